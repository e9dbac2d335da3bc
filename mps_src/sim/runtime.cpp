// The execution half of the simulator: kernel registry, lanes as fibers, the per-threadgroup
// scheduler, barriers and simd rendezvous, function constants and launches.
//
// Scheduling. A threadgroup's lanes start in a ready queue in lane order. A lane runs until it
// waits at a rendezvous (threadgroup_barrier, simdgroup_barrier, simd_exchange) or exits, then
// switches directly to the next ready lane; the last lane to arrive at a rendezvous completes it,
// queues the others and keeps running. Only when no lane is ready does control return to the
// scheduler, which then either starts the next threadgroup or reports the lanes still waiting.
//
// Divergence. Lanes of one simdgroup must meet at the same kind of rendezvous: a lane arriving
// at a simd operation while others of its simdgroup wait at a threadgroup barrier (or the other
// way round), or at a simd operation of another kind or size, is an error naming the kernel.
// Exited lanes leave every rendezvous, as on the GPU. Each rendezvous is also identified by its
// call site (the return address into shader code; shader_prelude.h keeps one source-level call
// one call site), so lanes that reach two different barriers, e.g. `if (sg == 0) barrier();
// barrier();`, are reported instead of being matched with each other.
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include "state.h"

namespace steel_sim {

struct Library {
  std::string path;
  std::vector<void*> handles;
  std::map<std::string, KernelEntry> kernels;
  std::map<std::string, uint32_t> max_threads;  // [[max_total_threads_per_threadgroup]]
  std::vector<std::string> duplicates;
};

namespace detail {

Sim g;

namespace {

// Thrown by run_threadgroup when a lane called lane_restart; caught by run_grid.
struct Restart {};

std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

// Libraries by path; the one being dlopen'd receives the registrations of its static
// initializers.
std::map<std::string, std::unique_ptr<Library>>& libraries() {
  static std::map<std::string, std::unique_ptr<Library>> libs;
  return libs;
}
Library* g_loading = nullptr;

// Ctrl-C during a launch: Python's own handler cannot run until the launch returns, so the
// launch watches for SIGINT itself and stops at the next lane switch or threadgroup.
volatile sig_atomic_t g_interrupted = 0;
Library& orphan_library() {  // registrations from a library loaded some other way
  static Library lib;
  return lib;
}

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list again;
  va_copy(again, args);
  int n = vsnprintf(nullptr, 0, fmt, args);
  va_end(args);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  vsnprintf(out.data(), out.size() + 1, fmt, again);
  va_end(again);
  return out;
}

const char* simd_kind_name(SimdKind kind) {
  switch (kind) {
    case SimdKind::Shuffle:
      return "simd shuffle/broadcast";
    case SimdKind::Reduce:
      return "simd reduction";
    case SimdKind::Ballot:
      return "simd ballot/vote";
    case SimdKind::MatrixLoad:
      return "simdgroup_load";
    case SimdKind::MatrixStore:
      return "simdgroup_store";
    case SimdKind::MatrixMma:
      return "simdgroup_multiply_accumulate";
    case SimdKind::TensorOp:
      return "tensor operation (mpp::tensor_ops)";
  }
  return "simd operation";
}

std::string describe_simd(const SimdGroup& sg) {
  if (sg.wait == SimdWait::Barrier) return "simdgroup_barrier";
  return format("%s (%zu bytes per lane)", simd_kind_name(sg.kind), sg.bytes);
}

std::string lane_list(uint32_t mask, uint32_t first) {
  std::string out;
  for (uint32_t i = 0; i < 32; ++i) {
    if (!(mask & (1u << i))) continue;
    uint32_t j = i;
    while (j + 1 < 32 && (mask & (1u << (j + 1)))) ++j;
    if (!out.empty()) out += ",";
    out += j == i ? format("%u", first + i) : format("%u-%u", first + i, first + j);
    i = j;
  }
  return out.empty() ? "none" : out;
}

// ---------------------------------------------------------------------------- lane switching

// Instruction counters: a simdgroup issues a basic block once for all its lanes that run it.
// Lanes run as fibers on their own between rendezvous, so the issue count of a block between
// two rendezvous of the simdgroup is the largest number of times one of its lanes ran it: a
// divergent if/else issues both paths, a loop whose trip count differs per lane issues the
// longest. (Two lanes running one block at different times in that span, as in a loop whose
// branch alternates between lanes, count as one: an undercount.)
void fold_block_runs(SimdGroup& sg) {
  for (const SimdGroup::BlockRuns& r : sg.runs) {
    uint32_t most = 0;
    for (uint32_t n : r.lanes) most = std::max(most, n);
    for (int k = 0; k < 16; ++k) g.counters.issued[k] += uint64_t{most} * r.histogram[k];
  }
  sg.runs.clear();
  sg.run_index.clear();
}

void fold_all_block_runs() {
  if (steel_sim_counting == 0) return;
  for (SimdGroup& sg : g.groups) fold_block_runs(sg);
}

// g.ready has a power-of-two size of at least the lane count: each lane is queued at most once.
void push_ready(Lane* lane) {
  lane->wait = Wait::Ready;
  g.ready[(g.ready_head + g.ready_count) & (g.ready.size() - 1)] = lane->index;
  ++g.ready_count;
}

Lane* pop_ready() {
  if (g.ready_count == 0) return nullptr;
  Lane* lane = &g.lanes[g.ready[g.ready_head]];
  g.ready_head = (g.ready_head + 1) & (g.ready.size() - 1);
  --g.ready_count;
  return lane;
}

// Leaves lane `me`: runs the next ready lane, or goes back to the scheduler when there is none.
void switch_from(Lane* me) {
  Lane* next = pop_ready();
  ++g.counters.lane_switches;
  if (next != nullptr) {
    next->wait = Wait::Running;
    g.cur = next;
    switch_context(&me->ctx, &next->ctx);
  } else {
    g.cur = nullptr;
    switch_context(&me->ctx, &g.scheduler);
  }
}

// The running lane waits (its `wait` is already set). Returns when some lane completes the
// rendezvous and this lane's turn comes.
void block() {
  g.run_accesses = 0;
  if (g_interrupted) lane_fail("interrupted");
  switch_from(g.cur);
}

// Collectives whose result on a lane depends on other lanes' values: shuffles, reductions,
// ballots and simdgroup-matrix multiplies (a simdgroup-matrix load or store moves each lane's
// own elements; a simdgroup_barrier exchanges nothing).
bool combines_lanes(SimdKind kind) {
  return kind == SimdKind::Shuffle || kind == SimdKind::Reduce || kind == SimdKind::Ballot ||
         kind == SimdKind::MatrixMma;
}

// Records that the lanes in `mask` of simdgroup `sg` (lane 0 of which is `first`) took part in
// one collective, for the race checker's rule on reads before a collective (checkers.cpp:
// collective_orders). The common case, every lane, is one store.
void met_in_collective(SimdGroup& sg, uint32_t first, uint32_t mask) {
  const uint32_t id = ++g.simd_epochs;
  if (mask == sg.members) {
    sg.all_met = id;
    return;
  }
  for (uint32_t i = 0; i < kSimdWidth; ++i) {
    if (!(mask & (1u << i))) continue;
    Lane& lane = g.lanes[first + i];
    for (uint32_t j = 0; j < kSimdWidth; ++j) {
      if (mask & (1u << j)) lane.met[j] = id;
    }
  }
}

// One completed simd operation of the lanes in `mask` (all of the simdgroup's waiting lanes, or
// those that reached one call site in divergent control flow).
void complete_simd_lanes(SimdGroup& sg, uint32_t mask) {
  bool exchange = sg.wait == SimdWait::Exchange;
  uint32_t first = static_cast<uint32_t>(&sg - g.groups.data()) * kSimdWidth;
  const Lane& lead = g.lanes[first + static_cast<uint32_t>(__builtin_ctz(mask))];
  const size_t bytes = lead.exchange_bytes;
  if (exchange && bytes != 0) {
    for (uint32_t i = 0; i < kSimdWidth; ++i) {
      if (!(mask & (1u << i))) continue;
      std::memcpy(sg.buf[1] + i * bytes, sg.buf[0] + i * kMaxExchangeBytes, bytes);
    }
  }
  const void* result = sg.buf[1];
  if (steel_sim_counting != 0) fold_block_runs(sg);
  ++g.counters.simd_ops;
  if (exchange) {
    switch (lead.exchange_kind) {
      case SimdKind::MatrixMma:
        ++g.counters.mma;
        break;
      case SimdKind::Shuffle:
        ++g.counters.shuffles;
        break;
      case SimdKind::Reduce:
        ++g.counters.reductions;
        break;
      case SimdKind::Ballot:
        ++g.counters.ballots;
        break;
      default:
        break;
    }
  }
  if (exchange && combines_lanes(lead.exchange_kind)) met_in_collective(sg, first, mask);
  for (uint32_t i = 0; i < kSimdWidth; ++i) {
    if (!(mask & (1u << i))) continue;
    Lane& lane = g.lanes[first + i];
    lane.exchange_result = result;
    lane.exchange_mask = mask;
    if (&lane != g.cur) push_ready(&lane);
  }
}

// Whether call chain a reaches its operation earlier in the program than b: compared from the
// outermost frame inward, at the first frame where they differ.
bool earlier(const CallChain& a, const CallChain& b) {
  uint32_t i = 0;
  while (i < a.n && i < b.n && a.pc[a.n - 1 - i] == b.pc[b.n - 1 - i]) ++i;
  if (i == a.n || i == b.n) return a.n > b.n;  // deeper in a shared path: inside a call
  return a.pc[a.n - 1 - i] < b.pc[b.n - 1 - i];
}

// Completes the simdgroup's pending simd operation once every live lane of it waits (at it, or,
// for shuffles, reductions and ballots, at another call site or a threadgroup barrier): lanes at
// one call site complete together, each site on its own, as divergent branches run on the GPU.
void try_complete_simd(SimdGroup& sg) {
  if (sg.arrived == 0 || (sg.arrived | sg.at_barrier) != sg.live) return;
  bool exchange = sg.wait == SimdWait::Exchange;
  uint32_t first = static_cast<uint32_t>(&sg - g.groups.data()) * kSimdWidth;
  // The lanes at the call site that comes first in the program complete; the others wait on, as
  // lanes that skipped a branch wait at the join point on the GPU for those in it. "First" is
  // the lower code address where the call chains part (compiled code keeps a branch body
  // before its join point, a loop body before its exit).
  uint32_t lead = static_cast<uint32_t>(__builtin_ctz(sg.arrived));
  for (uint32_t i = lead + 1; i < kSimdWidth; ++i) {
    if (!(sg.arrived & (1u << i))) continue;
    const Lane& a = g.lanes[first + i];
    const Lane& b = g.lanes[first + lead];
    if (a.site_key != b.site_key && earlier(a.site, b.site)) lead = i;
  }
  const uint64_t key = g.lanes[first + lead].site_key;
  uint32_t mask = 0;
  for (uint32_t i = 0; i < kSimdWidth; ++i) {
    if ((sg.arrived & (1u << i)) && g.lanes[first + i].site_key == key) mask |= 1u << i;
  }
  complete_simd_lanes(sg, mask);
  sg.arrived &= ~mask;
  if (sg.arrived != 0) return;  // the other call sites: when all lanes wait again
  sg.wait = SimdWait::None;
  // Only a simdgroup_barrier with memory flags orders memory between the lanes of a simdgroup
  // (MSL); a simd_sum or a simdgroup-matrix operation synchronizes execution only.
  if (!exchange && (sg.flags & kMemThreadgroup)) sg.epoch = ++g.simd_epochs;
  if (!exchange && (sg.flags & kMemDevice)) sg.dev_epoch = ++g.simd_epochs;
}

bool divergence_allowed(SimdWait wait, SimdKind kind) {
  return wait == SimdWait::Exchange &&
         (kind == SimdKind::Shuffle || kind == SimdKind::Reduce || kind == SimdKind::Ballot);
}

constexpr const char* kThreadgroupBarrier = "threadgroup_barrier";

void complete_barrier() {
  if (g.barrier_what == kThreadgroupBarrier) ++g.counters.barriers;
  fold_all_block_runs();
  g.barrier_live = g.live;
  g.at_barrier = 0;
  for (SimdGroup& sg : g.groups) sg.at_barrier = 0;
  // Each memory flag orders its own memory for every lane; without flags (mem_none) it is an
  // execution barrier only: memory written before it is not guaranteed visible after it, not
  // even to lanes of the writer's simdgroup.
  if (g.barrier_flags & kMemThreadgroup) ++g.epoch;
  if (g.barrier_flags & kMemDevice) ++g.dev_epoch;
  for (uint32_t i = 0; i < g.nlanes; ++i) {
    Lane& lane = g.lanes[i];
    if (lane.wait == Wait::Barrier && &lane != g.cur) push_ready(&lane);
  }
}

[[noreturn]] void lane_exit() {
  Lane* me = g.cur;
  g.run_accesses = 0;
  me->wait = Wait::Exited;
  SimdGroup& sg = g.groups[me->sg];
  sg.live &= ~(1u << (me->index % kSimdWidth));
  --g.live;
  g.cur = nullptr;  // so that completing a rendezvous queues every waiting lane
  try_complete_simd(sg);
  if (g.at_barrier != 0 && g.at_barrier == g.live) complete_barrier();
  switch_from(me);
  __builtin_unreachable();
}

void lane_main(void* arg) {
  (void)arg;
  // Taking the frame address keeps a frame pointer here, so the call chains of rendezvous
  // (call_chain) end in this frame, whose caller's frame pointer is null.
  __asm__ volatile("" : : "r"(__builtin_frame_address(0)));
  g.entry();
  lane_exit();
}

uint32_t simd_lane_bit(const Lane* lane) { return 1u << (lane->index % kSimdWidth); }

// ------------------------------------------------------------------------------ threadgroups

void start_threadgroup(uint32_t x, uint32_t y, uint32_t z) {
  g.tg_pos[0] = x;
  g.tg_pos[1] = y;
  g.tg_pos[2] = z;
  g.tg_id = 1 + x + g.grid[0] * (y + g.grid[1] * z);
  // dispatchThreads: the last threadgroup in a dimension holds what is left of the grid there.
  // Metal gives it threads_per_threadgroup of that size and forms its simdgroups from its own
  // linear thread indices, as for a threadgroup dispatched at that size; positions in the grid
  // still step by the dispatch's threadgroup size (dispatch_threads_per_threadgroup).
  uint32_t t[3];
  for (int d = 0; d < 3; ++d) {
    t[d] = g.threads_grid[0] == 0
               ? g.threads[d]
               : std::min(g.threads[d], g.threads_grid[d] - g.tg_pos[d] * g.threads[d]);
  }
  g.nlanes = t[0] * t[1] * t[2];
  g.nsimd = (g.nlanes + kSimdWidth - 1) / kSimdWidth;
  ++g.epoch;
  ++g.dev_epoch;
  g.live = g.nlanes;
  g.at_barrier = 0;
  g.scope_count.assign(g.nlanes, 0);
  g.ready_head = 0;
  g.ready_count = 0;
  for (uint32_t s = 0; s < g.nsimd; ++s) {
    SimdGroup& sg = g.groups[s];
    uint32_t n = std::min(kSimdWidth, g.nlanes - s * kSimdWidth);
    sg.live = n == 32 ? ~0u : (1u << n) - 1;
    sg.members = sg.live;
    sg.arrived = 0;
    sg.at_barrier = 0;
    sg.wait = SimdWait::None;
    sg.epoch = ++g.simd_epochs;
    sg.dev_epoch = ++g.simd_epochs;
    sg.runs.clear();  // a threadgroup abandoned for a restart leaves some
    sg.run_index.clear();
  }
  for (uint32_t i = 0; i < g.nlanes; ++i) {
    Lane& lane = g.lanes[i];
    LaneInfo& info = lane.info;
    uint32_t local[3] = {i % t[0], (i / t[0]) % t[1], i / (t[0] * t[1])};
    for (int d = 0; d < 3; ++d) {
      info.thread_position_in_threadgroup[d] = local[d];
      info.threadgroup_position_in_grid[d] = g.tg_pos[d];
      info.threads_per_threadgroup[d] = t[d];
      info.dispatch_threads_per_threadgroup[d] = g.threads[d];
      info.threadgroups_per_grid[d] = g.grid[d];
      info.threads_per_grid[d] =
          g.threads_grid[0] == 0 ? g.grid[d] * g.threads[d] : g.threads_grid[d];
      info.thread_position_in_grid[d] = g.tg_pos[d] * g.threads[d] + local[d];
    }
    info.thread_index_in_threadgroup = i;
    info.simdgroup_index_in_threadgroup = i / kSimdWidth;
    info.thread_index_in_simdgroup = i % kSimdWidth;
    info.simdgroups_per_threadgroup = g.nsimd;
    info.threads_per_simdgroup = kSimdWidth;
    lane.index = i;
    lane.sg = i / kSimdWidth;
    lane.exchange_result = nullptr;
    lane.exchange_mask = 0;
    make_context(&lane.ctx, g.stacks.stack(i), g.stacks.size(), &lane_main, &lane);
    push_ready(&lane);
  }
  start_threadgroup_memory();
  if (g.cache_on) cache_start_threadgroup(g.tg_id - 1);
}

std::string describe_waits() {
  std::string out;
  for (const SimdGroup& sg : g.groups) {
    uint32_t first = static_cast<uint32_t>(&sg - g.groups.data()) * kSimdWidth;
    if (sg.at_barrier) {
      out += " lanes " + lane_list(sg.at_barrier, first) + " at " + g.barrier_what + ";";
    }
    if (sg.arrived) {
      out += " lanes " + lane_list(sg.arrived, first) + " at " + describe_simd(sg) + ";";
    }
  }
  return out;
}

void run_threadgroup(uint32_t x, uint32_t y, uint32_t z) {
  start_threadgroup(x, y, z);
  while (Lane* lane = pop_ready()) {
    lane->wait = Wait::Running;
    g.cur = lane;
    g.run_accesses = 0;
    ++g.counters.lane_switches;
    switch_context(&g.scheduler, &lane->ctx);
    g.cur = nullptr;
    if (g.failed) {
      if (g.restart) throw Restart{};
      if (g_interrupted) throw Interrupted(g.error);
      throw SimError(g.error);
    }
  }
  fold_all_block_runs();
  if (g.live != 0) {
    throw SimError(format("kernel '%s' threadgroup (%u,%u,%u): lanes wait forever:",
                          g.kernel.c_str(), x, y, z) +
                   describe_waits());
  }
}

// While a launch runs, a fault in shader code (a wild pointer, a fiber stack overflow, an integer
// division by zero) becomes a SimulatorError of the lane instead of killing the process: the
// handler, on its own signal stack, unblocks the signal and abandons the lane like lane_fail.
// Faults outside a lane go to the previous handler (e.g. Python's faulthandler).
constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
struct sigaction g_old_actions[4];

pthread_t g_launch_thread;

const void* fault_pc(void* context) {
#if defined(__x86_64__) && defined(__linux__)
  // +1: lane_fail names the instruction before a return address; this is the faulting one.
  return reinterpret_cast<const char*>(
             static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_RIP]) + 1;
#else
  (void)context;
  return nullptr;
#endif
}

void on_fault(int sig, siginfo_t* info, void* context) {
  if (g.cur == nullptr || !pthread_equal(pthread_self(), g_launch_thread)) {
    for (size_t i = 0; i < 4; ++i) {
      if (kSignals[i] == sig) sigaction(sig, &g_old_actions[i], nullptr);
    }
    return;  // the faulting instruction runs again under the previous handler
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  sigprocmask(SIG_UNBLOCK, &set, nullptr);
  const void* addr = info->si_addr;
  if (sig == SIGFPE) {
    lane_fail("arithmetic fault (SIGFPE: integer division by zero or overflow) in shader code",
              fault_pc(context));
  }
  if (sig == SIGILL) lane_fail("illegal instruction (SIGILL) in shader code", fault_pc(context));
  if (g.stacks.in_guard(addr)) {
    lane_fail(format("lane stack overflow (%zu KiB per lane; set TORCH_STEEL_SIM_STACK_KB to "
                     "raise it, but MSL kernels rarely need this much: recursion?)",
                     g.stacks.size() / 1024),
              fault_pc(context));
  }
  lane_fail(format("invalid memory access at %p (%s) in shader code: a pointer outside every "
                   "bound buffer, threadgroup memory and the lane's own variables",
                   addr, sig == SIGBUS ? "SIGBUS" : "SIGSEGV"),
            fault_pc(context));
}

class FaultHandlers {
 public:
  FaultHandlers() {
    g_launch_thread = pthread_self();
    static std::vector<char> alt(256 * 1024);
    stack_t ss{};
    ss.ss_sp = alt.data();
    ss.ss_size = alt.size();
    sigaltstack(&ss, &old_stack_);
    struct sigaction sa {};
    sa.sa_sigaction = &on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < 4; ++i) sigaction(kSignals[i], &sa, &g_old_actions[i]);
  }
  ~FaultHandlers() {
    for (size_t i = 0; i < 4; ++i) sigaction(kSignals[i], &g_old_actions[i], nullptr);
    sigaltstack(&old_stack_, nullptr);
  }
  FaultHandlers(const FaultHandlers&) = delete;
  FaultHandlers& operator=(const FaultHandlers&) = delete;

 private:
  stack_t old_stack_{};
};

void on_interrupt(int) { g_interrupted = 1; }

class InterruptHandler {
 public:
  InterruptHandler() {
    g_interrupted = 0;
    struct sigaction sa {};
    sa.sa_handler = &on_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_);
  }
  ~InterruptHandler() { sigaction(SIGINT, &old_, nullptr); }
  InterruptHandler(const InterruptHandler&) = delete;
  InterruptHandler& operator=(const InterruptHandler&) = delete;

 private:
  struct sigaction old_ {};
};

#if defined(__linux__)
// A lane stuck in a loop that touches no device or threadgroup memory (an exit condition that is
// never met) would hang the process. A per-launch timer on the launching thread checks every
// second that lanes still switch; after TORCH_STEEL_SIM_LANE_TIMEOUT seconds (default 60)
// without a switch, the running lane fails from the signal handler, like a fault.
const int kWatchdogSignal = SIGRTMIN + 3;
volatile uint64_t g_watchdog_seen = 0;
volatile unsigned g_watchdog_stuck = 0;
unsigned g_watchdog_limit = 60;

void on_watchdog(int sig, siginfo_t*, void* context) {
  if (g.counters.lane_switches != g_watchdog_seen) {
    g_watchdog_seen = g.counters.lane_switches;
    g_watchdog_stuck = 0;
    return;
  }
  if (++g_watchdog_stuck < g_watchdog_limit || g.cur == nullptr) return;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  sigprocmask(SIG_UNBLOCK, &set, nullptr);
  lane_fail(format("ran for %u s without reaching a barrier, a simd operation or its end: an "
                   "endless loop? (TORCH_STEEL_SIM_LANE_TIMEOUT sets the limit in seconds)",
                   g_watchdog_limit),
            fault_pc(context));
}

class Watchdog {
 public:
  Watchdog() {
    const char* env = std::getenv("TORCH_STEEL_SIM_LANE_TIMEOUT");
    unsigned long limit = env != nullptr ? std::strtoul(env, nullptr, 10) : 0;
    g_watchdog_limit = limit > 0 ? static_cast<unsigned>(limit) : 60;
    g_watchdog_seen = ~uint64_t{0};
    g_watchdog_stuck = 0;
    struct sigaction sa {};
    sa.sa_sigaction = &on_watchdog;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(kWatchdogSignal, &sa, &old_);
    sigevent ev{};
    ev.sigev_notify = SIGEV_THREAD_ID;
    ev.sigev_signo = kWatchdogSignal;
    ev._sigev_un._tid = static_cast<pid_t>(syscall(SYS_gettid));
    armed_ = timer_create(CLOCK_MONOTONIC, &ev, &timer_) == 0;
    if (armed_) {
      itimerspec spec{};
      spec.it_value.tv_sec = 1;
      spec.it_interval.tv_sec = 1;
      timer_settime(timer_, 0, &spec, nullptr);
    }
  }
  ~Watchdog() {
    if (armed_) timer_delete(timer_);
    sigaction(kWatchdogSignal, &old_, nullptr);
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  struct sigaction old_ {};
  timer_t timer_{};
  bool armed_ = false;
};
#else
struct Watchdog {
  Watchdog() {}  // per-thread timers are Linux-only (SIGEV_THREAD_ID): no watchdog
};
#endif

size_t stack_bytes() {
  const char* env = std::getenv("TORCH_STEEL_SIM_STACK_KB");
  size_t kb = env != nullptr ? std::strtoul(env, nullptr, 10) : 0;
  return (kb > 0 ? kb : 256) * 1024;
}

}  // namespace

std::string where() {
  std::string out = format("kernel '%s' threadgroup (%u,%u,%u)", g.kernel.c_str(), g.tg_pos[0],
                           g.tg_pos[1], g.tg_pos[2]);
  if (g.cur != nullptr) {
    const LaneInfo& i = g.cur->info;
    out += format(" thread (%u,%u,%u)", i.thread_position_in_threadgroup[0],
                  i.thread_position_in_threadgroup[1], i.thread_position_in_threadgroup[2]);
  }
  return out + ": ";
}

std::string pc_text(const void* pc) {
  Dl_info info;
  if (pc == nullptr || dladdr(pc, &info) == 0 || info.dli_fname == nullptr) return "";
  // A return address points after the call: name the call instruction instead.
  auto offset = reinterpret_cast<uintptr_t>(pc) - reinterpret_cast<uintptr_t>(info.dli_fbase);
  return format(" [pc %s+0x%zx]", info.dli_fname, static_cast<size_t>(offset - 1));
}

void lane_fail(std::string message, const void* pc) {
  std::string full = where() + message + pc_text(pc);
  if (g.cur == nullptr) throw SimError(full);
  g.failed = true;
  g.error = std::move(full);
  full.clear();
  full.shrink_to_fit();  // the lane's stack is abandoned: free what it owns first
  message.clear();
  message.shrink_to_fit();
  Lane* me = g.cur;
  g.cur = nullptr;
  switch_context(&me->ctx, &g.scheduler);
  __builtin_unreachable();
}

void lane_restart() {
  g.failed = true;
  g.restart = true;
  Lane* me = g.cur;
  g.cur = nullptr;
  switch_context(&me->ctx, &g.scheduler);
  __builtin_unreachable();
}

}  // namespace detail

using namespace detail;

// ------------------------------------------------------------------------ runtime.h (shaders)

const LaneInfo& lane() {
  static const LaneInfo none{};
  return g.cur != nullptr ? g.cur->info : none;
}

void* buffer(uint32_t index) {
  // Metal lets a dispatch leave a parameter unbound that the compiled kernel does not use (a
  // mask pointer only offset and read under a false template constant): poison, as for a
  // buffer a function constant disables, so that only an access that matters is an error.
  if (index > kMaxBufferIndex || !g.buffer_bound[index]) return bind_disabled(index, true);
  return g.buffer_base[index];
}

void* disabled_buffer(uint32_t index) { return bind_disabled(index, false); }

void constant_buffer(uint32_t index) {
  if (index <= kMaxBufferIndex) g.constant_buffers |= 1u << index;
}

void* threadgroup_buffer(uint32_t index) {
  auto it = g.tg_args.find(index);
  if (it == g.tg_args.end()) {
    lane_fail(format("[[threadgroup(%u)]] has no threadgroup memory length set by this dispatch",
                     index),
              __builtin_return_address(0));
  }
  return g.tg_base + it->second.first;
}

void* threadgroup_array(uint32_t decl_id, size_t bytes, size_t align) {
  return allocate_threadgroup_array(decl_id, bytes, align, __builtin_return_address(0));
}

bool worst_precision() { return g.worst_precision; }
uint64_t precision_seed() { return g.precision_seed; }

bool function_constant_defined(uint32_t index) { return g.constants.count(index) != 0; }

namespace {
const steel::FunctionConstant& constant(uint32_t index, const void* pc) {
  auto it = g.constants.find(index);
  if (it == g.constants.end()) {
    lane_fail(format("function constant %u is used but not set by this dispatch", index), pc);
  }
  return it->second;
}
}  // namespace

namespace {
const char* constant_type_name(steel::FunctionConstant::Type t) {
  switch (t) {
    case steel::FunctionConstant::Type::Bool:
      return "bool";
    case steel::FunctionConstant::Type::Int:
      return "int";
    case steel::FunctionConstant::Type::UInt:
      return "uint";
    case steel::FunctionConstant::Type::Float:
      return "float";
  }
  return "?";
}

[[noreturn]] void constant_type_error(uint32_t index, const char* declared,
                                      const steel::FunctionConstant& c, const void* pc) {
  lane_fail(format("function constant %u is declared %s but the dispatch sets a %s value (Metal "
                   "refuses a constant value of another type)",
                   index, declared, constant_type_name(c.type)),
            pc);
}
}  // namespace

bool function_constant_bool(uint32_t index) {
  const void* pc = __builtin_return_address(0);
  const steel::FunctionConstant& c = constant(index, pc);
  if (c.type != steel::FunctionConstant::Type::Bool) constant_type_error(index, "bool", c, pc);
  return c.int_value != 0;
}

int64_t function_constant_int(uint32_t index) {
  const void* pc = __builtin_return_address(0);
  const steel::FunctionConstant& c = constant(index, pc);
  if (c.type != steel::FunctionConstant::Type::Int && c.type != steel::FunctionConstant::Type::UInt) {
    constant_type_error(index, "an integer", c, pc);
  }
  return c.int_value;
}

float function_constant_float(uint32_t index) {
  const void* pc = __builtin_return_address(0);
  const steel::FunctionConstant& c = constant(index, pc);
  if (c.type != steel::FunctionConstant::Type::Float) {
    constant_type_error(index, "floating point", c, pc);
  }
  return c.float_value;
}

namespace {

// The call chain of the running lane from `frame`, the frame of the runtime function that shader
// code called (its __builtin_frame_address(0)). Shader code keeps frame pointers
// (-fno-omit-frame-pointer), so the chain runs from frame to frame up to lane_main, whose caller's
// frame pointer is null (fiber.cpp). Only frames on the lane's own stack are followed. Without
// the checkers only the innermost return address counts, as divergence is not checked then.
__attribute__((always_inline)) inline CallChain call_chain(void* frame) {
  CallChain chain;
  auto** fp = static_cast<void**>(frame);
  chain.pc[0] = fp[1];
  chain.n = 1;
  chain.key = reinterpret_cast<uintptr_t>(fp[1]);
  if (!g.checkers || g.cur == nullptr) return chain;
  const auto lo = reinterpret_cast<uintptr_t>(g.stacks.stack(g.cur->index));
  const uintptr_t hi = lo + g.stacks.size();
  for (uint32_t depth = 0; depth < 64; ++depth) {
    auto** next = static_cast<void**>(fp[0]);
    auto n = reinterpret_cast<uintptr_t>(next);
    if (n <= reinterpret_cast<uintptr_t>(fp) || n + 16 > hi || n < lo || (n & 7) != 0) break;
    fp = next;
    if (chain.n < CallChain::kMax) chain.pc[chain.n++] = fp[1];
    chain.key = chain.key * 0x9E3779B97F4A7C15ull + reinterpret_cast<uintptr_t>(fp[1]);
  }
  return chain;
}

// " at <where a waits>\nThis thread: at <where this lane is>", naming the innermost frame in
// which the two chains differ (a helper's call site rather than the barrier inside the helper).
std::string two_sites(const CallChain& waiting, const CallChain& mine) {
  uint32_t i = 0;
  while (i + 1 < waiting.n && i + 1 < mine.n && waiting.pc[i] == mine.pc[i]) ++i;
  return pc_text(waiting.pc[i]) + "\nThis thread:" + pc_text(mine.pc[i]);
}

void barrier(uint32_t flags, const CallChain& site, const char* what = kThreadgroupBarrier) {
  Lane* me = g.cur;
  if (me == nullptr) lane_fail(std::string(what) + " outside a kernel");
  SimdGroup& sg = g.groups[me->sg];
  if (sg.arrived != 0 && !sg.divergent_ok) {
    lane_fail(std::string(what) + " while lanes " + lane_list(sg.arrived, me->sg * kSimdWidth) +
              " of its simdgroup wait at " + describe_simd(sg) +
              " (divergent control flow). They wait:" + two_sites(sg.site, site));
  }
  if (g.at_barrier == 0) {
    g.barrier_site = site;
    g.barrier_flags = flags;
    g.barrier_what = what;
  } else if (g.checkers && (site.key != g.barrier_site.key || what != g.barrier_what)) {
    lane_fail(format("reached a different %s call than the %u threads already waiting at %s "
                     "(divergent control flow). They wait:",
                     what, g.at_barrier, g.barrier_what) +
              two_sites(g.barrier_site, site));
  }
  sg.at_barrier |= simd_lane_bit(me);
  ++g.at_barrier;
  try_complete_simd(sg);  // lanes of this simdgroup at a shuffle or reduction go on
  if (g.at_barrier == g.live) {
    complete_barrier();
    return;
  }
  me->wait = Wait::Barrier;
  block();
}
}  // namespace

void threadgroup_barrier() { barrier(~0u, call_chain(__builtin_frame_address(0))); }

void threadgroup_barrier_flags(uint32_t mem_flags) {
  barrier(mem_flags, call_chain(__builtin_frame_address(0)));
}

namespace {
void simd_arrive(SimdWait wait, SimdKind kind, size_t bytes, const void* mine,
                 const CallChain& site, uint32_t flags = 0) {
  Lane* me = g.cur;
  SimdGroup& sg = g.groups[me->sg];
  const bool may_diverge = divergence_allowed(wait, kind);
  if (sg.at_barrier != 0 && !may_diverge) {
    std::string what = wait == SimdWait::Barrier ? "simdgroup_barrier" : simd_kind_name(kind);
    lane_fail(what + " while lanes " + lane_list(sg.at_barrier, me->sg * kSimdWidth) +
              " of its simdgroup wait at " + g.barrier_what +
              " (divergent control flow). They wait:" +
              two_sites(g.barrier_site, site));
  }
  if (sg.arrived != 0) {
    const bool apart = site.key != sg.site.key;
    if (apart && may_diverge && sg.divergent_ok) {
      // Another call site of a shuffle or reduction: completed on its own (try_complete_simd).
    } else if (sg.wait != wait ||
               (wait == SimdWait::Exchange && (sg.kind != kind || sg.bytes != bytes))) {
      std::string what = wait == SimdWait::Barrier
                             ? std::string("simdgroup_barrier")
                             : format("%s (%zu bytes per lane)", simd_kind_name(kind), bytes);
      lane_fail(what + " while lanes " + lane_list(sg.arrived, me->sg * kSimdWidth) +
                " of its simdgroup wait at " + describe_simd(sg) +
                " (divergent control flow). They wait:" + two_sites(sg.site, site));
    } else if (g.checkers && apart) {
      lane_fail(format("reached a different %s call than lanes %s of its simdgroup (divergent "
                       "control flow). They wait:",
                       wait == SimdWait::Barrier ? "simdgroup_barrier" : simd_kind_name(kind),
                       lane_list(sg.arrived, me->sg * kSimdWidth).c_str()) +
                two_sites(sg.site, site));
    }
  } else {
    sg.wait = wait;
    sg.kind = kind;
    sg.bytes = bytes;
    sg.site = site;
    sg.flags = flags;
    sg.divergent_ok = may_diverge;
  }
  me->site_key = may_diverge ? site.key : sg.site.key;
  me->exchange_bytes = bytes;
  me->exchange_kind = kind;
  if (may_diverge) me->site = site;
  if (mine != nullptr) {
    std::memcpy(sg.buf[0] + (me->index % kSimdWidth) * kMaxExchangeBytes, mine, bytes);
  }
  sg.arrived |= simd_lane_bit(me);
  try_complete_simd(sg);
  if (!(sg.arrived & simd_lane_bit(me))) return;  // completed
  me->wait = Wait::Simd;
  block();
}
}  // namespace

namespace {
void simd_barrier(uint32_t flags, const CallChain& site) {
  if (g.cur == nullptr) lane_fail("simdgroup_barrier outside a kernel");
  simd_arrive(SimdWait::Barrier, SimdKind::Shuffle, 0, nullptr, site, flags);
}
}  // namespace

void simdgroup_barrier() { simd_barrier(~0u, call_chain(__builtin_frame_address(0))); }

void simdgroup_barrier_flags(uint32_t mem_flags) {
  simd_barrier(mem_flags, call_chain(__builtin_frame_address(0)));
}

const void* simd_exchange(const void* mine, size_t bytes, SimdKind kind, uint32_t* active_mask) {
  const CallChain site = call_chain(__builtin_frame_address(0));
  if (g.cur == nullptr) lane_fail("simd operation outside a kernel");
  if (bytes > kMaxExchangeBytes) {
    lane_fail(format("simd_exchange of %zu bytes per lane (the simulator supports up to %zu)",
                     bytes, kMaxExchangeBytes));
  }
  simd_arrive(SimdWait::Exchange, kind, bytes, mine, site);
  if (active_mask != nullptr) *active_mask = g.cur->exchange_mask;
  return g.cur->exchange_result;
}

namespace {
// The checks both rendezvous of a tensor operation make before waiting.
void tensor_scope_check(uint32_t simdgroups, const char* op) {
  if (g.cur == nullptr) lane_fail(std::string(op) + " outside a kernel");
  if (simdgroups > 1 && (simdgroups != g.nsimd || g.nlanes != simdgroups * kSimdWidth)) {
    lane_fail(format("%s with execution_simdgroups<%u> in a threadgroup of %u threads (%u "
                     "simdgroups): the scope must be the whole threadgroup of exactly that many "
                     "simdgroups",
                     op, simdgroups, g.nlanes, g.nsimd));
  }
}

// After a rendezvous: every thread of the scope took part (none has exited).
void tensor_scope_complete(uint32_t simdgroups, const char* op) {
  if (simdgroups <= 1) {
    if (g.cur->exchange_mask != 0xffffffffu) {
      lane_fail(format("%s with threads of the simdgroup missing (exited or never there: lanes "
                       "%s take part); every thread of the scope must call it",
                       op, lane_list(g.cur->exchange_mask, 0).c_str()));
    }
  } else if (g.barrier_live != g.nlanes) {
    lane_fail(format("%s with %u of the threadgroup's %u threads (the others have exited); "
                     "every thread of the scope must call it",
                     op, g.barrier_live, g.nlanes));
  }
}

void tensor_rendezvous(const void* mine, uint32_t simdgroups, const char* op,
                       const CallChain& site) {
  tensor_scope_check(simdgroups, op);
  if (simdgroups <= 1) {
    simd_arrive(SimdWait::Exchange, SimdKind::TensorOp, mine ? sizeof(void*) : 0,
                mine ? static_cast<const void*>(&mine) : nullptr, site);
  } else {
    if (g.scope_count.size() < g.nlanes) g.scope_count.resize(g.nlanes);
    for (auto& v : g.scope_ptrs) {
      if (v.size() < g.nlanes) v.resize(g.nlanes);
    }
    if (mine != nullptr) {
      const uint32_t parity = g.scope_count[g.cur->index]++ & 1u;
      g.scope_ptrs[parity][g.cur->index] = mine;
    }
    barrier(0, site, op);
  }
  tensor_scope_complete(simdgroups, op);
}
}  // namespace

const void* const* tensor_op_gather(const void* mine, uint32_t simdgroups, const char* op) {
  const CallChain site = call_chain(__builtin_frame_address(0));
  tensor_rendezvous(mine, simdgroups, op, site);
  if (simdgroups <= 1) return static_cast<const void* const*>(g.cur->exchange_result);
  return g.scope_ptrs[(g.scope_count[g.cur->index] - 1) & 1u].data();
}

void tensor_op_release(uint32_t simdgroups, const char* op) {
  const CallChain site = call_chain(__builtin_frame_address(0));
  tensor_rendezvous(nullptr, simdgroups, op, site);
}

void count_tensor_op(uint64_t multiply_adds) {
  ++g.counters.tensor_ops;
  g.counters.tensor_multiply_adds += multiply_adds;
}

void register_kernel(const char* host_name, KernelEntry entry) {
  register_kernel_limited(host_name, entry, 0);
}

void register_kernel_limited(const char* host_name, KernelEntry entry, uint32_t max_threads) {
  Library& lib = g_loading != nullptr ? *g_loading : orphan_library();
  if (!lib.kernels.emplace(host_name, entry).second) lib.duplicates.emplace_back(host_name);
  if (max_threads != 0) lib.max_threads[host_name] = max_threads;
}

void fail(const char* message) { lane_fail(message, __builtin_return_address(0)); }

void fail_at(const char* message, const void* pc) { lane_fail(message, pc); }

// ------------------------------------------------------------------------------- host side

const Library* load_library(const std::vector<std::string>& paths) {
  std::lock_guard<std::mutex> lock(launch_mutex());
  std::string key;
  for (const std::string& p : paths) key += p + "\n";
  auto& libs = libraries();
  auto it = libs.find(key);
  if (it != libs.end()) return it->second.get();
  auto lib = std::make_unique<Library>();
  lib->path = paths.size() == 1 ? paths[0] : paths.empty() ? "" : paths[0].substr(0, paths[0].rfind('/'));
  for (const std::string& path : paths) {
    g_loading = lib.get();
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    g_loading = nullptr;
    if (handle == nullptr) {
      const char* err = dlerror();
      throw SimError("cannot load shader library " + path + ": " + (err ? err : "unknown error"));
    }
    lib->handles.push_back(handle);
  }
  return (libs[key] = std::move(lib)).get();
}

std::vector<std::string> kernel_names(const Library* library) {
  std::vector<std::string> out;
  for (const auto& kv : library->kernels) out.push_back(kv.first);
  return out;
}

namespace {

KernelEntry find_kernel(const LaunchSpec& spec) {
  const Library* lib = spec.library;
  if (lib == nullptr) throw SimError("kernel '" + spec.kernel + "': no shader library given");
  const auto& dups = lib->duplicates;
  if (std::find(dups.begin(), dups.end(), spec.kernel) != dups.end()) {
    throw SimError("kernel '" + spec.kernel + "' is defined more than once in " + lib->path);
  }
  auto it = lib->kernels.find(spec.kernel);
  if (it == lib->kernels.end()) {
    std::string known;
    for (const auto& kv : lib->kernels) known += (known.empty() ? "" : ", ") + kv.first;
    throw SimError("kernel '" + spec.kernel + "' not found in " + lib->path + " (it has: " +
                   (known.empty() ? "no kernels" : known) + ")");
  }
  auto limit = lib->max_threads.find(spec.kernel);
  uint64_t lanes = uint64_t{spec.threads[0]} * spec.threads[1] * spec.threads[2];
  if (limit != lib->max_threads.end() && lanes > limit->second) {
    throw SimError(format("kernel '%s': %llu threads per threadgroup exceed its "
                          "[[max_total_threads_per_threadgroup(%u)]] (Metal's pipeline has "
                          "maxTotalThreadsPerThreadgroup = %u)",
                          spec.kernel.c_str(), static_cast<unsigned long long>(lanes),
                          limit->second, limit->second));
  }
  return it->second;
}

void validate(const LaunchSpec& spec) {
  const std::string k = "kernel '" + spec.kernel + "': ";
  const uint64_t threadgroups = uint64_t{spec.grid[0]} * spec.grid[1] * spec.grid[2];
  int64_t previous = -1;
  for (const std::vector<uint32_t>& group : spec.groups) {
    for (uint32_t id : group) {
      if (id >= threadgroups || int64_t{id} <= previous) {
        throw SimError(k + format("threadgroup %u of a sampled run: the ids must ascend across "
                                  "the groups and lie below the grid's %llu threadgroups",
                                  id, static_cast<unsigned long long>(threadgroups)));
      }
      previous = id;
    }
  }
  uint64_t lanes = uint64_t{spec.threads[0]} * spec.threads[1] * spec.threads[2];
  if (lanes == 0) throw SimError(k + "threads per threadgroup must be positive in every dimension");
  const uint32_t* tg = spec.threads_grid;
  const uint32_t* t = spec.threads;
  if (tg[0] != 0 || tg[1] != 0 || tg[2] != 0) {
    for (int d = 0; d < 3; ++d) {
      if (tg[d] == 0 || spec.grid[d] != (tg[d] + t[d] - 1) / t[d]) {
        throw SimError(k + format("a grid of %ux%ux%u threads needs a positive size in every "
                                  "dimension and ceil(threads / %ux%ux%u) threadgroups (got "
                                  "%ux%ux%u)",
                                  tg[0], tg[1], tg[2], t[0], t[1], t[2], spec.grid[0],
                                  spec.grid[1], spec.grid[2]));
      }
    }
  }
  if (lanes > kMaxLanes) {
    throw SimError(k + format("%llu threads per threadgroup (%ux%ux%u) exceed Metal's limit of %u",
                              static_cast<unsigned long long>(lanes), spec.threads[0],
                              spec.threads[1], spec.threads[2], kMaxLanes));
  }
  bool seen[kMaxBufferIndex + 1] = {};
  for (const BufferArg& b : spec.buffers) {
    if (b.index > kMaxBufferIndex) {
      throw SimError(k + format("[[buffer(%u)]]: Metal has 31 buffer slots (0-30)", b.index));
    }
    if (seen[b.index]) throw SimError(k + format("[[buffer(%u)]] bound twice", b.index));
    seen[b.index] = true;
  }
}

void run_grid_once(const LaunchSpec& spec) {
  cache_reset(spec);
  g.group_counters.clear();
  if (spec.groups.empty()) {
    for (uint32_t z = 0; z < spec.grid[2]; ++z) {
      for (uint32_t y = 0; y < spec.grid[1]; ++y) {
        for (uint32_t x = 0; x < spec.grid[0]; ++x) {
          if (g_interrupted) throw Interrupted("kernel '" + spec.kernel + "' interrupted");
          run_threadgroup(x, y, z);
          ++g.counters.threadgroups;
          g.counters.lanes += g.nlanes;
        }
      }
    }
    cache_end_group();
    g.group_counters.push_back(take_counters());
    return;
  }
  for (const std::vector<uint32_t>& group : spec.groups) {
    for (uint32_t id : group) {
      if (g_interrupted) throw Interrupted("kernel '" + spec.kernel + "' interrupted");
      run_threadgroup(id % spec.grid[0], id / spec.grid[0] % spec.grid[1],
                      id / spec.grid[0] / spec.grid[1]);
      ++g.counters.threadgroups;
      g.counters.lanes += g.nlanes;
    }
    cache_end_group();
    g.group_counters.push_back(take_counters());
  }
}

// The dispatch on freshly bound memory, started over (nothing written back, counters from zero)
// each time a region turns out to need its reads tracked (state.h: DevShadow); every restart
// adds a binding to g.track_reads, so there are at most 31.
void run_grid(const LaunchSpec& spec) {
  for (;;) {
    try {
      run_grid_once(spec);
      return;
    } catch (const Restart&) {
      g.failed = false;
      g.restart = false;
      unbind_device(false);
      reset_threadgroup_memory(spec);
      g.counters = Counters();
      g.counters.kernel = spec.kernel;
      bind_device(spec);
    }
  }
}

}  // namespace

namespace {
// TORCH_STEEL_SIM_FAST_MATH: unset or "exact" (the shim's correctly rounded results) or "worst"
// (runtime.h: worst_precision); TORCH_STEEL_SIM_FAST_MATH_SEED: an unsigned integer.
void read_precision_mode() {
  const char* mode = std::getenv("TORCH_STEEL_SIM_FAST_MATH");
  const std::string m = mode != nullptr ? mode : "";
  if (m != "" && m != "exact" && m != "worst") {
    throw SimError("TORCH_STEEL_SIM_FAST_MATH=" + m + ": expected exact or worst");
  }
  g.worst_precision = m == "worst";
  const char* seed = std::getenv("TORCH_STEEL_SIM_FAST_MATH_SEED");
  g.precision_seed = seed != nullptr ? std::strtoull(seed, nullptr, 10) : 0;
}
}  // namespace

Counters launch(const LaunchSpec& spec) {
  if (!spec.groups.empty()) throw SimError("kernel '" + spec.kernel + "': groups need launch_groups");
  return launch_groups(spec)[0];
}

std::vector<Counters> launch_groups(const LaunchSpec& spec) {
  std::lock_guard<std::mutex> lock(launch_mutex());
  validate(spec);
  g.entry = find_kernel(spec);
  g.kernel = spec.kernel;
  g.checkers = spec.checkers;
  read_precision_mode();
  std::copy(spec.grid, spec.grid + 3, g.grid);
  std::copy(spec.threads, spec.threads + 3, g.threads);
  std::copy(spec.threads_grid, spec.threads_grid + 3, g.threads_grid);
  // The full threadgroup's (start_threadgroup sets a partial one's).
  g.nlanes = spec.threads[0] * spec.threads[1] * spec.threads[2];
  g.nsimd = (g.nlanes + kSimdWidth - 1) / kSimdWidth;
  g.constants.clear();
  for (const steel::FunctionConstant& c : spec.constants) g.constants[c.index] = c;
  g.counters = Counters();
  g.counters.kernel = spec.kernel;
  g.constant_buffers = 0;
  g.failed = false;
  g.restart = false;
  g.track_reads = 0;
  g.error.clear();
  g.cur = nullptr;
  g.tg_pos[0] = g.tg_pos[1] = g.tg_pos[2] = 0;

  g.stacks.reserve(kMaxLanes, stack_bytes());
  if (g.lanes.size() < g.nlanes) g.lanes.resize(g.nlanes);
  g.ready.assign(kMaxLanes, 0);
  static std::vector<uint8_t> exchange_space(2 * (kMaxLanes / kSimdWidth) * kSimdWidth *
                                             kMaxExchangeBytes);
  g.groups.assign(g.nsimd, SimdGroup());
  for (uint32_t s = 0; s < g.nsimd; ++s) {
    for (int p = 0; p < 2; ++p) {
      g.groups[s].buf[p] = exchange_space.data() + (2 * s + p) * kSimdWidth * kMaxExchangeBytes;
    }
  }

  reset_threadgroup_memory(spec);
  g.poison = 0xFF;
  bind_device(spec);
  FaultHandlers handlers;
  InterruptHandler interrupt;
  Watchdog watchdog;
  // Reset on every way out of the launch (block hooks of later launches stay one compare).
  struct Counting {
    explicit Counting(bool on) { steel_sim_counting = on ? 1 : 0; }
    ~Counting() { steel_sim_counting = 0; }
  } counting(spec.count_instructions);
  try {
    run_grid(spec);
    if (g.disabled_reads != 0 && g.checkers) {
      // A buffer disabled by a function constant was read. Metal's compiler removes such a read
      // when its value is unused; whether it is, shows in the results: run again with other
      // poison bytes and compare everything the dispatch wrote.
      std::vector<uint8_t> first = snapshot_outputs();
      std::string where = g.disabled_where;
      const void* pc = g.disabled_pc;
      uint32_t index = g.disabled_index;
      const char* reason = g.disabled_reason;
      unbind_device(false);
      reset_threadgroup_memory(spec);
      g.counters = Counters();
      g.counters.kernel = spec.kernel;
      g.poison = 0x00;
      bind_device(spec);
      run_grid(spec);
      if (snapshot_outputs() != first) {
        throw SimError(where +
                       format("reads [[buffer(%u)]], which %s (no buffer is bound to it), and "
                              "the value read changes the results: Metal leaves out only reads "
                              "whose value is unused",
                              index, reason) +
                       pc_text(pc));
      }
    }
  } catch (...) {
    unbind_device(false);
    throw;
  }
  unbind_device(true);
  return std::move(g.group_counters);
}

}  // namespace steel_sim

extern "C" {
__attribute__((visibility("default"))) uint32_t steel_sim_counting = 0;

// A counted basic block ran in the running lane (shader/callbacks.cpp: steel_sim_block).
__attribute__((visibility("default"))) void steel_sim_count_block(const uint32_t* histogram) {
  using namespace steel_sim::detail;
  Lane* lane = g.cur;
  if (lane == nullptr) return;
  SimdGroup& sg = g.groups[lane->sg];
  auto [it, fresh] = sg.run_index.try_emplace(histogram, static_cast<uint32_t>(sg.runs.size()));
  if (fresh) {
    sg.runs.push_back(SimdGroup::BlockRuns{histogram, {}});
  }
  ++sg.runs[it->second].lanes[lane->index % kSimdWidth];
}
}
