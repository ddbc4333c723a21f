// The DLPack ABI (legacy, unversioned "dltensor" capsules), which torch.from_dlpack and
// torch.utils.dlpack.to_dlpack speak. Declared here from the public specification, plus the
// conversions between ONNX Runtime buffers and capsules.
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

#include "small_vector.h"

namespace ortbridge {

namespace dl {
enum DeviceType : int32_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3 };
struct Device {
  int32_t device_type;
  int32_t device_id;
};
struct DataType {
  uint8_t code;  // the codes of each element type: element_types.h
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};
}  // namespace dl

// ONNX element type <-> DLPack dtype. Returns false for types DLPack cannot express.
bool ToDLDataType(int64_t onnx_type, dl::DataType* out);
int64_t FromDLDataType(dl::DataType dtype);  // 0 when there is no ONNX type for it

// A new "dltensor" capsule viewing `data` (borrowed: valid only while its owner keeps the
// buffer), with `strides` in elements (null: compact row-major).
PyObject* BorrowAsCapsule(void* data, int64_t onnx_type, const int64_t* shape, size_t ndim, dl::Device device,
                          const int64_t* strides = nullptr);

// A new "dltensor" capsule that owns `managed`: the consumer calls its deleter, or the capsule
// does when nobody consumed it (also when creating the capsule fails).
PyObject* NewOwningCapsule(dl::ManagedTensor* managed);

// Whether a "dltensor" capsule holds a tensor in host memory (DLPack's CPU device).
bool IsHostCapsule(PyObject* capsule);

// The ONNX element type of the tensor a "dltensor" capsule holds (0: none).
int64_t CapsuleElementType(PyObject* capsule);

// A tensor handed over by Python: owns the DLPack producer's memory until destroyed.
class ImportedTensor {
 public:
  // Takes the capsule's DLManagedTensor; throws std::runtime_error when it is not one.
  explicit ImportedTensor(PyObject* capsule);
  ImportedTensor(const ImportedTensor&) = delete;
  ImportedTensor& operator=(const ImportedTensor&) = delete;
  ~ImportedTensor();

  const dl::Tensor& tensor() const { return managed_->dl_tensor; }
  const char* data() const { return static_cast<const char*>(tensor().data) + tensor().byte_offset; }
  Shape shape() const { return {tensor().shape, tensor().shape + tensor().ndim}; }
  int64_t element_count() const;
  size_t element_size() const { return tensor().dtype.bits / 8; }
  // Whether the elements lie in row-major order without gaps (no strides, or compact ones).
  bool compact() const;
  // Whether the `element_count()` elements at dst overlap the bytes this tensor spans.
  bool Overlaps(const void* dst) const;
  // Copies the elements, in row-major order, to host memory dst (which holds element_count()
  // elements). dst may overlap the tensor's own memory (a view of the buffer ORT gave the output).
  void CopyTo(void* dst) const;

 private:
  void CopyStrided(char* dst) const;
  dl::ManagedTensor* managed_;
};

std::string DeviceName(dl::Device device);

}  // namespace ortbridge
