// The decode schedules behind dattn::decode (src/decode.h), called after validation:
// tree (each rank attends the new queries to its own shard, then two fixed-size reductions
// combine the partials: a max of lse, and a sum of [w * out | w] with w = exp(lse - max), the
// merge of kernels/merge.h written as sums so that it is one allreduce; with ranks on several
// nodes each reduction runs in two levels: reduce inside the node, allreduce across the node
// leaders, broadcast inside the node), ring (K/V shards rotate) and allgather (every rank gathers
// the whole cache).
#include <algorithm>

#include "src/strategies/strategies.h"

namespace dattn {

namespace {

// Allreduce of fp32 values over the cp ranks: flat, or in two levels across nodes. buf is on the
// runtime's device: on a GPU runtime cp() and the node groups split from it are NCCL
// communicators over device buffers, so the same calls serve both (tests/gpu/test_gpu_decode.cpp
// runs the two levels with declared nodes).
void allreduce_f32(Runtime& rt, float* buf, size_t count, ReduceOp op) {
  if (rt.cp_size() == 1) return;  // one rank: its partial is the result
  if (!rt.spans_nodes()) {
    rt.cp().allreduce(buf, buf, count, DType::f32, op);
    return;
  }
  Communicator& node = rt.node();
  node.reduce(buf, buf, count, DType::f32, op, 0);
  if (node.rank() == 0) rt.node_leaders().allreduce(buf, buf, count, DType::f32, op);
  node.broadcast(buf, count * sizeof(float), 0);
}

}  // namespace

// Tree: the local partial, then max of lse and sum of [w * out | w] over the ranks. The buffers
// live on q's device (the cache's and the communicator's), and the copy and weighting steps go
// through src/dispatch.h, so this schedule runs unchanged on host and GPU tensors.
Partial tree_decode(Runtime& rt, const Tensor& q, const std::vector<Run>& q_runs,
                    const KvCache& cache) {
  const AttnSpec& spec = cache.spec();
  const int64_t B = q.size(0), Sq = q.size(1), H = spec.heads_q, Dv = spec.dim_v();
  Partial res = empty_partial(q, spec);
  attend_runs(q, q_runs, cache.k().data(), cache.v().data(), cache.capacity(),
              cache.runs(cache.rank()), spec, res);
  float* out = res.out.ptr<float>();
  float* lse = res.lse.ptr<float>();
  const Device dev = q.device();

  const size_t rows = size_t(B * H * Sq), packed_n = size_t(B * Sq * H * (Dv + 1));
  Tensor m = byte_buffer(rows * sizeof(float), dev);
  copy_bytes(m.data(), lse, rows * sizeof(float), dev);
  allreduce_f32(rt, m.ptr<float>(), rows, ReduceOp::max);
  // [B, S_q, H, Dv + 1]: the weighted output and its weight (every element written). An empty
  // shard (lse = -inf) gives w = 0 and contributes nothing; m = -inf only when every shard is
  // empty.
  Tensor packed = byte_buffer(packed_n * sizeof(float), dev);
  weigh_partial(dev, packed.ptr<float>(), out, lse, m.ptr<float>(), B, Sq, H, Dv);
  allreduce_f32(rt, packed.ptr<float>(), packed_n, ReduceOp::sum);
  unweigh_partial(dev, out, lse, packed.ptr<float>(), m.ptr<float>(), B, Sq, H, Dv);
  // m and packed are freed on return while a GPU's unweigh may still be queued: device memory is
  // freed in the order of the default stream, after that work (src/base/tensor.h; the ring's
  // receive buffers rely on the same).
  return res;
}

namespace {

// This rank's shard as a compact [B, len, H_kv, D] block (K and V back to back), at the start of a
// buffer of at least `min_bytes` bytes on the cache's device.
Tensor pack_shard(const KvCache& c, size_t min_bytes) {
  const int64_t n = c.local_len();
  const size_t kr = c.k_row_bytes(), vr = c.v_row_bytes();
  const Device dev = c.device();
  Tensor buf = byte_buffer(std::max(size_t(c.batch() * n) * (kr + vr), min_bytes), dev);
  char* p = static_cast<char*>(buf.data());
  copy_rows(p, dev, n, 0, c.k().data(), dev, c.capacity(), 0, c.batch(), n, kr);
  copy_rows(p + size_t(c.batch() * n) * kr, dev, n, 0, c.v().data(), dev, c.capacity(), 0,
            c.batch(), n, vr);
  return buf;
}

// One rank: its own shard is the whole cache, attended in place (nothing to pass or gather).
Partial attend_own_shard(const Tensor& q, const std::vector<Run>& q_runs, const KvCache& c) {
  Partial res = empty_partial(q, c.spec());
  attend_runs(q, q_runs, c.k().data(), c.v().data(), c.capacity(), c.runs(0), c.spec(), res);
  return res;
}

// Attends q to a packed shard of `origin` (K then V, compact).
void attend_packed(const Tensor& q, const std::vector<Run>& q_runs, const char* shard,
                   const KvCache& c, int origin, Partial& res) {
  const int64_t n = c.local_len(origin);
  if (n == 0) return;
  const size_t kr = c.k_row_bytes();
  attend_runs(q, q_runs, shard, shard + size_t(c.batch() * n) * kr, n, c.runs(origin), c.spec(),
              res);
}

}  // namespace

// Ring (pass-KV): shards rotate around the ranks; every rank attends to every shard. Each
// shard's partial is kept apart and the partials are merged in rank order at the end, so that
// every rank returns the same bits whatever order its shards arrived in. The buffers live on the
// cache's device, so the schedule runs unchanged on host and GPU tensors.
Partial ring_decode(Communicator& comm, const Tensor& q, const std::vector<Run>& q_runs,
                    const KvCache& c) {
  const int P = comm.size(), me = comm.rank();
  if (P == 1) return attend_own_shard(q, q_runs, c);
  const size_t per_token = c.k_row_bytes() + c.v_row_bytes();
  auto bytes_of = [&](int origin) { return size_t(c.batch() * c.local_len(origin)) * per_token; };
  std::vector<Partial> parts(static_cast<size_t>(P));
  size_t biggest = 0;
  for (int r = 0; r < P; ++r)
    biggest = std::max(biggest, bytes_of(r));
  Tensor buf[2] = {pack_shard(c, biggest), byte_buffer(biggest, c.device())};
  for (int step = 0; step < P; ++step) {
    const int origin = (me - step + P) % P, incoming = (me - step - 1 + 2 * P) % P;
    InFlight pending(comm);  // after the buffers: completed before they go, even on a throw
    if (step + 1 < P) {      // every shard goes all the way round: all new queries see all of it
      if (bytes_of(incoming) > 0)
        pending.add(
            comm.irecv(buf[(step + 1) % 2].data(), bytes_of(incoming), (me - 1 + P) % P, 201));
      if (bytes_of(origin) > 0)
        pending.add(comm.isend(buf[step % 2].data(), bytes_of(origin), (me + 1) % P, 201));
    }
    comm.start();  // the next hop runs while this shard is attended
    parts[size_t(origin)] = empty_partial(q, c.spec());
    attend_packed(q, q_runs, static_cast<const char*>(buf[step % 2].data()), c, origin,
                  parts[size_t(origin)]);
    pending.wait();
  }
  const int64_t B = q.size(0), Sq = q.size(1), H = c.spec().heads_q, Dv = c.spec().dim_v();
  for (int r = 1; r < P; ++r)
    merge_partials(q.device(), parts[0].out.ptr<float>(), parts[0].lse.ptr<float>(),
                   parts[size_t(r)].out.ptr<float>(), parts[size_t(r)].lse.ptr<float>(), B, Sq, H,
                   Dv);
  return parts[0];
}

// Allgather: every rank gathers every shard, then attends to all of them (buffers on the cache's
// device, as the ring's).
Partial allgather_decode(Communicator& comm, const Tensor& q, const std::vector<Run>& q_runs,
                         const KvCache& c) {
  const int P = comm.size();
  const size_t per_token = c.k_row_bytes() + c.v_row_bytes();
  std::vector<size_t> counts(static_cast<size_t>(P));
  size_t total = 0;
  for (int r = 0; r < P; ++r)
    total += counts[size_t(r)] = size_t(c.batch() * c.local_len(r)) * per_token;
  if (P == 1) return attend_own_shard(q, q_runs, c);
  const Tensor mine = pack_shard(c, 0);
  const Tensor all = byte_buffer(total, c.device());
  comm.allgatherv(mine.data(), counts[size_t(comm.rank())], all.data(), counts);
  Partial res = empty_partial(q, c.spec());
  size_t off = 0;
  for (int r = 0; r < P; ++r) {
    attend_packed(q, q_runs, static_cast<const char*>(all.data()) + off, c, r, res);
    off += counts[size_t(r)];
  }
  return res;
}

}  // namespace dattn
