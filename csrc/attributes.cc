#include "attributes.h"

#include <algorithm>
#include <cstring>

namespace ortbridge {
namespace {

[[noreturn]] void Fail(const std::string& attr, const std::string& what) {
  throw AttributeError("attribute '" + attr + "': " + what);
}

// After a typed getter failed: absent is fine (or an error when required), another type never is.
bool Absent(const AttributeSource& a, const char* name, const char* type, bool required) {
  if (a.Has(name)) Fail(name, std::string("has the wrong type; expected ") + type);
  if (required) Fail(name, std::string("required ") + type + " attribute is missing");
  return true;
}

// A string that names something in Python (a function, argument kinds): non-empty UTF-8.
std::string RequireString(const AttributeSource& a, const char* name) {
  std::string s;
  if (!a.GetString(name, &s)) Absent(a, name, "STRING", true);
  if (s.empty()) Fail(name, "must not be empty");
  if (!IsValidUtf8(s)) Fail(name, "'" + Printable(s) + "' is not valid UTF-8 (or holds a NUL character)");
  return s;
}

// Returns false when the attribute is absent.
bool OptionalInts(const AttributeSource& a, const char* name, std::vector<int64_t>* v) {
  return a.GetInts(name, v) || !Absent(a, name, "INTS", false);
}

std::vector<int64_t> Ints(const AttributeSource& a, const char* name, bool required) {
  std::vector<int64_t> v;
  if (!a.GetInts(name, &v)) Absent(a, name, "INTS", required);
  return v;
}

std::vector<float> Floats(const AttributeSource& a, const char* name) {
  std::vector<float> v;
  if (!a.GetFloats(name, &v)) Absent(a, name, "FLOATS", false);
  return v;
}

bool Flag(const AttributeSource& a, const char* name, int64_t default_value) {
  int64_t v = default_value;
  if (!a.GetInt(name, &v)) Absent(a, name, "INT", false);
  if (v != 0 && v != 1) Fail(name, "must be 0 or 1, got " + std::to_string(v));
  return v == 1;
}

std::string Entries(size_t n) { return std::to_string(n) + (n == 1 ? " entry" : " entries"); }

void CheckSize(const char* name, size_t got, size_t want, const std::string& of) {
  if (got != want) Fail(name, "has " + Entries(got) + ", expected " + std::to_string(want) + " (" + of + ")");
}

void CheckConvention(const char* name, const std::string& conv) {
  for (char c : conv) {
    if (c != 'c' && c != 'd') {
      Fail(name, "unknown argument kind '" + Printable(std::string(1, c)) + "' (only 'c' and 'd')");
    }
  }
}

void CheckTypes(const char* name, const std::vector<int64_t>& types) {
  for (size_t i = 0; i < types.size(); ++i) {
    if (!IsSupportedElementType(types[i])) {
      Fail(name, "entry " + std::to_string(i) + " is ONNX type " + std::to_string(types[i]) +
                     ", which cannot cross to torch (supported: numeric types and bool)");
    }
  }
}

// Output ranks are required (shape inference needs them); input ranks may be absent or -1
// (unknown), since the kernel reads the actual shape of every input.
std::vector<int64_t> Ranks(const AttributeSource& a, const char* name, size_t count, const std::string& of,
                           bool required) {
  std::vector<int64_t> r;
  if (!a.GetInts(name, &r)) {
    Absent(a, name, "INTS", required);
    return std::vector<int64_t>(count, -1);
  }
  CheckSize(name, r.size(), count, of);
  for (int64_t x : r) {
    if (x < (required ? 0 : -1) || x > kMaxRank) {
      Fail(name, "rank " + std::to_string(x) + " is not valid (at most " + std::to_string(kMaxRank) + ")");
    }
  }
  return r;
}

double FromBits(int64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// Claims argument slot `pos` for a constant; every 'c' slot is claimed exactly once.
void Claim(const char* name, int64_t pos, const std::string& conv, std::vector<bool>& taken) {
  if (pos < 0 || static_cast<size_t>(pos) >= conv.size()) {
    Fail(name, "position " + std::to_string(pos) + " is outside the " + std::to_string(conv.size()) +
                   " arguments of input_convention");
  }
  if (conv[pos] != 'c') Fail(name, "position " + std::to_string(pos) + " is a tensor ('d') argument");
  if (taken[pos]) Fail(name, "position " + std::to_string(pos) + " is given more than one constant");
  taken[pos] = true;
}

struct ScalarNames {
  const char* values;
  const char* positions;
  Constant::Kind kind;
};

void ReadIntScalars(const AttributeSource& a, const ScalarNames& n, const std::string& conv,
                    std::vector<bool>& taken, std::vector<Constant>& out) {
  auto values = Ints(a, n.values, false);
  auto positions = Ints(a, n.positions, false);
  CheckSize(n.positions, positions.size(), values.size(), std::string("one per value of ") + n.values);
  for (size_t i = 0; i < values.size(); ++i) {
    Claim(n.positions, positions[i], conv, taken);
    if (n.kind == Constant::Kind::kBool && values[i] != 0 && values[i] != 1) {
      Fail(n.values, "bool value " + std::to_string(values[i]) + " is not 0 or 1");
    }
    out.push_back({n.kind, static_cast<size_t>(positions[i]), {values[i]}, {}});
  }
}

void ReadFloatScalars(const AttributeSource& a, const std::string& conv, std::vector<bool>& taken,
                      std::vector<Constant>& out) {
  auto values = Floats(a, "input_float_scalars");
  auto positions = Ints(a, "input_float_scalar_positions", false);
  CheckSize("input_float_scalar_positions", positions.size(), values.size(),
            "one per value of input_float_scalars");
  std::vector<int64_t> exact;  // ortbridge extension: the float64 bit patterns, exact
  if (OptionalInts(a, "input_float_scalars_f64", &exact)) {
    CheckSize("input_float_scalars_f64", exact.size(), values.size(), "one per value of input_float_scalars");
  }
  for (size_t i = 0; i < values.size(); ++i) {
    Claim("input_float_scalar_positions", positions[i], conv, taken);
    double v = exact.empty() ? static_cast<double>(values[i]) : FromBits(exact[i]);
    out.push_back({Constant::Kind::kFloat, static_cast<size_t>(positions[i]), {}, {v}});
  }
}

// Tuples: all values concatenated, one position and one begin offset per tuple.
void ReadTuples(const AttributeSource& a, const char* values_name, const char* positions_name,
                const char* begins_name, Constant::Kind kind, const std::string& conv,
                std::vector<bool>& taken, std::vector<Constant>& out) {
  std::vector<int64_t> ints;
  std::vector<double> floats;
  size_t total;
  if (kind == Constant::Kind::kFloatTuple) {
    for (float f : Floats(a, values_name)) floats.push_back(f);
    std::vector<int64_t> exact;
    if (OptionalInts(a, "input_float_tuples_f64", &exact)) {
      CheckSize("input_float_tuples_f64", exact.size(), floats.size(), "one per value of input_float_tuples");
      for (size_t i = 0; i < exact.size(); ++i) floats[i] = FromBits(exact[i]);
    }
    total = floats.size();
  } else {
    ints = Ints(a, values_name, false);
    total = ints.size();
  }
  auto positions = Ints(a, positions_name, false);
  auto begins = Ints(a, begins_name, false);
  CheckSize(begins_name, begins.size(), positions.size(), std::string("one per tuple in ") + positions_name);
  for (size_t t = 0; t < positions.size(); ++t) {
    int64_t begin = begins[t];
    int64_t end = t + 1 < begins.size() ? begins[t + 1] : static_cast<int64_t>(total);
    if (begin < 0 || begin > end || end > static_cast<int64_t>(total) || (t == 0 && begin != 0)) {
      Fail(begins_name, "offsets must start at 0 and rise within the " + std::to_string(total) +
                            " values of " + values_name);
    }
    Claim(positions_name, positions[t], conv, taken);
    Constant c{kind, static_cast<size_t>(positions[t]), {}, {}};
    if (kind == Constant::Kind::kFloatTuple) {
      c.floats.assign(floats.begin() + begin, floats.begin() + end);
    } else {
      c.ints.assign(ints.begin() + begin, ints.begin() + end);
      if (kind == Constant::Kind::kBoolTuple) {
        for (int64_t v : c.ints) {
          if (v != 0 && v != 1) Fail(values_name, "bool value " + std::to_string(v) + " is not 0 or 1");
        }
      }
    }
    out.push_back(std::move(c));
  }
  if (positions.empty() && total != 0) Fail(values_name, "has values but no tuple positions");
}

// ortbridge extension: constants that ORT's typed attributes cannot hold (None, str, lists, mixed
// or nested tuples, ...) as one JSON list. Its entries are counted and decoded in Python.
void ReadLiterals(const AttributeSource& a, const std::string& conv, std::vector<bool>& taken,
                  ForwardLayout& f) {
  const char* name = "input_literals";
  bool has_text = a.GetString(name, &f.literals) || !Absent(a, name, "STRING", false);
  if (has_text && !IsValidUtf8(f.literals)) Fail(name, "is not valid UTF-8 (or holds a NUL character)");
  auto positions = Ints(a, "input_literal_positions", false);
  if (has_text != !positions.empty()) {
    Fail(has_text ? "input_literal_positions" : name,
         "input_literals and input_literal_positions must be given together");
  }
  for (size_t i = 0; i < positions.size(); ++i) {
    Claim("input_literal_positions", positions[i], conv, taken);
    f.constants.push_back(
        {Constant::Kind::kLiteral, static_cast<size_t>(positions[i]), {static_cast<int64_t>(i)}, {}});
  }
}

// Input side: argument kinds, tensor input types and ranks, which tensors require a gradient.
void ReadForwardInputs(const AttributeSource& a, size_t input_count, ForwardLayout& f) {
  const std::string& conv = f.input_convention;
  size_t tensors = std::count(conv.begin(), conv.end(), 'd');
  CheckSize("input_convention", tensors, input_count, "its 'd' entries must match the node's tensor inputs");

  f.input_tensor_types = Ints(a, "input_tensor_types", input_count > 0);  // may be left off with no inputs
  CheckSize("input_tensor_types", f.input_tensor_types.size(), input_count, "one per tensor input");
  CheckTypes("input_tensor_types", f.input_tensor_types);
  f.input_tensor_ranks = Ranks(a, "input_tensor_ranks", input_count, "one per tensor input", false);

  std::vector<int64_t> rg;
  if (OptionalInts(a, "input_requires_grads", &rg)) {
    CheckSize("input_requires_grads", rg.size(), conv.size(), "one per argument in input_convention");
  } else {
    rg.assign(conv.size(), 0);
  }
  for (size_t i = 0; i < conv.size(); ++i) {
    if (rg[i] != 0 && rg[i] != 1) Fail("input_requires_grads", "entries must be 0 or 1");
    if (rg[i] == 1 && conv[i] == 'c') {
      Fail("input_requires_grads",
           "entry " + std::to_string(i) + " is 1, but argument " + std::to_string(i) + " is a constant");
    }
    if (conv[i] == 'd') {
      f.tensor_positions.push_back(i);
      f.requires_grad.push_back(rg[i] == 1);
    }
  }
}

// Every 'c' argument gets exactly one value from the typed constant attributes or the literals.
void ReadConstants(const AttributeSource& a, ForwardLayout& f) {
  const std::string& conv = f.input_convention;
  std::vector<bool> taken(conv.size(), false);
  ReadIntScalars(a, {"input_bool_scalars", "input_bool_scalar_positions", Constant::Kind::kBool}, conv, taken,
                 f.constants);
  ReadIntScalars(a, {"input_int_scalars", "input_int_scalar_positions", Constant::Kind::kInt}, conv, taken,
                 f.constants);
  ReadIntScalars(a, {"input_pointer_scalars", "input_pointer_scalar_positions", Constant::Kind::kObject},
                 conv, taken, f.constants);
  ReadFloatScalars(a, conv, taken, f.constants);
  ReadTuples(a, "input_bool_tuples", "input_bool_tuple_positions", "input_bool_tuple_begins",
             Constant::Kind::kBoolTuple, conv, taken, f.constants);
  ReadTuples(a, "input_int_tuples", "input_int_tuple_positions", "input_int_tuple_begins",
             Constant::Kind::kIntTuple, conv, taken, f.constants);
  ReadTuples(a, "input_float_tuples", "input_float_tuple_positions", "input_float_tuple_begins",
             Constant::Kind::kFloatTuple, conv, taken, f.constants);
  ReadLiterals(a, conv, taken, f);
  for (size_t i = 0; i < conv.size(); ++i) {
    if (conv[i] == 'c' && !taken[i]) {
      Fail("input_convention", "constant argument " + std::to_string(i) +
                                   " has no value in any input_*_scalars, "
                                   "input_*_tuples or input_literal_positions attribute");
    }
  }
  std::sort(f.constants.begin(), f.constants.end(),
            [](const Constant& x, const Constant& y) { return x.position < y.position; });
}

// tensor_reuse_map entries j -> i whose types agree: output j is input i updated in place.
void ReadReuseMap(const AttributeSource& a, size_t input_count, size_t output_count, ForwardLayout& f) {
  std::vector<int64_t> reuse;
  if (!OptionalInts(a, "tensor_reuse_map", &reuse)) return;
  CheckSize("tensor_reuse_map", reuse.size(), output_count, "one per node output, context id included");
  if (reuse[0] != -1) Fail("tensor_reuse_map", "entry 0 (the context id) must be -1");
  std::vector<bool> taken(input_count, false);
  for (size_t j = 0; j < reuse.size(); ++j) {
    int64_t i = reuse[j];
    if (i < -1 || i >= static_cast<int64_t>(input_count)) {
      Fail("tensor_reuse_map", "entry is not -1 or a tensor input index");
    }
    // ORTModule also maps outputs that view an input under another type: those are not in place.
    if (i >= 0 && !taken[i] && f.output_tensor_types[j - 1] == f.input_tensor_types[i]) {
      taken[i] = true;
      f.in_place.emplace_back(j, static_cast<size_t>(i));
    }
  }
}

// output_tensor_dims: one entry per output dim; a reference to an input dim needs the input ranks.
void ReadOutputDims(const AttributeSource& a, ForwardLayout& f) {
  if (!OptionalInts(a, "output_tensor_dims", &f.output_tensor_dims)) return;
  size_t dims = 0;
  for (int64_t r : f.output_tensor_ranks) dims += static_cast<size_t>(r);
  CheckSize("output_tensor_dims", f.output_tensor_dims.size(), dims,
            "one per dim of the outputs after the context id");
  int64_t input_dims = 0;
  for (int64_t r : f.input_tensor_ranks) {
    if (r < 0) {
      input_dims = -1;  // (unknown ranks: no dim can be referred to)
      break;
    }
    input_dims += r;
  }
  for (int64_t d : f.output_tensor_dims) {
    if (d < -1 && d <= -2 - input_dims) {  // (as -2 - d >= input_dims, without overflow)
      Fail("output_tensor_dims", "entry " + std::to_string(d) + " refers to no dim of the tensor inputs (" +
                                     std::to_string(std::max<int64_t>(input_dims, 0)) +
                                     " dims of known rank)");
    }
  }
}

}  // namespace

ForwardLayout ParseForward(const AttributeSource& a, size_t input_count, size_t output_count) {
  ForwardLayout f;
  f.func_name = RequireString(a, "func_name");
  f.input_convention = RequireString(a, "input_convention");
  CheckConvention("input_convention", f.input_convention);
  f.training_mode = Flag(a, "training_mode", 0);
  f.safe_run_mode = Flag(a, "safe_run_mode", 1);
  if (f.training_mode && !f.safe_run_mode) {
    Fail("safe_run_mode", "0 (forward without autograd) is supported only with training_mode=0");
  }
  // The last `ordering_inputs` inputs only order the node after the nodes that make them (never read).
  int64_t ordering = 0;
  if (!a.GetInt("ordering_inputs", &ordering)) Absent(a, "ordering_inputs", "INT", false);
  if (ordering < 0 || ordering > static_cast<int64_t>(input_count)) {
    Fail("ordering_inputs", "must be between 0 and the node's input count (" + std::to_string(input_count) +
                                "), got " + std::to_string(ordering));
  }
  f.ordering_inputs = static_cast<size_t>(ordering);
  const size_t tensor_inputs = input_count - f.ordering_inputs;
  ReadForwardInputs(a, tensor_inputs, f);
  ReadConstants(a, f);

  if (output_count < 1) Fail("output_tensor_types", "the node needs output 0, the context id");
  f.output_tensor_types = Ints(a, "output_tensor_types", true);
  CheckSize("output_tensor_types", f.output_tensor_types.size(), output_count - 1,
            "one per node output after the context id");
  CheckTypes("output_tensor_types", f.output_tensor_types);
  f.output_tensor_ranks =
      Ranks(a, "output_tensor_ranks", output_count - 1, "one per node output after the context id", true);
  CheckOutputDims("output_tensor_ranks", f.output_tensor_ranks);
  ReadReuseMap(a, tensor_inputs, output_count, f);
  ReadOutputDims(a, f);
  return f;
}

BackwardLayout ParseBackward(const AttributeSource& a, size_t input_count, size_t output_count) {
  BackwardLayout b;
  b.func_name = RequireString(a, "func_name");
  b.output_convention = RequireString(a, "output_convention");
  CheckConvention("output_convention", b.output_convention);
  if (!Flag(a, "safe_run_mode", 1)) {
    Fail("safe_run_mode", "0 (forward without autograd) is supported only for PythonOp with training_mode=0");
  }
  if (input_count < 1) Fail("input_tensor_types", "the node needs input 0, the context id");

  // One type per forward output. ORT's format leaves an empty input name where a gradient is
  // absent, which the custom-op API cannot express; ortbridge lists only the present gradients
  // and marks them in input_tensor_present (default: all present).
  b.input_tensor_types = Ints(a, "input_tensor_types", true);
  CheckTypes("input_tensor_types", b.input_tensor_types);
  const size_t slots = b.input_tensor_types.size();
  b.input_tensor_ranks = Ranks(a, "input_tensor_ranks", slots, "one per entry of input_tensor_types", false);
  std::vector<int64_t> present;
  if (OptionalInts(a, "input_tensor_present", &present)) {
    CheckSize("input_tensor_present", present.size(), slots, "one per entry of input_tensor_types");
  } else {
    present.assign(slots, 1);
  }
  for (size_t i = 0; i < slots; ++i) {
    if (present[i] != 0 && present[i] != 1) Fail("input_tensor_present", "entries must be 0 or 1");
    if (present[i]) b.grad_input_slots.push_back(i);
  }
  if (b.grad_input_slots.size() != input_count - 1) {
    Fail("input_tensor_present", "marks " + std::to_string(b.grad_input_slots.size()) +
                                     " gradients present, but the node has " +
                                     std::to_string(input_count - 1) + " inputs after the context id");
  }

  const std::string& conv = b.output_convention;
  for (size_t i = 0; i < conv.size(); ++i) {
    if (conv[i] == 'd') b.output_positions.push_back(i);
  }
  CheckSize("output_convention", b.output_positions.size(), output_count,
            "its 'd' entries must match the node's gradient outputs");
  b.output_tensor_types = Ints(a, "output_tensor_types", true);
  CheckSize("output_tensor_types", b.output_tensor_types.size(), output_count, "one per gradient output");
  CheckTypes("output_tensor_types", b.output_tensor_types);
  b.output_tensor_ranks = Ranks(a, "output_tensor_ranks", output_count, "one per gradient output", true);
  CheckOutputDims("output_tensor_ranks", b.output_tensor_ranks);
  auto rg = Ints(a, "output_tensor_requires_grads", true);
  CheckSize("output_tensor_requires_grads", rg.size(), output_count, "one per gradient output");
  for (int64_t r : rg) {
    if (r != 0 && r != 1) Fail("output_tensor_requires_grads", "entries must be 0 or 1");
    b.output_requires_grad.push_back(r == 1);
  }
  return b;
}

void CheckOutputDims(const char* attribute, const std::vector<int64_t>& ranks) {
  int64_t dims = 0;
  for (int64_t r : ranks) {
    if (r > kMaxRank) {
      Fail(attribute,
           "rank " + std::to_string(r) + " is not valid (at most " + std::to_string(kMaxRank) + ")");
    }
    dims += r > 0 ? r : 0;  // (shape inference calls this on ranks nothing checked before)
  }
  if (dims > kMaxOutputDims) {
    Fail(attribute, "the outputs have " + std::to_string(dims) + " dimensions in all; at most " +
                        std::to_string(kMaxOutputDims) + " are allowed per node");
  }
}

}  // namespace ortbridge
