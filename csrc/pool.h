// Context pool: the int64 id that travels through the graph <-> the live autograd context.
// Ids are random (63 bits from the kernel's CSPRNG): a model cannot guess, count or compute the id
// of a context it did not create, in this session or another.
// Generic over the handle so that it is tested without an interpreter; in the kernels the
// handle is a Python reference, dropped by the caller with the GIL held.
#pragma once

#include <sys/random.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <mutex>
#include <stdexcept>
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
    int64_t id = NewId();
    entries_.emplace(id, std::move(handle));
    return id;
  }

  // Removes and returns the entry: a context serves exactly one backward.
  std::optional<Handle> Take(int64_t id) {
    return TakeIf(id, [](const Handle&) { return true; });
  }

  // As Take, but only an entry for which `belongs(handle)` holds; any other stays live.
  template <class Predicate>
  std::optional<Handle> TakeIf(int64_t id, Predicate&& belongs) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(id);
    if (it == entries_.end() || !belongs(static_cast<const Handle&>(it->second))) return std::nullopt;
    Handle h = std::move(it->second);
    entries_.erase(it);
    return h;
  }

  bool Contains(int64_t id) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.count(id) != 0;
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
  // A fresh id: positive, not live. Random bits are fetched in batches (one syscall per batch).
  int64_t NewId() {
    for (;;) {
      if (next_random_ == random_.size()) {
        for (size_t filled = 0; filled < sizeof random_;) {
          ssize_t got =
              getrandom(reinterpret_cast<char*>(random_.data()) + filled, sizeof random_ - filled, 0);
          if (got < 0 && errno != EINTR)
            throw std::runtime_error("getrandom failed: cannot draw a context id");
          if (got > 0) filled += static_cast<size_t>(got);
        }
        next_random_ = 0;
      }
      const auto id = static_cast<int64_t>(random_[next_random_++] >> 1);
      if (id != kNoContext && entries_.count(id) == 0) return id;
    }
  }

  mutable std::mutex mutex_;
  std::unordered_map<int64_t, Handle> entries_;
  std::array<uint64_t, 64> random_{};
  size_t next_random_ = random_.size();
};

}  // namespace ortbridge
