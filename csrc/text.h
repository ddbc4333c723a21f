// Text from model files in error messages: what may appear as it is, and what is escaped. No
// Python and no ONNX Runtime here (tests/cpp/test_attributes.cc tests it).
#pragma once

#include <cstddef>
#include <string>

namespace ortbridge {

// `text` as it may appear in an error message: valid UTF-8 and printable ASCII as they are, any
// other byte (invalid UTF-8, control characters, NUL) as \xNN. Attribute values and names come
// from model files; ORT's error text must stay a valid, complete string.
// Beyond `max_bytes` the text is cut (ORT's messages end at about 4 KB: the reason must fit).
std::string Printable(const std::string& text, size_t max_bytes = 200);

// Whether `text` is valid UTF-8 without NUL characters (what a name must be to reach Python).
bool IsValidUtf8(const std::string& text);

}  // namespace ortbridge
