#include "python_kernel.h"

#include <stdexcept>

namespace ortbridge {

void InferOutputsFromAttributes(const OrtApi& api, OrtShapeInferContext* context, size_t first,
                                const std::vector<int64_t>& reuse) {
  auto types = ShapeInferInts(api, context, "output_tensor_types");
  auto ranks = ShapeInferInts(api, context, "output_tensor_ranks");
  if (ranks.size() != types.size()) {
    throw std::runtime_error("output_tensor_ranks and output_tensor_types differ in length");
  }
  CheckOutputDims("output_tensor_ranks", ranks);  // before any dimension is made
  for (size_t i = 0; i < types.size(); ++i) {
    const size_t j = first + i;
    // A reused input whose type or rank differs (ORTModule maps views too) gets the general rule.
    const bool reused =
        j < reuse.size() && reuse[j] >= 0 &&
        CopyInputTypeShape(api, context, static_cast<size_t>(reuse[j]), j, types[i], ranks[i]);
    if (!reused) SetOutputTypeAndRank(api, context, j, types[i], ranks[i]);
  }
}

void CheckDeclared(const char* kind, size_t index, const DeclaredValue& value, int64_t type,
                   const char* typed_by, const char* wanted_by) {
  const std::string what = std::string(kind) + " " + std::to_string(index);
  if (value.name.empty()) {
    throw AttributeError(what + " has an empty name, but " + wanted_by + " says the node " +
                         (kind[0] == 'i' ? "reads" : "writes") + " a value there");
  }
  if (value.elem_type != type) {
    throw AttributeError(
        what + " ('" + Printable(value.name) + "') is " +
        (value.elem_type ? std::string(ElementTypeName(value.elem_type)) : "of no tensor type") +
        " in the graph, but " + typed_by + " says " + ElementTypeName(type));
  }
}

}  // namespace ortbridge
