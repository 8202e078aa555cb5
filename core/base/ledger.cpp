#include "core/base/ledger.hpp"

#include <algorithm>
#include <cmath>
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

namespace {

std::string fixed_unit(double value, int digits, const char* unit) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f %s", digits, value, unit);
  return buf;
}

}  // namespace

std::string format_bytes(double bytes, ByteStyle style) {
  constexpr double MiB = 1024.0 * 1024, GiB = MiB * 1024;
  if (style == ByteStyle::mib_gib)
    return bytes >= GiB ? fixed_unit(bytes / GiB, 2, "GiB") : fixed_unit(bytes / MiB, 1, "MiB");
  if (style == ByteStyle::planner) {
    const double a = std::abs(bytes);
    if (a < GiB) return fixed_unit(bytes / MiB, a >= 100 * MiB ? 0 : a >= 10 * MiB ? 1 : 2, "MiB");
    return fixed_unit(bytes / GiB, bytes >= 100 * GiB ? 0 : bytes >= 10 * GiB ? 1 : 2, "GiB");
  }
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
