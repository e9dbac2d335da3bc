// The sanitizer-coverage callbacks, linked into every shader library (compiled without
// -fsanitize-coverage). Hidden, so that the shader code calls them directly rather than through
// the PLT; only accesses inside the device or threadgroup arena reach the runtime.
#include "sim/shader/callbacks.h"

#include <cstdio>
#include <cstring>

#include "sim/runtime.h"

namespace {

inline __attribute__((always_inline)) void check(void* p, size_t n, bool write, const void* pc,
                                                 size_t align = 0) {
  const SteelSimArenas& a = steel_sim_arenas;
  auto addr = reinterpret_cast<uintptr_t>(p);
  if (addr - a.dev_lo < a.dev_size || addr - a.tg_lo < a.tg_size) {
    if (align == 0) {
      steel_sim_access(p, n, write, pc);
    } else {
      steel_sim_access_aligned(p, n, align, write, pc);
    }
  }
}

// A range of bytes (a memcpy, memmove or memset): reported when either end is watched.
inline void range(const void* p, size_t n, bool write, const void* pc) {
  const SteelSimArenas& a = steel_sim_arenas;
  auto lo = reinterpret_cast<uintptr_t>(p);
  uintptr_t hi = lo + n - 1;
  if (lo - a.dev_lo < a.dev_size || lo - a.tg_lo < a.tg_size || hi - a.dev_lo < a.dev_size ||
      hi - a.tg_lo < a.tg_size) {
    steel_sim_access_range(p, n, write, pc);
  }
}

}  // namespace

extern "C" {

// The memory intrinsics of shader code (torch_steel/sim/ir.py redirects every llvm.memcpy,
// memmove and memset to a wrapper that calls this first): kind 1 copies from src, kind 0 fills.
__attribute__((visibility("hidden"))) void steel_sim_memop(void* dst, const void* src,
                                                           uint64_t n, int kind,
                                                           const void* pc) {
  if (n == 0) return;
  if (kind == 1) range(src, n, false, pc);
  range(dst, n, true, pc);
}

// A load or store declared less aligned than its size (torch_steel/sim/ir.py, underaligned,
// redirects its coverage callback here): checked against the alignment it was declared with.
__attribute__((visibility("hidden"))) void steel_sim_cov_access(void* p, uint64_t n,
                                                                uint64_t align, int write) {
  check(p, n, write != 0, __builtin_return_address(0), align);
}

// The hook at the entry of each counted basic block (torch_steel/sim/ir.py): one call and one
// compare when the launch does not count instructions.
__attribute__((visibility("hidden"))) void steel_sim_block(const uint32_t* histogram) {
  if (steel_sim_counting != 0) steel_sim_count_block(histogram);
}

#define STEEL_SIM_CALLBACKS(n)                                                     \
  __attribute__((visibility("hidden"))) void __sanitizer_cov_load##n(void* p) {  \
    check(p, n, false, __builtin_return_address(0));                             \
  }                                                                              \
  __attribute__((visibility("hidden"))) void __sanitizer_cov_store##n(void* p) { \
    check(p, n, true, __builtin_return_address(0));                              \
  }
STEEL_SIM_CALLBACKS(1)
STEEL_SIM_CALLBACKS(2)
STEEL_SIM_CALLBACKS(4)
STEEL_SIM_CALLBACKS(8)
STEEL_SIM_CALLBACKS(16)
#undef STEEL_SIM_CALLBACKS
}

// -fsanitize=float-cast-overflow: a float -> integer conversion of NaN or of a value outside the
// integer type's range is undefined in MSL (Apple GPUs saturate; x86 gives INT_MIN), so shader
// code must clamp first. clang calls these handlers (their layout is UBSan's ABI); a lane that
// does it fails with the shader line.
namespace {
struct UbsanType {
  uint16_t kind;  // 0 integer, 1 float
  uint16_t info;  // float: bit width; integer: (log2(bit width) << 1) | signed
  char name[1];
};
struct UbsanLocation {
  const char* file;
  uint32_t line;
  uint32_t column;
};
struct FloatCastData {
  UbsanLocation location;
  const UbsanType* from;
  const UbsanType* to;
};

[[noreturn]] void float_cast(void* data, uintptr_t value, const void* pc) {
  const auto* d = static_cast<const FloatCastData*>(data);
  char text[64] = "a value";
  if (d->from->kind == 1 && d->from->info == 32) {
    float f;
    uint32_t bits = static_cast<uint32_t>(value);
    std::memcpy(&f, &bits, sizeof f);
    snprintf(text, sizeof text, "%g", static_cast<double>(f));
  } else if (d->from->kind == 1 && d->from->info == 16) {
    _Float16 h;
    uint16_t bits = static_cast<uint16_t>(value);
    std::memcpy(&h, &bits, sizeof h);
    snprintf(text, sizeof text, "%g", static_cast<double>(static_cast<float>(h)));
  }
  char message[320];
  snprintf(message, sizeof message,
           "conversion of %s from %s to %s, which cannot represent it: undefined in MSL (Apple "
           "GPUs saturate, x86 does not); clamp before converting",
           text, d->from->name, d->to->name);
  steel_sim::fail_at(message, pc);
}

// -fsanitize=array-bounds: an index outside an array of known size (a thread-private array, a
// threadgroup array, an array member) is reported with the shader line.
struct OutOfBoundsData {
  UbsanLocation location;
  const UbsanType* array;
  const UbsanType* index;
};

[[noreturn]] void out_of_bounds(void* data, uintptr_t index, const void* pc) {
  const auto* d = static_cast<const OutOfBoundsData*>(data);
  const bool is_signed = (d->index->info & 1) != 0;
  const unsigned bits = 1u << (d->index->info >> 1);
  char text[48];
  if (is_signed) {
    int64_t v = static_cast<int64_t>(index);
    if (bits < 64) v = static_cast<int64_t>(index << (64 - bits)) >> (64 - bits);
    snprintf(text, sizeof text, "%lld", static_cast<long long>(v));
  } else {
    snprintf(text, sizeof text, "%llu", static_cast<unsigned long long>(index));
  }
  char message[320];
  snprintf(message, sizeof message, "index %s out of bounds of an array of type %s", text,
           d->array->name);
  steel_sim::fail_at(message, pc);
}
}  // namespace

extern "C" {
__attribute__((visibility("hidden"))) void __ubsan_handle_out_of_bounds(void* data,
                                                                         uintptr_t index) {
  out_of_bounds(data, index, __builtin_return_address(0));
}
__attribute__((visibility("hidden"))) void __ubsan_handle_out_of_bounds_abort(void* data,
                                                                               uintptr_t index) {
  out_of_bounds(data, index, __builtin_return_address(0));
}
__attribute__((visibility("hidden"))) void __ubsan_handle_float_cast_overflow(void* data,
                                                                               uintptr_t value) {
  float_cast(data, value, __builtin_return_address(0));
}
__attribute__((visibility("hidden"))) void __ubsan_handle_float_cast_overflow_abort(
    void* data, uintptr_t value) {
  float_cast(data, value, __builtin_return_address(0));
}
}
