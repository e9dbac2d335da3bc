// Threads share a small plan cache (test_plan_cache.py builds this with ThreadSanitizer).
//
// Eight threads plan GEMMs of 24 shapes in different orders through a cache of 8 entries, so
// that hits, misses, evictions and two threads planning one key at once all happen; between
// them, decode steps over a key and value grown by torch.cat, at lengths that differ per
// thread, which share one cache key and get the cached plan rewritten for their length. Every
// plan a thread gets must equal a fresh steel::make_plan of its own call. Prints
// "ok <hits> <misses>" or the first mismatch (exit 1); ThreadSanitizer reports any data race
// (exit 66).
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "plan/plan.h"
#include "plan/plan_cache.h"

namespace {

steel::TensorDesc matrix(int64_t rows, int64_t cols) {
  steel::TensorDesc t;
  t.dtype = steel::DType::Float16;
  t.sizes = {rows, cols};
  t.strides = {cols, 1};
  return t;
}

steel::TensorList gemm_call(int64_t m) {
  return {matrix(m, 32), matrix(32, 16 + m), std::nullopt, std::nullopt};
}

steel::TensorDesc row_major(std::vector<int64_t> sizes) {
  steel::TensorDesc t;
  t.dtype = steel::DType::Float16;
  t.sizes = sizes;
  t.strides.assign(sizes.size(), 1);
  for (size_t d = sizes.size() - 1; d > 0; --d) t.strides[d - 1] = t.strides[d] * sizes[d];
  return t;
}

// One query row against `keys` keys, grouped query heads.
steel::TensorList decode_call(int64_t keys) {
  const steel::TensorDesc kv = row_major({1, 4, keys, 64});
  return {row_major({1, 8, 1, 64}), kv, kv, std::nullopt, std::nullopt};
}

// Everything of a plan that a host reads, as text.
std::string summary(const steel::Plan& plan) {
  std::string s = std::to_string(plan.ok) + plan.reason + "|" + std::to_string(plan.inputs);
  for (int32_t slot : plan.contiguous_inputs) s += " c" + std::to_string(slot);
  for (const steel::Allocation& a : plan.allocations) {
    s += "|" + a.name + steel::shape_str(a.sizes) + std::to_string(static_cast<int>(a.dtype));
  }
  for (const steel::Dispatch& d : plan.dispatches) {
    s += "|" + d.kernel;
    for (const steel::FunctionConstant& c : d.constants) {
      s += " " + std::to_string(c.index) + "=" + std::to_string(c.int_value);
    }
    for (const steel::Binding& b : d.bindings) {
      s += " b" + std::to_string(b.index) + ":" + std::to_string(b.slot) + ":" +
           std::string(b.bytes.begin(), b.bytes.end());
    }
    for (int i = 0; i < 3; ++i) s += " " + std::to_string(d.grid[i]);
  }
  return s;
}

}  // namespace

int main() {
  constexpr int kThreads = 8, kShapes = 24, kRounds = 40, kDecodeEvery = 4;
  steel::PlanCache cache(8);
  steel::Options options;
  options.numbers["alpha"] = 1.0;
  options.numbers["beta"] = 0.0;
  std::vector<std::string> expected;
  for (int m = 1; m <= kShapes; ++m) {
    expected.push_back(summary(steel::make_plan("gemm", gemm_call(m), options)));
  }
  steel::Options attention;
  attention.numbers["dropout_p"] = 0.0;
  attention.numbers["is_causal"] = 0.0;
  attention.numbers["scale"] = 0.125;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        for (int i = 0; i < kShapes; ++i) {
          const int m = 1 + (i * (t + 1) + round) % kShapes;  // each thread its own order
          const std::string got = summary(*cache.get("gemm", gemm_call(m), options));
          if (got != expected[m - 1] && failures++ == 0) {
            std::printf("mismatch for m = %d:\n  got      %s\n  expected %s\n", m, got.c_str(),
                        expected[m - 1].c_str());
          }
          if (i % kDecodeEvery != 0) continue;
          const int64_t keys = 100 + (t * 37 + round * kShapes + i) % 60;  // one split class
          const std::string step = summary(*cache.get("sdpa", decode_call(keys), attention));
          const std::string fresh = summary(steel::make_plan("sdpa", decode_call(keys), attention));
          if (step != fresh && failures++ == 0) {
            std::printf("decode mismatch for %lld keys\n", static_cast<long long>(keys));
          }
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const steel::PlanCache::Stats stats = cache.stats();
  if (failures != 0) return 1;
  const uint64_t calls = uint64_t{kThreads} * kRounds * (kShapes + kShapes / kDecodeEvery);
  if (stats.size > 8 || stats.hits + stats.misses != calls) {
    std::printf("bad stats: size %zu, %llu hits, %llu misses\n", stats.size,
                static_cast<unsigned long long>(stats.hits),
                static_cast<unsigned long long>(stats.misses));
    return 1;
  }
  std::printf("ok %llu %llu\n", static_cast<unsigned long long>(stats.hits),
              static_cast<unsigned long long>(stats.misses));
  return 0;
}
