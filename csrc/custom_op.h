// One OrtCustomOp per kernel class: variadic, heterogeneous inputs and outputs on the CPU
// execution provider, with status-returning callbacks. Kernel supplies kName, kMinInputs,
// kMinOutputs, Create, Compute and InferShape.
#pragma once

#include <onnxruntime_c_api.h>

#include <cstring>

#include "ort_util.h"

namespace ortbridge {

constexpr const char* kDomain = "ortbridge";

template <class Kernel>
struct CustomOp : OrtCustomOp {
  CustomOp() {
    std::memset(static_cast<OrtCustomOp*>(this), 0, sizeof(OrtCustomOp));
    version = kOrtApiVersion;  // enables V2 callbacks (16) and shape inference (17) and nothing newer
    GetName = [](const OrtCustomOp*) { return Kernel::kName; };
    GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // CPU
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return Kernel::kMinInputs; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 0; };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return Kernel::kMinOutputs; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 0; };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
      return Kernel::Create(*api, info, kernel);
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
      return static_cast<Kernel*>(kernel)->Compute(context);
    };
    KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
    InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) {
      return Kernel::InferShape(context);
    };
  }
};

// The API table ORT handed to RegisterCustomOps (shape inference gets no other way to it).
const OrtApi& Api();

}  // namespace ortbridge
