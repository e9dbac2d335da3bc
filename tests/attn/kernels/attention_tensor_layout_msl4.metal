// Test kernels: the matmul2d attention prefill (shaders/steel/attn_tensor/forward_tensor.h) as
// shipped, and with an online softmax that hard-codes one fact of a layout: that every score a
// thread holds lies in the row of its first row-reduction slot (each thread holding a segment
// of one row, as some GPU's layout might), where the shipped one asks map_iterator. The
// simulator draws the layouts at random per seed, so the second must fail under every seed.
#include <metal_stdlib>

#include "steel/attn_tensor/forward_tensor.h"

using namespace metal;
using namespace steel;

template <typename T, short DE, short DV>
struct LayoutAssumingSoftmax : OnlineSoftmaxTensor<T, DE, DV> {
  using A = AttnTensor<T, DE, DV>;

  void update(thread typename A::Scores& s, thread typename A::Rows& factor) {
    thread typename A::Rows& m = this->m;
    thread typename A::Rows& l = this->l;
    typename A::Rows shift;
    reduce_rows(s, shift, mpp::tensor_ops::reduction_operation::max, -INFINITY);
    ushort first = 0;
    for (ushort i = 0; i < shift.get_capacity(); ++i) {
      if (!shift.is_valid_element(i)) continue;
      if (!shift.is_valid_element(first)) first = i;
      const float m_new = max(m[i], shift[i]);
      const float sub = m_new == -INFINITY ? 0.0f : m_new;
      factor[i] = exp2((m[i] - sub) * attn_exp_unit);
      m[i] = m_new;
      shift[i] = sub;
    }
    for (auto it = s.begin(); it != s.end(); ++it) {
      *it = exp2((*it - shift[first]) * attn_exp_unit);  // the assumption
    }
    typename A::Rows sum;
    reduce_rows(s, sum, mpp::tensor_ops::reduction_operation::sum, 0.0f);
    for (ushort i = 0; i < l.get_capacity(); ++i) {
      if (l.is_valid_element(i)) l[i] = l[i] * factor[i] + sum[i];
    }
  }
};

template <typename T, short DE, short DV, typename Softmax>
[[kernel]] void attention_tensor_test(const device T* q [[buffer(STEEL_ATTN_BUF_Q)]],
                                      const device T* k [[buffer(STEEL_ATTN_BUF_K)]],
                                      const device T* v [[buffer(STEEL_ATTN_BUF_V)]],
                                      const device uchar* mask [[buffer(STEEL_ATTN_BUF_MASK)]],
                                      const device uchar* sinks [[buffer(STEEL_ATTN_BUF_SINKS)]],
                                      device T* out [[buffer(STEEL_ATTN_BUF_OUT)]],
                                      device float* lse [[buffer(STEEL_ATTN_BUF_LSE)]],
                                      constant AttnParams& params
                                      [[buffer(STEEL_ATTN_BUF_PARAMS)]],
                                      uint3 tg [[threadgroup_position_in_grid]]) {
  threadgroup T p_mem[STEEL_ATTN_TENSOR_BQ * STEEL_ATTN_TENSOR_BK];
  threadgroup float row_mem[STEEL_ATTN_TENSOR_BQ];
  attention_tensor_block<T, DE, DV, Softmax>(q, k, v, mask, sinks, out, lse, nullptr, nullptr,
                                             params, p_mem, row_mem, tg);
}

template [[host_name("attention_tensor_index_api")]] [[kernel]]
decltype(attention_tensor_test<half, 64, 64, OnlineSoftmaxTensor<half, 64, 64>>)
    attention_tensor_test<half, 64, 64, OnlineSoftmaxTensor<half, 64, 64>>;
template [[host_name("attention_tensor_layout_assumed")]] [[kernel]]
decltype(attention_tensor_test<half, 64, 64, LayoutAssumingSoftmax<half, 64, 64>>)
    attention_tensor_test<half, 64, 64, LayoutAssumingSoftmax<half, 64, 64>>;
