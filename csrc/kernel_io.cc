#include "kernel_io.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#include "dlpack.h"

namespace ortbridge {
namespace {

std::atomic<uint64_t> g_skipped_copies{0};

// From this size a host copy goes through torch, whose copy runs on its intra-op threads: on two
// cores that is ~2x one memcpy at 4 MiB and ~3x at 16 MiB, against ~5 us for the call into Python.
constexpr size_t kTorchCopyBytes = size_t{1} << 20;

// As Python prints a tuple: (), (3,), (2, 3).
template <class Dims>
std::string ShapeText(const Dims& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

[[noreturn]] void ThrowTypeMismatch(const std::string& what, int64_t got, int64_t expected) {
  throw std::runtime_error(what + " is " + (got ? ElementTypeName(got) : "of a dtype with no ONNX type") +
                           ", but the node declares " + ElementTypeName(expected));
}

}  // namespace

TensorView ReadInput(const OrtApi& api, OrtKernelContext* context, size_t index, int64_t type, int64_t rank) {
  TensorView t;
  if (!GetInputTensor(api, context, index, &t))
    throw std::runtime_error("input " + std::to_string(index) + " is missing");
  if (t.elem_type != type) ThrowTypeMismatch("input " + std::to_string(index), t.elem_type, type);
  if (rank >= 0 && static_cast<int64_t>(t.shape.size()) != rank) {
    throw std::runtime_error("input " + std::to_string(index) + " has rank " +
                             std::to_string(t.shape.size()) + ", but the node declares rank " +
                             std::to_string(rank));
  }
  return t;
}

py::tuple BorrowInputs(const TensorViews& inputs, dl::Device device) {
  py::tuple capsules(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const TensorView& t = inputs[i];
    PyObject* item = Py_None;
    if (t.elem_type == 0) {
      Py_INCREF(item);  // no tensor in this slot
    } else {
      item = BorrowAsCapsule(t.data, t.elem_type, t.shape.data(), t.shape.size(), device);
      if (!item) throw py::error_already_set();
    }
    PyTuple_SET_ITEM(capsules.ptr(), i, item);
  }
  return capsules;
}

TensorView KernelOutputs::Write(size_t index, PyObject* capsule, int64_t type, int64_t rank, const char* kind,
                                const Shape* expected_shape) {
  ImportedTensor t(capsule);
  const dl::Tensor& d = t.tensor();
  auto what = [&] { return std::string(kind) + " " + std::to_string(index); };
  const dl::Device device = placement_.device;
  if (d.device.device_type != device.device_type || d.device.device_id != device.device_id) {
    const std::string runs_on = placement_.backend == Backend::kCuda
                                    ? DeviceName(device) + " (the CUDA execution provider)"
                                    : std::string("the CPU execution provider");
    throw std::runtime_error(what() + " is on " + DeviceName(d.device) + ", but this kernel runs on " +
                             runs_on);
  }
  const int64_t got = FromDLDataType(d.dtype);
  if (got != type) ThrowTypeMismatch(what(), got, type);
  if (d.ndim != rank) {
    throw std::runtime_error(what() + " has rank " + std::to_string(d.ndim) +
                             ", but the node declares rank " + std::to_string(rank));
  }
  TensorView out;
  out.elem_type = type;
  out.shape = t.shape();
  if (expected_shape && out.shape != *expected_shape) {
    throw std::runtime_error(what() + " has shape " + ShapeText(out.shape) +
                             ", but the forward input had shape " + ShapeText(*expected_shape));
  }
  if (const Lent* lent = LentElsewhere(index, t.data())) {
    throw std::runtime_error(what() + " is in the buffer lent for output " + std::to_string(lent->index) +
                             ": return a lent buffer as its own output");
  }
  out.data = Allocate(index, out.shape, type);
  if (out.data == t.data() && t.compact()) {
    g_skipped_copies.fetch_add(1, std::memory_order_relaxed);  // the Function wrote into ORT's buffer
  } else if (CopiedByTorch(static_cast<size_t>(t.element_count()) * t.element_size())) {
    TorchCopy(runner_, out.data, t);  // queued on the stream: t's memory stays valid (see device.h)
  } else {
    t.CopyTo(out.data);  // also a view of that buffer (a transpose, a slice): it may overlap
  }
  return out;
}

bool KernelOutputs::CopiedByTorch(size_t bytes) const {
  return placement_.via_torch() || bytes >= kTorchCopyBytes;
}

void KernelOutputs::Redirect(size_t index, TensorView* input) {
  void* buffer = Allocate(index, input->shape, input->elem_type);
  if (buffer == input->data) return;
  const size_t bytes = input->byte_size();
  if (CopiedByTorch(bytes)) {
    TorchCopy(runner_, buffer, *input, placement_.device);
  } else {
    std::memcpy(buffer, input->data, bytes);
  }
  input->data = buffer;
}

void KernelOutputs::Zeros(size_t index, const TensorMeta& meta) {
  TensorView out;
  static_cast<TensorMeta&>(out) = meta;
  out.data = Allocate(index, meta.shape, meta.elem_type);
  if (placement_.via_torch()) {
    TorchFill(runner_, out, placement_.device, 0);
  } else {
    std::memset(out.data, 0, meta.byte_size());
  }
}

void KernelOutputs::Scalar(size_t index, int64_t value) {
  TensorView out;
  out.elem_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  out.data = Allocate(index, {}, out.elem_type);
  if (placement_.via_torch()) {
    TorchFill(runner_, out, placement_.device, value);
  } else {
    *static_cast<int64_t*>(out.data) = value;
  }
}

py::object KernelOutputs::Lend(size_t index, const Shape& shape, int64_t type) {
  void* data = Allocate(index, shape, type);
  lent_.push_back({index, static_cast<const char*>(data), TensorMeta{type, shape}.byte_size()});
  PyObject* capsule = BorrowAsCapsule(data, type, shape.data(), shape.size(), placement_.device);
  if (!capsule) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(capsule);
}

const KernelOutputs::Lent* KernelOutputs::LentElsewhere(size_t index, const void* data) const {
  const char* p = static_cast<const char*>(data);
  for (const Lent& l : lent_) {
    if (l.index != index && p >= l.begin && p < l.begin + l.bytes) return &l;
  }
  return nullptr;
}

namespace {

thread_local OutputLending* t_lending = nullptr;  // the innermost kernel call on this thread

}  // namespace

OutputLending* OutputLending::Enter(OutputLending* self) {
  OutputLending* outer = t_lending;
  t_lending = self;
  return outer;
}

OutputLending::~OutputLending() { t_lending = outer_; }

py::object LendOutput(size_t output, const std::vector<int64_t>& shape) {
  const OutputLending* lending = t_lending;
  if (!lending || !lending->writer_) return py::none();
  const std::vector<int64_t>& types = *lending->types_;
  if (output >= types.size()) {
    throw py::index_error("output " + std::to_string(output) + " of a node with " +
                          std::to_string(types.size()) + " outputs");
  }
  const int64_t rank = (*lending->ranks_)[output];
  if (static_cast<int64_t>(shape.size()) != rank) {
    throw py::value_error("output " + std::to_string(output) + " cannot have shape " + ShapeText(shape) +
                          ": the node declares rank " + std::to_string(rank));
  }
  if (std::any_of(shape.begin(), shape.end(), [](int64_t d) { return d < 0; })) {
    throw py::value_error("output " + std::to_string(output) + " cannot have shape " + ShapeText(shape) +
                          ": a size is negative");
  }
  return lending->writer_->Lend(output + lending->skipped_, Shape(shape.begin(), shape.end()), types[output]);
}

uint64_t SkippedOutputCopies() { return g_skipped_copies.load(); }

}  // namespace ortbridge
