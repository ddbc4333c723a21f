// The library's C boundary. Guarded, around every kernel callback: exceptions become ORT error statuses,
// except the forced unwind that ends a thread, which must pass through (else glibc aborts the process:
// "FATAL: exception not rethrown"). CPython ends a daemon thread that way when it asks for the GIL
// during interpreter exit, which happens to a thread inside a Function.
#include "ort_util.h"

#include <cxxabi.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <string>

namespace ortbridge {
namespace {

std::string g_status_message;

OrtStatus* ORT_API_CALL RecordStatus(OrtErrorCode, const char* message) noexcept {
  g_status_message = message;
  static int marker;
  return reinterpret_cast<OrtStatus*>(&marker);
}

OrtApi FakeApi() {
  OrtApi api{};
  api.CreateStatus = RecordStatus;
  return api;
}

TEST(Guarded, TurnsExceptionsIntoStatuses) {
  const OrtApi api = FakeApi();
  EXPECT_EQ(Guarded(api, "node: ", [] {}), nullptr);
  EXPECT_NE(Guarded(api, "node: ", [] { throw std::runtime_error("bad attribute"); }), nullptr);
  EXPECT_EQ(g_status_message, "node: bad attribute");
  EXPECT_NE(Guarded(api, "node: ", [] { throw 42; }), nullptr);
  EXPECT_EQ(g_status_message, "node: unknown C++ exception");
}

std::atomic<bool> g_unwound{false};
std::atomic<bool> g_returned{false};

void* ExitInsideGuarded(void* api) {
  try {
    Guarded(*static_cast<const OrtApi*>(api), "", [] { pthread_exit(nullptr); });
    g_returned = true;
  } catch (abi::__forced_unwind&) {
    g_unwound = true;
    throw;
  }
  return nullptr;
}

TEST(Guarded, LetsTheForcedUnwindOfAThreadExitThrough) {
  OrtApi api = FakeApi();
  pthread_t thread;
  ASSERT_EQ(pthread_create(&thread, nullptr, ExitInsideGuarded, &api), 0);
  ASSERT_EQ(pthread_join(thread, nullptr), 0);
  EXPECT_TRUE(g_unwound);
  EXPECT_FALSE(g_returned);
}

// onnxruntime 1.18 loads the kernels but ignores the types their shape inference sets.
TEST(RegisterCustomOps, RefusesOnnxRuntimeOlderThan119) {
  for (const char* v : {"1.19.0", "1.19.2", "1.20.1", "1.32.0", "2.0.0"})
    EXPECT_TRUE(IsSupportedOrtVersion(v)) << v;
  for (const char* v : {"1.18.1", "1.18.0", "1.9.0", "0.99", "", "garbage"})
    EXPECT_FALSE(IsSupportedOrtVersion(v)) << v;
}

}  // namespace
}  // namespace ortbridge
