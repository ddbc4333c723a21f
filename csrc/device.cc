#include "device.h"

#include <cstdint>

namespace ortbridge {

const char* ExecutionProviderType(Backend backend) {
  return backend == Backend::kCuda ? "CUDAExecutionProvider" : nullptr;
}

Placement PlacementOf(const OrtApi& api, const OrtKernelInfo* info, Backend backend) {
  Placement placement;
  placement.backend = backend;
  if (backend != Backend::kCuda) return placement;
  OrtAllocator* allocator = nullptr;
  ThrowOnError(api, api.KernelInfoGetAllocator(info, OrtMemTypeDefault, &allocator));
  const OrtMemoryInfo* memory = nullptr;
  int id = 0;
  OrtStatus* status = api.AllocatorGetInfo(allocator, &memory);
  if (!status) status = api.MemoryInfoGetId(memory, &id);
  api.ReleaseAllocator(allocator);
  ThrowOnError(api, status);
  placement.device = {dl::kCUDA, id};
  return placement;
}

StreamScope::StreamScope(const OrtApi& api, OrtKernelContext* context, const Placement& placement,
                         const py::object& runner) {
  if (!placement.via_torch()) return;
  void* stream = nullptr;  // null on the CPU execution provider
  ThrowOnError(api, api.KernelContext_GetGPUComputeStream(context, &stream));
  previous_ = runner.attr(Runner().use_stream)(reinterpret_cast<uintptr_t>(stream));
  runner_ = runner;
}

StreamScope::~StreamScope() {
  if (!runner_) return;
  try {
    runner_.attr(Runner().restore_stream)(previous_);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("ortbridge: restoring torch's current stream");
  }
}

namespace {

py::object Capsule(void* data, int64_t type, const Shape& shape, dl::Device device,
                   const int64_t* strides = nullptr) {
  PyObject* capsule = BorrowAsCapsule(data, type, shape.data(), shape.size(), device, strides);
  if (!capsule) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(capsule);
}

}  // namespace

void TorchCopy(const py::object& runner, void* dst, const ImportedTensor& src) {
  const dl::Tensor& t = src.tensor();
  const int64_t type = FromDLDataType(t.dtype);
  const Shape shape = src.shape();
  runner.attr(Runner().copy_into)(Capsule(dst, type, shape, t.device),
                                  Capsule(const_cast<char*>(src.data()), type, shape, t.device, t.strides),
                                  src.Overlaps(dst));
}

void TorchCopy(const py::object& runner, void* dst, const TensorView& src, dl::Device device) {
  runner.attr(Runner().copy_into)(Capsule(dst, src.elem_type, src.shape, device),
                                  Capsule(src.data, src.elem_type, src.shape, device), false);
}

void TorchFill(const py::object& runner, const TensorView& dst, dl::Device device, int64_t value) {
  runner.attr(Runner().fill)(Capsule(dst.data, dst.elem_type, dst.shape, device), value);
}

}  // namespace ortbridge
