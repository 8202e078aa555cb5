#!/usr/bin/env python3
"""A multi-threaded rank on cores it shares with another process, with OpenMP's waiting threads
sleeping (OMP_WAIT_POLICY=PASSIVE), spinning (ACTIVE) or as libgomp decides (unset: loom's default), measured
in the same run of this script.

    python3 bench/shared_core.py --loom build/loom [--threads 2] [--steps 8]

Trains bench/bench.deck on one rank with run.threads = --threads, quiet and then beside one process that
spins on a core (a competing job on a shared node), each with OMP_WAIT_POLICY unset (libgomp's own
choice, as loom runs by default), PASSIVE and ACTIVE. Prints tokens/s (steady state, from summary.json)
and each one's ratio to the unset one in the same condition. Standard library only. A benchmark, not
a test: timings depend on what else the machine is doing.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = [("unset (loom's default)", None), ("PASSIVE", "PASSIVE"), ("ACTIVE", "ACTIVE")]


def run(args, policy):
    rundir = os.path.join(args.workdir, "run")
    shutil.rmtree(rundir, ignore_errors=True)
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [args.loom, "run", os.path.join(HERE, "bench.deck"), "--set", "run.dir=" + rundir,
           "--set", "run.threads=%d" % args.threads, "--set", "train.steps=%d" % args.steps]
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
    args = ap.parse_args()
    results = {}
    for condition in ("quiet", "beside a spinning process"):
        hog = None
        if condition != "quiet":
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            results[condition] = {name: run(args, policy) for name, policy in POLICIES}
        finally:
            if hog:
                hog.kill()
                hog.wait()
    print("\n%-28s %-28s %10s %8s" % ("condition", "OMP_WAIT_POLICY", "tokens/s", "ratio"))
    for condition, res in results.items():
        base = res[POLICIES[0][0]]
        for name, _ in POLICIES:
            print("%-28s %-28s %10.0f %8.2f" % (condition, name, res[name], res[name] / base))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
