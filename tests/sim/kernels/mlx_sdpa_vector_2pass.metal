// The includer of MLX's two-pass vector attention kernels (tests/sim/test_mlx_corpus.py): the
// header comes unmodified from the mlx-metal wheel (fetched at test time, bench/corpora.py);
// the instantiations below are the ones this test launches, named as MLX's host names them
// (sdpa_vector_2pass_1_<type>_<D>_<V>, sdpa_vector_2pass_2_<type>_<V>), written the way MLX's
// scaled_dot_product_attention.metal instantiates its templates (TK keeps its default).
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/sdpa_vector.h"

#define STEEL_TEST_SDPA_VECTOR_2PASS(tname, T, D)                                          \
  template [[host_name("sdpa_vector_2pass_1_" #tname "_" #D "_" #D)]] [[kernel]] decltype( \
      sdpa_vector_2pass_1<T, D, D>) sdpa_vector_2pass_1<T, D, D>;                          \
  template [[host_name("sdpa_vector_2pass_2_" #tname "_" #D)]] [[kernel]] decltype(        \
      sdpa_vector_2pass_2<T, D>) sdpa_vector_2pass_2<T, D>;

STEEL_TEST_SDPA_VECTOR_2PASS(float16_t, float16_t, 128)
STEEL_TEST_SDPA_VECTOR_2PASS(bfloat16_t, bfloat16_t, 64)
