// Test-only kernels for tests/sim/test_tensor_ops.py: MSL 4 tensors and mpp::tensor_ops::matmul2d
// in the simulator (views, slices, transposes, dynamic K, cooperative tensors and their
// layouts, reductions, scope errors). Compiled as MSL 4 (the _msl4 suffix).
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

using namespace metal;
using namespace mpp::tensor_ops;

// Shapes of a test: the m x n output block, K, the leading dimensions (elements between rows of
// the row-major matrices as stored, or between columns for a transposed operand), the block's
// origin in the output (row0, col0), the whole output's rows and columns.
struct TensorArgs {
  int M;
  int N;
  int K;
  int lda;
  int ldb;
  int ldd;
  int row0;
  int col0;
};

// d[m x n] = a[M x K] @ b[K x N] (or transposed operands), straight between device tensors, one
// 32 x 32 block at (row0, col0) of a ragged matrix: dynamic extents edge-check every side.
template <typename T, bool kTL, bool kTR, int kSimdgroups>
[[kernel]] void tensor_mm_device(const device T* a [[buffer(0)]], const device T* b [[buffer(1)]],
                                 device float* d [[buffer(2)]],
                                 constant TensorArgs& p [[buffer(3)]]) {
  // Left: M x K, dims (K, M); transposed: stored K x M, dims (M, K).
  auto ta = kTL ? tensor<const device T, dextents<int32_t, 2>, tensor_inline>(
                      a, dextents<int32_t, 2>(p.M, p.K), array<int32_t, 2>({1, p.lda}))
                : tensor<const device T, dextents<int32_t, 2>, tensor_inline>(
                      a, dextents<int32_t, 2>(p.K, p.M), array<int32_t, 2>({1, p.lda}));
  auto tb = kTR ? tensor<const device T, dextents<int32_t, 2>, tensor_inline>(
                      b, dextents<int32_t, 2>(p.K, p.N), array<int32_t, 2>({1, p.ldb}))
                : tensor<const device T, dextents<int32_t, 2>, tensor_inline>(
                      b, dextents<int32_t, 2>(p.N, p.K), array<int32_t, 2>({1, p.ldb}));
  tensor<device float, dextents<int32_t, 2>, tensor_inline> td(
      d, dextents<int32_t, 2>(p.N, p.M), array<int32_t, 2>({1, p.ldd}));
  constexpr auto desc = matmul2d_descriptor(32, 32, dynamic_extent, kTL, kTR);
  matmul2d<desc, execution_simdgroups<kSimdgroups>> op;
  auto sa = kTL ? ta.slice(p.row0, 0) : ta.slice(0, p.row0);
  auto sb = kTR ? tb.slice(0, p.col0) : tb.slice(p.col0, 0);
  op.run(sa, sb, td.slice(p.col0, p.row0));
}

#define TENSOR_MM_DEVICE(name, T, tl, tr, sg)                            \
  template [[host_name(name)]] [[kernel]] decltype(tensor_mm_device<T, tl, tr, sg>) \
      tensor_mm_device<T, tl, tr, sg>;
TENSOR_MM_DEVICE("tensor_mm_device_nn_f16", half, false, false, 1)
TENSOR_MM_DEVICE("tensor_mm_device_nt_f16", half, false, true, 1)
TENSOR_MM_DEVICE("tensor_mm_device_tn_f16", half, true, false, 1)
TENSOR_MM_DEVICE("tensor_mm_device_tt_f16", half, true, true, 1)
TENSOR_MM_DEVICE("tensor_mm_device_nn_bf16", bfloat, false, false, 1)
TENSOR_MM_DEVICE("tensor_mm_device_nn_f32", float, false, false, 1)
TENSOR_MM_DEVICE("tensor_mm_device_nn_f16_sg4", half, false, false, 4)

// The same product into a cooperative destination, accumulated over K in steps of 16
// (multiply_accumulate, cleared first), written out through the index API: the portable way.
template <int kSimdgroups>
[[kernel]] void tensor_mm_coop(const device half* a [[buffer(0)]], const device half* b [[buffer(1)]],
                               device float* d [[buffer(2)]], constant TensorArgs& p [[buffer(3)]]) {
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> ta(
      a, dextents<int32_t, 2>(p.K, p.M), array<int32_t, 2>({1, p.lda}));
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> tb(
      b, dextents<int32_t, 2>(p.N, p.K), array<int32_t, 2>({1, p.ldb}));
  constexpr auto desc = matmul2d_descriptor(32, 32, 16, false, false, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<kSimdgroups>> op;
  auto acc = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  for (ushort i = 0; i < acc.get_capacity(); ++i) acc[i] = 0.0f;
  for (int k = 0; k < p.K; k += 16) op.run(ta.slice(k, p.row0), tb.slice(p.col0, k), acc);
  for (ushort i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto at = acc.get_multidimensional_index(i);
    const int row = p.row0 + at[1], col = p.col0 + at[0];
    if (row < p.M && col < p.N) d[row * p.ldd + col] = acc[i];
  }
}
template [[host_name("tensor_mm_coop")]] [[kernel]] decltype(tensor_mm_coop<1>) tensor_mm_coop<1>;
template [[host_name("tensor_mm_coop_sg4")]] [[kernel]] decltype(tensor_mm_coop<4>) tensor_mm_coop<4>;

// The same with a static-extent slice for the output and coop.store (and iterators to scale).
[[kernel]] void tensor_mm_coop_store(const device half* a [[buffer(0)]],
                                     const device half* b [[buffer(1)]],
                                     device float* d [[buffer(2)]],
                                     constant TensorArgs& p [[buffer(3)]]) {
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> ta(
      a, dextents<int32_t, 2>(p.K, p.M), array<int32_t, 2>({1, p.lda}));
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> tb(
      b, dextents<int32_t, 2>(p.N, p.K), array<int32_t, 2>({1, p.ldb}));
  tensor<device float, dextents<int32_t, 2>, tensor_inline> td(
      d, dextents<int32_t, 2>(p.N, p.M), array<int32_t, 2>({1, p.ldd}));
  constexpr auto desc = matmul2d_descriptor(32, 32);
  matmul2d<desc, execution_simdgroup> op;
  auto acc = op.get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  op.run(ta, tb, acc);
  for (auto it = acc.begin(); it != acc.end(); ++it) *it = *it * 2.0f;
  acc.store(td);
}

// The broken way: assumes slot i of lane l is element l * capacity + i (one row-major layout).
// Right for no layout the simulator draws; the test expects it to fail.
[[kernel]] void tensor_mm_coop_hardcoded(const device half* a [[buffer(0)]],
                                         const device half* b [[buffer(1)]],
                                         device float* d [[buffer(2)]],
                                         constant TensorArgs& p [[buffer(3)]],
                                         ushort lane [[thread_index_in_simdgroup]]) {
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> ta(
      a, dextents<int32_t, 2>(p.K, p.M), array<int32_t, 2>({1, p.lda}));
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> tb(
      b, dextents<int32_t, 2>(p.N, p.K), array<int32_t, 2>({1, p.ldb}));
  constexpr auto desc = matmul2d_descriptor(32, 32);
  matmul2d<desc, execution_simdgroup> op;
  auto acc = op.get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  op.run(ta, tb, acc);
  for (ushort i = 0; i < 32; ++i) {
    const int e = lane * 32 + i;
    d[(e / 32) * p.ldd + e % 32] = acc[i < acc.get_capacity() ? i : 0];
  }
}

// Uses the index API but forgets is_valid_element: invalid slots write garbage somewhere.
[[kernel]] void tensor_mm_coop_no_valid_check(const device half* a [[buffer(0)]],
                                              const device half* b [[buffer(1)]],
                                              device float* d [[buffer(2)]],
                                              constant TensorArgs& p [[buffer(3)]]) {
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> ta(
      a, dextents<int32_t, 2>(p.K, p.M), array<int32_t, 2>({1, p.lda}));
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> tb(
      b, dextents<int32_t, 2>(p.N, p.K), array<int32_t, 2>({1, p.ldb}));
  constexpr auto desc = matmul2d_descriptor(32, 32);
  matmul2d<desc, execution_simdgroup> op;
  auto acc = op.get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  op.run(ta, tb, acc);
  for (ushort i = 0; i < acc.get_capacity(); ++i) {
    const auto at = acc.get_multidimensional_index(i);
    d[at[1] * p.ldd + at[0]] = acc[i];
  }
}

// Row sums, row maxima (identity -INFINITY, or the default 0 when p.K < 0: the trap) and column
// sums of a 32 x 32 product: out[0..31] sums, [32..63] maxima, [64..95] column sums, written by
// the threads that hold them (reduction results are replicated: several write the same value),
// and rows[r] = sum through map_iterator from every destination element (each writes its own).
[[kernel]] void tensor_reduce(const device half* a [[buffer(0)]], const device half* b [[buffer(1)]],
                              device float* out [[buffer(2)]], constant TensorArgs& p [[buffer(3)]],
                              device float* by_element [[buffer(4)]]) {
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> ta(
      a, dextents<int32_t, 2>(p.K < 0 ? -p.K : p.K, 32), array<int32_t, 2>({1, p.lda}));
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> tb(
      b, dextents<int32_t, 2>(32, p.K < 0 ? -p.K : p.K), array<int32_t, 2>({1, p.ldb}));
  constexpr auto desc = matmul2d_descriptor(32, 32);
  matmul2d<desc, execution_simdgroup> op;
  auto acc = op.get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  op.run(ta, tb, acc);
  auto sums = op.get_row_reduction_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  auto maxima = op.get_row_reduction_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  auto cols = op.get_column_reduction_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  reduce_rows(acc, sums, reduction_operation::sum);
  if (p.K < 0) {
    reduce_rows(acc, maxima, reduction_operation::max);
  } else {
    reduce_rows(acc, maxima, reduction_operation::max, -INFINITY);
  }
  reduce_columns(acc, cols, reduction_operation::sum);
  tensor<device float, dextents<int32_t, 1>, tensor_inline> t_sums(out, dextents<int32_t, 1>(32));
  tensor<device float, dextents<int32_t, 1>, tensor_inline> t_max(out + 32, dextents<int32_t, 1>(32));
  tensor<device float, dextents<int32_t, 1>, tensor_inline> t_cols(out + 64, dextents<int32_t, 1>(32));
  sums.store(t_sums);
  maxima.store(t_max);
  cols.store(t_cols);
  for (auto it = acc.begin(); it != acc.end(); ++it) {
    const auto at = it.get_multidimensional_index();
    by_element[at[1] * 32 + at[0]] = *sums.map_iterator(it);
  }
}

// A cooperative left input loaded from a tensor (a threadgroup copy of a), then multiplied.
[[kernel]] void tensor_mm_coop_left(const device half* a [[buffer(0)]],
                                    const device half* b [[buffer(1)]],
                                    device float* d [[buffer(2)]],
                                    constant TensorArgs& p [[buffer(3)]]) {
  tensor<const device half, extents<int32_t, 16, 32>, tensor_inline> ta(
      a, extents<int32_t, 16, 32>(), array<int32_t, 2>({1, p.lda}));
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> tb(
      b, dextents<int32_t, 2>(32, 16), array<int32_t, 2>({1, p.ldb}));
  tensor<device float, dextents<int32_t, 2>, tensor_inline> td(
      d, dextents<int32_t, 2>(32, 32), array<int32_t, 2>({1, p.ldd}));
  constexpr auto desc = matmul2d_descriptor(32, 32, 16);
  matmul2d<desc, execution_simdgroup> op;
  auto left = op.get_left_input_cooperative_tensor<decltype(ta), decltype(tb), half>();
  left.load(ta);
  op.run(left, tb, td);
}

// Static extents past the edge: a 32 x 32 static slice of a ragged (M x K) left operand reads
// rows past M as poison (NaN), where a dynamic slice reads zeros.
[[kernel]] void tensor_mm_static_edge(const device half* a [[buffer(0)]],
                                      const device half* b [[buffer(1)]],
                                      device float* d [[buffer(2)]],
                                      constant TensorArgs& p [[buffer(3)]]) {
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> ta(
      a, dextents<int32_t, 2>(p.K, p.M), array<int32_t, 2>({1, p.lda}));
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> tb(
      b, dextents<int32_t, 2>(32, p.K), array<int32_t, 2>({1, p.ldb}));
  tensor<device float, extents<int32_t, 32, 32>, tensor_inline> td(
      d, extents<int32_t, 32, 32>(), array<int32_t, 2>({1, p.ldd}));
  constexpr auto desc = matmul2d_descriptor(32, 32, 32);
  matmul2d<desc, execution_simdgroup> op;
  op.run(ta.slice<32, 32>(0, 0), tb, td);
}

// Float operands with relaxed_precision (11-bit operands) or exact.
template <bool kRelaxed>
[[kernel]] void tensor_mm_f32(const device float* a [[buffer(0)]], const device float* b [[buffer(1)]],
                              device float* d [[buffer(2)]], constant TensorArgs& p [[buffer(3)]]) {
  tensor<const device float, dextents<int32_t, 2>, tensor_inline> ta(a, dextents<int32_t, 2>(p.K, 16));
  tensor<const device float, dextents<int32_t, 2>, tensor_inline> tb(b, dextents<int32_t, 2>(16, p.K));
  tensor<device float, dextents<int32_t, 2>, tensor_inline> td(d, dextents<int32_t, 2>(16, 16));
  constexpr auto desc = matmul2d_descriptor(16, 16, dynamic_extent, false, false, kRelaxed);
  matmul2d<desc, execution_simdgroup> op;
  op.run(ta, tb, td);
}
template [[host_name("tensor_mm_f32_exact")]] [[kernel]] decltype(tensor_mm_f32<false>) tensor_mm_f32<false>;
template [[host_name("tensor_mm_f32_relaxed")]] [[kernel]] decltype(tensor_mm_f32<true>) tensor_mm_f32<true>;

// Scope errors: p.K selects the fault. 1: only lanes < 16 call run (divergent); 2: lanes >= 16
// return first (missing threads); 3: simdgroup 0 and the others call run at different sites;
// 4: the threads pass different tensors. Otherwise every thread calls run once.
[[kernel]] void tensor_mm_scope(const device half* a [[buffer(0)]], const device half* b [[buffer(1)]],
                                device float* d [[buffer(2)]], constant TensorArgs& p [[buffer(3)]],
                                ushort lane [[thread_index_in_simdgroup]],
                                ushort sg [[simdgroup_index_in_threadgroup]]) {
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> ta(a, dextents<int32_t, 2>(16, 32));
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> tb(b, dextents<int32_t, 2>(32, 16));
  tensor<device float, dextents<int32_t, 2>, tensor_inline> td(d, dextents<int32_t, 2>(32, 32));
  matmul2d<matmul2d_descriptor(32, 32), execution_simdgroups<2>> op;
  const int fault = p.K;
  if (fault == 2 && lane >= 16) return;
  if (fault == 1) {
    if (lane < 16) op.run(ta, tb, td);
    return;
  }
  if (fault == 3) {
    // Two operations (the compiler may merge two identical calls into one).
    matmul2d<matmul2d_descriptor(32, 32, 16), execution_simdgroups<2>> other;
    if (sg == 0) {
      op.run(ta, tb, td);
    } else {
      other.run(ta, tb, td);
    }
    return;
  }
  if (fault == 4) {
    op.run(ta.slice(0, lane == 5 ? 1 : 0), tb, td);
    return;
  }
  op.run(ta, tb, td);
}

// An int32 element offset that wraps: a 1 x 3 column of a tensor with a row stride of 2^30
// elements (row 2 is 2^31 elements away and wraps negative): out of bounds.
[[kernel]] void tensor_offset_wrap(const device half* a [[buffer(0)]], device float* d [[buffer(2)]]) {
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> ta(
      a, dextents<int32_t, 2>(16, 3), array<int32_t, 2>({1, 1 << 30}));
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> tb(a, dextents<int32_t, 2>(16, 16));
  tensor<device float, dextents<int32_t, 2>, tensor_inline> td(d, dextents<int32_t, 2>(16, 16));
  matmul2d<matmul2d_descriptor(16, 16), execution_simdgroup> op;
  op.run(ta, tb, td);
}

// Dynamic K whose operands' K extents differ, as on the ragged last tile of P x V: the left is
// M x KL (its dims (KL, M)), the right KR x N (dims (N, KR)), both row-major device tensors.
struct RaggedKArgs {
  int M;
  int N;
  int KL;
  int KR;
};

[[kernel]] void tensor_mm_ragged_k(const device half* a [[buffer(0)]],
                                   const device half* b [[buffer(1)]],
                                   device float* d [[buffer(2)]],
                                   constant RaggedKArgs& p [[buffer(3)]]) {
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> ta(
      a, dextents<int32_t, 2>(p.KL, p.M), array<int32_t, 2>({1, p.KL}));
  tensor<const device half, dextents<int32_t, 2>, tensor_inline> tb(
      b, dextents<int32_t, 2>(p.N, p.KR), array<int32_t, 2>({1, p.N}));
  tensor<device float, dextents<int32_t, 2>, tensor_inline> td(
      d, dextents<int32_t, 2>(p.N, p.M), array<int32_t, 2>({1, p.N}));
  constexpr auto desc = matmul2d_descriptor(32, 32, dynamic_extent);
  matmul2d<desc, execution_simdgroups<1>> op;
  op.run(ta, tb, td);
}
