// `loom plan DECK --devices N --memo FILE.md`: the memo for the chosen layout, answering
// the planning exercise's questions (../shared/reference/planning-exercises.txt) with the planner's
// numbers: how the layout removes the out-of-memory, where gradients are synchronised and what that
// costs from one node to N devices, micro-batching against naive layer splitting, what mixed
// precision saves and what stays fp32, and the first bottleneck to perfect scaling with the first
// mitigation, itself predicted. Every figure comes from `predict` on a variant of the deck.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <sstream>

#include "core/base/error.hpp"
#include "driver/commands.hpp"
#include "driver/plan/search.hpp"

namespace loom {
namespace {

const char* const kCategoryWhat[kMemCategories] = {"parameters (fp32; the 16-bit compute copies under mixed precision)",
                                                   "gradients (fp32)",
                                                   "AdamW moments m and v (fp32)",
                                                   "fp32 master weights (mixed precision)",
                                                   "activations kept for backward",
                                                   "communication buffers",
                                                   "workspace (operand slots, scratch)"};

std::string pct(double x) { return fixed(100.0 * x, 1) + "%"; }
// 12.85 billion, 3.4 million, 41472: a count readable at any size.
std::string count_text(double n) {
  if (n >= 1e9) return fixed(n / 1e9, 2) + " billion";
  if (n >= 1e6) return fixed(n / 1e6, 1) + " million";
  return fixed(n, 0);
}
std::string ms(double s) { return fixed(s * 1e3, s < 1e-3 ? 4 : s < 0.1 ? 2 : 1) + " ms"; }

std::string group_name(const std::string& g) {
  if (g == "dp") return "data parallel (dp)";
  if (g == "tp") return "tensor parallel (tp)";
  if (g == "pp") return "pipeline (pp)";
  if (g == "cp") return "context parallel ring (cp)";
  return g;
}

// How many ranks a group has.
int group_size(const std::string& g, const Variant& v) {
  if (g == "dp") return v.dp * v.cp;  // the gradient group: dp x cp
  if (g == "tp") return v.tp;
  if (g == "pp") return v.pp;
  if (g == "cp") return v.cp;
  return v.dp * v.cp * v.tp * v.pp;
}
bool group_inside_node(const std::string& g, const Variant& v, int per_node) {
  Layout l;
  l.dp = v.dp;
  l.tp = v.tp;
  l.pp = v.pp;
  l.cp = v.cp;
  return group_in_node(g, l, per_node);
}

struct GroupCost {
  double bytes = 0, messages = 0, seconds = 0;
  bool overlapped = false;
  std::vector<std::pair<std::string, int>> what;  // kinds of message, buckets folded: how many of each
  std::string list() const {
    std::string s;
    for (const auto& [w, n] : what)
      s += (s.empty() ? "" : "; ") + w + (n > 1 ? " (" + std::to_string(n) + " buckets)" : "");
    return s;
  }
};

// The rank that sets the step: its messages by group.
std::map<std::string, GroupCost> comm_by_group(const Candidate& c, const ClusterSpec& cluster) {
  std::map<std::string, GroupCost> out;
  const RankPrediction& r = c.p.worst();
  for (const CommCost& k : r.step.comm) {
    GroupCost& g = out[k.group];
    g.bytes += k.bytes;
    g.messages += k.messages;
    g.overlapped = g.overlapped || comm_hides(k, c.p.plan.layout, cluster);
    const std::string kind = std::regex_replace(k.what, std::regex("bucket [0-9]+ "), "");
    auto it = std::find_if(g.what.begin(), g.what.end(), [&](const auto& w) { return w.first == kind; });
    if (it == g.what.end())
      g.what.push_back({kind, 1});
    else
      ++it->second;
  }
  for (const auto& [name, sec] : c.p.time.comm_by_group) out[name].seconds = sec;
  return out;
}

double model_states(const std::array<double, kMemCategories>& b) {
  return b[static_cast<int>(Mem::params)] + b[static_cast<int>(Mem::grads)] + b[static_cast<int>(Mem::optimizer)] +
         b[static_cast<int>(Mem::master)];
}

std::string fits_text(const Candidate& c) {
  if (!c.built) return "refused: " + c.reason;
  return c.fits ? "fits" : "out of memory by " + gib(c.over);
}

class Memo {
 public:
  Memo(const PlanSearch& search, const PlanOptions& o, const std::vector<Candidate>& all)
      : search_(search), o_(o), all_(all), cluster_(search.cluster) {
    chosen_ = search_.evaluate(all[static_cast<std::size_t>(chosen_index(all, search.cluster.device_memory_bytes))].v,
                               true);  // every rank
    base_ = load_deck(search_.schema, search_.deck_path, search_.deck_sets);
  }

  std::string write() {
    header();
    out_of_memory();
    gradient_sync();
    micro_batching();
    precision();
    bottleneck();
    return s_.str();
  }

 private:
  const PlanSearch& search_;
  const PlanOptions& o_;
  const std::vector<Candidate>& all_;
  const ClusterSpec& cluster_;
  Candidate chosen_;
  Deck base_ = Deck();
  std::ostringstream s_;
  // Filled by gradient_sync for bottleneck: the same variant on one node.
  Candidate small_;
  bool have_small_ = false;
  int small_devices_ = 0;

  // A variant as the strategies' memo sentences see it, with the operand type its prediction found.
  PlanPoint point(const Variant& v, const std::string& precision) const {
    PlanPoint p = v.point(&base_);
    p.precision = precision;
    return p;
  }
  PlanPoint chosen_point() const { return point(chosen_.v, chosen_.p.precision); }

  Candidate with(Variant v, const std::vector<std::string>& extra = {}) const {
    v.extra.insert(v.extra.end(), extra.begin(), extra.end());
    return search_.evaluate(v, false);
  }

  std::string link(const std::string& g, const Variant& v) const {
    return group_inside_node(g, v, cluster_.devices_per_node)
               ? "inside a node (" + fixed(cluster_.intra_bytes_per_s / 1e9, 0) + " GB/s)"
               : "across nodes (" + fixed(cluster_.inter_bytes_per_s / 1e9, 0) + " GB/s)";
  }

  void header() {
    const Variant& v = chosen_.v;
    const Prediction& p = chosen_.p;
    const GPTConfig& m = p.plan.model;
    s_ << "Generated by `" << o_.command << "`; every figure below is `loom plan`'s prediction (nothing here was "
       << "measured on the cluster).\n\n";
    s_ << "# Training plan: " << m.layers << " layers, d_model " << m.d_model << ", " << m.heads << " heads, seq_len "
       << m.seq_len << ", vocab " << m.vocab << " on " << o_.devices << " devices\n\n";
    s_ << "**Recommendation: " << v.describe() << "** (`";
    for (const std::string& set : v.sets()) s_ << "--set " << set << " ";
    s_.seekp(-1, std::ios_base::cur);
    s_ << "`).\n\n";
    s_ << "- Cluster: " << cluster_.name << ", " << cluster_.nodes << " nodes x " << cluster_.devices_per_node
       << " devices, " << gib(cluster_.device_memory_bytes) << " each (" << cluster_.source << ")";
    // A plan for part of the cluster says how much of it.
    if (o_.devices < cluster_.devices())
      s_ << "; this plan is for " << o_.devices << " of its " << cluster_.devices() << " devices";
    s_ << ".\n";
    s_ << "- Batch: " << p.plan.global_batch << " sequences of " << m.seq_len << " tokens per step ("
       << p.plan.global_batch * m.seq_len << " tokens), " << p.plan.rows_per_micro << " sequence"
       << (p.plan.rows_per_micro == 1 ? "" : "s") << " per micro-batch.\n";
    s_ << "- Predicted: " << ms(p.time.step_s) << " per step, " << fixed(p.time.tokens_per_s, 0) << " tokens/s, MFU "
       << pct(p.time.mfu) << "; the largest rank (" << p.worst_rank << ") needs " << gib(p.peak_total) << " of "
       << gib(cluster_.device_memory_bytes) << ": " << gib(cluster_.device_memory_bytes - p.peak_total)
       << " are left for what loom's ledger does not count (the CUDA context, NCCL's own buffers, the allocator's "
       << "fragmentation: typically 1-3 GiB on a GPU).\n";
    int fit = 0;
    for (const Candidate& c : all_) fit += c.fits;
    const int c = chosen_index(all_, cluster_.device_memory_bytes);
    const Candidate& fastest = all_.front();
    if (c == 0) {
      s_ << "- Chosen as the fastest of " << fit << " fitting candidates out of " << all_.size()
         << " searched (the table `loom plan` prints lists the runners-up and why every other layout fails).\n\n";
    } else {
      s_ << "- Chosen as the one with fewest strategies on among the " << fit << " fitting candidates (of "
         << all_.size() << " searched) within " << fixed(100 * kSimplerWithin, 0)
         << "% of the fastest predicted and leaving " << fixed(100 * kSimplerHeadroom, 0)
         << "% of the device free: " << fastest.v.describe() << " is predicted "
         << fixed(100.0 * (fastest.p.time.tokens_per_s / chosen_.p.time.tokens_per_s - 1.0), 1) << "% faster ("
         << fixed(fastest.p.time.tokens_per_s, 0)
         << " tokens/s), a gap within the prediction's error, for more to set up and go wrong (`--set` it to "
            "take it). The table `loom plan` prints lists the runners-up and why every other layout fails.\n\n";
    }
  }

  void out_of_memory() {
    // One device, each dimension at its plain (first) value.
    Variant plain;
    plain.dims = &search_.dims;
    plain = search_.normalise(plain, base_);
    const Candidate one = with(plain);
    // The most one device can do alone: each dimension's lean value (16-bit products), recompute, one
    // sequence per micro-batch.
    Variant frugal = plain;
    std::string lean_words;
    for (const PlanDimension* d : search_.columns()) {
      const std::string value = d->lean ? d->lean(chosen_point()) : std::string();
      if (value.empty()) continue;
      frugal.set(d->key, value);
      const std::string words = d->describe ? d->describe(value) : value;
      if (!words.empty()) lean_words += words + " + ";
    }
    frugal.set(Variant::kRecomputeKey, "true");
    frugal.micro = chosen_.p.plan.global_batch;
    const Candidate lean = with(frugal);
    // The section answers the question the case asks: how the layout removes an out-of-memory, or,
    // where one device already holds the run, what the layout does to memory instead.
    if (one.fits)
      s_ << "## 1. Memory: one device already holds this run\n\nNothing here runs out of memory on one device (fp32, "
         << "no recompute, the whole batch at once): the layout below is chosen for speed, and this is what it "
            "does to each rank's memory.\n\n";
    else
      s_ << "## 1. How the layout removes the out-of-memory\n\n";
    s_ << "Peak memory of one device by the ledger's categories, against the chosen layout's largest rank:\n\n";
    s_ << "| category | one device, fp32 | one device, " << lean_words
       << "recompute + 1 sequence per micro-batch | chosen, rank " << chosen_.p.worst_rank
       << " |\n| --- | ---: | ---: | ---: |\n";
    auto cell = [](const Candidate& c, int i) { return c.built ? gib(c.p.peak[static_cast<std::size_t>(i)]) : "-"; };
    const RankPrediction& worst = chosen_.p.worst();
    for (int i = 0; i < kMemCategories; ++i)
      s_ << "| " << kCategoryWhat[i] << " | " << cell(one, i) << " | " << cell(lean, i) << " | "
         << gib(worst.peak[static_cast<std::size_t>(i)]) << " |\n";
    s_ << "| **total** | **" << (one.built ? gib(one.p.peak_total) : "-") << "** | **"
       << (lean.built ? gib(lean.p.peak_total) : "-") << "** | **" << gib(chosen_.p.peak_total) << "** |\n";
    s_ << "| against " << gib(cluster_.device_memory_bytes) << " | " << fits_text(one) << " | " << fits_text(lean)
       << " | " << fits_text(chosen_) << " |\n\n";
    if (lean.built) {
      const double states = model_states(lean.p.peak);
      const double params = static_cast<double>(lean.p.ranks.front().params_held);
      s_ << "The model has " << count_text(params) << " parameters. On one device its model states alone "
         << "(parameters, gradients, AdamW's two moments";
      if (lean.p.precision != "fp32") s_ << ", fp32 masters and 16-bit copies";
      s_ << ") take " << gib(states) << " (" << fixed(states / params, 1) << " bytes per parameter)"
         << (states > cluster_.device_memory_bytes ? ", more than the device holds, whatever is done to activations: "
                                                     "the model states themselves must be split over devices."
                                                   : ".")
         << "\n\n";
    }
    what_is_split();
    what_each_choice_buys();
  }

  void what_is_split() {
    const Variant& v = chosen_.v;
    s_ << "What the chosen layout splits:\n\n";
    if (v.tp > 1)
      s_ << "- **Tensor parallelism over " << v.tp
         << "** splits every block's weight matrices (and their gradients and "
         << "optimizer state) by columns and rows, and the attention heads and MLP activations with them: each rank "
         << "holds 1/" << v.tp << " of each block."
         << (chosen_.p.worst().sequence_parallel ? " Sequence parallelism splits LayerNorm and the residual "
                                                   "stream's activations by tokens too."
                                                 : "")
         << "\n";
    if (v.pp > 1)
      s_ << "- **Pipeline parallelism over " << v.pp << "** gives each stage " << chosen_.p.plan.model.layers / v.pp
         << " or so of the " << chosen_.p.plan.model.layers
         << " blocks; a stage keeps the activations of the micro-batches "
         << "it has in flight (the schedule bounds how many).\n";
    // What the strategies split over the dp ranks (ZeRO's shards), else the plain replicas.
    const std::string splits = search_.memo_text("split", chosen_point());
    s_ << splits;
    if (splits.empty() && v.dp > 1)
      s_ << "- **Data parallelism over " << v.dp << "** splits the batch, not the model: every dp rank keeps a full "
         << "copy of its shard of the model states.\n";
    if (v.recompute())
      s_ << "- **Recompute** keeps only each block's input during forward and runs the block again in backward.\n";
    if (v.micro > 1)
      s_ << "- **" << v.micro << " micro-batches** of " << chosen_.p.plan.rows_per_micro
         << " sequence(s): the activations "
         << "of one micro-batch (a few with a pipeline) are alive at a time, not the rank's whole batch.\n";
  }

  void what_each_choice_buys() {
    const Variant& v = chosen_.v;
    s_ << "\nWhat each choice buys, one change at a time from the chosen layout:\n\n";
    s_ << "| change | largest rank | against " << gib(cluster_.device_memory_bytes)
       << " | tokens/s |\n| --- | ---: | --- | ---: |\n";
    s_ << "| none (chosen) | " << gib(chosen_.p.peak_total) << " | fits | " << fixed(chosen_.p.time.tokens_per_s, 0)
       << " |\n";
    auto row = [&](const std::string& what, const Variant& w) {
      const Candidate c = with(w);
      s_ << "| " << what << " | " << (c.built ? gib(c.p.peak_total) : "-") << " | " << fits_text(c) << " | "
         << (c.built ? fixed(c.p.time.tokens_per_s, 0) : "-") << " |\n";
    };
    // The model's own choice first, then each strategy's what-ifs in column order.
    Variant w = v;
    w.set(Variant::kRecomputeKey, v.recompute() ? "false" : "true");
    row(v.recompute() ? "no recompute" : "recompute", w);
    for (const PlanDimension* d : search_.columns())
      if (d->what_if)
        for (const auto& [words, value] : d->what_if(chosen_point())) {
          w = v;
          w.set(d->key, value);
          row(words, w);
        }
    if (v.micro > 1) {
      w = v;
      w.micro = 1;
      row("1 micro-batch", w);
    }
    s_ << "\n";
  }

  void gradient_sync() {
    const Variant& v = chosen_.v;
    s_ << "## 2. Where gradients are synchronised, and what it costs from one node to " << o_.devices << " devices\n\n";
    s_ << "Messages of the rank that sets the step (rank " << chosen_.p.worst_rank << "), per step:\n\n";
    s_ << "| group | ranks | link | what | MiB sent | messages | time | hidden behind backward |\n"
       << "| --- | ---: | --- | --- | ---: | ---: | ---: | --- |\n";
    for (const auto& [g, k] : comm_by_group(chosen_, cluster_)) {
      s_ << "| " << group_name(g) << " | " << group_size(g, v) << " | " << link(g, v) << " | " << k.list() << " | "
         << fixed(k.bytes / (1 << 20), 1) << " | " << fixed(k.messages, 0) << " | " << ms(k.seconds) << " | "
         << (g == "cp" ? (chosen_.p.time.ring_hidden_behind_s > 0 ? "the blocks, behind the attention of the hop before"
                                                                  : "no")
             : k.overlapped ? "yes, bucket by bucket"
                            : "no")
         << " |\n";
    }
    const TimePrediction& t = chosen_.p.time;
    s_ << "\nOf " << ms(t.comm_s) << " of messages, " << ms(t.comm_exposed_s) << " are exposed (not hidden behind "
       << "compute); compute is " << ms(t.compute_s) << ".\n\n";
    s_ << "Gradients are summed over the " << v.dp * v.cp << " data-parallel replicas"
       << (v.cp > 1 ? " (dp x cp: context-parallel ranks hold the same weights)" : "")
       << " so that every replica takes the same step";
    if (v.dp * v.cp > 1) {
      const std::string sync = search_.memo_text("dp_sync", chosen_point());
      s_ << ": "
         << (sync.empty() ? "each bucket of gradients is all-reduced as soon as backward has finished it" : sync)
         << ". A ring moves about 2(n-1)/n of the gradients' bytes per rank, nearly independent of n, so what changes "
            "as "
         << "the job grows is the link the ring crosses and how much backward is left to hide it behind.\n";
    } else
      s_ << "; with dp = 1 there is no gradient synchronisation, only the tensor-parallel and pipeline messages.\n";
    if (v.tp > 1)
      s_ << "Tensor parallelism combines activations inside every block, forward and backward ("
         << (chosen_.p.worst().sequence_parallel ? "all-gathers and reduce-scatters, with sequence parallelism"
                                                 : "all-reduces")
         << "), on the critical path: that is why tp stays within a node (" << v.tp
         << " <= " << cluster_.devices_per_node << ").\n";
    if (v.pp > 1)
      s_ << "The pipeline sends each micro-batch's boundary activation forward and its gradient back, point to "
            "point.\n";
    s_ << "\n";
    one_node_to_all();
  }

  // The same layout on fewer devices: dp shrinks, the global batch stays.
  void one_node_to_all() {
    const Variant& v = chosen_.v;
    const int per_node = cluster_.devices_per_node;
    small_devices_ = o_.devices > per_node ? per_node : 0;
    const int model_split = v.tp * v.pp * v.cp;  // what dp multiplies
    if (small_devices_ == 0 || model_split > small_devices_ || small_devices_ % model_split != 0) {
      s_ << "(No one-node comparison: the chosen " << (v.cp > 1 ? "cp x tp x pp = " : "tp x pp = ") << model_split
         << " does not fit in one node of " << per_node << " devices, or the job is one node.)\n\n";
      return;
    }
    Variant sv = v;
    sv.dp = small_devices_ / model_split;
    // Keep the sequences per micro-batch: the same activations per micro-batch, more micro-batches.
    const int rows_small = chosen_.p.plan.global_batch / sv.dp;
    sv.micro = std::max(1, rows_small / std::max(1, chosen_.p.plan.rows_per_micro));
    sv = search_.normalise(sv, base_);  // a dimension the smaller dp no longer allows at its plain value
    small_ = with(sv);
    have_small_ = small_.built;
    const PlanSearch one_node(search_.registry, search_.schema, search_.deck_path, search_.deck_sets, cluster_);
    const std::vector<Candidate> best_small = one_node.run(small_devices_);
    s_ << "Growing from one node (" << small_devices_ << " devices) to " << o_.devices
       << ", with the same global batch:\n\n";
    s_ << "| devices | layout | dp ring | data-parallel messages | exposed messages | step | tokens/s | speed-up | "
          "scaling efficiency |\n"
       << "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n";
    // `scaling`: the row's efficiency against the reference (a row of one node other than the
    // reference has none: it is a comparison at the same size).
    auto scale_row = [&](int devices, const Candidate& c, double ref, bool scaling) {
      if (!c.built) {
        s_ << "| " << devices << " | " << c.v.describe() << " | | | | " << fits_text(c) << " | | | |\n";
        return;
      }
      double dp_s = 0;
      for (const auto& [g, sec] : c.p.time.comm_by_group)
        if (g == "dp") dp_s = sec;
      const double speedup = ref > 0 ? c.p.time.tokens_per_s / ref : 1.0;
      s_ << "| " << devices << " | " << c.v.describe() << (c.fits ? "" : " (" + fits_text(c) + ")") << " | "
         << (c.v.dp * c.v.cp > 1 ? link("dp", c.v) : "none") << " | " << ms(dp_s) << " | "
         << ms(c.p.time.comm_exposed_s) << " | " << ms(c.p.time.step_s) << " | " << fixed(c.p.time.tokens_per_s, 0)
         << " | " << fixed(speedup, 2) << "x | "
         << (scaling ? pct(speedup * small_devices_ / devices) : std::string("(same size)")) << " |\n";
    };
    const double ref = have_small_ ? small_.p.time.tokens_per_s : 0;
    scale_row(small_devices_, small_, ref, true);
    scale_row(o_.devices, chosen_, ref, true);
    const bool other_best = !best_small.empty() && best_small.front().fits && best_small.front().built &&
                            best_small.front().v.describe() != small_.v.describe();
    if (other_best) scale_row(small_devices_, best_small.front(), ref, false);
    s_ << "\n(" << small_devices_ << " devices: the chosen " << (v.cp > 1 ? "cp x tp x pp" : "tp x pp")
       << " with dp = " << sv.dp << "; the last row, when present, is the "
       << "search's best layout for one node. Scaling efficiency: speed-up / " << o_.devices / small_devices_
       << ".)\n\n";
    if (other_best && chosen_.built) {
      const double best = best_small.front().p.time.tokens_per_s;
      const double speedup = chosen_.p.time.tokens_per_s / best;
      s_ << "Against the fastest layout of one node (" << best_small.front().v.describe() << ", " << fixed(best, 0)
         << " tokens/s), the " << o_.devices << " devices' " << fixed(chosen_.p.time.tokens_per_s, 0)
         << " tokens/s are a " << fixed(speedup, 2) << "x speed-up, " << pct(speedup * small_devices_ / o_.devices)
         << " scaling efficiency.\n\n";
    }
  }

  void micro_batching() {
    const Variant& v = chosen_.v;
    s_ << "## 3. Pipeline micro-batching against naive layer splitting\n\n";
    Candidate piped = chosen_;
    if (v.pp == 1) {
      const Candidate* best_pp = nullptr;
      for (const Candidate& c : all_)
        if (c.fits && c.v.pp > 1) {
          best_pp = &c;
          break;
        }
      s_ << "The chosen layout does not split layers (pp = 1): it fits without a pipeline, and so pays no bubble.";
      if (!best_pp) {
        s_ << " No layout with pp > 1 fits these " << o_.devices << " devices.\n\n";
        return;
      }
      piped = search_.evaluate(best_pp->v, true);
      s_ << " The fastest fitting layout that does is " << piped.v.describe() << " at "
         << fixed(piped.p.time.tokens_per_s, 0) << " tokens/s ("
         << pct(piped.p.time.tokens_per_s / chosen_.p.time.tokens_per_s) << " of the chosen); for it:\n\n";
    }
    const Variant& w = piped.v;
    Variant naive = w;
    naive.micro = 1;
    const Candidate one = with(naive);
    const std::string schedule = search_.memo_text("schedule", point(w, piped.p.precision));
    s_ << "| " << w.pp << " stages, schedule " << schedule
       << " | micro-batches | bubble (idle share of a step) | step | tokens/s | largest rank |\n"
       << "| --- | ---: | ---: | ---: | ---: | ---: |\n";
    auto row = [&](const std::string& what, const Candidate& c) {
      s_ << "| " << what << " | " << c.v.micro << " | " << (c.built ? pct(c.p.time.bubble) : "-") << " | "
         << (c.built ? ms(c.p.time.step_s) : "-") << " | " << (c.built ? fixed(c.p.time.tokens_per_s, 0) : "-") << " | "
         << (c.built ? gib(c.p.peak_total) + " (" + fits_text(c) + ")" : fits_text(c)) << " |\n";
    };
    row("naive layer splitting: the batch passes the stages in turn", one);
    row("micro-batched", piped);
    if (w.micro * 2 <= piped.p.plan.rows_per_micro * w.micro && (piped.p.plan.rows_per_micro % 2) == 0) {
      Variant more = w;
      more.micro = w.micro * 2;
      row("twice the micro-batches", with(more));
    }
    s_ << "\nWith one batch a stage works only while the batch is on it: " << w.pp - 1 << " of " << w.pp
       << " stages wait at any time, so each device is busy about 1/" << w.pp << " of the step. Cut into " << w.micro
       << " micro-batches, stage s works on micro-batch i while stage s+1 works on i-1: the pipeline fills and drains "
       << "once per step, and the idle share falls to about (pp-1)/(m+pp-1) = "
       << pct((w.pp - 1.0) / (w.micro + w.pp - 1.0)) << " for equal stages; the planner replays the " << schedule
       << " schedule itself, with each stage's own "
       << "work (the first also embeds, the last also runs the vocabulary head and the loss), and finds "
       << pct(piped.p.time.bubble) << "." << search_.memo_text("schedule_note", point(w, piped.p.precision))
       << " More micro-batches shrink the bubble further but make each product smaller and add a boundary message "
          "each.\n\n";
  }

  void precision() {
    // The chosen variant against the what-if of the dimension that sets the products' operand type.
    const Variant& v = chosen_.v;
    Variant other = v;
    std::string other_precision = chosen_.p.precision;
    for (const PlanDimension* d : search_.columns())
      if (d->sets_precision && d->what_if)
        for (const auto& [words, value] : d->what_if(chosen_point())) {
          other.set(d->key, value);
          other_precision = value;
          break;
        }
    const bool fp32 = chosen_.p.precision == "fp32";
    const Candidate o = with(other);
    const Candidate& half = fp32 ? o : chosen_;
    const Candidate& full = fp32 ? chosen_ : o;
    const std::string h = fp32 ? other_precision : chosen_.p.precision;
    PlanPoint half_point = chosen_point();
    half_point.precision = h;
    s_ << "## 4. Mixed precision: what it saves, what stays fp32\n\n";
    s_ << "The chosen layout in fp32 and in " << h << " (largest rank):\n\n";
    s_ << "| | fp32 | " << h << " |\n| --- | ---: | ---: |\n";
    for (int i = 0; i < kMemCategories; ++i)
      s_ << "| " << kCategoryWhat[i] << " | "
         << (full.built ? gib(full.p.worst().peak[static_cast<std::size_t>(i)]) : "-") << " | "
         << (half.built ? gib(half.p.worst().peak[static_cast<std::size_t>(i)]) : "-") << " |\n";
    auto total = [](const Candidate& c) {
      return c.built ? gib(c.p.peak_total) + " (" + fits_text(c) + ")" : fits_text(c);
    };
    auto val = [](const Candidate& c, double x) { return c.built ? fixed(x, 1) : std::string("-"); };
    s_ << "| **total** | **" << total(full) << "** | **" << total(half) << "** |\n";
    s_ << "| matrix-product peak | " << fixed(cluster_.peak_flops_fp32 / 1e12, 1) << " TFLOP/s | "
       << fixed((h == "fp16" ? cluster_.peak_flops_fp16 : cluster_.peak_flops_bf16) / 1e12, 1) << " TFLOP/s |\n";
    s_ << "| step | " << (full.built ? ms(full.p.time.step_s) : "-") << " | "
       << (half.built ? ms(half.p.time.step_s) : "-") << " |\n";
    s_ << "| tokens/s | " << val(full, full.p.time.tokens_per_s) << " | " << val(half, half.p.time.tokens_per_s)
       << " |\n\n";
    s_ << "In " << h << " the matrix products (QKV, attention projection, MLP, the tied head) take 16-bit operands and "
       << "accumulate in fp32, so they run at the 16-bit peak; the inputs they save for backward are kept in 16 bits, "
       << "and each weight has a 16-bit compute copy. What stays fp32, and why:\n\n"
       << "- the **master weights, gradients and AdamW's m and v**: an update is often smaller than a 16-bit weight's "
       << "spacing (bf16 keeps 8 significant bits), so adding it in 16 bits would round it away; the masters cost the "
       << "extra bytes per parameter in the table above;\n"
       << "- **accumulations**: the products' sums, the gradient accumulation over micro-batches, the gradient norm "
          "and "
       << "the loss, where many small terms are added;\n"
       << "- **LayerNorm, softmax and the attention's own products, and the cross-entropy**: means, variances and "
       << "exponentials lose accuracy fastest, and their activations are not what dominates memory;\n"
       << search_.memo_text("precision_stays", half_point) << "\n"
       << (chosen_.p.plan.model.flash_attention
               ? std::string("Attention is fused here (`model.attention = " + chosen_.p.plan.model.attention +
                             "`): bf16 operands, no [batch, heads, T, T] matrices in memory; ") +
                     (priced_as_flash(chosen_.p.plan.model, cluster_)
                          ? "the time model below prices it at the cluster's measured fused-attention rate.\n\n"
                          : "the time model below prices it as the unfused kernels, as this cluster's description "
                            "gives no fused-attention rate (`flash_attention_tflops`).\n\n")
               : "Attention's own products run in fp32 in loom (on a GPU as TF32 under `run.tf32 = auto`, not at the "
                 "16-bit peak), and its kernels write and read the whole [batch, heads, T, T] matrices: here attention "
                 "takes " +
                     pct(half.built ? half.p.time.attention_s / half.p.time.step_s : 0.0) + " of the " + h +
                     " step, the largest share a faster (16-bit, fused) attention kernel, `model.attention = flash`, "
                     "would win back.\n\n")
       << search_.memo_text("precision_scaling", half_point);
  }

  // The step's parts, beyond the ideal of products and kernels on every device; returns the bubble's time.
  double step_parts(const std::map<std::string, double>& exposed_by_group) {
    const TimePrediction& t = chosen_.p.time;
    const double busy = t.compute_s - t.optimizer_s;
    const double bubble_s = t.bubble > 0 ? busy / (1.0 - t.bubble) - busy : 0.0;
    s_ << "The predicted step of " << ms(t.step_s) << " on " << o_.devices << " devices:\n\n";
    s_ << "| part | time | share |\n| --- | ---: | ---: |\n";
    auto row = [&](const std::string& what, double sec) {
      s_ << "| " << what << " | " << ms(sec) << " | " << pct(sec / t.step_s) << " |\n";
    };
    row("matrix products", t.matmul_s);
    row("attention", t.attention_s);
    row("element-wise kernels (memory-bound)", t.elementwise_s);
    row("AdamW", t.optimizer_s);
    if (t.strategies_s > 0)
      row("the strategies' host passes (replica hashes, compression) and their copies", t.strategies_s);
    if (bubble_s > 0) row("pipeline bubble", bubble_s);
    if (t.sync_wait_s > 0) row("waits for each group's slowest rank", t.sync_wait_s);
    for (const auto& [g, sec] : exposed_by_group)
      if (sec > 0) row("exposed " + group_name(g) + " messages", sec);
    s_ << "\n";
    return bubble_s;
  }

  // The candidates for the bottleneck: what does not shrink with more devices, largest first.
  struct Loss {
    std::string what;
    double seconds;
  };
  std::vector<Loss> fixed_losses(const std::map<std::string, double>& exposed_by_group, double bubble_s) const {
    std::vector<Loss> losses;
    if (bubble_s > 0) losses.push_back({"bubble", bubble_s});
    for (const auto& [g, sec] : exposed_by_group) losses.push_back({g, sec});
    // Every dp rank updates all it holds where no strategy splits the state (Prediction::zero_stage).
    if (chosen_.p.zero_stage == 0 && chosen_.v.dp * chosen_.v.cp > 1)
      losses.push_back({"optimizer", chosen_.p.time.optimizer_s});
    std::sort(losses.begin(), losses.end(), [](const Loss& a, const Loss& b) { return a.seconds > b.seconds; });
    return losses;
  }

  void bottleneck() {
    const Variant& v = chosen_.v;
    const TimePrediction& t = chosen_.p.time;
    s_ << "## 5. The first bottleneck to perfect scaling, and what to try first\n\n";
    const std::map<std::string, double> exposed_by_group(t.comm_exposed_by_group.begin(),
                                                         t.comm_exposed_by_group.end());
    const std::vector<Loss> losses = fixed_losses(exposed_by_group, step_parts(exposed_by_group));
    if (have_small_) {
      const double ideal = small_.p.time.step_s * small_devices_ / o_.devices;
      s_ << "Perfect scaling from " << small_devices_ << " devices would make the step " << ms(ideal)
         << " (the one-node step " << ms(small_.p.time.step_s) << " / " << o_.devices / small_devices_
         << "); the prediction is " << ms(t.step_s) << ", " << pct(ideal / t.step_s) << " efficiency.\n\n";
    }
    if (losses.empty() || losses.front().seconds < 0.02 * t.step_s) {
      s_ << "**Bottleneck:** none of the parts that do not shrink with more devices (exposed messages, bubble, "
         << "replicated optimizer) reaches 2% of the step; what limits scaling first is the products themselves "
         << "getting smaller per device (fewer sequences per rank), which lowers their efficiency: a larger global "
            "batch "
         << "is the first thing to try.\n";
      return;
    }
    const Loss& top = losses.front();
    // What the search did not vary (it already chose micro-batches, ZeRO, recompute, sp, precision
    // and the layout): each lever that addresses the bottleneck, predicted.
    std::vector<std::pair<std::string, Variant>> levers;
    auto lever = [&](const std::string& what, const std::vector<std::string>& extra, int batch_factor = 1) {
      Variant f = v;
      f.extra = extra;
      if (batch_factor > 1) {
        f.micro = v.micro * batch_factor;  // the same sequences per micro-batch, more of them
        f.extra.push_back("train.batch=" + std::to_string(chosen_.p.plan.global_batch * batch_factor));
      }
      levers.push_back({what, f});
    };
    std::string name, why;
    const std::string larger_batch =
        "a twice larger global batch (train.batch = " + std::to_string(2 * chosen_.p.plan.global_batch) +
        "; changes the optimisation: twice the tokens per step)";
    if (top.what == "bubble") {
      name = "the pipeline bubble";
      why = "each of " + std::to_string(v.pp) +
            " stages idles while the pipeline fills and drains, and with more devices "
            "(fixed global batch) each rank has fewer sequences to cut into micro-batches";
      for (const PlanLever& l : search_.levers("bubble", chosen_point())) lever(l.what, l.sets);
      lever(larger_batch, {}, 2);
    } else if (top.what == "optimizer") {
      name = "the replicated optimizer step";
      why = "every data-parallel rank updates all of its parameters, which does not shrink as dp grows";
      for (const PlanLever& l : search_.levers("optimizer", chosen_point())) lever(l.what, l.sets);
    } else if (top.what == "dp") {
      name = "the data-parallel gradient synchronisation";
      why = std::string("its ring runs ") +
            (group_inside_node("dp", v, cluster_.devices_per_node) ? "inside a node"
                                                                   : "across nodes, over the slower links,") +
            " and with a fixed global batch each rank's backward, which hides it, shrinks as dp grows";
      for (const PlanLever& l : search_.levers("dp", chosen_point())) lever(l.what, l.sets);
      lever(larger_batch, {}, 2);
    } else if (top.what == "tp") {
      name = "the tensor-parallel activation all-reduces";
      why = "they sit on the critical path of every block, forward and backward, and cannot overlap";
      lever(larger_batch, {}, 2);
    } else {
      name = "the " + group_name(top.what) + " messages";
      why = "they do not shrink with more devices";
      lever(larger_batch, {}, 2);
    }
    s_ << "**Bottleneck: " << name << "** (" << ms(top.seconds) << " of the step, " << pct(top.seconds / t.step_s)
       << "): " << why << ".\n\n";
    lever_table(levers);
  }

  // Each lever predicted on the chosen layout, and the first that fits and pays.
  void lever_table(const std::vector<std::pair<std::string, Variant>>& levers) {
    const TimePrediction& t = chosen_.p.time;
    s_ << "Levers the search does not vary, each predicted on the chosen layout:\n\n";
    s_ << "| lever | tokens/s | against the chosen | largest rank |\n| --- | ---: | ---: | --- |\n";
    const Candidate* first = nullptr;
    std::vector<Candidate> tried;
    tried.reserve(levers.size());
    for (const auto& [what, f] : levers) {
      tried.push_back(with(f));
      const Candidate& c = tried.back();
      s_ << "| " << what << " | " << (c.built ? fixed(c.p.time.tokens_per_s, 0) : "-") << " | "
         << (c.built ? (c.p.time.tokens_per_s >= t.tokens_per_s ? "+" : "") +
                           pct(c.p.time.tokens_per_s / t.tokens_per_s - 1.0)
                     : "-")
         << " | " << (c.built ? gib(c.p.peak_total) + " (" + fits_text(c) + ")" : fits_text(c)) << " |\n";
    }
    for (std::size_t i = 0; i < tried.size(); ++i)
      if (tried[i].fits && tried[i].p.time.tokens_per_s > t.tokens_per_s * 1.005) {
        first = &tried[i];
        s_ << "\n**First mitigation to try: " << levers[i].first << "**: predicted "
           << pct(tried[i].p.time.tokens_per_s / t.tokens_per_s - 1.0) << " more tokens/s, and it fits.\n";
        break;
      }
    if (!first)
      s_ << "\nNone of them both fits and pays on this layout: the bottleneck is what this model, batch and cluster "
            "leave, and the first thing to try is the lever above that gains most once memory allows it; measure "
            "before "
            "deciding.\n";
  }
};

}  // namespace

void write_memo(const PlanSearch& search, const PlanOptions& o, const std::vector<Candidate>& all) {
  Memo memo(search, o, all);
  const std::string text = memo.write();
  // Written beside the target and renamed over it, so a failed write leaves an earlier memo whole.
  const std::string tmp = o.memo + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    f.flush();
    if (!f) {
      std::remove(tmp.c_str());
      throw InputError("loom plan --memo " + o.memo + ": cannot write " + tmp +
                       " (check the directory and free space)");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, o.memo, ec);
  if (ec) {
    std::remove(tmp.c_str());
    throw InputError("loom plan --memo " + o.memo + ": " + ec.message());
  }
  std::cerr << "loom plan: wrote the memo " << o.memo << "\n";
}

}  // namespace loom
