// `loom plan DECK`: the deck's own layout (driver/plan/predict.hpp), or with --devices N the search
// over the layouts of N devices, and with --memo the memo for the one chosen (driver/plan/memo.cpp).
#include "driver/plan/search.hpp"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/base/error.hpp"
#include "driver/commands.hpp"

namespace loom {

namespace {

std::vector<const PlanDimension*> by_column(const std::vector<PlanDimension>* dims) {
  std::vector<const PlanDimension*> out;
  if (dims)
    for (const PlanDimension& d : *dims) out.push_back(&d);
  std::stable_sort(out.begin(), out.end(),
                   [](const PlanDimension* a, const PlanDimension* b) { return a->column_order < b->column_order; });
  return out;
}

// The model's own dimension: recompute (model.recompute), searched beside the strategies'.
PlanDimension recompute_dimension() {
  PlanDimension d(Variant::kRecomputeKey, "recompute", "rec", 5, "recompute", PlanDimension::Json::boolean, "", 30, 30);
  d.values = [](const PlanPoint&) { return std::vector<std::string>{"false", "true"}; };
  d.describe = [](const std::string& v) { return v == "true" ? std::string("recompute") : std::string(); };
  return d;
}

}  // namespace

std::string Variant::get(const std::string& key) const {
  for (const auto& [k, value] : settings)
    if (k == key) return value;
  return "";
}

void Variant::set(const std::string& key, const std::string& value) {
  for (auto& [k, old] : settings)
    if (k == key) {
      old = value;
      return;
    }
  // In the nest order of the dimensions, so that the --set list reads the same however it was built.
  const auto rank = [&](const std::string& k) {
    int i = 0;
    if (dims)
      for (const PlanDimension& d : *dims) {
        if (d.key == k) return i;
        ++i;
      }
    return i;
  };
  auto it = settings.begin();
  while (it != settings.end() && rank(it->first) <= rank(key)) ++it;
  settings.insert(it, {key, value});
}

std::vector<std::string> Variant::sets() const {
  std::vector<std::string> s = {"parallel.dp=" + std::to_string(dp), "parallel.tp=" + std::to_string(tp),
                                "parallel.pp=" + std::to_string(pp), "train.micro_batches=" + std::to_string(micro)};
  if (cp > 1 || cp_searched) s.push_back("parallel.cp=" + std::to_string(cp));
  for (const auto& [key, value] : settings) s.push_back(key + "=" + value);
  s.insert(s.end(), extra.begin(), extra.end());
  return s;
}

std::string Variant::layout() const {
  return "dp " + std::to_string(dp) + (cp > 1 ? " x cp " + std::to_string(cp) : "") + " x tp " + std::to_string(tp) +
         " x pp " + std::to_string(pp);
}

std::string Variant::describe() const {
  std::string s = layout() + ", " + std::to_string(micro) + " micro-batch" + (micro == 1 ? "" : "es");
  for (const PlanDimension* d : by_column(dims)) {
    const std::string value = get(d->key);
    const std::string words = value.empty() || !d->describe ? std::string() : d->describe(value);
    if (!words.empty()) s += ", " + words;
  }
  for (const std::string& e : extra) s += ", " + e;
  return s;
}

PlanPoint Variant::point(const Deck* deck) const {
  PlanPoint p;
  p.layout.dp = dp;
  p.layout.tp = tp;
  p.layout.pp = pp;
  p.layout.cp = cp;
  p.micro = micro;
  p.settings.insert(settings.begin(), settings.end());
  p.deck = deck;
  return p;
}

PlanSearch::PlanSearch(const StrategyRegistry& r, const DeckSchema& s, std::string path, std::vector<std::string> sets,
                       ClusterSpec c)
    : registry(r), schema(s), deck_path(std::move(path)), deck_sets(std::move(sets)), cluster(std::move(c)) {
  dims.push_back(recompute_dimension());
  for (const auto& [name, info] : registry.all())
    for (const PlanDimension& d : info.plan.dimensions)
      if (d.values) dims.push_back(d);
  std::stable_sort(dims.begin(), dims.end(),
                   [](const PlanDimension& a, const PlanDimension& b) { return a.nest < b.nest; });
}

std::vector<const PlanDimension*> PlanSearch::columns() const { return by_column(&dims); }

Variant PlanSearch::normalise(Variant v, const Deck& base) const {
  v.dims = &dims;
  for (const PlanDimension& d : dims) {
    const std::vector<std::string> values = d.values(v.point(&base));
    const std::string now = v.get(d.key);
    if (values.empty()) {
      v.settings.erase(
          std::remove_if(v.settings.begin(), v.settings.end(), [&](const auto& kv) { return kv.first == d.key; }),
          v.settings.end());
    } else if (std::find(values.begin(), values.end(), now) == values.end()) {
      v.set(d.key, values.front());
    }
  }
  return v;
}

std::string PlanSearch::memo_text(const std::string& topic, const PlanPoint& p) const {
  std::string s;
  for (const auto& [name, info] : registry.all())
    if (info.plan.memo) s += info.plan.memo(topic, p);
  return s;
}

std::vector<PlanLever> PlanSearch::levers(const std::string& bottleneck, const PlanPoint& p) const {
  std::vector<PlanLever> out;
  for (const auto& [name, info] : registry.all())
    if (info.plan.levers)
      for (PlanLever& l : info.plan.levers(bottleneck, p)) out.push_back(std::move(l));
  return out;
}

std::string gib(double bytes) { return format_bytes(bytes, ByteStyle::planner); }

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
    if (!c.fits)
      c.reason = "out of memory by " + gib(c.over) + " (rank " + std::to_string(c.p.worst_rank) + " needs " +
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
  // Context parallelism is searched where sequences are long (kSearchCpFrom tokens, where Megatron-Core
  // and torchtitan turn it on) or where the deck already asks for it; each cp must cut seq_len into
  // 2 x cp chunks.
  const int seq_len = static_cast<int>(base.get_int("model.seq_len"));
  const bool search_cp = seq_len >= kSearchCpFrom || base.get_int("parallel.cp") > 1;
  std::vector<Candidate> out;
  // Every value of every dimension, outer dimensions first; one that has no values at a layout
  // leaves the deck's own.
  std::function<void(std::size_t, Variant&)> enumerate = [&](std::size_t i, Variant& v) {
    if (i == dims.size()) {
      out.push_back(evaluate(v, false));
      return;
    }
    const std::vector<std::string> values = dims[i].values(v.point(&base));
    if (values.empty()) return enumerate(i + 1, v);
    for (std::size_t k = 0; k < values.size(); ++k) {
      v.settings.push_back({dims[i].key, values[k]});
      v.departures += k > 0;
      enumerate(i + 1, v);
      v.departures -= k > 0;
      v.settings.pop_back();
    }
  };
  for (int tp : divisors_of(devices))
    for (int pp : divisors_of(devices / tp))
      for (int cp : divisors_of(devices / tp / pp)) {
        if (cp > 1 && (!search_cp || seq_len % (2 * cp) != 0)) continue;
        const int dp = devices / tp / pp / cp;
        Variant v;
        v.dims = &dims;
        v.dp = dp;
        v.tp = tp;
        v.pp = pp;
        v.cp = cp;
        v.cp_searched = search_cp;
        // A layout whose batch does not split over dp is one rejection, not one per micro-batch count.
        std::vector<int> micros = batch % dp == 0 ? divisors_of(batch / dp) : std::vector<int>{1};
        for (int micro : micros) {
          v.micro = micro;
          enumerate(0, v);
        }
      }
  // Fitting ones first, fastest first; then the rest as enumerated.
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    if (a.fits != b.fits) return a.fits;
    return a.fits && faster(a, b);
  });
  return out;
}

int chosen_index(const std::vector<Candidate>& all, double device_bytes) {
  if (all.empty() || !all.front().fits) return -1;
  const double floor = (1.0 - kSimplerWithin) * all.front().p.time.tokens_per_s;
  int best = 0;
  for (std::size_t i = 1; i < all.size() && all[i].fits && all[i].p.time.tokens_per_s >= floor; ++i)
    if (all[i].v.strategies() < all[static_cast<std::size_t>(best)].v.strategies() &&
        static_cast<double>(all[i].p.peak_total) <= (1.0 - kSimplerHeadroom) * device_bytes)
      best = static_cast<int>(i);
  return best;
}

namespace {

// One line per dp x tp x pp: its best fitting variant, or why none fits (the smallest shortfall of
// memory, else the reason the layout cannot be built).
bool any_cp(const std::vector<Candidate>& all) {
  for (const Candidate& c : all)
    if (c.v.cp > 1) return true;
  return false;
}

std::string layout_table(const std::vector<Candidate>& all) {
  std::map<std::tuple<int, int, int, int>, std::vector<const Candidate*>> by_layout;
  for (const Candidate& c : all) by_layout[{c.v.tp, c.v.pp, c.v.cp, c.v.dp}].push_back(&c);
  const bool cp = any_cp(all);  // a cp column only where the search tried context parallelism
  std::ostringstream s;
  s << "every layout, its fastest variant that fits or why none does:\n";
  s << "     dp" << (cp ? "   cp" : "") << "   tp   pp  variants fit  tokens/s   best variant, or why none fits\n";
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
    s << "  " << std::setw(5) << first.v.dp;
    if (cp) s << std::setw(5) << first.v.cp;
    s << std::setw(5) << first.v.tp << std::setw(5) << first.v.pp << std::setw(9) << list.size() << std::setw(5) << fit;
    if (best) {
      s << std::setw(10) << fixed(best->p.time.tokens_per_s, 0) << "   " << best->v.describe() << "\n";
    } else if (closest) {
      s << std::setw(10) << "-"
        << "   out of memory by " << gib(closest->over) << " at the least (" << closest->v.describe() << ": "
        << gib(closest->p.peak_total) << ")\n";
    } else {
      s << std::setw(10) << "-"
        << "   " << first.reason << "\n";
    }
  }
  return s.str();
}

// A dimension's cell: "-" where it does not apply, yes/no for a flag, else its value.
std::string cell(const PlanDimension& d, const Variant& v) {
  const std::string value = v.get(d.key);
  if (value.empty()) return "-";
  if (d.json_type == PlanDimension::Json::boolean) return value == "true" ? "yes" : "no";
  return value;
}

std::string candidate_row(int index, const Candidate& c, const std::vector<const PlanDimension*>& columns, bool cp) {
  std::ostringstream s;
  const Variant& v = c.v;
  s << "  " << std::setw(3) << index << std::setw(5) << v.dp;
  if (cp) s << std::setw(4) << v.cp;
  s << std::setw(4) << v.tp << std::setw(4) << v.pp << std::setw(5) << v.micro;
  for (const PlanDimension* d : columns) s << std::setw(d->width) << cell(*d, v);
  if (!c.built) return s.str() + "   " + c.reason + "\n";
  const TimePrediction& t = c.p.time;
  const double step_ms = t.step_s * 1e3;
  s << std::setw(11) << gib(c.p.peak_total) << std::setw(10)
    << fixed(step_ms, step_ms < 1     ? 4
                      : step_ms < 100 ? 2
                                      : 1)
    << std::setw(11) << fixed(t.tokens_per_s, 0) << std::setw(6) << fixed(100 * t.mfu, 1) << std::setw(7)
    << fixed(t.bubble, 3) << std::setw(10) << fixed(t.comm_exposed_s * 1e3, 1);
  if (!c.fits) s << "   out of memory by " << gib(c.over);
  return s.str() + "\n";
}

std::string row_header(const std::vector<const PlanDimension*>& columns, bool cp) {
  std::ostringstream s;
  s << "    #   dp" << (cp ? "  cp" : "") << "  tp  pp   mb";
  for (const PlanDimension* d : columns) s << std::setw(d->width) << d->column;
  s << "     memory   step ms   tokens/s  MFU% bubble exposed ms\n";
  return s.str();
}

nlohmann::json typed(const PlanDimension& d, const std::string& value) {
  if (value.empty()) return nlohmann::json();
  switch (d.json_type) {
    case PlanDimension::Json::integer:
      return std::stoll(value);
    case PlanDimension::Json::boolean:
      return value == "true";
    case PlanDimension::Json::text:
      break;
  }
  return value;
}

}  // namespace

std::string describe_search(const PlanSearch& search, const std::vector<Candidate>& all, int devices, int top,
                            bool every) {
  const ClusterSpec& cluster = search.cluster;
  const std::vector<const PlanDimension*> columns = search.columns();
  const bool cp = any_cp(all);
  const std::string header = row_header(columns, cp);
  std::ostringstream s;
  int fit = 0, built = 0;
  for (const Candidate& c : all) {
    fit += c.fits;
    built += c.built;
  }
  std::string varied = "dp x tp x pp, micro-batches";
  for (const PlanDimension* d : columns) varied += ", " + d->what;
  s << "search: " << devices << " devices of " << cluster.name << " (" << cluster.devices_per_node << " per node, "
    << gib(cluster.device_memory_bytes) << " each): " << all.size() << " candidates (" << varied << "), " << built
    << " buildable, " << fit << " fit\n";
  s << layout_table(all);
  if (fit == 0) {  // with nothing buildable, command_plan_deck says why (exit 2) instead
    if (built > 0) s << "no candidate fits: more devices, a smaller batch per micro-batch or a larger device\n";
  } else {
    s << "the fastest that fit, by predicted tokens/s (mb: micro-batches; memory: the largest rank's peak):\n"
      << header;
    const int c = chosen_index(all, cluster.device_memory_bytes);
    for (int i = 0; i < std::min(top, fit); ++i)
      s << candidate_row(i + 1, all[static_cast<std::size_t>(i)], columns, cp);
    if (c >= std::min(top, fit)) s << candidate_row(c + 1, all[static_cast<std::size_t>(c)], columns, cp);
    const Candidate& chosen = all[static_cast<std::size_t>(c)];
    s << "chosen: #" << c + 1 << " " << chosen.v.describe();
    if (c > 0)
      s << " (" << fixed(100.0 * (1.0 - chosen.p.time.tokens_per_s / all.front().p.time.tokens_per_s), 1)
        << "% below the fastest, #1, with fewer strategies on: the simplest within " << fixed(100 * kSimplerWithin, 0)
        << "% that leaves " << fixed(100 * kSimplerHeadroom, 0) << "% of the device free; the gap is within the "
        << "prediction's error)";
    s << "\n";
  }
  if (every) {
    s << "every candidate:\n" << header;
    for (std::size_t i = 0; i < all.size(); ++i) s << candidate_row(static_cast<int>(i + 1), all[i], columns, cp);
  }
  return s.str();
}

std::string search_json(const PlanSearch& search, const std::vector<Candidate>& all, int devices) {
  const ClusterSpec& cluster = search.cluster;
  const int chosen = chosen_index(all, cluster.device_memory_bytes);
  nlohmann::json list = nlohmann::json::array();
  for (const Candidate& c : all) {
    nlohmann::json j = {{"dp", c.v.dp},
                        {"cp", c.v.cp},
                        {"tp", c.v.tp},
                        {"pp", c.v.pp},
                        {"micro_batches", c.v.micro},
                        {"fits", c.fits},
                        {"reason", c.reason},
                        {"strategies", c.v.strategies()}};
    for (const PlanDimension& d : search.dims) {
      const std::string value = c.v.get(d.key);
      j[d.json] = typed(d, value.empty() ? d.unset : value);
    }
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
                      {"chosen", chosen >= 0 ? nlohmann::json(chosen) : nlohmann::json()}};
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
  std::cout << (o.json ? search_json(search, all, o.devices) : describe_search(search, all, o.devices, o.top, o.all));
  // No layout could even be built: the deck is wrong whatever the layout (a head count that does not
  // divide d_model, ...), or no layout of this many devices divides it (3 devices of a deck whose
  // batch, heads and layers 3 divides none of); more memory would not change either.
  if (std::none_of(all.begin(), all.end(), [](const Candidate& c) { return c.built; })) {
    std::map<std::string, int> reasons;
    for (const Candidate& c : all) ++reasons[c.reason];
    const auto most = std::max_element(reasons.begin(), reasons.end(),
                                       [](const auto& a, const auto& b) { return a.second < b.second; });
    throw InputError("loom plan: no layout of " + std::to_string(o.devices) + " devices can be built for " + o.deck +
                     (most == reasons.end() ? std::string()
                                            : ": " + most->first + " (" + std::to_string(most->second) + " of " +
                                                  std::to_string(all.size()) + " candidates)"));
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
