// The dispatch layer (src/dispatch.h): the CPU kernels, memcpy and movement::host for host
// memory; the CUDA kernels, the CUDA runtime and movement::cuda for GPU memory, on the current
// stream (src/base/stream.h: the Runtime's). The one file of src/ that picks a kernel by the
// device.
#include "src/dispatch.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/attention_backward_cpu.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/decode_cpu.h"
#include "kernels/cpu/mla_cpu.h"
#include "kernels/cuda/limits.h"
#include "kernels/merge.h"
#include "kernels/movement/movement.h"
#include "src/base/error.h"
#include "src/base/stream.h"
#if DATTN_WITH_CUDA
#include "kernels/cuda/attention_backward_cuda.h"
#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/decode_cuda.h"
#include "kernels/cuda/mla_decode_cuda.h"
#include "src/base/cuda_check.h"
#endif

namespace dattn {

#if DATTN_WITH_CUDA
namespace {
// The stream of this call's device work: the Runtime's (src/base/stream.h).
cudaStream_t device_stream() {
  return static_cast<cudaStream_t>(current_stream());
}
}  // namespace
#else
namespace {
// The error of a GPU pointer in a build without the CUDA backend (such tensors cannot be made
// there, so this names a caller's bug rather than a user's choice).
[[noreturn]] void no_cuda(Device device) {
  DATTN_THROW("invalid device = ", device.str(), ": this build has no CUDA backend");
}
}  // namespace
#endif

void copy_bytes(void* dst, const void* src, size_t bytes, Device device) {
  if (bytes == 0) return;  // an empty buffer may have no data (memcpy takes no null)
  if (device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if DATTN_WITH_CUDA
  // Stream-ordered with the kernel that wrote src and the NCCL call that reads dst (header).
  DATTN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, device_stream()));
#else
  no_cuda(device);
#endif
}

void zero_floats(float* p, size_t n, Device device) {
  if (n == 0) return;
  if (device.is_cpu()) {
    std::memset(p, 0, n * sizeof(float));
    return;
  }
#if DATTN_WITH_CUDA
  DATTN_CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(float), device_stream()));
#else
  no_cuda(device);
#endif
}

void add_floats(float* out, const float* a, const float* b, size_t n, Device device) {
  if (device.is_cpu()) {
    movement::host::add_floats(out, a, b, int64_t(n));
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::add_floats(out, a, b, int64_t(n), device_stream());
#else
  no_cuda(device);
#endif
}

Tensor as_f32(const Tensor& t) {
  if (t.dtype() == DType::f32) return t;
  if (t.device().is_cpu()) return t.to(DType::f32);
#if DATTN_WITH_CUDA
  Tensor out = Tensor::empty_like(t, DType::f32);
  movement::cuda::widen_16(out.ptr<float>(), static_cast<const uint16_t*>(t.data()), t.numel(),
                           t.dtype() == DType::bf16, device_stream());
  return out;
#else
  no_cuda(t.device());
#endif
}

void copy_rows(void* dst, Device dst_device, int64_t dst_seq, int64_t dst_row0, const void* src,
               Device src_device, int64_t src_seq, int64_t src_row0, int64_t batch, int64_t rows,
               size_t row_bytes) {
  if (rows == 0 || batch == 0) return;  // an empty shard's tensors may have no data
  char* d = static_cast<char*>(dst) + size_t(dst_row0) * row_bytes;
  const char* s = static_cast<const char*>(src) + size_t(src_row0) * row_bytes;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    for (int64_t b = 0; b < batch; ++b)
      std::memcpy(d + size_t(b * dst_seq) * row_bytes, s + size_t(b * src_seq) * row_bytes,
                  size_t(rows) * row_bytes);
    return;
  }
#if DATTN_WITH_CUDA
  // One 2-D copy: `batch` blocks of rows * row_bytes contiguous bytes, at pitches of a batch
  // entry on each side. cudaMemcpyDefault: unified addressing tells host from device pointers.
  // On the current stream, so a decode step queued after it sees the rows; a copy from pageable
  // host memory has read it on return, and one to the host waits for the stream (the host reads
  // the rows next). cudaMemcpy2D takes pitches below 2^31 bytes only (cudaDevAttrMaxPitch); a
  // batch entry of a long cache may be larger: one copy per entry then.
  cudaStream_t stream = device_stream();
  const size_t dst_pitch = size_t(dst_seq) * row_bytes, src_pitch = size_t(src_seq) * row_bytes;
  const size_t width = size_t(rows) * row_bytes;
  constexpr size_t kMaxPitch = (size_t(1) << 31) - 1;
  if (batch == 1 || dst_pitch > kMaxPitch || src_pitch > kMaxPitch) {
    for (int64_t b = 0; b < batch; ++b)
      DATTN_CUDA_CHECK(cudaMemcpyAsync(d + size_t(b) * dst_pitch, s + size_t(b) * src_pitch, width,
                                       cudaMemcpyDefault, stream));
  } else {
    DATTN_CUDA_CHECK(cudaMemcpy2DAsync(d, dst_pitch, s, src_pitch, width, size_t(batch),
                                       cudaMemcpyDefault, stream));
  }
  if (dst_device.is_cpu()) DATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  return;
#else
  no_cuda(dst_device.is_cpu() ? src_device : dst_device);
#endif
}

void pack_rows(Device device, void* buf, const void* src, int64_t outer, int64_t inner,
               size_t outer_stride, size_t inner_stride, size_t row_bytes) {
  if (device.is_cpu()) {
    movement::host::pack_rows(buf, src, outer, inner, outer_stride, inner_stride, row_bytes);
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::pack_rows(buf, src, outer, inner, outer_stride, inner_stride, row_bytes,
                            device_stream());
#else
  no_cuda(device);
#endif
}

void unpack_rows(Device device, void* dst, const void* buf, int64_t outer, int64_t inner,
                 size_t outer_stride, size_t inner_stride, size_t row_bytes) {
  if (device.is_cpu()) {
    movement::host::unpack_rows(dst, buf, outer, inner, outer_stride, inner_stride, row_bytes);
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::unpack_rows(dst, buf, outer, inner, outer_stride, inner_stride, row_bytes,
                              device_stream());
#else
  no_cuda(device);
#endif
}

void merge_partials(Device device, float* out_a, float* lse_a, const float* out_b,
                    const float* lse_b, int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  if (device.is_cpu()) {
    movement::host::merge_partials(out_a, lse_a, out_b, lse_b, batch, seq, heads, dv);
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::merge_partials(out_a, lse_a, out_b, lse_b, batch, seq, heads, dv,
                                 device_stream());
#else
  no_cuda(device);
#endif
}

void weigh_partial(Device device, float* packed, const float* out, const float* lse, const float* m,
                   int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  if (device.is_cpu()) {
    movement::host::weigh_partial(packed, out, lse, m, batch, seq, heads, dv);
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::weigh_partial(packed, out, lse, m, batch, seq, heads, dv, device_stream());
#else
  no_cuda(device);
#endif
}

void unweigh_partial(Device device, float* out, float* lse, const float* packed, const float* m,
                     int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  if (device.is_cpu()) {
    movement::host::unweigh_partial(out, lse, packed, m, batch, seq, heads, dv);
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::unweigh_partial(out, lse, packed, m, batch, seq, heads, dv, device_stream());
#else
  no_cuda(device);
#endif
}

// ================================================================== kernels

namespace {
std::atomic<uint64_t> g_kernel_ns{0}, g_kernel_bytes{0}, g_kernel_calls{0};

// One kernel call in kernel_stats(): its bytes and the call at construction, on a host device
// the wall time until destruction (the end of the calling function's scope).
class CountedCall {
 public:
  CountedCall(Device device, uint64_t bytes) : host_(device.is_cpu()) {
    g_kernel_bytes.fetch_add(bytes, std::memory_order_relaxed);
    g_kernel_calls.fetch_add(1, std::memory_order_relaxed);
    if (host_) t0_ = std::chrono::steady_clock::now();
  }
  ~CountedCall() {
    if (!host_) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - t0_);
    g_kernel_ns.fetch_add(uint64_t(ns.count()), std::memory_order_relaxed);
  }
  CountedCall(const CountedCall&) = delete;
  CountedCall& operator=(const CountedCall&) = delete;

 private:
  bool host_;
  std::chrono::steady_clock::time_point t0_;
};

// The K/V bytes attend_runs streams at least once (kernel_stats in the header).
uint64_t run_bytes(const Tensor& q, const std::vector<Run>& q_runs, const std::vector<Run>& k_runs,
                   const AttnSpec& spec) {
  int64_t q_rows = 0, k_rows = 0;
  for (const Run& r : q_runs)
    q_rows += r.length;
  for (const Run& r : k_runs)
    k_rows += r.length;
  if (q_rows == 0) return 0;
  return uint64_t(k_rows * q.size(0) * spec.heads_kv * (spec.head_dim + spec.dim_v())) *
         dtype_size(q.dtype());
}
}  // namespace

KernelStats kernel_stats() {
  return {double(g_kernel_ns.load(std::memory_order_relaxed)) * 1e-9,
          g_kernel_bytes.load(std::memory_order_relaxed),
          g_kernel_calls.load(std::memory_order_relaxed)};
}

void reset_kernel_stats() {
  g_kernel_ns.store(0, std::memory_order_relaxed);
  g_kernel_bytes.store(0, std::memory_order_relaxed);
  g_kernel_calls.store(0, std::memory_order_relaxed);
}

void clear_partial(Partial& p) {
  if (p.out.device().is_cpu()) {
    clear_partial(p.out.ptr<float>(), p.lse.ptr<float>(), p.out.size(0), p.out.size(1),
                  p.out.size(2), p.out.size(3));
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::clear_partial(p.out.ptr<float>(), p.out.numel(), p.lse.ptr<float>(),
                                p.lse.numel(), device_stream());
#else
  no_cuda(p.out.device());
#endif
}

void add_sinks(Partial& p, const std::vector<float>& sinks) {
  if (!p.out.defined()) return;
  const int64_t B = p.out.size(0), S = p.out.size(1), H = p.out.size(2), Dv = p.out.size(3);
  DATTN_ASSERT(int64_t(sinks.size()) == H);
  if (p.out.device().is_cpu()) {
    movement::host::add_sinks(p.out.ptr<float>(), p.lse.ptr<float>(), sinks.data(), B, S, H, Dv);
    return;
  }
#if DATTN_WITH_CUDA
  // The sinks to device memory, one small copy per call (from pageable memory: read when the call
  // returns); freed on return in the order of the stream, after the kernel that reads them
  // (src/base/tensor.h).
  const Tensor s = byte_buffer(sinks.size() * sizeof(float), p.out.device());
  DATTN_CUDA_CHECK(cudaMemcpyAsync(s.data(), sinks.data(), sinks.size() * sizeof(float),
                                   cudaMemcpyHostToDevice, device_stream()));
  movement::cuda::add_sinks(p.out.ptr<float>(), p.lse.ptr<float>(), s.ptr<float>(), B, S, H, Dv,
                            device_stream());
#else
  no_cuda(p.out.device());
#endif
}

Partial empty_partial(const Tensor& q, const AttnSpec& spec) {
  const int64_t B = q.size(0), S = q.size(1);
  Partial p{Tensor::empty({B, S, spec.heads_q, spec.dim_v()}, DType::f32, q.device()),
            Tensor::empty({B, spec.heads_q, S}, DType::f32, q.device())};
  clear_partial(p);
  return p;
}

namespace {
// The kernel arguments shared by every block of one call (cpu:: or cuda::AttentionBlock, both a
// BlockOfWork): tensors, shapes, scale, and the CPU block's mask (the GPU's is set by the caller:
// its documents live in device memory).
template <typename Block>
Block make_block(const Tensor& q, const void* k, const void* v, int64_t k_rows,
                 const AttnSpec& spec) {
  Block blk;
  blk.q = q.data();
  blk.k = k;
  blk.v = v;
  blk.dtype = q.dtype();
  blk.batch = q.size(0);
  blk.seq_q = q.size(1);
  blk.seq_k = k_rows;
  blk.heads_q = spec.heads_q;
  blk.heads_kv = spec.heads_kv;
  blk.head_dim = spec.head_dim;
  blk.head_dim_v = spec.dim_v();
  blk.scale = spec.scale();
  blk.softcap = spec.softcap;
  if constexpr (std::is_same_v<Block, cpu::AttentionBlock>) blk.mask = spec.mask;
  return blk;
}

// Points blk at the query run qr and the key run kr (rows and global positions).
void set_runs(BlockOfWork& blk, const Run& qr, const Run& kr) {
  blk.q_begin = qr.local_begin;
  blk.q_len = qr.length;
  blk.q_pos0 = qr.global_begin;
  blk.q_pos_stride = qr.stride;
  blk.q_pos_block = qr.block;
  blk.k_begin = kr.local_begin;
  blk.k_len = kr.length;
  blk.k_pos0 = kr.global_begin;
  blk.k_pos_stride = kr.stride;
  blk.k_pos_block = kr.block;
}

#if DATTN_WITH_CUDA
// The mask's document boundaries in device memory, as the CUDA kernels read them (one copy per
// call, from pageable memory: read when the call returns; undefined without documents). Freed with
// the last copy of the tensor, in the order of the stream (src/base/tensor.h): after the kernels
// queued before, without a host wait.
Tensor device_cu_seqlens(const Mask& mask, Device device) {
  if (!mask.documents) return {};
  const std::vector<int64_t>& docs = *mask.documents;
  Tensor cu = byte_buffer(docs.size() * sizeof(int64_t), device);
  DATTN_CUDA_CHECK(cudaMemcpyAsync(cu.data(), docs.data(), docs.size() * sizeof(int64_t),
                                   cudaMemcpyHostToDevice, device_stream()));
  return cu;
}

// attend_runs on a GPU, on the current stream (the header says why). A kernel queued after
// Communicator::start() overlaps the messages of its own step (src/strategies/ring.cpp). A run of
// few query rows (a decode step, star's phase 2) goes to the split-KV decode kernel, which fills
// the GPU over the keys; longer runs to the forward, whose grid is over query tiles.
void attend_runs_cuda(const Tensor& q, const std::vector<Run>& q_runs, const void* k, const void* v,
                      int64_t k_rows, const std::vector<Run>& k_runs, const AttnSpec& spec,
                      Partial& res) {
  auto blk = make_block<cuda::AttentionBlock>(q, k, v, k_rows, spec);
  const Tensor cu_seqlens = device_cu_seqlens(spec.mask, q.device());
  cuda::set_mask(blk, spec.mask, static_cast<const int64_t*>(cu_seqlens.data()));
  for (const Run& qr : q_runs) {
    const bool decode = cuda::decode_kernel_fits(qr.length);
    for (const Run& kr : k_runs) {
      set_runs(blk, qr, kr);
      if (decode)
        cuda::decode_forward(blk, res.out.ptr<float>(), res.lse.ptr<float>(), device_stream());
      else
        cuda::attention_forward(blk, res.out.ptr<float>(), res.lse.ptr<float>(), device_stream());
    }
  }
  // The kernels read cu_seqlens until they finish; its storage is freed on return, in the order
  // of the stream where they run (src/base/tensor.h): after them, without a host wait.
}
#endif

}  // namespace

void attend_runs(const Tensor& q, const std::vector<Run>& q_runs, const void* k, const void* v,
                 int64_t k_rows, const std::vector<Run>& k_runs, const AttnSpec& spec,
                 Partial& res) {
  const CountedCall counted(q.device(), run_bytes(q, q_runs, k_runs, spec));
  if (!q.device().is_cpu()) {
#if DATTN_WITH_CUDA
    attend_runs_cuda(q, q_runs, k, v, k_rows, k_runs, spec, res);
    return;
#else
    no_cuda(q.device());
#endif
  }
  // A few query rows against many keys: the decode kernel (one pass over the keys for all the
  // query heads of a kv head); longer query blocks: the tile kernel.
  auto blk = make_block<cpu::AttentionBlock>(q, k, v, k_rows, spec);
  for (const Run& qr : q_runs) {
    const bool decode = cpu::decode_kernel_wins(qr.length);
    for (const Run& kr : k_runs) {
      set_runs(blk, qr, kr);
      if (decode)
        cpu::decode_forward(blk, res.out.ptr<float>(), res.lse.ptr<float>());
      else
        cpu::attention_forward(blk, res.out.ptr<float>(), res.lse.ptr<float>());
    }
  }
}

void backward_runs(const Tensor& q, const std::vector<Run>& q_runs, const void* k, const void* v,
                   int64_t k_rows, const std::vector<Run>& k_runs, const Tensor& dout,
                   const float* lse, const float* delta, const AttnSpec& spec, float* dq, float* dk,
                   float* dv) {
  if (!q.device().is_cpu()) {
#if DATTN_WITH_CUDA
    auto blk = make_block<cuda::AttentionBlock>(q, k, v, k_rows, spec);
    const Tensor cu_seqlens = device_cu_seqlens(spec.mask, q.device());
    cuda::set_mask(blk, spec.mask, static_cast<const int64_t*>(cu_seqlens.data()));
    for (const Run& qr : q_runs) {
      for (const Run& kr : k_runs) {
        set_runs(blk, qr, kr);
        cuda::attention_backward(blk, dout.data(), dout.dtype(), lse, delta, dq, dk, dv,
                                 device_stream());
      }
    }
    return;
#else
    no_cuda(q.device());
#endif
  }
  auto blk = make_block<cpu::AttentionBlock>(q, k, v, k_rows, spec);
  for (const Run& qr : q_runs) {
    for (const Run& kr : k_runs) {
      set_runs(blk, qr, kr);
      cpu::attention_backward(blk, dout.data(), dout.dtype(), lse, delta, dq, dk, dv);
    }
  }
}

Tensor backward_delta(const Tensor& dout, const Tensor& out) {
  const int64_t B = out.size(0), S = out.size(1), H = out.size(2);
  Tensor delta = Tensor::empty({B, H, S}, DType::f32, out.device());
  if (!out.device().is_cpu()) {
#if DATTN_WITH_CUDA
    cuda::attention_backward_delta(dout.data(), dout.dtype(), out.ptr<float>(), B, S, H,
                                   out.size(3), delta.ptr<float>(), device_stream());
    return delta;
#else
    no_cuda(out.device());
#endif
  }
  cpu::attention_backward_delta(dout.data(), dout.dtype(), out.ptr<float>(), B, S, H, out.size(3),
                                delta.ptr<float>());
  return delta;
}

void mla_absorbed_decode(Device device, const MlaAbsorbedBlock& blk, const Mask& mask, float* out,
                         int64_t out_heads, int64_t out_h0, float* lse) {
  const CountedCall counted(device, uint64_t(blk.batch * blk.seq_kv * (blk.nlat + blk.nrope)) * 4);
  if (device.is_cpu()) {
    cpu::mla_absorbed_decode(blk, mask, out, out_heads, out_h0, lse);
    return;
  }
#if DATTN_WITH_CUDA
  DATTN_ASSERT(!mask.documents);  // refused by check_mla_limits
  cuda::mla_absorbed_decode(blk, out, out_heads, out_h0, lse, device_stream());
#else
  (void)blk, (void)mask, (void)out, (void)out_heads, (void)out_h0, (void)lse;
  no_cuda(device);
#endif
}

// ================================================================== kernel limits

void check_attention_limits(Device device, DType dtype, const AttnSpec& spec, int64_t batch,
                            int64_t q_rows) {
  if (device.is_cpu()) return;
  DATTN_CHECK_ARG(!spec.mask.slices, "mask", spec.mask.str(),
                  detail::cat("a band or document mask on ", device.str(),
                              " (slice masks run on the CPU kernels only)"));
  cuda::check_attention_limits(dtype, spec.head_dim, spec.dim_v(), batch, spec.heads_q);
#if DATTN_WITH_CUDA
  // The kernels' shared memory against this device's opt-in limit, which differs between GPUs
  // (an sm_86/89 device has 99 KiB, under the forward's 134 KiB at head_dim 128): on hardware the
  // launch would fail mid-schedule, on the ranks with the smaller device only.
  int optin = 0;
  DATTN_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device.index));
  auto check = [&](const char* kernel, size_t bytes) {
    DATTN_CHECK_ARG(bytes <= size_t(optin), "head_dim",
                    detail::cat(spec.head_dim, " (head_dim_v ", spec.dim_v(), ")"),
                    detail::cat("dims whose ", kernel, " fits ", device.str(), ": it needs ", bytes,
                                " bytes of shared memory per block, the device allows ", optin,
                                " (cudaDevAttrMaxSharedMemoryPerBlockOptin)"));
  };
  check("decode kernel", cuda::decode_shared_bytes(spec.head_dim, spec.dim_v()));
  if (q_rows < 0 || !cuda::decode_kernel_fits(q_rows))
    check("attention forward kernel", cuda::attention_shared_bytes(spec.head_dim, spec.dim_v()));
#else
  (void)q_rows;
#endif
}

void check_mla_limits(Device device, const Mask& mask, int64_t nlat, int64_t nrope, int64_t batch,
                      int64_t seq_q, int64_t qk_nope) {
  if (device.is_cpu()) return;
  DATTN_CHECK_ARG(!mask.slices, "mask", mask.str(),
                  detail::cat("a band or document mask on ", device.str(),
                              " (slice masks run on the CPU kernels only)"));
  cuda::check_mla_limits(bool(mask.documents), mask.str(), nlat, nrope, batch, seq_q, qk_nope);
}

}  // namespace dattn
