#include "text.h"

#include <algorithm>

namespace ortbridge {

namespace {

// The length of the valid UTF-8 sequence at text[i], or 0 where the byte starts none.
size_t Utf8SequenceLength(const std::string& text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = byte(i);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
  if (n == 0 || i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
  }
  const bool overlong_or_out_of_range =
      (n == 2 && c < 0xc2) || (n == 3 && c == 0xe0 && byte(i + 1) < 0xa0) ||
      (n == 3 && c == 0xed && byte(i + 1) >= 0xa0) ||  // surrogates
      (n == 4 && (c > 0xf4 || (c == 0xf0 && byte(i + 1) < 0x90) || (c == 0xf4 && byte(i + 1) >= 0x90)));
  return overlong_or_out_of_range ? 0 : n;
}

}  // namespace

std::string Printable(const std::string& text, size_t max_bytes) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(std::min(text.size(), max_bytes));
  for (size_t i = 0; i < text.size();) {
    if (out.size() >= max_bytes) return out + "... (" + std::to_string(text.size()) + " bytes)";
    const auto c = static_cast<unsigned char>(text[i]);
    size_t n = Utf8SequenceLength(text, i);
    if (n == 1 && (c < 0x20 || c == 0x7f)) n = 0;  // control characters and NUL
    if (n) {
      out.append(text, i, n);
      i += n;
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 0xf];
      ++i;
    }
  }
  return out;
}

bool IsValidUtf8(const std::string& text) {
  for (size_t i = 0, n; i < text.size(); i += n) {
    n = text[i] == '\0' ? 0 : Utf8SequenceLength(text, i);
    if (n == 0) return false;
  }
  return true;
}

}  // namespace ortbridge
