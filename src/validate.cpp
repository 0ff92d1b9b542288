// agree_on_validation: one allreduce of (failing rank, hash, ~hash), then on failure a
// broadcast of the failing rank's error (kind and message) or an allgather of the hashes. Also
// the checks of q, k, v and the configuration hash that the attention and star entry points share.
#include "src/validate.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include "src/base/error.h"

namespace dattn {

void agree_on_validation(Communicator& group, const std::string& what, uint64_t config_hash,
                         const std::function<void()>& check) {
  // Flags, messages and hashes live in host memory: the group's control communicator carries
  // them (the group itself on MPI; its MPI twin on NCCL).
  Communicator& comm = group.control();
  constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();
  // The failing rank's error as it travels: its kind and message (cut to fit).
  struct Failure {
    uint64_t kind = uint64_t(ErrorKind::invalid_argument);
    char message[1024] = {};
  } failure;
  uint64_t local[3] = {kNone, config_hash, ~config_hash};
  auto fail = [&](ErrorKind kind, const std::string& message) {
    failure.kind = uint64_t(kind);
    std::strncpy(failure.message, message.c_str(), sizeof(failure.message) - 1);
    local[0] = uint64_t(comm.rank());
  };
  // Whatever the check throws is relayed, so that no rank goes on into a collective alone.
  try {
    check();
  } catch (const Error& e) {
    fail(e.kind(), e.message());
  } catch (const std::bad_alloc&) {
    fail(ErrorKind::out_of_memory, "out of memory while checking the arguments");
  } catch (const std::exception& e) {
    fail(ErrorKind::internal, detail::cat("internal error: ", e.what()));
  }
  // min over ranks of: failing rank, hash, ~hash. All hashes equal iff min(h) == ~min(~h).
  uint64_t global[3];
  comm.allreduce_u64(local, global, 3, ReduceOp::min);

  if (global[0] != kNone) {
    const int root = int(global[0]);
    comm.broadcast(&failure, sizeof(failure), root);
    failure.message[sizeof(failure.message) - 1] = '\0';
    const ErrorKind kind =
        failure.kind < uint64_t(kErrorKinds) ? ErrorKind(failure.kind) : ErrorKind::internal;
    DATTN_THROW_KIND(kind, "rank ", root, " rejected the ", what, ": ", failure.message);
  }
  if (global[1] != ~global[2]) {
    std::vector<uint64_t> hashes(size_t(comm.size()));
    comm.allgather(&config_hash, hashes.data(), sizeof(uint64_t));
    std::string differ;
    for (int r = 1; r < comm.size(); ++r)
      if (hashes[size_t(r)] != hashes[0])
        differ += (differ.empty() ? "" : ", ") + std::to_string(r);
    DATTN_THROW("invalid ", what, ": the configuration differs between ranks (ranks ", differ,
                " differ from rank 0): every rank must pass the same spec, layout, strategy,",
                " batch and dtype");
  }
}

// ================================================================== checks of the entry points

// Shape and dtype checks of q, k, v against the spec (local: each rank checks its own).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const AttnSpec& spec,
               const Device* device) {
  spec.validate();
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    DATTN_CHECK_ARG(t->dim() == 4, detail::cat(name, " rank"), t->dim(),
                    "4 dimensions [batch, seq, heads, head_dim]");
    if (device == nullptr)
      DATTN_CHECK_ARG(t->device().is_cpu(), detail::cat(name, " device"), t->device().str(),
                      "cpu (this entry point has no CUDA path yet)");
    else
      DATTN_CHECK_ARG(t->device() == *device, detail::cat(name, " device"), t->device().str(),
                      detail::cat(device->str(), " (the Runtime's device)"));
    DATTN_CHECK_ARG(t->dtype() == q.dtype(), detail::cat(name, " dtype"), dtype_name(t->dtype()),
                    detail::cat(dtype_name(q.dtype()), " (the dtype of q)"));
    DATTN_CHECK_ARG(t->size(0) == q.size(0), detail::cat(name, " batch"), t->size(0),
                    detail::cat(q.size(0), " (the batch of q)"));
    DATTN_CHECK_ARG(t->data() != nullptr || t->numel() == 0, detail::cat(name, " data"), "nullptr",
                    "a valid pointer");
  }
  DATTN_CHECK_ARG(q.size(0) > 0, "batch", q.size(0), "> 0");
  DATTN_CHECK_ARG(q.size(2) == spec.heads_q, "q heads", q.size(2),
                  detail::cat(spec.heads_q, " (spec.heads_q)"));
  DATTN_CHECK_ARG(q.size(3) == spec.head_dim, "q head_dim", q.size(3),
                  detail::cat(spec.head_dim, " (spec.head_dim)"));
  DATTN_CHECK_ARG(k.size(2) == spec.heads_kv, "k heads", k.size(2),
                  detail::cat(spec.heads_kv, " (spec.heads_kv)"));
  DATTN_CHECK_ARG(k.size(3) == spec.head_dim, "k head_dim", k.size(3),
                  detail::cat(spec.head_dim, " (spec.head_dim)"));
  DATTN_CHECK_ARG(v.size(2) == spec.heads_kv, "v heads", v.size(2),
                  detail::cat(spec.heads_kv, " (spec.heads_kv)"));
  DATTN_CHECK_ARG(v.size(3) == spec.dim_v(), "v head_dim", v.size(3),
                  detail::cat(spec.dim_v(), " (spec.head_dim_v)"));
  DATTN_CHECK_ARG(v.size(1) == k.size(1), "v seq", v.size(1),
                  detail::cat(k.size(1), " (the seq of k)"));
}

uint64_t attention_config_hash(const AttnSpec& spec, const Layout& layout, Strategy strategy,
                               DType dtype, int64_t batch) {
  uint32_t scale_bits;
  float scale = spec.scale();
  std::memcpy(&scale_bits, &scale, 4);
  uint32_t cap_bits;
  std::memcpy(&cap_bits, &spec.softcap, 4);
  uint64_t h = hash_mix(kHashSeed, cap_bits);
  for (uint64_t x : {uint64_t(spec.heads_q), uint64_t(spec.heads_kv), uint64_t(spec.head_dim),
                     uint64_t(spec.dim_v()), uint64_t(scale_bits), spec.mask.hash(), layout.hash(),
                     uint64_t(strategy), uint64_t(dtype), uint64_t(batch)})
    h = hash_mix(h, x);
  return spec.sinks_hash(h);
}

}  // namespace dattn
