// Memory of a launch and the checkers that watch it.
//
// Shader TUs are compiled with -fsanitize-coverage=func,trace-loads,trace-stores, so every load
// and store they make calls __sanitizer_cov_load<N>/__sanitizer_cov_store<N> below, before the
// access. Two address ranges matter; everything else (the lane's own stack, i.e. `thread`
// memory) returns after two compares:
//
// - The device arena. Every binding of the dispatch is copied into its own region of a fresh
//   mapping, regions separated by guard gaps at least as large as the region (64 KiB to 64 MiB),
//   so an access just outside a buffer lands in a gap rather than in a neighbour. Any access
//   inside the arena but not inside a bound region is an out-of-bounds error naming the buffer
//   index and the byte offset from that buffer's start. Bindings whose host memory overlaps (the
//   same tensor bound twice) share one region, as they share memory on the GPU. Bytes read and
//   written are counted per binding.
//
// - The threadgroup arena: [16 KiB guard][32 KiB][32 KiB guard]. [[threadgroup(i)]] arguments
//   are laid out first, in index order, then `threadgroup` arrays declared in kernel bodies as the
//   lanes first reach them. Accesses outside what is allocated are out-of-bounds errors. Memory is
//   filled with 0xFF bytes (NaN for half, bfloat and float) when a threadgroup starts, as it is
//   uninitialized on the GPU.
//
// Device races. Threadgroups of one dispatch are not ordered: with the checkers on, each tensor
// region has a shadow recording, per byte, the threadgroup that wrote it in this dispatch, and a
// write or read of it by another threadgroup is an error. (Device-scope atomics, which could
// order them, are not loads or stores and are not checked.)
//
// Race rule. Two accesses to the same threadgroup-memory byte by different lanes, at least one a
// write, race unless a threadgroup_barrier with mem_threadgroup completed between them, or the
// lanes belong to the same simdgroup and a simdgroup_barrier with mem_threadgroup completed
// between them (MSL: nothing else makes a write visible, not lockstep execution nor a simd
// operation). One more order, for reads: the reads a lane made before a collective that combined
// lanes' values (runtime.cpp: combines_lanes) in which it took part are ordered before the later
// accesses of that collective's lanes, since those depend on the reads through it
// (collective_orders). The shadow keeps per byte the last write and the latest reads with their
// threadgroup and simd epochs, which decides this exactly for the last writer and conservatively
// for many readers (never inventing a race across a barrier; reporting one that only a
// collective of part of the simdgroup would order).
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>

#include "state.h"

namespace steel_sim {
namespace detail {

namespace {

constexpr size_t kTgGuardLo = 16 * 1024;
constexpr size_t kTgGuardHi = 32 * 1024;
// Threadgroup allocations are laid out with a gap after each, as large as the allocation (at
// least 64 bytes), so that an index past one allocation lands in a gap instead of the next one
// (Metal counts only the allocations themselves against the 32 KiB).
constexpr size_t kTgSpan = 4 * kThreadgroupLimit;
constexpr uint32_t kTgMinGap = 64;
constexpr size_t kMinGap = 64 * 1024;
// What both PyTorch's CPU allocator and Metal's buffers guarantee at least.
constexpr size_t kHostAlignment = 64;
constexpr size_t kMaxGap = 64 * 1024 * 1024;

std::string fmt(const char* f, unsigned long long a, unsigned long long b = 0,
                unsigned long long c = 0, unsigned long long d = 0) {
  char buf[256];
  snprintf(buf, sizeof buf, f, a, b, c, d);
  return buf;
}

// The race rule on one shadowed byte (threadgroup or device memory of the running threadgroup)
// for an access by `lane` of simdgroup `sg`, whose memory epochs are `s` (its simdgroup's) and
// `e` (the threadgroup's). Returns kOrdered, or the lane it races with (>= 0), or kManyReaders
// (one of several readers, not recorded which); records the access.
constexpr int kOrdered = -1;
constexpr int kManyReaders = -2;
// (A read by lane l that conflicts is returned as -100 - l.)

// Whether a collective that combined values across lanes ordered the recorded reads of a byte
// (all in `me`'s simdgroup) before `me`'s access: every lane of the simdgroup took part in one
// after the latest read, or, with a single recorded reader, that reader and `me` did.
inline bool collective_orders(const Shadow& sh, const Lane& me) {
  if (g.groups[me.sg].all_met > sh.r_xstamp) return true;
  return !(sh.r_flags & kReadersManyLanes) && me.met[sh.r_lane % kSimdWidth] > sh.r_xstamp;
}

inline int order(Shadow& sh, const Lane& me, uint32_t s, uint32_t e, bool write) {
  const uint32_t lane = me.index;
  const uint32_t sg = me.sg;
  // The last write conflicts unless it is ours or ordered by a barrier.
  if (sh.w_epoch == e && sh.w_lane != lane &&
      (sh.w_lane / kSimdWidth != sg || sh.w_sepoch == s)) {
    return sh.w_lane;
  }
  if (write) {
    if (sh.r_epoch == e) {
      bool other_sg = (sh.r_flags & kReadersManySimdgroups) || sh.r_lane / kSimdWidth != sg;
      bool same_step = sh.r_sepoch == s &&
                       (sh.r_lane != lane || (sh.r_flags & kReadersManyLanes)) &&
                       !collective_orders(sh, me);
      if (other_sg || same_step) return sh.r_lane == lane ? kManyReaders : -100 - int(sh.r_lane);
    }
    sh.w_epoch = e;
    sh.w_sepoch = s;
    sh.w_lane = static_cast<uint16_t>(lane);
  } else if (sh.r_epoch != e) {
    sh.r_epoch = e;
    sh.r_sepoch = s;
    sh.r_lane = static_cast<uint16_t>(lane);
    sh.r_flags = 0;
  } else if (sh.r_lane / kSimdWidth != sg) {
    sh.r_flags = kReadersManySimdgroups;
    sh.r_sepoch = s;
    sh.r_lane = static_cast<uint16_t>(lane);
  } else if (sh.r_sepoch != s) {
    sh.r_sepoch = s;
    sh.r_lane = static_cast<uint16_t>(lane);
    sh.r_flags &= kReadersManySimdgroups;
  } else if (sh.r_lane != lane) {
    sh.r_flags |= kReadersManyLanes;
  }
  if (!write) sh.r_xstamp = g.simd_epochs;
  return kOrdered;
}

// Decodes order()'s result for a message: the other lane (-1: one of several readers) and
// whether it wrote.
inline void other_access(int r, int* other_lane, bool* other_wrote) {
  if (r >= 0) {
    *other_lane = r;
    *other_wrote = true;
  } else if (r == kManyReaders) {
    *other_lane = -1;
    *other_wrote = false;
  } else {
    *other_lane = -100 - r;
    *other_wrote = false;
  }
}

// ----------------------------------------------------------------------------- device memory

struct Region {
  uintptr_t host_lo = 0;
  uintptr_t host_hi = 0;
  uintptr_t arena_lo = 0;
  bool write_back = false;
  DevShadow race;  // its arrays are mapped for tensor regions, with checkers
};

char* g_arena = nullptr;
size_t g_arena_bytes = 0;
std::vector<Region> g_regions;
// After the regions, one poison slot per buffer index for buffers disabled by a function
// constant (runtime.h: disabled_buffer), each followed by a gap as large. A dead read through such
// a parameter (a params struct read before the branch that a false constant removes) is
// usually small; 256 KiB also covers per-thread reads of a modest grid.
constexpr size_t kPoisonBytes = 256 * 1024;
size_t g_poison_offset = 0;

size_t gap_for(size_t bytes) {
  size_t gap = std::min(std::max(bytes, kMinGap), kMaxGap);
  return (gap + 4095) & ~size_t{4095};
}

[[noreturn]] void device_oob(uintptr_t a, size_t n, bool write) {
  // Blame the nearest buffer, with the offset from its start (negative before it).
  const DeviceBuffer* best = nullptr;
  uintptr_t best_dist = ~uintptr_t{0};
  for (const DeviceBuffer& b : g.dev) {
    uintptr_t dist = a < b.lo ? b.lo - a : (a >= b.hi ? a - b.hi : 0);
    if (dist < best_dist) {
      best_dist = dist;
      best = &b;
    }
  }
  const char* op = write ? "write" : "read";
  char buf[320];
  if (best != nullptr && best->disabled) {
    snprintf(buf, sizeof buf,
             "out-of-bounds device %s of %zu bytes at byte offset %lld of [[buffer(%u)]], which "
             "%s (the simulator backs it with %zu bytes of poison so that reads whose value is "
             "unused do not fault)",
             op, n, static_cast<long long>(a) - static_cast<long long>(best->lo), best->index,
             absent_reason(*best), kPoisonBytes);
    lane_fail(buf, g.access_pc);
  }
  if (best == nullptr) {
    snprintf(buf, sizeof buf, "out-of-bounds device %s of %zu bytes (no buffer is bound)", op, n);
    lane_fail(buf, g.access_pc);
  }
  long long offset = static_cast<long long>(a) - static_cast<long long>(best->lo);
  snprintf(buf, sizeof buf,
           "out-of-bounds device %s of %zu bytes at byte offset %lld of [[buffer(%u)]] "
           "(%llu bytes bound)",
           op, n, offset, best->index, static_cast<unsigned long long>(best->hi - best->lo));
  lane_fail(buf, g.access_pc);
}

// A vector or scalar of 2, 4, 8 or 16 bytes must sit at a multiple of its type's alignment in
// device memory (MSL: pointers are aligned to their type), which is its size unless the type
// says less (`align` < n: a struct declared alignas(2) of 8 bytes, which the compiler loads in
// pieces). x86 forgives a misaligned load; an Apple GPU may read the wrong bytes. Addresses here
// keep the real binding's alignment (bind_device).
void check_alignment(const DeviceBuffer& b, uintptr_t a, size_t n, bool write, size_t align) {
  size_t need = align < n ? align : n;
  if ((need & (need - 1)) != 0 || need > 16 || a % need == 0) return;
  char buf[256];
  snprintf(buf, sizeof buf,
           "misaligned device %s of %zu bytes at byte offset %lld of [[buffer(%u)]] (address "
           "%% %zu = %llu): Metal needs %zu-byte accesses %zu-byte aligned",
           write ? "write" : "read", n, static_cast<long long>(a - b.lo), b.index, need,
           static_cast<unsigned long long>(a % need), need, need);
  lane_fail(buf, g.access_pc);
}

std::string threadgroup_name(uint32_t tg_id) {
  uint32_t i = tg_id - 1;
  return fmt("(%llu,%llu,%llu)", i % g.grid[0], i / g.grid[0] % g.grid[1],
             i / g.grid[0] / g.grid[1]);
}

[[noreturn]] void device_race(const DeviceBuffer& b, uintptr_t a, bool write, int r) {
  int other;
  bool wrote;
  other_access(r, &other, &wrote);
  char who[64] = "another thread";
  if (other >= 0) snprintf(who, sizeof who, "thread %d (simdgroup %d)", other, other / 32);
  uint32_t me = g.cur->index;
  char buf[400];
  snprintf(buf, sizeof buf,
           "data race on device memory (byte offset %lld of [[buffer(%u)]]): thread %u "
           "(simdgroup %u) %s it after %s of its threadgroup %s it with no "
           "threadgroup_barrier(mem_device) between",
           static_cast<long long>(a - b.lo), b.index, me, me / kSimdWidth,
           write ? "writes" : "reads", who, wrote ? "wrote" : "read");
  lane_fail(buf, g.access_pc);
}

// Races on device memory. Threadgroups of one dispatch run in no guaranteed order, and nothing
// but device-scope atomics (not instrumented, so not checked) orders them: a byte written by one
// threadgroup and written or read by another in the same dispatch is a race. Within a
// threadgroup, lanes are ordered as for threadgroup memory, by barriers with mem_device.
void check_device_race(const DeviceBuffer& b, uintptr_t a, size_t n, bool write) {
  DevShadow& race = *b.race;
  const size_t first = b.race_offset + (a - b.lo);
  uint32_t* tg = race.tg + first;
  Shadow* in_tg = race.in_tg + first;
  const Lane* me = g.cur;
  for (size_t i = 0; i < n; ++i) {
    if (tg[i] != 0 && tg[i] != g.tg_id) {
      char buf[320];
      snprintf(buf, sizeof buf,
               "device memory race: %s byte offset %lld of [[buffer(%u)]], which threadgroup %s "
               "wrote in the same dispatch (threadgroups are not ordered)",
               write ? "writes" : "reads", static_cast<long long>(a + i - b.lo), b.index,
               threadgroup_name(tg[i]).c_str());
      lane_fail(buf, g.access_pc);
    }
    if (me == nullptr) {
      if (write) tg[i] = g.tg_id;
      continue;
    }
    if (!race.track_reads) {
      if (!write && tg[i] == 0) {
        // Nothing to order it after; a later write of this threadgroup restarts (DevShadow).
        race.untracked_read_tg = g.tg_id;
        continue;
      }
      if (write && race.untracked_read_tg == g.tg_id) {
        g.track_reads |= race.bindings;
        lane_restart();
      }
    }
    if (write) tg[i] = g.tg_id;
    int r = order(in_tg[i], *me, g.groups[me->sg].dev_epoch, g.dev_epoch, write);
    if (r != kOrdered) device_race(b, a + i, write, r);
  }
}

// An access through a parameter that a function constant disables or that the dispatch does not
// bind. Metal has no buffer there:
// a write is an error; a read is what the compiler removes when its value is unused, which
// launch() finds out by running the dispatch again with other poison (state.h).
void disabled_access(const DeviceBuffer& b, uintptr_t a, size_t n, bool write) {
  if (write) {
    char buf[256];
    snprintf(buf, sizeof buf,
             "device write of %zu bytes at byte offset %lld of [[buffer(%u)]], which %s (no "
             "buffer is bound to it)",
             n, static_cast<long long>(a - b.lo), b.index, absent_reason(b));
    lane_fail(buf, g.access_pc);
  }
  if (g.disabled_reads++ == 0) {
    g.disabled_index = b.index;
    g.disabled_reason = absent_reason(b);
    g.disabled_where = where();
    g.disabled_pc = g.access_pc;
  }
}

void device_access(uintptr_t a, size_t n, bool write, bool bytes = false, size_t align = 16) {
  DeviceBuffer* b = g.dev_last;
  if (b == nullptr || a < b->lo || a + n > b->hi) {
    b = nullptr;
    for (DeviceBuffer& d : g.dev) {
      if (a >= d.lo && a + n <= d.hi) {
        b = &d;
        break;
      }
    }
    if (b == nullptr) {
      if (g.checkers) device_oob(a, n, write);
      return;
    }
    g.dev_last = b;
  }
  if (b->disabled) {
    disabled_access(*b, a, n, write);
    return;
  }
  (write ? b->counters.written : b->counters.read) += n;
  if (g.cache_on) cache_access(a, n, write);
  if (g.checkers && !bytes) check_alignment(*b, a, n, write, align);
  if (b->race != nullptr && g.checkers) check_device_race(*b, a, n, write);
}

// ------------------------------------------------------------------------- threadgroup memory



char* g_tg_arena = nullptr;

std::string tg_name(uint32_t offset) {
  for (const auto& kv : g.tg_args) {
    if (offset >= kv.second.first && offset < kv.second.first + kv.second.second) {
      return fmt("[[threadgroup(%llu)]] byte %llu", kv.first, offset - kv.second.first);
    }
  }
  for (const auto& kv : g.tg_arrays) {
    if (offset >= kv.second.first && offset < kv.second.first + kv.second.second) {
      return fmt("byte %llu of a threadgroup array", offset - kv.second.first);
    }
  }
  return fmt("threadgroup byte %llu", offset);
}

// other_lane < 0: one of several readers, not recorded which.
[[noreturn]] void race(uint32_t offset, bool write, int other_lane, bool other_wrote) {
  char buf[320];
  char other[64] = "another thread";
  if (other_lane >= 0) {
    snprintf(other, sizeof other, "thread %d (simdgroup %d)", other_lane, other_lane / 32);
  }
  uint32_t me = g.cur->index;
  snprintf(buf, sizeof buf,
           "data race on threadgroup memory (%s): thread %u (simdgroup %u) %s it after %s %s it "
           "with no threadgroup_barrier(mem_threadgroup) between",
           tg_name(offset).c_str(), me, me / kSimdWidth, write ? "writes" : "reads", other,
           other_wrote ? "wrote" : "read");
  lane_fail(buf, g.access_pc);
}

// Allocations placed in the layout so far (Shadow::owner numbers them).
uint32_t g_tg_allocations = 0;

// The allocation nearest to layout offset `offset`: its name and the offset relative to it.
std::string tg_nearest(long long offset) {
  std::string best = "no threadgroup memory is allocated";
  long long best_dist = -1;
  auto consider = [&](const std::string& name, uint32_t lo, uint32_t bytes) {
    long long dist = offset < lo ? lo - offset : (offset >= lo + bytes ? offset - lo - bytes + 1 : 0);
    if (best_dist < 0 || dist < best_dist) {
      best_dist = dist;
      best = fmt("at byte offset %lld of ", offset - lo) + name + fmt(" (%llu bytes)", bytes);
    }
  };
  for (const auto& kv : g.tg_args) {
    consider(fmt("[[threadgroup(%llu)]]", kv.first), kv.second.first, kv.second.second);
  }
  for (const auto& kv : g.tg_arrays) {
    consider("a threadgroup array", kv.second.first, kv.second.second);
  }
  return best;
}

void tg_access(uintptr_t a, size_t n, bool write) {
  (write ? g.counters.threadgroup_written : g.counters.threadgroup_read) += n;
  if (!g.checkers) return;
  auto base = reinterpret_cast<uintptr_t>(g.tg_base);
  uint16_t owner = 0;
  if (a >= base && a + n <= base + kTgSpan) {
    owner = g.shadow[a - base].owner;
    if (g.shadow[a - base + n - 1].owner != owner) owner = 0;
  }
  if (owner == 0) {
    long long offset = static_cast<long long>(a) - static_cast<long long>(base);
    char buf[300];
    snprintf(buf, sizeof buf, "out-of-bounds threadgroup %s of %zu bytes %s",
             write ? "write" : "read", n, tg_nearest(offset).c_str());
    lane_fail(buf, g.access_pc);
  }
  const Lane* me = g.cur;
  if (me == nullptr) return;
  const uint32_t s = g.groups[me->sg].epoch;
  auto offset = static_cast<uint32_t>(a - base);
  for (uint32_t i = offset; i < offset + n; ++i) {
    int r = order(g.shadow[i], *me, s, g.epoch, write);
    if (r != kOrdered) {
      int other;
      bool wrote;
      other_access(r, &other, &wrote);
      race(i, write, other, wrote);
    }
  }
}

[[noreturn]] void spinning() {
  lane_fail(fmt("made %llu device and threadgroup memory accesses without reaching a barrier or "
                "simd operation: is it spin-waiting for another thread? (Metal does not "
                "guarantee that threads of a threadgroup make progress independently)",
                g.run_accesses),
            g.access_pc);
}

inline __attribute__((always_inline)) void on_access(const void* p, size_t n, bool write,
                                                     const void* pc, bool bytes = false,
                                                     size_t align = 16) {
  auto a = reinterpret_cast<uintptr_t>(p);
  const SteelSimArenas& arenas = steel_sim_arenas;
  if (bytes) {
    // A range may start just outside an arena and end inside it: blame it where it lands.
    uintptr_t last = a + n - 1;
    if (a - arenas.dev_lo >= arenas.dev_size && a - arenas.tg_lo >= arenas.tg_size) a = last;
  }
  if (a - arenas.dev_lo >= arenas.dev_size && a - arenas.tg_lo >= arenas.tg_size) return;
  a = reinterpret_cast<uintptr_t>(p);
  g.access_pc = pc;
  if (++g.run_accesses > kSpinLimit) spinning();
  if (a - arenas.dev_lo < arenas.dev_size || (bytes && a + n - 1 - arenas.dev_lo <
                                                           arenas.dev_size)) {
    device_access(a, n, write, bytes, align);
  } else if (a - arenas.tg_lo < arenas.tg_size) {
    tg_access(a, n, write);
  }
}

}  // namespace

namespace {
void* map_shadow(size_t bytes, const LaunchSpec& spec) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    throw SimError("kernel '" + spec.kernel + "': cannot map a race-checker shadow");
  }
  return p;
}
}  // namespace

void bind_device(const LaunchSpec& spec) {
  // Group bindings by overlapping host memory: such bindings alias on the GPU too.
  std::vector<const BufferArg*> args;
  for (const BufferArg& b : spec.buffers) args.push_back(&b);
  std::sort(args.begin(), args.end(), [](const BufferArg* x, const BufferArg* y) {
    return reinterpret_cast<uintptr_t>(x->host) < reinterpret_cast<uintptr_t>(y->host);
  });
  g_regions.clear();
  std::vector<size_t> region_of(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto lo = reinterpret_cast<uintptr_t>(args[i]->host);
    uintptr_t hi = lo + args[i]->bytes;
    if (!g_regions.empty() && args[i]->bytes > 0 && lo < g_regions.back().host_hi) {
      g_regions.back().host_hi = std::max(g_regions.back().host_hi, hi);
      g_regions.back().write_back |= args[i]->write_back;
    } else {
      g_regions.push_back(Region{lo, hi, 0, args[i]->write_back});
    }
    region_of[i] = g_regions.size() - 1;
  }
  // A region starts at the same address modulo kHostAlignment as its host memory: a tensor's
  // storage is kHostAlignment-aligned on the CPU as an MTLBuffer is on the GPU, so a binding at
  // a storage offset keeps the alignment it has on the Mac (which check_alignment relies on).
  size_t offset = kMinGap;
  for (Region& r : g_regions) {
    r.arena_lo = offset + (r.host_lo % kHostAlignment);
    size_t bytes = (r.arena_lo - offset) + (r.host_hi - r.host_lo);
    offset += ((bytes + 255) & ~size_t{255}) + gap_for(bytes);
  }
  g_poison_offset = offset;
  offset += (kMaxBufferIndex + 1) * 2 * kPoisonBytes;
  void* p = mmap(nullptr, offset, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw SimError("kernel '" + spec.kernel + "': cannot map the device arena");
  g_arena = static_cast<char*>(p);
  g_arena_bytes = offset;
  for (Region& r : g_regions) {
    r.arena_lo += reinterpret_cast<uintptr_t>(g_arena);
    if (spec.checkers && r.write_back && r.host_hi > r.host_lo) {
      // Untouched shadow pages cost nothing: reading them maps the zero page.
      const size_t bytes = r.host_hi - r.host_lo;
      r.race.tg = static_cast<uint32_t*>(map_shadow(bytes * sizeof(uint32_t), spec));
      r.race.in_tg = static_cast<Shadow*>(map_shadow(bytes * sizeof(Shadow), spec));
    }
    if (r.host_hi > r.host_lo) {
      std::memcpy(reinterpret_cast<void*>(r.arena_lo), reinterpret_cast<void*>(r.host_lo),
                  r.host_hi - r.host_lo);
    }
  }
  g.dev.clear();
  g.dev.reserve(args.size() + kMaxBufferIndex + 1);  // bind_disabled keeps pointers valid
  std::fill(std::begin(g.buffer_bound), std::end(g.buffer_bound), false);
  std::fill(std::begin(g.disabled_base), std::end(g.disabled_base), nullptr);
  g.disabled_reads = 0;
  g.disabled_pc = nullptr;
  g.disabled_where.clear();
  for (size_t i = 0; i < args.size(); ++i) {
    const Region& r = g_regions[region_of[i]];
    uintptr_t lo = r.arena_lo + (reinterpret_cast<uintptr_t>(args[i]->host) - r.host_lo);
    if (args[i]->bytes == 0) lo = r.arena_lo;
    DeviceBuffer d;
    d.index = args[i]->index;
    d.lo = lo;
    d.hi = lo + args[i]->bytes;
    if (r.race.tg != nullptr) {
      Region& region = g_regions[region_of[i]];
      d.race = &region.race;
      d.race_offset = lo - r.arena_lo;
      region.race.bindings |= 1u << d.index;
      if (g.track_reads & (1u << d.index)) region.race.track_reads = true;
    }
    g.dev.push_back(d);
    g.buffer_base[d.index] = reinterpret_cast<void*>(lo);
    g.buffer_bound[d.index] = true;
  }
  g.dev_last = nullptr;
  steel_sim_arenas.dev_lo = reinterpret_cast<uintptr_t>(g_arena);
  steel_sim_arenas.dev_size = g_arena_bytes;
}

void* bind_disabled(uint32_t index, bool unbound) {
  if (index > kMaxBufferIndex) {
    lane_fail(fmt("[[buffer(%llu)]]: Metal has 31 buffer slots (0-30)", index));
  }
  if (g.disabled_base[index] == nullptr) {
    char* p = g_arena + g_poison_offset + index * 2 * kPoisonBytes;
    std::memset(p, g.poison, kPoisonBytes);
    DeviceBuffer d;
    d.index = index;
    d.lo = reinterpret_cast<uintptr_t>(p);
    d.hi = d.lo + kPoisonBytes;
    d.disabled = true;
    d.unbound = unbound;
    g.dev.push_back(d);
    g.dev_last = nullptr;
    g.disabled_base[index] = p;
  }
  return g.disabled_base[index];
}

std::vector<uint8_t> snapshot_outputs() {
  std::vector<uint8_t> out;
  for (const Region& r : g_regions) {
    if (!r.write_back || r.host_hi <= r.host_lo) continue;
    const auto* p = reinterpret_cast<const uint8_t*>(r.arena_lo);
    out.insert(out.end(), p, p + (r.host_hi - r.host_lo));
  }
  return out;
}

void unbind_device(bool write_back) {
  steel_sim_arenas.dev_size = 0;
  steel_sim_arenas.tg_size = 0;
  if (write_back) {
    for (const Region& r : g_regions) {
      if (r.write_back && r.host_hi > r.host_lo) {
        std::memcpy(reinterpret_cast<void*>(r.host_lo), reinterpret_cast<void*>(r.arena_lo),
                    r.host_hi - r.host_lo);
      }
    }
  }
  for (const DeviceBuffer& d : g.dev) {
    if (d.disabled) continue;
    BufferCounters& c = g.counters.buffers[d.index];
    c.read += d.counters.read;
    c.written += d.counters.written;
  }
  for (Region& r : g_regions) {
    const size_t bytes = r.host_hi - r.host_lo;
    if (r.race.tg != nullptr) munmap(r.race.tg, bytes * sizeof(uint32_t));
    if (r.race.in_tg != nullptr) munmap(r.race.in_tg, bytes * sizeof(Shadow));
    r.race = DevShadow();
  }
  if (g_arena != nullptr) munmap(g_arena, g_arena_bytes);
  g_arena = nullptr;
  g.dev.clear();
  g.dev_last = nullptr;
}

Counters take_counters() {
  Counters c = g.counters;
  for (DeviceBuffer& d : g.dev) {
    if (d.disabled) continue;
    BufferCounters& b = c.buffers[d.index];
    b.read += d.counters.read;
    b.written += d.counters.written;
    d.counters = BufferCounters();
  }
  c.threadgroup_memory_bytes = g.tg_used;  // arrays stay placed for the whole launch
  c.instruction_counts = steel_sim_counting != 0;
  for (const auto& [index, b] : c.buffers) {
    if (g.constant_buffers & (1u << index)) c.constant_read += b.read;
  }
  g.counters = Counters();
  g.counters.kernel = c.kernel;
  g.counters.cache = c.cache;
  return c;
}

namespace {
// Places an allocation of `bytes` in the layout (after the last one and its gap).
uint32_t place_threadgroup(size_t bytes, size_t align) {
  uint64_t offset = (uint64_t{g.tg_layout} + align - 1) / align * align;
  uint64_t gap = std::max<uint64_t>((bytes + 15) & ~uint64_t{15}, kTgMinGap);
  if (offset + bytes + gap > kTgSpan) {
    lane_fail("too many threadgroup allocations for the simulator's layout");
  }
  ++g_tg_allocations;
  for (uint64_t i = offset; i < offset + bytes; ++i) {
    g.shadow[i].owner = static_cast<uint16_t>(g_tg_allocations);
  }
  g.tg_layout = static_cast<uint32_t>(offset + bytes + gap);
  return static_cast<uint32_t>(offset);
}
}  // namespace

void reset_threadgroup_memory(const LaunchSpec& spec) {
  if (g_tg_arena == nullptr) {
    size_t total = kTgGuardLo + kTgSpan + kTgGuardHi;
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    g_tg_arena = static_cast<char*>(p);
    g.shadow = new Shadow[kTgSpan];
  }
  // Owners are set only inside the layout: clearing the last launch's is enough.
  for (uint32_t i = 0; i < g.tg_layout; ++i) g.shadow[i].owner = 0;
  g_tg_allocations = 0;
  g.tg_layout = 0;
  g.tg_base = g_tg_arena + kTgGuardLo;
  g.tg_args.clear();
  g.tg_arrays.clear();
  uint64_t used = 0;
  std::vector<steel::ThreadgroupMemory> args = spec.threadgroup_memory;
  std::sort(args.begin(), args.end(),
            [](const auto& x, const auto& y) { return x.index < y.index; });
  for (const steel::ThreadgroupMemory& m : args) {
    if (m.bytes % 16 != 0) {
      throw SimError("kernel '" + spec.kernel + "': " +
                     fmt("[[threadgroup(%llu)]] memory length %llu is not a multiple of 16 bytes "
                         "(Metal's setThreadgroupMemoryLength requires it)",
                         m.index, m.bytes));
    }
    if (g.tg_args.count(m.index)) {
      throw SimError("kernel '" + spec.kernel + "': " +
                     fmt("[[threadgroup(%llu)]] memory length set twice", m.index));
    }
    used = (used + 15) & ~uint64_t{15};
    used += m.bytes;
    if (used > kThreadgroupLimit) {
      throw SimError("kernel '" + spec.kernel + "': " +
                     fmt("threadgroup memory of %llu bytes exceeds the 32 KiB (32768 bytes) limit",
                         used));
    }
    g.tg_args[m.index] = {place_threadgroup(m.bytes, 16), m.bytes};
  }
  g.tg_used = static_cast<uint32_t>(used);
  steel_sim_arenas.tg_lo = reinterpret_cast<uintptr_t>(g_tg_arena);
  steel_sim_arenas.tg_size = kTgGuardLo + kTgSpan + kTgGuardHi;
}

void start_threadgroup_memory() { std::memset(g.tg_base, 0xFF, g.tg_layout); }

void* allocate_threadgroup_array(uint32_t decl, size_t bytes, size_t align, const void* pc) {
  auto it = g.tg_arrays.find(decl);
  if (it != g.tg_arrays.end()) {
    if (it->second.second != bytes) {
      lane_fail(fmt("threadgroup array #%llu requested with %llu bytes, earlier with %llu", decl,
                    bytes, it->second.second),
                pc);
    }
    return g.tg_base + it->second.first;
  }
  align = std::max<size_t>(align, 16);
  uint64_t used = (uint64_t{g.tg_used} + align - 1) / align * align;
  if (used + bytes > kThreadgroupLimit) {
    lane_fail(fmt("threadgroup memory of %llu bytes (with threadgroup array #%llu of %llu bytes) "
                  "exceeds the 32 KiB (32768 bytes) limit",
                  used + bytes, decl, bytes),
              pc);
  }
  g.tg_used = static_cast<uint32_t>(used + bytes);
  uint32_t offset = place_threadgroup(bytes, align);
  g.tg_arrays[decl] = {offset, static_cast<uint32_t>(bytes)};
  std::memset(g.tg_base + offset, 0xFF, bytes);
  return g.tg_base + offset;
}

}  // namespace detail
}  // namespace steel_sim

extern "C" {

__attribute__((visibility("default"))) SteelSimArenas steel_sim_arenas = {0, 0, 0, 0};

__attribute__((visibility("default"))) void steel_sim_access(const void* p, size_t n,
                                                             bool write, const void* pc) {
  steel_sim::detail::on_access(p, n, write, pc);
}

__attribute__((visibility("default"))) void steel_sim_access_aligned(const void* p, size_t n,
                                                                     size_t align, bool write,
                                                                     const void* pc) {
  steel_sim::detail::on_access(p, n, write, pc, false, align);
}

__attribute__((visibility("default"))) void steel_sim_access_range(const void* p, size_t n,
                                                                   bool write, const void* pc) {
  steel_sim::detail::on_access(p, n, write, pc, true);
}

}
