// PythonOp: runs Function.apply on the node's tensor inputs and constants. Output 0 is the
// context id (0 when training_mode=0); outputs 1.. are the Function's outputs.
#include <algorithm>
#include <memory>

#include "custom_op.h"
#include "python_kernel.h"

namespace ortbridge {
namespace {

class PythonOpKernel : public PythonKernel<ForwardLayout> {
 public:
  static constexpr const char* kName = "PythonOp";
  static constexpr int kMinInputs = 0;
  static constexpr bool kInplace = true;
  static constexpr int kMinOutputs = 1;

  static constexpr auto Parse = ParseForward;

  PythonOpKernel(const OrtApi& api, const std::string& node, ForwardLayout layout)
      : PythonKernel(api, kName, node, std::move(layout)) {}

  static OrtStatus* Create(const OrtApi& api, const OrtKernelInfo* info, Backend backend, void** out) {
    return PythonKernel::Create<PythonOpKernel>(api, info, backend, out);
  }

  static OrtMemType InputMemoryType(Backend, size_t) { return OrtMemTypeDefault; }

  OrtStatus* Compute(OrtKernelContext* context) {
    return Guarded(api_, error_prefix_, [&] {
      RequirePython();
      std::vector<TensorView> inputs;
      inputs.reserve(layout_.input_tensor_types.size());
      for (size_t i = 0; i < layout_.input_tensor_types.size(); ++i) {
        inputs.push_back(ReadInput(api_, context, i, layout_.input_tensor_types[i], layout_.input_tensor_ranks[i]));
      }
      KernelGil gil;
      try {
        StreamScope stream(api_, context, placement_, runner_);
        KernelOutputs writer(api_, context, placement_, runner_);
        for (auto [output, input] : layout_.in_place) {  // an output of another rank is a view: not in place
          if (inputs[input].shape.size() == static_cast<size_t>(layout_.output_tensor_ranks[output - 1])) {
            writer.Redirect(output, &inputs[input]);
          }
        }
        // (autograd context or None, output capsules..., [indices of inputs modified in place])
        py::tuple result = run_(BorrowInputs(inputs, placement_.device));
        const size_t n = layout_.output_tensor_types.size();
        if (result.size() != n + 1 && result.size() != n + 2) {
          throw std::logic_error("the runner returned a result of the wrong length");
        }
        // Output 1 may share input 0's buffer (MayInplace): write it last, after any other output
        // that still reads from that input.
        std::vector<TensorView> outputs(n);
        for (size_t i = n; i-- > 0;) {
          outputs[i] = writer.Write(i + 1, result[i + 1].ptr(), layout_.output_tensor_types[i],
                                    layout_.output_tensor_ranks[i], "output");
        }
        if (result.size() == n + 2) CheckInPlaceWrites(inputs, outputs, result[n + 1]);
        int64_t id = PythonContextPool::kNoContext;
        if (layout_.training_mode) {
          id = AddContext({py::reinterpret_borrow<py::object>(result[0]), function_, {inputs.begin(), inputs.end()},
                           {outputs.begin(), outputs.end()}});
        }
        if (context_id_output_) writer.Scalar(0, id);  // on the CUDA EP, in device memory
      } catch (py::error_already_set& e) {
        throw std::runtime_error(FormatPythonError(e));
      }
    });
  }

  static OrtStatus* InferShape(OrtShapeInferContext* context) {
    const OrtApi& api = Api();
    return Guarded(api, "ortbridge PythonOp shape inference: ", [&] {
      SetOutputTypeAndRank(api, context, 0, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, 0);  // the context id
      // tensor_reuse_map[j] = i: output j is input i updated in place; knowing that their sizes
      // match lets ORT give output 1 the buffer of input 0.
      InferOutputsFromAttributes(api, context, 1, ShapeInferInts(api, context, "tensor_reuse_map", false));
    });
  }

 private:
  friend class PythonKernel<ForwardLayout>;

  // Output 0 may be left unnamed only where no context is made (nothing could release one).
  void CheckValues(const std::vector<DeclaredValue>& inputs, const std::vector<DeclaredValue>& outputs) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      CheckDeclared("input", i, inputs[i], layout_.input_tensor_types[i], "attribute 'input_tensor_types'",
                    "attribute 'input_convention'");
    }
    context_id_output_ = !outputs[0].name.empty();
    if (context_id_output_ || layout_.training_mode) {
      CheckDeclared("output", 0, outputs[0], ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, kContextIdFormat,
                    "attribute 'training_mode'");
    }
    for (size_t j = 1; j < outputs.size(); ++j) {
      CheckDeclared("output", j, outputs[j], layout_.output_tensor_types[j - 1], "attribute 'output_tensor_types'",
                    "attribute 'output_tensor_types'");
    }
  }

  // A Function may write only into an input that the node declares updated in place (which then
  // views its output's buffer); any other input's buffer other nodes could read.
  static void CheckInPlaceWrites(const std::vector<TensorView>& inputs, const std::vector<TensorView>& outputs,
                                 py::handle modified) {
    for (py::handle index : modified) {
      const size_t i = index.cast<size_t>();
      const void* buffer = inputs.at(i).data;
      if (std::none_of(outputs.begin(), outputs.end(), [&](const TensorView& o) { return o.data == buffer; })) {
        throw std::runtime_error(
            "the Function modified input " + std::to_string(i) +
            " in place, but the node does not declare it updated in place (tensor_reuse_map), so other nodes may "
            "see the change. Modify a copy instead (x = x.clone()), or export the model with ortbridge.export, "
            "which declares the in-place updates it sees.");
      }
    }
  }

  bool context_id_output_ = true;  // whether output 0 has a value name

  py::object MakeRunner(const std::string& device) const {  // GIL held
    return Runner().attr("ForwardNode")(layout_, device);
  }
};

}  // namespace

const OrtCustomOp* PythonOp(Backend backend) { return OpFor<PythonOpKernel>(backend); }

}  // namespace ortbridge
