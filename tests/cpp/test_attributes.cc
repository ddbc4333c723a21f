// ParseForward / ParseBackward: the layouts a well-formed node yields, and for every malformed
// node an AttributeError whose message names the attribute at fault.
#include "attributes.h"
#include "attribute_map.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <ostream>
#include <string>
#include <vector>

namespace ortbridge {
namespace {

int64_t Bits(double d) {
  int64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  return bits;
}

// Passes when `parse` throws AttributeError naming `attribute` (and containing `detail`).
::testing::AssertionResult Rejects(const std::function<void()>& parse, const std::string& attribute,
                                   const std::string& detail = "") {
  try {
    parse();
  } catch (const AttributeError& e) {
    const std::string message = e.what();
    if (message.find("attribute '" + attribute + "'") == std::string::npos) {
      return ::testing::AssertionFailure() << "message does not name '" << attribute << "': " << message;
    }
    if (message.find(detail) == std::string::npos) {
      return ::testing::AssertionFailure() << "message lacks \"" << detail << "\": " << message;
    }
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "accepted; expected an AttributeError naming '" << attribute << "'";
}

// ---------------------------------------------------------------------------------------------
// PythonOp

class ForwardTest : public ::testing::Test {
 protected:
  // Minimal valid node: y = f(x), one float tensor in and out.
  void SetUp() override {
    a.strings["func_name"] = "test.Fn";
    a.strings["input_convention"] = "d";
    a.int_lists["input_tensor_types"] = {1};
    a.int_lists["output_tensor_types"] = {1};
    a.int_lists["output_tensor_ranks"] = {1};
  }

  ForwardLayout Parse() const { return ParseForward(a, inputs, outputs); }
  ::testing::AssertionResult Fails(const std::string& attribute, const std::string& detail = "") const {
    return Rejects([this] { Parse(); }, attribute, detail);
  }

  // One 'c' slot between two tensors ("dcd"), for the constant tests.
  void UseConstantSlot() {
    a.strings["input_convention"] = "dcd";
    a.int_lists["input_tensor_types"] = {1, 1};
    inputs = 2;
  }

  MapAttributes a;
  size_t inputs = 1;
  size_t outputs = 2;  // context id + y
};

TEST_F(ForwardTest, TensorOnly) {
  ForwardLayout f = Parse();
  EXPECT_EQ(f.func_name, "test.Fn");
  EXPECT_EQ(f.input_convention, "d");
  EXPECT_FALSE(f.training_mode);
  EXPECT_EQ(f.tensor_positions, (std::vector<size_t>{0}));
  EXPECT_EQ(f.requires_grad, (std::vector<bool>{false}));  // default: no input needs a gradient
  EXPECT_EQ(f.input_tensor_types, (std::vector<int64_t>{1}));
  EXPECT_EQ(f.input_tensor_ranks, (std::vector<int64_t>{-1}));  // absent: unknown
  EXPECT_TRUE(f.constants.empty());
  EXPECT_EQ(f.output_tensor_types, (std::vector<int64_t>{1}));
  EXPECT_EQ(f.output_tensor_ranks, (std::vector<int64_t>{1}));
}

TEST_F(ForwardTest, FlagsAndOptionalAttributes) {
  a.ints["training_mode"] = 1;
  a.ints["safe_run_mode"] = 1;
  a.int_lists["input_tensor_ranks"] = {-1};
  a.int_lists["input_requires_grads"] = {1};
  a.int_lists["tensor_reuse_map"] = {-1, 0};
  ForwardLayout f = Parse();
  EXPECT_TRUE(f.training_mode);
  EXPECT_EQ(f.requires_grad, (std::vector<bool>{true}));
  EXPECT_EQ(f.input_tensor_ranks, (std::vector<int64_t>{-1}));
}

TEST_F(ForwardTest, SeveralOutputs) {
  outputs = 4;
  a.int_lists["output_tensor_types"] = {1, 7, 9};
  a.int_lists["output_tensor_ranks"] = {0, 2, 3};
  ForwardLayout f = Parse();
  EXPECT_EQ(f.output_tensor_types, (std::vector<int64_t>{1, 7, 9}));
  EXPECT_EQ(f.output_tensor_ranks, (std::vector<int64_t>{0, 2, 3}));
}

TEST_F(ForwardTest, EverySupportedElementType) {
  for (int64_t t = 1; t <= 16; ++t) {
    if (t == 8 || t == 14 || t == 15) continue;  // string, complex64, complex128
    a.int_lists["input_tensor_types"] = {t};
    a.int_lists["output_tensor_types"] = {t};
    EXPECT_NO_THROW(Parse()) << "type " << t;
  }
}

// Every constant kind, tensors not first, tuples of several lengths (one empty).
TEST_F(ForwardTest, ConstantsOfEveryKind) {
  //                              0123456789A
  a.strings["input_convention"] = "cdcccccdccc";
  inputs = 2;
  a.int_lists["input_tensor_types"] = {1, 7};
  a.int_lists["input_tensor_ranks"] = {2, -1};
  a.int_lists["input_requires_grads"] = {0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  a.int_lists["input_bool_scalars"] = {1};
  a.int_lists["input_bool_scalar_positions"] = {0};
  a.int_lists["input_int_scalars"] = {-7};
  a.int_lists["input_int_scalar_positions"] = {2};
  a.float_lists["input_float_scalars"] = {0.5f};
  a.int_lists["input_float_scalar_positions"] = {3};
  a.int_lists["input_bool_tuples"] = {1, 0};
  a.int_lists["input_bool_tuple_positions"] = {4};
  a.int_lists["input_bool_tuple_begins"] = {0};
  a.int_lists["input_int_tuples"] = {3, 4, 5};
  a.int_lists["input_int_tuple_positions"] = {5, 10};  // (3, 4, 5) and ()
  a.int_lists["input_int_tuple_begins"] = {0, 3};
  a.float_lists["input_float_tuples"] = {1.5f, 2.0f, 2.5f};
  a.int_lists["input_float_tuple_positions"] = {8, 6};  // (1.5,) at 8, (2.0, 2.5) at 6
  a.int_lists["input_float_tuple_begins"] = {0, 1};
  a.int_lists["input_pointer_scalars"] = {123456789};
  a.int_lists["input_pointer_scalar_positions"] = {9};

  ForwardLayout f = Parse();
  EXPECT_EQ(f.tensor_positions, (std::vector<size_t>{1, 7}));
  EXPECT_EQ(f.requires_grad, (std::vector<bool>{true, false}));
  EXPECT_EQ(f.input_tensor_ranks, (std::vector<int64_t>{2, -1}));

  using K = Constant::Kind;
  struct Want {
    K kind;
    size_t position;
    std::vector<int64_t> ints;
    std::vector<double> floats;
  };
  const std::vector<Want> want = {
      {K::kBool, 0, {1}, {}},         {K::kInt, 2, {-7}, {}},           {K::kFloat, 3, {}, {0.5}},
      {K::kBoolTuple, 4, {1, 0}, {}}, {K::kIntTuple, 5, {3, 4, 5}, {}}, {K::kFloatTuple, 6, {}, {2.0, 2.5}},
      {K::kFloatTuple, 8, {}, {1.5}}, {K::kObject, 9, {123456789}, {}}, {K::kIntTuple, 10, {}, {}},
  };
  ASSERT_EQ(f.constants.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("constant " + std::to_string(i));
    EXPECT_EQ(f.constants[i].kind, want[i].kind);
    EXPECT_EQ(f.constants[i].position, want[i].position);  // sorted by position
    EXPECT_EQ(f.constants[i].ints, want[i].ints);
    EXPECT_EQ(f.constants[i].floats, want[i].floats);
  }
}

TEST_F(ForwardTest, LiteralsIndexTheirJsonList) {
  a.strings["input_convention"] = "cdcc";
  inputs = 1;
  a.int_lists["input_tensor_types"] = {1};
  a.strings["input_literals"] = "[null, \"gelu\"]";
  a.int_lists["input_literal_positions"] = {3, 0};
  a.int_lists["input_int_scalars"] = {4};
  a.int_lists["input_int_scalar_positions"] = {2};
  ForwardLayout f = Parse();
  EXPECT_EQ(f.literals, "[null, \"gelu\"]");  // decoded (and counted) in Python
  ASSERT_EQ(f.constants.size(), 3u);
  EXPECT_EQ(f.constants[0].kind, Constant::Kind::kLiteral);
  EXPECT_EQ(f.constants[0].ints, (std::vector<int64_t>{1}));  // position 0 is entry 1
  EXPECT_EQ(f.constants[1].kind, Constant::Kind::kInt);
  EXPECT_EQ(f.constants[2].ints, (std::vector<int64_t>{0}));
}

TEST_F(ForwardTest, RejectsLiteralsWithoutPositions) {
  UseConstantSlot();
  a.strings["input_literals"] = "[1]";
  EXPECT_TRUE(Fails("input_literal_positions", "given together"));
}

TEST_F(ForwardTest, RejectsLiteralPositionsWithoutText) {
  UseConstantSlot();
  a.int_lists["input_literal_positions"] = {1};
  EXPECT_TRUE(Fails("input_literals", "given together"));
}

TEST_F(ForwardTest, RejectsLiteralOnTensorSlot) {
  UseConstantSlot();
  a.strings["input_literals"] = "[1]";
  a.int_lists["input_literal_positions"] = {0};
  EXPECT_TRUE(Fails("input_literal_positions", "tensor ('d') argument"));
}

TEST_F(ForwardTest, RejectsLiteralsOfWrongType) {
  UseConstantSlot();
  a.int_lists["input_literals"] = {1};
  a.int_lists["input_literal_positions"] = {1};
  EXPECT_TRUE(Fails("input_literals", "wrong type"));
}

TEST_F(ForwardTest, ConstantsOnly) {
  inputs = 0;
  a.strings["input_convention"] = "c";
  a.int_lists["input_tensor_types"] = {};
  a.int_lists["input_int_scalars"] = {3};
  a.int_lists["input_int_scalar_positions"] = {0};
  ForwardLayout f = Parse();
  EXPECT_TRUE(f.tensor_positions.empty());
  ASSERT_EQ(f.constants.size(), 1u);
  EXPECT_EQ(f.constants[0].ints, (std::vector<int64_t>{3}));
}

TEST_F(ForwardTest, InputTypesMayBeLeftOffOnlyWithoutInputs) {
  inputs = 0;
  a.strings["input_convention"] = "c";
  a.int_lists.erase("input_tensor_types");
  a.int_lists["input_int_scalars"] = {3};
  a.int_lists["input_int_scalar_positions"] = {0};
  EXPECT_TRUE(Parse().input_tensor_types.empty());
  inputs = 1;
  a.strings["input_convention"] = "cd";
  EXPECT_TRUE(Fails("input_tensor_types", "required"));
}

TEST_F(ForwardTest, FloatScalarsWithoutF64AreFloat32) {
  UseConstantSlot();
  a.float_lists["input_float_scalars"] = {0.1f};
  a.int_lists["input_float_scalar_positions"] = {1};
  ForwardLayout f = Parse();
  ASSERT_EQ(f.constants.size(), 1u);
  EXPECT_EQ(f.constants[0].floats, (std::vector<double>{static_cast<double>(0.1f)}));
}

TEST_F(ForwardTest, FloatScalarsF64AreExact) {
  UseConstantSlot();
  a.float_lists["input_float_scalars"] = {0.1f};
  a.int_lists["input_float_scalar_positions"] = {1};
  a.int_lists["input_float_scalars_f64"] = {Bits(0.1)};
  ForwardLayout f = Parse();
  ASSERT_EQ(f.constants.size(), 1u);
  EXPECT_EQ(f.constants[0].floats, (std::vector<double>{0.1}));  // not 0.1f widened
}

TEST_F(ForwardTest, FloatTuplesF64AreExact) {
  a.strings["input_convention"] = "dcc";
  a.float_lists["input_float_tuples"] = {0.1f, 1e-40f, 3.0f};
  a.int_lists["input_float_tuple_positions"] = {1, 2};
  a.int_lists["input_float_tuple_begins"] = {0, 2};
  a.int_lists["input_float_tuples_f64"] = {Bits(0.1), Bits(1e-300), Bits(-2.5e300)};
  ForwardLayout f = Parse();
  ASSERT_EQ(f.constants.size(), 2u);
  EXPECT_EQ(f.constants[0].floats, (std::vector<double>{0.1, 1e-300}));
  EXPECT_EQ(f.constants[1].floats, (std::vector<double>{-2.5e300}));
}

// -- malformed: required attributes ------------------------------------------------------------

TEST_F(ForwardTest, RejectsMissingFuncName) {
  a.Erase("func_name");
  EXPECT_TRUE(Fails("func_name", "missing"));
}

TEST_F(ForwardTest, RejectsFuncNameOfAnotherType) {
  a.Erase("func_name");
  a.ints["func_name"] = 1;
  EXPECT_TRUE(Fails("func_name", "has the wrong type; expected STRING"));
}

TEST_F(ForwardTest, RejectsEmptyFuncName) {
  a.strings["func_name"] = "";
  EXPECT_TRUE(Fails("func_name", "must not be empty"));
}

TEST_F(ForwardTest, RejectsMissingInputConvention) {
  a.Erase("input_convention");
  EXPECT_TRUE(Fails("input_convention", "missing"));
}

TEST_F(ForwardTest, RejectsEmptyInputConvention) {
  inputs = 0;
  a.strings["input_convention"] = "";
  EXPECT_TRUE(Fails("input_convention", "must not be empty"));
}

TEST_F(ForwardTest, RejectsMissingInputTensorTypes) {
  a.Erase("input_tensor_types");
  EXPECT_TRUE(Fails("input_tensor_types", "missing"));
}

TEST_F(ForwardTest, RejectsInputTensorTypesAsFloats) {
  a.Erase("input_tensor_types");
  a.float_lists["input_tensor_types"] = {1.0f};
  EXPECT_TRUE(Fails("input_tensor_types", "has the wrong type; expected INTS"));
}

TEST_F(ForwardTest, RejectsMissingOutputTensorTypes) {
  a.Erase("output_tensor_types");
  EXPECT_TRUE(Fails("output_tensor_types", "missing"));
}

TEST_F(ForwardTest, RejectsMissingOutputTensorRanks) {
  a.Erase("output_tensor_ranks");
  EXPECT_TRUE(Fails("output_tensor_ranks", "missing"));
}

// -- malformed: convention and counts ----------------------------------------------------------

TEST_F(ForwardTest, RejectsUnknownConventionChar) {
  for (const char* conv : {"x", "dx", "D", "d ", "C"}) {
    a.strings["input_convention"] = conv;
    EXPECT_TRUE(Fails("input_convention", "unknown argument kind")) << conv;
  }
}

TEST_F(ForwardTest, RejectsTensorCountNotMatchingInputs) {
  a.strings["input_convention"] = "dd";
  EXPECT_TRUE(Fails("input_convention", "has 2 entries, expected 1"));
  inputs = 2;
  a.strings["input_convention"] = "dc";
  a.int_lists["input_int_scalars"] = {1};
  a.int_lists["input_int_scalar_positions"] = {1};
  EXPECT_TRUE(Fails("input_convention", "has 1 entry, expected 2"));
}

TEST_F(ForwardTest, RejectsInputTypesLengthMismatch) {
  a.int_lists["input_tensor_types"] = {1, 1};
  EXPECT_TRUE(Fails("input_tensor_types", "expected 1"));
  a.int_lists["input_tensor_types"] = {};
  EXPECT_TRUE(Fails("input_tensor_types", "expected 1"));
}

TEST_F(ForwardTest, RejectsUnsupportedInputType) {
  for (int64_t t : {0, 8, 17, 18, -1, 1000}) {
    a.int_lists["input_tensor_types"] = {t};
    EXPECT_TRUE(Fails("input_tensor_types", "ONNX type " + std::to_string(t))) << t;
  }
}

TEST_F(ForwardTest, RejectsUnsupportedOutputType) {
  for (int64_t t : {0, 8, 17, 23}) {
    a.int_lists["output_tensor_types"] = {t};
    EXPECT_TRUE(Fails("output_tensor_types", "ONNX type " + std::to_string(t))) << t;
  }
}

TEST_F(ForwardTest, RejectsInputRanksLengthMismatch) {
  a.int_lists["input_tensor_ranks"] = {1, 1};
  EXPECT_TRUE(Fails("input_tensor_ranks", "expected 1"));
}

TEST_F(ForwardTest, RejectsInputRankBelowUnknown) {
  a.int_lists["input_tensor_ranks"] = {-2};
  EXPECT_TRUE(Fails("input_tensor_ranks", "rank -2"));
}

TEST_F(ForwardTest, RejectsOutputTypesLengthMismatch) {
  a.int_lists["output_tensor_types"] = {1, 1};
  EXPECT_TRUE(Fails("output_tensor_types", "expected 1"));
}

TEST_F(ForwardTest, RejectsOutputRanksLengthMismatch) {
  a.int_lists["output_tensor_ranks"] = {1, 1};
  EXPECT_TRUE(Fails("output_tensor_ranks", "expected 1"));
}

TEST_F(ForwardTest, RejectsNegativeOutputRank) {
  a.int_lists["output_tensor_ranks"] = {-1};  // unlike inputs, outputs need a known rank
  EXPECT_TRUE(Fails("output_tensor_ranks", "rank -1"));
}

TEST_F(ForwardTest, RejectsNodeWithoutContextOutput) {
  outputs = 0;
  EXPECT_TRUE(Fails("output_tensor_types", "needs output 0, the context id"));
}

TEST_F(ForwardTest, RejectsRequiresGradsWrongLength) {
  a.int_lists["input_requires_grads"] = {1, 0};
  EXPECT_TRUE(Fails("input_requires_grads", "expected 1"));
  a.int_lists["input_requires_grads"] = {};
  EXPECT_TRUE(Fails("input_requires_grads", "expected 1"));
}

TEST_F(ForwardTest, RejectsRequiresGradsNotBool) {
  for (int64_t v : {2, -1}) {
    a.int_lists["input_requires_grads"] = {v};
    EXPECT_TRUE(Fails("input_requires_grads", "0 or 1")) << v;
  }
}

// -- malformed: flags --------------------------------------------------------------------------

TEST_F(ForwardTest, RejectsTrainingModeNotBool) {
  for (int64_t v : {2, -1}) {
    a.ints["training_mode"] = v;
    EXPECT_TRUE(Fails("training_mode", "got " + std::to_string(v)));
  }
}

TEST_F(ForwardTest, RejectsSafeRunModeNotBool) {
  a.ints["safe_run_mode"] = 2;
  EXPECT_TRUE(Fails("safe_run_mode", "must be 0 or 1"));
}

TEST_F(ForwardTest, SafeRunModeZeroOnlyForInference) {
  a.ints["safe_run_mode"] = 0;
  EXPECT_FALSE(Parse().safe_run_mode);
  EXPECT_FALSE(Parse().training_mode);
  a.ints["training_mode"] = 1;
  EXPECT_TRUE(Fails("safe_run_mode", "supported only with training_mode=0"));
}

// -- malformed: optional attributes of the wrong type are errors, not defaults ----------------

TEST_F(ForwardTest, RejectsOptionalAttributesOfTheWrongType) {
  a.strings["training_mode"] = "1";
  EXPECT_TRUE(Fails("training_mode", "has the wrong type; expected INT"));
  a.Erase("training_mode");
  a.float_lists["input_requires_grads"] = {1.0f};
  EXPECT_TRUE(Fails("input_requires_grads", "has the wrong type; expected INTS"));
  a.Erase("input_requires_grads");
  a.int_lists["input_float_scalars"] = {1};
  EXPECT_TRUE(Fails("input_float_scalars", "has the wrong type; expected FLOATS"));
  a.Erase("input_float_scalars");
  a.float_lists["input_tensor_ranks"] = {1.0f};
  EXPECT_TRUE(Fails("input_tensor_ranks", "has the wrong type; expected INTS"));
}

TEST_F(ForwardTest, RejectsRequiresGradOnAConstant) {
  UseConstantSlot();
  a.int_lists["input_int_scalars"] = {3};
  a.int_lists["input_int_scalar_positions"] = {1};
  a.int_lists["input_requires_grads"] = {0, 1, 0};
  EXPECT_TRUE(Fails("input_requires_grads", "argument 1 is a constant"));
}

// -- ordering_inputs ----------------------------------------------------------------------------

TEST_F(ForwardTest, OrderingInputsAreNoArguments) {
  inputs = 3;  // x, then two inputs that only order the node
  a.ints["ordering_inputs"] = 2;
  a.int_lists["tensor_reuse_map"] = {-1, 0};
  ForwardLayout f = Parse();
  EXPECT_EQ(f.ordering_inputs, 2u);
  EXPECT_EQ(f.tensor_positions, (std::vector<size_t>{0}));
  EXPECT_EQ(f.input_tensor_types, (std::vector<int64_t>{1}));
}

TEST_F(ForwardTest, RejectsOrderingInputsOutOfRange) {
  for (int64_t n : {-1, 2}) {
    a.ints["ordering_inputs"] = n;
    EXPECT_TRUE(Fails("ordering_inputs", "between 0 and the node's input count (1)")) << n;
  }
}

TEST_F(ForwardTest, RejectsOrderingInputsTheConventionCounts) {
  a.ints["ordering_inputs"] = 1;  // x would be no argument: the convention's 'd' has no input
  EXPECT_TRUE(Fails("input_convention", "must match the node's tensor inputs"));
}

TEST_F(ForwardTest, RejectsReuseOfAnOrderingInput) {
  inputs = 2;
  a.ints["ordering_inputs"] = 1;
  a.int_lists["tensor_reuse_map"] = {-1, 1};
  EXPECT_TRUE(Fails("tensor_reuse_map", "tensor input index"));
}

// -- output_tensor_dims -------------------------------------------------------------------------

TEST_F(ForwardTest, OutputDimsAreSizesOrInputDims) {
  a.int_lists["input_tensor_ranks"] = {2};
  a.int_lists["output_tensor_ranks"] = {3};
  a.int_lists["output_tensor_dims"] = {8, -3, -1};  // 8; dim 1 of the inputs; any
  EXPECT_EQ(Parse().output_tensor_dims, (std::vector<int64_t>{8, -3, -1}));
  a.int_lists.erase("output_tensor_dims");
  EXPECT_TRUE(Parse().output_tensor_dims.empty());  // absent: nothing to check
}

TEST_F(ForwardTest, RejectsOutputDimsOfAnotherCount) {
  a.int_lists["output_tensor_dims"] = {1, 2};
  EXPECT_TRUE(Fails("output_tensor_dims", "one per dim of the outputs"));
}

TEST_F(ForwardTest, RejectsOutputDimsReferringToNoInputDim) {
  a.int_lists["input_tensor_ranks"] = {2};
  for (int64_t d : {int64_t{-4}, std::numeric_limits<int64_t>::min()}) {
    a.int_lists["output_tensor_dims"] = {d};
    EXPECT_TRUE(Fails("output_tensor_dims", "refers to no dim of the tensor inputs (2 dims")) << d;
  }
  a.int_lists["input_tensor_ranks"] = {-1};  // (unknown: no dim to refer to)
  a.int_lists["output_tensor_dims"] = {-2};
  EXPECT_TRUE(Fails("output_tensor_dims", "refers to no dim of the tensor inputs (0 dims"));
}

// -- malformed: tensor_reuse_map ---------------------------------------------------------------

TEST_F(ForwardTest, RejectsReuseOfAnInputForTheContextId) {
  a.int_lists["tensor_reuse_map"] = {0, -1};
  EXPECT_TRUE(Fails("tensor_reuse_map", "entry 0 (the context id) must be -1"));
}

TEST_F(ForwardTest, ReuseMapGivesInPlaceOutputsOfTheInputsType) {
  a.strings["input_convention"] = "dd";
  a.int_lists["input_tensor_types"] = {1, 7};
  inputs = 2;
  outputs = 5;
  a.int_lists["output_tensor_types"] = {1, 1, 1, 7};
  a.int_lists["output_tensor_ranks"] = {1, 1, 1, 1};
  // output 1 <- input 0; output 2 <- input 0 again (ignored); output 3 <- input 1 of another type
  // (a view, not in place); output 4 <- input 1.
  a.int_lists["tensor_reuse_map"] = {-1, 0, 0, 1, 1};
  ForwardLayout f = Parse();
  EXPECT_EQ(f.in_place, (std::vector<std::pair<size_t, size_t>>{{1, 0}, {4, 1}}));
}

TEST_F(ForwardTest, RejectsReuseMapWrongLength) {
  a.int_lists["tensor_reuse_map"] = {-1};  // counts the context id too
  EXPECT_TRUE(Fails("tensor_reuse_map", "expected 2"));
}

TEST_F(ForwardTest, RejectsReuseMapIndexOutOfRange) {
  for (int64_t r : {1, -2}) {
    a.int_lists["tensor_reuse_map"] = {-1, r};
    EXPECT_TRUE(Fails("tensor_reuse_map", "tensor input index")) << r;
  }
}

// -- malformed: scalars ------------------------------------------------------------------------

struct ScalarAttrs {
  const char* values;
  const char* positions;
  bool floats;
};
const ScalarAttrs kScalars[] = {
    {"input_bool_scalars", "input_bool_scalar_positions", false},
    {"input_int_scalars", "input_int_scalar_positions", false},
    {"input_pointer_scalars", "input_pointer_scalar_positions", false},
    {"input_float_scalars", "input_float_scalar_positions", true},
};
void PrintTo(const ScalarAttrs& s, std::ostream* os) { *os << s.values; }

class ForwardScalarTest : public ForwardTest, public ::testing::WithParamInterface<ScalarAttrs> {
 protected:
  void SetUp() override {
    ForwardTest::SetUp();
    UseConstantSlot();  // "dcd": slot 1 is the constant
  }
  void Values(size_t n) {
    if (GetParam().floats) {
      a.float_lists[GetParam().values] = std::vector<float>(n, 1.0f);
    } else {
      a.int_lists[GetParam().values] = std::vector<int64_t>(n, 1);
    }
  }
  void Positions(std::vector<int64_t> p) { a.int_lists[GetParam().positions] = std::move(p); }
};

TEST_P(ForwardScalarTest, Accepted) {
  Values(1);
  Positions({1});
  ForwardLayout f = Parse();
  ASSERT_EQ(f.constants.size(), 1u);
  EXPECT_EQ(f.constants[0].position, 1u);
}

TEST_P(ForwardScalarTest, RejectsMorePositionsThanValues) {
  Values(1);
  Positions({1, 1});
  EXPECT_TRUE(Fails(GetParam().positions, "has 2 entries, expected 1"));
}

TEST_P(ForwardScalarTest, RejectsValuesWithoutPositions) {
  Values(1);
  EXPECT_TRUE(Fails(GetParam().positions, "has 0 entries, expected 1"));
}

TEST_P(ForwardScalarTest, RejectsPositionsWithoutValues) {
  Positions({1});
  EXPECT_TRUE(Fails(GetParam().positions, "has 1 entry, expected 0"));
}

TEST_P(ForwardScalarTest, RejectsPositionOutOfRange) {
  Values(1);
  Positions({3});
  EXPECT_TRUE(Fails(GetParam().positions, "position 3 is outside"));
}

TEST_P(ForwardScalarTest, RejectsNegativePosition) {
  Values(1);
  Positions({-1});
  EXPECT_TRUE(Fails(GetParam().positions, "position -1 is outside"));
}

TEST_P(ForwardScalarTest, RejectsPositionOfTensor) {
  Values(1);
  Positions({0});
  EXPECT_TRUE(Fails(GetParam().positions, "position 0 is a tensor"));
}

TEST_P(ForwardScalarTest, RejectsSamePositionTwice) {
  a.strings["input_convention"] = "dccd";
  Values(2);
  Positions({1, 1});
  EXPECT_TRUE(Fails(GetParam().positions, "position 1 is given more than one constant"));
}

INSTANTIATE_TEST_SUITE_P(Kinds, ForwardScalarTest, ::testing::ValuesIn(kScalars),
                         [](const ::testing::TestParamInfo<ScalarAttrs>& info) {
                           std::string name = info.param.values;
                           return name.substr(std::strlen("input_"));
                         });

TEST_F(ForwardTest, RejectsConstantSlotWithoutValue) {
  UseConstantSlot();
  EXPECT_TRUE(Fails("input_convention", "constant argument 1 has no value"));
}

TEST_F(ForwardTest, RejectsPositionClaimedByTwoKinds) {
  UseConstantSlot();
  a.int_lists["input_int_scalars"] = {4};
  a.int_lists["input_int_scalar_positions"] = {1};
  a.float_lists["input_float_scalars"] = {4.0f};
  a.int_lists["input_float_scalar_positions"] = {1};
  EXPECT_TRUE(Fails("input_float_scalar_positions", "more than one constant"));
}

TEST_F(ForwardTest, RejectsPositionClaimedByScalarAndTuple) {
  UseConstantSlot();
  a.int_lists["input_bool_scalars"] = {1};
  a.int_lists["input_bool_scalar_positions"] = {1};
  a.int_lists["input_int_tuples"] = {1, 2};
  a.int_lists["input_int_tuple_positions"] = {1};
  a.int_lists["input_int_tuple_begins"] = {0};
  EXPECT_TRUE(Fails("input_int_tuple_positions", "more than one constant"));
}

TEST_F(ForwardTest, RejectsBoolScalarNotBool) {
  UseConstantSlot();
  for (int64_t v : {2, -1}) {
    a.int_lists["input_bool_scalars"] = {v};
    a.int_lists["input_bool_scalar_positions"] = {1};
    EXPECT_TRUE(Fails("input_bool_scalars", "bool value " + std::to_string(v))) << v;
  }
}

TEST_F(ForwardTest, RejectsFloatScalarsF64WrongLength) {
  UseConstantSlot();
  a.float_lists["input_float_scalars"] = {1.0f};
  a.int_lists["input_float_scalar_positions"] = {1};
  a.int_lists["input_float_scalars_f64"] = {Bits(1.0), Bits(2.0)};
  EXPECT_TRUE(Fails("input_float_scalars_f64", "has 2 entries, expected 1"));
  a.int_lists["input_float_scalars_f64"] = {};
  EXPECT_TRUE(Fails("input_float_scalars_f64", "has 0 entries, expected 1"));
}

// -- malformed: tuples -------------------------------------------------------------------------

struct TupleAttrs {
  const char* values;
  const char* positions;
  const char* begins;
  bool floats;
};
const TupleAttrs kTuples[] = {
    {"input_bool_tuples", "input_bool_tuple_positions", "input_bool_tuple_begins", false},
    {"input_int_tuples", "input_int_tuple_positions", "input_int_tuple_begins", false},
    {"input_float_tuples", "input_float_tuple_positions", "input_float_tuple_begins", true},
};
void PrintTo(const TupleAttrs& t, std::ostream* os) { *os << t.values; }

class ForwardTupleTest : public ForwardTest, public ::testing::WithParamInterface<TupleAttrs> {
 protected:
  void SetUp() override {
    ForwardTest::SetUp();
    a.strings["input_convention"] = "dccc";  // slots 1..3 are constants
  }
  void Values(size_t n) {
    if (GetParam().floats) {
      a.float_lists[GetParam().values] = std::vector<float>(n, 0.0f);
    } else {
      a.int_lists[GetParam().values] = std::vector<int64_t>(n, 0);
    }
  }
  void Positions(std::vector<int64_t> p) { a.int_lists[GetParam().positions] = std::move(p); }
  void Begins(std::vector<int64_t> b) { a.int_lists[GetParam().begins] = std::move(b); }
};

TEST_P(ForwardTupleTest, Accepted) {
  Values(3);
  Positions({3, 1, 2});
  Begins({0, 1, 1});  // lengths 1, 0, 2
  ForwardLayout f = Parse();
  ASSERT_EQ(f.constants.size(), 3u);
  auto length = [&](const Constant& c) { return GetParam().floats ? c.floats.size() : c.ints.size(); };
  EXPECT_EQ(length(f.constants[0]), 0u);  // position 1
  EXPECT_EQ(length(f.constants[1]), 2u);  // position 2
  EXPECT_EQ(length(f.constants[2]), 1u);  // position 3
}

TEST_P(ForwardTupleTest, RejectsBeginsNotStartingAtZero) {
  Values(3);
  Positions({1, 2, 3});
  Begins({1, 2, 2});
  EXPECT_TRUE(Fails(GetParam().begins, "start at 0"));
}

TEST_P(ForwardTupleTest, RejectsDecreasingBegins) {
  Values(3);
  Positions({1, 2, 3});
  Begins({0, 2, 1});
  EXPECT_TRUE(Fails(GetParam().begins, "rise within the 3 values"));
}

TEST_P(ForwardTupleTest, RejectsBeginBeyondValues) {
  Values(3);
  Positions({1, 2, 3});
  Begins({0, 1, 4});
  EXPECT_TRUE(Fails(GetParam().begins, "rise within the 3 values"));
}

TEST_P(ForwardTupleTest, RejectsNegativeBegin) {
  Values(3);
  Positions({1, 2, 3});
  Begins({0, -1, 2});
  EXPECT_TRUE(Fails(GetParam().begins));
}

TEST_P(ForwardTupleTest, RejectsBeginsPositionsLengthMismatch) {
  Values(3);
  Positions({1, 2, 3});
  Begins({0, 1});
  EXPECT_TRUE(Fails(GetParam().begins, "has 2 entries, expected 3"));
  a.Erase(GetParam().begins);
  EXPECT_TRUE(Fails(GetParam().begins, "has 0 entries, expected 3"));
}

TEST_P(ForwardTupleTest, RejectsValuesWithoutPositions) {
  a.strings["input_convention"] = "d";
  Values(2);
  EXPECT_TRUE(Fails(GetParam().values, "no tuple positions"));
}

TEST_P(ForwardTupleTest, RejectsPositionOutOfRange) {
  Values(1);
  Positions({4});
  Begins({0});
  EXPECT_TRUE(Fails(GetParam().positions, "position 4 is outside"));
}

TEST_P(ForwardTupleTest, RejectsPositionOfTensor) {
  Values(1);
  Positions({0});
  Begins({0});
  EXPECT_TRUE(Fails(GetParam().positions, "position 0 is a tensor"));
}

TEST_P(ForwardTupleTest, RejectsSamePositionTwice) {
  Values(2);
  Positions({2, 2});
  Begins({0, 1});
  EXPECT_TRUE(Fails(GetParam().positions, "more than one constant"));
}

INSTANTIATE_TEST_SUITE_P(Kinds, ForwardTupleTest, ::testing::ValuesIn(kTuples),
                         [](const ::testing::TestParamInfo<TupleAttrs>& info) {
                           std::string name = info.param.values;
                           return name.substr(std::strlen("input_"));
                         });

TEST_F(ForwardTest, RejectsBoolTupleValueNotBool) {
  a.strings["input_convention"] = "dc";
  a.int_lists["input_bool_tuples"] = {1, 0, 2};
  a.int_lists["input_bool_tuple_positions"] = {1};
  a.int_lists["input_bool_tuple_begins"] = {0};
  EXPECT_TRUE(Fails("input_bool_tuples", "bool value 2"));
}

TEST_F(ForwardTest, RejectsFloatTuplesF64WrongLength) {
  a.strings["input_convention"] = "dc";
  a.float_lists["input_float_tuples"] = {1.0f, 2.0f};
  a.int_lists["input_float_tuple_positions"] = {1};
  a.int_lists["input_float_tuple_begins"] = {0};
  a.int_lists["input_float_tuples_f64"] = {Bits(1.0)};
  EXPECT_TRUE(Fails("input_float_tuples_f64", "has 1 entry, expected 2"));
}

// ---------------------------------------------------------------------------------------------
// PythonOpGrad

class BackwardTest : public ::testing::Test {
 protected:
  // Backward of a forward apply(x, c, w) -> (y, z), where z has no gradient flowing in:
  // inputs (ctx, dy), outputs (dx, dw).
  void SetUp() override {
    a.strings["func_name"] = "test.Fn";
    a.strings["output_convention"] = "dcd";
    a.int_lists["input_tensor_types"] = {1, 7};
    a.int_lists["input_tensor_present"] = {1, 0};
    a.int_lists["output_tensor_types"] = {1, 11};
    a.int_lists["output_tensor_ranks"] = {2, 0};
    a.int_lists["output_tensor_requires_grads"] = {1, 0};
  }

  BackwardLayout Parse() const { return ParseBackward(a, inputs, outputs); }
  ::testing::AssertionResult Fails(const std::string& attribute, const std::string& detail = "") const {
    return Rejects([this] { Parse(); }, attribute, detail);
  }

  MapAttributes a;
  size_t inputs = 2;
  size_t outputs = 2;
};

TEST_F(BackwardTest, Valid) {
  BackwardLayout b = Parse();
  EXPECT_EQ(b.func_name, "test.Fn");
  EXPECT_EQ(b.output_convention, "dcd");
  EXPECT_EQ(b.input_tensor_types, (std::vector<int64_t>{1, 7}));
  EXPECT_EQ(b.input_tensor_ranks, (std::vector<int64_t>{-1, -1}));
  EXPECT_EQ(b.grad_input_slots, (std::vector<size_t>{0}));  // the absent gradient is skipped
  EXPECT_EQ(b.output_tensor_types, (std::vector<int64_t>{1, 11}));
  EXPECT_EQ(b.output_tensor_ranks, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(b.output_requires_grad, (std::vector<bool>{true, false}));
  EXPECT_EQ(b.output_positions, (std::vector<size_t>{0, 2}));
}

TEST_F(BackwardTest, AllGradientsPresentByDefault) {
  a.Erase("input_tensor_present");
  a.int_lists["input_tensor_ranks"] = {1, -1};
  inputs = 3;
  BackwardLayout b = Parse();
  EXPECT_EQ(b.grad_input_slots, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(b.input_tensor_ranks, (std::vector<int64_t>{1, -1}));
}

TEST_F(BackwardTest, PresentMaskSkipsLeadingSlot) {
  a.int_lists["input_tensor_present"] = {0, 1};
  EXPECT_EQ(Parse().grad_input_slots, (std::vector<size_t>{1}));
}

TEST_F(BackwardTest, TensorsAfterConstants) {
  a.strings["output_convention"] = "ccdd";
  EXPECT_EQ(Parse().output_positions, (std::vector<size_t>{2, 3}));
}

TEST_F(BackwardTest, RejectsMissingFuncName) {
  a.Erase("func_name");
  EXPECT_TRUE(Fails("func_name", "missing"));
}

TEST_F(BackwardTest, RejectsEmptyFuncName) {
  a.strings["func_name"] = "";
  EXPECT_TRUE(Fails("func_name", "must not be empty"));
}

TEST_F(BackwardTest, RejectsMissingOutputConvention) {
  a.Erase("output_convention");
  EXPECT_TRUE(Fails("output_convention", "missing"));
}

TEST_F(BackwardTest, RejectsUnknownConventionChar) {
  a.strings["output_convention"] = "dxd";
  EXPECT_TRUE(Fails("output_convention", "unknown argument kind 'x'"));
}

TEST_F(BackwardTest, RejectsSafeRunMode) {
  a.ints["safe_run_mode"] = 0;
  EXPECT_TRUE(Fails("safe_run_mode", "supported only for PythonOp with training_mode=0"));
  a.ints["safe_run_mode"] = 3;
  EXPECT_TRUE(Fails("safe_run_mode", "must be 0 or 1"));
}

TEST_F(BackwardTest, RejectsNodeWithoutContextInput) {
  inputs = 0;
  EXPECT_TRUE(Fails("input_tensor_types", "needs input 0, the context id"));
}

TEST_F(BackwardTest, RejectsMissingInputTensorTypes) {
  a.Erase("input_tensor_types");
  EXPECT_TRUE(Fails("input_tensor_types", "missing"));
}

TEST_F(BackwardTest, RejectsUnsupportedInputType) {
  a.int_lists["input_tensor_types"] = {1, 8};
  EXPECT_TRUE(Fails("input_tensor_types", "ONNX type 8"));
}

TEST_F(BackwardTest, RejectsInputRanksWrongLength) {
  a.int_lists["input_tensor_ranks"] = {1};
  EXPECT_TRUE(Fails("input_tensor_ranks", "has 1 entry, expected 2"));
}

TEST_F(BackwardTest, RejectsTensorCountNotMatchingOutputs) {
  outputs = 3;
  EXPECT_TRUE(Fails("output_convention", "has 2 entries, expected 3"));
  outputs = 1;
  EXPECT_TRUE(Fails("output_convention", "has 2 entries, expected 1"));
}

TEST_F(BackwardTest, RejectsPresentMaskWrongLength) {
  a.int_lists["input_tensor_present"] = {1};
  EXPECT_TRUE(Fails("input_tensor_present", "has 1 entry, expected 2"));
}

TEST_F(BackwardTest, RejectsPresentMaskNotBool) {
  for (int64_t v : {2, -1}) {
    a.int_lists["input_tensor_present"] = {1, v};
    EXPECT_TRUE(Fails("input_tensor_present", "0 or 1")) << v;
  }
}

TEST_F(BackwardTest, RejectsPresentCountNotMatchingInputs) {
  inputs = 3;  // two gradient inputs, one present slot
  EXPECT_TRUE(Fails("input_tensor_present", "marks 1 gradients present, but the node has 2 inputs"));
  a.int_lists["input_tensor_present"] = {1, 1};
  inputs = 2;
  EXPECT_TRUE(Fails("input_tensor_present", "marks 2 gradients present, but the node has 1 inputs"));
}

TEST_F(BackwardTest, RejectsMissingOutputTensorTypes) {
  a.Erase("output_tensor_types");
  EXPECT_TRUE(Fails("output_tensor_types", "missing"));
}

TEST_F(BackwardTest, RejectsOutputTypesWrongLength) {
  a.int_lists["output_tensor_types"] = {1};
  EXPECT_TRUE(Fails("output_tensor_types", "has 1 entry, expected 2"));
}

TEST_F(BackwardTest, RejectsUnsupportedOutputType) {
  a.int_lists["output_tensor_types"] = {1, 0};
  EXPECT_TRUE(Fails("output_tensor_types", "ONNX type 0"));
}

TEST_F(BackwardTest, RejectsMissingOutputTensorRanks) {
  a.Erase("output_tensor_ranks");
  EXPECT_TRUE(Fails("output_tensor_ranks", "missing"));
}

TEST_F(BackwardTest, RejectsOutputRanksWrongLengthOrNegative) {
  a.int_lists["output_tensor_ranks"] = {2};
  EXPECT_TRUE(Fails("output_tensor_ranks", "has 1 entry, expected 2"));
  a.int_lists["output_tensor_ranks"] = {2, -1};
  EXPECT_TRUE(Fails("output_tensor_ranks", "rank -1"));
}

TEST_F(BackwardTest, RejectsMissingRequiresGrads) {
  a.Erase("output_tensor_requires_grads");
  EXPECT_TRUE(Fails("output_tensor_requires_grads", "missing"));
}

TEST_F(BackwardTest, RejectsRequiresGradsWrongLength) {
  a.int_lists["output_tensor_requires_grads"] = {1, 0, 1};
  EXPECT_TRUE(Fails("output_tensor_requires_grads", "has 3 entries, expected 2"));
}

TEST_F(BackwardTest, RejectsRequiresGradsNotBool) {
  for (int64_t v : {2, -1}) {
    a.int_lists["output_tensor_requires_grads"] = {1, v};
    EXPECT_TRUE(Fails("output_tensor_requires_grads", "0 or 1")) << v;
  }
}

// ---------------------------------------------------------------------------------------------

TEST(ElementTypes, SupportedSet) {
  EXPECT_FALSE(IsSupportedElementType(0));
  EXPECT_FALSE(IsSupportedElementType(8));
  EXPECT_FALSE(IsSupportedElementType(17));  // float8 and later
  EXPECT_TRUE(IsSupportedElementType(1));
  EXPECT_TRUE(IsSupportedElementType(9));
  EXPECT_TRUE(IsSupportedElementType(16));
  EXPECT_STREQ(ElementTypeName(1), "float32");
  EXPECT_STREQ(ElementTypeName(11), "float64");
  EXPECT_STREQ(ElementTypeName(16), "bfloat16");
  EXPECT_STREQ(ElementTypeName(17), "unsupported");
  EXPECT_STREQ(ElementTypeName(-1), "unsupported");
  EXPECT_EQ(ElementSize(ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE), 8u);
  EXPECT_FALSE(
      IsSupportedElementType(ONNX_TENSOR_ELEMENT_DATA_TYPE_COMPLEX64));  // ORT refuses it for custom ops
  EXPECT_EQ(ElementSize(ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING), 0u);
}

// ---------------------------------------------------------------------------------------------
// Hostile values: bounded ranks, names that must reach Python, bytes in error texts

TEST_F(ForwardTest, RejectsRanksBeyondTheBound) {
  for (int64_t rank : {kMaxRank + 1, int64_t{10000000}, int64_t{1} << 62}) {
    a.int_lists["output_tensor_ranks"] = {rank};
    EXPECT_TRUE(Fails("output_tensor_ranks", "rank " + std::to_string(rank) + " is not valid")) << rank;
    a.int_lists["output_tensor_ranks"] = {1};
    a.int_lists["input_tensor_ranks"] = {rank};
    EXPECT_TRUE(Fails("input_tensor_ranks", "is not valid")) << rank;
    a.Erase("input_tensor_ranks");
  }
  a.int_lists["output_tensor_ranks"] = {kMaxRank};
  EXPECT_EQ(Parse().output_tensor_ranks, (std::vector<int64_t>{kMaxRank}));
}

TEST_F(ForwardTest, RejectsMoreOutputDimensionsThanTheBound) {
  const int64_t outputs_of_max_rank = kMaxOutputDims / kMaxRank;
  a.int_lists["output_tensor_types"] = std::vector<int64_t>(outputs_of_max_rank + 1, 1);
  a.int_lists["output_tensor_ranks"] = std::vector<int64_t>(outputs_of_max_rank + 1, kMaxRank);
  outputs = outputs_of_max_rank + 2;
  EXPECT_TRUE(
      Fails("output_tensor_ranks", "at most " + std::to_string(kMaxOutputDims) + " are allowed per node"));
  a.int_lists["output_tensor_ranks"].back() = 0;  // exactly the bound
  EXPECT_NO_THROW(Parse());
  // Shape inference checks ranks no parse has seen: the sum must not overflow.
  EXPECT_TRUE(Rejects([] { CheckOutputDims("output_tensor_ranks", {3, INT64_MAX}); }, "output_tensor_ranks",
                      "rank 9223372036854775807 is not valid"));
}

TEST_F(ForwardTest, RejectsFunctionNamesThatAreNotUtf8) {
  a.strings["func_name"] = std::string("bad\xff\0name", 9);
  EXPECT_TRUE(Fails("func_name", "'bad\\xff\\x00name' is not valid UTF-8"));
}

TEST_F(ForwardTest, RejectsLiteralsThatAreNotUtf8) {
  UseConstantSlot();
  a.strings["input_literals"] = "[\"\xc3\x28\"]";  // an invalid two-byte sequence
  a.int_lists["input_literal_positions"] = {1};
  EXPECT_TRUE(Fails("input_literals", "not valid UTF-8"));
}

TEST_F(ForwardTest, EscapesConventionBytesInTheMessage) {
  a.strings["input_convention"] = "\x01";
  EXPECT_TRUE(Fails("input_convention", "unknown argument kind '\\x01'"));
}

TEST(Printable, KeepsUtf8AndEscapesTheRest) {
  EXPECT_EQ(Printable("plain.Name"), "plain.Name");
  EXPECT_EQ(Printable("gr\xc3\xbc\xc3\x9f \xe2\x82\xac \xf0\x9f\x98\x80"),
            "gr\xc3\xbc\xc3\x9f \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(Printable(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(Printable("\xff\n\x7f"), "\\xff\\x0a\\x7f");
  EXPECT_EQ(Printable("\xc0\xaf"), "\\xc0\\xaf");           // overlong
  EXPECT_EQ(Printable("\xed\xa0\x80"), "\\xed\\xa0\\x80");  // a surrogate
  EXPECT_EQ(Printable("\xe2\x82"), "\\xe2\\x82");           // truncated
  EXPECT_EQ(Printable(std::string(100000, 'f')), std::string(200, 'f') + "... (100000 bytes)");
}

TEST(IsValidUtf8, AllowsControlCharactersButNotNul) {
  EXPECT_TRUE(IsValidUtf8("tab\there\n"));
  EXPECT_TRUE(IsValidUtf8("\xe2\x82\xac"));
  EXPECT_FALSE(IsValidUtf8(std::string("a\0", 2)));
  EXPECT_FALSE(IsValidUtf8("\xff"));
}

}  // namespace
}  // namespace ortbridge
