// Context pool: the int64 id that travels through the graph <-> the live autograd context.
// Generic over the handle so that it is tested without an interpreter; in the kernels the
// handle is a Python reference, dropped by the caller with the GIL held.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ortbridge {

template <class Handle>
class ContextPool {
 public:
  static constexpr int64_t kNoContext = 0;  // what a forward without autograd context emits

  int64_t Add(Handle handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t id = ++last_id_;
    entries_.emplace(id, std::move(handle));
    return id;
  }

  // Removes and returns the entry: a context serves exactly one backward.
  std::optional<Handle> Take(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return std::nullopt;
    Handle h = std::move(it->second);
    entries_.erase(it);
    return h;
  }

  size_t Size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.size();
  }

  // Hands every entry back, so that the caller destroys them outside the lock (a handle's
  // destructor may run Python code that calls back into the pool).
  std::vector<Handle> TakeAll() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Handle> all;
    all.reserve(entries_.size());
    for (auto& kv : entries_) all.push_back(std::move(kv.second));
    entries_.clear();
    return all;
  }

 private:
  mutable std::mutex mutex_;
  int64_t last_id_ = kNoContext;
  std::unordered_map<int64_t, Handle> entries_;
};

}  // namespace ortbridge
