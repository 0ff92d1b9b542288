// The progress hook: a call the CPU attention kernel makes on the calling thread between its
// tiles, so that non-blocking messages a schedule started before the kernel (the ring's next
// hop) move while it computes. MPI's TCP transport moves data only inside MPI calls (Open MPI
// has no progress thread for it): without the hook a ring step over TCP took compute + transfer.
// The kernels know nothing of communicators: the hook is a plain function and its argument, set
// by a ProgressScope on the thread that calls the kernel, and called by that thread only (OpenMP's
// master), as MPI_THREAD_FUNNELED allows.
#pragma once

namespace dattn::cpu {

struct ProgressHook {
  void (*fn)(void* arg) = nullptr;  // null: none
  void* arg = nullptr;
  void operator()() const {
    if (fn != nullptr) fn(arg);
  }
};

// The calling thread's hook.
inline ProgressHook& progress_hook() {
  thread_local ProgressHook hook;
  return hook;
}

// Sets the calling thread's hook for the scope's lifetime (then restores the previous one).
class ProgressScope {
 public:
  explicit ProgressScope(ProgressHook hook) : saved_(progress_hook()) { progress_hook() = hook; }
  ~ProgressScope() { progress_hook() = saved_; }
  ProgressScope(const ProgressScope&) = delete;
  ProgressScope& operator=(const ProgressScope&) = delete;

 private:
  ProgressHook saved_;
};

}  // namespace dattn::cpu
