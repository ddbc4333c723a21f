// PythonOp: runs Function.apply on the node's tensor inputs and constants. Output 0 is the
// context id (0 when training_mode=0); outputs 1.. are the Function's outputs.
#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "custom_op.h"
#include "python_kernel.h"
#include "saved_tensors.h"

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
  ~PythonOpKernel() {
    ReleasePython(direct_.call);
    ReleasePython(direct_.args);
  }

  static OrtStatus* Create(const OrtApi& api, const OrtKernelInfo* info, Backend backend, void** out) {
    return PythonKernel::Create<PythonOpKernel>(api, info, backend, out);
  }

  static OrtMemType InputMemoryType(Backend, size_t) { return OrtMemTypeDefault; }

  OrtStatus* Compute(OrtKernelContext* context) {
    return Guarded(api_, error_prefix_, [&] {
      RequirePython();
      TensorViews inputs;
      inputs.reserve(layout_.input_tensor_types.size());
      for (size_t i = 0; i < layout_.input_tensor_types.size(); ++i) {
        inputs.push_back(
            ReadInput(api_, context, i, layout_.input_tensor_types[i], layout_.input_tensor_ranks[i]));
      }
      KernelGil gil(layout_.training_mode &&
                    direct_.call);  // (a direct training call keeps them: CallDirect)
      try {
        StreamScope stream(api_, context, placement_, runner_);
        KernelOutputs writer(api_, context, placement_, runner_, *checked_outputs_);
        for (auto [output, input] : layout_.in_place) {  // an output of another rank is a view: not in place
          if (inputs[input].shape.size() == static_cast<size_t>(layout_.output_tensor_ranks[output - 1])) {
            writer.Redirect(output, &inputs[input]);
          }
        }
        const bool lends =
            !layout_.training_mode && !placement_.via_torch();  // (an inference call on the CPU)
        OutputLending lending =
            lends ? OutputLending(&writer, &layout_.output_tensor_types, &layout_.output_tensor_ranks, 1)
                  : OutputLending();
        // (autograd context or None, output capsules..., [indices of inputs modified in place])
        py::tuple result = direct_.call ? CallDirect(inputs) : run_(BorrowInputs(inputs, placement_.device));
        const size_t n = layout_.output_tensor_types.size();
        if (result.size() != n + 1 && result.size() != n + 2) {
          throw std::logic_error("the runner returned a result of the wrong length");
        }
        // Output 1 may share input 0's buffer (MayInplace): write it last, after any other output
        // that still reads from that input.
        TensorViews outputs;
        outputs.resize(n);
        for (size_t i = n; i-- > 0;) {
          outputs[i] = writer.Write(i + 1, result[i + 1].ptr(), layout_.output_tensor_types[i],
                                    layout_.output_tensor_ranks[i], "output");
        }
        CheckCapturedSizes(inputs, outputs);
        if (result.size() == n + 2) CheckInPlaceWrites(inputs, outputs, result[n + 1]);
        int64_t id = PythonContextPool::kNoContext;
        if (layout_.training_mode) {
          SavedContext saved{py::reinterpret_borrow<py::object>(result[0]),
                             {},
                             function_,
                             {inputs.begin(), inputs.end()},
                             {outputs.begin(), outputs.end()}};
          if (PyTuple_Check(saved.ctx.ptr())) {  // (ctx, what owns its node): see Context
            py::object pair = std::move(saved.ctx);
            saved.ctx = pair[py::int_(0)];
            saved.node_owner = pair[py::int_(1)];
          }
          id = AddContext(std::move(saved));
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
    for (size_t i = 0; i < layout_.input_tensor_types.size(); ++i) {  // (not the ordering inputs: any type)
      CheckDeclared("input", i, inputs[i], layout_.input_tensor_types[i], "attribute 'input_tensor_types'",
                    "attribute 'input_convention'");
    }
    context_id_output_ = !outputs[0].name.empty();
    if (context_id_output_ || layout_.training_mode) {
      CheckDeclared("output", 0, outputs[0], ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, kContextIdFormat,
                    "attribute 'training_mode'");
    }
    for (size_t j = 1; j < outputs.size(); ++j) {
      CheckDeclared("output", j, outputs[j], layout_.output_tensor_types[j - 1],
                    "attribute 'output_tensor_types'", "attribute 'output_tensor_types'");
    }
  }

  // A graph with symbolic sizes took each output dim for a size or for one of the inputs' dims
  // (output_tensor_dims); a Function whose outputs have other sizes would leave the graph's
  // arithmetic on them wrong without an error.
  void CheckCapturedSizes(const TensorViews& inputs, const TensorViews& outputs) const {
    const std::vector<int64_t>& dims = layout_.output_tensor_dims;
    if (dims.empty()) return;
    std::vector<std::pair<size_t, size_t>> owner;  // per dim of the tensor inputs: (input, its dim)
    for (size_t i = 0; i < inputs.size(); ++i) {
      for (size_t j = 0; j < inputs[i].shape.size(); ++j) owner.emplace_back(i, j);
    }
    size_t k = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      for (size_t j = 0; j < outputs[i].shape.size(); ++j, ++k) {
        const int64_t d = dims.at(k);
        if (d == -1) continue;
        const auto [input, input_dim] =
            d < -1 ? owner.at(static_cast<size_t>(-2 - d)) : std::pair<size_t, size_t>{};
        const int64_t expected = d < -1 ? inputs[input].shape[input_dim] : d;
        if (outputs[i].shape[j] == expected) continue;
        const std::string taken_for = d < -1 ? "the size of dim " + std::to_string(input_dim) +
                                                   " of tensor input " + std::to_string(input)
                                             : std::string("the size in the recorded call");
        throw std::runtime_error(
            "output " + std::to_string(i + 1) + " has size " + std::to_string(outputs[i].shape[j]) +
            " in dim " + std::to_string(j) + ", but the graph was captured with " + std::to_string(expected) +
            " there (" + taken_for + "): " + layout_.func_name +
            "'s output sizes do not follow its inputs' as a capture with symbolic sizes took them. Give the "
            "Function infer_shape(node, shapes, dtypes), or capture with dynamic=False.");
      }
    }
  }

  // A Function may write only into an input that the node declares updated in place (which then
  // views its output's buffer); any other input's buffer other nodes could read.
  static void CheckInPlaceWrites(const TensorViews& inputs, const TensorViews& outputs, py::handle modified) {
    for (py::handle index : modified) {
      const size_t i = index.cast<size_t>();
      if (i >= inputs.size()) throw std::logic_error("the runner named an input the node does not have");
      const void* buffer = inputs[i].data;
      if (std::none_of(outputs.begin(), outputs.end(),
                       [&](const TensorView& o) { return o.data == buffer; })) {
        throw std::runtime_error("the Function modified input " + std::to_string(i) +
                                 " in place, but the node does not declare it updated in place "
                                 "(tensor_reuse_map), so other nodes may "
                                 "see the change. Modify a copy instead (x = x.clone()), or export the model "
                                 "with ortbridge.export, "
                                 "which declares the in-place updates it sees.");
      }
    }
  }

  // The runner's `run`, made here where ForwardNode.direct allows it: the Python around
  // Function.apply in `run` costs about as much as the kernel's own work. Anything but plain CPU
  // tensors out and unchanged inputs goes on to the runner's `result`, which checks and errors as
  // `run` does. GIL held.
  py::tuple CallDirect(const TensorViews& inputs) {
    const RunnerApi& torch = Runner();
    if (torch.functorch_active().ptr() == Py_True) return run_(BorrowInputs(inputs, placement_.device));
    const py::tuple capsules = BorrowInputs(inputs, placement_.device);
    py::list tensors(capsules.size());
    for (size_t i = 0; i < capsules.size(); ++i) tensors[i] = Call(torch.from_dlpack, {capsules[i]});
    const bool training = layout_.training_mode;
    if (training) {
      for (size_t i = 0; i < inputs.size(); ++i) {
        // (the attribute's setter: requires_grad_() parses its arguments)
        if (layout_.requires_grad[i] &&
            PyObject_SetAttr(tensors[i].ptr(), torch.requires_grad.ptr(), Py_True) != 0) {
          throw py::error_already_set();
        }
      }
    }
    const size_t argument_count = PyTuple_GET_SIZE(direct_.args.ptr());
    py::tuple args(argument_count);
    for (size_t i = 0; i < argument_count; ++i) {
      const int tensor = direct_.tensor_at[i];
      PyObject* arg =
          tensor < 0 ? PyTuple_GET_ITEM(direct_.args.ptr(), i) : PyList_GET_ITEM(tensors.ptr(), tensor);
      PyTuple_SET_ITEM(args.ptr(), i, py::handle(arg).inc_ref().ptr());
    }
    std::optional<SavingScope> saving;
    if (training) saving.emplace(Borrowed(inputs));
    const py::object outputs = CallWithGradMode(direct_.call, args, training);
    saving.reset();

    const size_t n = layout_.output_tensor_types.size();
    const ReturnedList items = ReturnedItems(outputs.ptr());
    auto unchanged = [&](py::handle t) { return t.attr(torch.version).cast<int64_t>() == 0; };
    auto by_the_runner = [&] {
      CloseOpenSaving(DirectRunScope());  // (the runner's Python runs without them, as in `run`)
      return runner_.attr(Runner().result)(outputs, tensors,
                                           training ? py::object(BorrowedSet(inputs)) : py::none());
    };
    if (items.size() != n || !std::all_of(tensors.begin(), tensors.end(), unchanged)) return by_the_runner();
    py::tuple result(n + 1);
    for (size_t i = 0; i < n; ++i) {
      py::object exported = ExportCpuTensor(items[i]);
      if (!exported) return by_the_runner();
      PyTuple_SET_ITEM(result.ptr(), i + 1, exported.release().ptr());
    }
    PyTuple_SET_ITEM(result.ptr(), 0, (training ? Context(items, inputs) : py::none()).release().ptr());
    return result;
  }

  // The autograd node of a training call, which is its context (None when no output needs a
  // gradient), as the runner's `result` finds it; (that, what keeps it alive) where a context does
  // not own its node.
  py::object Context(const ReturnedList& outputs, const TensorViews& inputs) const {
    const RunnerApi& torch = Runner();
    for (PyObject* o : outputs) {
      py::object ctx = py::handle(o).attr(torch.grad_fn);
      if (ctx.is_none()) continue;
      // A tensor kept as a plain attribute (ctx.x = x) would outlive ORT's buffer too.
      PyObject* attributes = PyObject_GenericGetDict(ctx.ptr(), nullptr);
      if (!attributes) throw py::error_already_set();
      const bool any = PyDict_Size(attributes) > 0;
      Py_DECREF(attributes);
      if (any) Runner().own_borrowed_attributes(ctx, BorrowedSet(inputs));
      if (!torch.node_owner.is_none()) return py::make_tuple(ctx, Call(torch.node_owner, {o}));
      return ctx;
    }
    return py::none();
  }

  // The buffers of ORT's inputs, which the call borrows.
  static BorrowedBuffers Borrowed(const TensorViews& inputs) {
    BorrowedBuffers buffers;
    for (const TensorView& t : inputs) {
      const auto begin = reinterpret_cast<uintptr_t>(t.data);
      buffers.push_back({begin, begin + t.byte_size()});
    }
    return buffers;
  }
  // Their addresses, as the runner's Python checks them.
  static py::set BorrowedSet(const TensorViews& inputs) {
    py::set buffers;
    for (const TensorView& t : inputs) buffers.add(py::int_(reinterpret_cast<uintptr_t>(t.data)));
    return buffers;
  }

  bool context_id_output_ = true;  // whether output 0 has a value name

  // From ForwardNode.direct (a DirectCall): what CallDirect calls, its arguments (None in the
  // tensor positions), and for each argument the index of its tensor input or -1. No call where
  // `direct` is None.
  struct {
    py::object call;
    py::object args;
    std::vector<int> tensor_at;
  } direct_;

  py::object MakeRunner(const std::string& device) {  // GIL held
    py::object runner = Runner().forward_node(layout_, device);
    py::object direct = runner.attr(Runner().direct);
    if (!direct.is_none() && !placement_.via_torch()) {  // (the device path is the CUDA kernels': `run`)
      const RunnerApi& api = Runner();
      direct_.args = py::tuple(direct.attr(api.direct_args));
      direct_.tensor_at.assign(py::len(direct_.args), -1);
      int tensor = 0;
      for (py::handle position : direct.attr(api.direct_tensor_positions))
        direct_.tensor_at.at(position.cast<size_t>()) = tensor++;
      direct_.call = direct.attr(api.direct_call);
    }
    return runner;
  }
};

}  // namespace

const OrtCustomOp* PythonOp(Backend backend) { return OpFor<PythonOpKernel>(backend); }

}  // namespace ortbridge
