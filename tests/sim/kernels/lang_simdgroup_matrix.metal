// Test-only kernels for tests/sim/test_simdgroup_matrix.py: the fragment map, simdgroup_load /
// simdgroup_store (elements_per_row, matrix_origin, transpose_matrix) from device and
// threadgroup memory, and simdgroup_multiply_accumulate with mixed types.
#include <metal_stdlib>

using namespace metal;

// Each lane writes (lane, 0) and (lane, 1) into its two elements; the store shows where they go.
[[kernel]] void lang_fragment_map(device float* out [[buffer(0)]],
                                  ushort lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  m.thread_elements()[0] = float(lane * 2);
  m.thread_elements()[1] = float(lane * 2 + 1);
  simdgroup_store(m, out, 8);
}

struct LoadStoreArgs {
  uint src_per_row;
  uint src_x;
  uint src_y;
  uint src_transpose;
  uint dst_per_row;
  uint dst_x;
  uint dst_y;
  uint dst_transpose;
};

// One 8x8 matrix from src to dst, straight from device memory.
template <typename T>
[[kernel]] void lang_load_store(const device T* src [[buffer(0)]], device T* dst [[buffer(1)]],
                                constant LoadStoreArgs& p [[buffer(2)]]) {
  simdgroup_matrix<T, 8, 8> m;
  simdgroup_load(m, src, p.src_per_row, ulong2(p.src_x, p.src_y), p.src_transpose != 0);
  simdgroup_store(m, dst, p.dst_per_row, ulong2(p.dst_x, p.dst_y), p.dst_transpose != 0);
}

// The same through threadgroup memory: src (n elements) is staged into threadgroup memory, the
// matrix goes from one threadgroup array to another, and that one is copied out to dst.
template <typename T>
[[kernel]] void lang_load_store_tg(const device T* src [[buffer(0)]], device T* dst [[buffer(1)]],
                                   constant LoadStoreArgs& p [[buffer(2)]],
                                   constant uint& n [[buffer(3)]],
                                   ushort lane [[thread_index_in_simdgroup]]) {
  threadgroup T staged[512];
  threadgroup T result[512];
  for (uint i = lane; i < n; i += 32) {
    staged[i] = src[i];
    result[i] = dst[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<T, 8, 8> m;
  simdgroup_load(m, staged, p.src_per_row, ulong2(p.src_x, p.src_y), p.src_transpose != 0);
  simdgroup_store(m, result, p.dst_per_row, ulong2(p.dst_x, p.dst_y), p.dst_transpose != 0);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = lane; i < n; i += 32) dst[i] = result[i];
}

#define LOAD_STORE(tname, T)                                                           \
  template [[host_name("lang_load_store_" #tname)]] [[kernel]]                         \
  decltype(lang_load_store<T>) lang_load_store<T>;                                     \
  template [[host_name("lang_load_store_tg_" #tname)]] [[kernel]]                      \
  decltype(lang_load_store_tg<T>) lang_load_store_tg<T>;

LOAD_STORE(f16, half)
LOAD_STORE(bf16, bfloat)
LOAD_STORE(f32, float)

// d = a * b + c (or a * b), each operand an 8x8 row-major matrix in device memory; `alias` makes
// the accumulator the destination (simdgroup_multiply_accumulate(c, a, b, c)).
template <typename TD, typename TA, typename TB, typename TC>
[[kernel]] void lang_mma(const device TA* a [[buffer(0)]], const device TB* b [[buffer(1)]],
                         const device TC* c [[buffer(2)]], device TD* d [[buffer(3)]],
                         constant uint& mode [[buffer(4)]]) {
  simdgroup_matrix<TA, 8, 8> ma;
  simdgroup_matrix<TB, 8, 8> mb;
  simdgroup_matrix<TC, 8, 8> mc;
  simdgroup_matrix<TD, 8, 8> md;
  simdgroup_load(ma, a);
  simdgroup_load(mb, b);
  simdgroup_load(mc, c);
  if (mode == 0) {
    simdgroup_multiply_accumulate(md, ma, mb, mc);
  } else {
    simdgroup_multiply(md, ma, mb);
  }
  simdgroup_store(md, d);
}

// The accumulator is also the destination.
template <typename T>
[[kernel]] void lang_mma_inplace(const device T* a [[buffer(0)]], const device T* b [[buffer(1)]],
                                 device float* c [[buffer(2)]]) {
  simdgroup_matrix<T, 8, 8> ma;
  simdgroup_matrix<T, 8, 8> mb;
  simdgroup_float8x8 acc;
  simdgroup_load(ma, a);
  simdgroup_load(mb, b);
  simdgroup_load(acc, c);
  simdgroup_multiply_accumulate(acc, ma, mb, acc);
  simdgroup_multiply_accumulate(acc, ma, mb, acc);
  simdgroup_store(acc, c);
}

#define MMA(name, TD, TA, TB, TC)                                                      \
  template [[host_name("lang_mma_" #name)]] [[kernel]] decltype(lang_mma<TD, TA, TB, TC>) \
  lang_mma<TD, TA, TB, TC>;

MMA(f32_f16_f16_f32, float, half, half, float)
MMA(f32_bf16_bf16_f32, float, bfloat, bfloat, float)
MMA(f32_f32_f32_f32, float, float, float, float)
MMA(f16_f16_f16_f16, half, half, half, half)
MMA(bf16_bf16_bf16_bf16, bfloat, bfloat, bfloat, bfloat)
MMA(f16_f16_f16_f32, half, half, half, float)
MMA(f32_f16_f32_f16, float, half, float, half)

template [[host_name("lang_mma_inplace_f16")]] [[kernel]] decltype(lang_mma_inplace<half>)
    lang_mma_inplace<half>;

// A diagonal matrix (simdgroup_matrix(d)) and a filled one, stored.
[[kernel]] void lang_matrix_init(device float* out [[buffer(0)]]) {
  simdgroup_float8x8 diag(2.5f);
  simdgroup_float8x8 filled = make_filled_simdgroup_matrix<float, 8, 8>(-1.0f);
  simdgroup_store(diag, out, 8);
  simdgroup_store(filled, out + 64, 8);
}

// Lanes past `active` exit before the multiply: the simulator must report it.
[[kernel]] void lang_mma_after_exit(device float* out [[buffer(0)]],
                                    constant uint& active [[buffer(1)]],
                                    ushort lane [[thread_index_in_simdgroup]]) {
  if (lane >= active) return;
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  simdgroup_multiply_accumulate(m, m, m, m);
  simdgroup_store(m, out, 8);
}

// simdgroup_load / simdgroup_store with arguments that differ between lanes when `split` < 32
// (lanes >= split pass another pointer, stride, origin or transpose flag, as `what` says).
[[kernel]] void lang_matrix_lane_args(const device float* src [[buffer(0)]],
                                      device float* dst [[buffer(1)]],
                                      constant uint2& p [[buffer(2)]],
                                      ushort lane [[thread_index_in_simdgroup]]) {
  const bool other = lane >= p.y;
  const uint what = p.x;
  const device float* s = src + (what == 0 && other ? 1 : 0);
  const ulong per_row = what == 1 && other ? 9 : 8;
  const ulong2 origin = ulong2(what == 2 && other ? 1 : 0, 0);
  const bool transpose = what == 3 && other;
  simdgroup_float8x8 m;
  simdgroup_load(m, s, per_row, origin, transpose);
  device float* d = dst + (what == 4 && other ? 1 : 0);
  simdgroup_store(m, d, 8);
}

// An accumulator the kernel forgets to clear: uninitialized on the GPU, NaN here.
[[kernel]] void lang_uninitialized_acc(const device float* a [[buffer(0)]],
                                       device float* out [[buffer(1)]],
                                       uint tg [[threadgroup_position_in_grid]]) {
  simdgroup_float8x8 ma;
  simdgroup_float8x8 acc;
  simdgroup_load(ma, a);
  simdgroup_multiply_accumulate(acc, ma, ma, acc);
  simdgroup_store(acc, out + 64 * tg);
}

// Lanes past `active` exit before a simdgroup_load (what = 0) or simdgroup_store (what = 1).
[[kernel]] void lang_load_store_after_exit(device float* out [[buffer(0)]],
                                           constant uint2& p [[buffer(1)]],
                                           ushort lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  if (p.x == 1) simdgroup_load(m, out + 64);
  if (lane >= p.y) return;
  if (p.x == 0) simdgroup_load(m, out + 64);
  simdgroup_store(m, out, 8);
}
