// The sharded KV cache and the decode step: tree (Tree Attention), ring and allgather.
// Tree: each rank attends the new queries to its own shard, then two fixed-size reductions
// combine the partials: a max of lse, and a sum of [w * out | w] with w = exp(lse - max) — the
// merge of kernels/merge.h written as sums, so that it is one allreduce. With ranks on several
// nodes each reduction runs in two levels: reduce inside the node, allreduce across the node
// leaders, broadcast inside the node.
#include "src/decode.h"

#include <cmath>
#include <cstring>

#include "src/base/error.h"
#include "src/check_finite.h"
#include "src/dispatch.h"
#include "src/strategies/strategies.h"
#include "src/validate.h"

namespace dattn {

const char* placement_name(Placement p) {
  return p == Placement::round_robin ? "round_robin" : "last_rank";
}

// ================================================================== the cache

KvCache::KvCache(int ranks, int rank, const AttnSpec& spec, int64_t batch, DType dtype,
                 int64_t capacity, Placement placement, Device device)
    : ranks_(ranks),
      rank_(rank),
      spec_(spec),
      batch_(batch),
      capacity_(capacity),
      dtype_(dtype),
      placement_(placement) {
  spec.validate();
  DATTN_CHECK_ARG(ranks > 0, "ranks", ranks, "> 0");
  DATTN_CHECK_ARG(rank >= 0 && rank < ranks, "rank", rank, detail::cat("0 to ", ranks - 1));
  DATTN_CHECK_ARG(batch > 0, "batch", batch, "> 0");
  DATTN_CHECK_ARG(capacity >= 0, "capacity", capacity, ">= 0 tokens");
  runs_.resize(size_t(ranks));
  prompt_runs_.assign(size_t(ranks), 0);
  k_ = Tensor::zeros({batch, capacity, spec.heads_kv, spec.head_dim}, dtype, device);
  v_ = Tensor::zeros({batch, capacity, spec.heads_kv, spec.dim_v()}, dtype, device);
}

int64_t KvCache::local_len(int rank) const {
  int64_t n = 0;
  for (const Run& r : runs(rank))
    n += r.length;
  return n;
}

namespace {
size_t row_bytes(const Tensor& t) {
  return size_t(t.size(2) * t.size(3)) * dtype_size(t.dtype());
}

void check_kv(const Tensor& k, const Tensor& v, const KvCache& c, int64_t rows, const char* what) {
  for (auto [t, name, dim] :
       {std::tuple{&k, "k", c.spec().head_dim}, std::tuple{&v, "v", c.spec().dim_v()}}) {
    const std::string n = detail::cat(what, " ", name);
    DATTN_CHECK_ARG(t->dim() == 4, n + " rank", t->dim(), "4 dimensions [batch, seq, heads, dim]");
    DATTN_CHECK_ARG(t->dtype() == c.dtype(), n + " dtype", dtype_name(t->dtype()),
                    dtype_name(c.dtype()));
    DATTN_CHECK_ARG(
        t->size(0) == c.batch() && t->size(1) == rows && t->size(2) == c.spec().heads_kv &&
            t->size(3) == dim,
        n + " shape", t->shape_str(),
        detail::cat("[", c.batch(), ", ", rows, ", ", c.spec().heads_kv, ", ", dim, "]"));
  }
}
}  // namespace

void KvCache::prefill(const Tensor& k_shard, const Tensor& v_shard, const Layout& layout) {
  DATTN_CHECK_ARG(length_ == 0, "cache length", length_, "0 (prefill an empty cache only)");
  DATTN_CHECK_ARG(layout.ranks() == ranks_, "layout ranks", layout.ranks(), ranks_);
  const int64_t n = layout.local_len(rank_);
  check_kv(k_shard, v_shard, *this, n, "prefill");
  DATTN_CHECK_ARG(n <= capacity_, "capacity", capacity_,
                  detail::cat(">= ", n, " tokens (this rank's share of the prompt)"));
  // The shards may be on the host or a device, whatever the cache's device (src/dispatch.h).
  copy_rows(k_.data(), k_.device(), capacity_, 0, k_shard.data(), k_shard.device(), n, 0, batch_, n,
            row_bytes(k_));
  copy_rows(v_.data(), v_.device(), capacity_, 0, v_shard.data(), v_shard.device(), n, 0, batch_, n,
            row_bytes(v_));
  for (int r = 0; r < ranks_; ++r) {
    runs_[size_t(r)].clear();
    for (const Run& run : layout.runs(r))
      if (run.length > 0) runs_[size_t(r)].push_back(run);
    prompt_runs_[size_t(r)] = runs_[size_t(r)].size();
  }
  length_ = prefill_len_ = layout.global_seq();
}

void KvCache::append(const Tensor& k_new, const Tensor& v_new) {
  const int64_t n = k_new.dim() >= 2 ? k_new.size(1) : 0;
  check_kv(k_new, v_new, *this, n, "append");
  // Token t of the appended ones (t = appended_ ..) goes to this rank if the placement says so.
  auto owner = [&](int64_t t) {
    return placement_ == Placement::round_robin ? int(t % ranks_) : ranks_ - 1;
  };
  // Every rank's share, known everywhere: if any rank's share would not fit, every rank
  // throws the same error and none stores anything (caches are built alike on every rank).
  std::vector<int64_t> count(size_t(ranks_), 0);
  for (int64_t i = 0; i < n; ++i)
    count[size_t(owner(appended_ + i))] += 1;
  for (int r = 0; r < ranks_; ++r)
    DATTN_CHECK_ARG(local_len(r) + count[size_t(r)] <= capacity_, "capacity", capacity_,
                    detail::cat(">= ", local_len(r) + count[size_t(r)], " tokens on rank ", r, " (",
                                local_len(r), " held + ", count[size_t(r)], " appended)"));
  std::vector<int64_t> mine;  // indices into k_new of this rank's new tokens
  for (int64_t i = 0; i < n; ++i)
    if (owner(appended_ + i) == rank_) mine.push_back(i);
  const int64_t row0 = local_len();
  for (size_t j = 0; j < mine.size(); ++j) {
    copy_rows(k_.data(), k_.device(), capacity_, row0 + int64_t(j), k_new.data(), k_new.device(), n,
              mine[j], batch_, 1, row_bytes(k_));
    copy_rows(v_.data(), v_.device(), capacity_, row0 + int64_t(j), v_new.data(), v_new.device(), n,
              mine[j], batch_, 1, row_bytes(v_));
  }
  // Every rank's runs: one run of appended tokens per rank, after its prompt rows.
  for (int r = 0; r < ranks_; ++r) {
    if (count[size_t(r)] == 0) continue;
    auto& runs = runs_[size_t(r)];
    if (runs.size() > prompt_runs_[size_t(r)]) {  // the rank's run of appended tokens
      runs.back().length += count[size_t(r)];
    } else {
      const int64_t first =
          placement_ == Placement::round_robin
              ? prefill_len_ + ((r - appended_) % ranks_ + ranks_) % ranks_ + appended_
              : prefill_len_ + appended_;
      const int64_t stride = placement_ == Placement::round_robin ? ranks_ : 1;
      runs.push_back(Run{local_len(r), first, stride, count[size_t(r)]});
    }
  }
  length_ += n;
  appended_ += n;
}

int64_t KvCache::global_position(int64_t row) const {
  for (const Run& r : runs(rank_))
    if (row >= r.local_begin && row < r.local_begin + r.length)
      return r.position(row - r.local_begin);
  return -1;
}

uint64_t KvCache::hash() const {
  uint32_t scale_bits;
  const float scale = spec_.scale();
  std::memcpy(&scale_bits, &scale, 4);
  uint64_t h = kHashSeed;
  for (uint64_t x : {uint64_t(ranks_), uint64_t(spec_.heads_q), uint64_t(spec_.heads_kv),
                     uint64_t(spec_.head_dim), uint64_t(spec_.dim_v()), uint64_t(scale_bits),
                     spec_.mask.hash(), uint64_t(batch_), uint64_t(dtype_), uint64_t(placement_),
                     uint64_t(length_), uint64_t(prefill_len_)})
    h = hash_mix(h, x);
  return h;
}

// ================================================================== the decode step

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

// This rank's shard as a compact [B, len, H_kv, D] block (K and V back to back), at the start of a
// buffer of at least `min_bytes` bytes on the cache's device.
Tensor pack_shard(const KvCache& c, size_t min_bytes) {
  const int64_t n = c.local_len();
  const size_t kr = row_bytes(c.k()), vr = row_bytes(c.v());
  const Device dev = c.device();
  Tensor buf = byte_buffer(std::max(size_t(c.batch() * n) * (kr + vr), min_bytes), dev);
  char* p = static_cast<char*>(buf.data());
  copy_rows(p, dev, n, 0, c.k().data(), dev, c.capacity(), 0, c.batch(), n, kr);
  copy_rows(p + size_t(c.batch() * n) * kr, dev, n, 0, c.v().data(), dev, c.capacity(), 0,
            c.batch(), n, vr);
  return buf;
}

// Attends q to a packed shard of `origin` (K then V, compact).
void attend_packed(const Tensor& q, const std::vector<Run>& q_runs, const char* shard,
                   const KvCache& c, int origin, Partial& res) {
  const int64_t n = c.local_len(origin);
  if (n == 0) return;
  const size_t kr = row_bytes(c.k());
  attend_runs(q, q_runs, shard, shard + size_t(c.batch() * n) * kr, n, c.runs(origin), c.spec(),
              res);
}

// Ring (pass-KV): shards rotate around the ranks; every rank attends to every shard. Each
// shard's partial is kept apart and the partials are merged in rank order at the end, so that
// every rank returns the same bits whatever order its shards arrived in. The buffers live on the
// cache's device, so the schedule runs unchanged on host and GPU tensors.
Partial ring_decode(Communicator& comm, const Tensor& q, const std::vector<Run>& q_runs,
                    const KvCache& c) {
  const int P = comm.size(), me = comm.rank();
  const size_t per_token = row_bytes(c.k()) + row_bytes(c.v());
  auto bytes_of = [&](int origin) { return size_t(c.batch() * c.local_len(origin)) * per_token; };
  std::vector<Partial> parts(static_cast<size_t>(P));
  size_t biggest = 0;
  for (int r = 0; r < P; ++r)
    biggest = std::max(biggest, bytes_of(r));
  Tensor buf[2] = {pack_shard(c, biggest), byte_buffer(P > 1 ? biggest : 0, c.device())};
  for (int step = 0; step < P; ++step) {
    const int origin = (me - step + P) % P, incoming = (me - step - 1 + 2 * P) % P;
    std::vector<RequestPtr> pending;
    if (step + 1 < P) {  // every shard goes all the way round: all new queries see all of it
      if (bytes_of(incoming) > 0)
        pending.push_back(
            comm.irecv(buf[(step + 1) % 2].data(), bytes_of(incoming), (me - 1 + P) % P, 201));
      if (bytes_of(origin) > 0)
        pending.push_back(comm.isend(buf[step % 2].data(), bytes_of(origin), (me + 1) % P, 201));
    }
    comm.start();  // the next hop runs while this shard is attended
    parts[size_t(origin)] = empty_partial(q, c.spec());
    attend_packed(q, q_runs, static_cast<const char*>(buf[step % 2].data()), c, origin,
                  parts[size_t(origin)]);
    comm.wait_all(pending);
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
  const size_t per_token = row_bytes(c.k()) + row_bytes(c.v());
  std::vector<size_t> counts(static_cast<size_t>(P));
  size_t total = 0;
  for (int r = 0; r < P; ++r)
    total += counts[size_t(r)] = size_t(c.batch() * c.local_len(r)) * per_token;
  if (P == 1) {  // one rank: nothing to gather
    Partial res = empty_partial(q, c.spec());
    attend_runs(q, q_runs, c.k().data(), c.v().data(), c.capacity(), c.runs(0), c.spec(), res);
    return res;
  }
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

}  // namespace

Partial decode(Runtime& rt, const Tensor& q, const KvCache& cache, Strategy strategy) {
  Communicator& comm = rt.cp();
  const int64_t Sq = q.dim() == 4 ? q.size(1) : 0;
  uint64_t hash = hash_mix(cache.hash(), uint64_t(strategy));
  hash = hash_mix(hash_mix(hash, uint64_t(q.dim() == 4 ? q.size(0) : 0)), uint64_t(Sq));
  agree_on_validation(comm, "decode step", hash, [&] {
    DATTN_CHECK_ARG(
        strategy == Strategy::tree || strategy == Strategy::ring || strategy == Strategy::allgather,
        "strategy", strategy_name(strategy), "tree, ring or allgather for decode");
    DATTN_CHECK_ARG(cache.ranks() == comm.size() && cache.rank() == comm.rank(), "cache rank",
                    detail::cat(cache.rank(), " of ", cache.ranks()),
                    detail::cat(comm.rank(), " of ", comm.size(), " (this cp rank)"));
    DATTN_CHECK_ARG(q.dim() == 4, "q rank", q.dim(), "4 dimensions [batch, S_q, heads, head_dim]");
    DATTN_CHECK_ARG(q.device() == rt.device(), "q device", q.device().str(),
                    detail::cat(rt.device().str(), " (the Runtime's device)"));
    DATTN_CHECK_ARG(cache.device() == rt.device(), "cache device", cache.device().str(),
                    detail::cat(rt.device().str(), " (the Runtime's device)"));
    // The kernels' limits, caught here, agreed by every rank, before any data moves.
    check_attention_limits(rt.device(), q.dtype(), cache.spec(), q.size(0));
    DATTN_CHECK_ARG(q.dtype() == cache.dtype(), "q dtype", dtype_name(q.dtype()),
                    dtype_name(cache.dtype()));
    DATTN_CHECK_ARG(q.size(0) == cache.batch(), "q batch", q.size(0), cache.batch());
    DATTN_CHECK_ARG(q.size(2) == cache.spec().heads_q, "q heads", q.size(2),
                    detail::cat(cache.spec().heads_q, " (spec.heads_q)"));
    DATTN_CHECK_ARG(q.size(3) == cache.spec().head_dim, "q head_dim", q.size(3),
                    detail::cat(cache.spec().head_dim, " (spec.head_dim)"));
    DATTN_CHECK_ARG(Sq >= 1 && Sq <= cache.length(), "S_q", Sq,
                    detail::cat("1 to the context length (", cache.length(),
                                "): append the new tokens' K/V before decoding them"));
    if (rt.check_finite()) {  // q, and this rank's cache rows (the filled ones only)
      check_finite_tensor(q, "q", [&](int64_t row) { return cache.length() - Sq + row; });
      auto cache_position = [&](int64_t row) { return cache.global_position(row); };
      check_finite_rows(cache.k(), "cache k", 0, cache.local_len(), cache_position);
      check_finite_rows(cache.v(), "cache v", 0, cache.local_len(), cache_position);
    }
  });
  // The new queries are the last S_q tokens of the context.
  const std::vector<Run> q_runs = {Run{0, cache.length() - Sq, 1, Sq}};
  switch (strategy) {
    case Strategy::tree:
      return tree_decode(rt, q, q_runs, cache);
    case Strategy::ring:
      return ring_decode(comm, q, q_runs, cache);
    default:
      return allgather_decode(comm, q, q_runs, cache);
  }
}

uint64_t decode_send_bytes(Strategy strategy, const KvCache& c, int64_t s_q, int node_size,
                           int rank) {
  const int P = c.ranks();
  if (P == 1) return 0;  // one rank sends nothing, whatever the strategy
  const uint64_t per_token = uint64_t(c.spec().heads_kv * (c.spec().head_dim + c.spec().dim_v())) *
                             dtype_size(c.dtype()) * uint64_t(c.batch());
  if (strategy == Strategy::ring) {
    uint64_t bytes = 0;
    for (int s = 0; s + 1 < P; ++s)
      bytes += uint64_t(c.local_len(((rank - s) % P + P) % P));
    return bytes * per_token;
  }
  if (strategy == Strategy::allgather) return uint64_t(c.local_len(rank)) * per_token;
  // Tree: two reductions of fixed size, [B, H, S_q] and [B, S_q, H, D_v + 1] floats.
  const uint64_t rows = uint64_t(c.batch() * c.spec().heads_q * s_q);
  const uint64_t floats = rows + rows * uint64_t(c.spec().dim_v() + 1);
  const bool two_level = node_size > 0 && node_size < P;
  if (!two_level) return floats * sizeof(float);  // allreduce: the payload
  // Two levels: reduce inside the node (every rank), allreduce across leaders, broadcast from
  // the leader. A node is node_size consecutive cp ranks; its leader is its first.
  const bool leader = rank % node_size == 0;
  const int nodes = (P + node_size - 1) / node_size;
  uint64_t bytes = floats * sizeof(float);                   // reduce
  if (leader && nodes > 1) bytes += floats * sizeof(float);  // allreduce across leaders
  if (leader) bytes += floats * sizeof(float);               // broadcast in the node
  return bytes;
}

}  // namespace dattn
