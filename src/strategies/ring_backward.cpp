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
#include <cstring>
#include <vector>

#include "src/base/error.h"
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

  Gradients g{Tensor::zeros({B, Sl, spec.heads_q, D}, DType::f32),
              Tensor::zeros({B, Sl, G, D}, DType::f32), Tensor::zeros({B, Sl, G, Dv}, DType::f32)};

  // Where my own block ends its journey: it is held by me + s for s = 0 .. last.
  int last = 0;
  while (last < P - 1 && ring_forwards(layout, spec.mask, me, last))
    ++last;
  // My block's finished gradient comes home from its last holder (when it left at all).
  std::vector<float> home(last > 0 ? grad_floats(me) : 0);
  RequestPtr home_recv;
  if (last > 0)
    home_recv = comm.irecv(home.data(), home.size() * sizeof(float), (me + last) % P, kTagReturn);

  const int64_t max_len = layout.max_local_len();
  std::vector<char> kbuf[2], vbuf[2];
  std::vector<float> acc[2];  // the accumulator of the block held at step s: acc[s % 2]
  for (int i = 0; i < 2 && P > 1; ++i) {
    kbuf[i].resize(size_t(B * max_len) * k_row);
    vbuf[i].resize(size_t(B * max_len) * v_row);
    acc[i].resize(size_t(B * max_len * grad_row));
  }
  std::vector<float> mine(size_t(B * max_len * grad_row));  // this rank's contribution
  RequestPtr acc_send[2];  // the send of acc[i], waited before acc[i] is reused

  const void* cur_k = k.data();
  const void* cur_v = v.data();
  bool holding = true;
  for (int step = 0; step < P; ++step) {
    const int origin = (me - step + P) % P;
    const int incoming = (me - step - 1 + 2 * P) % P;
    const int buf = step % 2;
    std::vector<RequestPtr> pending;
    // 1. K/V: the forward's hops. Then the accumulator of the block held now, which the previous
    //    holder sends once it has added its part (waited for only after the kernel below).
    const bool receive = ring_forwards(layout, spec.mask, incoming, step);
    if (receive) {
      pending.push_back(
          comm.irecv(kbuf[(step + 1) % 2].data(), size_t(B * rows(incoming)) * k_row, prev, kTagK));
      pending.push_back(
          comm.irecv(vbuf[(step + 1) % 2].data(), size_t(B * rows(incoming)) * v_row, prev, kTagV));
    }
    const bool forward = holding && step < P - 1 && ring_forwards(layout, spec.mask, origin, step);
    if (forward) {
      pending.push_back(comm.isend(cur_k, size_t(B * rows(origin)) * k_row, next, kTagK));
      pending.push_back(comm.isend(cur_v, size_t(B * rows(origin)) * v_row, next, kTagV));
    }
    RequestPtr acc_recv;
    if (holding && step > 0) {
      if (acc_send[buf]) comm.wait(acc_send[buf]);  // acc[buf] left two steps ago
      acc_recv = comm.irecv(acc[buf].data(), grad_floats(origin) * sizeof(float), prev, kTagGrad);
    }

    // 2. This rank's part: dq in place, dK|dV of the held block into `mine` (step 0: my block).
    if (holding) {
      const bool visible = layout.any_visible(spec.mask, me, origin);
      float* target = step == 0 ? (P > 1 ? acc[0].data() : nullptr) : mine.data();
      if (step == 0 && P == 1) {
        backward_runs(q, layout.runs(me), cur_k, cur_v, rows(origin), layout.runs(origin), dout,
                      lse, delta, spec, g.dq.ptr<float>(), g.dk.ptr<float>(), g.dv.ptr<float>());
      } else if (visible) {
        std::memset(target, 0, grad_floats(origin) * sizeof(float));
        const GradBlock t = split(target, B, rows(origin), spec);
        backward_runs(q, layout.runs(me), cur_k, cur_v, rows(origin), layout.runs(origin), dout,
                      lse, delta, spec, g.dq.ptr<float>(), t.dk, t.dv);
      } else if (step == 0) {
        std::memset(target, 0, grad_floats(origin) * sizeof(float));
      }

      // 3. The block's running sum, then on along the ring or home.
      if (P > 1) {
        float* sum = acc[buf].data();
        const size_t n = grad_floats(origin);
        if (step > 0) {
          comm.wait(acc_recv);
          if (visible)
            for (size_t i = 0; i < n; ++i)
              sum[i] += mine[i];
        }
        if (forward) {
          acc_send[buf] = comm.isend(sum, n * sizeof(float), next, kTagGrad);
        } else if (origin == me) {
          std::memcpy(g.dk.data(), sum, size_t(B * Sl * G * D) * sizeof(float));
          std::memcpy(g.dv.data(), sum + B * Sl * G * D, size_t(B * Sl * G * Dv) * sizeof(float));
        } else {
          acc_send[buf] = comm.isend(sum, n * sizeof(float), origin, kTagReturn);
        }
      }
    }
    comm.wait_all(pending);
    holding = receive;
    cur_k = kbuf[(step + 1) % 2].data();
    cur_v = vbuf[(step + 1) % 2].data();
  }
  for (RequestPtr& r : acc_send)
    if (r) comm.wait(r);
  if (home_recv) {
    comm.wait(home_recv);
    std::memcpy(g.dk.data(), home.data(), size_t(B * Sl * G * D) * sizeof(float));
    std::memcpy(g.dv.data(), home.data() + B * Sl * G * D, size_t(B * Sl * G * Dv) * sizeof(float));
  }
  return g;
}

}  // namespace dattn
