#pragma once
// The memory ledger: every tensor loom allocates is filed under one category, and the ledger keeps
// the current and peak bytes of each (per rank). `loom plan`, the metrics and the summary read it.
#include <array>
#include <cstddef>
#include <string>

namespace loom {

enum class Mem : int {
  params = 0,
  grads,
  optimizer,    // AdamW first and second moments
  master,       // fp32 master weights (mixed precision)
  activations,  // saved for backward, and the forward/backward scratch of a step
  comm,         // communication buffers
  workspace,    // everything else (data batches, logits scratch, ...)
  count_
};
inline constexpr int kMemCategories = static_cast<int>(Mem::count_);
const char* mem_name(Mem m);

class Ledger {
 public:
  void allocate(Mem m, std::size_t bytes);
  void release(Mem m, std::size_t bytes);
  std::size_t current(Mem m) const { return current_[idx(m)]; }
  std::size_t peak(Mem m) const { return peak_[idx(m)]; }
  std::size_t current_total() const { return total_current_; }
  std::size_t peak_total() const { return total_peak_; }  // peak of the sum, not the sum of peaks
  // Start a new peak window (peaks become the current values), e.g. at the start of a step.
  void reset_peaks();
  // The process-wide ledger that Tensor allocations are filed in.
  static Ledger& global();

 private:
  static int idx(Mem m) { return static_cast<int>(m); }
  std::array<std::size_t, kMemCategories> current_{}, peak_{};
  std::size_t total_current_ = 0, total_peak_ = 0;
};

// Bytes for people, in one of the three ways loom prints them (each kept where users know it):
//   units    "12.3 MiB": the largest unit below the value, one decimal (run summaries, logs)
//   mib_gib  "0.5 MiB", "1.25 GiB": MiB to one decimal below a GiB, GiB to two (loom plan's rank table)
//   planner  three significant figures in MiB below a GiB, GiB above ("512 MiB", "39.4 GiB"; the
//            layout search and the memo)
enum class ByteStyle { units, mib_gib, planner };
std::string format_bytes(double bytes, ByteStyle style = ByteStyle::units);

}  // namespace loom
