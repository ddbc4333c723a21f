// ContextPool with a move-only handle that counts live instances, so that a leak or a double
// destruction shows up as a wrong count.
#include "pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

namespace ortbridge {
namespace {

std::atomic<int> g_live{0};

class Handle {
 public:
  explicit Handle(int value) : value_(value), owns_(true) { ++g_live; }
  Handle(Handle&& other) noexcept : value_(other.value_), owns_(other.owns_) { other.owns_ = false; }
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      Reset();
      value_ = other.value_;
      owns_ = other.owns_;
      other.owns_ = false;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { Reset(); }

  int value() const { return value_; }

 private:
  void Reset() {
    if (owns_) --g_live;
    owns_ = false;
  }
  int value_;
  bool owns_;
};

using Pool = ContextPool<Handle>;

class PoolTest : public ::testing::Test {
 protected:
  void SetUp() override { g_live = 0; }
  void TearDown() override { EXPECT_EQ(g_live.load(), 0) << "handles leaked or destroyed twice"; }
};

TEST_F(PoolTest, IdsAreUniqueAndNeverNoContext) {
  Pool pool;
  std::set<int64_t> ids;
  for (int i = 0; i < 100; ++i) {
    int64_t id = pool.Add(Handle(i));
    EXPECT_NE(id, Pool::kNoContext);
    EXPECT_TRUE(ids.insert(id).second) << "id " << id << " given twice";
  }
  EXPECT_EQ(pool.Size(), 100u);
  EXPECT_EQ(g_live.load(), 100);
  pool.TakeAll();
}

TEST_F(PoolTest, IdsAreNotReusedAfterTake) {
  Pool pool;
  int64_t first = pool.Add(Handle(1));
  pool.Take(first);
  EXPECT_NE(pool.Add(Handle(2)), first);  // (random: equal once in 2^63 draws)
  pool.TakeAll();
}

TEST_F(PoolTest, IdsCannotBeGuessedFromAnother) {
  // A model that sees one id (its own context's) must not be able to compute another: ids are
  // positive 63-bit random numbers, not a count.
  Pool pool;
  std::vector<int64_t> ids;
  for (int i = 0; i < 200; ++i) ids.push_back(pool.Add(Handle(i)));
  int high_bit_set = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_GT(ids[i], 0);
    if (i > 0) {
      EXPECT_GT(std::llabs(ids[i] - ids[i - 1]), 1 << 20)
          << "consecutive ids " << ids[i - 1] << ", " << ids[i];
    }
    high_bit_set += (ids[i] >> 62) & 1;
  }
  EXPECT_GT(high_bit_set, 50);  // about 100 of 200 draws
  EXPECT_LT(high_bit_set, 150);
  pool.TakeAll();
}

TEST_F(PoolTest, TakeIfLeavesAnEntryThatDoesNotBelong) {
  Pool pool;
  int64_t id = pool.Add(Handle(7));
  EXPECT_FALSE(pool.TakeIf(id, [](const Handle& h) { return h.value() == 8; }).has_value());
  EXPECT_TRUE(pool.Contains(id));
  EXPECT_EQ(pool.TakeIf(id, [](const Handle& h) { return h.value() == 7; })->value(), 7);
  EXPECT_FALSE(pool.Contains(id));
}

TEST_F(PoolTest, TakeReturnsTheHandleOnce) {
  Pool pool;
  int64_t a = pool.Add(Handle(7));
  int64_t b = pool.Add(Handle(8));
  std::optional<Handle> h = pool.Take(a);
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->value(), 7);
  EXPECT_EQ(pool.Size(), 1u);
  EXPECT_FALSE(pool.Take(a).has_value());
  EXPECT_EQ(pool.Size(), 1u);
  h.reset();
  EXPECT_EQ(g_live.load(), 1);  // b is still held by the pool
  EXPECT_EQ(pool.Take(b)->value(), 8);
  EXPECT_EQ(pool.Size(), 0u);
}

TEST_F(PoolTest, TakeOfUnknownIdLeavesPoolAlone) {
  Pool pool;
  EXPECT_FALSE(pool.Take(Pool::kNoContext).has_value());
  int64_t id = pool.Add(Handle(1));
  EXPECT_FALSE(pool.Take(Pool::kNoContext).has_value());
  EXPECT_FALSE(pool.Take(id + 1).has_value());
  EXPECT_FALSE(pool.Take(-id).has_value());
  EXPECT_EQ(pool.Size(), 1u);
  EXPECT_EQ(g_live.load(), 1);
  pool.TakeAll();
}

TEST_F(PoolTest, TakeAllEmptiesThePool) {
  Pool pool;
  std::multiset<int> added;
  for (int i = 0; i < 10; ++i) {
    pool.Add(Handle(i));
    added.insert(i);
  }
  std::vector<Handle> all = pool.TakeAll();
  EXPECT_EQ(pool.Size(), 0u);
  EXPECT_EQ(g_live.load(), 10);  // handed back, not yet destroyed
  std::multiset<int> got;
  for (const Handle& h : all) got.insert(h.value());
  EXPECT_EQ(got, added);
  all.clear();
  EXPECT_EQ(g_live.load(), 0);
  EXPECT_TRUE(pool.TakeAll().empty());
}

TEST_F(PoolTest, DestroyingThePoolDestroysItsHandles) {
  {
    Pool pool;
    pool.Add(Handle(1));
    pool.Add(Handle(2));
    EXPECT_EQ(g_live.load(), 2);
  }
  EXPECT_EQ(g_live.load(), 0);
}

TEST_F(PoolTest, WorksWithUniquePtr) {
  ContextPool<std::unique_ptr<int>> pool;
  int64_t id = pool.Add(std::make_unique<int>(5));
  auto h = pool.Take(id);
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(**h, 5);
  EXPECT_FALSE(pool.Take(id).has_value());
}

// Four threads add and take concurrently, each taking back half of its own ids at once and
// the rest at the end: every handle comes back exactly once and none is left.
TEST_F(PoolTest, ConcurrentAddAndTake) {
  Pool pool;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 2000;
  std::atomic<int> taken{0};
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::pair<int64_t, int>> kept;
      for (int i = 0; i < kPerThread; ++i) {
        const int value = t * kPerThread + i;
        int64_t id = pool.Add(Handle(value));
        if (i % 2 == 0) {
          kept.emplace_back(id, value);
          continue;
        }
        auto h = pool.Take(id);
        ++(h && h->value() == value ? taken : wrong);
      }
      for (const auto& [id, value] : kept) {
        auto h = pool.Take(id);
        ++(h && h->value() == value ? taken : wrong);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(taken.load(), kThreads * kPerThread);
  EXPECT_EQ(pool.Size(), 0u);
  EXPECT_EQ(g_live.load(), 0);
}

}  // namespace
}  // namespace ortbridge
