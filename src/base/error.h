// dattn::Error and the checking macros used everywhere in the library.
// Library code throws; it never exits or aborts. Programs catch at main (launch/program.h).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dattn {

// The error every dattn call throws. what() reads
//   "dattn error on rank R (file.cpp:123): <message>"
// so that a log line from any rank says where and why.
class Error : public std::runtime_error {
 public:
  Error(const std::string& message, const char* file, int line);
  // The message without the rank/location prefix.
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

// The rank that error messages name. Set by the Runtime (or the program) once MPI is up;
// -1 (printed as "?") before that.
void set_error_rank(int rank);
int error_rank();

namespace detail {
[[noreturn]] void throw_error(const std::string& message, const char* file, int line);

// Streams any number of values into one string: cat("x = ", 3) -> "x = 3".
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace dattn

// Throws dattn::Error with the streamed message.
#define DATTN_THROW(...) \
  ::dattn::detail::throw_error(::dattn::detail::cat(__VA_ARGS__), __FILE__, __LINE__)

// Checks a condition on a named parameter; the message names the parameter, its value and what
// was expected: DATTN_CHECK_ARG(h_q % h_kv == 0, "heads_q", h_q, "a multiple of heads_kv (8)").
#define DATTN_CHECK_ARG(cond, name, value, expected)                                   \
  do {                                                                                 \
    if (!(cond)) DATTN_THROW("invalid ", name, " = ", value, ": expected ", expected); \
  } while (0)

// Internal invariant: a failure is a dattn bug, not a user error.
#define DATTN_ASSERT(cond)                                                \
  do {                                                                    \
    if (!(cond)) DATTN_THROW("internal error: assertion failed: " #cond); \
  } while (0)
