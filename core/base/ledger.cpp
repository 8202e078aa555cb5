#include "core/base/ledger.hpp"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace loom {

const char* mem_name(Mem m) {
  static const char* names[kMemCategories] = {"params",      "grads", "optimizer", "master",
                                              "activations", "comm",  "workspace"};
  return names[static_cast<int>(m)];
}

void Ledger::allocate(Mem m, std::size_t bytes) {
  auto i = idx(m);
  current_[i] += bytes;
  peak_[i] = std::max(peak_[i], current_[i]);
  total_current_ += bytes;
  total_peak_ = std::max(total_peak_, total_current_);
}

void Ledger::release(Mem m, std::size_t bytes) {
  auto i = idx(m);
  if (bytes > current_[i])
    throw std::logic_error(std::string("Ledger: releasing more ") + mem_name(m) + " bytes than allocated");
  current_[i] -= bytes;
  total_current_ -= bytes;
}

void Ledger::reset_peaks() {
  peak_ = current_;
  total_peak_ = total_current_;
}

Ledger& Ledger::global() {
  static Ledger ledger;
  return ledger;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

}  // namespace loom
