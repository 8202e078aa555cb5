#pragma once
// Loss-spike detection (train.on_spike, DESIGN.md "Runs a user can trust"): the loss and the
// gradient norm of a step against the mean and standard deviation of the last train.spike_window
// steps that were not spikes, as llm.c's outlier detector judges them. Only a rise counts.
#include <deque>
#include <string>

namespace loom {

struct SpikeVerdict {
  bool spike = false;
  double loss = 0, loss_z = 0, norm = 0, norm_z = 0;
  int window = 0;  // the steps the z-scores were taken over (0: the window is not full yet)
  // "loss 5.21 (z 14.3), gradient norm 2.10 (z 8.9) over the last 32 steps"
  std::string describe() const;
};

class SpikeDetector {
 public:
  // `loss_z`, `norm_z`: thresholds in standard deviations (0: that value is not watched).
  SpikeDetector(int window, double loss_z, double norm_z);
  // Judges one step's values (the same on every rank); a non-finite value is no spike
  // (train.on_nonfinite judges it).
  SpikeVerdict judge(double loss, double norm) const;
  // A step that was not a spike joins the window (non-finite values are left out).
  void admit(double loss, double norm);

 private:
  static double z_score(const std::deque<double>& past, double x);
  std::size_t window_;
  double loss_z_, norm_z_;
  std::deque<double> losses_, norms_;
};

}  // namespace loom
