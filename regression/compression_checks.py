#!/usr/bin/env python3
"""Gradient compression (plugins/compression/): bytes against each method's formula, identical
replicas every step, and the final loss on the learning deck against uncompressed training.

    python3 regression/compression_checks.py --loom build/loom --workdir build/compression-checks CASE

CASE is one of:
  bytes_fp16_dp2, bytes_bf16_dp2, bytes_int8_dp2, bytes_topk_dp2, bytes_powersgd_dp2, bytes_int8_dp4,
  bytes_int8_zero2_dp2, bytes_bf16_zero3_dp2, bytes_topk_zero1_dp2, bytes_powersgd_zero1_dp2,
  bytes_topkwarmup_dp2, bytes_topkwarmup_zero1_dp2
      6 steps of the small deck; every step: the bytes this rank sent on the dp group during the
      gradient sync (compression_bytes) equal the method's formula (compression_formula_bytes) plus the
      loss's one-double all-reduce, 2(N-1)/N x 8 bytes, and nothing more; every dp rank holds the same
      parameters after the update (compression_replicas_identical = 1). The formulas, per bucket of n
      fp32 elements over N ranks (uncompressed: a ring all-reduce, 2(N-1)/N 4n bytes, or ZeRO's
      reduce-scatter, (N-1)/N 4n):
        fp16, bf16  half of the fp32 collective's bytes
        int8        2(N-1)/N 4 ceil(n/chunk) (the chunks' shared steps, an fp32 max all-reduce) + the
                    int8 collective's (N-1)/N n or 2(N-1)/N n
        topk        (N-1) 8k, k = ceil(ratio n): every rank's (int32 index, fp32 value) pairs all-gathered;
                    with compression.warmup_steps = W (topkwarmup: 6) the ratio of step t (from 0) is
                    ratio^(t/W), and the bucket's plain fp32 sum where pairs would cost as much
        powersgd    2(N-1)/N 4 (u + sum r_i (n_i + m_i)): the uncompressed tensors (u elements) and the
                    factors P [n_i, r_i] and Q [m_i, r_i] of each compressed matrix (r_i: compression.rank,
                    the vocabulary table's compression.embedding_rank), also against the sum from the
                    small deck's shapes (powersgd_textbook); the first
                    compression.start_step steps are plain fp32 (ratio 1, no matrix compressed)
      bytes_int8_zero2_dp2, bytes_bf16_zero3_dp2 compose int8 and bf16 with ZeRO-2/3's reduce-scatter
      of each unit's gradient pieces (at stage 3 the parameters are kept in shares, so there is no
      whole copy to compare: compression_replicas_identical is -1); bytes_topk_zero1_dp2 and
      bytes_powersgd_zero1_dp2 replace ZeRO-1's reduce-scatter, (N-1)/N 4n, by the method's sum (each
      rank keeps its share of it).
  learning_fp16, learning_bf16, learning_int8, learning_powersgd, learning_topk, learning_topkwarmup
      the learning deck (150 steps) at dp 2 against the same run uncompressed: the final validation
      loss within the method's margin (relative): fp16, bf16 0.5%; int8 1%; PowerSGD rank 4 (from
      step 11) 5%. Top-k keeping 1% with error feedback alone (learning_topk: momentum correction
      and local clipping off) reaches 11.3% above uncompressed at this length (the residual holds
      back most of each step's gradient; 2% reaches 3.5%, 5% 1.5%), so its margin is 15%;
      learning_topk and learning_powersgd also run without error feedback and require it to help:
      that run must end at least 3x further from uncompressed (measured 38.3% and 5.8%).
      learning_topkwarmup: top-k with its defaults (momentum correction, local clipping) and a
      30-step sparsity warm-up, within 5%, and at most a third of the gap of top-k without them.
  learning_powersgd_vocabulary
      PowerSGD at rank 2 on text (the GPL-3, bytes as tokens; 300 steps at dp 2, 3 seeds; the deck
      of bench/compression_learning.py), with the vocabulary table at its default rank (8) and at the
      blocks' rank 2 (PyTorch's hook): the mean over seeds of the last 20 steps' training loss against
      uncompressed, within 2.5% at the default (the benchmark's 5 seeds: 1.79%) and at most 0.7 of the
      gap at rank 2 (3.68%): the table's own rank is what halves PowerSGD's cost
  restart_int8_dp2, restart_topk_dp2, restart_powersgd_dp2
      saved at step 4 of 8 and resumed on the same layout: the error-feedback residuals (each rank's
      row of /plugins/compression/residual_dp2/<name>) and PowerSGD's Q come back, so steps 5..8 log
      bit for bit the losses of the uninterrupted run; without them (the same run resumed from a
      checkpoint written by uncompressed training at step 4 would differ) the case would fail
  restart_topkwarmup_dp2
      the same with a 6-step sparsity warm-up, resumed mid-warm-up (top-k's defaults checkpoint
      momentum correction's velocity too: leaving it out fails restart_topk_dp2)
  restart_topk_dp2_to_dp4
      a top-k checkpoint from dp 2 resumed at dp 4: the run says the residuals start from zero and
      trains on
  restart_powersgd_dp2_rank2
      a PowerSGD checkpoint (compression.rank = 4, compression.embedding_rank = 8) resumed at ranks 2
      and 4: the run says that Q starts from its initial draw, the blocks' and the vocabulary
      table's (their datasets are per rank), and trains on
  restart_int8_pp2_dp2
      the same with pipeline stages (4 ranks): the last stage's shadow of wte keeps its own residual
      (".../wte.weight#head"), so both stages' state comes back and steps 5..8 are bit for bit
  restart_int8_zero2_dp2
      the same with ZeRO-2 and 2 micro-batches, whose reduce-scatters compress pieces of the units'
      gradients: each piece's residual is the part of its tensors' per-tensor residuals it covers, so
      they are saved and come back as the others (they were once kept per piece and not saved)
  restart_int8_zero2_bf16_dp2
      the same in bf16, where ZeRO-2 keeps the tensors the model reads in fp32 whole and reduces
      them in buckets of their own after the last backward: their residuals come back too
  restart_int8_zero3_dp2
      the same with ZeRO-3, whose tied wte and tensors under zero.param_persistence_threshold (1000
      here: the LayerNorms and biases) are kept whole
  nonfinite_skip_int8_dp2, nonfinite_skip_topk_dp2, nonfinite_skip_powersgd_dp2
      a NaN in one rank's weights at step 4 (LOOM_INJECT_FAULT where=nan) with train.on_nonfinite =
      skip: the compressed sum is non-finite on every rank (int8 agrees on it with the chunk maxima,
      top-k sends NaNs), so step 4 is skipped everywhere; the residuals and Q start afresh
      (compression_state_resets = 1) and every later step is finite, and the checkpoints at steps 5
      and 10 are written (nothing non-finite is left in the compression state)
  link_no_false_stall
      an emulated link so slow (0.0002 Gbit/s) that one ring step of the gradient all-reduce waits over 2 s for it, with run.comm_timeout =
      1: the watchdog does not count the link's time as a stall; the run finishes and the banner says
      the link is emulated
Standard library only.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

METHOD_SETS = {
    "fp16": ["compression.method=fp16"],
    "bf16": ["compression.method=bf16"],
    "int8": ["compression.method=int8"],
    "topk": ["compression.method=topk", "compression.ratio=0.01"],
    # Sparsity warm-up over 6 steps at dp 2: step 1 summed whole (fraction 1), then 0.01^(t/6) as pairs
    # (0.46, 0.22, ...), 0.01 from step 7; a restart at step 4 resumes mid-warm-up.
    "topkwarmup": ["compression.method=topk", "compression.ratio=0.01", "compression.warmup_steps=6"],
    # The vocabulary table (wte, 64 x 32) at its own rank 8, the blocks' matrices at 4: both in one bucket.
    "powersgd": ["compression.method=powersgd", "compression.rank=4", "compression.embedding_rank=8",
                 "compression.start_step=2"],
}
# Top-k as it was (every technique off: error feedback alone), and with its defaults (momentum
# correction, local clipping) and a sparsity warm-up.
TOPK_PLAIN = ["compression.momentum_correction=false", "compression.local_clip=0"]
LEARN_SETS = dict(METHOD_SETS, powersgd=["compression.method=powersgd", "compression.rank=4", "compression.start_step=10"],
                  topk=METHOD_SETS["topk"] + TOPK_PLAIN,
                  topkwarmup=["compression.method=topk", "compression.ratio=0.01", "compression.warmup_steps=30"])
MARGIN = {"fp16": 0.005, "bf16": 0.005, "int8": 0.01, "powersgd": 0.05, "topk": 0.15, "topkwarmup": 0.05}


def learning_deck():
    case = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases", "learns_synthetic.json")))
    return "\n".join(case["deck"]) + "\n"


def powersgd_textbook(ranks, d=32, layers=2, vocab=64, seq=16, rank=4, vocab_rank=8):
    """PowerSGD's bytes a step for the small deck, 2(N-1)/N 4 (u + sum r_i (n_i + m_i)), from its shapes:
    every matrix is worth compressing there (n m / ((n + m) r) >= 2), the vocabulary table at its own rank."""
    mats = [(seq, d, rank), (vocab, d, vocab_rank)] + layers * [(3 * d, d, rank), (d, d, rank), (4 * d, d, rank),
                                                                (d, 4 * d, rank)]
    vectors = layers * (2 * d + 3 * d + d + 2 * d + 4 * d + d) + 2 * d  # LayerNorms and biases; the final LayerNorm
    return 2.0 * (ranks - 1) / ranks * 4 * (vectors + sum(r * (n + m) for n, m, r in mats))


def bytes_case(c, method, ranks, extra):
    _, run = c.loom(method, ranks, ["parallel.dp=%d" % ranks] + METHOD_SETS[method] + extra)
    rows = common.rows(run)
    c.check(len(rows) == 6, "%d metrics rows, expected 6" % len(rows))
    loss_bytes = 2.0 * (ranks - 1) / ranks * 8
    start = 2 if method == "powersgd" else 0
    for r in rows:
        sent, formula = r["compression_bytes"], r["compression_formula_bytes"]
        print("step %d: sent %d bytes, formula %d + loss %g, uncompressed %d (ratio %.4f, formula %.4f), "
              "compressed matrices %d, replicas identical %g"
              % (r["step"], sent, formula, loss_bytes, r["compression_uncompressed_bytes"], r["compression_ratio"],
                 r["compression_formula_ratio"], r["compression_compressed_tensors"], r["compression_replicas_identical"]))
        c.check(abs(sent - formula - loss_bytes) <= 8 * (ranks - 1),
                "step %d: sent %d bytes, the formula gives %d + %g" % (r["step"], sent, formula, loss_bytes))
        # ZeRO-3 keeps parameters in shares: nothing whole to compare (-1)
        want = -1 if "zero.stage=3" in extra else 1
        c.check(r["compression_replicas_identical"] == want, "step %d: the dp ranks' parameters differ" % r["step"])
        if method == "powersgd" and not extra and r["step"] > start:
            want = powersgd_textbook(ranks)
            c.check(abs(r["compression_formula_bytes"] - want) < 1e-6 * want,
                    "step %d: PowerSGD's formula %d bytes, the textbook's %d" % (r["step"], r["compression_formula_bytes"], want))
        if method == "powersgd":
            plain = r["step"] <= start
            c.check((r["compression_compressed_tensors"] == 0) == plain,
                    "step %d: %d matrices compressed, expected %s" % (r["step"], r["compression_compressed_tensors"],
                                                                    "none (plain fp32 first)" if plain else "some"))
            if plain:
                c.check(abs(r["compression_formula_ratio"] - 1) < 1e-12, "step %d: not plain fp32" % r["step"])
    if method == "topkwarmup":  # whole at step 1, pairs of a falling fraction, then plain top-k's 0.02
        ratios = [r["compression_formula_ratio"] for r in rows]
        print("formula ratios by step: %s" % ["%.4f" % x for x in ratios])
        c.check(abs(ratios[0] - 1) < 1e-12, "step 1 was not summed whole: formula ratio %r" % ratios[0])
        # Pairs: 8k bytes against the fp32 sum's 2 (N-1)/N 4n = 4n at dp 2 (ZeRO's reduce-scatter: 2n);
        # summed whole wherever pairs would cost as much.
        factor = 4 if extra else 2
        for t in range(1, len(ratios)):
            want = factor * 0.01 ** (min(t, 6) / 6.0)
            want = 1.0 if want >= 1 else want
            c.check(abs(ratios[t] - want) <= 0.01 * want + 1e-3, "step %d: formula ratio %.4f, the warm-up's %d x 0.01^(%d/6) = %.4f"
                    % (t + 1, ratios[t], factor, t, want))
    want_ratio = {"fp16": 0.5, "bf16": 0.5}.get(method)
    if want_ratio:
        c.check(all(abs(r["compression_formula_ratio"] - want_ratio) < 1e-12 for r in rows), "the 16-bit formula is not half")


def learning_benchmark():
    """bench/compression_learning.py (the learning benchmark): its deck and PowerSGD's settings."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import compression_learning  # noqa: E402
    return compression_learning


def powersgd_vocabulary(args, name):
    bench = learning_benchmark()
    c = common.Case(args, name, bench.DECK.format(text="/usr/share/common-licenses/GPL-3", steps=300))
    psgd = bench.POWERSGD  # rank 2 from step 11
    configs = {"none": [], "default": psgd, "vocab_rank2": psgd + ["compression.embedding_rank=2"]}
    gaps = {"default": [], "vocab_rank2": []}
    for seed in (1, 2, 3):
        last = {}
        for tag, sets in configs.items():
            _, run = c.loom("%s_s%d" % (tag, seed), 2, ["parallel.dp=2", "train.seed=%d" % seed] + sets)
            rows = common.rows(run)
            c.check(len(rows) == 300, "%s seed %d: %d metrics rows, expected 300" % (tag, seed, len(rows)))
            if tag != "none":
                c.check(all(r.get("compression_replicas_identical") == 1 for r in rows), "the dp ranks' parameters differed")
            last[tag] = sum(r["loss"] for r in rows[-20:]) / 20
        for tag in gaps:
            gaps[tag].append(last[tag] / last["none"] - 1)
        print("seed %d: last 20 steps' loss %s" % (seed, {k: round(v, 4) for k, v in last.items()}))
    mean = {k: sum(v) / len(v) for k, v in gaps.items()}
    print("mean gap to uncompressed: vocabulary table at rank 8 %+.2f%%, at rank 2 %+.2f%%"
          % (100 * mean["default"], 100 * mean["vocab_rank2"]))
    c.check(mean["default"] <= 0.025, "PowerSGD rank 2 ends %.2f%% above uncompressed, bound 2.5%%" % (100 * mean["default"]))
    c.check(mean["default"] <= 0.7 * mean["vocab_rank2"],
            "the vocabulary table's rank did not help: %.2f%% against %.2f%% at rank 2"
            % (100 * mean["default"], 100 * mean["vocab_rank2"]))
    return c.done(name)


def main():
    args = common.case_arguments(__doc__)
    name = args.case

    if name.startswith("bytes_"):
        c = common.Case(args, name, common.small_deck(steps=6, log_every=1))
        parts = name.split("_")
        method, ranks = parts[1], int(parts[-1][2:])
        zero = [p for p in parts if p.startswith("zero")]
        extra = ["zero.stage=" + zero[0][4:]] if zero else []
        bytes_case(c, method, ranks, extra)
        return c.done(name)

    if name == "learning_powersgd_vocabulary":
        return powersgd_vocabulary(args, name)

    if name.startswith("learning_"):
        method = name.split("_", 1)[1]
        c = common.Case(args, name, learning_deck())
        _, ref = c.loom("none", 2, ["parallel.dp=2"])
        _, run = c.loom(method, 2, ["parallel.dp=2"] + LEARN_SETS[method])
        base, got = common.summary(ref)["final_val_loss"], common.summary(run)["final_val_loss"]
        gap = got / base - 1
        print("final validation loss: %s %.6f, uncompressed %.6f: %+.2f%% (margin %.1f%%), bytes ratio %.4f"
              % (method, got, base, 100 * gap, 100 * MARGIN[method], common.rows(run)[-1]["compression_ratio"]))
        c.check(abs(gap) <= MARGIN[method], "%s ends %.2f%% from uncompressed, margin %.1f%%" % (method, 100 * gap, 100 * MARGIN[method]))
        c.check(all(r.get("compression_replicas_identical") == 1 for r in common.rows(run)), "the dp ranks' parameters differed")
        if method == "topkwarmup":  # the techniques must be what closes the gap
            _, plain = c.loom("topk_plain", 2, ["parallel.dp=2"] + METHOD_SETS["topk"] + TOPK_PLAIN)
            plain_gap = common.summary(plain)["final_val_loss"] / base - 1
            print("top-k without the techniques: %+.2f%%" % (100 * plain_gap))
            c.check(plain_gap >= 3 * gap, "the techniques did not help: %.2f%% with them, %.2f%% without" % (100 * gap, 100 * plain_gap))
        if method in ("topk", "powersgd"):
            _, raw = c.loom(method + "_no_feedback", 2, ["parallel.dp=2"] + LEARN_SETS[method] + ["compression.error_feedback=false"])
            raw_gap = common.summary(raw)["final_val_loss"] / base - 1
            print("without error feedback: %+.2f%%" % (100 * raw_gap))
            c.check(raw_gap >= 3 * gap, "error feedback did not help: %.2f%% with it, %.2f%% without" % (100 * gap, 100 * raw_gap))
        return c.done(name)

    if name.startswith("nonfinite_skip_"):
        method = name.split("_")[2]
        deck = common.small_deck(steps=10, log_every=1) + "[checkpoint]\nevery = 5\n"
        c = common.Case(args, name, deck)
        sets = ["parallel.dp=2", "train.on_nonfinite=skip"] + METHOD_SETS[method]
        if method == "powersgd":
            sets = [x for x in sets if not x.startswith("compression.start_step")] + ["compression.start_step=0"]
        _, run = c.loom(method, 2, sets, env={"LOOM_INJECT_FAULT": "rank=1,step=3,where=nan"})
        rows = common.rows(run)
        print("(step, loss, skipped, resets): %s" % [(r["step"], r["loss"], r.get("skipped", False),
                                                      r.get("compression_state_resets")) for r in rows])
        c.check([r["step"] for r in rows if r.get("skipped")] == [4], "the skipped steps are not exactly [4]")
        c.check(all(r["loss"] is not None and r["loss"] == r["loss"] for r in rows if r["step"] > 4),
                "a step after the skipped one was not finite: the compression state kept the NaN")
        c.check(rows and rows[-1].get("compression_state_resets") == 1, "the compression state was not reset once")
        ck = os.path.join(run, "checkpoints")
        c.check(os.path.exists(os.path.join(ck, "ckpt-00000010.h5")), "no checkpoint at step 10")
        return c.done(name)

    if name == "link_no_false_stall":
        c = common.Case(args, name, common.small_deck(steps=3, log_every=1))
        p, run = c.loom("slow", 2, ["parallel.dp=2", "compression.method=int8", "run.emulate_link_gbps=0.0002",
                                     "run.comm_timeout=1"])
        c.expect(p.stdout, [r"link    : EMULATED, 0\.0002 Gbit/s per rank"], "the banner")
        steps = [r["step_ms"] for r in common.rows(run)]
        print("step times with the emulated link: %s ms (run.comm_timeout = 1 s)" % steps)
        c.check(len(steps) == 3 and max(steps) > 1000, "the steps did not wait over a second for the link")
        return c.done(name)

    if name.startswith("restart_"):
        method = name.split("_")[1]
        c = common.Case(args, name, common.small_deck(steps=8, log_every=1))
        sets = ["parallel.dp=2"] + METHOD_SETS[method]
        ranks = 2
        if "pp2" in name:
            sets += ["parallel.pp=2", "train.micro_batches=2"]
            ranks = 4
        if "zero2" in name or "zero3" in name:
            sets += ["zero.stage=" + name.split("zero")[1][0], "train.micro_batches=2"]
        if "zero3" in name:  # LayerNorms and biases kept whole, beside the tied wte
            sets += ["zero.param_persistence_threshold=1000"]
        if "bf16" in name:  # ZeRO-2 keeps the tensors the model reads in fp32 whole: their own buckets
            sets += ["precision.dtype=bf16"]
        _, full = c.loom("full", ranks, sets + ["checkpoint.every=4", "checkpoint.keep=5"])
        ckpt = os.path.join(full, "checkpoints", "ckpt-00000004.h5")
        if name.endswith("_rank2"):  # PowerSGD resumed at another compression.rank: told that Q starts afresh
            p, resumed = c.loom("resumed_rank2", ranks, sets + ["compression.rank=2", "compression.embedding_rank=4",
                                                                "checkpoint.resume=" + ckpt])
            c.expect(p.stdout, [r"compression: the checkpoint's PowerSGD Q has compression\.rank = 4: at compression\.rank = 2 "
                                r"Q starts from its initial draw",
                                r"compression: the checkpoint's PowerSGD Q of the vocabulary tables has rank 8: at rank 4 "
                                r"\(compression\.embedding_rank\) their Q starts from its initial draw"],
                     "the notes on other PowerSGD ranks")
            c.check([r["step"] for r in common.rows(resumed)] == [5, 6, 7, 8], "the rank 2 run did not go on from step 5")
            return c.done(name)
        if name.endswith("to_dp4"):
            p, resumed = c.loom("resumed_dp4", 4, ["parallel.dp=4"] + METHOD_SETS[method] + ["checkpoint.resume=" + ckpt])
            c.expect(p.stdout, [r"compression: the checkpoint was written at 2 data-parallel ranks \(dp x cp\): "
                                r"error-feedback residuals \(one per rank\) start from zero at 4"],
                     "the note on another dp size")
            c.check([r["step"] for r in common.rows(resumed)] == [5, 6, 7, 8], "the dp 4 run did not go on from step 5")
            return c.done(name)
        p, resumed = c.loom("resumed", ranks, sets + ["checkpoint.resume=" + ckpt])
        c.check("starts from its initial draw" not in p.stdout, "a note that Q starts afresh at the same ranks")
        ref = {r["step"]: r["loss"] for r in common.rows(full)}
        got = {r["step"]: r["loss"] for r in common.rows(resumed)}
        print("steps 5..8, resumed: %s; uninterrupted: %s" % ([got.get(k) for k in range(5, 9)], [ref[k] for k in range(5, 9)]))
        c.check(sorted(got) == [5, 6, 7, 8], "the resumed run logged steps %s" % sorted(got))
        c.check(all(got.get(k) == ref[k] for k in range(5, 9)), "the resumed losses are not bit for bit the uninterrupted run's")
        return c.done(name)

    sys.exit("unknown case " + name)


if __name__ == "__main__":
    sys.exit(main())
