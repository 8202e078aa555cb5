#!/usr/bin/env python3
"""Mixed precision: fp16 loss scaling as a run shows it, and checkpoints across precisions.

    python3 regression/precision_checks.py --loom build/loom --workdir build/precision-checks CASE

CASE is one of:
  fp16_overflow_backoff  fp16 from a scale that overflows at once (2^32, Megatron's initial scale) on the
                         learning deck, the scale growing after 10 clean steps: the first steps are
                         skipped and named, and every step's logged scale is exactly what the dynamic
                         rule (hysteresis 2, back-off 0.5, growth 2 after the window) gives from the
                         run's own overflow pattern; then the loss falls like fp32's: the final loss
                         within fp16_final_tol (5%, relative) of the fp32 run's, the same deck
  fp16_overflow_one_rank ZeRO-2 at dp = 2, fp16: an inf in rank 1's gradient share after the sync
                         (LOOM_INJECT_FAULT where=overflow) is an overflow on that rank only; the step is
                         skipped on both ranks (the curve equals one process skipping the same step,
                         within fp16's u = 2^-11), the run goes on and finishes
  reduce_bf16_dp2, reduce_bf16_zero2_dp2
                         bf16 with precision.reduce_dtype = bf16 at dp 2 (and ZeRO-2): every step's
                         gradient collective sends half the bytes of the fp32 one: the measured ratio to
                         the fp32 textbook volume is 0.5, within 1% (ZeRO-2: its parameter all-gather is
                         of the 16-bit copies, the fp32 masters being sharded, but the W = P - S elements
                         the model reads in fp32 are all-gathered in fp32 after their sharded update, so
                         the ratio is (4P + 2W) / 8P = 0.5 + W/4P; from step 2 on, the first step also
                         carries the gather that makes the copies after initialisation); the loss curve
                         equals bf16 on one process within bf16's u = 2^-9
  checkpoint_bf16_to_fp32, checkpoint_fp32_to_bf16
                         saved at step 4 of 8 in one precision, resumed in the other: the file holds
                         fp32 master weights, so steps 5..8 follow the uninterrupted run within bf16's
                         u = 2^-9 (relative)
  memory_bf16, memory_bf16_tp2_sp
                         the ledger of a bf16 run against the fp32 run of the same small deck (L = 2,
                         C = 32, V = 64, N = 8 x 16 rows), byte for byte: params (the store's 16-bit
                         compute copies of the matrix weights) = 2 x (12 L C^2 + V C) / tp; master (the
                         fp32 parameters) = the fp32 run's params; gradients and AdamW unchanged; the
                         activations smaller by 2 bytes per element saved in 16 bits instead of fp32 (the
                         products' inputs ln1, atty, ln2, fch_gelu of every block and the head's lnf):
                         2 N C (7 L + 1) at one rank; with tp 2 and sequence parallelism ln1, ln2 and lnf
                         are gathered in fp32 and stay fp32, so 2 N (C + 4C) / tp L per rank; the fc
                         product's dout scratch [N, 4C/tp] in 16 bits saves 2 N 4C / tp more, and the
                         classifier's 16-bit dlogits table [N, V/tp] beside the shared fp32 logits (one
                         table, logits then dlogits in place, in an fp32 run) costs 2 N V / tp
  memory_bf16_zero2_dp2  ZeRO-2 at dp 2 in bf16 shards the fp32 masters too: of the S = 12 L C^2 elements of
                         the block matrices each rank keeps the fp32 master of its share S/N, and the
                         whole 16-bit copy S (plus wte's, 2 V C bytes); the W = P - S elements the model
                         reads in fp32 (LayerNorm, biases, positions, wte) stay whole on every rank, but
                         each rank updates only its share of them, so AdamW's state is sharded whole
                         (as DeepSpeed's): master = 4 (S/N + W), AdamW = 8 P/N, params = 2 S + 2 V C,
                         byte for byte
  memory_bf16_zero1_dp2  the same at ZeRO-1 (gradients whole): the fp32 masters are this rank's share of the
                         flat range and the whole tensors, master = 4 (P/N + W), AdamW = 8 P/N; the 16-bit
                         copy is of the whole flat range, params = 2 P + 2 V C
  checkpoint_bf16_zero2_dp2, checkpoint_bf16_zero1_dp2
                         bf16 ZeRO-2 (and ZeRO-1) at dp 2 (fp32 masters sharded, 16-bit copies whole), saved at step 4
                         and resumed: steps 5..8 bit for bit
  nonfinite_skip_bf16    bf16, one weight element NaN for step 3's forward and backward (LOOM_INJECT_FAULT
                         where=nan) with train.on_nonfinite = skip: the 16-bit compute copies see the
                         poison and then its removal, so step 3 alone is skipped and every later step is
                         finite (a copy left holding the NaN would poison every later step)
  nonfinite_skip_bf16_zero1_dp2, nonfinite_skip_bf16_zero2_dp2
                         the same on rank 1 of bf16 ZeRO-1 (ZeRO-2) at dp 2, whose first owned slice is
                         a matrix's fp32 master share that no forward reads: the poison goes into a
                         tensor the forward reads from the store's fp32 values, so step 3 is skipped on
                         both ranks, and only step 3
  checkpoint_fp16_scale  fp16, the scale growing every 2 clean steps, saved at step 4 and resumed: the
                         loss scale and its counters come back, so steps 5..8 log the same scales and,
                         bit for bit, the same losses as the uninterrupted run
Standard library only.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

U_BF16, U_FP16 = 2.0 ** -9, 2.0 ** -11
FP16_FINAL_TOL = 0.05


def learning_deck():
    case = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases", "learns_synthetic.json")))
    return "\n".join(case["deck"]) + "\n"


def expected_scales(skipped, initial, window, hysteresis, backoff=0.5, growth=2.0, min_scale=1.0):
    """The scale each step runs with under the dynamic rule, given which steps overflowed."""
    scale, tracker, hyst, out = initial, 0, hysteresis, []
    for overflow in skipped:
        out.append(scale)
        if overflow:
            tracker = 0
            hyst -= 1
            if hyst <= 0:
                hyst = 0
                scale = max(scale * backoff, min_scale)
        else:
            tracker += 1
            if tracker == window:
                tracker = 0
                hyst = hysteresis
                scale *= growth
    return out


def compare(c, got, ref, tol, what):
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got, ref)) if got else 0.0
    print("%s: %d steps, worst relative error %.3g (tolerance %.3g)" % (what, len(got), worst, tol))
    c.check(len(got) == len(ref) and worst <= tol, "%s: worst relative error %.3g above %.3g (or %d steps, expected %d)"
            % (what, worst, tol, len(got), len(ref)))


def main():
    args = common.case_arguments(__doc__)
    name = args.case

    if name == "fp16_overflow_backoff":
        c = common.Case(args, name, learning_deck())
        window = 10
        p16, run = c.loom("fp16", 1, ["precision.dtype=fp16", "precision.initial_scale_power=32",
                                      "precision.loss_scale_window=%d" % window, "train.log_every=1"])
        _, ref = c.loom("fp32", 1, [])
        rows = common.rows(run)
        skipped = [bool(r.get("skipped")) for r in rows]
        scales = [r["loss_scale"] for r in rows]
        first_clean = skipped.index(False) if False in skipped else len(skipped)
        print("fp16 from 2^32: %d skipped step(s) in all, the first %d in a row; scales %s ..." %
              (sum(skipped), first_clean, scales[:first_clean + 2]))
        c.check(first_clean >= 2, "the first steps did not overflow from a scale of 2^32")
        c.check(all("fp16 gradient overflow" in r.get("skip_reason", "") for r, s in zip(rows, skipped) if s),
                "a skipped step does not name the overflow")
        # The step lines say so in words: no nan for the norm of a step that overflowed.
        lines = [l for l in p16.stdout.splitlines() if l.startswith("step ")]
        c.check(not any("nan" in l for l in lines), "a step line prints nan: %s" % [l for l in lines if "nan" in l][:1])
        c.check(sum("norm overflow: skipped" in l for l in lines) == sum(skipped),
                "%d step lines say 'norm overflow: skipped', %d steps were skipped"
                % (sum("norm overflow: skipped" in l for l in lines), sum(skipped)))
        want = expected_scales(skipped, 2.0 ** 32, window, 2)
        bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(scales, want)) if a != b]
        c.check(not bad, "logged scales differ from the dynamic rule's at (step, logged, expected) %s" % bad[:5])
        c.check(any(b > a for a, b in zip(scales, scales[1:])), "the scale never grew after a window of clean steps")
        final, final_ref = rows[-1]["loss"], common.rows(ref)[-1]["loss"]
        err = abs(final - final_ref) / abs(final_ref)
        print("final loss: fp16 %.6f, fp32 %.6f (relative %.3g, tolerance %.3g)" % (final, final_ref, err, FP16_FINAL_TOL))
        c.check(err <= FP16_FINAL_TOL, "the fp16 run's final loss is %.3g away from fp32's (relative)" % err)
        c.check(rows[-1]["loss"] < rows[0]["loss"] - 2.0, "the fp16 run did not learn")
        return c.done(name)

    if name == "fp16_overflow_one_rank":
        c = common.Case(args, name, common.small_deck(steps=8, log_every=1))
        fp16 = ["precision.dtype=fp16"]
        p, run = c.loom("zero2_dp2", 2, fp16 + ["parallel.dp=2", "zero.stage=2"],
                        env={"LOOM_INJECT_FAULT": "rank=1,step=3,where=overflow"})
        _, ref = c.loom("single", 1, fp16, env={"LOOM_INJECT_FAULT": "rank=0,step=3,where=overflow"})
        rows, ref_rows = common.rows(run), common.rows(ref)
        skipped = [r["step"] for r in rows if r.get("skipped")]
        print("ZeRO-2 dp 2, inf in rank 1's gradient share at step 4: skipped steps %s; %s" % (skipped, rows[3].get("skip_reason") if len(rows) > 3 else ""))
        c.check(skipped == [4], "skipped steps %s, expected [4]" % skipped)
        c.check([r["step"] for r in ref_rows if r.get("skipped")] == [4], "the one-process reference did not skip step 4")
        clean = lambda rs: [r["loss"] for r in rs if not r.get("skipped")]
        compare(c, clean(rows), clean(ref_rows), U_FP16, "ZeRO-2 dp 2 against one process, skipped step left out")
        return c.done(name)

    if name in ("reduce_bf16_dp2", "reduce_bf16_zero2_dp2"):
        c = common.Case(args, name, common.small_deck(steps=8, log_every=1))
        bf16 = ["precision.dtype=bf16"]
        zero = ["zero.stage=2"] if "zero2" in name else []
        ratio_key = "zero_ratio" if zero else "dp_allreduce_ratio"
        _, run = c.loom("dp2", 2, bf16 + zero + ["parallel.dp=2", "precision.reduce_dtype=bf16"])
        _, ref = c.loom("single", 1, bf16)
        rows = common.rows(run)
        ratios = [r.get(ratio_key) for r in rows]
        print("%s per step with the bf16 collective: %s" % (ratio_key, ratios))
        want = 0.5
        if zero:  # the fp32 elements' all-gather (W of them): 0.5 + W/4P
            P = common.summary(ref)["mem_peak_bytes"]["master"] // 4
            W = P - 12 * 2 * 32 * 32  # the small deck: L = 2, C = 32
            want = 0.5 + W / (4.0 * P)
            print("expected from step 2 on: 0.5 + W/4P = %.6f (P = %d, W = %d)" % (want, P, W))
        c.check(rows and all(x is not None and abs(x - want) <= 0.01 * want for x in ratios[1 if zero else 0:]),
                "the gradient collective did not send half the fp32 bytes: %s = %s, expected %g" % (ratio_key, ratios, want))
        compare(c, [r["loss"] for r in rows], common.losses(ref), U_BF16, "bf16 collective at dp 2 against one process")
        return c.done(name)

    if name in ("memory_bf16", "memory_bf16_tp2_sp"):
        c = common.Case(args, name, common.small_deck(steps=2, log_every=1))
        L, C, V, N = 2, 32, 64, 8 * 16
        tp, extra = (2, ["parallel.tp=2", "tensor.sequence_parallel=true"]) if "tp2" in name else (1, [])
        _, ref = c.loom("fp32", tp, extra)
        _, run = c.loom("bf16", tp, extra + ["precision.dtype=bf16"])
        m32, m16 = common.summary(ref)["mem_peak_bytes"], common.summary(run)["mem_peak_bytes"]
        saved = 2 * N * (C + 4 * C) // tp * L if tp > 1 else 2 * N * C * (7 * L + 1)
        saved += 2 * N * 4 * C // tp - 2 * N * V // tp  # the fc dout scratch in 16 bits; dlogits' own table
        want = {"params": 2 * (12 * L * C * C + V * C) // tp, "master": m32["params"], "grads": m32["grads"],
                "optimizer": m32["optimizer"], "activations": m32["activations"] - saved}
        for k, v in want.items():
            print("%-11s fp32 %9d  bf16 %9d  expected %9d" % (k, m32[k], m16[k], v))
            c.check(m16[k] == v, "bf16 %s: %d bytes, expected %d" % (k, m16[k], v))
        c.check(common.summary(run).get("precision", {}).get("compute_copy_bytes") == want["params"],
                "summary.json precision.compute_copy_bytes is not the 16-bit copies' bytes")
        return c.done(name)

    if name.startswith("nonfinite_skip_bf16"):
        c = common.Case(args, name, common.small_deck(steps=8, log_every=1))
        zero = name[-9:-4] if "zero" in name else ""
        layout = ["parallel.dp=2", "zero.stage=" + zero[-1]] if zero else []
        _, run = c.loom("bf16", 2 if zero else 1, ["precision.dtype=bf16", "train.on_nonfinite=skip"] + layout,
                        env={"LOOM_INJECT_FAULT": "rank=%d,step=2,where=nan" % (1 if zero else 0)})
        rows = common.rows(run)
        skipped = [r["step"] for r in rows if r.get("skipped")]
        print("skipped steps %s; losses %s" % (skipped, [r["loss"] for r in rows]))
        c.check(skipped == [3], "skipped steps %s, expected [3]" % skipped)
        c.check(all(r["loss"] == r["loss"] for r in rows if r["step"] > 3), "a later step was not finite")
        return c.done(name)

    if name in ("memory_bf16_zero2_dp2", "memory_bf16_zero1_dp2"):
        c = common.Case(args, name, common.small_deck(steps=2, log_every=1))
        L, C, V, N = 2, 32, 64, 2
        stage = 1 if "zero1" in name else 2
        _, ref = c.loom("fp32", 1, [])
        _, run = c.loom("bf16_zero%d" % stage, N, ["parallel.dp=2", "zero.stage=%d" % stage, "precision.dtype=bf16"])
        P = common.summary(ref)["mem_peak_bytes"]["params"] // 4
        S = 12 * L * C * C
        W = P - S
        m = common.summary(run)["mem_peak_bytes"]
        if stage == 2:
            want = {"master": 4 * (S // N + W), "optimizer": 8 * P // N, "params": 2 * S + 2 * V * C}
        else:
            want = {"master": 4 * (P // N + W), "optimizer": 8 * P // N, "params": 2 * P + 2 * V * C, "grads": 4 * P}
        for k, v in want.items():
            print("%-9s bf16 ZeRO-%d dp 2: %8d bytes, expected %8d (P = %d, S = %d)" % (k, stage, m[k], v, P, S))
            c.check(m[k] == v, "%s: %d bytes, expected %d" % (k, m[k], v))
        return c.done(name)

    if name.startswith("checkpoint_"):
        c = common.Case(args, name, common.small_deck(steps=8, log_every=1))
        cross = {"checkpoint_bf16_to_fp32": ("bf16", "fp32"), "checkpoint_fp32_to_bf16": ("fp32", "bf16")}
        if name in cross:
            a, b = cross[name]
            extra_a, extra_b, tol = ["precision.dtype=" + a], ["precision.dtype=" + b], U_BF16
        elif name == "checkpoint_fp16_scale":
            extra_a = extra_b = ["precision.dtype=fp16", "precision.loss_scale_window=2"]
            tol = 0.0
        elif name in ("checkpoint_bf16_zero2_dp2", "checkpoint_bf16_zero1_dp2"):  # sharded masters, copies rebuilt
            extra_a = extra_b = ["precision.dtype=bf16", "parallel.dp=2", "zero.stage=" + name[-5],
                                 "train.micro_batches=2"]
            tol = 0.0
        else:
            sys.exit("unknown case " + name)
        ranks = 2 if name.endswith("dp2") else 1
        _, full = c.loom("full", ranks, extra_a + ["checkpoint.every=4", "checkpoint.keep=5"])
        ckpt = os.path.join(full, "checkpoints", "ckpt-00000004.h5")
        _, resumed = c.loom("resumed", ranks, extra_b + ["checkpoint.resume=" + ckpt])
        ref = {r["step"]: r for r in common.rows(full)}
        got = {r["step"]: r for r in common.rows(resumed)}
        c.check(sorted(got) == [5, 6, 7, 8], "the resumed run logged steps %s, expected 5..8" % sorted(got))
        steps = [s for s in sorted(got) if s in ref]
        compare(c, [got[s]["loss"] for s in steps], [ref[s]["loss"] for s in steps], tol, "resumed against uninterrupted")
        if name == "checkpoint_fp16_scale":
            scales = [(s, got[s]["loss_scale"], ref[s]["loss_scale"]) for s in steps]
            print("loss scales (step, resumed, uninterrupted): %s" % scales)
            c.check(all(a == b for _, a, b in scales), "the resumed run's loss scales differ from the uninterrupted run's")
            c.check(ref[5]["loss_scale"] > ref[1]["loss_scale"], "the scale did not grow before the checkpoint")
        return c.done(name)

    sys.exit("unknown case " + name)


if __name__ == "__main__":
    sys.exit(main())
