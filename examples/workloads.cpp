// The table of workloads behind dattn-run and the benchmark executables.
#include "examples/workloads.h"

namespace dattn::bench {

const std::vector<WorkloadEntry>& workloads() {
  static const std::vector<WorkloadEntry> all = {
      {"prefill", "dattn-prefill-bench",
       "distributed prefill: ring, ulysses or hybrid over any layout and mask",
       make_prefill_workload},
      {"decode", "dattn-decode-bench", "decoding over a sharded KV cache: tree, ring or allgather",
       make_decode_workload},
      {"star", "dattn-star-bench", "star attention: blockwise phase 1, then decoding",
       make_star_workload},
      {"mla", "dattn-mla-bench", "MLA decode: head split against TPLA", make_mla_workload},
      {"kernel", "dattn-kernel-bench", "the CPU kernel against sgemm, one process",
       make_kernel_workload},
  };
  return all;
}

const WorkloadEntry* find_workload(const std::string& name) {
  for (const WorkloadEntry& w : workloads())
    if (name == w.name) return &w;
  return nullptr;
}

}  // namespace dattn::bench
