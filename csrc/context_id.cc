#include "context_id.h"

#include "dlpack.h"
#include "proxy.h"

namespace ortbridge {
namespace {

struct ContextIdTensor {
  dl::ManagedTensor managed;
  int64_t id = ContextPool<SavedContext>::kNoContext;
};

void ReleaseContextId(dl::ManagedTensor* self) {
  auto* holder = static_cast<ContextIdTensor*>(self->manager_ctx);
  // Ids are never reused, so an id whose backward already took its context finds nothing.
  if (auto saved = Contexts().Take(holder->id)) ReleasePython(saved->ctx);
  delete holder;
}

}  // namespace

PyObject* NewContextIdCapsule() {
  auto* holder = new ContextIdTensor;
  dl::Tensor& t = holder->managed.dl_tensor;
  t.data = &holder->id;
  t.device = {dl::kCPU, 0};
  t.ndim = 0;
  ToDLDataType(7 /* int64 */, &t.dtype);
  t.shape = nullptr;
  t.strides = nullptr;
  t.byte_offset = 0;
  holder->managed.manager_ctx = holder;
  holder->managed.deleter = ReleaseContextId;
  return NewOwningCapsule(&holder->managed);
}

}  // namespace ortbridge
