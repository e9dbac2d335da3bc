// The simulator's host-side API: what the Python module (python/module.cpp) calls.
//
// The shader side talks to the runtime through runtime.h; this header is for the host: load a
// library of translated shaders, launch one kernel, or execute a whole launch plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/plan.h"

namespace steel_sim {

// A kernel fault or a misuse of the simulator; the message names the kernel.
class SimError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// SIGINT (Ctrl-C) arrived during a launch: it stops between threadgroups; the Python module turns
// this into KeyboardInterrupt.
class Interrupted : public SimError {
 public:
  using SimError::SimError;
};

// A shared library of translated shaders; its kernels registered themselves when it was loaded.
struct Library;
// dlopen's `paths` (once per set; each a .metal file's library, RTLD_LOCAL, so that each keeps
// its own functions as in Metal) and collects the kernels they register. Throws SimError.
const Library* load_library(const std::vector<std::string>& paths);
std::vector<std::string> kernel_names(const Library* library);

// One [[buffer(index)]]: `bytes` bytes at `host` (a tensor's element 0, or inline bytes).
// Tensor bindings are copied into the device arena before the launch and back after it.
struct BufferArg {
  uint32_t index = 0;
  void* host = nullptr;
  size_t bytes = 0;
  bool write_back = true;  // false for inline bytes (setBytes)
};

// The cache model of a launch (cache.cpp): device accesses replayed through an L2 and a
// system-level cache (SLC), each a fully associative LRU of whole lines, with `resident`
// threadgroups in flight at a time (a wave: linear threadgroup ids [w * resident, (w + 1) *
// resident)), whose accesses are interleaved round-robin. Off unless `enabled`.
struct CacheSpec {
  bool enabled = false;
  uint32_t line_bytes = 128;
  uint64_t l2_bytes = 0;
  uint64_t slc_bytes = 0;
  uint32_t resident = 1;
};

struct LaunchSpec {
  const Library* library = nullptr;
  std::string kernel;
  std::vector<steel::FunctionConstant> constants;
  std::vector<BufferArg> buffers;
  std::vector<steel::ThreadgroupMemory> threadgroup_memory;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t threads[3] = {1, 1, 1};
  // All non-zero: a dispatchThreads launch of this many threads, `grid` then being the rounded-up
  // threadgroup count; the last threadgroup in each dimension is partial (runtime.cpp:
  // start_threadgroup). All zero: dispatchThreadgroups, every threadgroup full.
  uint32_t threads_grid[3] = {0, 0, 0};
  bool checkers = true;
  CacheSpec cache;
  // Empty: every threadgroup runs and launch_groups returns one Counters. Else only the
  // threadgroups listed (linear ids x + grid[0] * (y + grid[1] * z), ascending across the
  // groups) run, and each group gets its own Counters; the cache model's state carries over from
  // one group to the next (each group's pending wave replayed when it ends) unless waves are
  // skipped in between, which empties the caches. The outputs of such a run are partial.
  std::vector<std::vector<uint32_t>> groups;
  // Count the instructions simdgroups issue (Counters::issued; a call per basic block when off).
  bool count_instructions = false;
};

struct BufferCounters {
  uint64_t read = 0;     // bytes
  uint64_t written = 0;  // bytes
};

// What one launch did. simd_ops counts simdgroup rendezvous (every simd_* call and simdgroup
// matrix operation, once per simdgroup, plus simdgroup_barrier); mma counts the
// SimdKind::MatrixMma ones among them.
struct Counters {
  std::string kernel;
  uint64_t threadgroups = 0;
  uint64_t lanes = 0;
  uint64_t mma = 0;
  uint64_t simd_ops = 0;
  uint64_t shuffles = 0;    // simd_shuffle*, simd_broadcast* (per simdgroup)
  uint64_t reductions = 0;  // simd_sum/min/max/product/and/or/xor and prefix sums
  uint64_t ballots = 0;     // simd_ballot, simd_all, simd_any
  uint64_t barriers = 0;
  uint64_t threadgroup_read = 0;     // bytes of threadgroup memory loaded by all lanes
  uint64_t threadgroup_written = 0;  // bytes stored
  // Threadgroup memory one threadgroup holds ([[threadgroup(i)]] lengths and arrays declared in
  // the kernel, aligned as Metal counts them): what limits how many threadgroups share a core.
  uint64_t threadgroup_memory_bytes = 0;
  uint64_t lane_switches = 0;
  // Metal 4 tensor operations (matmul2d::run, reductions), once per execution scope, and the
  // multiply-adds of the matmuls among them (m * n * K each).
  uint64_t tensor_ops = 0;
  uint64_t tensor_multiply_adds = 0;
  std::map<uint32_t, BufferCounters> buffers;
  // With the cache model on (CacheSpec::enabled): bytes read from and written to DRAM, and the
  // line accesses that hit or missed each level (repeats of a line within a threadgroup's last
  // kTraceWindow distinct lines merged, cache.cpp).
  bool cache = false;
  uint64_t dram_read = 0;
  uint64_t dram_written = 0;
  uint64_t l2_hits = 0;
  uint64_t l2_misses = 0;
  uint64_t slc_hits = 0;
  uint64_t slc_misses = 0;
  // With LaunchSpec::count_instructions: what the simdgroups issued, in the order of
  // torch_steel/sim/ir.py's FIELDS (instruction classes, MMAs by dtype, threadgroup and device
  // load and store instructions), per simdgroup and basic block as runtime.cpp folds them.
  bool instruction_counts = false;
  uint64_t issued[16] = {};
  // Bytes read through [[buffer(n)]] parameters in the constant address space (also in buffers).
  uint64_t constant_read = 0;
};

// Runs one dispatch to completion. Throws SimError on any fault; buffers are then not written
// back. One launch at a time per process (a global lock serializes callers).
Counters launch(const LaunchSpec& spec);
// The same, with the counters of each of spec.groups (one Counters when it is empty).
std::vector<Counters> launch_groups(const LaunchSpec& spec);

// A plan slot's tensor as bound: element 0 and the bytes its view can reach.
struct SlotArg {
  bool present = false;
  void* host = nullptr;
  size_t bytes = 0;
};

// Executes every dispatch of `plan` in order through steel::encode_plan, like the Metal host.
std::vector<Counters> run_plan(const Library* library, const steel::Plan& plan,
                               const std::vector<SlotArg>& slots, bool checkers);
// The same with a cache model and threadgroup groups per dispatch (index = the dispatch's
// position in the plan; missing entries: off / every threadgroup): the counters of each group of
// each dispatch.
std::vector<std::vector<Counters>> run_plan_groups(
    const Library* library, const steel::Plan& plan, const std::vector<SlotArg>& slots,
    bool checkers, const std::vector<CacheSpec>& caches,
    const std::vector<std::vector<std::vector<uint32_t>>>& groups,
    bool count_instructions = false);

}  // namespace steel_sim
