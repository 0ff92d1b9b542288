// The first exception of the threads of an OpenMP region: an exception must not leave an OpenMP
// thread (std::terminate), so each task runs under run(), which keeps the first one and makes the
// later tasks return at once; rethrow() after the region throws it on the calling thread.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>

namespace dattn::cpu {

class FirstError {
 public:
  template <class F>
  void run(F&& f) {
    if (set_.load(std::memory_order_relaxed)) return;
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      set_.store(true, std::memory_order_relaxed);
    }
  }
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::atomic<bool> set_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

}  // namespace dattn::cpu
