// The includer of MLX's steel attention kernel (tests/sim/test_mlx_corpus.py): the headers
// come unmodified from the mlx-metal wheel (fetched at test time, bench/corpora.py); the
// instantiations below are the ones this test launches, with MLX's host names
// (steel_attention_<type>_bq.._bk.._bd.._wm.._wn.._mask<mask type>) and its host's tile
// (bq 32, bk 32 below head dim 128 and 16 from it, wm 4, wn 1).
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/attn/kernels/steel_attention.h"

#define STEEL_TEST_ATTENTION(tname, T, BK, D, mname, M)                                     \
  template [[host_name("steel_attention_" #tname "_bq32_bk" #BK "_bd" #D "_wm4_wn1_mask"   \
                       #mname)]] [[kernel]] decltype(attention<T, 32, BK, D, D, 4, 1, M,  \
                                                               float>)                     \
      attention<T, 32, BK, D, D, 4, 1, M, float>;

STEEL_TEST_ATTENTION(float32, float, 32, 64, float32, float)
STEEL_TEST_ATTENTION(float16, float16_t, 16, 128, float16, float16_t)
STEEL_TEST_ATTENTION(bfloat16, bfloat16_t, 32, 64, bool_, bool)
