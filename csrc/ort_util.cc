#include "ort_util.h"

// The C++ wrappers over the API table ORT hands RegisterCustomOps (ORT_API_MANUAL_INIT: no
// library to link), where they say in one line what the C API takes five for.
#include <onnxruntime_cxx_api.h>

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

bool CopyInputTypeShape(const OrtApi& api, OrtShapeInferContext* ctx, size_t input, size_t output,
                        int64_t elem_type, int64_t rank) {
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

std::string NodeName(const OrtApi&, const OrtKernelInfo* info) {
  return Ort::ConstKernelInfo(info).GetNodeName();
}

namespace {
ShapeReferenceFn g_shape_reference = nullptr;
}

void InitShapeReference(const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(kShapeReferenceApiVersion);
  if (api) g_shape_reference = reinterpret_cast<const ShapeReferenceFn*>(api)[kShapeReferenceIndex];
}

bool GetInputTensor(const OrtApi& api, OrtKernelContext* ctx, size_t index, TensorView* out) {
  Ort::ConstValue value = Ort::KernelContext(ctx).GetInput(index);
  if (!value) return false;
  if (g_shape_reference) {
    ONNXTensorElementDataType type;
    const int64_t* dims = nullptr;
    size_t rank = 0;
    ThrowOnError(api, g_shape_reference(value, &type, &dims, &rank));
    out->elem_type = type;
    out->shape = Shape(dims, dims + rank);
  } else {
    Ort::TensorTypeAndShapeInfo info = value.GetTensorTypeAndShapeInfo();
    out->elem_type = info.GetElementType();
    out->shape.resize(info.GetDimensionsCount());
    ThrowOnError(
        api, api.GetDimensions(info, out->shape.data(), out->shape.size()));  // (into the shape's own room)
  }
  // ORT hands inputs as const; the kernel only reads them.
  out->data = const_cast<void*>(value.GetTensorRawData());
  return true;
}

void* AllocateOutput(const OrtApi&, OrtKernelContext* ctx, size_t index, const Shape& shape,
                     int64_t elem_type, bool check) {
  Ort::UnownedValue value = Ort::KernelContext(ctx).GetOutput(index, shape.data(), shape.size());
  if (!value) throw std::runtime_error("output " + std::to_string(index) + " has no value in the graph");
  if (!check) return value.GetTensorMutableRawData();
  Ort::TensorTypeAndShapeInfo info = value.GetTensorTypeAndShapeInfo();
  size_t expected = 1;
  for (int64_t d : shape) expected *= static_cast<size_t>(d);
  if (info.GetElementType() != elem_type || info.GetElementCount() != expected) {
    throw std::runtime_error("ONNX Runtime allocated output " + std::to_string(index) + " as " +
                             ElementTypeName(info.GetElementType()) + " of " +
                             std::to_string(info.GetElementCount()) + " elements, but the node writes " +
                             ElementTypeName(elem_type) + " of " + std::to_string(expected));
  }
  return value.GetTensorMutableRawData();
}

namespace {

// The element type of a declared value, 0 where the graph gives it no tensor type.
int64_t TensorElementType(const Ort::TypeInfo& type) {
  return type.GetONNXType() == ONNX_TYPE_TENSOR ? type.GetTensorTypeAndShapeInfo().GetElementType() : 0;
}

template <class Name, class Type>
std::vector<DeclaredValue> Declared(size_t count, Name&& name_of, Type&& type_of) {
  std::vector<DeclaredValue> values(count);
  for (size_t i = 0; i < count; ++i) {
    values[i].name = name_of(i);
    if (values[i].name.empty()) continue;  // an empty slot has no type
    try {
      values[i].elem_type = TensorElementType(type_of(i));
    } catch (const Ort::Exception&) {
      // no type in the graph: elem_type stays 0
    }
  }
  return values;
}

}  // namespace

std::vector<DeclaredValue> DeclaredInputs(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo k(info);
  return Declared(
      k.GetInputCount(), [&](size_t i) { return k.GetInputName(i); },
      [&](size_t i) { return k.GetInputTypeInfo(i); });
}

std::vector<DeclaredValue> DeclaredOutputs(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo k(info);
  return Declared(
      k.GetOutputCount(), [&](size_t i) { return k.GetOutputName(i); },
      [&](size_t i) { return k.GetOutputTypeInfo(i); });
}

}  // namespace ortbridge
