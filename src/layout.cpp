// Layouts: the runs each rank holds, visibility between shards, dispatch and undispatch.
#include "src/layout.h"

#include <algorithm>
#include <limits>

#include "collective/communicator.h"
#include "kernels/movement/movement.h"
#include "src/base/error.h"
#include "src/models.h"

namespace dattn {

Layout::Layout(Kind kind, int64_t global_seq, int ranks)
    : kind_(kind), ranks_(ranks), global_seq_(global_seq) {
  DATTN_CHECK_ARG(ranks > 0, "layout ranks", ranks, "> 0");
  DATTN_CHECK_ARG(global_seq >= 0, "global_seq", global_seq, ">= 0");
  runs_.resize(size_t(ranks));
}

Layout Layout::contiguous(int64_t global_seq, int ranks) {
  Layout l(Kind::contiguous, global_seq, ranks);
  const int64_t base = global_seq / ranks, extra = global_seq % ranks;
  int64_t start = 0;
  for (int r = 0; r < ranks; ++r) {
    const int64_t len = base + (r < extra ? 1 : 0);
    l.runs_[size_t(r)].push_back(Run{0, start, 1, len});
    start += len;
  }
  return l;
}

Layout Layout::zigzag(int64_t global_seq, int ranks) {
  Layout l(Kind::zigzag, global_seq, ranks);
  const int chunks = 2 * ranks;
  const int64_t base = global_seq / chunks, extra = global_seq % chunks;
  std::vector<int64_t> start(size_t(chunks) + 1, 0);
  for (int c = 0; c < chunks; ++c)
    start[size_t(c) + 1] = start[size_t(c)] + base + (c < extra);
  for (int r = 0; r < ranks; ++r) {
    const int a = r, b = chunks - 1 - r;
    const int64_t len_a = start[size_t(a) + 1] - start[size_t(a)];
    l.runs_[size_t(r)].push_back(Run{0, start[size_t(a)], 1, len_a});
    l.runs_[size_t(r)].push_back(
        Run{len_a, start[size_t(b)], 1, start[size_t(b) + 1] - start[size_t(b)]});
  }
  return l;
}

Layout Layout::striped(int64_t global_seq, int ranks, int64_t block) {
  DATTN_CHECK_ARG(block >= 1, "stripe block", block, ">= 1 token");
  Layout l(Kind::striped, global_seq, ranks);
  l.block_ = block;
  // Written so that no intermediate exceeds global_seq (sizes near the int64 limit, a block
  // wider than the sequence): blocks * block may, and so may ranks * block, which is only a
  // stride when a rank holds a second block, and then it lies below global_seq.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const int64_t blocks = global_seq / block + (global_seq % block != 0);  // the last may be partial
  const int64_t stride = block <= kMax / ranks ? ranks * block : kMax;
  for (int r = 0; r < ranks; ++r) {
    const int64_t mine = blocks > r ? (blocks - r - 1) / ranks + 1 : 0;  // blocks r, r+P, ..
    const bool has_last = mine > 0 && r + (mine - 1) * ranks == blocks - 1;
    const int64_t len =
        has_last ? (mine - 1) * block + (global_seq - (blocks - 1) * block) : mine * block;
    l.runs_[size_t(r)].push_back(Run{0, mine > 0 ? r * block : global_seq, stride, len, block});
  }
  return l;
}

Layout Layout::varlen(std::vector<int64_t> cu_seqlens, int ranks) {
  Mask::document(cu_seqlens, false).validate();  // non-decreasing, from 0
  Layout l(Kind::varlen, cu_seqlens.back(), ranks);
  const int chunks = 2 * ranks;
  std::vector<int64_t> local(size_t(ranks), 0);
  for (size_t d = 0; d + 1 < cu_seqlens.size(); ++d) {
    const int64_t begin = cu_seqlens[d], len = cu_seqlens[d + 1] - begin;
    const int64_t base = len / chunks, extra = len % chunks;
    auto chunk_begin = [&](int c) { return begin + c * base + std::min<int64_t>(c, extra); };
    for (int r = 0; r < ranks; ++r) {
      for (int c : {r, chunks - 1 - r}) {
        const int64_t n = chunk_begin(c + 1) - chunk_begin(c);
        if (n == 0) continue;  // a document shorter than 2P chunks, or an empty one: no run
        l.runs_[size_t(r)].push_back(Run{local[size_t(r)], chunk_begin(c), 1, n});
        local[size_t(r)] += n;
      }
    }
  }
  l.documents_ = std::make_shared<const std::vector<int64_t>>(std::move(cu_seqlens));
  return l;
}

Layout Layout::blocks(int64_t global_seq, int ranks, int64_t block) {
  DATTN_CHECK_ARG(block >= 1, "block", block, ">= 1 token");
  Layout l(Kind::blocks, global_seq, ranks);
  l.block_ = block;
  // r * nb / P and its start in tokens without overflow near the int64 limit: r * nb as
  // r * (nb / P) + r * (nb % P), both below the limit, and block b starts at min(S, b * block).
  const int64_t nb = global_seq / block + (global_seq % block != 0);
  auto first_block = [&](int64_t r) { return r * (nb / ranks) + r * (nb % ranks) / ranks; };
  auto start = [&](int64_t b) { return b >= nb ? global_seq : b * block; };
  for (int r = 0; r < ranks; ++r) {
    const int64_t first = start(first_block(r)), end = start(first_block(int64_t(r) + 1));
    l.runs_[size_t(r)].push_back(Run{0, first, 1, end - first});
  }
  return l;
}

Layout Layout::balanced(const Mask& mask, int64_t global_seq, int ranks, int64_t chunk) {
  DATTN_CHECK_ARG(chunk >= 1, "chunk", chunk, ">= 1 token");
  mask.validate();
  Layout l(Kind::balanced, global_seq, ranks);
  l.block_ = chunk;
  const int64_t n = global_seq / chunk + (global_seq % chunk != 0);
  // Every pair of chunks is priced: 4096 chunks take about a second (a 65-slice mask).
  DATTN_CHECK_ARG(n <= 4096, "chunk", chunk,
                  detail::cat("at least global_seq / 4096 = ", (global_seq + 4095) / 4096,
                              " (at most 4096 chunks; the dealing prices every pair)"));
  std::vector<Run> chunks(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c)
    chunks[size_t(c)] = Run{0, c * chunk, 1, std::min(chunk, global_seq - c * chunk)};
  std::vector<double> work(size_t(n), 0.0);
  for (size_t c = 0; c < chunks.size(); ++c)
    for (const Run& k : chunks)
      work[c] += kernel_scores(chunks[c], k, mask);
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c)
    order[size_t(c)] = c;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return work[size_t(a)] > work[size_t(b)]; });
  // Every rank takes n / P chunks, and n % P of them one more.
  const int64_t base = n / ranks;
  int64_t extra = n % ranks;
  std::vector<double> load(size_t(ranks), 0.0);
  std::vector<int64_t> count(size_t(ranks), 0);
  std::vector<std::vector<int64_t>> mine(static_cast<size_t>(ranks));
  for (int64_t c : order) {
    int best = -1;
    for (int r = 0; r < ranks; ++r) {
      const bool room = count[size_t(r)] < base || (count[size_t(r)] == base && extra > 0);
      if (room && (best < 0 || load[size_t(r)] < load[size_t(best)])) best = r;
    }
    if (count[size_t(best)] == base) --extra;
    ++count[size_t(best)];
    load[size_t(best)] += work[size_t(c)];
    mine[size_t(best)].push_back(c);
  }
  for (int r = 0; r < ranks; ++r) {
    std::sort(mine[size_t(r)].begin(), mine[size_t(r)].end());
    int64_t local = 0;
    for (int64_t c : mine[size_t(r)]) {
      Run run = chunks[size_t(c)];
      run.local_begin = local;
      local += run.length;
      l.runs_[size_t(r)].push_back(run);
    }
  }
  return l;
}

Layout Layout::make(const std::string& kind, int64_t global_seq, int ranks) {
  if (kind == "contiguous") return contiguous(global_seq, ranks);
  if (kind == "zigzag") return zigzag(global_seq, ranks);
  if (kind == "striped") return striped(global_seq, ranks, 1);
  DATTN_THROW("invalid layout = '", kind, "': expected contiguous, zigzag or striped");
}

const char* Layout::kind_name(Kind kind) {
  switch (kind) {
    case Kind::contiguous:
      return "contiguous";
    case Kind::zigzag:
      return "zigzag";
    case Kind::striped:
      return "striped";
    case Kind::varlen:
      return "varlen";
    case Kind::blocks:
      return "blocks";
    case Kind::balanced:
      return "balanced";
  }
  return "?";
}

const std::vector<Run>& Layout::runs(int rank) const {
  DATTN_CHECK_ARG(rank >= 0 && rank < ranks_, "rank", rank,
                  detail::cat("0 to ", ranks_ - 1, " (ranks of ", str(), ")"));
  return runs_[size_t(rank)];
}

int64_t Layout::local_len(int rank) const {
  int64_t n = 0;
  for (const Run& run : runs(rank))
    n += run.length;
  return n;
}

int64_t Layout::max_local_len() const {
  int64_t m = 0;
  for (int r = 0; r < ranks_; ++r)
    m = std::max(m, local_len(r));
  return m;
}

int64_t Layout::global_position(int rank, int64_t local_index) const {
  for (const Run& run : runs(rank)) {
    if (local_index >= run.local_begin && local_index < run.local_begin + run.length)
      return run.position(local_index - run.local_begin);
  }
  DATTN_THROW("invalid local_index = ", local_index, ": expected 0 to ", local_len(rank) - 1,
              " on rank ", rank, " of ", str());
}

Layout Layout::grouped(int group_size) const {
  DATTN_CHECK_ARG(group_size >= 1 && ranks_ % group_size == 0, "group size", group_size,
                  detail::cat("a divisor of the layout's ranks (", ranks_, ")"));
  Layout g = *this;
  g.ranks_ = ranks_ / group_size;
  g.runs_.assign(size_t(g.ranks_), {});
  for (int group = 0; group < g.ranks_; ++group) {
    int64_t offset = 0;
    for (int m = 0; m < group_size; ++m) {
      const int r = group * group_size + m;
      for (Run run : runs(r)) {
        run.local_begin += offset;
        g.runs_[size_t(group)].push_back(run);
      }
      offset += local_len(r);
    }
  }
  return g;
}

bool Layout::any_visible(const Mask& mask, int q_rank, int k_rank) const {
  for (const Run& q : runs(q_rank)) {
    for (const Run& k : runs(k_rank)) {
      if (q.length == 0 || k.length == 0) continue;
      if (mask.cover(q.global_begin, q.last_position(), k.global_begin, k.last_position()) !=
          Mask::Cover::none)
        return true;
    }
  }
  return false;
}

namespace {
// Bytes of one sequence position of a bshd tensor.
size_t row_bytes(const Tensor& t) {
  size_t n = dtype_size(t.dtype());
  for (int d = 2; d < t.dim(); ++d)
    n *= size_t(t.size(d));
  return n;
}

// Appends the global row (b * global_seq + position) of each of a shard's batch * shard_seq rows,
// in the shard's order: the index map that movement's gather (dispatch) and scatter (undispatch)
// follow. The runs tile the shard, so every entry is set.
void append_global_rows(std::vector<int64_t>& idx, const std::vector<Run>& runs, int64_t global_seq,
                        int64_t shard_seq, int64_t batch) {
  const size_t base = idx.size();
  idx.resize(base + size_t(batch * shard_seq));
  for (int64_t b = 0; b < batch; ++b)
    for (const Run& run : runs)
      for (int64_t t = 0; t < run.length; ++t)
        idx[base + size_t(b * shard_seq + run.local_begin + t)] = b * global_seq + run.position(t);
}
}  // namespace

Tensor Layout::dispatch(const Tensor& global, int rank) const {
  DATTN_CHECK_ARG(global.dim() >= 2, "global tensor rank", global.dim(), ">= 2 (bshd)");
  DATTN_CHECK_ARG(global.size(1) == global_seq_, "global tensor sequence length", global.size(1),
                  detail::cat(global_seq_, " (the layout's global_seq)"));
  const int64_t len = local_len(rank);
  Tensor shard;
  switch (global.dim()) {
    case 2:
      shard = Tensor::empty({global.size(0), len}, global.dtype());
      break;
    case 3:
      shard = Tensor::empty({global.size(0), len, global.size(2)}, global.dtype());
      break;
    default:
      shard = Tensor::empty({global.size(0), len, global.size(2), global.size(3)}, global.dtype());
  }
  std::vector<int64_t> idx;
  append_global_rows(idx, runs(rank), global_seq_, len, global.size(0));
  // On the host; a GPU tensor comes over and its shard goes back to its device.
  const Tensor host = global.device().is_cpu() ? global : global.to_device(Device::cpu());
  movement::host::gather_rows(shard.data(), host.data(), idx.data(), int64_t(idx.size()),
                              row_bytes(global));
  return global.device().is_cpu() ? shard : shard.to_device(global.device());
}

Tensor Layout::undispatch(Communicator& comm, const Tensor& shard) const {
  DATTN_CHECK_ARG(comm.size() == ranks_, "communicator size", comm.size(),
                  detail::cat(ranks_, " (the layout's ranks)"));
  DATTN_CHECK_ARG(shard.dim() >= 2, "shard tensor rank", shard.dim(), ">= 2 (bshd)");
  const int me = comm.rank();
  DATTN_CHECK_ARG(shard.size(1) == local_len(me), "shard sequence length", shard.size(1),
                  detail::cat(local_len(me), " (the layout's local length on rank ", me, ")"));
  const int64_t B = shard.size(0);
  const size_t row = row_bytes(shard);
  std::vector<size_t> counts(static_cast<size_t>(ranks_));
  size_t total = 0;
  for (int r = 0; r < ranks_; ++r)
    total += counts[size_t(r)] = size_t(B * local_len(r)) * row;
  // Over the host-memory twin of comm (itself for MPI; NCCL's MPI side channel, since NCCL moves
  // device memory only): a GPU shard comes to the host first, and the whole tensor goes back to
  // its device at the end. A convenience for results and checks, not a hot path.
  const Tensor host = shard.device().is_cpu() ? shard : shard.to_device(Device::cpu());
  std::vector<char> gathered(std::max<size_t>(total, 1));
  comm.control().allgatherv(host.data(), host.nbytes(), gathered.data(), counts);
  Tensor global;
  switch (shard.dim()) {
    case 2:
      global = Tensor::empty({B, global_seq_}, shard.dtype());
      break;
    case 3:
      global = Tensor::empty({B, global_seq_, shard.size(2)}, shard.dtype());
      break;
    default:
      global = Tensor::empty({B, global_seq_, shard.size(2), shard.size(3)}, shard.dtype());
  }
  std::vector<int64_t> idx;  // every rank's shard, in the order allgatherv put them
  for (int r = 0; r < ranks_; ++r)
    append_global_rows(idx, runs(r), global_seq_, local_len(r), B);
  movement::host::scatter_rows(global.data(), gathered.data(), idx.data(), int64_t(idx.size()),
                               row);
  return shard.device().is_cpu() ? global : global.to_device(shard.device());
}

std::string Layout::str() const {
  std::string extra = kind_ == Kind::striped || kind_ == Kind::blocks
                          ? detail::cat(", block=", block_, "")
                      : kind_ == Kind::balanced ? detail::cat(", chunk=", block_)
                      : documents_              ? detail::cat(", docs=", documents_->size() - 1)
                                                : std::string();
  return detail::cat(kind_name(kind_), "(S=", global_seq_, ", P=", ranks_, extra, ")");
}

uint64_t Layout::hash() const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the defining fields
  auto mix = [&h](uint64_t x) {
    h ^= x;
    h *= 1099511628211ull;
  };
  for (uint64_t x : {uint64_t(kind_), uint64_t(ranks_), uint64_t(global_seq_), uint64_t(block_)})
    mix(x);
  if (documents_)
    for (int64_t e : *documents_)
      mix(uint64_t(e));
  if (kind_ == Kind::balanced)  // which chunks each rank holds
    for (const std::vector<Run>& runs : runs_)
      for (const Run& run : runs)
        mix(uint64_t(run.global_begin) + 1);
  return h;
}

}  // namespace dattn
