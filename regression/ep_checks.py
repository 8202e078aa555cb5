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
  4. the loss equals parallel.ep = 1's at every step (relative 1e-5: the same model).
Standard library only.
"""
import argparse
import os
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
    for tag, ep, extra in (("ep1", 1, []), ("ep2", 2, []), ("ep4", 4, []), ("ep4_recompute", 4, ["model.recompute=true"])):
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
    ratio = sent["ep4"] / max(sent["ep2"], 1)
    c.check(1.2 <= ratio <= 1.8, "ep 4 sends %.3f x ep 2's bytes per step (balanced routing: 1.5)" % ratio)
    print("ep 4 / ep 2 bytes per step: %.3f (balanced routing: (3/4) / (1/2) = 1.5)" % ratio)
    return c.done("ep_checks")


if __name__ == "__main__":
    sys.exit(main())
