// Ring attention forward. Each rank keeps its queries; the K/V blocks travel around the ring,
// one hop per step, P steps in all. While the kernel works on the block a rank holds, the
// block's next hop and the receipt of the following block run as non-blocking messages into
// a second buffer (double buffering). A block stops travelling once no rank ahead of it has a
// query that sees it, and a rank skips a block its queries cannot see: under a causal mask
// future blocks are neither computed nor, where no later rank needs them, sent.
// The same code runs on host and GPU tensors: buffers are allocated on q's device and attend_runs
// picks the kernel by it.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/progress.h"
#include "src/base/error.h"
#include "src/models.h"
#include "src/strategies/strategies.h"

namespace dattn {

namespace {
constexpr int kTagK = 101;
constexpr int kTagV = 102;

// The CPU kernel's progress hook while a step's messages are in flight: comm.progress() between
// tiles. DATTN_RING_PROGRESS=0 leaves it out (the overlap benchmark's comparison).
cpu::ProgressHook step_progress(Communicator& comm, bool messages) {
  static const bool off = [] {
    const char* env = std::getenv("DATTN_RING_PROGRESS");
    return env != nullptr && std::strcmp(env, "0") == 0;
  }();
  if (!messages || off) return {};
  return {[](void* c) { static_cast<Communicator*>(c)->progress(); }, &comm};
}
}  // namespace

Partial ring_attention_forward(Communicator& comm, const Tensor& q, const Tensor& k,
                               const Tensor& v, const AttnSpec& spec, const Layout& layout) {
  const int P = comm.size(), me = comm.rank();
  const int next = (me + 1) % P, prev = (me - 1 + P) % P;
  const int64_t B = q.size(0);
  const size_t k_row = size_t(spec.heads_kv * spec.head_dim) * dtype_size(k.dtype());
  const size_t v_row = size_t(spec.heads_kv * spec.dim_v()) * dtype_size(v.dtype());
  auto k_bytes = [&](int origin) { return size_t(B * layout.local_len(origin)) * k_row; };
  auto v_bytes = [&](int origin) { return size_t(B * layout.local_len(origin)) * v_row; };

  Partial res = empty_partial(q, spec);

  // Two receive buffers for K and for V, each big enough for the largest shard, on q's device.
  const int64_t max_len = P > 1 ? layout.max_local_len() : 0;
  Tensor kbuf[2], vbuf[2];
  for (int i = 0; i < 2 && P > 1; ++i) {
    kbuf[i] = byte_buffer(size_t(B * max_len) * k_row, q.device());
    vbuf[i] = byte_buffer(size_t(B * max_len) * v_row, q.device());
  }

  const void* cur_k = k.data();  // the block this rank holds at this step
  const void* cur_v = v.data();
  bool holding = true;
  for (int step = 0; step < P; ++step) {
    const int origin = (me - step + P) % P;            // whose block this rank holds now
    const int incoming = (me - step - 1 + 2 * P) % P;  // whose block prev holds now
    InFlight pending(comm);  // after the buffers: completed before they go, even on a throw
    // 1. Next hop: receive prev's block, send ours, if some rank ahead still needs them.
    const bool receive = ring_forwards(layout, spec.mask, incoming, step);
    if (receive) {
      pending.add(comm.irecv(kbuf[(step + 1) % 2].data(), k_bytes(incoming), prev, kTagK));
      pending.add(comm.irecv(vbuf[(step + 1) % 2].data(), v_bytes(incoming), prev, kTagV));
    }
    if (holding && ring_forwards(layout, spec.mask, origin, step)) {
      pending.add(comm.isend(cur_k, k_bytes(origin), next, kTagK));
      pending.add(comm.isend(cur_v, v_bytes(origin), next, kTagV));
    }
    // 2. Attend our queries to the block we hold, overlapped with the messages (started first:
    // a backend that defers them, NCCL, issues them now).
    comm.start();
    if (holding && layout.any_visible(spec.mask, me, origin)) {
      const cpu::ProgressScope progress(step_progress(comm, !pending.empty()));
      attend_runs(q, layout.runs(me), cur_k, cur_v, layout.local_len(origin), layout.runs(origin),
                  spec, res);
    }
    // 3. The received block is the next step's.
    pending.wait();
    holding = receive;
    cur_k = kbuf[(step + 1) % 2].data();
    cur_v = vbuf[(step + 1) % 2].data();
  }
  return res;
}

}  // namespace dattn
