// Test support shared by every test binary: deterministic random tensors, an independent
// float64 attention with arbitrary token positions, cu_seqlens with empty documents and the same
// without them, and the comparison of a dattn partial (out, lse; fp32) against a float64
// reference with per-dtype tolerances.
#pragma once

#include <gtest/gtest.h>
#if __has_include(<mpi.h>)
#include <mpi.h>
#endif

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/reference.h"
#include "src/base/dtype.h"
#include "src/base/error.h"
#include "src/base/spec.h"
#include "src/base/tensor.h"

namespace dattn::test {

// ---------------------------------------------------------------- random data

// Fills t with normal(0, stddev) values (rounded to t's dtype), a pure function of seed: every
// rank that calls it with the same seed gets the same tensor.
void fill_normal(Tensor& t, uint64_t seed, float stddev = 1.f);
// n pseudo-random bytes, a pure function of seed (the data movement tests copy raw rows).
std::vector<unsigned char> random_bytes(size_t n, uint32_t seed);
Tensor random_tensor(std::initializer_list<int64_t> shape, DType dtype, uint64_t seed,
                     float stddev = 1.f);

// ---------------------------------------------------------------- independent reference

// Float64 attention where query row i sits at q_pos[i] and key row j at k_pos[j] (any
// positions: strided, shuffled). Same result layout as dattn::cpu::attention_reference.
cpu::ReferenceResult naive_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const AttnSpec& spec, const std::vector<int64_t>& q_pos,
                                     const std::vector<int64_t>& k_pos);
// Attention sinks for `heads` query heads (AttnSpec::sinks): values from -2 to 1, and 6 on every
// fourth head, far above the scores of unit-variance inputs, so that the sink dominates its rows.
std::shared_ptr<const std::vector<float>> sinks_for(int64_t heads);
// Positions begin, begin + stride, ... (n of them).
std::vector<int64_t> positions(int64_t begin, int64_t n, int64_t stride = 1);

// ---------------------------------------------------------------- empty documents

// cu_seqlens with its repeated entries (empty documents) removed: the boundaries of the same
// non-empty documents, which a call with empty documents must treat exactly as it treats these.
std::vector<int64_t> without_empty_documents(std::vector<int64_t> cu);
// The mask with its documents' repeated boundaries removed; a mask without documents unchanged.
Mask without_empty_documents(const Mask& mask);

// cu_seqlens over S >= 4 tokens (documents [0, S/4), [S/4, S/2), a 1-token one at S/2 and the
// rest) with empty documents where packed batches put them: at the start, in the middle (before
// the 1-token document), several in a row, at the end, all of these at once, and around a single
// document.
struct EmptyDocumentsCase {
  std::string name;
  std::vector<int64_t> cu;
};
std::vector<EmptyDocumentsCase> empty_documents_cases(int64_t S);

// ---------------------------------------------------------------- slice masks

// A random slice mask over positions [0, S): the queries cut into random ranges, each range given
// random disjoint key ranges of random kinds (so no two slices overlap), with empty slices (no
// queries, no keys, bi_causal with fewer keys than queries) and query ranges with no slice (rows
// that see nothing) among them.
Mask random_slices(std::mt19937_64& rng, int64_t S);
// MagiAttention's shared-prefix mask: a causal prefix [0, prefix), then documents cu (from prefix
// to S) each seeing the whole prefix and itself causally.
Mask shared_prefix_mask(int64_t prefix, const std::vector<int64_t>& cu);

// ---------------------------------------------------------------- comparison

// |got - ref| <= atol + rtol * |ref| for lse, and the same times (1 + |lse| / 16) for out (the
// rounding error of the scores grows with their size).
struct Tolerance {
  double out_atol, out_rtol, lse_atol, lse_rtol;
};
// The tolerance for a kernel whose inputs are stored in `dtype` (see test_reference.cpp for the
// measured errors these are set from).
Tolerance tolerance_for(DType dtype);

struct CompareStats {
  double max_out_err = 0, max_lse_err = 0;  // absolute
  double max_ratio = 0;                     // largest error / allowed error
  int64_t rows = 0, empty_rows = 0;
};

// Checks a partial against the reference. out is fp32 [B, S, H, Dv] (bshd), lse fp32 [B, H, S];
// row s of the partial is row ref_row(s) of the reference (ref has ref_S rows, same B, H, Dv).
// A row that the reference says is empty (lse = -inf) must have lse exactly -inf and out
// exactly 0; no value may be NaN or +inf. On failure the message names the worst index.
testing::AssertionResult matches_reference(const float* out, const float* lse, int64_t B, int64_t S,
                                           int64_t H, int64_t Dv, const cpu::ReferenceResult& ref,
                                           int64_t ref_S,
                                           const std::function<int64_t(int64_t)>& ref_row,
                                           const Tolerance& tol, CompareStats* stats = nullptr);
// Same rows in both (ref_S == S).
testing::AssertionResult matches_reference(const float* out, const float* lse, int64_t B, int64_t S,
                                           int64_t H, int64_t Dv, const cpu::ReferenceResult& ref,
                                           const Tolerance& tol, CompareStats* stats = nullptr);

// Whether to print measured errors (DATTN_TEST_PRINT_ERRORS=1), for setting tolerances.
bool print_errors();

// Runs f, which must throw dattn::Error whose what() contains every needle.
template <typename F>
testing::AssertionResult throws_naming(F&& f, const std::vector<std::string>& needles) {
  try {
    f();
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const auto& n : needles)
      if (what.find(n) == std::string::npos)
        return testing::AssertionFailure()
               << "dattn::Error does not mention '" << n << "': what() = " << what;
    return testing::AssertionSuccess() << what;
  } catch (const std::exception& e) {
    return testing::AssertionFailure() << "threw a non-dattn exception: " << e.what();
  }
  return testing::AssertionFailure() << "did not throw";
}

#if __has_include(<mpi.h>)  // not in the core-only build of a bare GPU machine (tests/gpu)
// This process's rank and the world's size (MPI test binaries).
inline int world_size() {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}
inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
#endif

}  // namespace dattn::test
