#include "context_id.h"

#include <mutex>
#include <unordered_set>

#include "dlpack.h"
#include "proxy.h"

namespace ortbridge {
namespace {

struct ContextIdTensor {
  dl::ManagedTensor managed;
  int64_t id = ContextPool<SavedContext>::kNoContext;
};

// The live context-id tensors (a handful: one per pending backward).
std::mutex g_holders_mutex;
std::unordered_set<const ContextIdTensor*> g_holders;

void ReleaseContextId(dl::ManagedTensor* self) {
  auto* holder = static_cast<ContextIdTensor*>(self->manager_ctx);
  {
    std::lock_guard<std::mutex> lock(g_holders_mutex);
    g_holders.erase(holder);
  }
  // An id whose backward already took its context finds nothing (ids are 63 random bits: that a
  // new context drew the same id meanwhile is not a case to plan for).
  if (auto saved = Contexts().Take(holder->id)) ReleasePython(saved->ctx);
  delete holder;
}

}  // namespace

PyObject* NewContextIdCapsule(int64_t id) {
  auto* holder = new ContextIdTensor;
  holder->id = id;
  dl::Tensor& t = holder->managed.dl_tensor;
  t.data = &holder->id;
  t.device = {dl::kCPU, 0};
  t.ndim = 0;
  ToDLDataType(ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, &t.dtype);
  t.shape = nullptr;
  t.strides = nullptr;
  t.byte_offset = 0;
  holder->managed.manager_ctx = holder;
  holder->managed.deleter = ReleaseContextId;
  {
    std::lock_guard<std::mutex> lock(g_holders_mutex);
    g_holders.insert(holder);
  }
  return NewOwningCapsule(&holder->managed);
}

std::unordered_set<int64_t> HeldByContextIdTensors() {
  std::lock_guard<std::mutex> lock(g_holders_mutex);
  std::unordered_set<int64_t> ids;
  for (const ContextIdTensor* holder : g_holders) ids.insert(holder->id);
  return ids;
}

}  // namespace ortbridge
