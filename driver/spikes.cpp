#include "driver/spikes.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace loom {

std::string SpikeVerdict::describe() const {
  char buf[200];
  std::snprintf(buf, sizeof buf, "loss %.4f (z %.1f), gradient norm %.3f (z %.1f) over the last %d steps", loss, loss_z,
                norm, norm_z, window);
  return buf;
}

SpikeDetector::SpikeDetector(int window, double loss_z, double norm_z)
    : window_(static_cast<std::size_t>(window)), loss_z_(loss_z), norm_z_(norm_z) {}

double SpikeDetector::z_score(const std::deque<double>& past, double x) {
  double mean = 0;
  for (double v : past) mean += v;
  mean /= static_cast<double>(past.size());
  double var = 0;
  for (double v : past) var += (v - mean) * (v - mean);
  const double sd = std::sqrt(var / static_cast<double>(past.size() - 1));
  // A window of (nearly) equal values would make any rounding a spike: the deviation is taken as at
  // least 0.1% of the mean.
  return (x - mean) / std::max(sd, 1e-3 * std::abs(mean) + 1e-30);
}

SpikeVerdict SpikeDetector::judge(double loss, double norm) const {
  SpikeVerdict v;
  v.loss = loss;
  v.norm = norm;
  if (!std::isfinite(loss) || !std::isfinite(norm)) return v;
  if (losses_.size() == window_) {
    v.window = static_cast<int>(window_);
    v.loss_z = z_score(losses_, loss);
    v.norm_z = z_score(norms_, norm);
    v.spike = (loss_z_ > 0 && v.loss_z > loss_z_) || (norm_z_ > 0 && v.norm_z > norm_z_);
  }
  return v;
}

void SpikeDetector::admit(double loss, double norm) {
  if (!std::isfinite(loss) || !std::isfinite(norm)) return;
  losses_.push_back(loss);
  norms_.push_back(norm);
  if (losses_.size() > window_) {
    losses_.pop_front();
    norms_.pop_front();
  }
}

}  // namespace loom
