// The workloads dattn-run runs and the benchmark executables run one each: their registry. Each
// workload file defines its factory (a Workload on the engine, examples/engine.h), so that
// `dattn-run prefill ARGS` and `dattn-prefill-bench ARGS` are the same run.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "examples/engine.h"

namespace dattn::bench {

std::unique_ptr<Workload> make_prefill_workload();
std::unique_ptr<Workload> make_kernel_workload();
std::unique_ptr<Workload> make_decode_workload();
std::unique_ptr<Workload> make_star_workload();
std::unique_ptr<Workload> make_mla_workload();

const std::vector<WorkloadEntry>& workloads();
const WorkloadEntry* find_workload(const std::string& name);  // nullptr when unknown

}  // namespace dattn::bench
