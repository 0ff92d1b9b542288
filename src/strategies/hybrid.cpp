// Ulysses and hybrid (USP-style) attention. Inside a group of U ranks an all-to-all turns
// sequence shards into head shards: each rank gets its group's whole sequence for H/U of the
// heads (K/V with H_kv/U heads: GQA stays unexpanded). The group's sequence is then attended
// locally (Ulysses: one group) or by ring attention across the R = P/U groups (hybrid), and a
// second all-to-all returns every rank its own rows for all heads. Q, K and V travel in one
// all-to-all, out and lse in the other.
#include <cstring>
#include <vector>

#include "src/error.h"
#include "src/strategies/strategies.h"

namespace dattn {

namespace {

// One member's share of a tensor, on the way out or back: rows [B, rows, heads, dim] of bytes
// `esz`, taken from or put into a bshd tensor of `seq` rows and `all_heads` heads at row `row0`
// and head `head0`. to_buffer: tensor -> buffer, else buffer -> tensor. Returns bytes moved.
size_t copy_block(char* tensor, int64_t B, int64_t seq, int64_t all_heads, int64_t row0,
                  int64_t rows, int64_t head0, int64_t heads, int64_t dim, size_t esz, char* buf,
                  bool to_buffer) {
  const size_t chunk = size_t(heads * dim) * esz;
  size_t off = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < rows; ++s) {
      char* t = tensor + (size_t((b * seq + row0 + s) * all_heads + head0) * size_t(dim)) * esz;
      if (to_buffer)
        std::memcpy(buf + off, t, chunk);
      else
        std::memcpy(t, buf + off, chunk);
      off += chunk;
    }
  }
  return off;
}

// The lse rows [B, heads, rows] of an lse tensor [B, all_heads, seq] at head0 / row0.
size_t copy_lse(float* lse, int64_t B, int64_t seq, int64_t all_heads, int64_t row0, int64_t rows,
                int64_t head0, int64_t heads, char* buf, bool to_buffer) {
  size_t off = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      float* t = lse + (b * all_heads + head0 + h) * seq + row0;
      const size_t n = size_t(rows) * sizeof(float);
      if (to_buffer)
        std::memcpy(buf + off, t, n);
      else
        std::memcpy(t, buf + off, n);
      off += n;
    }
  }
  return off;
}

}  // namespace

Partial hybrid_attention_forward(Communicator& group, Communicator* ring, const Tensor& q,
                                 const Tensor& k, const Tensor& v, const AttnSpec& spec,
                                 const Layout& layout, int cp_rank) {
  const int U = group.size(), me = group.rank();
  const int first = cp_rank - me;  // cp rank of the group's first member
  const int64_t B = q.size(0), Sl = q.size(1);
  const int64_t hq = spec.heads_q / U, hkv = spec.heads_kv / U;
  const int64_t D = spec.head_dim, Dv = spec.dim_v();
  const size_t esz = dtype_size(q.dtype());

  // Rows of each member and where they start in the group's sequence.
  std::vector<int64_t> rows(static_cast<size_t>(U)), row0(static_cast<size_t>(U) + 1, 0);
  for (int j = 0; j < U; ++j) {
    rows[size_t(j)] = layout.local_len(first + j);
    row0[size_t(j) + 1] = row0[size_t(j)] + rows[size_t(j)];
  }
  const int64_t Sg = row0[size_t(U)];

  // ---- 1. Q, K, V: my rows of member j's heads to member j.
  const int64_t per_row = hq * D + hkv * D + hkv * Dv;  // elements per row and member
  std::vector<size_t> send_bytes(static_cast<size_t>(U)), recv_bytes(static_cast<size_t>(U));
  for (int j = 0; j < U; ++j) {
    send_bytes[size_t(j)] = size_t(B * Sl * per_row) * esz;
    recv_bytes[size_t(j)] = size_t(B * rows[size_t(j)] * per_row) * esz;
  }
  std::vector<char> send(size_t(B * Sl * per_row) * esz * size_t(U));
  std::vector<char> recv(size_t(B * Sg * per_row) * esz);
  size_t off = 0;
  for (int j = 0; j < U; ++j) {
    char* buf = send.data() + off;
    size_t n = copy_block(static_cast<char*>(q.data()), B, Sl, spec.heads_q, 0, Sl, j * hq, hq, D,
                          esz, buf, true);
    n += copy_block(static_cast<char*>(k.data()), B, Sl, spec.heads_kv, 0, Sl, j * hkv, hkv, D, esz,
                    buf + n, true);
    n += copy_block(static_cast<char*>(v.data()), B, Sl, spec.heads_kv, 0, Sl, j * hkv, hkv, Dv,
                    esz, buf + n, true);
    off += n;
  }
  group.alltoallv(send.data(), send_bytes, recv.data(), recv_bytes);

  Tensor qg = Tensor::empty({B, Sg, hq, D}, q.dtype());
  Tensor kg = Tensor::empty({B, Sg, hkv, D}, q.dtype());
  Tensor vg = Tensor::empty({B, Sg, hkv, Dv}, q.dtype());
  off = 0;
  for (int j = 0; j < U; ++j) {
    char* buf = recv.data() + off;
    const int64_t r0 = row0[size_t(j)], n = rows[size_t(j)];
    size_t m =
        copy_block(static_cast<char*>(qg.data()), B, Sg, hq, r0, n, 0, hq, D, esz, buf, false);
    m += copy_block(static_cast<char*>(kg.data()), B, Sg, hkv, r0, n, 0, hkv, D, esz, buf + m,
                    false);
    m += copy_block(static_cast<char*>(vg.data()), B, Sg, hkv, r0, n, 0, hkv, Dv, esz, buf + m,
                    false);
    off += m;
  }

  // ---- 2. Attention over the group's sequence for my heads: locally, or a ring of groups.
  AttnSpec sub = spec;
  sub.heads_q = hq;
  sub.heads_kv = hkv;
  sub.softmax_scale = spec.scale();
  const Layout groups = layout.grouped(U);
  Partial part;
  if (ring == nullptr || ring->size() == 1) {
    part = empty_partial(qg, sub);
    attend_runs(qg, groups.runs(0), kg.data(), vg.data(), Sg, groups.runs(0), sub, part);
  } else {
    part = ring_attention_forward(*ring, qg, kg, vg, sub, groups);
  }

  // ---- 3. out and lse: member j's rows of my heads back to member j.
  const size_t f = sizeof(float);
  for (int j = 0; j < U; ++j) {
    send_bytes[size_t(j)] = size_t(B * rows[size_t(j)] * hq * (Dv + 1)) * f;
    recv_bytes[size_t(j)] = size_t(B * Sl * hq * (Dv + 1)) * f;
  }
  send.assign(size_t(B * Sg * hq * (Dv + 1)) * f, 0);
  recv.assign(size_t(B * Sl * hq * (Dv + 1)) * f * size_t(U), 0);
  off = 0;
  for (int j = 0; j < U; ++j) {
    const int64_t r0 = row0[size_t(j)], n = rows[size_t(j)];
    char* buf = send.data() + off;
    size_t m =
        copy_block(static_cast<char*>(part.out.data()), B, Sg, hq, r0, n, 0, hq, Dv, f, buf, true);
    m += copy_lse(part.lse.ptr<float>(), B, Sg, hq, r0, n, 0, hq, buf + m, true);
    off += m;
  }
  group.alltoallv(send.data(), send_bytes, recv.data(), recv_bytes);

  Partial res{Tensor::empty({B, Sl, spec.heads_q, Dv}, DType::f32),
              Tensor::empty({B, spec.heads_q, Sl}, DType::f32)};
  off = 0;
  for (int j = 0; j < U; ++j) {
    char* buf = recv.data() + off;
    size_t m = copy_block(static_cast<char*>(res.out.data()), B, Sl, spec.heads_q, 0, Sl, j * hq,
                          hq, Dv, f, buf, false);
    m += copy_lse(res.lse.ptr<float>(), B, Sl, spec.heads_q, 0, Sl, j * hq, hq, buf + m, false);
    off += m;
  }
  return res;
}

}  // namespace dattn
