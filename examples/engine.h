// The benchmark engine, in the manner of nccl-tests: a Workload says what to run (its options, its
// cases, each case's inputs, timed call, byte and FLOP models and reference check, its table
// columns and plan); run_workload owns everything around it: option parsing (the shared options,
// the launch options, --help, --version, --compare), the Runtime, warm-up, timing and progress
// lines, the check statistics and #wrong, the tables, the footer, the JSON file and the dry run.
// report:: holds what they print with: the header block, fixed-width tables, footer lines, JSON.
//
// The shared options, owned by the engine for every workload (a workload does not declare them):
//   -n/--iters (its name and default from Defaults), -w/--warmup, -k/--check, -T/--threads,
//   -J/--json, --compare KEY=A,B, -h/--help, -V/--version, and launch/options.h's options.
// -k/--check defaults to 1 (unless Defaults::has_check is false): every workload's check runs by
// default, so it must be cheap (a sample: a few rows per rank, one extra step); `-k 0` turns it
// off, `--check` alone means `--check 1`.
//
// One run (rank 0 prints, every rank computes): the header ("dattn <name> benchmark" and
// Workload::config_lines; a warning when a rank has fewer CPUs than OpenMP threads); for each Case
// the rows of Workload::run, each printed as it comes (a case whose table differs from the
// previous one prints that table's heading first); the footer: "Out of bounds values" (#wrong of
// every row), "Avg TFLOP/s per rank|GPU" (rows with tflops_per_rank >= 0), "Byte model
// mismatches" (rows with byte_checked), Workload::finish's lines and the --compare summary; then
// the JSON file (-J). The exit code is 1 when #wrong > 0.
#pragma once

#include <boost/program_options.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "collective/communicator.h"
#include "launch/options.h"
#include "src/base/dtype.h"
#include "src/base/spec.h"
#include "src/runtime.h"

namespace dattn {
struct Run;  // src/layout.h
}  // namespace dattn

namespace dattn::report {

// JSON objects keep their members in insertion order.
using Json = nlohmann::ordered_json;
// An object's members as "key value key value ..." for a header or plan line: keys with '-' for
// '_', strings without their quotes.
std::string words(const Json& object);

// "# label : value" with the labels aligned, as in the nccl-tests footer.
void print_footer_line(const std::string& label, const std::string& value);

struct Column {
  std::string name;  // first heading line
  std::string unit;  // second heading line, "" for none
  int width = 10;    // cells are right-aligned in this width
};
// A fixed-width table: heading lines start with '#', data rows with ' ', so that a reader (or
// grep -v '^#') finds the numbers alone. A row has one cell per column (else dattn::Error).
void print_heading(const std::vector<Column>& columns);
void print_row(const std::vector<Column>& columns, const std::vector<std::string>& cells);

// n indices from first, as a plan prints them: "-" (none), "5", "4-7".
std::string index_range(int64_t first, int64_t n);
// v with `precision` digits after the point, or in scientific notation ("1.23e-05");
// non-finite values as "nan", "inf", "-inf".
std::string fixed(double v, int precision);
std::string sci(double v, int precision);
// The items joined with sep between them ("a, b, c").
std::string join(const std::vector<std::string>& items, const char* sep);
// The global positions of a rank's runs, for the --dry-run plans: "0-1023" for a contiguous run,
// "5-4093/4" for every 4th position, "16-31/64x16" for blocks of 16 every 64; the runs that hold
// tokens, separated by spaces, or "-" for none.
std::string positions(const std::vector<Run>& runs);

// The row every workload writes into "rows" with --json, so that one plotting script
// (launch/plot.py) reads any of them: these keys first, in this order, then the workload's own.
struct ResultRow {
  std::string workload;          // prefill, decode, star, mla, kernel
  std::string strategy;          // ring, ulysses, hybrid, tree, allgather, star, head_split, ...
  std::string layout;            // contiguous, zigzag, striped, varlen; "" where none applies
  int64_t seq = 0;               // prefill: the global sequence length; decode: the context
  int ranks = 0;                 // ranks of the run (cp x tp)
  double time_ms = 0;            // prefill: one forward; decode: the mean step latency
  double tflops_per_rank = -1;   // < 0: not reported (null)
  double sent_mb_per_rank = 0;   // payload sent per rank per forward / step, max over ranks
  double model_mb_per_rank = 0;  // the byte model's figure for the same
  int64_t wrong = -1;            // elements over tolerance + byte model mismatches; < 0: null
};
Json result_row(const ResultRow& r);

}  // namespace dattn::report

namespace dattn::bench {

namespace po = boost::program_options;

// ------------------------------------------------------------------ options

// What a workload asks of the shared options.
struct Defaults {
  const char* iters_option = "iters,n";  // decode and mla: "steps,n" (the name users know)
  const char* iters_help = "timed iterations";
  int iters = 5;
  int warmup = 1;             // -w default; < 0: the workload has no --warmup
  int threads = 0;            // -T default (0: OMP_NUM_THREADS, else cores per rank)
  int min_threads = 0;        // -T must be >= this
  bool has_check = true;      // false: no -k (a workload with no reference, e.g. kernel)
  bool runs_on_cuda = false;  // LaunchOptions::runs_on_cuda: --device cuda is accepted
  // One process: the grid is cp 1 x tp 1 whatever the job (--cp, --tp, --world-size must say 1,
  // --device cpu); each rank of a larger job runs the workload alone on MPI_COMM_SELF.
  bool one_process = false;
};

// The shared options as parsed and resolved (launch.cp, launch.tp, launch.world, launch.dev set).
struct EngineOptions {
  int iters = 5;
  int warmup = 1;
  int check = 1;
  int threads = 0;
  std::string json;                         // -J FILE, "" for none
  std::string compare;                      // --compare as given
  std::string compare_key;                  // its KEY: a long option of the workload
  std::vector<std::string> compare_values;  // its A,B (two or more values)
  LaunchOptions launch;
  // In a --compare rerun: the value of compare_key this run has. The workload's cases() then
  // returns its largest case only (see Workload::cases).
  std::string compare_value;
  bool comparing() const { return !compare_value.empty(); }
};

// ------------------------------------------------------------------ checks

// |got - ref| <= abs + rel * |ref|.
struct Tolerance {
  double abs = 0, rel = 0;
};

// Element statistics of a reference check. compare() counts one element: an infinite got or ref
// (an lse of a row that sees no key) must equal the other exactly; a NaN is always wrong.
struct CheckStats {
  uint64_t checked = 0;  // elements compared
  uint64_t wrong = 0;    // elements over tolerance
  double max_err = 0;    // largest finite |got - ref|
  void compare(double got, double ref, const Tolerance& tol);
  // Sums checked and wrong, maxes max_err over every rank of MPI_COMM_WORLD. Collective.
  CheckStats reduced() const;
};

// ------------------------------------------------------------------ timing

// One timed call of a case: Bench::time runs prepare (untimed), a barrier, call (timed: it must
// return when the work has finished, bench_device.h's synchronize), then compares the bytes this
// rank's communicators counted in the call with model_bytes.
struct TimedCall {
  std::function<void()> call;
  std::function<void(int step)> prepare;                 // optional; step counts warm-up ones too
  std::function<uint64_t()> model_bytes;                 // optional: no byte check without it
  std::function<uint64_t(const ByteCounters&)> counted;  // default: data_bytes()
  int warmup = -1, iters = -1;                           // -1: the engine's -w and -n
  const char* unit = "iterations";                       // progress lines: "3/6 iterations"
};

// What Bench::time measured, over every rank.
struct Timing {
  double mean_ms = 0;             // max over ranks of the rank's mean over the timed calls
  double step_mean_ms = 0;        // mean over the timed calls of the slowest rank's time
  double p50_ms = 0, p99_ms = 0;  // nearest-rank percentiles of the slowest rank's times
  double best_ms = 0;             // fastest timed call of the slowest rank
  std::vector<double> step_ms;    // the slowest rank's time of each timed call, in order
  double sent_mb = 0;             // bytes counted per timed call, max over ranks (1 MB = 1e6 B)
  double model_mb = 0;            // model_bytes per timed call, max over ranks
  uint64_t byte_mismatches = 0;   // (rank, call) pairs, warm-up included, counted != model
  bool byte_checked = false;      // model_bytes was given
  // The K/V bytes the attention kernels streamed in the timed calls over the kernels' host time
  // (src/dispatch.h's kernel_stats), both summed over ranks: GB/s (1e9 B) per rank; < 0 when
  // no kernel time was counted (GPU kernels are not host-timed).
  double kernel_gbs = -1;
};

// ------------------------------------------------------------------ rows

// One row of a table and of the JSON "rows".
struct Row {
  std::vector<std::string> cells;  // one per column of its case's table
  // The JSON row's common keys. result.wrong: the elements over tolerance of the row's check
  // (plus whatever else the workload counts as wrong there); < 0 when no check ran. wrong()
  // adds byte_mismatches to it for the #wrong cell (wrong_cell), the footer and the JSON.
  report::ResultRow result;
  report::Json extra = report::Json::object();  // the JSON row's own keys, after the common ones
  bool in_json = true;                          // false: table only (e.g. star's accuracy rows)
  uint64_t byte_mismatches = 0;  // Timing::byte_mismatches: "Byte model mismatches" and #wrong
  bool byte_checked = false;     // Timing::byte_checked
  // max(result.wrong, 0) + byte_mismatches.
  uint64_t wrong() const;
  // Whether anything was checked: result.wrong >= 0 or byte_mismatches > 0 (else #wrong N/A).
  bool has_wrong() const;
  // Copies t's bytes into the row: byte_checked, byte_mismatches, result.sent_mb_per_rank and
  // result.model_mb_per_rank.
  void take_bytes(const Timing& t);
};

// The #wrong cell: the row's wrong(), or "N/A" when !has_wrong().
std::string wrong_cell(const Row& r);
// The kernel bandwidth cell: t.kernel_gbs with 2 digits, or "n/a" when it is < 0.
std::string kernel_cell(const Timing& t);

// ------------------------------------------------------------------ the run's services

class Bench {
 public:
  Bench(Runtime& rt, const EngineOptions& opts) : rt_(rt), opts_(opts) {}
  Runtime& rt() { return rt_; }
  const EngineOptions& opts() const { return opts_; }
  bool root() const { return rt_.rank() == 0; }
  bool check() const { return opts_.check != 0; }
  // Each rank drives one GPU (--device cuda): throughput reads "per GPU", tolerances may widen.
  bool per_gpu() const { return !rt_.device().is_cpu(); }
  // "per GPU" or "per rank", for column units and footer labels.
  const char* per_unit() const { return per_gpu() ? "per GPU" : "per rank"; }
  // "# <line>" on rank 0, flushed (what a long phase is doing).
  void note(const std::string& line) const;
  // Warm-up and timed calls of c, with progress lines named `what`. Collective.
  Timing time(const std::string& what, const TimedCall& c);

 private:
  Runtime& rt_;
  const EngineOptions& opts_;
};

// Collective over MPI_COMM_WORLD: max or sum of a value over every rank.
double allreduce_max(double v);
uint64_t allreduce_max(uint64_t v);
uint64_t allreduce_sum(uint64_t v);
double allreduce_sum(double v);
// The fewest ranks of MPI_COMM_WORLD that share a node (MPI_Comm_split_type), the same on every
// rank. Collective.
int node_ranks();
// The relative L2 error ||got - ref|| / ||ref|| (||got - ref|| when ref is 0) of elements on
// every rank: add() each of this rank's, then reduced() (collective).
struct RelL2 {
  double d2 = 0, r2 = 0;  // the sums of (got - ref)^2 and of ref^2
  void add(double got, double ref) {
    d2 += (got - ref) * (got - ref);
    r2 += ref * ref;
  }
  double reduced() const;
};
// A footer's verdict on a target: ": met" or ": NOT met" when this run is the target's
// configuration, else `otherwise` (e.g. " (not the target configuration)").
std::string verdict(bool is_target, bool met, const char* otherwise);
// The max, the sum and the max / mean (1 when the sum is 0) of f(0 .. n-1), e.g. a model over
// ranks.
struct Spread {
  double max = 0, sum = 0, imbalance = 1;
};
Spread spread(int n, const std::function<double(int)>& f);
// The footer's roofline lines: "Read bandwidth", a STREAM-style read bandwidth of the ranks'
// OpenMP threads (the best of 3 sums over 1 GiB per node, every rank at once; GB/s, the mean over
// ranks), then "Kernel / read" with each (name, Timing::kernel_gbs) pair's ratio to it ("n/a" for
// one < 0). Returns the ratios in order (< 0: n/a); adds "read_gbs" and "kernel_over_read" to
// top. Collective.
std::vector<double> roofline_footer(Bench& b,
                                    const std::vector<std::pair<std::string, double>>& kernels,
                                    report::Json& top);
// Peak resident set of this process so far (ru_maxrss), in MiB.
double peak_rss_mib();
// --dtype NAME as a DType, else UsageError ("fp32, bf16 or fp16").
DType dtype_option(const std::string& name);
// Option checks throwing UsageError (require_option's message): value one of `allowed` ("invalid
// --layout = X: expected contiguous, zigzag or striped").
void require_one_of(const char* option, const std::string& value,
                    const std::vector<std::string>& allowed);
// "a,b,c" -> the whole decimal integers, or nullopt when any item is not one.
std::optional<std::vector<int64_t>> parse_int_list(const std::string& s);

// The attention shape options of prefill, decode and star: -b/--batch, -H/--heads,
// -G/--kv-heads, -d/--head-dim, -t/--dtype. resolve checks them for --tp (each >= 1, --kv-heads
// dividing --heads and divisible by --tp) and parses the dtype, throwing UsageError.
struct Shape {
  int64_t batch = 1, heads = 8, kv_heads = 2, head_dim = 128;
  std::string dtype_name = "fp32";
  DType dtype = DType::f32;
  int tp = 1;
  void add_options(po::options_description& desc);
  void resolve(int tp);
  // One tp rank's heads (heads / tp query heads, kv_heads / tp key/value heads) under mask.
  AttnSpec spec(Mask mask = Mask::causal()) const;
  // "dtype T batch B heads H kv-heads G head-dim D", and the same as JSON config keys.
  std::string words() const;
  void json(report::Json& cfg) const;
};

// ------------------------------------------------------------------ the dry run

// What --dry-run prints, on rank 0 only (no Runtime: --world-size may exceed the job). The
// engine prints "# dattn <name> plan (dry run, nothing computed), version V" first and
// "# planned W ranks in T s" last. Per-rank tables stay bounded: shown(n) is the indices the plan
// prints out of n (all when n <= 16, else the first 8 and the last 8), so that a plan at 1024
// ranks does O(ranks) model work and prints a screenful; a row for each shown index, and
// "#  ... N ranks not shown" between the runs of shown indices.
class Plan {
 public:
  explicit Plan(const EngineOptions& opts) : opts_(opts) {}
  const EngineOptions& opts() const { return opts_; }
  void line(const std::string& text) const;  // "# <text>"
  // The grid's lines: "world W ranks = cp P x tp T ...; <what>", the cp and tp communicators
  // (then `groups`, e.g. a hybrid's), and the device rule.
  void grid(const std::string& what, const std::string& groups = "") const;
  void table(std::vector<report::Column> columns);  // prints its heading
  void row(const std::vector<std::string>& cells) const { report::print_row(columns_, cells); }
  static std::vector<int> shown(int n);
  // f(i) for each shown i of n, with the skipped line where indices are left out.
  void for_shown(int n, const std::function<void(int)>& f) const;

 private:
  const EngineOptions& opts_;
  std::vector<report::Column> columns_;
};

// ------------------------------------------------------------------ the workload

// One case of a run: a row (or a few) of one table.
struct Case {
  int table = 0;      // index into Workload::tables()
  std::string label;  // progress lines and --compare: "prefill seq 65536"
  int64_t index = 0;  // the workload's own (e.g. which sequence length)
};

class Workload {
 public:
  virtual ~Workload() = default;

  // ---- options (the name, program and summary are its WorkloadEntry's)
  virtual Defaults defaults() const { return {}; }
  // The workload's own options (the shared ones are the engine's), bound to its members.
  virtual void add_options(po::options_description& desc) = 0;
  // After parsing and resolving the shared options: validates and derives the workload's
  // options; throws UsageError (require_option) naming the option, the same on every rank.
  virtual void resolve(const po::variables_map& vm, const EngineOptions& e) = 0;

  // ---- the run
  // The Runtime's options: by default the grid, device and threads of e.
  virtual RuntimeOptions runtime_options(const EngineOptions& e) const;
  // The header's configuration lines (after "# <title>, version V"; the engine adds a line of
  // the shared options). By default one line: the grid and threads, then config_words().
  virtual std::vector<std::string> config_lines(Runtime& rt) const;
  // The workload's keys of the JSON "config" (after program, version, ranks, threads_per_rank,
  // iters, warmup, check; before with_cuda, with_nccl, device).
  virtual void config_json(report::Json& cfg) const = 0;
  // config_json's members as report::words, for the header and the plans.
  std::string config_words() const;
  // The tables, in Case::table order. Called after the Runtime exists (units may say per GPU).
  virtual std::vector<std::vector<report::Column>> tables(const Bench& b) const = 0;
  // What runs, in order. In a --compare rerun (e.opts().comparing()) only the largest case
  // (its time is the first row's result.time_ms).
  virtual std::vector<Case> cases(const Bench& b) const = 0;
  // Runs one case: inputs, Bench::time, byte and FLOP models, the reference check (when
  // b.check()); returns its rows (usually one). Collective.
  virtual std::vector<Row> run(Bench& b, const Case& c) = 0;
  // After the last case: the workload's footer lines (rank 0 prints; every rank calls it) and
  // top-level JSON sections (add them to top; "config", "rows", "wrong", "avg_tflops_per_rank",
  // "byte_mismatches" (with a byte check), "compare" are the engine's).
  virtual void finish(Bench& b, const std::vector<Row>& rows, report::Json& top) {
    (void)b, (void)rows, (void)top;
  }

  // ---- the dry run
  virtual void plan(Plan& p) const = 0;
};

// A registered workload: its factory (the engine makes a fresh one for each option set, e.g.
// each --compare value).
struct WorkloadEntry {
  const char* name;     // "prefill": dattn-run's word, the header's "dattn prefill benchmark"
  const char* program;  // "dattn-prefill-bench"
  const char* summary;  // one line for --help and dattn-run --help
  std::unique_ptr<Workload> (*make)();
};

// Parses argv (argv[0] names the program), then runs the dry run or the benchmark; the exit code
// (1 when #wrong > 0). Throws UsageError on bad options (run_program prints it once). Called
// inside run_program (MPI up).
int run_workload(const WorkloadEntry& w, int argc, char** argv);

// A workload parsed and resolved from a command line as run_workload does it, nothing run (the
// fuzzers use it): the workload, the shared options and the options as given; nullopt when
// --help or --version was answered. Throws UsageError. Called with MPI up.
struct ParsedWorkload {
  std::unique_ptr<Workload> workload;
  EngineOptions options;
  po::variables_map vm;
};
std::optional<ParsedWorkload> parse_workload(const WorkloadEntry& w, int argc, char** argv);

}  // namespace dattn::bench
