// Error messages of the native extensions, built with std::string only.
//
// Not with c10::str, std::ostringstream or TORCH_CHECK's formatting: on our H200 test machine (torch
// 2.11, g++ 13.3) std::ostringstream segfaults in a JIT-built extension, so a TORCH_CHECK message with a
// number in it crashed the process instead of raising. A message is cat(parts...) of strings, bools and
// integers, shapes, dtypes and devices, thrown as std::runtime_error (Python's RuntimeError).
#pragma once

#include <ATen/core/Tensor.h>

#include <stdexcept>
#include <string>
#include <type_traits>

namespace rlk {

inline std::string text(const char* s) { return s; }
inline std::string text(const std::string& s) { return s; }
inline std::string text(bool b) { return b ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string text(T v) {
  return std::to_string(v);
}
inline std::string text(c10::ScalarType t) { return c10::toString(t); }
inline std::string text(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}
inline std::string text(const c10::Device& d) {
  return c10::DeviceTypeName(d.type(), /*lower_case=*/true) + (d.has_index() ? ":" + std::to_string(d.index()) : "");
}
template <typename... T>
std::string cat(const T&... parts) {
  return (std::string() + ... + text(parts));
}

}  // namespace rlk
