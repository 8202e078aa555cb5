#!/usr/bin/env python3
"""Expert parallelism's traffic against its formula: inputs/moe.deck (8 experts top-2, capacity 1.25)
for 4 steps at dp 4 with parallel.ep = 2 and 4, and at ep = 4 with a recomputed forward.

    python3 regression/ep_checks.py --loom build/loom --workdir build/ep-checks

  1. every step, every rank of every ep group sent on the ep communicator exactly the formula for its
     routed counts: the rows it sends to other ranks' experts and the rows it returns, C fp32 values
     each, forward and backward (ep_ranks_off_formula 0; rank 0's ep_alltoall_bytes equal to
     ep_alltoall_formula_bytes, the communicator's count against the formula's);
  2. the exchanges a step makes: 4 per block with experts and micro-batch (6 with recompute);
  3. the bytes are not nothing, and at ep 4 a rank sends more of its rows away than at ep 2 (3/4 of a
     balanced routing's rows against 1/2: between 1.2x and 1.8x, routing being uneven);
  4. the loss equals parallel.ep = 1's at every step (relative 1e-5: the same model);
  5. under ZeRO-1 at ep 2 (zero.stage = 1): the same losses; the dense tensors' AdamW state sharded over
     dp 4 and the experts' over their 2 holders (the ledger's optimizer bytes 8 (Pd/4 + Pe/2), within
     rounding); the bytes ZeRO sends (reduce-scatter and refresh over dp, the experts' refresh over edp)
     equal its textbook 2(N-1)/N 4Pd + (Ne-1)/Ne 4Pe and the model state 8P + 8Pd/N + 8Pe/Ne, within
     share rounding;
  6. `loom plan`'s bytes per group for each layout (comm_bytes_by_group) against what rank 0 sent in the
     last step: dp and edp within 0.1% (their volumes do not depend on the routing; edp sends nothing at ep
     4 = dp), ep within 15% (the plan prices balanced routing; the run's is off it by 2% at ep 2, 7% at ep 4).
Standard library only.
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DECK_PATH = os.path.join(HERE, "..", "inputs", "moe.deck")
BLOCKS, STEPS = 4, 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    common.add_launcher_arguments(ap)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    c = common.Case(args, "ep_checks", open(DECK_PATH).read(), "moe.deck")
    sets = ["train.steps=%d" % STEPS, "train.log_every=1", "train.eval_every=0", "run.overwrite=true",
            "parallel.dp=4"]
    runs = {}
    for tag, ep, extra in (("ep1", 1, []), ("ep2", 2, []), ("ep4", 4, []), ("ep4_recompute", 4, ["model.recompute=true"]),
                           ("ep2_zero1", 2, ["zero.stage=1"])):
        _, runs[tag] = c.loom(tag, 4, sets + ["parallel.ep=%d" % ep] + extra)
    base = {r["step"]: r["loss"] for r in common.rows(runs["ep1"])}
    sent = {}
    for tag, exchanges in (("ep2", 4), ("ep4", 4), ("ep4_recompute", 6)):
        rows = common.rows(runs[tag])
        c.check(len(rows) == STEPS, "%s: %d steps logged" % (tag, STEPS))
        for r in rows:
            s = r.get("step")
            c.check(r.get("ep_ranks_off_formula", -1) == 0,
                    "%s step %s: %r ranks sent other than their routed counts' formula" % (tag, s, r.get("ep_ranks_off_formula")))
            c.check(r.get("ep_alltoall_bytes", -1) == r.get("ep_alltoall_formula_bytes", -2) > 0,
                    "%s step %s: rank 0 sent %r bytes on the ep communicator, the formula %r" %
                    (tag, s, r.get("ep_alltoall_bytes"), r.get("ep_alltoall_formula_bytes")))
            c.check(r.get("ep_exchanges") == exchanges * BLOCKS,
                    "%s step %s: %r exchanges, expected %d" % (tag, s, r.get("ep_exchanges"), exchanges * BLOCKS))
            want = base.get(s)
            c.check(want is not None and abs(r["loss"] - want) <= 1e-5 * abs(want),
                    "%s step %s: loss %r, ep 1's %r" % (tag, s, r["loss"], want))
        sent[tag] = sum(r.get("ep_alltoall_bytes", 0) for r in rows) / max(1, len(rows))
        last = rows[-1]
        print("%s: rank 0 sent %d bytes on the ep communicator in step %d = its routed counts' formula %d; "
              "%d exchanges; all-to-all waits %.1f ms" % (tag, last["ep_alltoall_bytes"], last["step"],
                                                           last["ep_alltoall_formula_bytes"], last["ep_exchanges"],
                                                           last["ep_alltoall_wait_ms"]))
    zero_checks(c, base, common.rows(runs["ep2_zero1"]), common.rows(runs["ep2"]))
    for tag, ep, extra in (("ep2", 2, []), ("ep4_recompute", 4, ["model.recompute=true"]),
                           ("ep2_zero1", 2, ["zero.stage=1"])):
        plan_checks(c, args.loom, tag, sets + ["parallel.ep=%d" % ep] + extra, common.rows(runs[tag])[-1])
    ratio = sent["ep4"] / max(sent["ep2"], 1)
    c.check(1.2 <= ratio <= 1.8, "ep 4 sends %.3f x ep 2's bytes per step (balanced routing: 1.5)" % ratio)
    print("ep 4 / ep 2 bytes per step: %.3f (balanced routing: (3/4) / (1/2) = 1.5)" % ratio)
    return c.done("ep_checks")


def plan_checks(c, loom, tag, sets, last):
    """loom plan's bytes per group against the run's last step on rank 0."""
    cmd = [loom, "plan", c.deck, "--json"]
    for x in sets:
        cmd += ["--set", x]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    if p.returncode != 0:
        c.check(False, "%s: loom plan exited %d: %s" % (tag, p.returncode, p.stderr[-400:]))
        return
    planned = json.loads(p.stdout).get("comm_bytes_by_group", {})
    line = []
    for group, tol in (("dp", 1e-3), ("edp", 1e-3), ("ep", 0.15)):
        sent = last.get("comm", {}).get(group, {}).get("bytes_sent", 0)
        want = planned.get(group, 0)
        c.check(abs(want - sent) <= tol * sent and (sent > 0 or group == "edp"),
                "%s: loom plan prices %r bytes on %s, the run's rank 0 sent %r (tolerance %g)" % (tag, want, group, sent, tol))
        line.append("%s %.0f / %.0f" % (group, want, sent))
    print("%s: loom plan's bytes a step / the run's: %s" % (tag, ", ".join(line)))


def zero_checks(c, base, rows, plain):
    """ZeRO-1 at dp 4 with ep 2: the same model, the state sharded within each group, the textbook bytes."""
    c.check(len(rows) == STEPS, "ep2_zero1: %d steps logged" % STEPS)
    for r in rows:
        tag = "ep2_zero1 step %s" % r.get("step")
        want = base.get(r.get("step"))
        c.check(want is not None and abs(r["loss"] - want) <= 1e-5 * abs(want),
                "%s: loss %r, ep 1's %r" % (tag, r["loss"], want))
        n, ne, pe = 4, r.get("zero_expert_group"), r.get("zero_expert_elements", 0)
        c.check(ne == 2 and pe > 0, "%s: experts' group %r, elements %r (expected 2 and > 0)" % (tag, ne, pe))
        p = r["mem_peak_bytes"]["params"] // 4  # fp32 stage 1 keeps the flat parameters whole: 4P
        pd = p - pe
        opt = 8 * (pd / n + pe / ne)
        runs = 2 * BLOCKS + 1  # dense and experts' runs of the flat range, each rounded apart
        c.check(abs(r["mem_peak_bytes"]["optimizer"] - opt) <= 8 * runs,
                "%s: AdamW state %d bytes, expected 8 (Pd/%d + Pe/%d) = %.0f" % (tag, r["mem_peak_bytes"]["optimizer"], n, ne, opt))
        sent = r["zero_reduce_scatter_bytes"] + r["zero_all_gather_bytes"] + r["zero_expert_all_gather_bytes"]
        textbook = 2 * (n - 1) / n * 4 * pd + (ne - 1) / ne * 4 * pe
        c.check(abs(r["zero_textbook_bytes"] - textbook) < 1e-6 * textbook, "%s: textbook %r, expected %r" % (tag, r["zero_textbook_bytes"], textbook))
        c.check(abs(sent - textbook) <= 2 * n * 4 * runs, "%s: ZeRO sent %d bytes, textbook %.0f" % (tag, sent, textbook))
        state = 8 * p + 8 * pd / n + 8 * pe / ne
        c.check(abs(r["zero_state_bytes"] - state) <= 16 * runs, "%s: model state %d bytes, textbook %.0f" % (tag, r["zero_state_bytes"], state))
    last, without = rows[-1], plain[-1]
    c.check(last["mem_peak_bytes"]["optimizer"] < without["mem_peak_bytes"]["optimizer"] / 2,
            "ep2_zero1: AdamW state %d bytes, not under half of ep 2 without ZeRO's %d" %
            (last["mem_peak_bytes"]["optimizer"], without["mem_peak_bytes"]["optimizer"]))
    print("ep2_zero1: AdamW state %d bytes per rank (ep 2 without ZeRO: %d); ZeRO sent %d bytes in step %d "
          "(textbook %.0f, ratio %.4f); model state %d bytes (textbook %.0f)"
          % (last["mem_peak_bytes"]["optimizer"], without["mem_peak_bytes"]["optimizer"],
             last["zero_reduce_scatter_bytes"] + last["zero_all_gather_bytes"] + last["zero_expert_all_gather_bytes"],
             last["step"], last["zero_textbook_bytes"], last["zero_ratio"], last["zero_state_bytes"],
             last["zero_state_textbook_bytes"]))


if __name__ == "__main__":
    sys.exit(main())
