// PythonOp: runs Function.apply on the node's tensor inputs and constants. Output 0 is the
// context id (0 when training_mode=0); outputs 1.. are the Function's outputs.
#include <memory>

#include "custom_op.h"
#include "kernel_io.h"

namespace ortbridge {
namespace {

// The Python objects for the constant arguments, built once per kernel.
py::object ConstantValue(const Constant& c) {
  switch (c.kind) {
    case Constant::Kind::kBool: return py::bool_(c.ints[0] != 0);
    case Constant::Kind::kInt: return py::int_(c.ints[0]);
    case Constant::Kind::kFloat: return py::float_(c.floats[0]);
    case Constant::Kind::kBoolTuple: {
      py::tuple t(c.ints.size());
      for (size_t i = 0; i < c.ints.size(); ++i) t[i] = py::bool_(c.ints[i] != 0);
      return std::move(t);
    }
    case Constant::Kind::kIntTuple: {
      py::tuple t(c.ints.size());
      for (size_t i = 0; i < c.ints.size(); ++i) t[i] = py::int_(c.ints[i]);
      return std::move(t);
    }
    case Constant::Kind::kFloatTuple: {
      py::tuple t(c.floats.size());
      for (size_t i = 0; i < c.floats.size(); ++i) t[i] = py::float_(c.floats[i]);
      return std::move(t);
    }
    case Constant::Kind::kObject: return Runner().attr("pinned_object")(c.ints[0]);
  }
  throw std::logic_error("unknown constant kind");
}

class PythonOpKernel {
 public:
  static constexpr const char* kName = "PythonOp";
  static constexpr int kMinInputs = 0;
  static constexpr int kMinOutputs = 1;

  static OrtStatus* Create(const OrtApi& api, const OrtKernelInfo* info, void** out) {
    std::string prefix = "ortbridge PythonOp: ";
    return Guarded(api, prefix, [&] {
      std::string node = NodeName(api, info);
      prefix = "ortbridge PythonOp node '" + node + "': ";
      size_t inputs = 0, outputs = 0;
      ThrowOnError(api, api.KernelInfo_GetInputCount(info, &inputs));
      ThrowOnError(api, api.KernelInfo_GetOutputCount(info, &outputs));
      auto kernel = std::make_unique<PythonOpKernel>(api, node, ParseForward(KernelInfoAttributes(api, info), inputs, outputs));
      prefix += "function '" + kernel->layout_.func_name + "': ";
      kernel->BindPython();
      *out = kernel.release();
    });
  }

  PythonOpKernel(const OrtApi& api, std::string node, ForwardLayout layout)
      : api_(api), layout_(std::move(layout)),
        error_prefix_("ortbridge PythonOp node '" + node + "' (function '" + layout_.func_name + "'): ") {}

  ~PythonOpKernel() { ReleasePython(run_); }

  OrtStatus* Compute(OrtKernelContext* context) {
    return Guarded(api_, error_prefix_, [&] {
      RequirePython();
      std::vector<TensorView> inputs;
      for (size_t i = 0; i < layout_.input_tensor_types.size(); ++i) {
        inputs.push_back(ReadInput(api_, context, i, layout_.input_tensor_types[i]));
      }
      py::gil_scoped_acquire gil;
      try {
        py::tuple result = run_(BorrowInputs(inputs));  // (context entry or None, output capsules...)
        const size_t n = layout_.output_tensor_types.size();
        if (result.size() != n + 1) throw std::logic_error("the runner returned a result of the wrong length");
        for (size_t i = 0; i < n; ++i) {
          WriteOutput(api_, context, i + 1, result[i + 1].ptr(), layout_.output_tensor_types[i],
                      layout_.output_tensor_ranks[i], "output " + std::to_string(i + 1));
        }
        int64_t id = PythonContextPool::kNoContext;
        if (layout_.training_mode) id = Contexts().Add(py::reinterpret_borrow<py::object>(result[0]));
        *static_cast<int64_t*>(AllocateOutput(api_, context, 0, {})) = id;
      } catch (py::error_already_set& e) {
        throw std::runtime_error(FormatPythonError(e));
      }
    });
  }

  static OrtStatus* InferShape(OrtShapeInferContext* context) {
    const OrtApi& api = Api();
    return Guarded(api, "ortbridge PythonOp shape inference: ", [&] {
      auto types = ShapeInferInts(api, context, "output_tensor_types");
      auto ranks = ShapeInferInts(api, context, "output_tensor_ranks");
      if (ranks.size() != types.size()) throw std::runtime_error("output_tensor_ranks and output_tensor_types differ in length");
      SetOutputTypeAndRank(api, context, 0, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, 0);
      for (size_t i = 0; i < types.size(); ++i) SetOutputTypeAndRank(api, context, i + 1, types[i], ranks[i]);
    });
  }

 private:
  void BindPython() {
    RequirePython();
    py::gil_scoped_acquire gil;
    try {
      py::list args;  // tensor slots stay None until a call fills them
      for (size_t i = 0; i < layout_.input_convention.size(); ++i) args.append(py::none());
      for (const Constant& c : layout_.constants) args[c.position] = ConstantValue(c);
      py::list positions, requires_grad;
      for (size_t i = 0; i < layout_.tensor_positions.size(); ++i) {
        positions.append(layout_.tensor_positions[i]);
        requires_grad.append(py::bool_(layout_.requires_grad[i]));
      }
      py::object node = Runner().attr("ForwardNode")(layout_.func_name, args, positions, requires_grad,
                                                     layout_.training_mode, layout_.output_tensor_types.size());
      run_ = node.attr("run");
    } catch (py::error_already_set& e) {
      throw std::runtime_error(FormatPythonError(e));
    }
  }

  const OrtApi& api_;
  ForwardLayout layout_;
  std::string error_prefix_;
  py::object run_;  // ortbridge._runner.ForwardNode(...).run
};

}  // namespace

const OrtCustomOp* PythonOp() {
  static CustomOp<PythonOpKernel> op;
  return &op;
}

}  // namespace ortbridge
