// Progress on rank 0 for long runs: "# progress: prefill seq 65536: 3/6 iterations, 41 s
// elapsed, ~41 s left". Quiet for the first few seconds (short runs print nothing) and then at
// most once every few seconds, so logs stay readable; only the rank constructed with
// enabled = true prints.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace dattn {

class Progress {
 public:
  Progress(bool enabled, std::string what, int64_t total, const char* unit = "iterations")
      : enabled_(enabled), what_(std::move(what)), unit_(unit), total_(total) {}

  // One more unit done; prints when the run has lasted kQuiet and kEvery passed since the last.
  void step(int64_t n = 1) {
    done_ += n;
    if (!enabled_) return;
    const double t = elapsed();
    if (t < kQuietSeconds || t - last_ < kEverySeconds) return;
    last_ = t;
    const double left = done_ > 0 ? t * double(total_ - done_) / double(done_) : 0;
    std::printf("# progress: %s: %lld/%lld %s, %.0f s elapsed, ~%.0f s left\n", what_.c_str(),
                static_cast<long long>(done_), static_cast<long long>(total_), unit_, t, left);
    std::fflush(stdout);
  }

 private:
  static constexpr double kQuietSeconds = 3, kEverySeconds = 5;
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  bool enabled_;
  std::string what_;
  const char* unit_;
  int64_t total_, done_ = 0;
  double last_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace dattn
