#!/usr/bin/env python3
"""A multi-threaded rank on cores it shares, with OpenMP's waiting threads sleeping
(OMP_WAIT_POLICY=PASSIVE), spinning (ACTIVE), spinning a while (GOMP_SPINCOUNT) or as loom decides
(unset: core/backend/wait_policy.hpp), measured in the same run of this script.

    python3 bench/shared_core.py --loom build/loom [--threads 2] [--steps 8] [--mpirun mpirun]

Trains bench/bench.deck with run.threads = --threads (OMP_NUM_THREADS set to it, as a job script
does) in three conditions: one rank, quiet; one rank beside a process that spins on a core (a
competing job on a shared node); and two ranks at dp = 2 on this machine (loom's own ranks sharing
the cores when 2 x threads exceeds them). In each, OMP_WAIT_POLICY unset (loom's default: loom sets
PASSIVE itself where its own ranks x threads exceed the CPUs), set empty (libgomp's default, which
loom leaves alone: what loom did before it decided), PASSIVE, ACTIVE and two GOMP_SPINCOUNTs. Prints
tokens/s (steady state, from rank 0's summary.json) and each one's ratio to the unset one in the same
condition. Standard library only. A benchmark, not a test: timings depend on what else the machine
is doing.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# (name, environment): OMP_WAIT_POLICY, and libgomp's GOMP_SPINCOUNT (how long a waiting thread spins
# before it sleeps; libgomp's default without a policy is 300000, PASSIVE is 0).
POLICIES = [("unset (loom's default)", {}), ("empty (libgomp's default)", {"OMP_WAIT_POLICY": ""}),
            ("PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}),
            ("ACTIVE", {"OMP_WAIT_POLICY": "ACTIVE"}), ("GOMP_SPINCOUNT=10000", {"GOMP_SPINCOUNT": "10000"}),
            ("GOMP_SPINCOUNT=1000", {"GOMP_SPINCOUNT": "1000"})]


def run(args, policy, ranks=1):
    rundir = os.path.join(args.workdir, "run")
    shutil.rmtree(rundir, ignore_errors=True)
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    env.update(policy)
    env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [args.loom, "run", os.path.join(HERE, "bench.deck"), "--set", "run.dir=" + rundir,
           "--set", "run.threads=%d" % args.threads, "--set", "train.steps=%d" % args.steps]
    if ranks > 1:
        cmd = [args.mpirun, "-n", str(ranks)] + cmd + ["--set", "parallel.dp=%d" % ranks,
                                                        "--set", "train.batch=%d" % (8 * ranks)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(p.stdout[-2000:] + p.stderr)
    with open(os.path.join(rundir, "summary.json")) as f:
        return json.load(f)["tokens_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", required=True)
    ap.add_argument("--workdir", default="build/bench-shared-core")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--mpirun", default="mpirun")
    args = ap.parse_args()
    results = {}
    for condition in ("quiet", "beside a spinning process", "2 ranks (dp = 2)"):
        hog = None
        if condition.startswith("beside"):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        ranks = 2 if condition.startswith("2 ranks") else 1
        try:
            results[condition] = {name: run(args, policy, ranks) for name, policy in POLICIES}
        finally:
            if hog:
                hog.kill()
                hog.wait()
    print("\n%-28s %-28s %10s %8s" % ("condition", "wait policy", "tokens/s", "ratio"))
    for condition, res in results.items():
        base = res[POLICIES[0][0]]
        for name, _ in POLICIES:
            print("%-28s %-28s %10.0f %8.2f" % (condition, name, res[name], res[name] / base))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
