#include "dlpack.h"

#include <cstring>
#include <new>
#include <stdexcept>

#include "element_types.h"

namespace ortbridge {
namespace {

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

// One allocation holds the DLPack header and, after it, its shape and stride arrays (one per
// input and call, so a second allocation for the arrays counts).
struct BorrowedTensor {
  dl::ManagedTensor managed;

  static BorrowedTensor* New(size_t ndim) {
    static_assert(sizeof(BorrowedTensor) % alignof(int64_t) == 0);
    void* memory = ::operator new(sizeof(BorrowedTensor) + 2 * ndim * sizeof(int64_t));
    return new (memory) BorrowedTensor;
  }
  static void Delete(BorrowedTensor* b) {
    b->~BorrowedTensor();
    ::operator delete(b);
  }
  int64_t* shape_and_strides() { return reinterpret_cast<int64_t*>(this + 1); }
};

void DeleteBorrowed(dl::ManagedTensor* self) {
  BorrowedTensor::Delete(static_cast<BorrowedTensor*>(self->manager_ctx));
}

// A capsule torch never consumed still owns its tensor.
void CapsuleDestructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) return;
  auto* managed = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed && managed->deleter) managed->deleter(managed);
}

}  // namespace

bool IsHostCapsule(PyObject* capsule) {
  auto* managed = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  return managed && managed->dl_tensor.device.device_type == dl::kCPU;
}

int64_t CapsuleElementType(PyObject* capsule) {
  auto* managed = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  return managed ? FromDLDataType(managed->dl_tensor.dtype) : 0;
}

bool ToDLDataType(int64_t onnx_type, dl::DataType* out) {
  const ElementType* t = FindElementType(onnx_type);
  if (t) *out = {t->dlpack_code, t->bits, 1};
  return t != nullptr;
}

int64_t FromDLDataType(dl::DataType d) {
  if (d.lanes != 1) return 0;
  for (const ElementType& t : kElementTypes) {
    if (t.dlpack_code == d.code && t.bits == d.bits) return t.onnx;
  }
  return 0;
}

PyObject* BorrowAsCapsule(void* data, int64_t onnx_type, const int64_t* shape, size_t ndim, dl::Device device,
                          const int64_t* given_strides) {
  BorrowedTensor* b = BorrowedTensor::New(ndim);
  int64_t* dims = b->shape_and_strides();
  int64_t* strides = dims + ndim;
  int64_t stride = 1;
  for (size_t i = ndim; i-- > 0;) {
    dims[i] = shape[i];
    strides[i] = given_strides ? given_strides[i] : stride;
    stride *= shape[i] > 0 ? shape[i] : 1;
  }
  dl::Tensor& t = b->managed.dl_tensor;
  t.data = data;
  t.device = device;
  t.ndim = static_cast<int32_t>(ndim);
  ToDLDataType(onnx_type, &t.dtype);
  t.shape = ndim ? dims : nullptr;
  t.strides = ndim ? strides : nullptr;
  t.byte_offset = 0;
  b->managed.manager_ctx = b;
  b->managed.deleter = DeleteBorrowed;
  return NewOwningCapsule(&b->managed);
}

PyObject* NewOwningCapsule(dl::ManagedTensor* managed) {
  PyObject* capsule = PyCapsule_New(managed, kCapsuleName, CapsuleDestructor);
  if (!capsule) managed->deleter(managed);
  return capsule;
}

ImportedTensor::ImportedTensor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) {
    throw std::runtime_error("expected an unconsumed DLPack capsule");
  }
  managed_ = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  PyCapsule_SetName(capsule, kUsedCapsuleName);  // ownership moves to this object
}

ImportedTensor::~ImportedTensor() {
  if (managed_->deleter) managed_->deleter(managed_);
}

int64_t ImportedTensor::element_count() const {
  int64_t n = 1;
  for (int32_t i = 0; i < tensor().ndim; ++i) n *= tensor().shape[i];
  return n;
}

bool ImportedTensor::compact() const {
  const dl::Tensor& t = tensor();
  if (!t.strides) return true;
  int64_t expected = 1;
  for (int32_t i = t.ndim; i-- > 0;) {
    if (t.shape[i] != 1 && t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

void ImportedTensor::CopyTo(void* dst) const {
  const size_t item = element_size();
  const int64_t n = element_count();
  if (n == 0) return;
  if (compact()) {
    std::memmove(dst, data(), n * item);  // memmove: dst may overlap
    return;
  }
  char* out = static_cast<char*>(dst);
  if (Overlaps(dst)) {  // through a buffer
    std::vector<char> staging(n * item);
    CopyStrided(staging.data());
    std::memcpy(out, staging.data(), staging.size());
  } else {
    CopyStrided(out);
  }
}

bool ImportedTensor::Overlaps(const void* dst) const {
  // The bytes the (possibly strided) elements span.
  const dl::Tensor& t = tensor();
  const int64_t item = static_cast<int64_t>(element_size());
  const int64_t n = element_count();
  if (n == 0) return false;
  int64_t low = 0, high = n - 1;
  if (t.strides) {
    high = 0;
    for (int32_t d = 0; d < t.ndim; ++d) {
      const int64_t reach = (t.shape[d] - 1) * t.strides[d];
      (reach < 0 ? low : high) += reach;
    }
  }
  const char* first = data() + low * item;
  const char* end = data() + (high + 1) * item;
  const char* out = static_cast<const char*>(dst);
  return out < end && first < out + n * item;
}

void ImportedTensor::CopyStrided(char* out) const {
  // Walk the index odometer, copying the innermost dimension per step.
  const dl::Tensor& t = tensor();
  const size_t item = element_size();
  const int64_t n = element_count();
  const int32_t nd = t.ndim;
  const int64_t inner = t.shape[nd - 1];
  const int64_t inner_stride = t.strides[nd - 1] * static_cast<int64_t>(item);
  std::vector<int64_t> index(nd, 0);
  const char* base = data();
  for (int64_t done = 0; done < n; done += inner) {
    int64_t offset = 0;
    for (int32_t d = 0; d < nd - 1; ++d) offset += index[d] * t.strides[d];
    const char* src = base + offset * static_cast<int64_t>(item);
    if (inner_stride == static_cast<int64_t>(item)) {
      std::memcpy(out, src, inner * item);
      out += inner * item;
    } else {
      for (int64_t k = 0; k < inner; ++k, out += item) std::memcpy(out, src + k * inner_stride, item);
    }
    for (int32_t d = nd - 2; d >= 0; --d) {
      if (++index[d] < t.shape[d]) break;
      index[d] = 0;
    }
  }
}

std::string DeviceName(dl::Device device) {
  switch (device.device_type) {
    case dl::kCPU:
      return "cpu";
    case dl::kCUDA:
      return "cuda:" + std::to_string(device.device_id);
    case dl::kCUDAHost:
      return "cuda_host";
    default:
      return "device type " + std::to_string(device.device_type);
  }
}

}  // namespace ortbridge
