// dattn::Error, its kind (what failed: the caller's input, MPI, CUDA, NCCL, memory, a deadline,
// dattn itself), and the checking macros used everywhere in the library.
// Library code throws; it never exits or aborts. Programs catch at main (launch/program.h).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dattn {

// What an Error stands for, set where it is thrown: the C API turns it into a dattn_status and
// the Python binding into an exception class. Agreed validation relays it with the message, so
// every rank throws the same kind.
enum class ErrorKind : int {
  invalid_argument,  // a bad parameter or configuration; the message names it (DATTN_CHECK_ARG)
  mpi,               // an MPI call failed (DATTN_MPI_CHECK)
  cuda,              // a CUDA runtime call failed (DATTN_CUDA_CHECK)
  nccl,              // an NCCL call failed (DATTN_NCCL_CHECK)
  out_of_memory,     // host or device memory ran out
  timeout,           // a wait passed its deadline (the watchdog's deadlines end the job instead)
  internal,          // a broken invariant: a dattn bug (DATTN_ASSERT)
};
inline constexpr int kErrorKinds = 7;

// "invalid argument", "MPI error", "CUDA error", "NCCL error", "out of memory", "timeout",
// "internal error"; "unknown error" for a value outside the enum.
const char* error_kind_name(ErrorKind kind);

// The error every dattn call throws. what() reads
//   "dattn error on rank R (file.cpp:123): <message>"
// so that a log line from any rank says where and why.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message, const char* file, int line);
  ErrorKind kind() const { return kind_; }
  // The message without the rank/location prefix.
  const std::string& message() const { return message_; }

 private:
  ErrorKind kind_;
  std::string message_;
};

// The rank that error messages name. Set by the Runtime (or the program) once MPI is up;
// -1 (printed as "?") before that.
void set_error_rank(int rank);
int error_rank();

namespace detail {
[[noreturn]] void throw_error(ErrorKind kind, const std::string& message, const char* file,
                              int line);

// Streams any number of values into one string: cat("x = ", 3) -> "x = 3".
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace dattn

// Throws dattn::Error of the given ErrorKind with the streamed message:
// DATTN_THROW_KIND(ErrorKind::out_of_memory, "out of host memory allocating ", shape).
#define DATTN_THROW_KIND(kind, ...) \
  ::dattn::detail::throw_error((kind), ::dattn::detail::cat(__VA_ARGS__), __FILE__, __LINE__)

// Throws dattn::Error (invalid argument) with the streamed message.
#define DATTN_THROW(...) DATTN_THROW_KIND(::dattn::ErrorKind::invalid_argument, __VA_ARGS__)

// Checks a condition on a named parameter; the message names the parameter, its value and what
// was expected: DATTN_CHECK_ARG(h_q % h_kv == 0, "heads_q", h_q, "a multiple of heads_kv (8)").
#define DATTN_CHECK_ARG(cond, name, value, expected)                                   \
  do {                                                                                 \
    if (!(cond)) DATTN_THROW("invalid ", name, " = ", value, ": expected ", expected); \
  } while (0)

// Internal invariant: a failure is a dattn bug, not a user error (ErrorKind::internal).
#define DATTN_ASSERT(cond)                                                                        \
  do {                                                                                            \
    if (!(cond))                                                                                  \
      DATTN_THROW_KIND(::dattn::ErrorKind::internal, "internal error: assertion failed: " #cond); \
  } while (0)
