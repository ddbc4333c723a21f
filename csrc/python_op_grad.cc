// PythonOpGrad: looks up the context that PythonOp stored under input 0 and runs
// Function.backward(ctx, *grads). Outputs are the gradients of the forward tensor inputs, in
// order; a context serves one backward and is released whether it succeeds or fails.
#include <memory>

#include "custom_op.h"
#include "kernel_io.h"

namespace ortbridge {
namespace {

class PythonOpGradKernel {
 public:
  static constexpr const char* kName = "PythonOpGrad";
  static constexpr int kMinInputs = 1;
  static constexpr int kMinOutputs = 0;

  static OrtStatus* Create(const OrtApi& api, const OrtKernelInfo* info, void** out) {
    std::string prefix = "ortbridge PythonOpGrad: ";
    return Guarded(api, prefix, [&] {
      std::string node = NodeName(api, info);
      prefix = "ortbridge PythonOpGrad node '" + node + "': ";
      size_t inputs = 0, outputs = 0;
      ThrowOnError(api, api.KernelInfo_GetInputCount(info, &inputs));
      ThrowOnError(api, api.KernelInfo_GetOutputCount(info, &outputs));
      auto kernel = std::make_unique<PythonOpGradKernel>(api, node,
                                                         ParseBackward(KernelInfoAttributes(api, info), inputs, outputs));
      prefix += "function '" + kernel->layout_.func_name + "': ";
      kernel->BindPython();
      *out = kernel.release();
    });
  }

  PythonOpGradKernel(const OrtApi& api, std::string node, BackwardLayout layout)
      : api_(api), layout_(std::move(layout)),
        error_prefix_("ortbridge PythonOpGrad node '" + node + "' (function '" + layout_.func_name + "'): ") {}

  ~PythonOpGradKernel() { ReleasePython(run_); }

  OrtStatus* Compute(OrtKernelContext* context) {
    return Guarded(api_, error_prefix_, [&] {
      RequirePython();
      int64_t id = ContextId(context);
      std::vector<TensorView> grads(layout_.input_tensor_types.size());  // absent gradients stay empty
      for (size_t k = 0; k < layout_.grad_input_slots.size(); ++k) {
        size_t slot = layout_.grad_input_slots[k];
        grads[slot] = ReadInput(api_, context, k + 1, layout_.input_tensor_types[slot]);
      }
      py::gil_scoped_acquire gil;
      std::optional<py::object> saved = Contexts().Take(id);
      if (!saved) {
        throw std::runtime_error("context id " + std::to_string(id) +
                                 " is not live: its backward already ran, it was released, or its PythonOp ran "
                                 "with training_mode=0");
      }
      try {
        py::tuple result = run_(*saved, BorrowInputs(grads));  // one capsule or None per output
        *saved = py::object();  // release the context (and what it saved) before copying
        const size_t n = layout_.output_tensor_types.size();
        if (result.size() != n) throw std::logic_error("the runner returned a result of the wrong length");
        for (size_t i = 0; i < n; ++i) {
          if (result[i].is_none()) continue;  // no gradient wanted for this input
          WriteOutput(api_, context, i, result[i].ptr(), layout_.output_tensor_types[i],
                      layout_.output_tensor_ranks[i], "gradient output " + std::to_string(i));
        }
      } catch (py::error_already_set& e) {
        throw std::runtime_error(FormatPythonError(e));
      }
    });
  }

  static OrtStatus* InferShape(OrtShapeInferContext* context) {
    const OrtApi& api = Api();
    return Guarded(api, "ortbridge PythonOpGrad shape inference: ", [&] {
      auto types = ShapeInferInts(api, context, "output_tensor_types");
      auto ranks = ShapeInferInts(api, context, "output_tensor_ranks");
      if (ranks.size() != types.size()) throw std::runtime_error("output_tensor_ranks and output_tensor_types differ in length");
      for (size_t i = 0; i < types.size(); ++i) SetOutputTypeAndRank(api, context, i, types[i], ranks[i]);
    });
  }

 private:
  int64_t ContextId(OrtKernelContext* context) const {
    TensorView t;
    if (!GetInputTensor(api_, context, 0, &t)) throw std::runtime_error("input 0 (the context id) is missing");
    int64_t count = 1;
    for (int64_t d : t.shape) count *= d;
    if (t.elem_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 || count != 1) {
      throw std::runtime_error("input 0 must be the int64 context id that PythonOp produced");
    }
    return *static_cast<const int64_t*>(t.data);
  }

  void BindPython() {
    RequirePython();
    py::gil_scoped_acquire gil;
    try {
      py::list positions, requires_grad;
      for (size_t i = 0; i < layout_.output_positions.size(); ++i) {
        positions.append(layout_.output_positions[i]);
        requires_grad.append(py::bool_(layout_.output_requires_grad[i]));
      }
      py::object node = Runner().attr("BackwardNode")(layout_.func_name, layout_.output_convention.size(),
                                                      positions, requires_grad);
      run_ = node.attr("run");
    } catch (py::error_already_set& e) {
      throw std::runtime_error(FormatPythonError(e));
    }
  }

  const OrtApi& api_;
  BackwardLayout layout_;
  std::string error_prefix_;
  py::object run_;  // ortbridge._runner.BackwardNode(...).run
};

}  // namespace

const OrtCustomOp* PythonOpGrad() {
  static CustomOp<PythonOpGradKernel> op;
  return &op;
}

}  // namespace ortbridge
