// Validation that all ranks agree on: a failure on any rank becomes the same dattn::Error on
// every rank, before any data moves, so that no rank is left waiting in a collective. And the
// checks the entry points (attention, star) share.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "collective/communicator.h"
#include "src/attention.h"

namespace dattn {

// Runs `check` on this rank (it throws dattn::Error on bad input), then one small allreduce:
// if any rank's check failed, every rank throws an Error that names the lowest failing rank and
// carries that rank's kind and message (std::bad_alloc counts as out_of_memory, any other
// exception as internal); if the ranks passed different config_hash values (a configuration that
// must match everywhere), every rank throws an invalid_argument Error naming `what` and the ranks
// that differ from rank 0. Collective over comm.
void agree_on_validation(Communicator& comm, const std::string& what, uint64_t config_hash,
                         const std::function<void()>& check);

// FNV-1a mixing of configuration fields into a hash.
inline uint64_t hash_mix(uint64_t h, uint64_t x) {
  for (int i = 0; i < 8; ++i) {
    h ^= (x >> (8 * i)) & 0xffu;
    h *= 1099511628211ull;
  }
  return h;
}
inline constexpr uint64_t kHashSeed = 1469598103934665603ull;

// Shape, dtype and spec checks of this rank's q, k, v (throws dattn::Error naming the field).
// device: the device they must all be on (the Runtime's); null: the host (an entry point
// without a CUDA path).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const AttnSpec& spec,
               const Device* device = nullptr);
// The hash of what must match on every rank of an attention call.
uint64_t attention_config_hash(const AttnSpec& spec, const Layout& layout, Strategy strategy,
                               DType dtype, int64_t batch);

}  // namespace dattn
