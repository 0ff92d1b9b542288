// The sharded KV cache, and the decode step's validation, agreed by all ranks, and choice of
// schedule (tree, ring or allgather: src/strategies/decode.cpp); and the decode byte model.
#include "src/decode.h"

#include <cmath>
#include <cstring>

#include "src/base/error.h"
#include "src/check_finite.h"
#include "src/dispatch.h"
#include "src/strategies/strategies.h"
#include "src/validate.h"

namespace dattn {

const char* strategy_name(DecodeStrategy s) {
  switch (s) {
    case DecodeStrategy::tree:
      return "tree";
    case DecodeStrategy::ring:
      return "ring";
    case DecodeStrategy::allgather:
      return "allgather";
  }
  return "?";
}

DecodeStrategy parse_decode_strategy(const std::string& name) {
  if (name == "tree") return DecodeStrategy::tree;
  if (name == "ring") return DecodeStrategy::ring;
  if (name == "allgather") return DecodeStrategy::allgather;
  DATTN_THROW("invalid decode strategy = '", name, "': expected tree, ring or allgather");
}

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

size_t KvCache::k_row_bytes() const {
  return size_t(spec_.heads_kv * spec_.head_dim) * dtype_size(dtype_);
}
size_t KvCache::v_row_bytes() const {
  return size_t(spec_.heads_kv * spec_.dim_v()) * dtype_size(dtype_);
}

namespace {
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
            k_row_bytes());
  copy_rows(v_.data(), v_.device(), capacity_, 0, v_shard.data(), v_shard.device(), n, 0, batch_, n,
            v_row_bytes());
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
              mine[j], batch_, 1, k_row_bytes());
    copy_rows(v_.data(), v_.device(), capacity_, row0 + int64_t(j), v_new.data(), v_new.device(), n,
              mine[j], batch_, 1, v_row_bytes());
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
  uint32_t cap_bits;
  std::memcpy(&cap_bits, &spec_.softcap, 4);
  uint64_t h = hash_mix(kHashSeed, cap_bits);
  for (uint64_t x : {uint64_t(ranks_), uint64_t(spec_.heads_q), uint64_t(spec_.heads_kv),
                     uint64_t(spec_.head_dim), uint64_t(spec_.dim_v()), uint64_t(scale_bits),
                     spec_.mask.hash(), uint64_t(batch_), uint64_t(dtype_), uint64_t(placement_),
                     uint64_t(length_), uint64_t(prefill_len_)})
    h = hash_mix(h, x);
  return spec_.sinks_hash(h);
}

// ================================================================== the decode step

Partial decode(Runtime& rt, const Tensor& q, const KvCache& cache, DecodeStrategy strategy) {
  StreamScope on_stream(rt.stream());  // all device work of this call on its stream
  Communicator& comm = rt.cp();
  const int64_t Sq = q.dim() == 4 ? q.size(1) : 0;
  uint64_t hash = hash_mix(cache.hash(), uint64_t(strategy));
  hash = hash_mix(hash_mix(hash, uint64_t(q.dim() == 4 ? q.size(0) : 0)), uint64_t(Sq));
  agree_on_validation(comm, "decode step", hash, [&] {
    DATTN_CHECK_ARG(strategy == DecodeStrategy::tree || strategy == DecodeStrategy::ring ||
                        strategy == DecodeStrategy::allgather,
                    "strategy", int(strategy), "tree, ring or allgather for decode");
    DATTN_CHECK_ARG(cache.ranks() == comm.size() && cache.rank() == comm.rank(), "cache rank",
                    detail::cat(cache.rank(), " of ", cache.ranks()),
                    detail::cat(comm.rank(), " of ", comm.size(), " (this cp rank)"));
    DATTN_CHECK_ARG(q.dim() == 4, "q rank", q.dim(), "4 dimensions [batch, S_q, heads, head_dim]");
    DATTN_CHECK_ARG(q.device() == rt.device(), "q device", q.device().str(),
                    detail::cat(rt.device().str(), " (the Runtime's device)"));
    DATTN_CHECK_ARG(cache.device() == rt.device(), "cache device", cache.device().str(),
                    detail::cat(rt.device().str(), " (the Runtime's device)"));
    // The kernels' limits, caught here, agreed by every rank, before any data moves.
    check_attention_limits(rt.device(), q.dtype(), cache.spec(), q.size(0), q.size(1));
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
  Partial res = strategy == DecodeStrategy::tree   ? tree_decode(rt, q, q_runs, cache)
                : strategy == DecodeStrategy::ring ? ring_decode(comm, q, q_runs, cache)
                                                   : allgather_decode(comm, q, q_runs, cache);
  // The schedules merge plain partials (their kernels ignore the sinks); the sinks join the
  // merged result once.
  if (cache.spec().sinks) add_sinks(res, *cache.spec().sinks);
  return res;
}

uint64_t decode_send_bytes(DecodeStrategy strategy, const KvCache& c, int64_t s_q, int node_size,
                           int rank) {
  const int P = c.ranks();
  if (P == 1) return 0;  // one rank sends nothing, whatever the strategy
  const uint64_t per_token = uint64_t(c.spec().heads_kv * (c.spec().head_dim + c.spec().dim_v())) *
                             dtype_size(c.dtype()) * uint64_t(c.batch());
  if (strategy == DecodeStrategy::ring) {
    uint64_t bytes = 0;
    for (int s = 0; s + 1 < P; ++s)
      bytes += uint64_t(c.local_len(((rank - s) % P + P) % P));
    return bytes * per_token;
  }
  if (strategy == DecodeStrategy::allgather) return uint64_t(c.local_len(rank)) * per_token;
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
