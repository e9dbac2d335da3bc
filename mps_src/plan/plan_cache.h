// A bounded, thread-safe cache of launch plans, so that a repeated op call does no planning.
//
// Decode calls the same few ops with the same shapes thousands of times; planning one (the tile
// table, the params bytes, the kernel name) costs tens of microseconds, more than the call's GPU
// work. The Metal host and the simulator both get their plans through cached_plan.
//
// The key is everything a planner reads: the op, each tensor's presence, dtype, sizes and
// strides, and every option. Of a tensor's storage offset, planners read only its alignment
// (vector loads need aligned row starts) and whether the tensor's reach from it passes 32-bit
// indexing (extent()); the key holds exactly those two, so that views at different offsets of
// one layout share a plan while a plan is never handed to a call it was not made for.
//
// A decode stream (sdpa with one more key per token) would be a new key per token. Its key
// leaves the key length S out and holds instead what the plan derives from S
// (attn::decode_length_class); the cached plan is rewritten for the call's S
// (attn::set_decode_length, a copy of the plan, far cheaper than planning) when it was made
// for another, and kept for that S. A key and value that grow by torch.cat, and a mask made
// anew per token (row-major, so their strides hold S too) are keyed by their sizes alone, and
// their strides rewritten. A mask's view of a longer buffer keeps its strides, as a KV
// cache's views do. A paged KV cache's decode stream (max_seqlen_k one more per token) is keyed
// without max_seqlen_k, with what its plan derives from it (attn::paged_length_class): the
// cached plan serves every max_seqlen_k of its class as it is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "plan.h"

namespace steel {

// Offsets that agree modulo this many elements have the same alignment for every access the
// kernels make (at most 16 bytes, and every element is at least 1 byte).
constexpr int64_t kPlanOffsetAlign = 16;

// The cache key of a planner call (see the header comment); with `any_length`, the key length
// (dim -2 of the key and value, tensors 1 and 2, and the last dim of a mask, tensor 3, unless
// it broadcasts) is left out of it, and so are the strides of those that are row-major; the
// number option named `without` is left out too.
std::string plan_key(const std::string& op, const TensorList& tensors, const Options& options,
                     bool any_length = false, const char* without = nullptr);

class PlanCache {
 public:
  explicit PlanCache(size_t capacity) : capacity_(capacity) {}

  struct Stats {
    uint64_t hits = 0;
    uint64_t misses = 0;
    size_t size = 0;
    size_t capacity = 0;
  };

  // The plan of make_plan(op, tensors, options): the cached one when the key was planned
  // before, else planned now (outside the lock: a slow planner does not stall other threads)
  // and kept, the least recently used plan making room when the cache is full.
  std::shared_ptr<const Plan> get(const std::string& op, const TensorList& tensors,
                                  const Options& options);

  Stats stats() const;
  // Drops every plan and resets the counters; a capacity of 0 turns caching off.
  void reset(size_t capacity);

 private:
  struct Entry {
    std::string key;
    std::shared_ptr<const Plan> plan;
    int64_t length;  // the key length (paged: max_seqlen_k) it was made for (-1: the key holds it)
  };

  mutable std::mutex mutex_;
  size_t capacity_;
  std::list<Entry> recent_;  // most recently used first
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
  uint64_t families_ = 0;  // the last Plan::family handed out
};

// Enough for every op of a model at a few shapes each (an entry is a few hundred bytes).
constexpr size_t kPlanCacheCapacity = 4096;

// The process's plan cache.
PlanCache& plan_cache();

// plan_cache().get(op, tensors, options).
std::shared_ptr<const Plan> cached_plan(const std::string& op, const TensorList& tensors,
                                        const Options& options);

}  // namespace steel
