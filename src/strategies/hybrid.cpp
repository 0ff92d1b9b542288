// Ulysses and hybrid (USP-style) attention. Inside a group of U ranks an all-to-all turns
// sequence shards into head shards: each rank gets its group's whole sequence for H/U of the
// heads (K/V with H_kv/U heads, or with U > H_kv the one kv head its query heads use, sent to
// each of the U/H_kv members that share it: GQA stays unexpanded). The group's sequence is then
// attended locally (Ulysses: one group) or by ring attention across the R = P/U groups (hybrid),
// and a second all-to-all returns every rank its own rows for all heads. Q, K and V travel in one
// all-to-all, out and lse in the other. The backward is the same with the all-to-alls
// transposed: Q, K, V, dout, lse and delta to head shards, dq, dk, dv back (a shared kv head's
// dk and dv summed over the members that share it).
// The forward runs unchanged on host and GPU tensors: its buffers live on q's device, the packing
// goes through src/dispatch.h, and attend_runs picks the kernel.
#include <vector>

#include "src/base/error.h"
#include "src/dispatch.h"
#include "src/models.h"
#include "src/strategies/strategies.h"

namespace dattn {

namespace {

// One member's share of a tensor, on the way out or back: rows [B, rows, heads, dim] of bytes
// `esz`, taken from or put into a bshd tensor of `seq` rows and `all_heads` heads at row `row0`
// and head `head0`. to_buffer: tensor -> buffer, else buffer -> tensor; both on `dev`. Returns
// bytes moved.
size_t copy_block(Device dev, char* tensor, int64_t B, int64_t seq, int64_t all_heads, int64_t row0,
                  int64_t rows, int64_t head0, int64_t heads, int64_t dim, size_t esz, char* buf,
                  bool to_buffer) {
  if (B * rows == 0) return 0;  // an empty share: the tensor and buf may be null
  const size_t chunk = size_t(heads * dim) * esz, row_stride = size_t(all_heads * dim) * esz;
  char* t = tensor + size_t(row0 * all_heads + head0) * size_t(dim) * esz;
  if (to_buffer)
    pack_rows(dev, buf, t, B, rows, size_t(seq) * row_stride, row_stride, chunk);
  else
    unpack_rows(dev, t, buf, B, rows, size_t(seq) * row_stride, row_stride, chunk);
  return size_t(B * rows) * chunk;
}

// The lse rows [B, heads, rows] of an lse tensor [B, all_heads, seq] at head0 / row0.
size_t copy_lse(Device dev, float* lse, int64_t B, int64_t seq, int64_t all_heads, int64_t row0,
                int64_t rows, int64_t head0, int64_t heads, char* buf, bool to_buffer) {
  if (B * rows == 0) return 0;  // an empty share: the tensor and buf may be null
  const size_t f = sizeof(float), n = size_t(rows) * f;
  float* t = lse + head0 * seq + row0;
  if (to_buffer)
    pack_rows(dev, buf, t, B, heads, size_t(all_heads * seq) * f, size_t(seq) * f, n);
  else
    unpack_rows(dev, t, buf, B, heads, size_t(all_heads * seq) * f, size_t(seq) * f, n);
  return size_t(B * heads) * n;
}

// Adds rows [B, rows] of n fp32 values from buf into a host tensor (row_stride, batch_stride in
// bytes): the back exchange of a kv head that several members share.
size_t add_rows(char* tensor, const char* buf, int64_t B, int64_t rows, size_t batch_stride,
                size_t row_stride, size_t n_bytes) {
  const size_t n = n_bytes / sizeof(float);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < rows; ++r) {
      float* dst =
          reinterpret_cast<float*>(tensor + size_t(b) * batch_stride + size_t(r) * row_stride);
      const float* src = reinterpret_cast<const float*>(buf) + size_t(b * rows + r) * n;
      for (size_t i = 0; i < n; ++i)
        dst[i] += src[i];
    }
  return size_t(B * rows) * n_bytes;
}

// One tensor taking part in an exchange: bshd with `heads` heads per member of `dim` elements of
// `esz` bytes, or lse-like [B, heads, S] (lse = true, dim 1, fp32). `share` members hold the same
// heads (a kv head when U > H_kv: member j holds heads [(j / share) * heads, ...) of the
// [B, Sl, (U / share) * heads, dim] side); on the way back their shares are summed (fp32, host;
// dst zeroed).
struct Part {
  const void* src;  // to_heads: [B, Sl, U / share * heads, dim]; back: [B, Sg, heads, dim]
  void* dst;        // to_heads: [B, Sg, heads, dim];     back: [B, Sl, U / share * heads, dim]
  int64_t heads, dim;
  size_t esz;
  bool lse = false;
  int share = 1;
};

// The group's members: rows[j] = member j's shard length, row0[j] = where it starts in the
// group's sequence (row0[U] = Sg).
struct Members {
  std::vector<int64_t> rows, row0;
};

// Copies member j's share of one part into (to_buffer) or out of a message buffer. to_heads:
// the sender holds rows [0, Sl) of all heads and sends heads [j*h, (j+1)*h); the receiver
// puts them at rows [row0_j, row0_j + rows_j) of its own heads. Back: the reverse.
size_t copy_share(Device dev, const Part& p, char* tensor, bool tensor_is_rows, int j, int U,
                  int64_t B, int64_t Sl, const Members& m, char* buf, bool to_buffer) {
  const int64_t Sg = m.row0.back();
  const int64_t seq = tensor_is_rows ? Sl : Sg;
  const int64_t all_heads = tensor_is_rows ? U / p.share * p.heads : p.heads;
  const int64_t row0 = tensor_is_rows ? 0 : m.row0[size_t(j)];
  const int64_t rows = tensor_is_rows ? Sl : m.rows[size_t(j)];
  const int64_t head0 = tensor_is_rows ? j / p.share * p.heads : 0;
  if (p.share > 1 && tensor_is_rows && !to_buffer) {  // a shared head's share, summed
    DATTN_ASSERT(dev.is_cpu() && p.esz == sizeof(float) && !p.lse);  // fp32 sums on the host
    const size_t row_stride = size_t(all_heads * p.dim) * p.esz;
    return add_rows(tensor + size_t(head0 * p.dim) * p.esz, buf, B, rows, size_t(seq) * row_stride,
                    row_stride, size_t(p.heads * p.dim) * p.esz);
  }
  if (p.lse)
    return copy_lse(dev, reinterpret_cast<float*>(tensor), B, seq, all_heads, row0, rows, head0,
                    p.heads, buf, to_buffer);
  return copy_block(dev, tensor, B, seq, all_heads, row0, rows, head0, p.heads, p.dim, p.esz, buf,
                    to_buffer);
}

// One all-to-all over the group moving every part: sequence shards to head shards (to_heads) or
// back. Each part's bytes per row and member are heads * dim * esz. Every tensor and both message
// buffers live on `dev` (the group's memory: host for MPI, the GPU for NCCL).
void exchange(Device dev, Communicator& group, const std::vector<Part>& parts, int64_t B,
              int64_t Sl, const Members& m, bool to_heads) {
  const int U = group.size();
  size_t row_bytes = 0;
  for (const Part& p : parts)
    row_bytes += size_t(p.heads * p.dim) * p.esz;
  std::vector<size_t> send_bytes(static_cast<size_t>(U)), recv_bytes(static_cast<size_t>(U));
  for (int j = 0; j < U; ++j) {
    const size_t mine = size_t(B * Sl) * row_bytes;
    const size_t theirs = size_t(B * m.rows[size_t(j)]) * row_bytes;
    send_bytes[size_t(j)] = to_heads ? mine : theirs;
    recv_bytes[size_t(j)] = to_heads ? theirs : mine;
  }
  size_t send_total = 0, recv_total = 0;
  for (int j = 0; j < U; ++j) {
    send_total += send_bytes[size_t(j)];
    recv_total += recv_bytes[size_t(j)];
  }
  const Tensor send = byte_buffer(send_total, dev), recv = byte_buffer(recv_total, dev);
  char* send_buf = static_cast<char*>(send.data());
  char* recv_buf = static_cast<char*>(recv.data());
  size_t off = 0;
  for (int j = 0; j < U; ++j)
    for (const Part& p : parts)
      off += copy_share(dev, p, static_cast<char*>(const_cast<void*>(p.src)), to_heads, j, U, B, Sl,
                        m, send_buf + off, true);
  group.alltoallv(send_buf, send_bytes, recv_buf, recv_bytes);
  off = 0;
  for (int j = 0; j < U; ++j)
    for (const Part& p : parts)
      off += copy_share(dev, p, static_cast<char*>(p.dst), !to_heads, j, U, B, Sl, m,
                        recv_buf + off, false);
  // send and recv are freed on return while a GPU's unpacking may still be queued: device memory
  // is freed in the order of the default stream, after that work (src/base/tensor.h).
}

Members members_of(const Communicator& group, const Layout& layout, int cp_rank) {
  const int U = group.size(), first = cp_rank - group.rank();
  Members m;
  m.rows.resize(static_cast<size_t>(U));
  m.row0.assign(static_cast<size_t>(U) + 1, 0);
  for (int j = 0; j < U; ++j) {
    m.rows[size_t(j)] = layout.local_len(first + j);
    m.row0[size_t(j) + 1] = m.row0[size_t(j)] + m.rows[size_t(j)];
  }
  return m;
}

}  // namespace

Partial hybrid_attention_forward(Communicator& group, Communicator* ring, const Tensor& q,
                                 const Tensor& k, const Tensor& v, const AttnSpec& spec,
                                 const Layout& layout, int cp_rank) {
  const int U = group.size();
  const int64_t B = q.size(0), Sl = q.size(1);
  const AttnSpec sub = ulysses_member_spec(spec, U);
  const int share = ulysses_kv_share(spec, U);
  const int64_t hq = sub.heads_q, hkv = sub.heads_kv, D = spec.head_dim, Dv = spec.dim_v();
  const size_t esz = dtype_size(q.dtype()), f = sizeof(float);
  const Members m = members_of(group, layout, cp_rank);
  const int64_t Sg = m.row0.back();
  const Device dev = q.device();  // every buffer on q's device: the same schedule on host and GPU

  // 1. Q, K, V: my rows of member j's heads to member j.
  Tensor qg = Tensor::empty({B, Sg, hq, D}, q.dtype(), dev);
  Tensor kg = Tensor::empty({B, Sg, hkv, D}, q.dtype(), dev);
  Tensor vg = Tensor::empty({B, Sg, hkv, Dv}, q.dtype(), dev);
  exchange(dev, group,
           {{q.data(), qg.data(), hq, D, esz},
            {k.data(), kg.data(), hkv, D, esz, false, share},
            {v.data(), vg.data(), hkv, Dv, esz, false, share}},
           B, Sl, m, true);

  // 2. Attention over the group's sequence for my heads: locally, or a ring of groups.
  const Layout groups = layout.grouped(U);
  Partial part;
  if (ring == nullptr || ring->size() == 1) {
    part = empty_partial(qg, sub);
    attend_runs(qg, groups.runs(0), kg.data(), vg.data(), Sg, groups.runs(0), sub, part);
  } else {
    part = ring_attention_forward(*ring, qg, kg, vg, sub, groups);
  }

  // 3. out and lse: member j's rows of my heads back to member j.
  Partial res{Tensor::empty({B, Sl, spec.heads_q, Dv}, DType::f32, dev),
              Tensor::empty({B, spec.heads_q, Sl}, DType::f32, dev)};
  exchange(dev, group,
           {{part.out.data(), res.out.data(), hq, Dv, f},
            {part.lse.data(), res.lse.data(), hq, 1, f, true}},
           B, Sl, m, false);
  return res;
}

Gradients hybrid_attention_backward(Communicator& group, Communicator* ring, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& dout,
                                    const float* lse, const float* delta, const AttnSpec& spec,
                                    const Layout& layout, int cp_rank) {
  const int U = group.size();
  const int64_t B = q.size(0), Sl = q.size(1);
  const AttnSpec sub = ulysses_member_spec(spec, U);
  const int share = ulysses_kv_share(spec, U);
  const int64_t hq = sub.heads_q, hkv = sub.heads_kv, D = spec.head_dim, Dv = spec.dim_v();
  const size_t esz = dtype_size(q.dtype()), f = sizeof(float);
  const Members m = members_of(group, layout, cp_rank);
  const int64_t Sg = m.row0.back();
  const Device dev = q.device();             // every buffer, and the exchanges, on it
  DATTN_ASSERT(dout.dtype() == DType::f32);  // the entry point's fp32 dout (the byte model's)

  // 1. The forward's exchange of Q, K, V, plus dout (fp32) and the rows' lse and delta.
  Tensor qg = Tensor::empty({B, Sg, hq, D}, q.dtype(), dev);
  Tensor kg = Tensor::empty({B, Sg, hkv, D}, q.dtype(), dev);
  Tensor vg = Tensor::empty({B, Sg, hkv, Dv}, q.dtype(), dev);
  Tensor dog = Tensor::empty({B, Sg, hq, Dv}, DType::f32, dev);
  Tensor lseg = Tensor::empty({B, hq, Sg}, DType::f32, dev);
  Tensor deltag = Tensor::empty({B, hq, Sg}, DType::f32, dev);
  exchange(dev, group,
           {{q.data(), qg.data(), hq, D, esz},
            {k.data(), kg.data(), hkv, D, esz, false, share},
            {v.data(), vg.data(), hkv, Dv, esz, false, share},
            {dout.data(), dog.data(), hq, Dv, f},
            {lse, lseg.data(), hq, 1, f, true},
            {delta, deltag.data(), hq, 1, f, true}},
           B, Sl, m, true);

  // 2. The backward over the group's sequence for my heads.
  const Layout groups = layout.grouped(U);
  Gradients part;
  if (ring == nullptr || ring->size() == 1) {
    part = {Tensor::zeros({B, Sg, hq, D}, DType::f32, dev),
            Tensor::zeros({B, Sg, hkv, D}, DType::f32, dev),
            Tensor::zeros({B, Sg, hkv, Dv}, DType::f32, dev)};
    backward_runs(qg, groups.runs(0), kg.data(), vg.data(), Sg, groups.runs(0), dog,
                  lseg.ptr<float>(), deltag.ptr<float>(), sub, part.dq.ptr<float>(),
                  part.dk.ptr<float>(), part.dv.ptr<float>());
  } else {
    part = ring_attention_backward(*ring, qg, kg, vg, dog, lseg.ptr<float>(), deltag.ptr<float>(),
                                   sub, groups);
  }

  // 3. dq, dk, dv: member j's rows of my heads back to member j.
  // A kv head that `share` members hold gets the sum of their dk and dv (each covers its own
  // query heads), so those start at zero.
  auto grad = [&](int64_t heads, int64_t d) {
    return share > 1 ? Tensor::zeros({B, Sl, heads, d}, DType::f32, dev)
                     : Tensor::empty({B, Sl, heads, d}, DType::f32, dev);
  };
  Gradients g{Tensor::empty({B, Sl, spec.heads_q, D}, DType::f32, dev), grad(spec.heads_kv, D),
              grad(spec.heads_kv, Dv)};
  exchange(dev, group,
           {{part.dq.data(), g.dq.data(), hq, D, f},
            {part.dk.data(), g.dk.data(), hkv, D, f, false, share},
            {part.dv.data(), g.dv.data(), hkv, Dv, f, false, share}},
           B, Sl, m, false);
  return g;
}

}  // namespace dattn
