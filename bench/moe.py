#!/usr/bin/env python3
"""Mixture of experts on this machine, measured in one run: inputs/moe.deck (4 blocks, d_model 128, 8
experts of half the dense MLP's width, top-2: a token reaches as many weights as in the dense model)
against the same deck dense (model.experts = 0), one process, one BLAS thread; then expert parallelism.

    python3 bench/moe.py --loom build/loom [--seeds 5] [--steps 300] [--rounds 3] [--text FILE]

Prints:
  1. learning: the final validation loss of the MoE and the dense model over --seeds seeds (train.seed),
     their means, spreads (max - min) and the gap; the MoE runs' load-balancing loss, z-loss, dropped
     share and busiest expert against its fair share (means over the run and the seeds). On --text: by
     default the reStructuredText sources of Python's documentation (Debian's python3.11-doc, which
     setup.sh installs), 11 MB concatenated into the workdir, 2% held out, 16 validation batches; the
     deck's own GPL-3 (35 kB) is over-fitted within 200 steps, where more parameters only over-fit more;
  2. speed: the MoE step against the dense step (tokens/s of the same runs, taken in turn, seed by seed:
     the median of the seeds' ratios; target <= 1.3x);
  3. expert parallelism: tokens/s at dp 2 x ep 2 (the deck as written, 8 rows a rank) against two
     independent single-rank runs at once of 8 rows each with all 8 experts (the machine's ceiling for
     two ranks, as bench/weak_scaling.py measures it; target >= 0.8), --rounds times in turn, the median
     round the verdict; and the all-to-all's share of the step (its wait over the step).
Standard library only. A benchmark, not a test: numbers depend on what else the machine is doing.
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DECK = os.path.join(HERE, "..", "inputs", "moe.deck")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def loom_run(cmd, rundir):
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr)
        sys.exit("loom failed: " + " ".join(cmd))
    with open(os.path.join(rundir, "summary.json")) as f:
        return json.load(f)


def one_process(loom, workdir, experts, seed, steps, text):
    rundir = os.path.join(workdir, "e%d-s%d" % (experts, seed))
    cmd = [loom, "run", DECK, "--set", "parallel.dp=1", "--set", "parallel.ep=1", "--set", "model.experts=%d" % experts,
           "--set", "train.seed=%d" % seed, "--set", "train.steps=%d" % steps, "--set", "run.dir=" + rundir,
           "--set", "run.overwrite=true", "--set", "data.source=text:" + text, "--set", "data.val_fraction=0.02",
           "--set", "train.eval_batches=16"]
    return loom_run(cmd, rundir)


def default_text(workdir):
    """Python's documentation sources, concatenated (sorted: the same bytes every time)."""
    files = sorted(glob.glob("/usr/share/doc/python3.11/html/_sources/*.txt") +
                   glob.glob("/usr/share/doc/python3.11/html/_sources/*/*.txt"))
    if not files:
        sys.exit("no /usr/share/doc/python3.11/html/_sources (Debian's python3.11-doc): give --text FILE")
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "pydocs.txt")
    with open(out, "wb") as f:
        for name in files:
            with open(name, "rb") as src:
                f.write(src.read())
    return out


def ep_run(loom, mpirun, workdir, steps):
    rundir = os.path.join(workdir, "ep2")
    cmd = [mpirun, "-n", "2", loom, "run", DECK, "--set", "train.steps=%d" % steps, "--set", "train.eval_every=0",
           "--set", "run.dir=" + rundir, "--set", "run.overwrite=true"]
    return loom_run(cmd, rundir)


def independent(loom, workdir, steps):
    procs, dirs = [], []
    for i in range(2):
        rundir = os.path.join(workdir, "independent-%d" % i)
        dirs.append(rundir)
        cmd = [loom, "run", DECK, "--set", "parallel.dp=1", "--set", "parallel.ep=1", "--set", "train.batch=8",
               "--set", "train.steps=%d" % steps, "--set", "train.eval_every=0", "--set", "run.dir=" + rundir,
               "--set", "run.overwrite=true"]
        procs.append(subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    print("$ 2 x %s run inputs/moe.deck --set parallel.dp=1 --set parallel.ep=1 --set train.batch=8 (concurrently)"
          % loom, flush=True)
    total = 0.0
    for p, d in zip(procs, dirs):
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit("independent run failed: " + err)
        with open(os.path.join(d, "summary.json")) as f:
            total += json.load(f)["tokens_per_s"]
    return total


def spread(v):
    return max(v) - min(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--text", help="the learning comparison's text (default: Python's documentation sources)")
    ap.add_argument("--ep-steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default="build/bench-moe")
    args = ap.parse_args()
    text = args.text or default_text(args.workdir)
    dense, moe = [], []
    for seed in range(1, args.seeds + 1):  # in turn, so that a slow minute falls on both
        dense.append(one_process(args.loom, args.workdir, 0, seed, args.steps, text))
        moe.append(one_process(args.loom, args.workdir, 8, seed, args.steps, text))
    dv = [s["final_val_loss"] for s in dense]
    mv = [s["final_val_loss"] for s in moe]
    ratios = sorted(d["tokens_per_s"] / m["tokens_per_s"] for d, m in zip(dense, moe))
    step_ratio = statistics.median(ratios)
    rounds = []
    for _ in range(args.rounds):
        ep = ep_run(args.loom, args.mpirun, args.workdir, args.ep_steps)
        ceiling = independent(args.loom, args.workdir, args.ep_steps)
        share = ep["moe_ep_wait_share"] if "moe_ep_wait_share" in ep else ep["ep_alltoall_wait_ms"] / (
            1e3 * ep["train_time_s"] / ep["steps_run"])
        rounds.append((ep["tokens_per_s"] / ceiling, ep["tokens_per_s"], ceiling, share))
    rounds.sort()
    vs_ceiling, ep_tps, ceiling, share = rounds[len(rounds) // 2]
    mean = lambda key: statistics.mean(s[key] for s in moe)  # noqa: E731
    print()
    print("mixture of experts, inputs/moe.deck (8 experts top-2 of half width, dropless) on %s (%.1f MB), "
          "%d steps, %d seeds" % (os.path.basename(text), os.path.getsize(text) / 1e6, args.steps, args.seeds))
    print("  %-58s %8.4f (spread %.4f)" % ("dense: mean final validation loss", statistics.mean(dv), spread(dv)))
    print("  %-58s %8.4f (spread %.4f)" % ("MoE:   mean final validation loss", statistics.mean(mv), spread(mv)))
    print("  %-58s %+8.4f (%s)" % ("MoE - dense", statistics.mean(mv) - statistics.mean(dv),
                                   "lower" if statistics.mean(mv) < statistics.mean(dv) else "NOT lower"))
    print("  %-58s %8d of %d" % ("seeds on which the MoE's is lower (same seed, paired)",
                                 sum(m < d for m, d in zip(mv, dv)), len(dv)))
    print("  %-58s %8.4f" % ("MoE load-balancing loss (1 = balanced), mean", mean("moe_aux")))
    print("  %-58s %8.4f" % ("MoE z-loss, mean", mean("moe_z")))
    print("  %-58s %7.2f%%" % ("MoE assignments dropped (the deck's capacity), mean", 100 * mean("moe_dropped")))
    print("  %-58s %8.3f" % ("MoE busiest expert / its fair share, mean over steps", mean("moe_load_max")))
    print("  %-58s %8.3f   (target <= 1.3: %s; seeds: %s)" % (
        "MoE step / dense step (tokens/s ratio, median of seeds)", step_ratio,
        "met" if step_ratio <= 1.3 else "NOT met", ", ".join("%.3f" % r for r in ratios)))
    print("expert parallelism, dp 2 x ep 2 (4 experts a rank) against 2 independent 1-rank runs, %d steps, median of "
          "%d rounds (%s)" % (args.ep_steps, len(rounds), ", ".join("%.3f" % r[0] for r in rounds)))
    print("  %-58s %10.1f" % ("tokens/s at dp 2 x ep 2", ep_tps))
    print("  %-58s %10.1f" % ("tokens/s of 2 independent 1-rank runs at once", ceiling))
    print("  %-58s %10.3f   (target >= 0.8: %s)" % ("ep 2 against that ceiling", vs_ceiling,
                                                    "met" if vs_ceiling >= 0.8 else "NOT met"))
    print("  %-58s %9.1f%%" % ("the all-to-all's wait, share of the step", 100 * share))
    print(json.dumps({"dense_val": dv, "moe_val": mv, "step_ratio": step_ratio, "step_ratios": ratios,
                      "ep2_vs_ceiling": vs_ceiling, "ep2_tokens_per_s": ep_tps, "ceiling_tokens_per_s": ceiling,
                      "alltoall_share": share, "rounds": [r[0] for r in rounds]}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
