// The includer of MLX's one-pass vector attention kernel (tests/sim/test_mlx_corpus.py): the
// header comes unmodified from the mlx-metal wheel (fetched at test time, bench/corpora.py);
// the instantiations below are the ones this test launches, named as MLX's host names them
// (sdpa_vector_<type>_<D>_<V>), written the way MLX's .metal files instantiate its templates.
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/sdpa_vector.h"

#define STEEL_TEST_SDPA_VECTOR(tname, T, D)                                            \
  template [[host_name("sdpa_vector_" #tname "_" #D "_" #D)]] [[kernel]] decltype( \
      sdpa_vector<T, D, D>) sdpa_vector<T, D, D>;

STEEL_TEST_SDPA_VECTOR(float, float, 64)
STEEL_TEST_SDPA_VECTOR(float16_t, float16_t, 128)
STEEL_TEST_SDPA_VECTOR(bfloat16_t, bfloat16_t, 64)
