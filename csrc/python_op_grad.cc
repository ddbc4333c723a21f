// PythonOpGrad: looks up the context that PythonOp stored under input 0 and runs
// Function.backward(ctx, *grads). Outputs are the gradients of the forward tensor inputs, in
// order; a context serves one backward and is released whether it succeeds or fails.
#include <algorithm>
#include <memory>

#include "custom_op.h"
#include "python_kernel.h"

namespace ortbridge {
namespace {

class PythonOpGradKernel : public PythonKernel<BackwardLayout> {
 public:
  static constexpr const char* kName = "PythonOpGrad";
  static constexpr int kMinInputs = 1;
  static constexpr bool kInplace = false;
  static constexpr int kMinOutputs = 0;

  static constexpr auto Parse = ParseBackward;

  PythonOpGradKernel(const OrtApi& api, const std::string& node, BackwardLayout layout)
      : PythonKernel(api, kName, node, std::move(layout)) {}
  ~PythonOpGradKernel() { ReleasePython(direct_); }

  static OrtStatus* Create(const OrtApi& api, const OrtKernelInfo* info, Backend backend, void** out) {
    return PythonKernel::Create<PythonOpGradKernel>(api, info, backend, out);
  }

  // The context id is read on the host: off the CPU, ORT copies its 8 bytes there (a custom op
  // cannot keep an output in host memory, so PythonOp's id is on the device).
  static OrtMemType InputMemoryType(Backend backend, size_t index) {
    return backend != Backend::kCpu && index == 0 ? OrtMemTypeCPUInput : OrtMemTypeDefault;
  }

  OrtStatus* Compute(OrtKernelContext* context) {
    return Guarded(api_, error_prefix_, [&] {
      RequirePython();
      int64_t id = ContextId(context);
      KernelGil gil;
      // Taken first: from here on the context is released however this call ends.
      std::optional<SavedContext> saved =
          Contexts().TakeIf(id, [&](const SavedContext& s) { return s.function == function_; });
      if (!saved) {
        throw std::runtime_error(
            "context id " + std::to_string(id) +
            " is not a live context of this Function: its backward already ran, it was "
            "released, its PythonOp ran with training_mode=0, or another Function made it");
      }
      TensorViews grads;  // absent gradients stay empty
      grads.resize(layout_.input_tensor_types.size());
      for (size_t k = 0; k < layout_.grad_input_slots.size(); ++k) {
        size_t slot = layout_.grad_input_slots[k];
        grads[slot] = ReadInput(api_, context, k + 1, layout_.input_tensor_types[slot],
                                layout_.input_tensor_ranks[slot]);
      }
      CheckMatchesForward(*saved);
      try {
        StreamScope stream(api_, context, placement_, runner_);
        KernelOutputs writer(api_, context, placement_, runner_, *checked_outputs_);
        OutputLending lending;  // lends nothing, and hides the buffers of a call this one runs inside
        // One capsule or None per gradient output; None where no gradient is wanted or the
        // Function gave none (written as zeros).
        const bool all_present = layout_.grad_input_slots.size() == layout_.input_tensor_types.size();
        py::tuple result =
            direct_ && all_present && !saved->ctx.is_none()
                ? CallDirect(saved->ctx, grads)
                : run_(saved->ctx, BorrowInputs(grads, placement_.device), AbsentGradientShapes(*saved));
        saved->ctx = py::object();  // release the context (and what it saved) before copying
        saved->node_owner = py::object();
        const size_t n = layout_.output_tensor_types.size();
        if (result.size() != n) throw std::logic_error("the runner returned a result of the wrong length");
        for (size_t i = 0; i < n; ++i) {
          if (!layout_.output_requires_grad[i]) continue;
          if (result[i].is_none()) {
            writer.Zeros(i, saved->inputs[i]);
          } else {
            writer.Write(i, result[i].ptr(), layout_.output_tensor_types[i], layout_.output_tensor_ranks[i],
                         "gradient output", &saved->inputs[i].shape);
          }
        }
      } catch (py::error_already_set& e) {
        throw std::runtime_error(FormatPythonError(e));
      }
    });
  }

  static OrtStatus* InferShape(OrtShapeInferContext* context) {
    const OrtApi& api = Api();
    return Guarded(api, "ortbridge PythonOpGrad shape inference: ", [&] {
      InferOutputsFromAttributes(api, context, 0);
    });
  }

 private:
  friend class PythonKernel<BackwardLayout>;

  // Gradient outputs nobody wants may be left unnamed (ORT's format does so).
  void CheckValues(const std::vector<DeclaredValue>& inputs,
                   const std::vector<DeclaredValue>& outputs) const {
    CheckDeclared("input", 0, inputs[0], ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, kContextIdFormat,
                  kContextIdFormat);
    for (size_t k = 1; k < inputs.size(); ++k) {
      CheckDeclared("input", k, inputs[k], layout_.input_tensor_types[layout_.grad_input_slots[k - 1]],
                    "attribute 'input_tensor_types'", "attribute 'input_tensor_present'");
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (layout_.output_requires_grad[i]) {
        CheckDeclared("output", i, outputs[i], layout_.output_tensor_types[i],
                      "attribute 'output_tensor_types'", "attribute 'output_tensor_requires_grads'");
      }
    }
  }

  // The node must describe the forward call the context came from: gradients are written in
  // its input types (zeros included), with its input shapes.
  void CheckMatchesForward(const SavedContext& saved) const {
    if (saved.outputs.size() != layout_.input_tensor_types.size() ||
        saved.inputs.size() != layout_.output_tensor_types.size()) {
      throw std::runtime_error(
          "the node takes gradients for " + std::to_string(layout_.input_tensor_types.size()) +
          " outputs and gives " + std::to_string(layout_.output_tensor_types.size()) +
          ", but the forward of this context had " + std::to_string(saved.outputs.size()) + " outputs and " +
          std::to_string(saved.inputs.size()) + " tensor inputs");
    }
    for (size_t i = 0; i < saved.inputs.size(); ++i) {
      if (saved.inputs[i].elem_type != layout_.output_tensor_types[i]) {
        throw std::runtime_error("output_tensor_types entry " + std::to_string(i) + " is " +
                                 ElementTypeName(layout_.output_tensor_types[i]) + ", but forward input " +
                                 std::to_string(i) + " was " + ElementTypeName(saved.inputs[i].elem_type));
      }
    }
  }

  // (shape, ONNX type) of each forward output whose gradient is absent, for Functions that
  // materialize it as zeros; None when every gradient is present.
  py::object AbsentGradientShapes(const SavedContext& saved) const {
    if (layout_.grad_input_slots.size() == layout_.input_tensor_types.size()) return py::none();
    py::dict shapes;
    for (size_t slot = 0; slot < saved.outputs.size(); ++slot) {
      if (std::find(layout_.grad_input_slots.begin(), layout_.grad_input_slots.end(), slot) ==
          layout_.grad_input_slots.end()) {
        const TensorMeta& meta = saved.outputs[slot];
        py::tuple shape(meta.shape.size());
        for (size_t d = 0; d < meta.shape.size(); ++d) shape[d] = py::int_(meta.shape[d]);
        shapes[py::int_(slot)] = py::make_tuple(shape, meta.elem_type);
      }
    }
    return std::move(shapes);
  }

  int64_t ContextId(OrtKernelContext* context) const {
    TensorView t;
    if (!GetInputTensor(api_, context, 0, &t))
      throw std::runtime_error("input 0 (the context id) is missing");
    int64_t count = 1;
    for (int64_t d : t.shape) count *= d;
    if (t.elem_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 || count != 1) {
      throw std::runtime_error("input 0 must be the int64 context id that PythonOp produced");
    }
    return *static_cast<const int64_t*>(t.data);
  }

  // The runner's `run` for a context and every gradient present, made here where
  // BackwardNode.direct allows it; anything but plain CPU tensors or None in the gradients'
  // positions goes on to the runner's `result`, which checks and errors as `run` does. GIL held.
  py::tuple CallDirect(const py::object& ctx, const TensorViews& grads) {
    const RunnerApi& torch = Runner();
    const py::tuple capsules = BorrowInputs(grads, placement_.device);
    py::tuple args(capsules.size() + 1);
    PyTuple_SET_ITEM(args.ptr(), 0, ctx.inc_ref().ptr());
    for (size_t i = 0; i < capsules.size(); ++i) {
      PyTuple_SET_ITEM(args.ptr(), i + 1, Call(torch.from_dlpack, {capsules[i]}).release().ptr());
    }
    const py::object returned = CallWithGradMode(direct_, args, false);
    const ReturnedList values = ReturnedItems(returned.ptr());
    const size_t n = layout_.output_tensor_types.size();
    if (values.size() != layout_.output_convention.size()) return runner_.attr(Runner().result)(returned);
    py::tuple gradients(n);
    for (size_t i = 0; i < n; ++i) {
      PyObject* g = layout_.output_requires_grad[i] ? values[layout_.output_positions[i]] : Py_None;
      py::object exported = g == Py_None ? py::none() : ExportCpuTensor(g);
      // (a gradient of another dtype than the input's: the runner casts it, as autograd does)
      if (!exported || (g != Py_None && CapsuleElementType(exported.ptr()) != layout_.output_tensor_types[i]))
        return runner_.attr(Runner().result)(returned);
      PyTuple_SET_ITEM(gradients.ptr(), i, exported.release().ptr());
    }
    return gradients;
  }

  py::object direct_;  // BackwardNode.direct: Function.backward, or None where `run` is needed

  py::object MakeRunner(const std::string& device) {  // GIL held
    py::object runner = Runner().backward_node(layout_, device);
    py::object direct = runner.attr(Runner().direct);
    if (!direct.is_none() && !placement_.via_torch())
      direct_ = direct;  // (the device path: `run`, as on CUDA)
    return runner;
  }
};

}  // namespace

const OrtCustomOp* PythonOpGrad(Backend backend) { return OpFor<PythonOpGradKernel>(backend); }

}  // namespace ortbridge
