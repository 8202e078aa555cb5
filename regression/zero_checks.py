#!/usr/bin/env python3
"""ZeRO stage 1 traffic and memory per rank, checked against the textbook.

    python3 regression/zero_checks.py --loom build/loom --workdir build/zero-checks [--ranks 2]

Runs a small deck at dp = N with zero.stage = 1 (and with zero.stage = 0 for comparison), then checks
every step of rank 0's metrics:
  1. bytes: what rank 0 sent to reduce-scatter the gradients and all-gather the parameters equals the
     textbook 2(N-1)/N M (M = the parameter bytes), to within the rounding of the dp shares (the
     flat buffer of P elements is cut into shares of P//N or P//N + 1 elements: at most 2 N x 4 bytes),
     plus at most 2(N-1) x 8 bytes of scalar all-reduces (the loss mean);
  2. memory: the ledger's model state on rank 0 (parameters + gradients + AdamW moments) equals
     4P + 4P + 8 x share_0 bytes exactly (share_0 = ceil(P/N), the largest share), which is the
     textbook 4P + 4P + 8P/N to within 8 bytes; the optimizer state alone is 8 x share_0, against 8P
     at stage 0; the collectives' scratch, which loom adds, is named (zero_comm_scratch_bytes);
  3. the loss curve equals stage 0's to the dp cases' tolerance (1e-5 relative).
Standard library only.
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DECK = common.small_deck(steps=6, log_every=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    ap.add_argument("--mpirun", default="mpiexec")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    n = args.ranks
    c = common.Case(args, "zero1_np%d" % n, DECK, "zero.deck")
    _, plain = c.loom("stage0", n, ["parallel.dp=%d" % n, "run.overwrite=true"])
    _, zero = c.loom("stage1", n, ["parallel.dp=%d" % n, "zero.stage=1", "run.overwrite=true"])
    P = common.summary(zero).get("parameters_rank0", 0)
    share0 = -(-P // n)
    rows0, rows1 = common.rows(plain), common.rows(zero)
    c.check(len(rows1) == 6 and len(rows0) == 6, "6 steps logged each")
    for r0, r in zip(rows0, rows1):
        s = r["step"]
        textbook = 2 * (n - 1) / n * 4 * P
        sent = r["zero_reduce_scatter_bytes"] + r["zero_all_gather_bytes"]
        c.check(abs(r["zero_textbook_bytes"] - textbook) < 1e-6, "step %d: zero_textbook_bytes %s, expected %s" % (s, r["zero_textbook_bytes"], textbook))
        c.check(abs(sent - textbook) <= 2 * n * 4, "step %d: sent %d bytes, textbook %.1f" % (s, sent, textbook))
        c.check(r["zero_all_reduce_bytes"] <= 2 * (n - 1) * 8, "step %d: %d bytes of scalar all-reduces" % (s, r["zero_all_reduce_bytes"]))
        mem = r["mem_peak_bytes"]
        c.check(mem["optimizer"] == 8 * share0, "step %d: AdamW state %d bytes, expected 8 x %d" % (s, mem["optimizer"], share0))
        c.check(r0["mem_peak_bytes"]["optimizer"] == 8 * P, "step %d: stage 0 AdamW state %d, expected 8P" % (s, r0["mem_peak_bytes"]["optimizer"]))
        c.check(mem["params"] == 4 * P and mem["grads"] == 4 * P, "step %d: parameters/gradients not 4P" % s)
        c.check(r["zero_state_bytes"] == 8 * P + 8 * share0, "step %d: model state %d, expected %d" % (s, r["zero_state_bytes"], 8 * P + 8 * share0))
        c.check(abs(r["zero_state_bytes"] - r["zero_state_textbook_bytes"]) <= 8, "step %d: model state off the textbook" % s)
        c.check(r["zero_comm_scratch_bytes"] > 0, "step %d: the collectives' scratch is not named" % s)
        c.check(abs(r["loss"] - r0["loss"]) <= 1e-5 * max(1.0, abs(r0["loss"])), "step %d: loss %r, stage 0 %r" % (s, r["loss"], r0["loss"]))
    print("P = %d, N = %d: sent %d of textbook %.0f bytes per step; model state %d bytes (textbook %.0f); scratch %d"
          % (P, n, sent, textbook, rows1[-1]["zero_state_bytes"], rows1[-1]["zero_state_textbook_bytes"],
             rows1[-1]["zero_comm_scratch_bytes"]))
    return c.done("zero_checks np%d" % n)


if __name__ == "__main__":
    sys.exit(main())
