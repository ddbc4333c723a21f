#include "context_id.h"

#include <mutex>
#include <unordered_set>

#include "dlpack.h"
#include "run_scope.h"

namespace ortbridge {
namespace {

struct ContextIdTensor {
  dl::ManagedTensor managed;
  std::vector<int64_t> ids;
  int64_t size = 0;  // (the tensor's shape)
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
  for (int64_t id : holder->ids) {
    if (auto saved = Contexts().Take(id)) {
      ReleasePython(saved->ctx);
      ReleasePython(saved->node_owner);
    }
  }
  delete holder;
}

}  // namespace

PyObject* NewContextIdsCapsule(std::vector<int64_t> ids) {
  auto* holder = new ContextIdTensor;
  holder->ids = std::move(ids);
  holder->size = static_cast<int64_t>(holder->ids.size());
  dl::Tensor& t = holder->managed.dl_tensor;
  t.data = holder->ids.data();
  t.device = {dl::kCPU, 0};
  t.ndim = 1;
  ToDLDataType(ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, &t.dtype);
  t.shape = &holder->size;
  t.strides = nullptr;
  t.byte_offset = 0;
  holder->managed.manager_ctx = holder;
  holder->managed.deleter = ReleaseContextId;
  {
    std::lock_guard<std::mutex> lock(g_holders_mutex);
    g_holders.insert(holder);
  }
  HeldFromNowOn(holder->ids);
  return NewOwningCapsule(&holder->managed);
}

std::unordered_set<int64_t> HeldByContextIdTensors() {
  std::lock_guard<std::mutex> lock(g_holders_mutex);
  std::unordered_set<int64_t> ids;
  for (const ContextIdTensor* holder : g_holders) ids.insert(holder->ids.begin(), holder->ids.end());
  return ids;
}

}  // namespace ortbridge
