// Shared reporting for the dattn benchmarks, in the nccl-tests style: the header block (version,
// configuration, build, one line per rank), fixed-width tables with a two-line heading (names,
// then units), footer lines, and a small JSON writer for the --json rows. Only rank 0 prints.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace dattn {
struct Run;  // src/layout.h
}  // namespace dattn

namespace dattn::report {

// ------------------------------------------------------------------ header

// What the header says about one rank.
struct RankInfo {
  int rank = 0;
  int pid = 0;
  std::string host;
  std::string device;  // "cpu", "cuda:0"
  int threads = 0;     // OpenMP threads of the rank
};

// Collective over comm: every rank's RankInfo, on every rank (fixed-size buffers, allgather).
std::vector<RankInfo> gather_rank_info(MPI_Comm comm, const std::string& device, int threads);

// Prints the header block:
//   # <title>, version X
//   # <each config line>
//   # DATTN_WITH_CUDA=.. DATTN_WITH_NCCL=..
//   #
//   # Using devices
//   #  Rank  0 Group  0 Pid  1234 on host device cpu threads 2
void print_header(std::FILE* f, const std::string& title, const std::vector<std::string>& config,
                  const std::vector<RankInfo>& ranks);

// "# label : value" with the labels aligned, as in the nccl-tests footer.
void print_footer_line(std::FILE* f, const std::string& label, const std::string& value);

// ------------------------------------------------------------------ tables

struct Column {
  std::string name;  // first heading line
  std::string unit;  // second heading line, "" for none
  int width = 10;    // cells are right-aligned in this width
};

// A fixed-width table: heading lines start with '#', data rows with ' ', so that a reader (or
// grep -v '^#') finds the numbers alone.
class Table {
 public:
  explicit Table(std::vector<Column> columns) : columns_(std::move(columns)) {}
  void print_heading(std::FILE* f) const;
  // One row of already formatted cells, one per column (throws dattn::Error otherwise).
  void print_row(std::FILE* f, const std::vector<std::string>& cells) const;

 private:
  std::vector<Column> columns_;
};

// n indices from first, as a plan prints them: "-" (none), "5", "4-7".
std::string index_range(int64_t first, int64_t n);
// v with `precision` digits after the point; non-finite values as "nan", "inf", "-inf".
std::string fixed(double v, int precision);
// v in scientific notation with `precision` digits ("1.23e-05").
std::string sci(double v, int precision);

// The items joined with sep between them ("a, b, c").
std::string join(const std::vector<std::string>& items, const char* sep);
// A run's global positions, for the --dry-run plans: "0-1023" for a contiguous run, "5-4093/4"
// for every 4th position, "16-31/64x16" for blocks of 16 every 64.
std::string run_desc(const Run& run);

// ------------------------------------------------------------------ JSON

std::string json_string(const std::string& s);  // quoted and escaped
std::string json_number(double v);              // shortest round-trip form; null if non-finite
std::string json_array(const std::vector<std::string>& items);  // items are JSON text

// An object whose members keep their insertion order; values are JSON text.
class JsonObject {
 public:
  JsonObject& add_raw(const std::string& key, const std::string& json_text);
  JsonObject& add(const std::string& key, const std::string& value);
  JsonObject& add(const std::string& key, const char* value);
  JsonObject& add(const std::string& key, double value);
  JsonObject& add(const std::string& key, int64_t value);
  JsonObject& add(const std::string& key, int value) { return add(key, int64_t(value)); }
  JsonObject& add(const std::string& key, bool value);
  JsonObject& add_all(const JsonObject& other);  // other's members, in their order
  bool empty() const { return members_.empty(); }
  // "key value key value ...": the members for a header line (keys with '-' for '_', strings
  // without their quotes).
  std::string words() const;
  std::string str() const;

 private:
  std::vector<std::pair<std::string, std::string>> members_;
};

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
JsonObject result_row(const ResultRow& r);

// Writes text (plus a newline) to path; throws dattn::Error naming the path on failure.
void write_text_file(const std::string& path, const std::string& text);

}  // namespace dattn::report
