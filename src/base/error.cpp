// dattn::Error: message formatting with rank and location, and the names of the error kinds.
#include "src/base/error.h"

#include <atomic>

namespace dattn {

namespace {
std::atomic<int> g_error_rank{-1};

std::string basename_of(const char* file) {
  std::string f(file);
  auto slash = f.find_last_of('/');
  return slash == std::string::npos ? f : f.substr(slash + 1);
}

std::string format(const std::string& message, const char* file, int line) {
  int r = g_error_rank.load();
  return detail::cat("dattn error on rank ", r < 0 ? std::string("?") : std::to_string(r), " (",
                     basename_of(file), ":", line, "): ", message);
}
}  // namespace

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::invalid_argument:
      return "invalid argument";
    case ErrorKind::mpi:
      return "MPI error";
    case ErrorKind::cuda:
      return "CUDA error";
    case ErrorKind::nccl:
      return "NCCL error";
    case ErrorKind::out_of_memory:
      return "out of memory";
    case ErrorKind::timeout:
      return "timeout";
    case ErrorKind::internal:
      return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorKind kind, const std::string& message, const char* file, int line)
    : std::runtime_error(format(message, file, line)), kind_(kind), message_(message) {}

void set_error_rank(int rank) {
  g_error_rank.store(rank);
}
int error_rank() {
  return g_error_rank.load();
}

namespace detail {
void throw_error(ErrorKind kind, const std::string& message, const char* file, int line) {
  throw Error(kind, message, file, line);
}
}  // namespace detail

}  // namespace dattn
