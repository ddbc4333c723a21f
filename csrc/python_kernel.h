// What PythonOp and PythonOpGrad share: creation from node attributes (errors name the node
// and the function), the placement of the tensors, the bound Python runner, and type inference
// from output attributes.
#pragma once

#include <memory>
#include <string>

#include "kernel_io.h"
#include "run_scope.h"

namespace ortbridge {

template <class Layout>
class PythonKernel {
 public:
  PythonKernel(const OrtApi& api, const char* op, const std::string& node, Layout layout)
      : api_(api),
        layout_(std::move(layout)),
        error_prefix_(std::string("ortbridge ") + op + " node '" + Printable(node) + "' (function '" +
                      Printable(layout_.func_name) + "'): ") {}
  ~PythonKernel() {
    ReleasePython(run_);
    ReleasePython(runner_);
  }

  // Kernel creation at session creation: parse and validate the attributes, then bind the
  // Function through the registry (an unknown func_name fails here).
  template <class Kernel>
  static OrtStatus* Create(const OrtApi& api, const OrtKernelInfo* info, Backend backend, void** out) {
    std::string prefix = std::string("ortbridge ") + Kernel::kName + ": ";
    return Guarded(api, prefix, [&] {
      std::string node = NodeName(api, info);
      prefix = std::string("ortbridge ") + Kernel::kName + " node '" + Printable(node) + "': ";
      // ORT quotes the node name raw in its own run errors, which Python must decode.
      if (!IsValidUtf8(node)) throw AttributeError("the node name is not valid UTF-8");
      const std::vector<DeclaredValue> inputs = DeclaredInputs(api, info);
      const std::vector<DeclaredValue> outputs = DeclaredOutputs(api, info);
      auto kernel = std::make_unique<Kernel>(
          api, node, Kernel::Parse(KernelInfoAttributes(api, info), inputs.size(), outputs.size()));
      prefix = kernel->error_prefix_;
      kernel->placement_ = PlacementOf(api, info, backend);
      kernel->checked_outputs_ = std::make_unique<CheckedOutputs>(outputs.size());
      // ORT allocates outputs by the graph's types (which are the attributes' only when shape
      // inference succeeded: ORT ignores its status), so the two must agree before any write.
      kernel->CheckValues(inputs, outputs);
      RequirePython();
      KernelGil gil;
      try {
        kernel->runner_ = kernel->MakeRunner(DeviceName(kernel->placement_.device));
        kernel->function_ = kernel->runner_.attr(Runner().func).ptr();  // kept alive by the runner
        kernel->run_ = kernel->runner_.attr(Runner().run);
      } catch (py::error_already_set& e) {
        throw std::runtime_error(FormatPythonError(e));
      }
      *out = kernel.release();
    });
  }

 protected:
  const OrtApi& api_;
  const Layout layout_;
  const std::string error_prefix_;
  Placement placement_;
  py::object runner_;  // ortbridge._kernel.runner's node: runs the Function, writes device buffers
  py::object run_;     // its bound `run` method
  const PyObject* function_ = nullptr;  // the Function class: contexts belong to it
  std::unique_ptr<CheckedOutputs> checked_outputs_;
};

// Refuses a node input or output that the kernel reads or writes when the graph leaves it
// unnamed (`wanted_by` says why a value is needed there) or declares another element type than
// `type` (which `typed_by` gives), as "attribute 'output_tensor_types'".
constexpr const char* kContextIdFormat = "the node format (a context id)";
void CheckDeclared(const char* kind, size_t index, const DeclaredValue& value, int64_t type,
                   const char* typed_by, const char* wanted_by);

// Sets outputs [first, ...) from the node's output_tensor_types and output_tensor_ranks, except
// that output j takes the shape of input reuse[j] when that entry is >= 0 and the input has the
// output's type and rank (an output that is its input updated in place: tensor_reuse_map).
void InferOutputsFromAttributes(const OrtApi& api, OrtShapeInferContext* context, size_t first,
                                const std::vector<int64_t>& reuse = {});

}  // namespace ortbridge
