// SmallVector: the same contents whether its elements are in place or have moved to the heap,
// through growth, copies and moves in both directions.
#include "small_vector.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ortbridge {
namespace {

using Small = SmallVector<int64_t, 3>;

std::vector<int64_t> Items(const Small& v) { return {v.begin(), v.end()}; }

TEST(SmallVector, GrowsPastItsInlineRoomKeepingItsElements) {
  Small v;
  EXPECT_EQ(v.size(), 0u);
  for (int64_t i = 0; i < 10; ++i) {
    v.push_back(i * i);
    ASSERT_EQ(v.size(), static_cast<size_t>(i + 1));
  }
  EXPECT_EQ(Items(v), (std::vector<int64_t>{0, 1, 4, 9, 16, 25, 36, 49, 64, 81}));
}

TEST(SmallVector, ResizeFillsOnlyTheNewElements) {
  Small v{7, 8};
  v.resize(5, -1);
  EXPECT_EQ(Items(v), (std::vector<int64_t>{7, 8, -1, -1, -1}));
  v.resize(1);
  EXPECT_EQ(Items(v), (std::vector<int64_t>{7}));
}

TEST(SmallVector, CopiesAndMovesInPlaceAndOnTheHeap) {
  for (size_t n : {2u, 3u, 4u, 9u}) {  // (in place: up to 3)
    std::vector<int64_t> items;
    for (size_t i = 0; i < n; ++i) items.push_back(static_cast<int64_t>(100 + i));
    const Small original(items.begin(), items.end());
    Small copy = original;
    EXPECT_EQ(Items(copy), items);
    EXPECT_TRUE(copy == original);
    copy[0] = -5;  // the copy has storage of its own
    EXPECT_EQ(original[0], 100);
    EXPECT_TRUE(copy != original);

    Small moved = std::move(copy);
    EXPECT_EQ(moved[0], -5);
    EXPECT_EQ(moved.size(), n);
    EXPECT_EQ(copy.size(), 0u);
    copy.push_back(1);  // a moved-from vector is usable
    EXPECT_EQ(Items(copy), (std::vector<int64_t>{1}));

    Small target{1, 2, 3, 4, 5};  // (on the heap) assigned from any size
    target = original;
    EXPECT_EQ(Items(target), items);
    target = Small{9};
    EXPECT_EQ(Items(target), (std::vector<int64_t>{9}));
  }
}

TEST(SmallVector, ComparesByElements) {
  EXPECT_TRUE((Small{1, 2}) == (Small{1, 2}));
  EXPECT_TRUE((Small{1, 2}) != (Small{1, 2, 3}));
  EXPECT_TRUE((Small{1, 2, 3, 4}) != (Small{1, 2, 3, 5}));
  EXPECT_TRUE(Small() == Small());
}

// Elements that own memory (as a TensorView's shape may): moved, not copied as bytes, when the
// vector grows or moves, and each copy owning its own.
TEST(SmallVector, KeepsElementsThatOwnMemory) {
  using Names = SmallVector<std::string, 2>;
  const std::string longer(64, 'x');  // (past std::string's own in-place room)
  Names v;
  for (int i = 0; i < 5; ++i) v.push_back(longer + std::to_string(i));  // in place, then on the heap
  ASSERT_EQ(v.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(v[i], longer + std::to_string(i));
  Names copy = v;
  copy[0] += "!";
  EXPECT_EQ(v[0], longer + "0");
  Names moved = std::move(copy);
  EXPECT_EQ(moved[0], longer + "0!");
  EXPECT_EQ(copy.size(), 0u);

  Names small{"a", "b"};  // moved while in place
  Names target{"c", "d", "e"};
  target = std::move(small);
  EXPECT_EQ(target.size(), 2u);
  EXPECT_EQ(target[0], "a");
  EXPECT_EQ(target[1], "b");
}

}  // namespace
}  // namespace ortbridge
