// `loom plan DECK`: the deck's own layout (driver/plan/predict.hpp), or with --devices N the search
// over the layouts of N devices, and with --memo the memo for the one chosen (driver/plan/memo.cpp).
#include "driver/plan/search.hpp"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/base/error.hpp"
#include "driver/commands.hpp"

namespace loom {

std::vector<std::string> Variant::sets() const {
  std::vector<std::string> s = {"parallel.dp=" + std::to_string(dp), "parallel.tp=" + std::to_string(tp),
                                "parallel.pp=" + std::to_string(pp), "train.micro_batches=" + std::to_string(micro),
                                "zero.stage=" + std::to_string(zero), std::string("model.recompute=") + (recompute ? "true" : "false"),
                                "precision.dtype=" + precision};
  // Sequence parallelism is a tensor-parallel option; with tp = 1 the deck's own value stays.
  if (tp > 1) s.push_back(std::string("tensor.sequence_parallel=") + (sp ? "true" : "false"));
  s.insert(s.end(), extra.begin(), extra.end());
  return s;
}

std::string Variant::layout() const {
  return "dp " + std::to_string(dp) + " x tp " + std::to_string(tp) + " x pp " + std::to_string(pp);
}

std::string Variant::describe() const {
  std::string s = layout() + ", " + std::to_string(micro) + " micro-batch" + (micro == 1 ? "" : "es");
  if (zero) s += ", ZeRO " + std::to_string(zero);
  if (recompute) s += ", recompute";
  if (sp) s += ", sequence parallel";
  s += ", " + precision;
  for (const std::string& e : extra) s += ", " + e;
  return s;
}

std::string gib(double bytes) {
  std::ostringstream s;
  if (std::abs(bytes) < 1024.0 * 1024 * 1024) {  // below a GiB, in MiB
    s << std::fixed << std::setprecision(std::abs(bytes) >= 100.0 * (1 << 20) ? 0 : std::abs(bytes) >= 10.0 * (1 << 20) ? 1 : 2)
      << bytes / (1024.0 * 1024) << " MiB";
    return s.str();
  }
  s << std::fixed << std::setprecision(bytes >= 100.0 * (1 << 30) ? 0 : bytes >= 10.0 * (1 << 30) ? 1 : 2)
    << bytes / (1024.0 * 1024 * 1024) << " GiB";
  return s.str();
}

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

Candidate PlanSearch::evaluate(const Variant& v, bool every_rank) const {
  Candidate c;
  c.v = v;
  std::vector<std::string> sets = deck_sets;
  for (const std::string& s : v.sets()) sets.push_back(s);
  try {
    const Deck deck = load_deck(schema, deck_path, sets);
    c.p = predict(deck, registry, cluster, every_rank);
    c.built = true;
    c.over = c.p.peak_total - cluster.device_memory_bytes;
    c.fits = c.over <= 0;
    if (!c.fits) c.reason = "out of memory by " + gib(c.over) + " (rank " + std::to_string(c.p.worst_rank) + " needs " +
                            gib(c.p.peak_total) + ")";
  } catch (const InputError& e) {
    // The first clause says what does not divide or combine; the rest lists what would.
    std::string why = e.what();
    const std::size_t cut = why.find("; ");
    if (cut != std::string::npos) why.resize(cut);
    c.reason = why;
  }
  return c;
}

namespace {

std::vector<int> divisors_of(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

bool faster(const Candidate& a, const Candidate& b) {
  if (a.p.time.tokens_per_s != b.p.time.tokens_per_s) return a.p.time.tokens_per_s > b.p.time.tokens_per_s;
  return a.p.peak_total < b.p.peak_total;
}

}  // namespace

std::vector<Candidate> PlanSearch::run(int devices) const {
  const Deck base = load_deck(schema, deck_path, deck_sets);
  const int batch = static_cast<int>(base.get_int("train.batch"));
  const std::string own = base.get_string("precision.dtype");
  const std::vector<std::string> precisions = {"fp32", own == "fp16" ? "fp16" : "bf16"};
  std::vector<Candidate> out;
  for (int tp : divisors_of(devices))
    for (int pp : divisors_of(devices / tp)) {
      const int dp = devices / tp / pp;
      Variant v;
      v.dp = dp;
      v.tp = tp;
      v.pp = pp;
      // A layout whose batch does not split over dp is one rejection, not one per micro-batch count.
      std::vector<int> micros = batch % dp == 0 ? divisors_of(batch / dp) : std::vector<int>{1};
      // ZeRO shards over dp; stages 2 and 3 are refused with pipelines (zero.cpp says why).
      std::vector<int> zeros = {0};
      if (dp > 1) zeros = pp > 1 ? std::vector<int>{0, 1} : std::vector<int>{0, 1, 2, 3};
      for (int micro : micros)
        for (int zero : zeros)
          for (bool recompute : {false, true})
            for (const std::string& precision : precisions)
              for (bool sp : tp > 1 ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
                v.micro = micro;
                v.zero = zero;
                v.recompute = recompute;
                v.precision = precision;
                v.sp = sp;
                out.push_back(evaluate(v, false));
              }
    }
  // Fitting ones first, fastest first; then the rest as enumerated.
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    if (a.fits != b.fits) return a.fits;
    return a.fits && faster(a, b);
  });
  return out;
}

namespace {

// One line per dp x tp x pp: its best fitting variant, or why none fits (the smallest shortfall of
// memory, else the reason the layout cannot be built).
std::string layout_table(const std::vector<Candidate>& all) {
  std::map<std::tuple<int, int, int>, std::vector<const Candidate*>> by_layout;
  for (const Candidate& c : all) by_layout[{c.v.tp, c.v.pp, c.v.dp}].push_back(&c);
  std::ostringstream s;
  s << "every layout, its fastest variant that fits or why none does:\n";
  s << "     dp   tp   pp  variants fit  tokens/s   best variant, or why none fits\n";
  for (const auto& [key, list] : by_layout) {
    const Candidate& first = *list.front();
    int fit = 0;
    const Candidate* best = nullptr;
    const Candidate* closest = nullptr;
    for (const Candidate* c : list) {
      if (c->fits) {
        ++fit;
        if (!best || faster(*c, *best)) best = c;
      } else if (c->built && (!closest || c->over < closest->over)) {
        closest = c;
      }
    }
    s << "  " << std::setw(5) << first.v.dp << std::setw(5) << first.v.tp << std::setw(5) << first.v.pp << std::setw(9)
      << list.size() << std::setw(5) << fit;
    if (best) {
      s << std::setw(10) << fixed(best->p.time.tokens_per_s, 0) << "   " << best->v.describe() << "\n";
    } else if (closest) {
      s << std::setw(10) << "-" << "   out of memory by " << gib(closest->over) << " at the least (" << closest->v.describe()
        << ": " << gib(closest->p.peak_total) << ")\n";
    } else {
      s << std::setw(10) << "-" << "   " << first.reason << "\n";
    }
  }
  return s.str();
}

std::string candidate_row(int index, const Candidate& c, const ClusterSpec& cluster) {
  std::ostringstream s;
  const Variant& v = c.v;
  s << "  " << std::setw(3) << index << std::setw(5) << v.dp << std::setw(4) << v.tp << std::setw(4) << v.pp << std::setw(5)
    << v.micro << std::setw(5) << v.zero << std::setw(5) << (v.recompute ? "yes" : "no") << std::setw(4)
    << (v.tp > 1 ? (v.sp ? "yes" : "no") : "-") << std::setw(6) << v.precision;
  if (!c.built) return s.str() + "   " + c.reason + "\n";
  const TimePrediction& t = c.p.time;
  const double step_ms = t.step_s * 1e3;
  s << std::setw(11) << gib(c.p.peak_total) << std::setw(10) << fixed(step_ms, step_ms < 1 ? 4 : step_ms < 100 ? 2 : 1) << std::setw(11)
    << fixed(t.tokens_per_s, 0) << std::setw(6) << fixed(100 * t.mfu, 1) << std::setw(7) << fixed(t.bubble, 3)
    << std::setw(10) << fixed(t.comm_exposed_s * 1e3, 1);
  if (!c.fits) s << "   out of memory by " << gib(c.over);
  (void)cluster;
  return s.str() + "\n";
}

const char* kRowHeader =
    "    #   dp  tp  pp   mb zero  rec  sp  prec     memory   step ms   tokens/s  MFU% bubble exposed ms\n";

}  // namespace

std::string describe_search(const std::vector<Candidate>& all, int devices, const ClusterSpec& cluster, int top,
                            bool every) {
  std::ostringstream s;
  int fit = 0, built = 0;
  for (const Candidate& c : all) {
    fit += c.fits;
    built += c.built;
  }
  s << "search: " << devices << " devices of " << cluster.name << " (" << cluster.devices_per_node << " per node, "
    << gib(cluster.device_memory_bytes) << " each): " << all.size() << " candidates (dp x tp x pp, micro-batches, ZeRO "
    << "stage, recompute, sequence parallelism, precision), " << built << " buildable, " << fit << " fit\n";
  s << layout_table(all);
  if (fit == 0) {  // with nothing buildable, command_plan_deck says why (exit 2) instead
    if (built > 0) s << "no candidate fits: more devices, a smaller batch per micro-batch or a larger device\n";
  } else {
    s << "the fastest that fit, by predicted tokens/s (mb: micro-batches; memory: the largest rank's peak):\n" << kRowHeader;
    for (int i = 0; i < std::min(top, fit); ++i) s << candidate_row(i + 1, all[static_cast<std::size_t>(i)], cluster);
    s << "chosen: " << all.front().v.describe() << "\n";
  }
  if (every) {
    s << "every candidate:\n" << kRowHeader;
    for (std::size_t i = 0; i < all.size(); ++i) s << candidate_row(static_cast<int>(i + 1), all[i], cluster);
  }
  return s.str();
}

std::string search_json(const std::vector<Candidate>& all, int devices, const ClusterSpec& cluster) {
  nlohmann::json list = nlohmann::json::array();
  for (const Candidate& c : all) {
    nlohmann::json j = {{"dp", c.v.dp},         {"tp", c.v.tp},       {"pp", c.v.pp},
                        {"micro_batches", c.v.micro}, {"zero_stage", c.v.zero}, {"recompute", c.v.recompute},
                        {"sequence_parallel", c.v.sp}, {"precision", c.v.precision}, {"fits", c.fits},
                        {"reason", c.reason}};
    if (c.built) {
      j["mem_peak_bytes_total"] = static_cast<std::int64_t>(c.p.peak_total);
      j["step_ms"] = c.p.time.step_s * 1e3;
      j["tokens_per_s"] = c.p.time.tokens_per_s;
      j["mfu"] = c.p.time.mfu;
      j["bubble"] = c.p.time.bubble;
    }
    list.push_back(j);
  }
  nlohmann::json j = {{"devices", devices},
                      {"cluster", cluster.name},
                      {"device_memory_bytes", cluster.device_memory_bytes},
                      {"candidates", list},
                      {"chosen", !all.empty() && all.front().fits ? nlohmann::json(0) : nlohmann::json()}};
  return j.dump(2) + "\n";
}

int command_plan_deck(const PlanOptions& o, const StrategyRegistry& registry, const DeckSchema& schema,
                      const ClusterSpec& cluster) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (!o.memo.empty() && o.devices == 0)
    throw InputError("loom plan: --memo writes the memo of a layout search: give --devices N as well");
  if (o.devices > cluster.devices())
    throw InputError("loom plan: --devices " + std::to_string(o.devices) + " is more than the cluster's " +
                     std::to_string(cluster.nodes) + " node(s) x " + std::to_string(cluster.devices_per_node) +
                     " devices (" + cluster.origin + "); set cluster.nodes, or ask for at most " +
                     std::to_string(cluster.devices()));
  if (rank != 0) return 0;  // a plan is one process's arithmetic
  if (o.devices == 0) {
    const Deck deck = load_deck(schema, o.deck, o.sets);
    const Prediction p = predict(deck, registry, cluster);
    std::cout << (o.json ? prediction_json(p, cluster) : describe_prediction(p, cluster));
    return 0;
  }
  const PlanSearch search{registry, schema, o.deck, o.sets, cluster};
  const std::vector<Candidate> all = search.run(o.devices);
  std::cout << (o.json ? search_json(all, o.devices, cluster) : describe_search(all, o.devices, cluster, o.top, o.all));
  // No layout could even be built: the deck is wrong whatever the layout (a head count that does not
  // divide d_model, ...), or no layout of this many devices divides it (3 devices of a deck whose
  // batch, heads and layers 3 divides none of); more memory would not change either.
  if (std::none_of(all.begin(), all.end(), [](const Candidate& c) { return c.built; })) {
    std::map<std::string, int> reasons;
    for (const Candidate& c : all) ++reasons[c.reason];
    const auto most = std::max_element(reasons.begin(), reasons.end(),
                                       [](const auto& a, const auto& b) { return a.second < b.second; });
    throw InputError("loom plan: no layout of " + std::to_string(o.devices) + " devices can be built for " + o.deck +
                     (most == reasons.end() ? std::string() : ": " + most->first + " (" + std::to_string(most->second) +
                                                                  " of " + std::to_string(all.size()) + " candidates)"));
  }
  if (!o.memo.empty()) {
    if (all.empty() || !all.front().fits)
      throw InputError("loom plan --memo " + o.memo + ": no layout of " + std::to_string(o.devices) +
                       " devices fits; the memo needs one (see the table above)");
    write_memo(search, o, all);
  }
  return 0;
}

}  // namespace loom
