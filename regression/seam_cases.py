#!/usr/bin/env python3
"""The core's seams, as a user's run exercises them: declared role composition, a
strategy that wraps data parallelism's gradient reducer, phase hooks, and checkpoint state that a
strategy contributes. The strategies are test plugins in build/test-plugins (plugins/test/
test_seams.cpp), found through LOOM_PLUGIN_PATH.

    /usr/bin/python3 regression/seam_cases.py --loom build/loom --plugins build/test-plugins \\
        --mpirun mpiexec --workdir build/seam-cases CASE

CASE is one of:
  role_clash_dp2         parallel.dp = 2 with run.plugins = syncclash (provides gradient sync, as data
                         does, without declaring that it replaces it): exit 2 before any step, naming
                         both strategies and the role
  undeclared_role        run.plugins = undeclared (fills gradient sync without claiming it): exit 2,
                         naming the strategy and the role, said once
  reducer_wrap_dp2       dp = 2, small buckets, run.plugins = countreducer (wraps data's reducer):
                         every step the wrapper saw every bucket, every tensor once, every gradient
                         element, each tensor where the bucket said; the phase hooks ran in order; the
                         losses are bit for bit those of the run without the wrapper
  contributed_state_tp2  dp = 2 x tp = 2, countreducer with checkpoint.every = 2: its tensors
                         /plugins/countreducer/seen/<name> (full shapes, written by their owners)
                         hold the number of steps in every element and its attribute the bucket
                         total; a resume from step 2 restores both (they go on counting from there);
                         a checkpoint of a run without the strategy still loads (its state starts at 0)
The checkpoint reads use h5py: run with /usr/bin/python3 (Debian's python3-h5py).
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import losses, rows  # noqa: E402

DECK = common.small_deck(steps=4, log_every=1)
TENSORS = 2 + 12 * 2 + 2  # wte, wpe, 12 per block, ln_f


class Case(common.Case):
    def __init__(self, args, name):
        super().__init__(args, name, DECK, "seams.deck")

    def loom(self, tag, ranks, sets, env=None, expect=0):
        e = {"LOOM_PLUGIN_PATH": self.args.plugins}
        e.update(env or {})
        return super().loom(tag, ranks, sets + ["run.overwrite=true"], env=e, expect=expect)


def refused_once(c, plugin, pattern, said):
    """A dp = 2 run with run.plugins = `plugin`: exit 2, `pattern` on stderr exactly once, no step."""
    p, rundir = c.loom("run", 2, ["parallel.dp=2", "run.plugins=" + plugin], expect=2)
    c.expect(p.stderr, [pattern], "stderr")
    c.check(p.stderr.count(said) == 1, "the refusal is said once, not per rank:\n" + p.stderr)
    c.check(not rows(rundir), "a refused run trained")


def role_clash_dp2(c):
    refused_once(c, "syncclash", r"strategies 'data' \(parallel\.dp = 2\) and 'syncclash' \(run\.plugins = syncclash\) both "
                 r"fill the gradient sync role, and neither declares that it replaces or wraps the other", "both fill")


def undeclared_role(c):
    refused_once(c, "undeclared", r"strategy 'undeclared' \(\S+libloom_undeclared\.so\) fills the gradient sync role "
                 r"without declaring it", "without declaring")


def reducer_wrap_dp2(c):
    sets = ["parallel.dp=2", "data_parallel.bucket_mb=0.02"]
    plain_p, plain = c.loom("plain", 2, sets)
    p, wrapped = c.loom("wrapped", 2, sets + ["run.plugins=countreducer"])
    m = re.search(r"gradient sync data-parallel counted all-reduce over dp 2, (\d+) buckets", p.stdout)
    c.check(m is not None, "the banner names the wrapped reducer and its buckets:\n" + p.stdout[:3000])
    buckets = int(m.group(1)) if m else -1
    c.check(buckets > 3, "small buckets: expected several, got %d" % buckets)
    params = common.summary(wrapped).get("parameters_rank0")
    for r in rows(wrapped):
        step = r["step"]
        c.check(r.get("countreducer_buckets") == buckets, "step %d: saw %s buckets of %d" % (step, r.get("countreducer_buckets"), buckets))
        c.check(r.get("countreducer_tensors") == TENSORS, "step %d: saw %s tensors of %d" % (step, r.get("countreducer_tensors"), TENSORS))
        c.check(r.get("countreducer_elements") == params, "step %d: saw %s elements of %s" % (step, r.get("countreducer_elements"), params))
        c.check(r.get("countreducer_seen_sum") == step * params, "step %d: every element reduced once per step" % step)
        c.check(r.get("countreducer_misplaced") == 0, "step %d: a bucket's tensor was not where it said" % step)
        c.check(r.get("countreducer_phase_order_ok") == 1, "step %d: the phase hooks ran out of order" % step)
        c.check(abs(r.get("dp_allreduce_ratio", 0) - 1) < 1e-9, "step %d: the wrapped all-reduce sent other bytes" % step)
    c.check(len(rows(wrapped)) == 4, "4 steps logged")
    c.check(losses(wrapped) == losses(plain) and losses(plain),
            "the wrapper changed the numbers: %s vs %s" % (losses(wrapped), losses(plain)))


def contributed_state_tp2(c):
    import h5py
    sets = ["parallel.dp=2", "parallel.tp=2", "data_parallel.bucket_mb=0.02", "run.plugins=countreducer"]
    ck = os.path.join(c.dir, "ckpt")
    _, full = c.loom("full", 4, sets + ["checkpoint.every=2", "checkpoint.dir=" + ck])
    final = rows(full)[-1] if rows(full) else {}
    buckets = final.get("countreducer_buckets", -1)
    with h5py.File(os.path.join(ck, "ckpt-00000004.h5"), "r") as f:
        c.check(f.attrs.get("countreducer.buckets_total") == 4 * buckets,
                "attribute countreducer.buckets_total %s, expected %s" % (f.attrs.get("countreducer.buckets_total"), 4 * buckets))
        names = sorted(f["/plugins/countreducer/seen"].keys()) if "/plugins/countreducer/seen" in f else []
        c.check(len(names) == TENSORS, "%d contributed tensors, expected %d" % (len(names), TENSORS))
        for n in names:
            d = f["/plugins/countreducer/seen/" + n]
            c.check(d.shape == f["/params/" + n].shape, "%s: shape %s, the parameter's is %s" % (n, d.shape, f["/params/" + n].shape))
            vals = d[()].ravel()
            c.check(vals.min() == 4 and vals.max() == 4, "%s: counts %s..%s, expected 4 everywhere" % (n, vals.min(), vals.max()))
    # Resume from step 2: the strategy's state comes back and goes on counting.
    _, resumed = c.loom("resumed", 4, sets + ["checkpoint.resume=" + os.path.join(ck, "ckpt-00000002.h5")])
    last = rows(resumed)[-1] if rows(resumed) else {}
    c.check(last.get("countreducer_buckets_total") == final.get("countreducer_buckets_total"),
            "resumed bucket total %s, uninterrupted %s" % (last.get("countreducer_buckets_total"), final.get("countreducer_buckets_total")))
    c.check(last.get("countreducer_seen_sum") == final.get("countreducer_seen_sum"),
            "resumed per-element counts %s, uninterrupted %s" % (last.get("countreducer_seen_sum"), final.get("countreducer_seen_sum")))
    c.check(losses(resumed) == losses(full)[2:], "the resumed run's losses differ: %s vs %s" % (losses(resumed), losses(full)[2:]))
    # A checkpoint written without the strategy: its state is not required, and starts from zero.
    ck0 = os.path.join(c.dir, "ckpt-plain")
    c.loom("plain", 4, sets[:-1] + ["checkpoint.every=2", "checkpoint.dir=" + ck0])
    _, adds = c.loom("adds", 4, sets + ["checkpoint.resume=" + os.path.join(ck0, "ckpt-00000002.h5")])
    first = rows(adds)[0] if rows(adds) else {}
    c.check(first.get("countreducer_buckets_total") == buckets, "added state should start at 0: bucket total %s after one step"
            % first.get("countreducer_buckets_total"))


CASES = {f.__name__: f for f in (role_clash_dp2, undeclared_role, reducer_wrap_dp2, contributed_state_tp2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    ap.add_argument("--plugins", required=True)
    common.add_launcher_arguments(ap)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("case", choices=sorted(CASES))
    args = ap.parse_args()
    c = Case(args, args.case)
    CASES[args.case](c)
    return c.done(args.case)


if __name__ == "__main__":
    sys.exit(main())
