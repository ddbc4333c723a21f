// A vector that keeps its first N elements in place, for the shapes and short lists of one kernel
// call: each std::vector there cost a malloc and a free, about a dozen a call, and glibc's
// allocator was the largest part of a call's cost over Function.apply (benchmarks/overhead.py).
// Past N the elements move to the heap. All N in-place elements are constructed with the vector,
// and those past size() stay constructed (holding whatever they held) until it dies: elements
// must be cheap to default-construct (a shape, a tensor's view of a buffer), not owners of much.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <utility>

namespace ortbridge {

template <class T, size_t N>
class SmallVector {
 public:
  SmallVector() = default;
  template <class It>
  SmallVector(It first, It last) {
    reserve(static_cast<size_t>(std::distance(first, last)));
    for (; first != last; ++first) data()[size_++] = *first;
  }
  SmallVector(std::initializer_list<T> items) : SmallVector(items.begin(), items.end()) {}
  SmallVector(const SmallVector& other) : SmallVector(other.begin(), other.end()) {}
  SmallVector(SmallVector&& other) noexcept { *this = std::move(other); }
  SmallVector& operator=(const SmallVector& other) {
    if (this != &other) {
      size_ = 0;
      reserve(other.size_);
      std::copy(other.begin(), other.end(), data());
      size_ = other.size_;
    }
    return *this;
  }
  SmallVector& operator=(SmallVector&& other) noexcept {
    if (this != &other) {
      heap_ = std::move(other.heap_);
      capacity_ = other.capacity_;
      size_ = other.size_;
      if (!heap_) std::move(other.inline_, other.inline_ + size_, inline_);
      other.capacity_ = N;
      other.size_ = 0;
    }
    return *this;
  }

  T* data() { return heap_ ? heap_.get() : inline_; }
  const T* data() const { return heap_ ? heap_.get() : inline_; }
  size_t size() const { return size_; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }

  void push_back(T value) {
    if (size_ == capacity_) reserve(2 * capacity_);
    data()[size_++] = std::move(value);
  }
  void resize(size_t count, T value = T()) {
    reserve(count);
    std::fill(data() + std::min(size_, count), data() + count, value);
    size_ = count;
  }
  void reserve(size_t capacity) {
    if (capacity <= capacity_) return;
    std::unique_ptr<T[]> grown(new T[capacity]);
    std::move(begin(), end(), grown.get());
    heap_ = std::move(grown);
    capacity_ = capacity;
  }

  friend bool operator==(const SmallVector& a, const SmallVector& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator!=(const SmallVector& a, const SmallVector& b) { return !(a == b); }

 private:
  T inline_[N];
  std::unique_ptr<T[]> heap_;  // (null while the elements fit in place)
  size_t capacity_ = N;
  size_t size_ = 0;
};

// A tensor's dims, in place up to the ranks models use.
using Shape = SmallVector<int64_t, 8>;

}  // namespace ortbridge
