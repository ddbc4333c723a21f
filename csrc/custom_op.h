// One OrtCustomOp per kernel class and backend (the execution provider it registers for):
// variadic, heterogeneous inputs and outputs, with status-returning callbacks. Kernel supplies
// kName, kMinInputs, kMinOutputs, kInplace (may output 1 take input 0's buffer), Create,
// InputMemoryType, Compute and InferShape.
#pragma once

#include <onnxruntime_c_api.h>

#include <cstring>

#include "device.h"
#include "ort_util.h"

namespace ortbridge {

constexpr const char* kDomain = "ortbridge";

template <class Kernel>
struct CustomOp : OrtCustomOp {
  explicit CustomOp(Backend b) {
    std::memset(static_cast<OrtCustomOp*>(this), 0, sizeof(OrtCustomOp));
    backend = b;
    version = kCustomOpVersion;
    GetName = [](const OrtCustomOp*) { return Kernel::kName; };
    GetExecutionProviderType = [](const OrtCustomOp* op) { return ExecutionProviderType(Of(op)); };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; };
    GetInputMemoryType = [](const OrtCustomOp* op, size_t index) {
      return Kernel::InputMemoryType(Of(op), index);
    };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return Kernel::kMinInputs; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 0; };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return Kernel::kMinOutputs; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 0; };
    CreateKernelV2 = [](const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
      return Kernel::Create(*api, info, Of(op), kernel);
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
      return static_cast<Kernel*>(kernel)->Compute(context);
    };
    KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
    InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) {
      return Kernel::InferShape(context);
    };
    if (Kernel::kInplace) {  // ORT may hand input 0's buffer to output 1 (it decides per graph)
      GetMayInplace = [](int** input_index, int** output_index) -> size_t {
        *input_index = new int[1]{0};
        *output_index = new int[1]{1};
        return 1;
      };
      ReleaseMayInplace = [](int* input_index, int* output_index) {
        delete[] input_index;
        delete[] output_index;
      };
    }
  }

  Backend backend;

 private:
  static Backend Of(const OrtCustomOp* op) { return static_cast<const CustomOp*>(op)->backend; }
};

// One kernel class's op for each backend.
template <class Kernel>
const OrtCustomOp* OpFor(Backend backend) {
  static const CustomOp<Kernel> ops[] = {CustomOp<Kernel>(Backend::kCpu), CustomOp<Kernel>(Backend::kCuda),
                                         CustomOp<Kernel>(Backend::kCpuViaTorch)};
  return &ops[static_cast<int>(backend)];
}

// The two ops, for each backend (python_op.cc, python_op_grad.cc).
const OrtCustomOp* PythonOp(Backend backend);
const OrtCustomOp* PythonOpGrad(Backend backend);

// The API table ORT handed to RegisterCustomOps (shape inference gets no other way to it).
const OrtApi& Api();

}  // namespace ortbridge
