/* The C API (src/dattn.h) from a C99 program under mpiexec with 1-4 ranks: forward and backward
 * of every layout, mask and strategy against a naive float64 attention written here (with empty
 * documents too: repeated cu_seqlens entries; a slice mask with a row that sees nothing), and
 * every error path (status, a message naming the parameter, agreement across ranks, no hang). A
 * failed check prints the rank and line and aborts the job (MPI_Abort), so no rank waits. */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "src/dattn.h"

static int g_rank = 0, g_size = 1, g_checks = 0;

#define CHECK(cond, ...)                                                                  \
  do {                                                                                    \
    ++g_checks;                                                                           \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "test_c_api: rank %d: %s:%d: check failed: %s: ", g_rank, __FILE__, \
              __LINE__, #cond);                                                           \
      fprintf(stderr, __VA_ARGS__);                                                       \
      fprintf(stderr, "\n  dattn_last_error() = \"%s\"\n", dattn_last_error());           \
      fflush(stderr);                                                                     \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                       \
    }                                                                                     \
  } while (0)

#define CHECK_OK(call)                                                             \
  do {                                                                             \
    dattn_status st_ = (call);                                                     \
    CHECK(st_ == DATTN_OK, "%s returned %s", #call, dattn_status_name(st_));       \
    CHECK(dattn_last_error()[0] == '\0', "no message after a success, got \"%s\"", \
          dattn_last_error());                                                     \
  } while (0)

/* A call must fail with `want` and a message that contains `word` (the parameter's name). */
#define CHECK_FAILS(call, want, word)                                                          \
  do {                                                                                         \
    dattn_status st_ = (call);                                                                 \
    CHECK(st_ == (want), "%s returned %s, expected %s", #call, dattn_status_name(st_),         \
          dattn_status_name(want));                                                            \
    CHECK(strstr(dattn_last_error(), (word)) != NULL, "the message should name \"%s\"", word); \
  } while (0)

/* ---------------------------------------------------------------- data */

/* Deterministic values in [-1, 1), the same on every rank. */
static void fill(float* x, int64_t n, uint32_t seed) {
  uint32_t s = seed * 2654435761u + 12345u;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    x[i] = (float)(s >> 8) * (1.0f / 8388608.0f) - 1.0f;
  }
}

static void* xmalloc(size_t bytes) {
  void* p = malloc(bytes > 0 ? bytes : 1);
  CHECK(p != NULL, "malloc(%zu)", bytes);
  return p;
}

/* ---------------------------------------------------------------- naive float64 attention */

typedef struct problem {
  int64_t B, S, H, Hkv, D, Dv;
  double scale;
  dattn_mask_kind mask;
  int64_t left, right; /* window */
  int doc_causal;
  const int64_t* cu;
  int64_t ncu;
  const float* sinks; /* H logits, or NULL */
  double softcap;     /* > 0: scores become softcap * tanh(s / softcap) */
} problem;

/* The slice mask of the DATTN_MASK_SLICES cases over S = 37: a causal prefix of 7 tokens, two
 * documents that see it whole and themselves causally, an inverse-causal and a bi-causal slice,
 * position 36 seeing nothing, and an empty slice. */
static const int64_t kSlices[][5] = {{0, 7, 0, 7, 1},     {7, 20, 0, 7, 0},    {7, 20, 7, 20, 1},
                                     {20, 30, 0, 7, 0},   {20, 30, 20, 30, 1}, {30, 33, 20, 37, 2},
                                     {33, 36, 25, 37, 3}, {9, 9, 0, 37, 0}};
static const int64_t kNumSlices = 8;

/* Whether query i sees key j under kSlices (the kinds written out on offsets in the rectangle). */
static int slice_visible(int64_t i, int64_t j) {
  for (int64_t n = 0; n < kNumSlices; ++n) {
    const int64_t* e = kSlices[n];
    if (i < e[0] || i >= e[1] || j < e[2] || j >= e[3]) continue;
    const int64_t a = i - e[0], b = j - e[2], excess = (e[3] - e[2]) - (e[1] - e[0]);
    const int below = b <= a + excess, above = b >= a;
    return e[4] == 0 ? 1 : e[4] == 1 ? below : e[4] == 2 ? above : below && above;
  }
  return 0;
}

static int64_t doc_of(const problem* p, int64_t pos) {
  int64_t d = 0;
  while (d + 1 < p->ncu && p->cu[d + 1] <= pos)
    ++d;
  return d;
}

static int visible(const problem* p, int64_t i, int64_t j) {
  switch (p->mask) {
    case DATTN_MASK_NONE:
      return 1;
    case DATTN_MASK_CAUSAL:
      return j <= i;
    case DATTN_MASK_WINDOW:
      return j >= i - p->left && j <= i + p->right;
    case DATTN_MASK_DOCUMENT:
      return doc_of(p, i) == doc_of(p, j) && (!p->doc_causal || j <= i);
    case DATTN_MASK_SLICES:
      return slice_visible(i, j);
  }
  return 0;
}

/* Global tensors are bshd with the full sequence S. Writes out [B,S,H,Dv], lse [B,H,S] and, when
 * dout is given, dq [B,S,H,D], dk [B,S,Hkv,D], dv [B,S,Hkv,Dv] and, with sinks, dsinks [H] (all
 * float64, zeroed here). A sink joins its rows' normaliser as a key with no value. */
static void reference(const problem* p, const float* q, const float* k, const float* v,
                      const float* dout, double* out, double* lse, double* dq, double* dk,
                      double* dv, double* dsinks) {
  const int64_t B = p->B, S = p->S, H = p->H, Hkv = p->Hkv, D = p->D, Dv = p->Dv;
  double* prob = xmalloc(sizeof(double) * (size_t)S);
  if (dout) {
    memset(dq, 0, sizeof(double) * (size_t)(B * S * H * D));
    memset(dk, 0, sizeof(double) * (size_t)(B * S * Hkv * D));
    memset(dv, 0, sizeof(double) * (size_t)(B * S * Hkv * Dv));
    if (p->sinks) memset(dsinks, 0, sizeof(double) * (size_t)H);
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / Hkv);
      for (int64_t i = 0; i < S; ++i) {
        const float* qi = q + ((b * S + i) * H + h) * D;
        double m = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          prob[j] = -INFINITY;
          if (!visible(p, i, j)) continue;
          const float* kj = k + ((b * S + j) * Hkv + g) * D;
          double s = 0;
          for (int64_t d = 0; d < D; ++d)
            s += (double)qi[d] * kj[d];
          prob[j] = s * p->scale;
          if (p->softcap > 0) prob[j] = p->softcap * tanh(prob[j] / p->softcap);
          if (prob[j] > m) m = prob[j];
        }
        const double sink = p->sinks ? (double)p->sinks[h] : -INFINITY;
        if (sink > m) m = sink;
        double* oi = out + ((b * S + i) * H + h) * Dv;
        if (m == -INFINITY) { /* a row that sees no key: out 0, lse -inf, no gradient */
          for (int64_t e = 0; e < Dv; ++e)
            oi[e] = 0;
          lse[(b * H + h) * S + i] = -INFINITY;
          continue;
        }
        double sum = exp(sink - m);
        for (int64_t j = 0; j < S; ++j) {
          prob[j] = prob[j] == -INFINITY ? 0 : exp(prob[j] - m);
          sum += prob[j];
        }
        for (int64_t e = 0; e < Dv; ++e)
          oi[e] = 0;
        for (int64_t j = 0; j < S; ++j) {
          prob[j] /= sum;
          const float* vj = v + ((b * S + j) * Hkv + g) * Dv;
          for (int64_t e = 0; e < Dv; ++e)
            oi[e] += prob[j] * vj[e];
        }
        lse[(b * H + h) * S + i] = m + log(sum);
        if (!dout) continue;
        /* dS_ij = P_ij (dP_ij - delta_i), dP_ij = dout_i . v_j, delta_i = dout_i . out_i */
        const float* doi = dout + ((b * S + i) * H + h) * Dv;
        double delta = 0;
        for (int64_t e = 0; e < Dv; ++e)
          delta += (double)doi[e] * oi[e];
        if (p->sinks) dsinks[h] -= exp(sink - m) / sum * delta;
        for (int64_t j = 0; j < S; ++j) {
          if (prob[j] == 0) continue;
          const float* vj = v + ((b * S + j) * Hkv + g) * Dv;
          const float* kj = k + ((b * S + j) * Hkv + g) * D;
          double dp = 0;
          for (int64_t e = 0; e < Dv; ++e)
            dp += (double)doi[e] * vj[e];
          double ds = prob[j] * (dp - delta) * p->scale;
          if (p->softcap > 0) { /* through softcap * tanh(s / softcap): 1 - tanh^2 */
            double s = 0;
            for (int64_t d = 0; d < D; ++d)
              s += (double)qi[d] * kj[d];
            const double t = tanh(s * p->scale / p->softcap);
            ds *= 1 - t * t;
          }
          for (int64_t d = 0; d < D; ++d) {
            dq[((b * S + i) * H + h) * D + d] += ds * kj[d];
            dk[((b * S + j) * Hkv + g) * D + d] += ds * qi[d];
          }
          for (int64_t e = 0; e < Dv; ++e)
            dv[((b * S + j) * Hkv + g) * Dv + e] += prob[j] * doi[e];
        }
      }
    }
  free(prob);
}

/* ---------------------------------------------------------------- shards */

/* Rows of a global bshd tensor [B, S, heads, dim] at the given positions: [B, n, heads, dim]. */
static float* shard_of(const float* global, int64_t B, int64_t S, int64_t row, const int64_t* pos,
                       int64_t n) {
  float* s = xmalloc(sizeof(float) * (size_t)(B * n * row));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      memcpy(s + (b * n + i) * row, global + (b * S + pos[i]) * row, sizeof(float) * (size_t)row);
  return s;
}

/* max |shard - reference rows| of a bshd result */
static double diff_bshd(const float* got, const double* ref, int64_t B, int64_t S, int64_t row,
                        const int64_t* pos, int64_t n) {
  double worst = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < row; ++e) {
        const double d = fabs(got[(b * n + i) * row + e] - ref[(b * S + pos[i]) * row + e]);
        if (!(d <= worst)) worst = d; /* NaN sticks */
      }
  return worst;
}

static double diff_lse(const float* got, const double* ref, int64_t B, int64_t H, int64_t S,
                       const int64_t* pos, int64_t n) {
  double worst = 0;
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < n; ++i) {
      const double r = ref[bh * S + pos[i]];
      const double d = r == -INFINITY ? (got[bh * n + i] == -INFINITY ? 0 : INFINITY)
                                      : fabs(got[bh * n + i] - r);
      if (!(d <= worst)) worst = d;
    }
  return worst;
}

/* ---------------------------------------------------------------- one case */

static const char* kLayoutNames[] = {"contiguous", "zigzag", "striped", "varlen"};
static const char* kMaskNames[] = {"none", "causal", "window", "document", "slices"};
static const char* kStrategyNames[] = {"ring", "ulysses", "hybrid"};

/* The documents of the cases (the reference's), and the same documents with empty ones (repeated
 * boundaries) at the start, in the middle, in a row and at the end. */
static const int64_t kDocs[] = {0, 7, 20, 21, 37};
static const int64_t kEmptyDocs[] = {0, 0, 7, 20, 20, 20, 21, 37, 37};

/* Forward and backward of one configuration against the float64 reference, on this rank's
 * shard. The call takes the document boundaries cu (ncu entries; kDocs or kEmptyDocs), the
 * reference kDocs. */
static void run_case_docs(dattn_runtime* rt, dattn_layout_kind lk, dattn_mask_kind mk,
                          dattn_strategy strategy, int64_t H, int64_t Hkv, int64_t D, int64_t Dv,
                          int backward, const int64_t* cu, int64_t ncu, const float* sinks,
                          float softcap) {
  const int64_t B = 2, S = 37;
  problem p = {B, S, H, Hkv, D, Dv, 1.0 / sqrt((double)D), mk, 5, 2, 1, kDocs, 5, sinks, softcap};

  dattn_layout layout = {lk, S, 2, cu, ncu};
  dattn_spec spec = {H,         Hkv,          D,  Dv,  0.0f,  mk,      p.left,
                     p.right,   p.doc_causal, cu, ncu, sinks, softcap, &kSlices[0][0],
                     kNumSlices};

  int64_t n = -1;
  CHECK_OK(dattn_layout_shard_len(&layout, g_size, g_rank, &n));
  int64_t* pos = xmalloc(sizeof(int64_t) * (size_t)n);
  CHECK_OK(dattn_layout_positions(&layout, g_size, g_rank, pos, n));

  float* q = xmalloc(sizeof(float) * (size_t)(B * S * H * D));
  float* k = xmalloc(sizeof(float) * (size_t)(B * S * Hkv * D));
  float* v = xmalloc(sizeof(float) * (size_t)(B * S * Hkv * Dv));
  float* dout = xmalloc(sizeof(float) * (size_t)(B * S * H * Dv));
  fill(q, B * S * H * D, 1);
  fill(k, B * S * Hkv * D, 2);
  fill(v, B * S * Hkv * Dv, 3);
  fill(dout, B * S * H * Dv, 4);
  double* ro = xmalloc(sizeof(double) * (size_t)(B * S * H * Dv));
  double* rl = xmalloc(sizeof(double) * (size_t)(B * H * S));
  double* rdq = xmalloc(sizeof(double) * (size_t)(B * S * H * D));
  double* rdk = xmalloc(sizeof(double) * (size_t)(B * S * Hkv * D));
  double* rdv = xmalloc(sizeof(double) * (size_t)(B * S * Hkv * Dv));
  double* rds = xmalloc(sizeof(double) * (size_t)H);
  reference(&p, q, k, v, backward ? dout : NULL, ro, rl, rdq, rdk, rdv, rds);

  float* qs = shard_of(q, B, S, H * D, pos, n);
  float* ks = shard_of(k, B, S, Hkv * D, pos, n);
  float* vs = shard_of(v, B, S, Hkv * Dv, pos, n);
  float* dos = shard_of(dout, B, S, H * Dv, pos, n);
  dattn_tensor tq = {qs, DATTN_FP32, {B, n, H, D}};
  dattn_tensor tk = {ks, DATTN_FP32, {B, n, Hkv, D}};
  dattn_tensor tv = {vs, DATTN_FP32, {B, n, Hkv, Dv}};
  dattn_tensor tdo = {dos, DATTN_FP32, {B, n, H, Dv}};
  dattn_buffer out = {xmalloc(sizeof(float) * (size_t)(B * n * H * Dv)), B * n * H * Dv};
  dattn_buffer lse = {xmalloc(sizeof(float) * (size_t)(B * H * n)), B * H * n};

  CHECK_OK(dattn_attention_forward(rt, &tq, &tk, &tv, &spec, &layout, strategy, out, lse));
  const double eo = diff_bshd(out.data, ro, B, S, H * Dv, pos, n);
  const double el = diff_lse(lse.data, rl, B, H, S, pos, n);
  const char* what_l = kLayoutNames[lk];
  const char* what_m = kMaskNames[mk];
  const char* what_s = kStrategyNames[strategy];
  CHECK(eo < 2e-5 && el < 2e-5,
        "%s %s %s H=%lld/%lld, %lld boundaries: max |out err| = %g, |lse err| = %g", what_s, what_l,
        what_m, (long long)H, (long long)Hkv, (long long)ncu, eo, el);

  if (backward) {
    dattn_buffer dq = {xmalloc(sizeof(float) * (size_t)(B * n * H * D)), B * n * H * D};
    dattn_buffer dk = {xmalloc(sizeof(float) * (size_t)(B * n * Hkv * D)), B * n * Hkv * D};
    dattn_buffer dv = {xmalloc(sizeof(float) * (size_t)(B * n * Hkv * Dv)), B * n * Hkv * Dv};
    dattn_buffer ds = {sinks ? xmalloc(sizeof(float) * (size_t)H) : NULL, sinks ? H : 0};
    CHECK_OK(dattn_attention_backward(rt, &tq, &tk, &tv, out.data, lse.data, &tdo, &spec, &layout,
                                      strategy, dq, dk, dv, ds));
    const double eq = diff_bshd(dq.data, rdq, B, S, H * D, pos, n);
    const double ek = diff_bshd(dk.data, rdk, B, S, Hkv * D, pos, n);
    const double ev = diff_bshd(dv.data, rdv, B, S, Hkv * Dv, pos, n);
    double es = 0; /* every rank holds the sum over all rows */
    for (int64_t h = 0; sinks && h < H; ++h)
      es = fmax(es, fabs(ds.data[h] - rds[h]));
    CHECK(eq < 5e-5 && ek < 5e-5 && ev < 5e-5 && es < 5e-5,
          "%s %s %s H=%lld/%lld, %lld boundaries%s: max |dq err| = %g, |dk err| = %g, |dv err| = "
          "%g, |dsinks err| = %g",
          what_s, what_l, what_m, (long long)H, (long long)Hkv, (long long)ncu,
          sinks ? ", sinks" : "", eq, ek, ev, es);
    free(ds.data);
    free(dq.data);
    free(dk.data);
    free(dv.data);
  }
  free(out.data);
  free(lse.data);
  free(qs);
  free(ks);
  free(vs);
  free(dos);
  free(ro);
  free(rl);
  free(rdq);
  free(rdk);
  free(rdv);
  free(rds);
  free(q);
  free(k);
  free(v);
  free(dout);
  free(pos);
}

static void run_case(dattn_runtime* rt, dattn_layout_kind lk, dattn_mask_kind mk,
                     dattn_strategy strategy, int64_t H, int64_t Hkv, int64_t D, int64_t Dv,
                     int backward) {
  run_case_docs(rt, lk, mk, strategy, H, Hkv, D, Dv, backward, kDocs, 5, NULL, 0.0f);
}

/* ---------------------------------------------------------------- error paths */

/* The message of a thread's last call is its own. */
static void* other_thread(void* arg) {
  int64_t len = 0;
  dattn_status st = dattn_layout_shard_len(NULL, 1, 0, &len);
  int* ok = arg;
  *ok = st == DATTN_ERROR_INVALID_ARGUMENT && strstr(dattn_last_error(), "layout") != NULL;
  return NULL;
}

static void run_error_paths(dattn_runtime* rt) {
  const int64_t B = 1, S = 16, H = 4, Hkv = 2, D = 8;
  dattn_layout layout = {DATTN_LAYOUT_CONTIGUOUS, S, 0, NULL, 0};
  dattn_spec spec = {H, Hkv, D, 0, 0.0f, DATTN_MASK_CAUSAL, 0, 0, 0, NULL, 0, NULL, 0.0f, NULL, 0};
  int64_t n = 0;
  CHECK_OK(dattn_layout_shard_len(&layout, g_size, g_rank, &n));
  float* q = xmalloc(sizeof(float) * (size_t)(B * n * H * D));
  float* kv = xmalloc(sizeof(float) * (size_t)(B * n * Hkv * D));
  float* res = xmalloc(sizeof(float) * (size_t)(B * n * H * D));
  float* res2 = xmalloc(sizeof(float) * (size_t)(B * n * H * D));
  fill(q, B * n * H * D, 5);
  fill(kv, B * n * Hkv * D, 6);
  dattn_tensor tq = {q, DATTN_FP32, {B, n, H, D}};
  dattn_tensor tk = {kv, DATTN_FP32, {B, n, Hkv, D}};
  dattn_buffer out = {res, B * n * H * D};
  dattn_buffer lse = {res2, B * H * n};
  const int last = g_size - 1;

  /* NULL runtime: local (there is no communicator to agree over). */
  CHECK_FAILS(
      dattn_attention_forward(NULL, &tq, &tk, &tk, &spec, &layout, DATTN_STRATEGY_RING, out, lse),
      DATTN_ERROR_INVALID_ARGUMENT, "runtime");
  CHECK_FAILS(dattn_runtime_create(MPI_COMM_WORLD, NULL, NULL), DATTN_ERROR_INVALID_ARGUMENT,
              "runtime");
  CHECK_FAILS(dattn_runtime_cp(NULL, NULL, NULL), DATTN_ERROR_INVALID_ARGUMENT, "runtime");

  /* NULL tensor data on the last rank only: every rank fails, naming q.data. */
  {
    dattn_tensor bad = tq;
    if (g_rank == last) bad.data = NULL;
    CHECK_FAILS(
        dattn_attention_forward(rt, &bad, &tk, &tk, &spec, &layout, DATTN_STRATEGY_RING, out, lse),
        DATTN_ERROR_INVALID_ARGUMENT, "q.data");
    CHECK_FAILS(
        dattn_attention_forward(rt, &tq, NULL, &tk, &spec, &layout, DATTN_STRATEGY_RING, out, lse),
        DATTN_ERROR_INVALID_ARGUMENT, "invalid k = NULL");
  }
  /* A bad dtype enum. */
  {
    dattn_tensor bad = tq;
    bad.dtype = (dattn_dtype)7;
    CHECK_FAILS(
        dattn_attention_forward(rt, &bad, &tk, &tk, &spec, &layout, DATTN_STRATEGY_RING, out, lse),
        DATTN_ERROR_INVALID_ARGUMENT, "q.dtype");
    /* Mixed dtypes (fp32 q, bf16 k) name k's dtype. */
    dattn_tensor k16 = tk;
    k16.dtype = DATTN_BF16;
    CHECK_FAILS(
        dattn_attention_forward(rt, &tq, &k16, &tk, &spec, &layout, DATTN_STRATEGY_RING, out, lse),
        DATTN_ERROR_INVALID_ARGUMENT, "k dtype");
  }
  /* heads_q not a multiple of heads_kv. */
  {
    dattn_spec bad = spec;
    bad.heads_q = 3;
    CHECK_FAILS(
        dattn_attention_forward(rt, &tq, &tk, &tk, &bad, &layout, DATTN_STRATEGY_RING, out, lse),
        DATTN_ERROR_INVALID_ARGUMENT, "heads_q");
  }
  /* Ulysses needs heads_kv a multiple or a divisor of the ranks (2 kv heads: fails on 3 ranks
     only; 4 ranks share each kv head between two of them). */
  if (Hkv % g_size != 0 && g_size % Hkv != 0)
    CHECK_FAILS(dattn_attention_forward(rt, &tq, &tk, &tk, &spec, &layout, DATTN_STRATEGY_ULYSSES,
                                        out, lse),
                DATTN_ERROR_INVALID_ARGUMENT, "heads_kv");
  /* The wrong shard length on rank 0 only: every rank fails, naming q's seq. */
  {
    dattn_tensor bad_q = tq, bad_k = tk;
    dattn_buffer bad_out = out, bad_lse = lse;
    float* big = xmalloc(sizeof(float) * (size_t)(B * (n + 1) * H * D));
    float* big_lse = xmalloc(sizeof(float) * (size_t)(B * H * (n + 1)));
    float* big_k = xmalloc(sizeof(float) * (size_t)(B * (n + 1) * Hkv * D));
    fill(big, B * (n + 1) * H * D, 7);
    fill(big_k, B * (n + 1) * Hkv * D, 8);
    if (g_rank == 0) {
      bad_q.data = big;
      bad_q.shape[1] = n + 1;
      bad_k.data = big_k;
      bad_k.shape[1] = n + 1;
      bad_out.data = big;
      bad_out.numel = B * (n + 1) * H * D;
      bad_lse.data = big_lse;
      bad_lse.numel = B * H * (n + 1);
    }
    CHECK_FAILS(dattn_attention_forward(rt, &bad_q, &bad_k, &bad_k, &spec, &layout,
                                        DATTN_STRATEGY_RING, bad_out, bad_lse),
                DATTN_ERROR_INVALID_ARGUMENT, "q seq");
    free(big);
    free(big_lse);
    free(big_k);
  }
  /* Output buffers of the wrong size, or NULL. */
  {
    dattn_buffer small = out;
    small.numel -= 1;
    CHECK_FAILS(
        dattn_attention_forward(rt, &tq, &tk, &tk, &spec, &layout, DATTN_STRATEGY_RING, small, lse),
        DATTN_ERROR_INVALID_ARGUMENT, "out.numel");
    dattn_buffer null_lse = {NULL, lse.numel};
    if (lse.numel > 0)
      CHECK_FAILS(dattn_attention_forward(rt, &tq, &tk, &tk, &spec, &layout, DATTN_STRATEGY_RING,
                                          out, null_lse),
                  DATTN_ERROR_INVALID_ARGUMENT, "lse.data");
  }
  /* Bad enums: layout kind, mask kind, strategy; a negative shape; a window without sizes. */
  {
    dattn_layout bad_layout = layout;
    bad_layout.kind = (dattn_layout_kind)9;
    CHECK_FAILS(dattn_attention_forward(rt, &tq, &tk, &tk, &spec, &bad_layout, DATTN_STRATEGY_RING,
                                        out, lse),
                DATTN_ERROR_INVALID_ARGUMENT, "layout.kind");
    dattn_spec bad_mask = spec;
    bad_mask.mask = (dattn_mask_kind)-1;
    CHECK_FAILS(dattn_attention_forward(rt, &tq, &tk, &tk, &bad_mask, &layout, DATTN_STRATEGY_RING,
                                        out, lse),
                DATTN_ERROR_INVALID_ARGUMENT, "spec.mask");
    CHECK_FAILS(
        dattn_attention_forward(rt, &tq, &tk, &tk, &spec, &layout, (dattn_strategy)5, out, lse),
        DATTN_ERROR_INVALID_ARGUMENT, "strategy");
    dattn_tensor neg = tq;
    neg.shape[2] = -4;
    CHECK_FAILS(
        dattn_attention_forward(rt, &neg, &tk, &tk, &spec, &layout, DATTN_STRATEGY_RING, out, lse),
        DATTN_ERROR_INVALID_ARGUMENT, "q.shape[2]");
    dattn_spec bad_window = spec;
    bad_window.mask = DATTN_MASK_WINDOW;
    bad_window.window_left = -3;
    CHECK_FAILS(dattn_attention_forward(rt, &tq, &tk, &tk, &bad_window, &layout,
                                        DATTN_STRATEGY_RING, out, lse),
                DATTN_ERROR_INVALID_ARGUMENT, "spec.window_left");
    dattn_spec no_docs = spec;
    no_docs.mask = DATTN_MASK_DOCUMENT;
    CHECK_FAILS(dattn_attention_forward(rt, &tq, &tk, &tk, &no_docs, &layout, DATTN_STRATEGY_RING,
                                        out, lse),
                DATTN_ERROR_INVALID_ARGUMENT, "spec.cu_seqlens");
    /* Repeated boundaries are empty documents; a decreasing one is an error naming its index. */
    const int64_t down[4] = {0, 5, 4, S};
    dattn_spec decreasing = no_docs;
    decreasing.cu_seqlens = down;
    decreasing.num_cu_seqlens = 4;
    CHECK_FAILS(dattn_attention_forward(rt, &tq, &tk, &tk, &decreasing, &layout,
                                        DATTN_STRATEGY_RING, out, lse),
                DATTN_ERROR_INVALID_ARGUMENT, "cu_seqlens[2] = 4");
  }
#ifndef __SANITIZE_ADDRESS__ /* AddressSanitizer reports an allocation this large, not fails it */
  /* Arguments on the last rank that need more memory than there is (2^56 document boundaries):
   * every rank fails with the status of that rank's error, out of memory. */
  {
    const int64_t cu[3] = {0, 8, S};
    dattn_spec huge = spec;
    huge.mask = DATTN_MASK_DOCUMENT;
    huge.cu_seqlens = cu;
    huge.num_cu_seqlens = g_rank == last ? (int64_t)1 << 56 : 3;
    CHECK_FAILS(
        dattn_attention_forward(rt, &tq, &tk, &tk, &huge, &layout, DATTN_STRATEGY_RING, out, lse),
        DATTN_ERROR_OUT_OF_MEMORY, "out of memory");
  }
#endif
  /* Layout helpers. */
  {
    int64_t len = 0;
    CHECK_FAILS(dattn_layout_shard_len(&layout, 2, 2, &len), DATTN_ERROR_INVALID_ARGUMENT, "rank");
    CHECK_FAILS(dattn_layout_shard_len(&layout, 1, 0, NULL), DATTN_ERROR_INVALID_ARGUMENT,
                "shard_len");
    int64_t pos[16];
    CHECK_FAILS(dattn_layout_positions(&layout, 1, 0, pos, 15), DATTN_ERROR_INVALID_ARGUMENT,
                "count");
    dattn_layout varlen = {DATTN_LAYOUT_VARLEN, 0, 0, NULL, 0};
    CHECK_FAILS(dattn_layout_shard_len(&varlen, 1, 0, &len), DATTN_ERROR_INVALID_ARGUMENT,
                "layout.cu_seqlens");
  }
  /* Backward: NULL dout, NULL lse, a dq buffer of the wrong size. */
  {
    CHECK_OK(
        dattn_attention_forward(rt, &tq, &tk, &tk, &spec, &layout, DATTN_STRATEGY_RING, out, lse));
    float* g = xmalloc(sizeof(float) * (size_t)(B * n * H * D));
    float* gk = xmalloc(sizeof(float) * (size_t)(B * n * Hkv * D));
    float* gv = xmalloc(sizeof(float) * (size_t)(B * n * Hkv * D));
    float* dout = xmalloc(sizeof(float) * (size_t)(B * n * H * D));
    fill(dout, B * n * H * D, 9);
    dattn_tensor tdo = {dout, DATTN_FP32, {B, n, H, D}};
    dattn_buffer dq = {g, B * n * H * D}, dk = {gk, B * n * Hkv * D}, dv = {gv, B * n * Hkv * D};
    const dattn_buffer none = {NULL, 0};
    CHECK_FAILS(dattn_attention_backward(rt, &tq, &tk, &tk, out.data, lse.data, NULL, &spec,
                                         &layout, DATTN_STRATEGY_RING, dq, dk, dv, none),
                DATTN_ERROR_INVALID_ARGUMENT, "dout");
    if (lse.numel > 0)
      CHECK_FAILS(dattn_attention_backward(rt, &tq, &tk, &tk, out.data, NULL, &tdo, &spec, &layout,
                                           DATTN_STRATEGY_RING, dq, dk, dv, none),
                  DATTN_ERROR_INVALID_ARGUMENT, "lse");
    dattn_buffer bad_dk = dk;
    bad_dk.numel += 1;
    CHECK_FAILS(dattn_attention_backward(rt, &tq, &tk, &tk, out.data, lse.data, &tdo, &spec,
                                         &layout, DATTN_STRATEGY_RING, dq, bad_dk, dv, none),
                DATTN_ERROR_INVALID_ARGUMENT, "dk.numel");
    /* dsinks without sinks; sinks without dsinks; sinks of a non-finite value. */
    float ds_data[4];
    const dattn_buffer ds = {ds_data, H};
    CHECK_FAILS(dattn_attention_backward(rt, &tq, &tk, &tk, out.data, lse.data, &tdo, &spec,
                                         &layout, DATTN_STRATEGY_RING, dq, dk, dv, ds),
                DATTN_ERROR_INVALID_ARGUMENT, "dsinks");
    {
      const float sinks[4] = {0.f, 1.f, 2.f, 3.f}, bad_sinks[4] = {0.f, 1.f, NAN, 3.f};
      dattn_spec with = spec;
      with.sinks = sinks;
      CHECK_FAILS(dattn_attention_backward(rt, &tq, &tk, &tk, out.data, lse.data, &tdo, &with,
                                           &layout, DATTN_STRATEGY_RING, dq, dk, dv, none),
                  DATTN_ERROR_INVALID_ARGUMENT, "dsinks.numel");
      with.sinks = bad_sinks;
      CHECK_FAILS(
          dattn_attention_forward(rt, &tq, &tk, &tk, &with, &layout, DATTN_STRATEGY_RING, out, lse),
          DATTN_ERROR_INVALID_ARGUMENT, "sinks[2]");
    }
    CHECK_OK(dattn_attention_backward(rt, &tq, &tk, &tk, out.data, lse.data, &tdo, &spec, &layout,
                                      DATTN_STRATEGY_RING, dq, dk, dv, none));
    free(g);
    free(gk);
    free(gv);
    free(dout);
  }
  /* Runtime options: a Ulysses degree that does not divide the ranks, on every rank. */
  if (g_size > 1) {
    dattn_runtime_options o = {0, g_size + 1, 0, 0, 0.0};
    dattn_runtime* bad = (dattn_runtime*)&o; /* must be overwritten with NULL */
    CHECK_FAILS(dattn_runtime_create(MPI_COMM_WORLD, &o, &bad), DATTN_ERROR_INVALID_ARGUMENT,
                "ulysses");
    CHECK(bad == NULL, "a failed create leaves NULL");
  }
  /* Messages are per thread: another thread's failure leaves this thread's message alone. */
  {
    CHECK_FAILS(dattn_runtime_cp(NULL, NULL, NULL), DATTN_ERROR_INVALID_ARGUMENT, "runtime");
    int ok = 0;
    pthread_t t;
    CHECK(pthread_create(&t, NULL, other_thread, &ok) == 0, "pthread_create");
    pthread_join(t, NULL);
    CHECK(ok, "the other thread saw its own error");
    CHECK(strstr(dattn_last_error(), "runtime") != NULL, "this thread's message survives");
    CHECK(strcmp(dattn_status_name(DATTN_ERROR_MPI), "MPI error") == 0, "status names");
  }
  /* Every status has its own name. */
  {
    static const char* names[] = {
        "ok",         "invalid argument", "MPI error", "out of memory", "internal error",
        "CUDA error", "NCCL error",       "timeout"};
    for (int s = 0; s <= DATTN_ERROR_TIMEOUT; ++s)
      CHECK(strcmp(dattn_status_name((dattn_status)s), names[s]) == 0, "status %d is \"%s\"", s,
            dattn_status_name((dattn_status)s));
    CHECK(strcmp(dattn_status_name((dattn_status)(DATTN_ERROR_TIMEOUT + 1)), "unknown status") == 0,
          "a value outside the enum");
  }
  /* After all these failures the runtime still works. */
  CHECK_OK(
      dattn_attention_forward(rt, &tq, &tk, &tk, &spec, &layout, DATTN_STRATEGY_RING, out, lse));
  free(q);
  free(kv);
  free(res);
  free(res2);
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);

  dattn_runtime* rt = NULL;
  CHECK_OK(dattn_runtime_create(MPI_COMM_WORLD, NULL, &rt));
  int cp_rank = -1, cp_size = -1;
  CHECK_OK(dattn_runtime_cp(rt, &cp_rank, &cp_size));
  CHECK(cp_rank == g_rank && cp_size == g_size, "cp rank %d of %d", cp_rank, cp_size);

  /* Every layout x mask with ring, GQA 4/2, head_dim_v != head_dim in half of them. */
  for (int lk = 0; lk < 4; ++lk)
    for (int mk = 0; mk < 5; ++mk)
      run_case(rt, (dattn_layout_kind)lk, (dattn_mask_kind)mk, DATTN_STRATEGY_RING, 4, 2, 16,
               (lk + mk) % 2 ? 8 : 16, 1);
  /* Ulysses with heads_kv = the ranks; MQA on the ring. */
  for (int mk = 0; mk < 5; ++mk)
    run_case(rt, DATTN_LAYOUT_ZIGZAG, (dattn_mask_kind)mk, DATTN_STRATEGY_ULYSSES, 2 * g_size,
             g_size, 16, 16, 1);
  run_case(rt, DATTN_LAYOUT_STRIPED, DATTN_MASK_CAUSAL, DATTN_STRATEGY_RING, 4, 1, 32, 32, 1);
  /* Empty documents: the document mask (and the varlen layout) on kEmptyDocs give the results of
   * kDocs, with the ring and with Ulysses. */
  for (int lk = 0; lk < 4; ++lk)
    run_case_docs(rt, (dattn_layout_kind)lk, DATTN_MASK_DOCUMENT, DATTN_STRATEGY_RING, 4, 2, 16, 8,
                  1, kEmptyDocs, 9, NULL, 0.0f);
  run_case_docs(rt, DATTN_LAYOUT_VARLEN, DATTN_MASK_DOCUMENT, DATTN_STRATEGY_ULYSSES, 2 * g_size,
                g_size, 16, 16, 1, kEmptyDocs, 9, NULL, 0.0f);
  {
    /* Attention sinks (one far above the scores) and a logit softcap, apart and together,
     * forward and backward, ring and Ulysses. */
    const float sinks[8] = {0.5f, -1.f, 6.f, 1.5f, -2.f, 0.f, 3.f, 1.f};
    for (int lk = 0; lk < 4; ++lk)
      run_case_docs(rt, (dattn_layout_kind)lk, DATTN_MASK_CAUSAL, DATTN_STRATEGY_RING, 4, 2, 16, 8,
                    1, kDocs, 5, lk == 3 ? NULL : sinks, lk == 0 ? 0.0f : 1.5f);
    if (g_size <= 4)
      run_case_docs(rt, DATTN_LAYOUT_ZIGZAG, DATTN_MASK_WINDOW, DATTN_STRATEGY_ULYSSES, 2 * g_size,
                    g_size, 16, 16, 1, kDocs, 5, sinks, 2.0f);
  }
  {
    /* A varlen layout on kEmptyDocs holds the tokens of one on kDocs, in the same places. */
    dattn_layout with = {DATTN_LAYOUT_VARLEN, 0, 0, kEmptyDocs, 9};
    dattn_layout without = {DATTN_LAYOUT_VARLEN, 0, 0, kDocs, 5};
    int64_t n = -1, m = -2;
    CHECK_OK(dattn_layout_shard_len(&with, g_size, g_rank, &n));
    CHECK_OK(dattn_layout_shard_len(&without, g_size, g_rank, &m));
    CHECK(n == m, "varlen shard of %lld tokens with empty documents, %lld without", (long long)n,
          (long long)m);
    int64_t* a = xmalloc(sizeof(int64_t) * (size_t)n);
    int64_t* b = xmalloc(sizeof(int64_t) * (size_t)n);
    CHECK_OK(dattn_layout_positions(&with, g_size, g_rank, a, n));
    CHECK_OK(dattn_layout_positions(&without, g_size, g_rank, b, n));
    CHECK(n == 0 || memcmp(a, b, sizeof(int64_t) * (size_t)n) == 0,
          "varlen positions differ with empty documents");
    free(a);
    free(b);
  }
  /* Hybrid with Ulysses degree 2 on an even number of ranks. */
  if (g_size % 2 == 0) {
    dattn_runtime* hy = NULL;
    dattn_runtime_options o = {1, 2, 0, 0, 0.0};
    CHECK_OK(dattn_runtime_create(MPI_COMM_WORLD, &o, &hy));
    for (int mk = 0; mk < 4; ++mk)
      run_case(hy, DATTN_LAYOUT_VARLEN, (dattn_mask_kind)mk, DATTN_STRATEGY_HYBRID, 4, 2, 16, 16,
               1);
    CHECK_OK(dattn_runtime_destroy(hy));
  }

  run_error_paths(rt);

  /* The non-finite check: a NaN in q on the last rank fails the call on every rank, naming it. */
  {
    dattn_runtime* checked = NULL;
    dattn_runtime_options o = {0, 0, 0, 1, 60.0};
    CHECK_OK(dattn_runtime_create(MPI_COMM_WORLD, &o, &checked));
    const int64_t B = 1, S = 12, H = 2, D = 8;
    dattn_layout layout = {DATTN_LAYOUT_ZIGZAG, S, 0, NULL, 0};
    dattn_spec spec = {H, H, D, 0, 0.0f, DATTN_MASK_CAUSAL, 0, 0, 0, NULL, 0, NULL, 0.0f, NULL, 0};
    int64_t n = 0;
    CHECK_OK(dattn_layout_shard_len(&layout, g_size, g_rank, &n));
    float* q = xmalloc(sizeof(float) * (size_t)(B * (n + 1) * H * D));
    float* res = xmalloc(sizeof(float) * (size_t)(B * (n + 1) * H * D));
    float* res2 = xmalloc(sizeof(float) * (size_t)(B * H * (n + 1)));
    fill(q, B * n * H * D, 9);
    dattn_tensor t = {q, DATTN_FP32, {B, n, H, D}};
    dattn_buffer out = {res, B * n * H * D};
    dattn_buffer lse = {res2, B * H * n};
    CHECK_OK(dattn_attention_forward(checked, &t, &t, &t, &spec, &layout, DATTN_STRATEGY_RING, out,
                                     lse));
    if (g_rank == g_size - 1) q[3] = NAN; /* zigzag of 12 tokens: every rank of 1-4 holds some */
    CHECK_FAILS(
        dattn_attention_forward(checked, &t, &t, &t, &spec, &layout, DATTN_STRATEGY_RING, out, lse),
        DATTN_ERROR_INVALID_ARGUMENT, "invalid q = nan");
    /* Bad option values are named. */
    dattn_runtime* bad = NULL;
    dattn_runtime_options b1 = {0, 0, 0, 2, 0.0};
    CHECK_FAILS(dattn_runtime_create(MPI_COMM_WORLD, &b1, &bad), DATTN_ERROR_INVALID_ARGUMENT,
                "options.check_finite");
    dattn_runtime_options b2 = {0, 0, 0, 0, -1.0};
    CHECK_FAILS(dattn_runtime_create(MPI_COMM_WORLD, &b2, &bad), DATTN_ERROR_INVALID_ARGUMENT,
                "options.timeout_s");
    CHECK_OK(dattn_runtime_destroy(checked));
    free(q);
    free(res);
    free(res2);
  }

  CHECK_OK(dattn_runtime_destroy(rt));
  CHECK_OK(dattn_runtime_destroy(NULL));
  if (g_rank == 0) printf("test_c_api: %d checks passed on rank 0 of %d\n", g_checks, g_size);
  MPI_Finalize();
  return 0;
}
