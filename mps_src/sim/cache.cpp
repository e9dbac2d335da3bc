// The cache model (sim.h: CacheSpec): a dispatch's device accesses replayed through an L2 and a
// system-level cache (SLC), giving the bytes that reach DRAM.
//
// - Lines: the line_bytes-aligned blocks of the device arena (checkers.cpp: bind_device), where a
//   binding keeps its host address modulo 64, so a tensor's first byte starts a line unless a
//   storage offset moves it.
// - Trace: the simulator runs one threadgroup at a time, so each threadgroup's accesses are
//   recorded as a sequence of lines (read or write) and replayed when its wave is complete. A line
//   among the threadgroup's last kTraceWindow distinct lines is not recorded again (the lanes of
//   one load touch the same few lines one after another): under LRU such a repeat hits anyway,
//   since at most resident * kTraceWindow other lines are touched in between, as long as that
//   many lines fit in the L2 (true of every chip's L2 and wave; not of a test's tiny cache).
// - Waves: threadgroups are resident `resident` at a time in dispatch (linear id) order; wave w
//   holds ids [w * resident, (w + 1) * resident). Its traces are interleaved round-robin by access
//   (the first line of each threadgroup in id order, then the second of each, ...), as if its
//   threadgroups ran in lockstep; a threadgroup whose trace ends drops out.
// - Levels: each a fully associative LRU of whole lines. An access looks up the L2; a miss looks
//   up the SLC; an SLC miss of a read reads the line from DRAM. A missed line is filled into both
//   levels (neither inclusive nor exclusive: each keeps its own LRU order).
// - Writes: write-back and write-allocate without a fetch (GPU stores carry byte masks). A written
//   line reaches DRAM once, when it leaves the last level holding it or at the end of the
//   dispatch; it is counted when it is first written (so a group's writes are its own, sampling
//   included) and again only if it is written after it left both levels.
// - Both caches start empty at each dispatch; nothing carries over between dispatches. In a run
//   of some threadgroups only (LaunchSpec::groups), they are emptied again before a wave that
//   does not follow the last wave run: the waves skipped would have replaced their contents.
#include <unordered_map>
#include <unordered_set>

#include "state.h"

namespace steel_sim::detail {

namespace {

constexpr uint32_t kNone = ~0u;
constexpr uint32_t kTraceWindow = 16;

// A fully associative LRU set of lines: a hash map into a doubly linked list kept in a vector.
class Lru {
 public:
  void reset(uint64_t lines) {
    capacity_ = lines;
    nodes_.clear();
    where_.clear();
    where_.reserve(std::min<uint64_t>(lines, 1u << 20));
    head_ = tail_ = kNone;
  }

  bool contains(uint32_t line) const { return where_.count(line) != 0; }

  // Whether `line` is held (it becomes the most recent); on a miss it is inserted as the most
  // recent and *evicted is the line it displaced (kNone when none was).
  bool touch(uint32_t line, uint32_t* evicted) {
    *evicted = kNone;
    auto it = where_.find(line);
    if (it != where_.end()) {
      uint32_t i = it->second;
      if (i != head_) {
        unlink(i);
        push_front(i);
      }
      return true;
    }
    if (capacity_ == 0) return false;
    uint32_t i;
    if (nodes_.size() < capacity_) {
      i = static_cast<uint32_t>(nodes_.size());
      nodes_.push_back(Node{});
    } else {
      i = tail_;
      *evicted = nodes_[i].line;
      where_.erase(nodes_[i].line);
      unlink(i);
    }
    nodes_[i].line = line;
    where_.emplace(line, i);
    push_front(i);
    return false;
  }

 private:
  struct Node {
    uint32_t line = 0;
    uint32_t prev = kNone;
    uint32_t next = kNone;
  };

  void unlink(uint32_t i) {
    Node& n = nodes_[i];
    (n.prev == kNone ? head_ : nodes_[n.prev].next) = n.next;
    (n.next == kNone ? tail_ : nodes_[n.next].prev) = n.prev;
  }

  void push_front(uint32_t i) {
    nodes_[i].prev = kNone;
    nodes_[i].next = head_;
    if (head_ != kNone) nodes_[head_].prev = i;
    head_ = i;
    if (tail_ == kNone) tail_ = i;
  }

  uint64_t capacity_ = 0;
  std::vector<Node> nodes_;
  std::unordered_map<uint32_t, uint32_t> where_;
  uint32_t head_ = kNone;
  uint32_t tail_ = kNone;
};

struct Model {
  uint32_t shift = 7;
  uint32_t line_bytes = 128;
  uint32_t resident = 1;
  uintptr_t base = 0;
  uint64_t l2_lines = 0;
  uint64_t slc_lines = 0;
  bool started = false;  // a threadgroup of this attempt started (wave_id is its wave)
  Lru l2;
  Lru slc;
  std::unordered_set<uint32_t> dirty;  // written lines not yet back in DRAM
  // The pending wave: traces of its threadgroups (entries: line << 1 | written), in id order.
  std::vector<std::vector<uint32_t>> wave;
  size_t wave_n = 0;
  uint64_t wave_id = 0;
  std::vector<uint32_t>* trace = nullptr;
  uint32_t window[kTraceWindow];
  uint32_t window_pos = 0;
};

Model m;

// A line leaving one level: if the other does not hold it either, a pending write of it has
// reached DRAM.
void left(uint32_t line, const Lru& other) {
  if (!other.contains(line)) m.dirty.erase(line);
}

void touch(uint32_t entry) {
  const uint32_t line = entry >> 1;
  const bool write = entry & 1;
  Counters& c = g.counters;
  uint32_t evicted;
  if (m.l2.touch(line, &evicted)) {
    ++c.l2_hits;
  } else {
    ++c.l2_misses;
    if (evicted != kNone) left(evicted, m.slc);
    if (m.slc.touch(line, &evicted)) {
      ++c.slc_hits;
    } else {
      ++c.slc_misses;
      if (!write) c.dram_read += m.line_bytes;
    }
    if (evicted != kNone) left(evicted, m.l2);
  }
  if (write) {
    if (!m.l2.contains(line) && !m.slc.contains(line)) {
      c.dram_written += m.line_bytes;  // no level holds it (both sizes 0): straight to DRAM
    } else if (m.dirty.insert(line).second) {
      c.dram_written += m.line_bytes;
    }
  }
}

void replay() {
  size_t longest = 0;
  for (size_t t = 0; t < m.wave_n; ++t) longest = std::max(longest, m.wave[t].size());
  for (size_t i = 0; i < longest; ++i) {
    for (size_t t = 0; t < m.wave_n; ++t) {
      if (i < m.wave[t].size()) touch(m.wave[t][i]);
    }
  }
  m.wave_n = 0;
  m.trace = nullptr;
}

void record(uint32_t entry) {
  for (uint32_t w : m.window) {
    if (w == entry || w == (entry | 1)) return;
  }
  m.window[m.window_pos] = entry;
  m.window_pos = (m.window_pos + 1) % kTraceWindow;
  m.trace->push_back(entry);
}

}  // namespace

void cache_reset(const LaunchSpec& spec) {
  g.cache_on = spec.cache.enabled;
  g.counters.cache = spec.cache.enabled;
  if (!g.cache_on) return;
  const CacheSpec& c = spec.cache;
  if (c.line_bytes < 16 || (c.line_bytes & (c.line_bytes - 1)) != 0 || c.resident == 0) {
    throw SimError("kernel '" + spec.kernel +
                   "': the cache model needs a power-of-two line size of at least 16 bytes and "
                   "at least one resident threadgroup");
  }
  m.line_bytes = c.line_bytes;
  m.shift = static_cast<uint32_t>(__builtin_ctz(c.line_bytes));
  if ((steel_sim_arenas.dev_size >> m.shift) >= (uint64_t{1} << 31)) {
    throw SimError("kernel '" + spec.kernel + "': the device arena is too large for the cache model");
  }
  m.resident = c.resident;
  m.base = steel_sim_arenas.dev_lo;
  m.l2_lines = c.l2_bytes / c.line_bytes;
  m.slc_lines = c.slc_bytes / c.line_bytes;
  m.l2.reset(m.l2_lines);
  m.slc.reset(m.slc_lines);
  m.started = false;
  m.dirty.clear();
  m.wave_n = 0;
  m.trace = nullptr;
}

void cache_start_threadgroup(uint32_t linear_id) {
  const uint64_t w = linear_id / m.resident;
  if (m.wave_n != 0 && w != m.wave_id) replay();
  if (m.started && w > m.wave_id + 1) {
    // Waves skipped (a sampled run): they would have replaced the caches' contents, so what
    // the waves run before them left there is no guide to what the next wave finds. Empty.
    m.l2.reset(m.l2_lines);
    m.slc.reset(m.slc_lines);
    m.dirty.clear();
  }
  m.started = true;
  m.wave_id = w;
  if (m.wave.size() <= m.wave_n) m.wave.emplace_back();
  m.trace = &m.wave[m.wave_n++];
  m.trace->clear();
  std::fill(std::begin(m.window), std::end(m.window), kNone);
  m.window_pos = 0;
}

void cache_access(uintptr_t a, size_t n, bool write) {
  if (m.trace == nullptr || n == 0) return;  // outside a threadgroup (cannot happen in a lane)
  const uint32_t first = static_cast<uint32_t>((a - m.base) >> m.shift);
  const uint32_t last = static_cast<uint32_t>((a + n - 1 - m.base) >> m.shift);
  for (uint32_t line = first; line <= last; ++line) record(line << 1 | (write ? 1u : 0u));
}

void cache_end_group() {
  if (g.cache_on && m.wave_n != 0) replay();
}

}  // namespace steel_sim::detail
