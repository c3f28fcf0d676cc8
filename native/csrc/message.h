// Error messages of the native extensions, built with std::string only.
//
// Not with c10::str, std::ostringstream or TORCH_CHECK's formatting: on our H200 test machine (torch
// 2.11, g++ 13.3) std::ostringstream segfaults in a JIT-built extension, so a TORCH_CHECK message with a
// number in it crashed the process instead of raising. A message is cat(parts...) of strings, bools and
// integers, thrown as std::runtime_error (Python's RuntimeError).
#pragma once

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
template <typename... T>
std::string cat(const T&... parts) {
  return (std::string() + ... + text(parts));
}

}  // namespace rlk
