#!/usr/bin/env python3
"""Context parallelism's costs, measured against its formulas: inputs/long_context_cp.deck (seq_len
2048, flash attention, 4 layers, d_model 128) for 3 steps at parallel.cp = 1, 2 and 4.

    python3 regression/cp_checks.py --loom build/loom --workdir build/cp-checks

  1. activations: every rank's peak of the ledger's `activations` at cp = N is the cp = 1 run's / N,
     within 10% (the attention-dominated deck: each rank holds T/N tokens of every table);
  2. ring bytes: every step, what each rank sent on the cp communicator (metrics.jsonl comm.cp) equals
     the ring's formula, per layer and micro-batch (N - 1) key/value blocks forward, (N - 1) again
     backward and N block gradients, a block being B x T/N x 2C fp32 elements (B rows a micro-batch);
  3. the share of the step spent waiting on the ring (cp_wait_share) is printed every step, in [0, 1];
  4. the loss at every step equals cp = 1's within bf16's roundoff (the ring rounds operands as flash).
Standard library only.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DECK_PATH = os.path.join(HERE, "..", "inputs", "long_context_cp.deck")
LAYERS, C, T, BATCH, STEPS = 4, 128, 2048, 2, 3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    common.add_launcher_arguments(ap)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    deck = open(DECK_PATH).read()
    c = common.Case(args, "cp_checks", deck, "long_context_cp.deck")
    sets = ["train.steps=%d" % STEPS, "train.log_every=1", "train.eval_every=0", "run.memory_limit=0",
            "run.overwrite=true"]
    runs = {}
    for n in (1, 2, 4):
        _, runs[n] = c.loom("cp%d" % n, n, sets + ["parallel.cp=%d" % n])
    act1 = [r["activations"] for r in common.summary(runs[1])["mem_peak_bytes_by_rank"]]
    base = {r["step"]: r["loss"] for r in common.rows(runs[1])}
    for n in (2, 4):
        summary = common.summary(runs[n])
        acts = [r["activations"] for r in summary["mem_peak_bytes_by_rank"]]
        c.check(len(acts) == n, "cp %d: %d ranks' peaks in summary.json" % (n, len(acts)))
        for q, a in enumerate(acts):
            ratio = a / act1[0]
            c.check(abs(ratio * n - 1) <= 0.10, "cp %d rank %d: activations %d bytes, %.4f of cp 1's %d (expected 1/%d within 10%%)"
                    % (n, q, a, ratio, act1[0], n))
        print("cp %d: activations per rank %s bytes = %.4f of cp 1's %d (1/%d = %.4f)"
              % (n, acts[0], acts[0] / act1[0], act1[0], n, 1.0 / n))
        block = BATCH * (T // n) * 2 * C * 4
        formula = LAYERS * 1 * (2 * (n - 1) + n) * block
        rows = common.rows(runs[n])
        c.check(len(rows) == STEPS, "cp %d: %d steps logged" % (n, STEPS))
        for r in rows:
            sent = r.get("comm", {}).get("cp", {}).get("bytes_sent", -1)
            c.check(sent == formula, "cp %d step %d: sent %d bytes on the ring, the formula %d" % (n, r["step"], sent, formula))
            share = r.get("cp_wait_share", -1)
            c.check(0 <= share <= 1, "cp %d step %d: cp_wait_share %r" % (n, r["step"], share))
            want = base.get(r["step"])
            c.check(want is not None and abs(r["loss"] - want) <= 2 ** -9 * abs(want),
                    "cp %d step %d: loss %r, cp 1's %r" % (n, r["step"], r["loss"], want))
        last = rows[-1]
        print("cp %d: ring bytes per rank per step %d = formula L x (2(N-1) + N) x B T/N 2C x 4 = %d; waiting %.1f%% of the "
              "ring's time (%.3f s of %.3f s compute)" % (n, last["comm"]["cp"]["bytes_sent"], formula,
                                                          100 * last["cp_wait_share"], last["cp_wait_s"], last["cp_compute_s"]))
    return c.done("cp_checks")


if __name__ == "__main__":
    sys.exit(main())
