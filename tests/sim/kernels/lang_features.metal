// Test-only kernel for tests/sim/test_translate_kernels.py: MSL as MLX-style steel code writes
// it (macros for constants and unrolling, nested namespaces, structs with const-thread methods,
// kernel attribute lists, the long instantiation form, fast:: math, simd reductions).
#include <metal_simdgroup>
#include <metal_stdlib>

using namespace metal;

#define STEEL_CONST static constant constexpr const
#define STEEL_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")

namespace mlx {
namespace steel {

template <typename T, short kWidth = 4>
struct RowSoftmax {
  STEEL_CONST short kVec = kWidth;
  STEEL_CONST float kLog2e = 1.44269504088896341;

  float row_max = -metal::numeric_limits<float>::infinity();
  float row_sum = 0.0;

  METAL_FUNC float scale() const thread { return kLog2e; }

  // Online softmax statistics of this lane's kVec values, then across the simdgroup.
  METAL_FUNC void update(const thread vec<T, kWidth>& v) thread {
    float m = row_max;
    STEEL_PRAGMA_UNROLL
    for (short i = 0; i < kVec; ++i) m = max(m, float(v[i]));
    m = simd_max(m);
    float s = 0;
    STEEL_PRAGMA_UNROLL
    for (short i = 0; i < kVec; ++i) s += fast::exp2((float(v[i]) - m) * scale());
    row_sum = row_sum * fast::exp2((row_max - m) * scale()) + simd_sum(s);
    row_max = m;
  }
};

}  // namespace steel
}  // namespace mlx

template <typename T>
[[kernel, max_total_threads_per_threadgroup(64)]] void lang_softmax_stats(
    const device T* x [[buffer(0)]], device float* out [[buffer(1)]],
    ushort simd_lane_id [[thread_index_in_simdgroup]], ushort simd_group_id
    [[simdgroup_index_in_threadgroup]]) {
  threadgroup vec<T, 4> staged[64];
  const uint row = simd_group_id;
  staged[row * 32 + simd_lane_id] = *((const device vec<T, 4>*)(x) + row * 32 + simd_lane_id);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  mlx::steel::RowSoftmax<T> stats;
  const vec<T, 4> mine = staged[row * 32 + simd_lane_id];  // a thread& cannot bind threadgroup
  stats.update(mine);
  if (simd_is_first()) {
    out[2 * row] = stats.row_max;
    out[2 * row + 1] = stats.row_sum;
  }
}

template [[host_name("lang_softmax_stats_f16")]] [[kernel]] void lang_softmax_stats<half>(
    const device half* x [[buffer(0)]], device float* out [[buffer(1)]],
    ushort simd_lane_id [[thread_index_in_simdgroup]],
    ushort simd_group_id [[simdgroup_index_in_threadgroup]]);
template [[host_name("lang_softmax_stats_f32")]] [[kernel]] void lang_softmax_stats<float>(
    const device float* x [[buffer(0)]], device float* out [[buffer(1)]],
    ushort simd_lane_id [[thread_index_in_simdgroup]],
    ushort simd_group_id [[simdgroup_index_in_threadgroup]]);
