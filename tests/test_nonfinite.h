// Support of the non-finite tests (test_nonfinite_kernel.cpp, test_nonfinite_dist.cpp): tokens
// filled with NaN and inf, the rows and keys whose results must not depend on them, and the
// bitwise comparison of those results between a run with the garbage and a run without.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "src/base/spec.h"
#include "src/base/tensor.h"

namespace dattn::test {

// The garbage values, in turn: NaN, +inf, -inf.
inline float garbage_value(int64_t i) {
  const float values[] = {NAN, INFINITY, -INFINITY};
  return values[i % 3];
}

// Overwrites every element of the rows (dimension 1) of the bshd tensor t whose position
// pos(row) is marked in bad (indexed by position) with garbage_value.
inline void poison_rows(Tensor& t, const std::vector<char>& bad,
                        const std::function<int64_t(int64_t)>& pos) {
  const int64_t B = t.size(0), S = t.size(1), row = t.size(2) * t.size(3);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t p = pos(s);
      if (p < 0 || p >= int64_t(bad.size()) || !bad[size_t(p)]) continue;
      for (int64_t e = 0; e < row; ++e)
        t.set((b * S + s) * row + e, garbage_value(b + s + e));
    }
}

// Which query and key positions must give the same bits whatever the garbage tokens hold: a
// query that is clean and sees no garbage key (its out, lse, dq), a key that is clean and is
// seen only by such queries (its dk, dv: a query that sees garbage has garbage lse and dS). q_pos
// and k_pos list the positions present.
struct CleanSets {
  std::vector<char> query, key;  // indexed by position
};
inline CleanSets clean_sets(const Mask& mask, const std::vector<int64_t>& q_pos,
                            const std::vector<int64_t>& k_pos, const std::vector<char>& bad) {
  int64_t n = int64_t(bad.size());
  for (int64_t p : q_pos)
    n = std::max(n, p + 1);
  for (int64_t p : k_pos)
    n = std::max(n, p + 1);
  auto is_bad = [&](int64_t p) { return p < int64_t(bad.size()) && bad[size_t(p)]; };
  CleanSets c{std::vector<char>(size_t(n), 0), std::vector<char>(size_t(n), 0)};
  for (int64_t qp : q_pos) {
    bool ok = !is_bad(qp);
    for (int64_t kp : k_pos)
      ok = ok && !(mask.visible(qp, kp) && is_bad(kp));
    c.query[size_t(qp)] = ok;
  }
  for (int64_t kp : k_pos) {
    bool ok = !is_bad(kp);
    for (int64_t qp : q_pos)
      ok = ok && !(mask.visible(qp, kp) && !c.query[size_t(qp)]);
    c.key[size_t(kp)] = ok;
  }
  return c;
}

inline bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

// Compares the rows (dimension `seq_dim`) of two fp32 tensors of the same shape whose position
// pos(row) is marked in `clean`: every element bitwise equal and finite. `counted` adds the
// number of rows compared (a test checks that it compared something).
inline testing::AssertionResult same_clean_rows(const char* what, const Tensor& got,
                                                const Tensor& want, int seq_dim,
                                                const std::vector<char>& clean,
                                                const std::function<int64_t(int64_t)>& pos,
                                                int64_t* counted = nullptr) {
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < seq_dim; ++d)
    outer *= got.size(d);
  for (int d = seq_dim + 1; d < got.dim(); ++d)
    inner *= got.size(d);
  const int64_t S = got.size(seq_dim);
  const float* a = got.ptr<float>();
  const float* b = want.ptr<float>();
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t p = pos(s);
      if (p < 0 || p >= int64_t(clean.size()) || !clean[size_t(p)]) continue;
      if (counted != nullptr && o == 0) ++*counted;
      for (int64_t e = 0; e < inner; ++e) {
        const int64_t i = (o * S + s) * inner + e;
        if (!std::isfinite(a[i]) || !same_bits(a[i], b[i]))
          return testing::AssertionFailure()
                 << what << " at position " << p << " (row " << s << ", outer " << o << ", element "
                 << e << "): " << a[i] << " with garbage elsewhere, " << b[i] << " without";
      }
    }
  return testing::AssertionSuccess();
}

// Sets an environment variable for one scope (and restores what was there).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value != nullptr)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_.c_str(), old_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace dattn::test
