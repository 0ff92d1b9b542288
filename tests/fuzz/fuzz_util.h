// Shared by the libFuzzer targets of tests/fuzz: how a target fails (a report and abort(), which
// libFuzzer records as a crash with the input), and which exceptions are an expected answer to a
// bad input.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "src/base/error.h"

namespace dattn::fuzz {

// A finding: print what broke and abort, so libFuzzer saves the input as a crash.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "dattn fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// dattn::Error is the library's answer to a bad argument, so it is expected, except the one
// DATTN_ASSERT throws: a broken invariant is a bug whatever the input.
inline void expect_argument_error(const dattn::Error& e) {
  if (e.message().rfind("internal error", 0) == 0) fail(std::string("internal error: ") + e.what());
}

}  // namespace dattn::fuzz

// FUZZ_CHECK(cond, streamed message...): a finding unless cond holds.
#define FUZZ_CHECK(cond, ...)                                                           \
  do {                                                                                  \
    if (!(cond))                                                                        \
      ::dattn::fuzz::fail(                                                              \
          ::dattn::detail::cat(__FILE__, ":", __LINE__, ": " #cond ": ", __VA_ARGS__)); \
  } while (0)
