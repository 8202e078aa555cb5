#!/usr/bin/env python3
"""Context parallelism on this machine, measured in one run: inputs/long_context_cp.deck (seq_len 2048,
flash attention) at parallel.cp = 1 and cp = N, the same global batch (the sequences are split, not
multiplied), one BLAS thread per rank.

    python3 bench/context_parallel.py --loom build/loom [--steps 12] [--ranks 2] [--rounds 3]

Prints:
  - tokens/s at cp = 1 and cp = N, and  tokens/s(cp N) / (N x tokens/s(cp 1))  (target >= 0.8);
  - the tokens/s of N independent single-rank runs at once (no communication): the ceiling the machine's
    shared cores, caches and memory set, as bench/weak_scaling.py measures it, and cp = N against it
    (the issue's target: >= 0.8 of that ceiling);
  - the ring's bytes each rank sent per step against the formula L x (2(N-1) + N) x B T/N 2C x 4, and
    the share of the ring's time spent waiting on it (cp_wait_share) and of the step on any message.
The three runs (cp 1, cp N, N independent) are taken in turn, --rounds times; the ratios are each
round's, and their median is the verdict: a shared machine's speed moves by tens of percent between
minutes, less within one round.
Standard library only. A benchmark, not a test: numbers depend on what else the machine is doing.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DECK = os.path.join(HERE, "..", "inputs", "long_context_cp.deck")
LAYERS, C, T, BATCH = 4, 128, 2048, 2
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def sets(steps, rundir):
    return ["--set", "train.steps=%d" % steps, "--set", "train.eval_every=0", "--set", "run.memory_limit=0",
            "--set", "run.dir=" + rundir, "--set", "run.overwrite=true"]


def run(loom, mpirun, cp, steps, workdir):
    rundir = os.path.join(workdir, "cp%d" % cp)
    cmd = [mpirun, "-n", str(cp), loom, "run", DECK, "--set", "parallel.cp=%d" % cp] + sets(steps, rundir)
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr)
        sys.exit("loom failed at cp = %d" % cp)
    with open(os.path.join(rundir, "summary.json")) as f:
        return json.load(f)


def run_independent(loom, n, steps, workdir):
    procs, dirs = [], []
    for i in range(n):
        rundir = os.path.join(workdir, "independent-%d" % i)
        dirs.append(rundir)
        cmd = [loom, "run", DECK, "--set", "parallel.cp=1"] + sets(steps, rundir)
        procs.append(subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    print("$ %d x %s run inputs/long_context_cp.deck --set parallel.cp=1 (concurrently, no communication)" % (n, loom),
          flush=True)
    total = 0.0
    for p, d in zip(procs, dirs):
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit("independent run failed: " + err)
        with open(os.path.join(d, "summary.json")) as f:
            total += json.load(f)["tokens_per_s"]
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workdir", default="build/bench-cp")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.ranks
    rounds = []
    for _ in range(args.rounds):
        one = run(args.loom, args.mpirun, 1, args.steps, args.workdir)
        many = run(args.loom, args.mpirun, n, args.steps, args.workdir)
        independent = run_independent(args.loom, n, args.steps, args.workdir)
        rounds.append((many["tokens_per_s"] / independent, one, many, independent))
    rounds.sort(key=lambda r: r[0])
    vs_ceiling, one, many, independent = rounds[len(rounds) // 2]  # the median round
    eff = many["tokens_per_s"] / (n * one["tokens_per_s"])
    measured = many["comm"]["cp"]["bytes_sent_per_step"]
    formula = LAYERS * (2 * (n - 1) + n) * BATCH * (T // n) * 2 * C * 4
    print()
    print("context parallelism, inputs/long_context_cp.deck (seq_len %d, flash), global batch %d, %d steps; "
          "the median of %d rounds (cp %d against the ceiling, each round: %s)"
          % (T, BATCH, args.steps, len(rounds), n, ", ".join("%.3f" % r[0] for r in rounds)))
    print("  %-52s %12.1f" % ("tokens/s at cp = 1", one["tokens_per_s"]))
    print("  %-52s %12.1f" % ("tokens/s at cp = %d" % n, many["tokens_per_s"]))
    print("  %-52s %12.3f" % ("tok/s(cp N) / (N tok/s(cp 1))", eff))
    print("  %-52s %12.1f" % ("tokens/s of %d independent 1-rank runs at once" % n, independent))
    print("  %-52s %12.3f   (target >= 0.8: %s)" % ("cp = %d against that ceiling" % n, vs_ceiling,
                                                     "met" if vs_ceiling >= 0.8 else "NOT met"))
    print("  %-52s %12.0f" % ("ring bytes sent per rank per step", measured))
    print("  %-52s %12.0f   (%s)" % ("formula L x (2(N-1) + N) x B T/N 2C x 4", formula,
                                     "equal" if measured == formula else "NOT equal"))
    print("  %-52s %12.1f%%" % ("the ring's time spent waiting (cp_wait_share)", 100 * many["cp_wait_share"]))
    print("  %-52s %12.1f%%" % ("step time waiting on any message", 100 * many["comm_wait_share"]))
    print(json.dumps({"ranks": n, "tokens_per_s_cp1": one["tokens_per_s"], "tokens_per_s_cpN": many["tokens_per_s"],
                      "efficiency": eff, "independent_tokens_per_s": independent, "vs_ceiling": vs_ceiling,
                      "ring_bytes_per_step": measured, "ring_formula": formula, "cp_wait_share": many["cp_wait_share"],
                      "comm_wait_share": many["comm_wait_share"], "rounds": [r[0] for r in rounds]}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
