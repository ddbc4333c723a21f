// Node attributes -> a validated call layout. No Python and no ONNX Runtime here, so the
// parsing rules are unit-tested on their own (tests/cpp/test_attributes.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "element_types.h"
#include "text.h"

namespace ortbridge {

// Tensor ranks a node may declare. Shape inference creates one named dimension per rank, so a
// bound keeps a hostile rank from costing gigabytes before anything else is checked (torch
// supports at most 64 dimensions, too).
constexpr int64_t kMaxRank = 64;
// The dimensions of all outputs of one node together: ORT keeps some 400 bytes per inferred
// dimension, so this bounds what one node's few bytes of ranks can cost.
constexpr int64_t kMaxOutputDims = 256;

// Throws AttributeError (naming `attribute`) when `ranks` add up to more than kMaxOutputDims.
void CheckOutputDims(const char* attribute, const std::vector<int64_t>& ranks);

// Where attributes come from: the ORT kernel info in production, a map in tests.
// Each getter returns false when the attribute is absent or has another type; Has tells the two
// apart (only on error paths, so it may be slow).
class AttributeSource {
 public:
  virtual ~AttributeSource() = default;
  virtual bool Has(const char* name) const = 0;
  virtual bool GetInt(const char* name, int64_t* out) const = 0;
  virtual bool GetString(const char* name, std::string* out) const = 0;
  virtual bool GetInts(const char* name, std::vector<int64_t>* out) const = 0;
  virtual bool GetFloats(const char* name, std::vector<float>* out) const = 0;
};

// A malformed node. The message names the attribute; the kernel adds the node name.
class AttributeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One non-tensor argument of Function.apply, fixed in the graph.
struct Constant {
  enum class Kind { kBool, kInt, kFloat, kBoolTuple, kIntTuple, kFloatTuple, kObject, kLiteral };
  Kind kind;
  size_t position;             // index among all apply arguments
  std::vector<int64_t> ints;   // bool/int values, the object key (kObject), the index in literals (kLiteral)
  std::vector<double> floats;  // float values
};

// PythonOp: Function.apply(*args) where args interleave tensor inputs and constants.
struct ForwardLayout {
  std::string func_name;
  std::string input_convention;  // 'd' tensor, 'c' constant, one per argument
  bool training_mode = false;
  bool safe_run_mode = true;                 // false: forward is called without Function.apply
  std::vector<bool> requires_grad;           // per tensor input
  std::vector<size_t> tensor_positions;      // argument index of each tensor input
  std::vector<int64_t> input_tensor_types;   // ONNX element types
  std::vector<int64_t> input_tensor_ranks;   // -1: unknown
  std::vector<Constant> constants;           // sorted by position
  std::string literals;                      // input_literals: JSON list the kLiteral constants index
  std::vector<int64_t> output_tensor_types;  // per output after the context id
  std::vector<int64_t> output_tensor_ranks;
  // tensor_reuse_map entries j -> i whose output and input types agree (the first per input):
  // node output j is tensor input i updated in place.
  std::vector<std::pair<size_t, size_t>> in_place;
  size_t ordering_inputs = 0;  // the last inputs, which only order the node (never read)
  // output_tensor_dims: empty, or one entry per output dim (outputs in order) that the kernel checks
  // the Function's outputs against: >= 0 that size; -1 any; -2 - k the size of dim k of the
  // tensor inputs' dims in order (a graph with symbolic sizes assumed those equal).
  std::vector<int64_t> output_tensor_dims;
};

// PythonOpGrad: Function.backward(ctx, *grads) -> one value per forward argument.
struct BackwardLayout {
  std::string func_name;
  std::string output_convention;            // the forward input_convention
  std::vector<int64_t> input_tensor_types;  // per forward output: the type of its gradient
  std::vector<int64_t> input_tensor_ranks;
  std::vector<size_t> grad_input_slots;      // forward output of each gradient input (after ctx)
  std::vector<int64_t> output_tensor_types;  // per forward tensor input (absent outputs allowed)
  std::vector<int64_t> output_tensor_ranks;
  std::vector<bool> output_requires_grad;  // per gradient output
  std::vector<size_t> output_positions;    // backward-result index of each gradient output
};

// input_count/output_count are the node's own counts (context id included).
ForwardLayout ParseForward(const AttributeSource& attrs, size_t input_count, size_t output_count);
BackwardLayout ParseBackward(const AttributeSource& attrs, size_t input_count, size_t output_count);

}  // namespace ortbridge
