#include "ort_util.h"

#include <atomic>

namespace ortbridge {

void ThrowOnError(const OrtApi& api, OrtStatus* status) {
  if (!status) return;
  std::string message = api.GetErrorMessage(status);
  api.ReleaseStatus(status);
  throw OrtError(message);
}

bool KernelInfoAttributes::Ok(OrtStatus* status) const {
  if (!status) return true;
  api_.ReleaseStatus(status);
  return false;
}

bool KernelInfoAttributes::Has(const char* name) const {
  // The C API has no presence query: an attribute exists if a getter of some type finds it.
  int64_t i;
  float f;
  size_t size = 0;
  return Ok(api_.KernelInfoGetAttribute_int64(info_, name, &i)) ||
         Ok(api_.KernelInfoGetAttribute_float(info_, name, &f)) ||
         Ok(api_.KernelInfoGetAttribute_string(info_, name, nullptr, &size)) ||
         Ok(api_.KernelInfoGetAttributeArray_int64(info_, name, nullptr, &size)) ||
         Ok(api_.KernelInfoGetAttributeArray_float(info_, name, nullptr, &size));
}

bool KernelInfoAttributes::GetInt(const char* name, int64_t* out) const {
  return Ok(api_.KernelInfoGetAttribute_int64(info_, name, out));
}

bool KernelInfoAttributes::GetString(const char* name, std::string* out) const {
  size_t size = 0;
  if (!Ok(api_.KernelInfoGetAttribute_string(info_, name, nullptr, &size))) return false;
  std::string s(size, '\0');
  if (!Ok(api_.KernelInfoGetAttribute_string(info_, name, s.data(), &size))) return false;
  s.resize(size > 0 ? size - 1 : 0);  // size counts the terminating NUL
  *out = std::move(s);
  return true;
}

bool KernelInfoAttributes::GetInts(const char* name, std::vector<int64_t>* out) const {
  size_t size = 0;
  if (!Ok(api_.KernelInfoGetAttributeArray_int64(info_, name, nullptr, &size))) return false;
  out->resize(size);
  return size == 0 || Ok(api_.KernelInfoGetAttributeArray_int64(info_, name, out->data(), &size));
}

bool KernelInfoAttributes::GetFloats(const char* name, std::vector<float>* out) const {
  size_t size = 0;
  if (!Ok(api_.KernelInfoGetAttributeArray_float(info_, name, nullptr, &size))) return false;
  out->resize(size);
  return size == 0 || Ok(api_.KernelInfoGetAttributeArray_float(info_, name, out->data(), &size));
}

std::vector<int64_t> ShapeInferInts(const OrtApi& api, OrtShapeInferContext* ctx, const char* name,
                                    bool required) {
  const OrtOpAttr* attr = nullptr;
  OrtStatus* status = api.ShapeInferContext_GetAttribute(ctx, name, &attr);
  if (status || !attr) {
    if (status) api.ReleaseStatus(status);
    if (!required) return {};
    throw OrtError(std::string("attribute '") + name + "' is missing");
  }
  size_t bytes = 0;  // ReadOpAttr counts bytes, not elements
  status = api.ReadOpAttr(attr, ORT_OP_ATTR_INTS, nullptr, 0, &bytes);
  if (status) api.ReleaseStatus(status);  // the size query reports "buffer too small"
  std::vector<int64_t> v(bytes / sizeof(int64_t));
  if (!v.empty()) ThrowOnError(api, api.ReadOpAttr(attr, ORT_OP_ATTR_INTS, v.data(), bytes, &bytes));
  return v;
}

void SetOutputTypeAndRank(const OrtApi& api, OrtShapeInferContext* ctx, size_t index, int64_t elem_type,
                          int64_t rank) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ThrowOnError(api, api.CreateTensorTypeAndShapeInfo(&info));
  // ORT records a dimension without a name as the value -1, so each unknown dimension gets a
  // name of its own (names shared between dimensions would claim they are equal).
  static std::atomic<uint64_t> counter{0};
  std::vector<int64_t> dims(rank > 0 ? rank : 0, -1);
  std::vector<std::string> names(dims.size());
  std::vector<const char*> params(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    names[i] = "ortbridge_dim_" + std::to_string(counter++);
    params[i] = names[i].c_str();
  }
  OrtStatus* status = api.SetTensorElementType(info, static_cast<ONNXTensorElementDataType>(elem_type));
  if (!status) status = api.SetDimensions(info, dims.data(), dims.size());
  if (!status) status = api.SetSymbolicDimensions(info, params.data(), params.size());
  if (!status) status = api.ShapeInferContext_SetOutputTypeShape(ctx, index, info);
  api.ReleaseTensorTypeAndShapeInfo(info);
  ThrowOnError(api, status);
}

bool CopyInputTypeShape(const OrtApi& api, OrtShapeInferContext* ctx, size_t input, size_t output, int64_t elem_type,
                        int64_t rank) {
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  ThrowOnError(api, api.ShapeInferContext_GetInputTypeShape(ctx, input, &info));
  ONNXTensorElementDataType type;
  size_t dims = 0;
  ThrowOnError(api, api.GetTensorElementType(info, &type));
  ThrowOnError(api, api.GetDimensionsCount(info, &dims));
  if (type != elem_type || static_cast<int64_t>(dims) != rank) return false;
  ThrowOnError(api, api.ShapeInferContext_SetOutputTypeShape(ctx, output, info));
  return true;
}

std::string NodeName(const OrtApi& api, const OrtKernelInfo* info) {
  size_t size = 0;
  ThrowOnError(api, api.KernelInfo_GetNodeName(info, nullptr, &size));
  std::string s(size, '\0');
  ThrowOnError(api, api.KernelInfo_GetNodeName(info, s.data(), &size));
  s.resize(size > 0 ? size - 1 : 0);
  return s;
}

bool GetInputTensor(const OrtApi& api, OrtKernelContext* ctx, size_t index, TensorView* out) {
  const OrtValue* value = nullptr;
  ThrowOnError(api, api.KernelContext_GetInput(ctx, index, &value));
  if (!value) return false;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ThrowOnError(api, api.GetTensorTypeAndShape(value, &info));
  ONNXTensorElementDataType type;
  size_t rank = 0;
  OrtStatus* status = api.GetTensorElementType(info, &type);
  if (!status) status = api.GetDimensionsCount(info, &rank);
  if (!status) {
    out->shape.resize(rank);
    status = api.GetDimensions(info, out->shape.data(), rank);
  }
  api.ReleaseTensorTypeAndShapeInfo(info);
  ThrowOnError(api, status);
  out->elem_type = type;
  // ORT hands inputs as const; the kernel only reads them.
  ThrowOnError(api, api.GetTensorMutableData(const_cast<OrtValue*>(value), &out->data));
  return true;
}

void* AllocateOutput(const OrtApi& api, OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& shape) {
  OrtValue* value = nullptr;
  ThrowOnError(api, api.KernelContext_GetOutput(ctx, index, shape.data(), shape.size(), &value));
  void* data = nullptr;
  ThrowOnError(api, api.GetTensorMutableData(value, &data));
  return data;
}

}  // namespace ortbridge
