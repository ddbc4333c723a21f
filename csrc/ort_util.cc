#include "ort_util.h"

#include <atomic>

namespace ortbridge {

namespace {

// Whether an ORT call succeeded; a failure's status is released (for optional information).
bool Released(const OrtApi& api, OrtStatus* status) {
  if (status) api.ReleaseStatus(status);
  return status == nullptr;
}

}  // namespace

void ThrowOnError(const OrtApi& api, OrtStatus* status) {
  if (!status) return;
  std::string message = api.GetErrorMessage(status);
  api.ReleaseStatus(status);
  throw OrtError(message);
}

bool KernelInfoAttributes::Has(const char* name) const {
  // The C API has no presence query: an attribute exists if a getter of some type finds it.
  int64_t i;
  float f;
  size_t size = 0;
  return Released(api_, api_.KernelInfoGetAttribute_int64(info_, name, &i)) ||
         Released(api_, api_.KernelInfoGetAttribute_float(info_, name, &f)) ||
         Released(api_, api_.KernelInfoGetAttribute_string(info_, name, nullptr, &size)) ||
         Released(api_, api_.KernelInfoGetAttributeArray_int64(info_, name, nullptr, &size)) ||
         Released(api_, api_.KernelInfoGetAttributeArray_float(info_, name, nullptr, &size));
}

bool KernelInfoAttributes::GetInt(const char* name, int64_t* out) const {
  return Released(api_, api_.KernelInfoGetAttribute_int64(info_, name, out));
}

bool KernelInfoAttributes::GetString(const char* name, std::string* out) const {
  size_t size = 0;
  if (!Released(api_, api_.KernelInfoGetAttribute_string(info_, name, nullptr, &size))) return false;
  std::string s(size, '\0');
  if (!Released(api_, api_.KernelInfoGetAttribute_string(info_, name, s.data(), &size))) return false;
  s.resize(size > 0 ? size - 1 : 0);  // size counts the terminating NUL
  *out = std::move(s);
  return true;
}

bool KernelInfoAttributes::GetInts(const char* name, std::vector<int64_t>* out) const {
  size_t size = 0;
  if (!Released(api_, api_.KernelInfoGetAttributeArray_int64(info_, name, nullptr, &size))) return false;
  out->resize(size);
  return size == 0 || Released(api_, api_.KernelInfoGetAttributeArray_int64(info_, name, out->data(), &size));
}

bool KernelInfoAttributes::GetFloats(const char* name, std::vector<float>* out) const {
  size_t size = 0;
  if (!Released(api_, api_.KernelInfoGetAttributeArray_float(info_, name, nullptr, &size))) return false;
  out->resize(size);
  return size == 0 || Released(api_, api_.KernelInfoGetAttributeArray_float(info_, name, out->data(), &size));
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
  if (rank < 0 || rank > kMaxRank || !IsSupportedElementType(elem_type)) {
    throw std::runtime_error("output " + std::to_string(index) + ": type " + std::to_string(elem_type) +
                             " of rank " + std::to_string(rank) + " is not a tensor type ortbridge supports");
  }
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ThrowOnError(api, api.CreateTensorTypeAndShapeInfo(&info));
  // ORT records a dimension without a name as the value -1, so each unknown dimension gets a
  // name of its own (names shared between dimensions would claim they are equal).
  static std::atomic<uint64_t> counter{0};
  std::vector<int64_t> dims(rank, -1);
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

void* AllocateOutput(const OrtApi& api, OrtKernelContext* ctx, size_t index, const std::vector<int64_t>& shape,
                     int64_t elem_type) {
  OrtValue* value = nullptr;
  ThrowOnError(api, api.KernelContext_GetOutput(ctx, index, shape.data(), shape.size(), &value));
  if (!value) throw std::runtime_error("output " + std::to_string(index) + " has no value in the graph");
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ThrowOnError(api, api.GetTensorTypeAndShape(value, &info));
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  size_t count = 0;
  OrtStatus* status = api.GetTensorElementType(info, &type);
  if (!status) status = api.GetTensorShapeElementCount(info, &count);
  api.ReleaseTensorTypeAndShapeInfo(info);
  ThrowOnError(api, status);
  size_t expected = 1;
  for (int64_t d : shape) expected *= static_cast<size_t>(d);
  if (type != elem_type || count != expected) {
    throw std::runtime_error("ONNX Runtime allocated output " + std::to_string(index) + " as " +
                             ElementTypeName(type) + " of " + std::to_string(count) + " elements, but the node writes " +
                             ElementTypeName(elem_type) + " of " + std::to_string(expected));
  }
  void* data = nullptr;
  ThrowOnError(api, api.GetTensorMutableData(value, &data));
  return data;
}

namespace {

using NameGetter = OrtStatus*(ORT_API_CALL*)(const OrtKernelInfo*, size_t, char*, size_t*);
using TypeGetter = OrtStatus*(ORT_API_CALL*)(const OrtKernelInfo*, size_t, OrtTypeInfo**);

std::vector<DeclaredValue> Declared(const OrtApi& api, const OrtKernelInfo* info, size_t count, NameGetter get_name,
                                    TypeGetter get_type) {
  std::vector<DeclaredValue> values(count);
  for (size_t i = 0; i < count; ++i) {
    size_t size = 0;
    ThrowOnError(api, get_name(info, i, nullptr, &size));
    std::string name(size, '\0');
    ThrowOnError(api, get_name(info, i, name.data(), &size));
    name.resize(size > 0 ? size - 1 : 0);
    values[i].name = std::move(name);
    OrtTypeInfo* type_info = nullptr;
    if (values[i].name.empty() || !Released(api, get_type(info, i, &type_info)) || !type_info) continue;
    const OrtTensorTypeAndShapeInfo* tensor = nullptr;  // owned by type_info; null for non-tensors
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    if (Released(api, api.CastTypeInfoToTensorInfo(type_info, &tensor)) && tensor &&
        Released(api, api.GetTensorElementType(tensor, &type))) {
      values[i].elem_type = type;
    }
    api.ReleaseTypeInfo(type_info);
  }
  return values;
}

}  // namespace

std::vector<DeclaredValue> DeclaredInputs(const OrtApi& api, const OrtKernelInfo* info) {
  size_t count = 0;
  ThrowOnError(api, api.KernelInfo_GetInputCount(info, &count));
  return Declared(api, info, count, api.KernelInfo_GetInputName, api.KernelInfo_GetInputTypeInfo);
}

std::vector<DeclaredValue> DeclaredOutputs(const OrtApi& api, const OrtKernelInfo* info) {
  size_t count = 0;
  ThrowOnError(api, api.KernelInfo_GetOutputCount(info, &count));
  return Declared(api, info, count, api.KernelInfo_GetOutputName, api.KernelInfo_GetOutputTypeInfo);
}

}  // namespace ortbridge
