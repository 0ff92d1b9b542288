// The benchmarks' shared reporting: header block with one line per rank, fixed-width tables,
// footer lines and a minimal JSON writer (see report.h).
#include "examples/report.h"

#include "kernels/cpu/attention_cpu.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "collective/mpi_communicator.h"
#include "launch/program.h"
#include "src/base/error.h"
#include "src/layout.h"

namespace dattn::report {

// ------------------------------------------------------------------ header

namespace {
// Fixed-size record for the allgather: host and device names are truncated to fit.
struct RankRecord {
  int32_t rank;
  int32_t pid;
  int32_t threads;
  char host[64];
  char device[16];
};

void copy_truncated(char* dst, size_t size, const std::string& src) {
  std::memset(dst, 0, size);
  std::memcpy(dst, src.data(), std::min(size - 1, src.size()));
}
}  // namespace

std::vector<RankInfo> gather_rank_info(MPI_Comm comm, const std::string& device, int threads) {
  int rank = 0, size = 1;
  DATTN_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  DATTN_MPI_CHECK(MPI_Comm_size(comm, &size));
  RankRecord mine{};
  mine.rank = rank;
  mine.pid = int32_t(getpid());
  mine.threads = threads;
  copy_truncated(mine.host, sizeof(mine.host), host_name());
  copy_truncated(mine.device, sizeof(mine.device), device);
  std::vector<RankRecord> all(static_cast<size_t>(size));
  DATTN_MPI_CHECK(MPI_Allgather(&mine, sizeof(RankRecord), MPI_BYTE, all.data(), sizeof(RankRecord),
                                MPI_BYTE, comm));
  std::vector<RankInfo> out;
  out.reserve(all.size());
  for (const auto& r : all)
    out.push_back({r.rank, r.pid, r.host, r.device, r.threads});
  return out;
}

void print_header(std::FILE* f, const std::string& title, const std::vector<std::string>& config,
                  const std::vector<RankInfo>& ranks) {
  std::fprintf(f, "# %s, version %s\n", title.c_str(), DATTN_VERSION);
  for (const auto& line : config)
    std::fprintf(f, "# %s\n", line.c_str());
  std::fprintf(f, "# DATTN_WITH_CUDA=%d DATTN_WITH_NCCL=%d\n", int(DATTN_WITH_CUDA),
               int(DATTN_WITH_NCCL));
  std::fprintf(f, "# cpu kernel: %s\n", dattn::cpu::cpu_kernel_info().c_str());
  std::fprintf(f, "#\n# Using devices\n");
  for (const auto& r : ranks) {
    std::fprintf(f, "#  Rank %2d Group  0 Pid %6d on %10s device %s threads %d\n", r.rank, r.pid,
                 r.host.c_str(), r.device.c_str(), r.threads);
  }
  std::fprintf(f, "#\n");
}

void print_footer_line(std::FILE* f, const std::string& label, const std::string& value) {
  std::fprintf(f, "# %-22s: %s\n", label.c_str(), value.c_str());
}

// ------------------------------------------------------------------ tables

void Table::print_heading(std::FILE* f) const {
  std::string names = "#", units = "#";
  for (const auto& c : columns_) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), " %*s", c.width, c.name.c_str());
    names += buf;
    std::snprintf(buf, sizeof(buf), " %*s", c.width, c.unit.c_str());
    units += buf;
  }
  std::fprintf(f, "%s\n%s\n", names.c_str(), units.c_str());
}

void Table::print_row(std::FILE* f, const std::vector<std::string>& cells) const {
  DATTN_CHECK_ARG(cells.size() == columns_.size(), "table row cells", cells.size(),
                  detail::cat(columns_.size(), " (one per column)"));
  std::string line = " ";
  for (size_t i = 0; i < cells.size(); ++i) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), " %*s", columns_[i].width, cells[i].c_str());
    line += buf;
  }
  std::fprintf(f, "%s\n", line.c_str());
}

namespace {
std::string non_finite(double v) {
  return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
}
}  // namespace

std::string index_range(int64_t first, int64_t n) {
  if (n <= 0) return "-";
  if (n == 1) return std::to_string(first);
  return std::to_string(first) + "-" + std::to_string(first + n - 1);
}

std::string fixed(double v, int precision) {
  if (!std::isfinite(v)) return non_finite(v);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", precision, v);
  return buf;
}

std::string sci(double v, int precision) {
  if (!std::isfinite(v)) return non_finite(v);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*e", precision, v);
  return buf;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i];
  }
  return out;
}

std::string run_desc(const Run& run) {
  using detail::cat;
  const std::string range = cat(run.global_begin, "-", run.last_position());
  if (run.length <= run.block || run.stride == run.block) return range;
  return run.block == 1 ? cat(range, "/", run.stride) : cat(range, "/", run.stride, "x", run.block);
}

// ------------------------------------------------------------------ JSON

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  // Prefer the shortest form that reads back to the same double.
  for (int p = 6; p < 17; ++p) {
    char shorter[64];
    std::snprintf(shorter, sizeof(shorter), "%.*g", p, v);
    if (std::strtod(shorter, nullptr) == v) return shorter;
  }
  return buf;
}

std::string json_array(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i)
    out += (i ? ",\n  " : "\n  ") + items[i];
  return out + (items.empty() ? "]" : "\n]");
}

JsonObject& JsonObject::add_raw(const std::string& key, const std::string& json_text) {
  members_.emplace_back(key, json_text);
  return *this;
}
JsonObject& JsonObject::add(const std::string& key, const std::string& value) {
  return add_raw(key, json_string(value));
}
JsonObject& JsonObject::add(const std::string& key, const char* value) {
  return add_raw(key, json_string(value));
}
JsonObject& JsonObject::add(const std::string& key, double value) {
  return add_raw(key, json_number(value));
}
JsonObject& JsonObject::add(const std::string& key, int64_t value) {
  return add_raw(key, std::to_string(value));
}
JsonObject& JsonObject::add(const std::string& key, bool value) {
  return add_raw(key, value ? "true" : "false");
}

JsonObject& JsonObject::add_all(const JsonObject& other) {
  members_.insert(members_.end(), other.members_.begin(), other.members_.end());
  return *this;
}

std::string JsonObject::str() const {
  std::string out = "{";
  for (size_t i = 0; i < members_.size(); ++i) {
    out += (i ? ", " : "") + json_string(members_[i].first) + ": " + members_[i].second;
  }
  return out + "}";
}

std::string JsonObject::words() const {
  std::string out;
  for (const auto& [key, value] : members_) {
    std::string k = key;
    std::replace(k.begin(), k.end(), '_', '-');
    const bool quoted = value.size() >= 2 && value.front() == '"';
    out +=
        (out.empty() ? "" : " ") + k + " " + (quoted ? value.substr(1, value.size() - 2) : value);
  }
  return out;
}

JsonObject result_row(const ResultRow& r) {
  JsonObject j;
  j.add("workload", r.workload).add("strategy", r.strategy).add("layout", r.layout);
  j.add("seq", r.seq).add("ranks", r.ranks).add("time_ms", r.time_ms);
  if (r.tflops_per_rank >= 0)
    j.add("tflops_per_rank", r.tflops_per_rank);
  else
    j.add_raw("tflops_per_rank", "null");
  j.add("sent_mb_per_rank", r.sent_mb_per_rank).add("model_mb_per_rank", r.model_mb_per_rank);
  if (r.wrong >= 0)
    j.add("wrong", r.wrong);
  else
    j.add_raw("wrong", "null");
  return j;
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream os(path);
  if (!os) DATTN_THROW("cannot open --json file '", path, "' for writing");
  os << text << "\n";
  os.close();
  if (!os) DATTN_THROW("failed writing --json file '", path, "'");
}

}  // namespace dattn::report
