#include "plan_cache.h"

#include "attention_plan.h"

namespace steel {
namespace {

void put_bytes(std::string* key, const void* data, size_t size) {
  key->append(static_cast<const char*>(data), size);
}

void put_int(std::string* key, int64_t value) { put_bytes(key, &value, sizeof value); }

// Length-prefixed, so that no two different sequences of strings serialize alike.
void put_string(std::string* key, const std::string& value) {
  put_int(key, static_cast<int64_t>(value.size()));
  key->append(value);
}

}  // namespace

std::string plan_key(const std::string& op, const TensorList& tensors, const Options& options,
                     bool any_length, const char* without) {
  std::string key;
  key.reserve(64 + 48 * tensors.size());
  put_string(&key, op);
  put_int(&key, static_cast<int64_t>(tensors.size()));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::optional<TensorDesc>& t = tensors[i];
    if (!t) {
      put_int(&key, -1);
      continue;
    }
    put_int(&key, static_cast<int64_t>(t->dtype));
    put_int(&key, t->dim());
    // Where the key length is: key and value rows, a mask's last dim (unless broadcast).
    int64_t length_dim = -1;
    if (any_length && (i == 1 || i == 2)) length_dim = t->dim() - 2;
    if (any_length && i == 3 && t->dim() > 0 && t->sizes.back() != 1) length_dim = t->dim() - 1;
    for (int64_t d = 0; d < t->dim(); ++d) put_int(&key, d == length_dim ? -2 : t->sizes[d]);
    if (length_dim >= 0 && row_major(*t)) {
      // A key, value or mask grown by torch.cat (or made anew per token): its strides are its
      // sizes', S included.
      put_int(&key, -3);
    } else {
      // A desc with fewer strides than sizes is malformed; the planner refuses it, and the key
      // must still tell it apart from a well-formed one.
      put_int(&key, static_cast<int64_t>(t->strides.size()));
      for (int64_t stride : t->strides) put_int(&key, stride);
    }
    put_int(&key, t->offset % kPlanOffsetAlign);
    // Shared storage: the first earlier tensor of the call on the same storage, and the exact
    // distance between their offsets (what a K/V alias is decided from), so that two calls share
    // a plan only where their tensors share storage alike.
    int64_t shared = -1;
    for (size_t j = 0; j < i && t->storage != 0 && shared < 0; ++j) {
      if (tensors[j] && tensors[j]->storage == t->storage) shared = static_cast<int64_t>(j);
    }
    put_int(&key, shared);
    if (shared >= 0) put_int(&key, t->offset - tensors[shared]->offset);
    put_int(&key, t->strides.size() == t->sizes.size() && extent(*t) > kInt32Max ? 1 : 0);
  }
  put_int(&key, static_cast<int64_t>(options.numbers.size()));
  for (const auto& [name, value] : options.numbers) {
    if (without != nullptr && name == without) continue;  // counted: a call without it differs
    put_string(&key, name);
    put_bytes(&key, &value, sizeof value);  // bit-exact: -0.0 and 0.0 may plan differently
  }
  put_int(&key, static_cast<int64_t>(options.strings.size()));
  for (const auto& [name, value] : options.strings) {
    put_string(&key, name);
    put_string(&key, value);
  }
  return key;
}

std::shared_ptr<const Plan> PlanCache::get(const std::string& op, const TensorList& tensors,
                                           const Options& options) {
  std::string length_class;
  int64_t length = -1;
  const bool any_length =
      op == "sdpa" && attn::decode_length_class(tensors, options, &length_class, &length);
  const bool any_max_keys = op == "sdpa_varlen" &&
                            attn::paged_length_class(tensors, options, &length_class, &length);
  std::string key =
      plan_key(op, tensors, options, any_length, any_max_keys ? "max_seqlen_k" : nullptr);
  key += length_class;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = index_.find(key);
    // A refusal names the shapes: it is handed out only for the length it was made for.
    if (found != index_.end() && (found->second->length == length || found->second->plan->ok)) {
      ++hits_;
      recent_.splice(recent_.begin(), recent_, found->second);
      Entry& entry = *found->second;
      if (entry.length != length && any_length) {  // a paged plan holds nothing of its length
        auto plan = std::make_shared<Plan>(*entry.plan);
        attn::set_decode_length(plan.get(), tensors, options);
        entry.plan = std::move(plan);
      }
      entry.length = length;
      return entry.plan;
    }
    ++misses_;
  }
  auto made = std::make_shared<Plan>(make_plan(op, tensors, options));
  std::lock_guard<std::mutex> lock(mutex_);
  if (capacity_ == 0) return made;  // caching off: no family
  made->family = ++families_;
  std::shared_ptr<const Plan> plan = std::move(made);
  auto found = index_.find(key);
  if (found != index_.end()) {  // planned meanwhile, or a refusal made for another length
    *found->second = Entry{found->first, plan, length};
    return plan;
  }
  recent_.push_front(Entry{key, plan, length});
  index_.emplace(std::move(key), recent_.begin());
  while (index_.size() > capacity_) {
    index_.erase(recent_.back().key);
    recent_.pop_back();
  }
  return plan;
}

PlanCache::Stats PlanCache::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  Stats s;
  s.hits = hits_;
  s.misses = misses_;
  s.size = index_.size();
  s.capacity = capacity_;
  return s;
}

void PlanCache::reset(size_t capacity) {
  std::lock_guard<std::mutex> lock(mutex_);
  capacity_ = capacity;
  recent_.clear();
  index_.clear();
  hits_ = 0;
  misses_ = 0;
}

PlanCache& plan_cache() {
  static PlanCache instance(kPlanCacheCapacity);  // constructed on first use
  return instance;
}

std::shared_ptr<const Plan> cached_plan(const std::string& op, const TensorList& tensors,
                                        const Options& options) {
  return plan_cache().get(op, tensors, options);
}

}  // namespace steel
