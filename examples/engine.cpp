// The benchmark engine (see engine.h): option parsing, the Runtime, timing, the check
// statistics, tables, footer, JSON, --compare and the dry run around a Workload; then report::.
#include "examples/engine.h"

#include <mpi.h>
#include <omp.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <type_traits>

#include "collective/mpi_communicator.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/decode_cpu.h"
#include "launch/program.h"
#include "launch/progress.h"
#include "src/base/error.h"
#include "src/dispatch.h"
#include "src/layout.h"

namespace dattn::bench {

using detail::cat;

// ------------------------------------------------------------------ small services

namespace {
template <typename T>
T allreduce(T v, MPI_Op op) {
  const MPI_Datatype type = std::is_same_v<T, double> ? MPI_DOUBLE : MPI_UINT64_T;
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &v, 1, type, op, MPI_COMM_WORLD));
  return v;
}
}  // namespace

double allreduce_max(double v) {
  return allreduce(v, MPI_MAX);
}
uint64_t allreduce_max(uint64_t v) {
  return allreduce(v, MPI_MAX);
}
uint64_t allreduce_sum(uint64_t v) {
  return allreduce(v, MPI_SUM);
}
double allreduce_sum(double v) {
  return allreduce(v, MPI_SUM);
}

int node_ranks() {
  MPI_Comm node;
  DATTN_MPI_CHECK(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int n = 1;
  DATTN_MPI_CHECK(MPI_Comm_size(node, &n));
  DATTN_MPI_CHECK(MPI_Comm_free(&node));
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &n, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  return n;
}

std::string verdict(bool is_target, bool met, const char* otherwise) {
  return !is_target ? otherwise : met ? ": met" : ": NOT met";
}

double RelL2::reduced() const {
  double s[2] = {d2, r2};
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, s, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  return std::sqrt(s[1] > 0 ? s[0] / s[1] : s[0]);
}

Spread spread(int n, const std::function<double(int)>& f) {
  Spread s;
  for (int r = 0; r < n; ++r) {
    const double v = f(r);
    s.max = std::max(s.max, v), s.sum += v;
  }
  if (s.sum > 0) s.imbalance = s.max / (s.sum / n);
  return s;
}

namespace {

int world_rank() {
  int rank = 0;
  DATTN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}

// Nearest-rank percentile (0 < p <= 100) of sorted values (not empty).
double percentile(const std::vector<double>& sorted, double p) {
  const size_t n = sorted.size();
  const size_t k = std::clamp<size_t>(size_t(std::ceil(p / 100.0 * double(n))), 1, n);
  return sorted[k - 1];
}

// The read bandwidth of roofline_footer: 1 GiB / node_ranks per rank (1 GiB per node: larger
// than a last-level cache) that the rank's threads wrote; GB/s (1e9 B), the mean over ranks.
double read_bandwidth_gbs(int node_ranks) {
  // Each thread sums its part with the decode kernel's widest vectors (cpu::read_sum).
  constexpr int64_t kLanes = 64;
  const int64_t n = (int64_t(1) << 30) / int64_t(sizeof(float)) / kLanes / node_ranks * kLanes;
  std::unique_ptr<float[]> buf(new float[size_t(n)]);
  float* p = buf.get();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)  // the pages land near the threads that read them
    p[i] = float(i & 7);
  double best = 0;
  for (int pass = 0; pass < 3; ++pass) {
    DATTN_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
    const double t0 = MPI_Wtime();
    double total = 0;
#pragma omp parallel reduction(+ : total)
    {
      // The same static split of the n / kLanes blocks as the fill's.
      const int64_t blocks = n / kLanes, threads = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
      total += cpu::read_sum(p + b0 * kLanes, (b1 - b0) * kLanes);
    }
    const double s = MPI_Wtime() - t0;
    if (total < 0) std::abort();  // the sum is used, so the loop stays
    best = std::max(best, double(n) * sizeof(float) / s / 1e9);
  }
  int ranks = 1;
  DATTN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &ranks));
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &best, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  return best / ranks;
}

// "a,b,c" -> the items, empty ones kept (so that they can be rejected).
std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  for (size_t begin = 0;;) {
    const size_t at = s.find(',', begin);
    out.push_back(s.substr(begin, at == std::string::npos ? at : at - begin));
    if (at == std::string::npos) return out;
    begin = at + 1;
  }
}

}  // namespace

std::vector<double> roofline_footer(Bench& b,
                                    const std::vector<std::pair<std::string, double>>& kernels,
                                    report::Json& top) {
  const double read = read_bandwidth_gbs(b.rt().node().size());
  std::vector<double> ratios;
  std::vector<std::string> cells;
  report::Json j = report::Json::object();
  for (const auto& [name, gbs] : kernels) {
    ratios.push_back(gbs < 0 ? -1 : gbs / read);
    cells.push_back(cat(name, " ", gbs < 0 ? "n/a" : report::fixed(ratios.back(), 2)));
    if (gbs >= 0) j[name] = ratios.back();
  }
  if (b.root()) {
    report::print_footer_line(
        "Read bandwidth", cat(report::fixed(read, 2), " GB/s per rank (", b.rt().threads(),
                              " threads: best of 3 sums over 1 GiB per node, every rank at once)"));
    report::print_footer_line("Kernel / read", cat(report::join(cells, ", "),
                                                   " (the kernel column over the read bandwidth)"));
  }
  top["read_gbs"] = read, top["kernel_over_read"] = j;
  return ratios;
}

double peak_rss_mib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) / 1024.0;  // KiB on Linux
}

std::optional<std::vector<int64_t>> parse_int_list(const std::string& s) {
  std::vector<int64_t> out;
  for (const std::string& item : split_list(s)) {
    size_t used = 0;
    try {
      out.push_back(std::stoll(item, &used, 10));
    } catch (const std::exception&) {
      return std::nullopt;
    }
    if (used != item.size()) return std::nullopt;
  }
  return out;
}

DType dtype_option(const std::string& name) {
  try {
    return parse_dtype(name);
  } catch (const Error&) {
    require_option(false, "--dtype", name, "fp32, bf16 or fp16");
  }
  return DType::f32;
}

void Shape::add_options(po::options_description& desc) {
  // clang-format off
  desc.add_options()
    ("batch,b", po::value(&batch)->default_value(batch), "batch size B")
    ("heads,H", po::value(&heads)->default_value(heads), "query heads H_q")
    ("kv-heads,G", po::value(&kv_heads)->default_value(kv_heads),
     "key/value heads H_kv (H_q must be a multiple)")
    ("head-dim,d", po::value(&head_dim)->default_value(head_dim), "head dimension D")
    ("dtype,t", po::value(&dtype_name)->default_value(dtype_name),
     "storage dtype: fp32, bf16 or fp16");
  // clang-format on
}

void Shape::resolve(int tp_size) {
  tp = tp_size;
  require_option(batch >= 1, "--batch", batch, ">= 1");
  require_option(heads >= 1, "--heads", heads, ">= 1");
  require_option(kv_heads >= 1 && heads % kv_heads == 0, "--kv-heads", kv_heads,
                 cat(">= 1 and dividing --heads (", heads, ")"));
  require_option(kv_heads % tp == 0, "--kv-heads", kv_heads,
                 cat("divisible by --tp (", tp, "): tensor parallelism splits the heads"));
  require_option(head_dim >= 1, "--head-dim", head_dim, ">= 1");
  dtype = dtype_option(dtype_name);
}

AttnSpec Shape::spec(Mask mask) const {
  return {.heads_q = heads / tp, .heads_kv = kv_heads / tp, .head_dim = head_dim, .mask = mask};
}

std::string Shape::words() const {
  report::Json j = report::Json::object();
  json(j);
  return report::words(j);
}

void Shape::json(report::Json& cfg) const {
  cfg["dtype"] = dattn::dtype_name(dtype), cfg["batch"] = batch, cfg["heads"] = heads;
  cfg["kv_heads"] = kv_heads, cfg["head_dim"] = head_dim;
}

void require_one_of(const char* option, const std::string& value,
                    const std::vector<std::string>& allowed) {
  std::string expected;
  for (size_t i = 0; i < allowed.size(); ++i)
    expected += (i == 0 ? "" : i + 1 == allowed.size() ? " or " : ", ") + allowed[i];
  require_option(std::find(allowed.begin(), allowed.end(), value) != allowed.end(), option, value,
                 expected);
}

void CheckStats::compare(double got, double ref, const Tolerance& tol) {
  checked += 1;
  if (std::isinf(ref) || std::isinf(got)) {
    if (got != ref) wrong += 1;
    return;
  }
  const double err = std::abs(got - ref);
  if (std::isfinite(err)) max_err = std::max(max_err, err);
  if (!(err <= tol.abs + tol.rel * std::abs(ref))) wrong += 1;
}

CheckStats CheckStats::reduced() const {
  return {allreduce_sum(checked), allreduce_sum(wrong), allreduce_max(max_err)};
}

uint64_t Row::wrong() const {
  return uint64_t(std::max<int64_t>(result.wrong, 0)) + byte_mismatches;
}

bool Row::has_wrong() const {
  return result.wrong >= 0 || byte_mismatches > 0;
}

void Row::take_bytes(const Timing& t) {
  byte_checked = t.byte_checked;
  byte_mismatches = t.byte_mismatches;
  result.sent_mb_per_rank = t.sent_mb;
  result.model_mb_per_rank = t.model_mb;
}

std::string wrong_cell(const Row& r) {
  return r.has_wrong() ? std::to_string(r.wrong()) : "N/A";
}

std::string kernel_cell(const Timing& t) {
  return t.kernel_gbs >= 0 ? report::fixed(t.kernel_gbs, 2) : "n/a";
}

// ------------------------------------------------------------------ Bench

void Bench::note(const std::string& line) const {
  if (!root()) return;
  std::printf("# %s\n", line.c_str());
  std::fflush(stdout);
}

Timing Bench::time(const std::string& what, const TimedCall& c) {
  const int warmup = c.warmup >= 0 ? c.warmup : std::max(opts_.warmup, 0);
  const int iters = c.iters >= 1 ? c.iters : opts_.iters;
  Progress progress(root(), what, warmup + iters, c.unit);
  std::vector<double> times;
  double seconds = 0, kernel_s = 0;
  uint64_t sent_sum = 0, model_sum = 0, mismatches = 0, kernel_bytes = 0;
  for (int i = 0; i < warmup + iters; ++i) {
    const bool timed = i >= warmup;
    if (c.prepare) c.prepare(i);
    rt_.reset_counters();
    rt_.world().barrier();
    const KernelStats k0 = kernel_stats();
    const double t0 = MPI_Wtime();
    c.call();
    const double t = MPI_Wtime() - t0;
    const KernelStats k1 = kernel_stats();
    if (timed) kernel_s += k1.seconds - k0.seconds, kernel_bytes += k1.bytes - k0.bytes;
    if (c.model_bytes) {
      const ByteCounters counters = rt_.counters();
      const uint64_t sent = c.counted ? c.counted(counters) : counters.data_bytes();
      const uint64_t model = c.model_bytes();
      if (sent != model) mismatches += 1;
      if (timed) sent_sum += sent, model_sum += model;
    }
    if (timed) times.push_back(t), seconds += t;
    progress.step();
  }
  Timing r;
  r.mean_ms = allreduce_max(seconds / iters) * 1e3;
  // A step's time is the slowest rank's: the element-wise max over ranks.
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, times.data(), int(times.size()), MPI_DOUBLE, MPI_MAX,
                                MPI_COMM_WORLD));
  double total = 0;
  for (double t : times)
    total += t, r.step_ms.push_back(t * 1e3);
  std::sort(times.begin(), times.end());
  r.step_mean_ms = total / iters * 1e3;
  r.p50_ms = percentile(times, 50) * 1e3;
  r.p99_ms = percentile(times, 99) * 1e3;
  r.best_ms = times.front() * 1e3;
  double kernel[2] = {kernel_s, double(kernel_bytes)};
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, kernel, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  if (kernel[0] > 0) r.kernel_gbs = kernel[1] / kernel[0] / 1e9;
  if (c.model_bytes) {
    r.byte_checked = true;
    r.sent_mb = double(allreduce_max(sent_sum)) / iters / 1e6;
    r.model_mb = double(allreduce_max(model_sum)) / iters / 1e6;
    r.byte_mismatches = allreduce_sum(mismatches);
  }
  return r;
}

// ------------------------------------------------------------------ Plan

void Plan::line(const std::string& text) const {
  std::printf("# %s\n", text.c_str());
}

void Plan::grid(const std::string& what, const std::string& groups) const {
  const LaunchOptions& l = opts_.launch;
  line(cat("world ", l.world, " ranks = cp ", l.cp, " x tp ", l.tp,
           " (tp is the fastest rank index); ", what));
  line(cat("communicators: ", l.tp, " cp group(s) of ", l.cp,
           " ranks (cp group t: world ranks t, t+", l.tp, ", ...); ", l.cp, " tp group(s) of ",
           l.tp, " consecutive ranks", groups));
  line("device: " + device_plan(l));
}

void Plan::table(std::vector<report::Column> columns) {
  columns_ = std::move(columns);
  report::print_heading(columns_);
}

std::vector<int> Plan::shown(int n) {
  constexpr int kEnds = 8;
  std::vector<int> out;
  for (int i = 0; i < n; ++i)
    if (n <= 2 * kEnds || i < kEnds || i >= n - kEnds) out.push_back(i);
  return out;
}

void Plan::for_shown(int n, const std::function<void(int)>& f) const {
  int next = 0;
  for (int i : shown(n)) {
    if (i > next) std::printf("#  ... %d ranks not shown\n", i - next);
    f(i);
    next = i + 1;
  }
}

// ------------------------------------------------------------------ options

std::vector<std::string> Workload::config_lines(Runtime& rt) const {
  return {cat("ranks ", rt.size(), " (cp ", rt.cp_size(), " x tp ", rt.tp_size(), ") threads/rank ",
              rt.threads(), " ", config_words())};
}

std::string Workload::config_words() const {
  report::Json cfg = report::Json::object();
  config_json(cfg);
  return report::words(cfg);
}

RuntimeOptions Workload::runtime_options(const EngineOptions& e) const {
  return {.device = e.launch.dev, .cp = e.launch.cp, .tp = e.launch.tp, .threads = e.threads};
}

namespace {

// A workload and its options, parsed from one command line.
struct Parsed {
  std::unique_ptr<Workload> w;
  EngineOptions e;
  po::variables_map vm;
  Defaults d;
  bool answered = false;  // --help or --version was printed
};

// The shared options of a one-process workload: cp 1 x tp 1, the device cpu; the job's other
// launch options are checked on the job's grid.
void resolve_one_process(LaunchOptions& o) {
  const std::string why = "the workload runs in one process";
  require_option(o.cp == 0 || o.cp == 1, "--cp", o.cp, cat("1: ", why));
  require_option(o.tp == 0 || o.tp == 1, "--tp", o.tp, cat("1: ", why));
  require_option(o.world_size <= 1, "--world-size", o.world_size,
                 cat("1: ", why, " (each rank of a job runs it alone)"));
  require_option(o.device == "cpu", "--device", o.device, cat("cpu: ", why, " on the CPU"));
  LaunchOptions job = o;
  job.cp = job.tp = 0;
  resolve_launch_options(job, 1);
  o.cp = o.tp = o.world = 1;
  o.dev = job.dev;
}

// The engine's own long options, which --compare cannot vary.
bool engine_option(const std::string& key) {
  for (const char* k : {"compare", "json", "help", "version", "config", "dry-run", "world-size"})
    if (key == k) return true;
  return false;
}

// -k/--check takes an optional value: a bare -k or --check (not followed by a value) means 1.
// (Boost's implicit_value would take no separate value at all: `-k 0` must keep working.)
std::vector<std::string> with_check_values(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] != "-k" && args[i] != "--check") continue;
    const bool value_next = i + 1 < args.size() && !args[i + 1].empty() && args[i + 1][0] != '-';
    if (!value_next) args[i] = "--check=1";
  }
  return args;
}

// compare_key and compare_value given: a --compare rerun, the option set to the value.
Parsed parse(const WorkloadEntry& entry, int argc, char** argv, const std::string& compare_key = "",
             const std::string& compare_value = "") {
  Parsed p;
  p.w = entry.make();
  Workload& w = *p.w;
  EngineOptions& e = p.e;
  const Defaults d = p.d = w.defaults();
  e.iters = d.iters;
  e.warmup = std::max(d.warmup, 0);
  e.threads = d.threads;
  e.check = d.has_check ? 1 : 0;
  bool help = false, version = false;
  po::options_description desc(cat(entry.program, ": ", entry.summary, "\nusage: mpiexec -n P ",
                                   entry.program, " [options]"));
  po::options_description own(cat(entry.name, " options"));
  w.add_options(own);
  po::options_description shared("benchmark options (shared by every workload)");
  auto add = shared.add_options();
  add(d.iters_option, po::value(&e.iters)->default_value(e.iters), d.iters_help);
  if (d.warmup >= 0)
    add("warmup,w", po::value(&e.warmup)->default_value(e.warmup), "untimed warm-up iterations");
  if (d.has_check)
    add("check,k", po::value(&e.check)->default_value(e.check)->value_name("0|1"),
        "the built-in check against the float64 reference, on a cheap sample (fills #wrong); "
        "0: off; --check alone: 1");
  add("threads,T", po::value(&e.threads)->default_value(e.threads),
      "OpenMP threads per rank (0: OMP_NUM_THREADS, else cores per rank)");
  add("json,J", po::value(&e.json)->value_name("FILE"), "also write the results as JSON to FILE");
  add("compare", po::value(&e.compare)->value_name("KEY=A,B"),
      "after the table, run the largest case once per value of option KEY (a long option "
      "above, e.g. layout=contiguous,zigzag or mask=none,causal) and report the time ratios "
      "B/A");
  add("help,h", po::bool_switch(&help), "print this help");
  add("version,V", po::bool_switch(&version), "print the version");
  desc.add(own).add(shared);
  add_launch_options(desc, e.launch);

  const std::vector<std::string> args = with_check_values(argc, argv);
  std::vector<char*> ptrs;
  for (const std::string& a : args)
    ptrs.push_back(const_cast<char*>(a.c_str()));
  po::variables_map& vm = p.vm;
  std::vector<std::string> first;
  if (!compare_value.empty()) first = {"--" + compare_key, compare_value};
  parse_command_line(int(ptrs.size()), ptrs.data(), desc, vm, first);
  if (help || version) {
    if (world_rank() == 0) {
      if (help) std::cout << desc << "\n";
      if (version) std::cout << entry.program << " " << DATTN_VERSION << "\n";
    }
    p.answered = true;
    return p;
  }

  if (d.one_process) {
    resolve_one_process(e.launch);
  } else {
    e.launch.runs_on_cuda = d.runs_on_cuda;
    resolve_launch_options(e.launch, 1);
  }
  const std::string iters_name = cat("--", split_list(d.iters_option)[0]);
  require_option(e.iters >= 1, iters_name.c_str(), e.iters, ">= 1");
  require_option(e.warmup >= 0, "--warmup", e.warmup, ">= 0");
  require_option(e.check == 0 || e.check == 1, "--check", e.check, "0 or 1");
  require_option(e.threads >= d.min_threads, "--threads", e.threads, cat(">= ", d.min_threads));
  if (vm.count("compare")) {
    const size_t eq = e.compare.find('=');
    const std::string key = e.compare.substr(0, eq);
    const std::vector<std::string> values =
        eq == std::string::npos ? std::vector<std::string>{} : split_list(e.compare.substr(eq + 1));
    const bool values_ok =
        values.size() >= 2 &&
        std::none_of(values.begin(), values.end(), [](const std::string& v) { return v.empty(); });
    require_option(values_ok && !key.empty() && !engine_option(key) &&
                       desc.find_nothrow(key, false) != nullptr,
                   "--compare", e.compare,
                   "KEY=A,B[,...]: KEY a long option of the workload, two or more values");
    e.compare_key = key;
    e.compare_values = values;
  }
  e.compare_value = compare_value;
  w.resolve(vm, e);
  return p;
}

// The header block: "# <title>, version X", the config lines, the build, and one line per rank
// (allgathered in fixed-size records): "#  Rank  0 Group  0 Pid  1234 on host device cpu
// threads 2". Collective over MPI_COMM_WORLD.
void print_header(const std::string& title, const std::vector<std::string>& config, Runtime& rt) {
  // Ranks whose OpenMP threads outnumber the CPUs they may run on (mpiexec binds each rank to
  // one core when it starts at most 2): their threads take turns.
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int ncpu = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 0;
  struct Record {
    int32_t crowded;
    char line[188];
  } mine{ncpu > 0 && rt.threads() > ncpu, {}};
  std::snprintf(mine.line, sizeof mine.line,
                "#  Rank %2d Group  0 Pid %6d on %10.64s device %.16s threads %d", world_rank(),
                int(getpid()), host_name().c_str(), rt.device().str().c_str(), rt.threads());
  int ranks = 1;
  DATTN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &ranks));
  std::vector<Record> all(static_cast<size_t>(ranks));
  DATTN_MPI_CHECK(MPI_Allgather(&mine, sizeof(Record), MPI_BYTE, all.data(), sizeof(Record),
                                MPI_BYTE, MPI_COMM_WORLD));
  if (rt.rank() != 0) return;  // (a one-process workload: every rank of the job prints)
  std::printf("# %s, version %s\n", title.c_str(), DATTN_VERSION);
  for (const auto& line : config)
    std::printf("# %s\n", line.c_str());
  std::printf("# DATTN_WITH_CUDA=%d DATTN_WITH_NCCL=%d\n", int(DATTN_WITH_CUDA),
              int(DATTN_WITH_NCCL));
  std::printf("# cpu kernel: %s\n#\n# Using devices\n", dattn::cpu::cpu_kernel_info().c_str());
  int crowded = 0;
  for (const Record& r : all)
    std::printf("%s\n", r.line), crowded += r.crowded;
  std::printf("#\n");
  if (crowded > 0)
    std::printf(
        "# warning: %d rank(s) may use fewer CPUs than their %d OpenMP threads, which then take "
        "turns (mpiexec --bind-to none lets them spread)\n",
        crowded, rt.threads());
  std::fflush(stdout);
}

// Runs every case of one workload, printing its tables; returns the rows.
std::vector<Row> run_cases(Workload& w, Bench& b) {
  const auto tables = w.tables(b);
  std::vector<Row> rows;
  int current = -1;
  for (const Case& c : w.cases(b)) {
    DATTN_ASSERT(c.table >= 0 && size_t(c.table) < tables.size());
    const std::vector<report::Column>& table = tables[size_t(c.table)];
    if (b.root() && c.table != current) report::print_heading(table);
    current = c.table;
    for (Row& r : w.run(b, c)) {
      if (b.root()) report::print_row(table, r.cells);
      rows.push_back(std::move(r));
    }
  }
  return rows;
}

// One --compare value: the largest case under KEY = value.
struct Compared {
  std::string value;
  std::string label;
  double time_ms = 0;
  uint64_t wrong = 0;
};

Compared run_compare(const WorkloadEntry& entry, int argc, char** argv, const EngineOptions& base,
                     const std::string& value) {
  Parsed p = parse(entry, argc, argv, base.compare_key, value);
  Runtime rt = Runtime::from_mpi(p.d.one_process ? MPI_COMM_SELF : MPI_COMM_WORLD,
                                 p.w->runtime_options(p.e));
  Bench b(rt, p.e);
  b.note(cat("compare ", base.compare_key, "=", value, ":"));
  const std::vector<Row> rows = run_cases(*p.w, b);
  Compared c;
  c.value = value;
  const std::vector<Case> cases = p.w->cases(b);
  c.label = cases.empty() ? "" : cases.front().label;
  c.time_ms = rows.empty() ? 0 : rows.front().result.time_ms;
  for (const Row& r : rows)
    c.wrong += r.wrong();
  return c;
}

void dry_run(const char* name, Workload& w, const EngineOptions& e) {
  const double start = MPI_Wtime();
  std::printf("# dattn %s plan (dry run, nothing computed), version %s\n", name, DATTN_VERSION);
  Plan plan(e);
  w.plan(plan);
  std::printf("# planned %d ranks in %.3f s\n", e.launch.world, MPI_Wtime() - start);
  std::fflush(stdout);
}

}  // namespace

// ------------------------------------------------------------------ the run

std::optional<ParsedWorkload> parse_workload(const WorkloadEntry& entry, int argc, char** argv) {
  Parsed p = parse(entry, argc, argv);
  if (p.answered) return std::nullopt;
  return ParsedWorkload{std::move(p.w), std::move(p.e), std::move(p.vm)};
}

int run_workload(const WorkloadEntry& entry, int argc, char** argv) {
  Parsed p = parse(entry, argc, argv);
  if (p.answered) return 0;
  for (const std::string& v : p.e.compare_values)  // each rerun's options, before any run
    parse(entry, argc, argv, p.e.compare_key, v);
  Workload& w = *p.w;
  const EngineOptions& e = p.e;
  if (e.launch.dry_run) {
    if (world_rank() == 0) dry_run(entry.name, w, e);
    return 0;
  }

  Runtime rt =
      Runtime::from_mpi(p.d.one_process ? MPI_COMM_SELF : MPI_COMM_WORLD, w.runtime_options(e));
  Bench b(rt, e);
  std::vector<std::string> config = w.config_lines(rt);
  config.push_back(cat(split_list(p.d.iters_option)[0], " ", e.iters,
                       p.d.warmup >= 0 ? cat(" warmup ", e.warmup) : "",
                       p.d.has_check ? cat(" check ", e.check) : "",
                       e.compare.empty() ? "" : " compare " + e.compare));
  print_header(cat("dattn ", entry.name, " benchmark"), config, rt);
  const std::vector<Row> rows = run_cases(w, b);
  std::vector<Compared> compared;
  for (const std::string& v : e.compare_values)
    compared.push_back(run_compare(entry, argc, argv, e, v));

  // ---------------------------------------------------------------- footer
  uint64_t wrong = 0, byte_mismatches = 0;
  bool byte_checked = false;
  double tflops = 0;
  int tflops_rows = 0;
  for (const Row& r : rows) {
    wrong += r.wrong();
    byte_mismatches += r.byte_mismatches;
    byte_checked = byte_checked || r.byte_checked;
    if (r.in_json && r.result.tflops_per_rank >= 0) {
      tflops += r.result.tflops_per_rank;
      ++tflops_rows;
    }
  }
  for (const Compared& c : compared)
    wrong += c.wrong;
  if (tflops_rows > 0) tflops /= tflops_rows;
  if (b.root()) {
    report::print_footer_line("Out of bounds values",
                              std::to_string(wrong) + (wrong == 0 ? " OK" : " FAILED"));
    if (tflops_rows > 0)
      report::print_footer_line(cat("Avg TFLOP/s ", b.per_unit()), report::fixed(tflops, 4));
    if (byte_checked)
      report::print_footer_line(
          "Byte model mismatches",
          cat(byte_mismatches, " ((rank, call) pairs whose counted bytes differ from the model)"));
  }
  report::Json sections = report::Json::object();
  w.finish(b, rows, sections);
  report::Json jcompare;
  if (!compared.empty()) {
    const Compared& a = compared.front();
    jcompare = {{"key", e.compare_key}, {"values", report::Json::array()}};
    for (const Compared& c : compared) {
      report::Json j = {{"value", c.value}, {"time_ms", c.time_ms}, {"wrong", c.wrong}};
      if (&c != &a) j["ratio"] = c.time_ms / a.time_ms;
      jcompare["values"].push_back(j);
      if (b.root() && &c != &a)
        std::printf("# compare %s: %s/%s time ratio = %.2f (%s %.3f ms, %s %.3f ms; %s)\n",
                    e.compare_key.c_str(), c.value.c_str(), a.value.c_str(), c.time_ms / a.time_ms,
                    a.value.c_str(), a.time_ms, c.value.c_str(), c.time_ms, a.label.c_str());
    }
  }
  if (b.root()) std::fflush(stdout);

  // ---------------------------------------------------------------- JSON
  if (b.root() && !e.json.empty()) {
    report::Json cfg = {{"program", entry.program}, {"version", DATTN_VERSION},
                        {"ranks", rt.size()},       {"threads_per_rank", rt.threads()},
                        {"iters", e.iters},         {"warmup", e.warmup},
                        {"check", e.check == 1}};
    w.config_json(cfg);
    cfg["with_cuda"] = bool(DATTN_WITH_CUDA), cfg["with_nccl"] = bool(DATTN_WITH_NCCL);
    if (b.per_gpu()) cfg["device"] = "cuda";  // one GPU per rank: per-rank figures are per GPU
    report::Json top = {{"config", cfg}, {"rows", report::Json::array()}};
    for (const Row& r : rows) {
      if (!r.in_json) continue;
      report::ResultRow c = r.result;
      c.wrong = r.has_wrong() ? int64_t(r.wrong()) : -1;
      top["rows"].push_back(report::result_row(c));
      top["rows"].back().update(r.extra);
    }
    top["wrong"] = wrong, top["avg_tflops_per_rank"] = tflops;
    if (byte_checked) top["byte_mismatches"] = byte_mismatches;
    top.update(sections);
    if (!jcompare.is_null()) top["compare"] = jcompare;
    std::ofstream os(e.json);
    os << top.dump() << "\n";
    if (!os) DATTN_THROW("cannot write --json file '", e.json, "'");
  }
  return wrong > 0 ? 1 : 0;
}

}  // namespace dattn::bench

namespace dattn::report {

using detail::cat;

void print_footer_line(const std::string& label, const std::string& value) {
  std::printf("# %-22s: %s\n", label.c_str(), value.c_str());
}

std::string words(const Json& object) {
  std::string out;
  for (const auto& [key, value] : object.items()) {
    std::string k = key;
    std::replace(k.begin(), k.end(), '_', '-');
    out += cat(out.empty() ? "" : " ", k, " ",
               value.is_string()         ? value.get<std::string>()
               : value.is_number_float() ? cat(value.get<double>())
                                         : value.dump());
  }
  return out;
}

// ------------------------------------------------------------------ tables

void print_heading(const std::vector<Column>& columns) {
  for (bool names : {true, false}) {
    std::printf("#");
    for (const Column& c : columns)
      std::printf(" %*s", c.width, (names ? c.name : c.unit).c_str());
    std::printf("\n");
  }
  std::fflush(stdout);
}

void print_row(const std::vector<Column>& columns, const std::vector<std::string>& cells) {
  DATTN_CHECK_ARG(cells.size() == columns.size(), "table row cells", cells.size(),
                  cat(columns.size(), " (one per column)"));
  std::printf(" ");
  for (size_t i = 0; i < cells.size(); ++i)
    std::printf(" %*s", columns[i].width, cells[i].c_str());
  std::printf("\n");
  std::fflush(stdout);
}

std::string index_range(int64_t first, int64_t n) {
  if (n <= 0) return "-";
  if (n == 1) return std::to_string(first);
  return std::to_string(first) + "-" + std::to_string(first + n - 1);
}

namespace {
std::string format(const char* conversion, double v, int precision) {
  if (!std::isfinite(v)) return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
  char buf[64];
  std::snprintf(buf, sizeof(buf), conversion, precision, v);
  return buf;
}
}  // namespace

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i)
    out += (i ? sep : "") + items[i];
  return out;
}

std::string fixed(double v, int precision) {
  return format("%.*f", v, precision);
}

std::string sci(double v, int precision) {
  return format("%.*e", v, precision);
}

std::string positions(const std::vector<Run>& runs) {
  std::vector<std::string> out;
  for (const Run& r : runs) {
    if (r.length <= 0) continue;
    const std::string range = cat(r.global_begin, "-", r.last_position());
    if (r.length <= r.block || r.stride == r.block)
      out.push_back(range);
    else
      out.push_back(r.block == 1 ? cat(range, "/", r.stride)
                                 : cat(range, "/", r.stride, "x", r.block));
  }
  return out.empty() ? "-" : join(out, " ");
}

Json result_row(const ResultRow& r) {
  return {{"workload", r.workload},
          {"strategy", r.strategy},
          {"layout", r.layout},
          {"seq", r.seq},
          {"ranks", r.ranks},
          {"time_ms", r.time_ms},
          {"tflops_per_rank", r.tflops_per_rank >= 0 ? Json(r.tflops_per_rank) : Json()},
          {"sent_mb_per_rank", r.sent_mb_per_rank},
          {"model_mb_per_rank", r.model_mb_per_rank},
          {"wrong", r.wrong >= 0 ? Json(r.wrong) : Json()}};
}

}  // namespace dattn::report
