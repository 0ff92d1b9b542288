// The table of workloads behind dattn-run and the benchmark executables.
#include "examples/workloads.h"

namespace dattn::bench {

const std::vector<Workload>& workloads() {
  static const std::vector<Workload> all = {
      {"prefill", "dattn-prefill-bench",
       "distributed prefill: ring, ulysses or hybrid over any layout and mask", prefill_main},
      {"decode", "dattn-decode-bench", "decoding over a sharded KV cache: tree, ring or allgather",
       decode_main},
      {"star", "dattn-star-bench", "star attention: blockwise phase 1, then decoding", star_main},
      {"mla", "dattn-mla-bench", "MLA decode: head split against TPLA", mla_main},
      {"kernel", "dattn-kernel-bench", "the CPU kernel against sgemm, one process", kernel_main},
  };
  return all;
}

const Workload* find_workload(const std::string& name) {
  for (const Workload& w : workloads())
    if (name == w.name) return &w;
  return nullptr;
}

}  // namespace dattn::bench
