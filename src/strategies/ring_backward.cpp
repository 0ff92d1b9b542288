// Ring attention backward. The K/V blocks travel exactly as in the forward (the same hops, the
// same skipped steps, double buffered and overlapped with the kernel), and each block carries its
// gradient accumulator dK|dV (fp32): every rank on the block's path adds what its queries
// contribute and passes the sum on with the block. The rank that holds a block last sends the
// accumulator straight home to the block's owner.
//
// Why home directly rather than round the rest of the ring: the return is one message of
// B * len * H_kv * (D + D_v) * 4 bytes per block that left home, the least any schedule can send
// to get the gradient back. Where blocks travel the whole ring (no mask, zigzag, striped) the last
// holder is the owner's predecessor, so the direct send is the ring's next hop anyway; where
// blocks stop early (causal, contiguous: block o stops at rank P-1) continuing round the ring
// would add P-1-(last holder) more hops of the same size. A second ring that carried the
// gradients back after the K/V ring finished would cost the same hops again and could not
// overlap with the kernel. ring_backward_send_bytes (src/models.h) counts this schedule.
//
// Determinism: dq sums the steps in step order; a block's dK|dV sums its holders in path order
// (the received sum plus this rank's contribution, computed into a zeroed buffer). No atomics,
// so repeated calls give bit-identical gradients.
//
// Every buffer lives on q's device and every step on it goes through the dispatch layer (kernels,
// zeroing, the running sum, copies), so the same schedule runs on host tensors over MPI and on
// GPU tensors over NCCL.
#include "src/base/error.h"
#include "src/dispatch.h"
#include "src/models.h"
#include "src/strategies/strategies.h"

namespace dattn {

namespace {
constexpr int kTagK = 201;
constexpr int kTagV = 202;
constexpr int kTagGrad = 203;    // a block's dK|dV accumulator, one hop along the ring
constexpr int kTagReturn = 204;  // a block's finished dK|dV, from its last holder to its owner

// Splits a dK|dV accumulator of `rows` rows into its dk and dv parts.
struct GradBlock {
  float* dk;
  float* dv;
};
GradBlock split(float* acc, int64_t B, int64_t rows, const AttnSpec& spec) {
  return {acc, acc + B * rows * spec.heads_kv * spec.head_dim};
}
// This rank's finished dK|dV (a whole accumulator of its own block) into the gradients.
void copy_home(Gradients& g, const float* acc, int64_t B, int64_t Sl, int64_t G, int64_t D,
               int64_t Dv) {
  const Device dev = g.dk.device();
  copy_bytes(g.dk.data(), acc, size_t(B * Sl * G * D) * sizeof(float), dev);
  copy_bytes(g.dv.data(), acc + B * Sl * G * D, size_t(B * Sl * G * Dv) * sizeof(float), dev);
}
float* floats(Tensor& t) {
  return t.ptr<float>();
}
}  // namespace

Gradients ring_attention_backward(Communicator& comm, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& dout, const float* lse,
                                  const float* delta, const AttnSpec& spec, const Layout& layout) {
  const int P = comm.size(), me = comm.rank();
  const int next = (me + 1) % P, prev = (me - 1 + P) % P;
  const int64_t B = q.size(0), Sl = q.size(1);
  const int64_t G = spec.heads_kv, D = spec.head_dim, Dv = spec.dim_v();
  const size_t k_row = size_t(G * D) * dtype_size(k.dtype());
  const size_t v_row = size_t(G * Dv) * dtype_size(v.dtype());
  const int64_t grad_row = G * (D + Dv);  // floats of dK|dV per token
  auto rows = [&](int origin) { return layout.local_len(origin); };
  auto grad_floats = [&](int origin) { return size_t(B * rows(origin) * grad_row); };

  const Device dev = q.device();
  Gradients g{Tensor::zeros({B, Sl, spec.heads_q, D}, DType::f32, dev),
              Tensor::zeros({B, Sl, G, D}, DType::f32, dev),
              Tensor::zeros({B, Sl, G, Dv}, DType::f32, dev)};

  // Where my own block ends its journey: it is held by me + s for s = 0 .. last.
  int last = 0;
  while (last < P - 1 && ring_forwards(layout, spec.mask, me, last))
    ++last;

  const int64_t max_len = layout.max_local_len();
  const int64_t acc_len = B * max_len * grad_row;
  Tensor kbuf[2], vbuf[2];
  Tensor acc_in, acc_out;  // the held block's accumulator: received, passed on
  for (int i = 0; i < 2 && P > 1; ++i) {
    kbuf[i] = byte_buffer(size_t(B * max_len) * k_row, dev);
    vbuf[i] = byte_buffer(size_t(B * max_len) * v_row, dev);
  }
  if (P > 1) {
    acc_in = Tensor::empty({acc_len}, DType::f32, dev);
    acc_out = Tensor::empty({acc_len}, DType::f32, dev);
  }
  Tensor mine = Tensor::empty({acc_len}, DType::f32, dev);  // this rank's contribution
  // My block's finished gradient, from its last holder (when it left at all).
  Tensor home = Tensor::empty({last > 0 ? int64_t(grad_floats(me)) : 0}, DType::f32, dev);
  InFlight pending(comm);  // after the buffers: completed before they go, even on a throw

  // The order of issue is NCCL's concern too (it matches a peer's messages in issue order, tags
  // ignored, and completes an issued batch only when every message in it has met its peer's):
  // every message between two ranks is posted in the same step on both sides, so each step's
  // batch meets its peers' batches of that step. A step posts its receives and sends, starts
  // them with the accumulator that left in the previous step, runs the kernel and waits for all.
  // The home message leaves its last holder at step last and is received at step last + 1
  // (after the loop where that is P).
  const void* cur_k = k.data();
  const void* cur_v = v.data();
  bool holding = true;
  for (int step = 0; step < P; ++step) {
    const int origin = (me - step + P) % P;
    const int incoming = (me - step - 1 + 2 * P) % P;
    // 1. K/V: the forward's hops. Then the accumulator of the block held now, which the previous
    //    holder sent at the end of its last step.
    const bool receive = ring_forwards(layout, spec.mask, incoming, step);
    if (receive) {
      pending.add(
          comm.irecv(kbuf[(step + 1) % 2].data(), size_t(B * rows(incoming)) * k_row, prev, kTagK));
      pending.add(
          comm.irecv(vbuf[(step + 1) % 2].data(), size_t(B * rows(incoming)) * v_row, prev, kTagV));
    }
    const bool forward = holding && step < P - 1 && ring_forwards(layout, spec.mask, origin, step);
    if (forward) {
      pending.add(comm.isend(cur_k, size_t(B * rows(origin)) * k_row, next, kTagK));
      pending.add(comm.isend(cur_v, size_t(B * rows(origin)) * v_row, next, kTagV));
    }
    if (holding && step > 0)
      pending.add(comm.irecv(acc_in.data(), grad_floats(origin) * sizeof(float), prev, kTagGrad));
    const bool home_now = last > 0 && step == last + 1;
    if (home_now) pending.add(comm.irecv(home.data(), home.nbytes(), (me + last) % P, kTagReturn));
    comm.start();

    // 2. This rank's part: dq in place, dK|dV of the held block into `mine` (step 0: straight
    //    into the accumulator that leaves).
    const bool visible = holding && layout.any_visible(spec.mask, me, origin);
    if (holding) {
      float* target = step == 0 ? (P > 1 ? floats(acc_out) : nullptr) : floats(mine);
      if (step == 0 && P == 1) {
        backward_runs(q, layout.runs(me), cur_k, cur_v, rows(origin), layout.runs(origin), dout,
                      lse, delta, spec, g.dq.ptr<float>(), g.dk.ptr<float>(), g.dv.ptr<float>());
      } else if (visible) {
        zero_floats(target, grad_floats(origin), dev);
        const GradBlock t = split(target, B, rows(origin), spec);
        backward_runs(q, layout.runs(me), cur_k, cur_v, rows(origin), layout.runs(origin), dout,
                      lse, delta, spec, g.dq.ptr<float>(), t.dk, t.dv);
      } else if (step == 0) {
        zero_floats(target, grad_floats(origin), dev);
      }
    }
    pending.wait();  // this step's K/V and accumulator, and the one that left last step
    if (home_now) copy_home(g, floats(home), B, Sl, G, D, Dv);

    // 3. The block's running sum (acc_out is free: its last send completed above), then on
    //    along the ring or home.
    if (holding && P > 1) {
      const size_t n = grad_floats(origin);
      if (step > 0 && visible)
        add_floats(floats(acc_out), floats(acc_in), floats(mine), n, dev);
      else if (step > 0)
        copy_bytes(acc_out.data(), acc_in.data(), n * sizeof(float), dev);
      if (forward)
        pending.add(comm.isend(acc_out.data(), n * sizeof(float), next, kTagGrad));
      else if (origin == me)
        copy_home(g, floats(acc_out), B, Sl, G, D, Dv);
      else
        pending.add(comm.isend(acc_out.data(), n * sizeof(float), origin, kTagReturn));
    }
    holding = receive;
    cur_k = kbuf[(step + 1) % 2].data();
    cur_v = vbuf[(step + 1) % 2].data();
  }
  const bool home_last = last > 0 && last + 1 == P;
  if (home_last) pending.add(comm.irecv(home.data(), home.nbytes(), (me + last) % P, kTagReturn));
  pending.wait();
  if (home_last) copy_home(g, floats(home), B, Sl, G, D, Dv);
  return g;
}

}  // namespace dattn
