// The includer of PyTorch's decode attention kernels (tests/sim/test_pytorch_corpus.py): the
// header comes unmodified from the installed torch wheel (torch/include) and expects its
// includer to provide <metal_stdlib> and `using namespace metal`, as PyTorch's Attention.metal
// does.
#include <c10/metal/utils.h>
#include <metal_simdgroup>
#include <metal_stdlib>

using namespace metal;
#include <ATen/native/mps/kernels/DecodeAttention.h>
