// The includer of MLX's steel GEMM kernel (tests/sim/test_mlx_corpus.py): the headers come
// unmodified from the mlx-metal wheel (fetched at test time, bench/corpora.py); the
// instantiations below are the ones this test launches, with MLX's host names
// (steel_gemm_fused_<t|n><t|n>_<in>_<out>_bm.._bn.._bk.._wm.._wn..) and the tile of its
// host's small-problem branch (bm = bn = 32, bk = 16, wm = wn = 2).
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/gemm/gemm.h"
#include "mlx/backend/metal/kernels/steel/gemm/kernels/steel_gemm_fused.h"

#define STEEL_TEST_GEMM(tr, tname, T, ta, tb)                                            \
  template [[host_name("steel_gemm_fused_" #tr "_" #tname "_" #tname                    \
                       "_bm32_bn32_bk16_wm2_wn2")]] [[kernel]] decltype(                \
      gemm<T, 32, 32, 16, 2, 2, ta, tb, float>) gemm<T, 32, 32, 16, 2, 2, ta, tb, float>;

STEEL_TEST_GEMM(nn, float32, float, false, false)
STEEL_TEST_GEMM(nt, float16, float16_t, false, true)
STEEL_TEST_GEMM(tn, bfloat16, bfloat16_t, true, false)
