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
  for (size_t i = 0; i < types.size(); ++i) {
    const size_t j = first + i;
    // A reused input whose type or rank differs (ORTModule maps views too) gets the general rule.
    const bool reused = j < reuse.size() && reuse[j] >= 0 &&
                        CopyInputTypeShape(api, context, static_cast<size_t>(reuse[j]), j, types[i], ranks[i]);
    if (!reused) SetOutputTypeAndRank(api, context, j, types[i], ranks[i]);
  }
}

}  // namespace ortbridge
