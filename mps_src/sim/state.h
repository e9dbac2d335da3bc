// Internal state of the simulator, shared by runtime.cpp (scheduler, rendezvous, launches) and
// checkers.cpp (device and threadgroup memory, the load/store callbacks).
//
// One launch runs at a time (launch() holds a global lock) on one OS thread, so the state of the
// running launch is a plain global: the load/store callbacks, which run for every memory access
// of shader code, reach it without thread-local lookups.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "fiber.h"
#include "sim.h"
#include "sim/runtime.h"
#include "sim/shader/callbacks.h"

#define STEEL_SIM_HIDDEN __attribute__((visibility("hidden")))

namespace steel_sim::detail {

constexpr uint32_t kSimdWidth = 32;
constexpr uint32_t kMaxLanes = 1024;
constexpr uint32_t kMaxBufferIndex = 30;  // Metal: [[buffer(0)]] .. [[buffer(30)]]
constexpr uint32_t kThreadgroupLimit = 32 * 1024;
constexpr size_t kMaxExchangeBytes = 256;  // per lane and simd_exchange
constexpr uint32_t kMemDevice = 1;       // Metal's mem_flags::mem_device
constexpr uint32_t kMemThreadgroup = 2;  // Metal's mem_flags::mem_threadgroup
constexpr uint64_t kSpinLimit = uint64_t{1} << 27;

enum class Wait : uint8_t { Ready, Running, Barrier, Simd, Exited };
enum class SimdWait : uint8_t { None, Exchange, Barrier };

// Where a lane reached a rendezvous: the return addresses of the call chain in shader code
// (innermost first, through frame pointers), so that a non-inlined helper holding a barrier that
// is reached from two call sites counts as two barriers. `key` hashes the whole chain.
struct CallChain {
  static constexpr uint32_t kMax = 12;
  // Only pc[0, n) is set: a chain is built at every rendezvous, so the rest is not even zeroed.
  const void* pc[kMax];
  uint32_t n = 0;
  uint64_t key = 0;
  CallChain() = default;
  CallChain(const CallChain& o) : n(o.n), key(o.key) { std::copy(o.pc, o.pc + o.n, pc); }
  CallChain& operator=(const CallChain& o) {
    n = o.n;
    key = o.key;
    std::copy(o.pc, o.pc + o.n, pc);
    return *this;
  }
};

struct Lane {
  Context ctx;
  LaneInfo info;
  uint32_t index = 0;  // thread_index_in_threadgroup
  uint32_t sg = 0;     // simdgroup_index_in_threadgroup
  Wait wait = Wait::Ready;
  const void* exchange_result = nullptr;
  uint32_t exchange_mask = 0;
  // The simd operation it waits at: its call chain's key, size and kind, and (when it may be
  // reached in divergent control flow) the chain itself (runtime.cpp, try_complete_simd).
  uint64_t site_key = 0;
  size_t exchange_bytes = 0;
  SimdKind exchange_kind = SimdKind::Shuffle;
  CallChain site;
  // met[j]: the id (from Sim::simd_epochs) of the last collective of its simdgroup that combined
  // values across lanes (runtime.cpp: combines_lanes) in which this lane and lane j both took
  // part, when not all lanes of the simdgroup did (SimdGroup::all_met covers that case). The race
  // checker orders a read of lane j before this lane's accesses after such a collective.
  uint32_t met[kSimdWidth] = {};
};

struct SimdGroup {
  uint32_t live = 0;        // lanes (bit per lane of the simdgroup) that have not exited
  uint32_t arrived = 0;     // lanes waiting at the current simd rendezvous
  uint32_t at_barrier = 0;  // lanes waiting at threadgroup_barrier
  SimdWait wait = SimdWait::None;
  SimdKind kind = SimdKind::Shuffle;
  size_t bytes = 0;
  CallChain site;  // where the current rendezvous was first reached
  // Whether every lane waiting now waits at a simd shuffle, reduction or ballot: those may be
  // reached in divergent control flow (MSL defines them over the active lanes), each call site
  // then completing with the lanes that reached it, once no lane of the simdgroup runs.
  bool divergent_ok = false;
  uint32_t flags = 0;   // mem_flags of the simdgroup_barrier being gathered
  // buf[0]: each waiting lane's contribution, lane l at l * kMaxExchangeBytes; buf[1]: the
  // contributions of the lanes of the last completed operation, lane-major at its size. A lane
  // reads buf[1] before any further operation of its simdgroup can complete (that needs every
  // live lane to wait again), so one result buffer is enough.
  // Advance at every completed simdgroup_barrier with mem_threadgroup (epoch) or mem_device
  // (dev_epoch): what orders the memory accesses of this simdgroup's lanes for the race checker.
  // Other simd operations do not order memory in MSL.
  uint32_t epoch = 0;
  uint32_t dev_epoch = 0;
  // The id of the last collective that combined values across lanes in which every lane of the
  // simdgroup (`members`, at the threadgroup's start) took part (see Lane::met).
  uint32_t all_met = 0;
  uint32_t members = 0;
  uint8_t* buf[2] = {nullptr, nullptr};
  // Instruction counters (runtime.cpp: count_block): since the simdgroup's last rendezvous,
  // how often each of its lanes ran each counted basic block (by the block's histogram).
  struct BlockRuns {
    const uint32_t* histogram;
    uint32_t lanes[kSimdWidth];
  };
  std::vector<BlockRuns> runs;
  std::unordered_map<const uint32_t*, uint32_t> run_index;  // histogram -> index in runs
};

struct DeviceBuffer {
  uint32_t index = 0;
  uintptr_t lo = 0;  // in the device arena
  uintptr_t hi = 0;
  // Race shadow of the region holding this buffer (null for inline bytes), see DevShadow, and
  // the buffer's first byte in it.
  struct DevShadow* race = nullptr;
  size_t race_offset = 0;
  BufferCounters counters;
  // The poison region of a buffer a function constant disables or the dispatch leaves unbound
  // (Metal binds nothing there; a kernel may still hold the pointer, as long as a read of it is
  // dead code there).
  bool disabled = false;
  bool unbound = false;  // not bound at all (rather than disabled by a function constant)
};

// Why a disabled region has no buffer, for messages: "which <reason>".
inline const char* absent_reason(const DeviceBuffer& b) {
  return b.unbound ? "the dispatch does not bind" : "a function constant disables";
}

// Race-checker shadow of one threadgroup-memory byte: the last write and the latest reads, each
// stamped with the threadgroup epoch (advanced by threadgroup barriers and threadgroup starts)
// and the simd epoch of the accessing lane's simdgroup.
struct Shadow {
  uint32_t w_epoch = 0;
  uint32_t w_sepoch = 0;
  uint32_t r_epoch = 0;
  uint32_t r_sepoch = 0;
  // Sim::simd_epochs at the latest read: a collective with a higher id came after every
  // recorded read (checkers.cpp: collective_orders).
  uint32_t r_xstamp = 0;
  uint16_t w_lane = 0;
  uint16_t r_lane = 0;
  uint8_t r_flags = 0;  // kReadersManySimdgroups | kReadersManyLanes
  // Threadgroup memory only: the allocation the byte belongs to (1-based; 0: a gap between
  // allocations), kept here rather than in an array of its own so that the bounds check of an
  // access reads the cache line that its race check needs anyway (checkers.cpp, tg_access).
  uint16_t owner = 0;
};
// Race-checker shadow of one device region (a tensor's bytes, shared by the bindings that alias
// it). Per byte: the threadgroup (linear index + 1) that last wrote it in this dispatch (0 if
// none), for races between threadgroups, and the accesses of the running threadgroup as for
// threadgroup memory, with device epochs (mem_device barriers). Two arrays, so that the common
// access, a read of a byte that nothing wrote in this dispatch, touches only the first.
//
// Such a read is recorded in `in_tg` only once the region tracks reads: a read of a byte that no
// one wrote cannot race with an earlier access, only with a later write of the same threadgroup.
// So a region starts untracked, remembers the last threadgroup that read it untracked, and when
// that threadgroup then writes the region, the dispatch starts over with the region's reads
// tracked (checkers.cpp, runtime.cpp: launch). Kernels that only read their inputs never pay
// for recording those reads; one that reads and writes a buffer pays for one threadgroup twice.
struct DevShadow {
  uint32_t* tg = nullptr;
  Shadow* in_tg = nullptr;
  bool track_reads = false;
  uint32_t untracked_read_tg = 0;
  uint32_t bindings = 0;  // the binding indices (bit per index) that share the region
};
constexpr uint8_t kReadersManySimdgroups = 1;
constexpr uint8_t kReadersManyLanes = 2;

struct Sim {
  // The dispatch.
  std::string kernel;
  KernelEntry entry = nullptr;
  bool checkers = true;
  bool worst_precision = false;  // runtime.h: worst_precision
  uint64_t precision_seed = 0;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t threads[3] = {1, 1, 1};
  uint32_t threads_grid[3] = {0, 0, 0};  // LaunchSpec::threads_grid
  uint32_t tg_pos[3] = {0, 0, 0};
  uint32_t tg_id = 0;  // linear index of the running threadgroup + 1
  uint32_t nlanes = 0;
  uint32_t nsimd = 0;
  std::map<uint32_t, steel::FunctionConstant> constants;

  // Device memory: bound buffers in one arena (steel_sim_arenas.dev_*); everything else in the
  // arena is a guard gap.
  std::vector<DeviceBuffer> dev;  // sorted by lo
  DeviceBuffer* dev_last = nullptr;
  void* buffer_base[kMaxBufferIndex + 1] = {};
  bool buffer_bound[kMaxBufferIndex + 1] = {};
  // Buffers disabled by function constants or left unbound (runtime.h: disabled_buffer): their
  // poison regions (null until a lane first asks), the byte they are filled with in this run,
  // and the first read of one (where, which and why it has no buffer), for the second run that
  // tells a dead read from a used one.
  void* disabled_base[kMaxBufferIndex + 1] = {};
  uint8_t poison = 0xFF;
  uint64_t disabled_reads = 0;
  uint32_t disabled_index = 0;
  const char* disabled_reason = "";
  std::string disabled_where;
  const void* disabled_pc = nullptr;

  // Threadgroup memory (steel_sim_arenas.tg_*): [guard][32 KiB][guard];
  // tg_used bytes are allocated as Metal counts them; in the simulator's layout they lie in
  // [tg_base, tg_base + tg_layout), each allocation followed by a gap (checkers.cpp).
  char* tg_base = nullptr;
  uint32_t tg_used = 0;
  uint32_t tg_layout = 0;
  std::map<uint32_t, std::pair<uint32_t, uint32_t>> tg_args;  // [[threadgroup(i)]] -> offset, bytes
  std::unordered_map<uint32_t, std::pair<uint32_t, uint32_t>> tg_arrays;  // decl -> offset, bytes
  Shadow* shadow = nullptr;
  uint32_t epoch = 0;          // threadgroup epoch, never reset (so the shadow never is either)
  uint32_t dev_epoch = 0;      // the same for device memory (mem_device barriers)
  uint32_t simd_epochs = 0;    // source of fresh simd epochs

  // Lanes of the running threadgroup.
  std::vector<Lane> lanes;
  std::vector<SimdGroup> groups;
  std::vector<uint32_t> ready;  // ring of lane indices
  size_t ready_head = 0;
  size_t ready_count = 0;
  uint32_t live = 0;
  uint32_t at_barrier = 0;
  CallChain barrier_site;  // where the threadgroup barrier being gathered was first reached
  uint32_t barrier_flags = 0;          // its mem_flags
  // What the threadgroup-wide rendezvous being gathered is: threadgroup_barrier, or a tensor
  // operation of a multi-simdgroup scope (runtime.h: tensor_op_gather), for messages.
  const char* barrier_what = "threadgroup_barrier";  // runtime.cpp: kThreadgroupBarrier
  // tensor_op_gather's contributions of a threadgroup-wide scope, double-buffered by the
  // parity of each lane's gather count (a lane can be one operation ahead of the leader).
  std::vector<const void*> scope_ptrs[2];
  std::vector<uint32_t> scope_count;  // per lane
  // Live lanes when the last threadgroup-wide rendezvous completed (stable until every lane
  // that it released reaches the next one).
  uint32_t barrier_live = 0;
  Lane* cur = nullptr;  // the running lane, null on the scheduler
  Context scheduler;
  StackPool stacks;

  // Device and threadgroup accesses of the running lane since it last waited or started: a lane
  // that makes kSpinLimit of them without reaching a rendezvous is spinning on memory that
  // another lane would have to change (Metal guarantees no forward progress for that), which
  // would otherwise hang the fibers.
  uint64_t run_accesses = 0;
  const void* access_pc = nullptr;  // shader code making the device/threadgroup access at hand

  // A fault inside a lane: recorded, then the lane switches to the scheduler, which throws.
  bool failed = false;
  // The dispatch must start over with the reads of more regions tracked (DevShadow): then also
  // `failed`, with no error. track_reads: the binding indices (bit per index) whose regions
  // track reads from the start, learned by such restarts within one launch.
  bool restart = false;
  uint32_t track_reads = 0;
  std::string error;

  // [[buffer(n)]] parameters in the constant address space (bit per index): runtime.h,
  // constant_buffer.
  uint32_t constant_buffers = 0;

  Counters counters;
  // The counters of each finished group (sim.h: LaunchSpec::groups) of the running attempt.
  std::vector<Counters> group_counters;
  bool cache_on = false;  // the cache model records device accesses (cache.cpp)
};

STEEL_SIM_HIDDEN extern Sim g;

// "kernel 'k' threadgroup (x,y,z) thread (x,y,z): " for messages about the running lane.
std::string where();
// " [pc <library>+0x<offset>]" for an address in shader code (a return address), or "".
std::string pc_text(const void* pc);
// Reports a fault of the running lane (or throws when called on the scheduler).
// `pc`, an address in shader code, is named in the message as "[pc <library>+0x<offset>]" (which
// torch_steel/sim/__init__.py turns into file:line).
[[noreturn]] void lane_fail(std::string message, const void* pc = nullptr);
// Abandons the running lane and the dispatch, which launch() runs again from the start with the
// regions of the binding indices in g.track_reads tracking reads (DevShadow).
[[noreturn]] void lane_restart();

// checkers.cpp
void bind_device(const LaunchSpec& spec);    // copies buffers into a fresh arena
void* bind_disabled(uint32_t index, bool unbound);  // the poison region of a disabled buffer
// The bytes of every region that is written back, for comparing two runs of one dispatch.
std::vector<uint8_t> snapshot_outputs();
void unbind_device(bool write_back);         // copies them back (on success) and unmaps
void reset_threadgroup_memory(const LaunchSpec& spec);  // [[threadgroup(i)]] layout
void start_threadgroup_memory();             // poisons the allocated bytes for a new threadgroup
void* allocate_threadgroup_array(uint32_t decl, size_t bytes, size_t align, const void* pc);
// The running counters with the bound buffers' bytes, which it then zeroes (a group's counters).
Counters take_counters();

// cache.cpp (sim.h: CacheSpec): reset at each attempt of a dispatch (after bind_device), then
// told of every threadgroup start and device access, and of the end of each group.
void cache_reset(const LaunchSpec& spec);
void cache_start_threadgroup(uint32_t linear_id);
void cache_access(uintptr_t a, size_t n, bool write);
void cache_end_group();

}  // namespace steel_sim::detail
