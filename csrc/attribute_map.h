// A map-backed AttributeSource: attributes of a node read outside ONNX Runtime (ortbridge._C's
// parse_forward, for ONNX graphs run as torch modules), and in the parser's unit tests and fuzzer.
#pragma once

#include "attributes.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace ortbridge {

// Attributes by type, as ORT stores them: a getter finds only its own type.
class MapAttributes : public AttributeSource {
 public:
  std::map<std::string, int64_t> ints;
  std::map<std::string, std::string> strings;
  std::map<std::string, std::vector<int64_t>> int_lists;
  std::map<std::string, std::vector<float>> float_lists;

  bool Has(const char* name) const override {
    return ints.count(name) || strings.count(name) || int_lists.count(name) || float_lists.count(name);
  }
  bool GetInt(const char* name, int64_t* out) const override { return Find(ints, name, out); }
  bool GetString(const char* name, std::string* out) const override { return Find(strings, name, out); }
  bool GetInts(const char* name, std::vector<int64_t>* out) const override {
    return Find(int_lists, name, out);
  }
  bool GetFloats(const char* name, std::vector<float>* out) const override {
    return Find(float_lists, name, out);
  }

  void Erase(const std::string& name) {
    ints.erase(name);
    strings.erase(name);
    int_lists.erase(name);
    float_lists.erase(name);
  }

 private:
  template <class Map, class T>
  static bool Find(const Map& map, const char* name, T* out) {
    auto it = map.find(name);
    if (it == map.end()) return false;
    *out = it->second;
    return true;
  }
};

}  // namespace ortbridge
