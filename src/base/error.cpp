// dattn::Error: message formatting with rank and location.
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

Error::Error(const std::string& message, const char* file, int line)
    : std::runtime_error(format(message, file, line)), message_(message) {}

void set_error_rank(int rank) {
  g_error_rank.store(rank);
}
int error_rank() {
  return g_error_rank.load();
}

namespace detail {
void throw_error(const std::string& message, const char* file, int line) {
  throw Error(message, file, line);
}
}  // namespace detail

}  // namespace dattn
