/* dattn's C API: distributed attention forward and backward over an MPI communicator, for C
 * programs and foreign-function interfaces. A C99 header (no C++ types); src/c_api.cpp implements
 * it over the C++ API of src/attention.h. Every call returns a dattn_status; the message of the
 * last failing call is dattn_last_error() (per thread). No C++ exception crosses this boundary.
 *
 *   dattn_runtime* rt;
 *   dattn_runtime_create(MPI_COMM_WORLD, NULL, &rt);
 *   dattn_spec spec = {.heads_q = 8, .heads_kv = 2, .head_dim = 64, .mask = DATTN_MASK_CAUSAL};
 *   dattn_layout layout = {.kind = DATTN_LAYOUT_ZIGZAG, .global_seq = 4096};
 *   ... q, k, v: this rank's shards [B, S_local, H, D] (dattn_layout_shard_len gives S_local)
 *   if (dattn_attention_forward(rt, &q, &k, &v, &spec, &layout, DATTN_STRATEGY_RING, out, lse))
 *     fprintf(stderr, "%s\n", dattn_last_error());
 *   dattn_runtime_destroy(rt);
 */
#ifndef DATTN_DATTN_H_
#define DATTN_DATTN_H_

#include <mpi.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status and errors */

/* One status per kind of error (the C++ library's dattn::ErrorKind). A call that fails because
 * of another rank (bad arguments there) returns that rank's status on every rank. */
typedef enum dattn_status {
  DATTN_OK = 0,
  DATTN_ERROR_INVALID_ARGUMENT = 1, /* a bad parameter; the message names it */
  DATTN_ERROR_MPI = 2,              /* an MPI call failed */
  DATTN_ERROR_OUT_OF_MEMORY = 3,    /* host or device memory ran out */
  DATTN_ERROR_INTERNAL = 4,         /* a dattn bug */
  DATTN_ERROR_CUDA = 5,             /* a CUDA runtime call failed */
  DATTN_ERROR_NCCL = 6,             /* an NCCL call failed */
  DATTN_ERROR_TIMEOUT = 7 /* a wait passed its deadline (the watchdog ends the job instead) */
} dattn_status;

/* The message of this thread's last dattn call: "" after a success, else what failed (the
 * parameter, its value and what was expected, the rank). Valid until this thread's next dattn
 * call other than dattn_last_error and dattn_status_name. Never NULL. */
const char* dattn_last_error(void);
/* "ok", "invalid argument", "MPI error", "out of memory", "internal error", "CUDA error",
 * "NCCL error", "timeout" ("unknown status" for any other value). */
const char* dattn_status_name(dattn_status status);

/* ---------------------------------------------------------------- runtime */

typedef struct dattn_runtime dattn_runtime; /* opaque */

/* Zero in any field means its default. */
typedef struct dattn_runtime_options {
  int tp;      /* tensor-parallel degree: the ranks form a cp x tp grid, tp fastest (default 1) */
  int ulysses; /* Ulysses degree of DATTN_STRATEGY_HYBRID: a divisor of the cp ranks (default 1) */
  int threads; /* OpenMP threads per rank (default: OMP_NUM_THREADS, else cores / ranks per node) */
  int check_finite; /* 1: scan the inputs of every call for NaN/inf and fail naming the first one
                     * (default 0; DATTN_CHECK_FINITE=1 in the environment turns it on too) */
  double timeout_s; /* the watchdog's deadline in seconds for any wait (default: DATTN_TIMEOUT,
                     * else 300); on expiry the job is aborted with a message (exit code 14) */
} dattn_runtime_options;

/* Creates a runtime over comm (duplicated; MPI must be initialised). Collective over comm.
 * options may be NULL (all defaults). On failure *runtime is NULL. */
dattn_status dattn_runtime_create(MPI_Comm comm, const dattn_runtime_options* options,
                                  dattn_runtime** runtime);
/* Releases the runtime (NULL is allowed). Collective over its communicator; call it before
 * MPI_Finalize. */
dattn_status dattn_runtime_destroy(dattn_runtime* runtime);
/* This rank's index and the number of ranks in the runtime's context-parallel group (either
 * pointer may be NULL). */
dattn_status dattn_runtime_cp(const dattn_runtime* runtime, int* cp_rank, int* cp_size);

/* ---------------------------------------------------------------- tensors */

typedef enum dattn_dtype { DATTN_FP32 = 0, DATTN_BF16 = 1, DATTN_FP16 = 2 } dattn_dtype;

/* An input: a contiguous row-major view of caller memory, shape [batch, seq, heads, head_dim]
 * (bshd). bf16 and fp16 elements are their 16-bit patterns. */
typedef struct dattn_tensor {
  const void* data;
  dattn_dtype dtype;
  int64_t shape[4];
} dattn_tensor;

/* An output: caller memory for `numel` fp32 values; numel must be the result's exact size. */
typedef struct dattn_buffer {
  float* data;
  int64_t numel;
} dattn_buffer;

/* ---------------------------------------------------------------- layouts */

typedef enum dattn_layout_kind {
  DATTN_LAYOUT_CONTIGUOUS = 0, /* rank r holds one contiguous range */
  DATTN_LAYOUT_ZIGZAG = 1,     /* 2P chunks: rank r holds chunks r and 2P-1-r */
  DATTN_LAYOUT_STRIPED = 2,    /* round-robin blocks of stripe_block tokens */
  DATTN_LAYOUT_VARLEN = 3      /* documents (cu_seqlens), each cut zigzag over the ranks */
} dattn_layout_kind;

typedef struct dattn_layout {
  dattn_layout_kind kind;
  int64_t global_seq;        /* tokens in the whole sequence; varlen: 0 or cu_seqlens[num - 1] */
  int64_t stripe_block;      /* striped: tokens per block (0 means 1); else ignored */
  const int64_t* cu_seqlens; /* varlen: document boundaries [0, e1, ..., S], non-decreasing (a
                                repeated entry is an empty document); else ignored */
  int64_t num_cu_seqlens;    /* entries in cu_seqlens (documents + 1) */
} dattn_layout;

/* The number of tokens rank `rank` of `ranks` holds under the layout. */
dattn_status dattn_layout_shard_len(const dattn_layout* layout, int ranks, int rank,
                                    int64_t* shard_len);
/* The global positions of those tokens, in local order, into positions[0 .. count); count must
 * be the shard length. */
dattn_status dattn_layout_positions(const dattn_layout* layout, int ranks, int rank,
                                    int64_t* positions, int64_t count);

/* ---------------------------------------------------------------- spec */

typedef enum dattn_mask_kind {
  DATTN_MASK_NONE = 0,
  DATTN_MASK_CAUSAL = 1,
  DATTN_MASK_WINDOW = 2,   /* keys from q - window_left to q + window_right (0, 0: only q itself) */
  DATTN_MASK_DOCUMENT = 3, /* a token sees its own document only (cu_seqlens); causal inside it
                              when document_causal is non-zero */
  DATTN_MASK_SLICES = 4    /* a slice mask (slices): a query sees the keys of the slices it is in */
} dattn_mask_kind;

typedef struct dattn_spec {
  int64_t heads_q; /* a multiple of heads_kv (GQA/MQA) */
  int64_t heads_kv;
  int64_t head_dim;    /* of q and k */
  int64_t head_dim_v;  /* of v and out; 0 means head_dim */
  float softmax_scale; /* 0 means 1 / sqrt(head_dim) */
  dattn_mask_kind mask;
  int64_t window_left, window_right; /* DATTN_MASK_WINDOW: >= 0 each */
  int document_causal;               /* DATTN_MASK_DOCUMENT */
  const int64_t* cu_seqlens;         /* DATTN_MASK_DOCUMENT: [0, e1, ..., S], S the global seq,
                                        non-decreasing (a repeated entry: an empty document) */
  int64_t num_cu_seqlens;
  const float* sinks;    /* attention sinks: heads_q finite logits, one per query head, each joining
                            its rows' softmax as a key with no value (lse counts it; a row of no key:
                            out 0, lse the sink); NULL: none */
  float softcap;         /* logit softcap: > 0, scores become softcap * tanh(s / softcap) before the
                            mask and softmax (Gemma 2); 0: off */
  const int64_t* slices; /* DATTN_MASK_SLICES: num_slices rectangles of 5 values each, q_begin,
                            q_end, k_begin, k_end (global positions) and kind: 0 full, 1 causal
                            (bottom-right aligned: the last query sees every key), 2 inverse
                            causal (top-left aligned), 3 bi-causal (both); none may overlap */
  int64_t num_slices;
} dattn_spec;

/* ---------------------------------------------------------------- attention */

typedef enum dattn_strategy {
  DATTN_STRATEGY_RING = 0,    /* K/V blocks rotate around the ranks */
  DATTN_STRATEGY_ULYSSES = 1, /* all-to-all to head shards (heads_kv divisible by the ranks) */
  DATTN_STRATEGY_HYBRID = 2 /* Ulysses inside groups of the runtime's ulysses degree, ring across */
} dattn_strategy;

/* Distributed attention forward. Collective over the runtime's cp group: every rank passes the
 * same spec, layout, strategy, batch and dtype. q [B, S_local, heads_q, head_dim], k
 * [B, S_local, heads_kv, head_dim], v [B, S_local, heads_kv, head_dim_v], all of one dtype, are
 * this rank's shards under the layout. Writes this rank's out [B, S_local, heads_q, head_dim_v]
 * and lse [B, heads_q, S_local] (natural log; -inf for a query that sees no key), both fp32.
 * Bad arguments on any rank fail the call on every rank with the same status. */
dattn_status dattn_attention_forward(dattn_runtime* runtime, const dattn_tensor* q,
                                     const dattn_tensor* k, const dattn_tensor* v,
                                     const dattn_spec* spec, const dattn_layout* layout,
                                     dattn_strategy strategy, dattn_buffer out, dattn_buffer lse);

/* Distributed attention backward, with the arguments of the forward call that produced out
 * [B, S_local, heads_q, head_dim_v] and lse [B, heads_q, S_local] (fp32), and dout, the gradient
 * of out (any dtype, the shape of out). Writes dq (the shape of q), dk (of k) and dv (of v), fp32;
 * for GQA dk and dv sum over each group's query heads; with spec->sinks, dsinks (heads_q fp32,
 * summed over every rank's rows, the same on each), else dsinks must be {NULL, 0}. Repeated calls
 * give bit-identical results. */
dattn_status dattn_attention_backward(dattn_runtime* runtime, const dattn_tensor* q,
                                      const dattn_tensor* k, const dattn_tensor* v,
                                      const float* out, const float* lse, const dattn_tensor* dout,
                                      const dattn_spec* spec, const dattn_layout* layout,
                                      dattn_strategy strategy, dattn_buffer dq, dattn_buffer dk,
                                      dattn_buffer dv, dattn_buffer dsinks);

#ifdef __cplusplus
}
#endif

#endif /* DATTN_DATTN_H_ */
