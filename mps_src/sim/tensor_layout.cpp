// Cooperative-tensor layouts of the simulated Metal 4 tensor operations (runtime.h:
// tensor_layout), and the leader's scratch memory.
//
// On the GPU the element-to-(thread, slot) map of a cooperative tensor is supplied by the driver
// and differs between GPU generations; MSL only promises get_multidimensional_index,
// is_valid_element, load and store. The simulator therefore draws every role's map at random,
// from the layout seed and the role's key: a kernel that hard-codes one map (as one known
// framework does for M5) computes garbage under most seeds, one that uses the index API passes
// under all of them. Layouts are cached for the process (the seed is part of the key), so every
// threadgroup and thread of a launch sees the same map, as with one pipeline on the GPU.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "state.h"

namespace steel_sim {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

struct Rng {
  uint64_t state;
  uint32_t below(uint32_t n) { return static_cast<uint32_t>((state = mix(state)) % n); }
};

struct OwnedLayout {
  TensorLayout view;
  std::vector<int32_t> element_at, index_of_invalid, place_of;
  std::vector<uint8_t> owner;

  void publish(uint32_t threads, uint32_t capacity, uint32_t elements) {
    view.threads = threads;
    view.capacity = capacity;
    view.elements = elements;
    view.element_at = element_at.data();
    view.index_of_invalid = index_of_invalid.data();
    view.place_of = place_of.data();
    view.owner = owner.data();
  }
};

std::mutex& cache_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<OwnedLayout>>& cache() {
  static std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<OwnedLayout>> c;
  return c;
}

uint64_t layout_seed() {
  const char* env = std::getenv("TORCH_STEEL_SIM_LAYOUT_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 0;
}

// Invalid slots claim a made-up element of the tensor, so that code which writes every slot
// without asking is_valid_element overwrites a real element with garbage.
void fill_invalid(OwnedLayout& l, Rng& rng, uint32_t elements) {
  l.index_of_invalid.assign(l.element_at.size(), 0);
  for (size_t p = 0; p < l.element_at.size(); ++p) {
    if (l.element_at[p] < 0) l.index_of_invalid[p] = static_cast<int32_t>(rng.below(elements));
  }
}

}  // namespace

const TensorLayout* tensor_layout(uint64_t role_key, uint32_t elements, uint32_t threads,
                                  uint32_t max_capacity) {
  const uint64_t seed = layout_seed();
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto& slot = cache()[{seed, role_key}];
  if (slot) return &slot->view;
  auto l = std::make_unique<OwnedLayout>();
  Rng rng{mix(seed ^ mix(role_key))};
  const uint32_t least = (elements + threads - 1) / threads;
  // Up to two padding slots per thread: with them some slots of every thread may be invalid.
  const uint32_t capacity = std::min(max_capacity, least + rng.below(3));
  const uint32_t places = capacity * threads;
  std::vector<int32_t> order(places);
  for (uint32_t p = 0; p < places; ++p) order[p] = static_cast<int32_t>(p);
  for (uint32_t p = places; p > 1; --p) std::swap(order[p - 1], order[rng.below(p)]);
  l->element_at.assign(places, -1);
  l->place_of.assign(elements, -1);
  l->owner.assign(places, 0);
  for (uint32_t e = 0; e < elements; ++e) {
    l->element_at[order[e]] = static_cast<int32_t>(e);
    l->place_of[e] = order[e];
    l->owner[order[e]] = 1;
  }
  fill_invalid(*l, rng, elements);
  l->publish(threads, capacity, elements);
  slot = std::move(l);
  return &slot->view;
}

const TensorLayout* tensor_reduction_layout(uint64_t role_key, const TensorLayout* source,
                                            uint32_t rows, uint32_t cols, bool keep_rows,
                                            uint32_t max_capacity) {
  const uint64_t seed = layout_seed();
  const uint64_t key = mix(role_key ^ mix(reinterpret_cast<uintptr_t>(source)));
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto& slot = cache()[{seed, key}];
  if (slot) return &slot->view;
  auto l = std::make_unique<OwnedLayout>();
  Rng rng{mix(seed ^ key)};
  const uint32_t out = keep_rows ? rows : cols;
  const uint32_t threads = source->threads;
  // The results each thread must hold: those of the rows (columns) of its source elements.
  std::vector<std::vector<int32_t>> held(threads);
  uint32_t most = 0;
  for (uint32_t t = 0; t < threads; ++t) {
    std::vector<uint8_t> seen(out, 0);
    for (uint32_t s = 0; s < source->capacity; ++s) {
      const int32_t e = source->element_at[t * source->capacity + s];
      if (e < 0) continue;
      const uint32_t r = keep_rows ? uint32_t(e) / cols : uint32_t(e) % cols;
      if (!seen[r]) held[t].push_back(static_cast<int32_t>(r));
      seen[r] = 1;
    }
    most = std::max(most, static_cast<uint32_t>(held[t].size()));
  }
  const uint32_t capacity = std::min(max_capacity, std::max(most, 1u) + rng.below(2));
  l->element_at.assign(threads * capacity, -1);
  l->place_of.assign(out, -1);
  l->owner.assign(threads * capacity, 0);
  for (uint32_t t = 0; t < threads; ++t) {
    std::vector<uint32_t> slots(capacity);
    for (uint32_t s = 0; s < capacity; ++s) slots[s] = s;
    for (uint32_t s = capacity; s > 1; --s) std::swap(slots[s - 1], slots[rng.below(s)]);
    for (size_t i = 0; i < held[t].size(); ++i) {
      const int32_t p = static_cast<int32_t>(t * capacity + slots[i]);
      const int32_t r = held[t][i];
      l->element_at[p] = r;
      if (l->place_of[r] < 0) {  // the first holder stores it
        l->place_of[r] = p;
        l->owner[p] = 1;
      }
    }
  }
  fill_invalid(*l, rng, out);
  l->publish(threads, capacity, out);
  slot = std::move(l);
  return &slot->view;
}

void* tensor_op_scratch(size_t bytes) {
  // One launch at a time, and the leader does not yield between gather and release.
  static std::vector<uint64_t> space;
  if (space.size() * sizeof(uint64_t) < bytes) space.resize((bytes + 7) / 8);
  return space.data();
}

}  // namespace steel_sim
