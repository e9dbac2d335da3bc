// Test kernels: the matmul2d dQ and dmask blocks of the attention backward
// (shaders/steel/attn_tensor/backward_tensor.h) as shipped, finding each score's (key, row)
// with the cooperative tensor index API, and with an index that hard-codes a layout: slot i of
// thread t holds element 16 t + i in row-major order (each thread a run of one row, as
// some GPU's layout might be). The simulator draws the layouts at random per seed, so the second
// must fail under every seed.
#include <metal_stdlib>

#include "steel/attn_tensor/backward_tensor.h"

using namespace metal;
using namespace steel;

struct LayoutAssumingIndex {
  template <typename Coop>
  static array<int, 2> at(thread const Coop& c, ushort i, ushort thread_index) {
    constexpr int kElements = STEEL_ATTN_TENSOR_BQ * STEEL_ATTN_TENSOR_BK;
    constexpr int kPerThread = kElements / (32 * STEEL_ATTN_TENSOR_SIMDGROUPS);
    const int e = (int(thread_index) * kPerThread + int(i)) % kElements;  // the assumption
    return array<int, 2>({e % STEEL_ATTN_TENSOR_BK, e / STEEL_ATTN_TENSOR_BK});
  }
};

template <typename T, short D, typename Index>
[[kernel]] void attention_bwd_tensor_dq_test(
    const device T* q [[buffer(STEEL_ATTN_BUF_Q)]], const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
    const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
    const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
    const device T* grad_out [[buffer(STEEL_ATTN_BUF_GRAD_OUT)]],
    const device float* lse [[buffer(STEEL_ATTN_BUF_FWD_LSE)]],
    const device float* delta [[buffer(STEEL_ATTN_BUF_DELTA)]],
    device T* dq [[buffer(STEEL_ATTN_BUF_DQ)]],
    constant AttnBackwardParams& params [[buffer(STEEL_ATTN_BUF_BWD_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort thread_index [[thread_index_in_threadgroup]]) {
  threadgroup T ds_mem[STEEL_ATTN_TENSOR_BQ * STEEL_ATTN_TENSOR_BK];
  threadgroup float stats[3 * STEEL_ATTN_TENSOR_BQ];
  attention_bwd_tensor_dq_block<T, D, Index>(q, k, v, mask, grad_out, lse, delta, dq, nullptr,
                                             nullptr, params, ds_mem, stats, tg, thread_index);
}

template [[host_name("attention_bwd_tensor_dq_index_api")]] [[kernel]]
decltype(attention_bwd_tensor_dq_test<half, 64, AttnTensorIndex>)
    attention_bwd_tensor_dq_test<half, 64, AttnTensorIndex>;
template [[host_name("attention_bwd_tensor_dq_layout_assumed")]] [[kernel]]
decltype(attention_bwd_tensor_dq_test<half, 64, LayoutAssumingIndex>)
    attention_bwd_tensor_dq_test<half, 64, LayoutAssumingIndex>;

template <typename T, short D, typename Index>
[[kernel]] void attention_bwd_tensor_dmask_test(
    const device T* q [[buffer(STEEL_ATTN_BUF_Q)]], const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
    const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
    const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
    const device T* grad_out [[buffer(STEEL_ATTN_BUF_GRAD_OUT)]],
    const device float* lse [[buffer(STEEL_ATTN_BUF_FWD_LSE)]],
    const device float* delta [[buffer(STEEL_ATTN_BUF_DELTA)]],
    device uchar* dmask [[buffer(STEEL_ATTN_BUF_DMASK)]],
    constant AttnBackwardParams& params [[buffer(STEEL_ATTN_BUF_BWD_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    ushort thread_index [[thread_index_in_threadgroup]]) {
  threadgroup float red[STEEL_ATTN_TENSOR_BQ * STEEL_ATTN_TENSOR_BK];
  threadgroup float stats[3 * STEEL_ATTN_TENSOR_BQ];
  attention_bwd_tensor_dmask_block<T, D, Index>(q, k, v, mask, grad_out, lse, delta, dmask,
                                                params, red, stats, tg, thread_index);
}

template [[host_name("attention_bwd_tensor_dmask_index_api")]] [[kernel]]
decltype(attention_bwd_tensor_dmask_test<half, 64, AttnTensorIndex>)
    attention_bwd_tensor_dmask_test<half, 64, AttnTensorIndex>;
template [[host_name("attention_bwd_tensor_dmask_layout_assumed")]] [[kernel]]
decltype(attention_bwd_tensor_dmask_test<half, 64, LayoutAssumingIndex>)
    attention_bwd_tensor_dmask_test<half, 64, LayoutAssumingIndex>;
