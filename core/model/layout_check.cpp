#include "core/model/layout_check.hpp"

#include <numeric>
#include <sstream>

#include "core/base/error.hpp"

namespace loom {

namespace {

std::string s(long v) { return std::to_string(v); }

}  // namespace

void check_context_layout(const Layout& l, const GPTConfig& m) {
  if (l.cp < 1) throw InputError("parallel.cp = " + s(l.cp) + " must be at least 1");
  if (l.cp == 1) return;
  // Each rank holds chunks i and 2cp-1-i of every sequence (the causal load balance).
  if (m.seq_len % (2 * l.cp) != 0) {
    std::string fit;
    for (int c = 1; 2 * c <= m.seq_len; ++c)
      if (m.seq_len % (2 * c) == 0) fit += (fit.empty() ? "" : ", ") + s(c);
    throw InputError("parallel.cp = " + s(l.cp) + " does not split model.seq_len = " + s(m.seq_len) +
                     " into 2 x cp = " + s(2 * l.cp) + " chunks (each rank holds chunks i and 2cp-1-i); cp sizes " +
                     "that work: " + fit);
  }
  if (m.llama())
    throw InputError("parallel.cp = " + s(l.cp) + " with model.arch = llama: rotary positions are not yet given " +
                     "their global positions under context parallelism; use model.arch = gpt2, or parallel.cp = 1");
  if (m.experts > 0)
    throw InputError("parallel.cp = " + s(l.cp) + " with model.experts = " + s(m.experts) +
                     ": the experts' capacity and load-balancing loss are per sequence, and a cp rank holds only " +
                     "part of each; use parallel.cp = 1 (or parallel.dp for more ranks)");
  if (m.attention == "cudnn")
    throw InputError("parallel.cp = " + s(l.cp) + " with model.attention = cudnn: cuDNN's attention cannot take " +
                     "part in the ring (it neither merges a running output nor attends to another rank's keys); " +
                     "use model.attention = unfused, flash or auto, or parallel.cp = 1");
}

void check_layout(const Layout& l, int world, const GPTConfig& m, int batch, int micro) {
  if (l.ranks() != world) {
    std::ostringstream msg;
    if (l.cp > 1)
      msg << "parallel.dp x parallel.cp x parallel.tp x parallel.pp = " << l.dp << " x " << l.cp << " x " << l.tp
          << " x " << l.pp << " = " << l.ranks();
    else
      msg << "parallel.dp x parallel.tp x parallel.pp = " << l.dp << " x " << l.tp << " x " << l.pp << " = "
          << l.ranks();
    msg << ", but the job has " << world << " MPI rank" << (world == 1 ? "" : "s") << "; either launch with mpirun -n "
        << l.ranks() << ", or choose a layout whose product is " << world;
    // Suggest the dp that fills the job with the deck's tp and pp, when the batch splits over it.
    const int tp_pp = l.tp * l.pp * l.cp;
    if (world % tp_pp == 0) {
      const int dp_fit = world / tp_pp;
      if (batch % (dp_fit * micro) == 0) msg << " (e.g. parallel.dp = " << dp_fit << ")";
    }
    throw InputError(msg.str());
  }
  // tp splits heads, channels and the vocabulary: it must divide all three.
  const long tp_ok = std::gcd(std::gcd(m.heads, m.d_model), m.vocab);
  if (m.heads % l.tp != 0)
    throw InputError("parallel.tp = " + s(l.tp) + " does not divide model.heads = " + s(m.heads) +
                     "; tp sizes that work: " + divisors(tp_ok));
  if (m.d_model % l.tp != 0)
    throw InputError("parallel.tp = " + s(l.tp) + " does not divide model.d_model = " + s(m.d_model) +
                     "; tp sizes that work: " + divisors(tp_ok));
  if (m.vocab % l.tp != 0)
    throw InputError("parallel.tp = " + s(l.tp) + " does not divide model.vocab = " + s(m.vocab) +
                     " (the token embedding is split by vocabulary); tp sizes that work: " + divisors(tp_ok));
  if (m.ffn() % l.tp != 0)
    throw InputError("parallel.tp = " + s(l.tp) + " does not divide the MLP's width " + s(m.ffn()) +
                     (m.llama() ? " (model.ffn_hidden)" : " (4 x model.d_model)") +
                     "; tp sizes that work: " + divisors(std::gcd(tp_ok, static_cast<long>(m.ffn()))));
  if (m.experts > 0 && m.expert_ffn() % l.tp != 0)
    throw InputError(
        "parallel.tp = " + s(l.tp) + " does not divide an expert's width " + s(m.expert_ffn()) +
        " (model.moe_ffn_hidden); tp sizes that work: " + divisors(std::gcd(tp_ok, static_cast<long>(m.expert_ffn()))));
  if (l.pp > m.layers)
    throw InputError("parallel.pp = " + s(l.pp) + " is more stages than model.layers = " + s(m.layers) +
                     "; pp sizes that work: 1 .. " + s(m.layers));
  check_context_layout(l, m);
  if (l.ep < 1) throw InputError("parallel.ep = " + s(l.ep) + " must be at least 1");
  if (l.ep > 1) {
    if (m.experts == 0)
      throw InputError("parallel.ep = " + s(l.ep) +
                       " splits experts over ranks, and model.experts = 0: set model.experts");
    if (l.replicas() % l.ep != 0)
      throw InputError(
          "parallel.ep = " + s(l.ep) + " does not divide parallel.dp = " + s(l.dp) +
          " (the experts split over groups of ep data-parallel ranks); ep sizes that work: " + divisors(l.replicas()));
    if (m.experts % l.ep != 0)
      throw InputError("parallel.ep = " + s(l.ep) + " does not divide model.experts = " + s(m.experts) +
                       " (each expert-parallel rank holds experts / ep of them); ep sizes that work: " +
                       divisors(std::gcd(static_cast<long>(m.experts), static_cast<long>(l.replicas()))));
  }
  if (batch % (l.dp * micro) != 0) {
    std::ostringstream msg;
    msg << "train.batch = " << batch << " does not split into parallel.dp = " << l.dp
        << " ranks x train.micro_batches = " << micro << " micro-batches (" << l.dp * micro << " must divide it)";
    if (batch % l.dp == 0) msg << "; micro_batches that work with this dp: " << divisors(batch / l.dp);
    // A dp works when each rank's share of the batch still splits into the micro-batches.
    if (batch % micro == 0)
      msg << "; dp sizes that work with train.micro_batches = " << micro << ": " << divisors(batch / micro);
    else if (batch % l.dp == 0)
      msg << "; no dp works with train.micro_batches = " << micro << " (it does not divide train.batch)";
    else
      msg << "; no dp works with train.micro_batches = " << micro
          << " (it does not divide train.batch); micro_batches that do: " << divisors(batch);
    throw InputError(msg.str());
  }
}

}  // namespace loom
