// The one table of tensor element types that cross between ONNX Runtime and torch: ORT's
// enum, the name (torch's dtype name, also used in error texts) and the DLPack encoding.
// Strings and float8/int4 types have no torch counterpart that DLPack carries, and ORT refuses
// complex types for custom ops: absent.
#pragma once

#include <onnxruntime_c_api.h>

#include <cstddef>
#include <cstdint>

namespace ortbridge {

struct ElementType {
  ONNXTensorElementDataType onnx;
  const char* name;
  uint8_t dlpack_code;  // DLDataTypeCode: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
  uint8_t bits;
};

inline constexpr ElementType kElementTypes[] = {
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, "float32", 2, 32},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, "uint8", 1, 8},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8, "int8", 0, 8},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16, "uint16", 1, 16},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16, "int16", 0, 16},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, "int32", 0, 32},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, "int64", 0, 64},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, "bool", 6, 8},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, "float16", 2, 16},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE, "float64", 2, 64},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32, "uint32", 1, 32},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64, "uint64", 1, 64},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16, "bfloat16", 4, 16},
};

// The entry for an ONNX element type, or null when it does not cross to torch.
inline const ElementType* FindElementType(int64_t onnx_type) {
  for (const ElementType& t : kElementTypes) {
    if (t.onnx == onnx_type) return &t;
  }
  return nullptr;
}

inline bool IsSupportedElementType(int64_t onnx_type) { return FindElementType(onnx_type) != nullptr; }

inline const char* ElementTypeName(int64_t onnx_type) {
  const ElementType* t = FindElementType(onnx_type);
  return t ? t->name : "unsupported";
}

// Bytes per element; 0 for an unsupported type.
inline size_t ElementSize(int64_t onnx_type) {
  const ElementType* t = FindElementType(onnx_type);
  return t ? t->bits / 8 : 0;
}

}  // namespace ortbridge
