// libFuzzer target for the attribute parser (csrc/attributes.cc), built by -DORTBRIDGE_FUZZ=ON and
// run by scripts/fuzz_parser.sh. The input bytes are decoded into a node: which parser, its input
// and output counts, and a list of typed attributes (the real names of both ops, or random ones).
// A malformed node must end in AttributeError; any other exception, a crash, a sanitizer report
// or a layout that breaks the invariants below is a finding.
//
// `attributes_fuzzer --write-seeds=DIR` writes a few valid nodes, encoded, as a starting corpus.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <set>
#include <string>
#include <typeinfo>
#include <vector>

#include "attribute_map.h"
#include "attributes.h"

namespace ortbridge {
namespace {

// The attributes of PythonOp and PythonOpGrad (docs/node_format.md).
const char* const kNames[] = {
    "func_name",
    "call_index",
    "input_convention",
    "output_convention",
    "training_mode",
    "safe_run_mode",
    "input_tensor_types",
    "input_tensor_ranks",
    "input_requires_grads",
    "input_tensor_present",
    "input_bool_scalars",
    "input_bool_scalar_positions",
    "input_int_scalars",
    "input_int_scalar_positions",
    "input_float_scalars",
    "input_float_scalar_positions",
    "input_float_scalars_f64",
    "input_pointer_scalars",
    "input_pointer_scalar_positions",
    "input_bool_tuples",
    "input_bool_tuple_positions",
    "input_bool_tuple_begins",
    "input_int_tuples",
    "input_int_tuple_positions",
    "input_int_tuple_begins",
    "input_float_tuples",
    "input_float_tuple_positions",
    "input_float_tuple_begins",
    "input_float_tuples_f64",
    "input_literals",
    "input_literal_positions",
    "output_tensor_types",
    "output_tensor_ranks",
    "output_tensor_requires_grads",
    "tensor_reuse_map",
};
constexpr size_t kNameCount = sizeof kNames / sizeof kNames[0];
constexpr uint8_t kRandomName = 0xE0;  // name bytes from here on: a random name follows

// Values the parser compares against: limits, sign and width boundaries.
const int64_t kSpecialInts[] = {
    std::numeric_limits<int64_t>::min(),
    std::numeric_limits<int64_t>::max(),
    -1,
    0,
    std::numeric_limits<int32_t>::min(),
    std::numeric_limits<int32_t>::max(),
    int64_t{1} << 32,
    (int64_t{1} << 32) - 1,
    int64_t{1} << 31,
    255,
    256,
    65535,
    65536,
    kMaxRank,
    kMaxRank + 1,
};
const size_t kSpecialCounts[] = {
    0,
    1,
    2,
    std::numeric_limits<size_t>::max(),
    std::numeric_limits<size_t>::max() - 1,
    size_t{1} << 32,
    size_t{1} << 31,
    255,
    256,
    65536,
};
const float kSpecialFloats[] = {
    std::numeric_limits<float>::quiet_NaN(),
    std::numeric_limits<float>::infinity(),
    -std::numeric_limits<float>::infinity(),
    -0.0f,
    std::numeric_limits<float>::max(),
    std::numeric_limits<float>::denorm_min(),
    1e-30f,
    0.1f,
};

enum Type : uint8_t { kInt = 0, kInts = 1, kFloats = 2, kString = 3 };
constexpr uint8_t kConventionBits = 4;  // with kString: the string is 'c'/'d' bits

struct Node {
  bool backward = false;
  size_t inputs = 0;
  size_t outputs = 0;
  MapAttributes attrs;
};

// Total decoder: past the end every byte reads as 0, so any input is a node.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool Done() const { return pos_ >= size_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  template <class T>
  T Raw() {
    uint8_t bytes[sizeof(T)];
    for (uint8_t& b : bytes) b = Byte();
    T v;
    std::memcpy(&v, bytes, sizeof v);
    return v;
  }
  size_t Count() {
    uint8_t b = Byte();
    return b < 0xF0 ? b % 16
                    : kSpecialCounts[(b - 0xF0) % (sizeof kSpecialCounts / sizeof kSpecialCounts[0])];
  }
  int64_t Int() {
    uint8_t b = Byte();
    if (b < 0x80) return int64_t{b} - 8;
    if (b < 0xC0) return kSpecialInts[(b - 0x80) % (sizeof kSpecialInts / sizeof kSpecialInts[0])];
    return Raw<int64_t>();
  }
  float Float() {
    uint8_t b = Byte();
    if (b < 0x80) return static_cast<float>(int{b} - 16);
    if (b < 0xC0) return kSpecialFloats[(b - 0x80) % (sizeof kSpecialFloats / sizeof kSpecialFloats[0])];
    return Raw<float>();
  }
  std::string Bytes(size_t n) {
    std::string s;
    for (size_t i = 0; i < n; ++i) s.push_back(static_cast<char>(Byte()));
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// Byte layout: flags (bit 0: PythonOpGrad), input count, output count, then attributes until the
// input ends: name (index into kNames, or kRandomName.. + length + bytes), type byte, value.
Node Decode(const uint8_t* data, size_t size) {
  Reader r(data, size);
  Node node;
  node.backward = r.Byte() & 1;
  node.inputs = r.Count();
  node.outputs = r.Count();
  while (!r.Done()) {
    uint8_t n = r.Byte();
    std::string name = n < kRandomName ? kNames[n % kNameCount] : r.Bytes(r.Byte() % 32);
    uint8_t type = r.Byte();
    switch (type % 4) {
      case kInt:
        node.attrs.ints[name] = r.Int();
        break;
      case kInts: {
        std::vector<int64_t> v(r.Byte());
        for (int64_t& x : v) x = r.Int();
        node.attrs.int_lists[name] = v;
        break;
      }
      case kFloats: {
        std::vector<float> v(r.Byte());
        for (float& x : v) x = r.Float();
        node.attrs.float_lists[name] = v;
        break;
      }
      case kString: {
        size_t length = r.Byte();
        std::string s;
        if (type & kConventionBits) {
          for (size_t i = 0; i < length; i += 8) {
            uint8_t bits = r.Byte();
            for (size_t k = i; k < length && k < i + 8; ++k) s.push_back((bits >> (k - i)) & 1 ? 'd' : 'c');
          }
        } else {
          s = r.Bytes(length);
        }
        node.attrs.strings[name] = s;
        break;
      }
    }
  }
  return node;
}

// The inverse of Decode, for the seeds (lists and strings of up to 255 entries).
class Writer {
 public:
  std::vector<uint8_t> bytes;

  Writer(bool backward, size_t inputs, size_t outputs) {
    bytes.push_back(backward);
    Count(inputs);
    Count(outputs);
  }
  void Add(const MapAttributes& a) {
    for (const auto& [name, v] : a.ints) {
      Name(name, kInt);
      Int(v);
    }
    for (const auto& [name, v] : a.int_lists) {
      Name(name, kInts);
      Length(v.size());
      for (int64_t x : v) Int(x);
    }
    for (const auto& [name, v] : a.float_lists) {
      Name(name, kFloats);
      Length(v.size());
      for (float x : v) Float(x);
    }
    for (const auto& [name, s] : a.strings) {
      bool convention = !s.empty() && s.find_first_not_of("cd") == std::string::npos;
      Name(name, convention ? kString | kConventionBits : kString);
      Length(s.size());
      if (convention) {
        for (size_t i = 0; i < s.size(); i += 8) {
          uint8_t bits = 0;
          for (size_t k = i; k < s.size() && k < i + 8; ++k) bits |= (s[k] == 'd') << (k - i);
          bytes.push_back(bits);
        }
      } else {
        bytes.insert(bytes.end(), s.begin(), s.end());
      }
    }
  }

 private:
  void Count(size_t n) {
    if (n >= 16) std::abort();  // seeds use small counts
    bytes.push_back(static_cast<uint8_t>(n));
  }
  void Length(size_t n) {
    if (n > 255) std::abort();
    bytes.push_back(static_cast<uint8_t>(n));
  }
  void Name(const std::string& name, uint8_t type) {
    size_t i = 0;
    while (i < kNameCount && name != kNames[i]) ++i;
    if (i < kNameCount) {
      bytes.push_back(static_cast<uint8_t>(i));
    } else {
      bytes.push_back(kRandomName);
      Length(name.size());
      bytes.insert(bytes.end(), name.begin(), name.end());
    }
    bytes.push_back(type);
  }
  void Raw(const void* p, size_t n) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  }
  void Int(int64_t v) {
    if (v >= -8 && v < 0x80 - 8) {
      bytes.push_back(static_cast<uint8_t>(v + 8));
    } else {
      bytes.push_back(0xFF);
      Raw(&v, sizeof v);
    }
  }
  void Float(float v) {
    if (v == std::floor(v) && v >= -16 && v < 0x80 - 16 && !(v == 0 && std::signbit(v))) {
      bytes.push_back(static_cast<uint8_t>(static_cast<int>(v) + 16));
    } else {
      bytes.push_back(0xFF);
      Raw(&v, sizeof v);
    }
  }
};

[[noreturn]] void Finding(const char* what) {
  std::fprintf(stderr, "attributes_fuzzer: invariant broken: %s\n", what);
  std::abort();
}
#define EXPECT(cond)             \
  do {                           \
    if (!(cond)) Finding(#cond); \
  } while (0)

bool StrictlyIncreasing(const std::vector<size_t>& v) {
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i - 1] >= v[i]) return false;
  }
  return true;
}

bool AllSupported(const std::vector<int64_t>& types) {
  for (int64_t t : types) {
    if (!IsSupportedElementType(t)) return false;
  }
  return true;
}

bool RanksValid(const std::vector<int64_t>& ranks, int64_t lowest) {
  for (int64_t r : ranks) {
    if (r < lowest || r > kMaxRank) return false;
  }
  return true;
}

bool IsBool(int64_t v) { return v == 0 || v == 1; }

std::vector<size_t> Slots(const std::string& convention, char kind) {
  std::vector<size_t> slots;
  for (size_t i = 0; i < convention.size(); ++i) {
    if (convention[i] == kind) slots.push_back(i);
  }
  return slots;
}

void CheckForward(const ForwardLayout& f, size_t inputs, size_t outputs) {
  const std::string& conv = f.input_convention;
  EXPECT(!f.func_name.empty() && IsValidUtf8(f.func_name));
  EXPECT(!conv.empty() && conv.find_first_not_of("cd") == std::string::npos);
  EXPECT(!f.training_mode || f.safe_run_mode);

  // Tensor inputs: one per 'd' slot, in argument order.
  EXPECT(f.tensor_positions == Slots(conv, 'd'));
  EXPECT(f.tensor_positions.size() == inputs);
  EXPECT(StrictlyIncreasing(f.tensor_positions));
  EXPECT(f.requires_grad.size() == inputs);
  EXPECT(f.input_tensor_types.size() == inputs && AllSupported(f.input_tensor_types));
  EXPECT(f.input_tensor_ranks.size() == inputs && RanksValid(f.input_tensor_ranks, -1));

  // Constants: every 'c' slot exactly once, sorted, with a value of their kind.
  std::vector<size_t> positions;
  size_t literals = 0;
  for (const Constant& c : f.constants) {
    EXPECT(c.position < conv.size());
    EXPECT(conv[c.position] == 'c');
    positions.push_back(c.position);
    switch (c.kind) {
      case Constant::Kind::kBool:
        EXPECT(c.ints.size() == 1 && IsBool(c.ints[0]) && c.floats.empty());
        break;
      case Constant::Kind::kInt:
      case Constant::Kind::kObject:
        EXPECT(c.ints.size() == 1 && c.floats.empty());
        break;
      case Constant::Kind::kFloat:
        EXPECT(c.floats.size() == 1 && c.ints.empty());
        break;
      case Constant::Kind::kBoolTuple:
        for (int64_t v : c.ints) EXPECT(IsBool(v));
        EXPECT(c.floats.empty());
        break;
      case Constant::Kind::kIntTuple:
        EXPECT(c.floats.empty());
        break;
      case Constant::Kind::kFloatTuple:
        EXPECT(c.ints.empty());
        break;
      case Constant::Kind::kLiteral:
        EXPECT(c.ints.size() == 1 && c.floats.empty());
        ++literals;
        break;
      default:
        Finding("unknown constant kind");
    }
  }
  EXPECT(StrictlyIncreasing(positions));
  EXPECT(positions == Slots(conv, 'c'));
  // Literal indices: 0..n-1, each once (in position order they need not rise).
  std::set<int64_t> literal_indices;
  for (const Constant& c : f.constants) {
    if (c.kind == Constant::Kind::kLiteral) {
      EXPECT(c.ints[0] >= 0 && static_cast<size_t>(c.ints[0]) < literals);
      literal_indices.insert(c.ints[0]);
    }
  }
  EXPECT(literal_indices.size() == literals);
  EXPECT(literals == 0 || IsValidUtf8(f.literals));

  // Outputs after the context id, and the in-place pairs among them.
  EXPECT(outputs >= 1);
  EXPECT(f.output_tensor_types.size() == outputs - 1 && AllSupported(f.output_tensor_types));
  EXPECT(f.output_tensor_ranks.size() == outputs - 1 && RanksValid(f.output_tensor_ranks, 0));
  std::set<size_t> updated;
  size_t last_output = 0;
  for (const auto& [j, i] : f.in_place) {
    EXPECT(j >= 1 && j < outputs && j > last_output);
    EXPECT(i < inputs);
    EXPECT(updated.insert(i).second);
    EXPECT(f.output_tensor_types[j - 1] == f.input_tensor_types[i]);
    last_output = j;
  }
}

void CheckBackward(const BackwardLayout& b, size_t inputs, size_t outputs) {
  const std::string& conv = b.output_convention;
  EXPECT(!b.func_name.empty() && IsValidUtf8(b.func_name));
  EXPECT(!conv.empty() && conv.find_first_not_of("cd") == std::string::npos);

  // Gradient inputs: the present ones among the forward outputs, after the context id.
  const size_t slots = b.input_tensor_types.size();
  EXPECT(AllSupported(b.input_tensor_types));
  EXPECT(b.input_tensor_ranks.size() == slots && RanksValid(b.input_tensor_ranks, -1));
  EXPECT(inputs >= 1 && b.grad_input_slots.size() == inputs - 1);
  EXPECT(StrictlyIncreasing(b.grad_input_slots));
  for (size_t s : b.grad_input_slots) EXPECT(s < slots);

  // Gradient outputs: one per 'd' of the forward arguments.
  EXPECT(b.output_positions == Slots(conv, 'd'));
  EXPECT(b.output_positions.size() == outputs);
  EXPECT(b.output_tensor_types.size() == outputs && AllSupported(b.output_tensor_types));
  EXPECT(b.output_tensor_ranks.size() == outputs && RanksValid(b.output_tensor_ranks, 0));
  EXPECT(b.output_requires_grad.size() == outputs);
}

// An AttributeError names the attribute at fault: "attribute 'NAME': ...".
void CheckError(const AttributeError& e) {
  const std::string message = e.what();
  const std::string prefix = "attribute '";
  EXPECT(message.compare(0, prefix.size(), prefix) == 0);
  size_t end = message.find("': ", prefix.size());
  EXPECT(end != std::string::npos && end > prefix.size());
}

void Run(const Node& node) {
  try {
    if (node.backward) {
      CheckBackward(ParseBackward(node.attrs, node.inputs, node.outputs), node.inputs, node.outputs);
    } else {
      CheckForward(ParseForward(node.attrs, node.inputs, node.outputs), node.inputs, node.outputs);
    }
  } catch (const AttributeError& e) {
    CheckError(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attributes_fuzzer: %s escaped the parser: %s\n", typeid(e).name(), e.what());
    std::abort();
  } catch (...) {
    Finding("a non-std exception escaped the parser");
  }
}

int64_t Bits(double d) {
  int64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  return bits;
}

// A few valid nodes; each must parse, which also checks Writer against Decode.
std::vector<Node> Seeds() {
  std::vector<Node> seeds;
  Node n;  // y = f(x)
  n.inputs = 1;
  n.outputs = 2;
  n.attrs.strings = {{"func_name", "test.Fn"}, {"input_convention", "d"}};
  n.attrs.int_lists = {
      {"input_tensor_types", {1}}, {"output_tensor_types", {1}}, {"output_tensor_ranks", {1}}};
  seeds.push_back(n);

  n = Node();  // every kind of constant, training, in place
  n.inputs = 2;
  n.outputs = 3;
  n.attrs.strings = {
      {"func_name", "test.All"}, {"input_convention", "dccccccccdc"}, {"input_literals", "[null]"}};
  n.attrs.ints = {{"training_mode", 1}, {"call_index", 3}};
  n.attrs.int_lists = {
      {"input_tensor_types", {1, 7}},
      {"input_tensor_ranks", {2, -1}},
      {"input_requires_grads", {1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
      {"input_bool_scalars", {1}},
      {"input_bool_scalar_positions", {1}},
      {"input_int_scalars", {-42}},
      {"input_int_scalar_positions", {2}},
      {"input_float_scalar_positions", {3}},
      {"input_float_scalars_f64", {Bits(0.1)}},
      {"input_pointer_scalars", {12345}},
      {"input_pointer_scalar_positions", {4}},
      {"input_bool_tuples", {1, 0, 1}},
      {"input_bool_tuple_positions", {5}},
      {"input_bool_tuple_begins", {0}},
      {"input_int_tuples", {1, 2, 3, 4}},
      {"input_int_tuple_positions", {6, 10}},
      {"input_int_tuple_begins", {0, 2}},
      {"input_float_tuple_positions", {7}},
      {"input_float_tuple_begins", {0}},
      {"input_float_tuples_f64", {Bits(1.5), Bits(-2.25)}},
      {"input_literal_positions", {8}},
      {"output_tensor_types", {1, 7}},
      {"output_tensor_ranks", {2, 0}},
      {"tensor_reuse_map", {-1, 0, 1}},
  };
  n.attrs.float_lists = {{"input_float_scalars", {0.1f}}, {"input_float_tuples", {1.5f, -2.25f}}};
  seeds.push_back(n);

  n = Node();  // an operator node: no tensor inputs, forward without Function.apply
  n.inputs = 0;
  n.outputs = 2;
  n.attrs.strings = {
      {"func_name", "aten::relu.default"}, {"input_convention", "cc"}, {"input_literals", "[[-1], []]"}};
  n.attrs.ints = {{"safe_run_mode", 0}};
  n.attrs.int_lists = {
      {"input_literal_positions", {0, 1}}, {"output_tensor_types", {10}}, {"output_tensor_ranks", {3}}};
  seeds.push_back(n);

  n = Node();  // dx = f'(ctx, dy)
  n.backward = true;
  n.inputs = 2;
  n.outputs = 1;
  n.attrs.strings = {{"func_name", "test.Fn"}, {"output_convention", "d"}};
  n.attrs.int_lists = {{"input_tensor_types", {1}},
                       {"output_tensor_types", {1}},
                       {"output_tensor_ranks", {1}},
                       {"output_tensor_requires_grads", {1}}};
  seeds.push_back(n);

  n = Node();  // an absent gradient input, a constant argument
  n.backward = true;
  n.inputs = 3;
  n.outputs = 2;
  n.attrs.strings = {{"func_name", "test.Two"}, {"output_convention", "dcd"}};
  n.attrs.ints = {{"safe_run_mode", 1}};
  n.attrs.int_lists = {{"input_tensor_types", {1, 7, 11}},  {"input_tensor_ranks", {2, -1, 1}},
                       {"input_tensor_present", {1, 0, 1}}, {"output_tensor_types", {1, 16}},
                       {"output_tensor_ranks", {2, 1}},     {"output_tensor_requires_grads", {1, 0}}};
  seeds.push_back(n);
  return seeds;
}

int WriteSeeds(const std::string& dir) {
  int index = 0;
  for (const Node& seed : Seeds()) {
    Writer w(seed.backward, seed.inputs, seed.outputs);
    w.Add(seed.attrs);
    Node back = Decode(w.bytes.data(), w.bytes.size());
    try {
      if (back.backward) {
        ParseBackward(back.attrs, back.inputs, back.outputs);
      } else {
        ParseForward(back.attrs, back.inputs, back.outputs);
      }
    } catch (const AttributeError& e) {
      std::fprintf(stderr, "seed %d does not parse: %s\n", index, e.what());
      return 1;
    }
    const std::string path = dir + "/seed-" + std::to_string(index++);
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(w.bytes.data(), 1, w.bytes.size(), f) != w.bytes.size() || std::fclose(f) != 0) {
      std::perror(path.c_str());
      return 1;
    }
  }
  std::printf("wrote %d seeds to %s\n", index, dir.c_str());
  return 0;
}

}  // namespace
}  // namespace ortbridge

// libFuzzer calls this before it reads its own flags.
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  const std::string flag = "--write-seeds=";
  for (int i = 1; i < *argc; ++i) {
    if (flag.compare(0, flag.size(), (*argv)[i], flag.size()) == 0) {
      std::exit(ortbridge::WriteSeeds((*argv)[i] + flag.size()));
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ortbridge::Run(ortbridge::Decode(data, size));
  return 0;
}
