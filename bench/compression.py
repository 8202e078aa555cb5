#!/usr/bin/env python3
"""Gradient compression methods against uncompressed data parallelism on the bench model, in one run,
on this node's own transport and over emulated slower links.

    python3 bench/compression.py --loom build/loom [--steps 20] [--links 0 10 1 0.1] [--ranks 2]

Trains bench/bench.deck at dp = N (per-rank batch 8, one BLAS thread per rank, data_parallel.bucket_mb = 4)
with compression.method = none, fp16, bf16, int8, topk (ratio 0.01) and powersgd (rank 4, compressing
from step 6), each over every link in --links: 0 is the node's shared memory as it is; a positive value
is run.emulate_link_gbps, a link of that many Gbit/s per rank that every send waits its turn on (the
communicator's stated bandwidth model, no real network). For each it prints
  - the bytes rank 0 sent per step for the gradients and the ratio to the uncompressed run's;
  - the time spent compressing per step (compression_seconds);
  - the step time (median of the steady steps, the first excluded) and its ratio to the uncompressed
    run's over the same link: below 1, compression pays there;
  - the loss after the last step and its difference from the uncompressed run's (same data, same
    seed: what compression cost in accuracy at this length).
Then one JSON line with everything. Standard library only. A benchmark, not a test: timings depend on
what else the machine is doing; exit 0 when every run worked.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = [("none", []), ("fp16", []), ("bf16", []), ("int8", []), ("topk", ["compression.ratio=0.01"]),
           ("powersgd", ["compression.rank=4", "compression.start_step=5"])]


def run(args, method, sets, gbps):
    rundir = os.path.join(args.workdir, "%s-link%g" % (method, gbps))
    cmd = [args.mpirun, "-n", str(args.ranks), args.loom, "run", os.path.join(HERE, "bench.deck"),
           "--set", "parallel.dp=%d" % args.ranks, "--set", "train.batch=%d" % (8 * args.ranks),
           "--set", "train.steps=%d" % args.steps, "--set", "run.dir=" + rundir, "--set", "run.overwrite=true",
           "--set", "data_parallel.bucket_mb=4", "--set", "train.log_every=1", "--set", "compression.method=" + method,
           "--set", "run.emulate_link_gbps=%g" % gbps]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(p.stdout[-2000:] + p.stderr[-2000:])
        return None
    rows = [json.loads(line) for line in open(os.path.join(rundir, "metrics.jsonl")) if line.endswith("\n")]
    steady = rows[1:] if len(rows) > 1 else rows
    after = [r for r in steady if method != "powersgd" or r["step"] > 5] or steady  # PowerSGD once it compresses

    def med(rs, key, default=0.0):
        vals = [r[key] for r in rs if key in r]
        return statistics.median(vals) if vals else default
    return {"step_ms": med(steady, "step_ms"),
            "bytes": med(after, "compression_bytes", med(after, "dp_allreduce_bytes")),
            "compress_ms": 1e3 * med(after, "compression_seconds"),
            "loss": rows[-1]["loss"], "wait_share": med(steady, "comm_wait_share")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--links", type=float, nargs="+", default=[0, 10, 1, 0.1])
    ap.add_argument("--workdir", default="build/bench-compression")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    results, ok = {}, True
    for gbps in args.links:
        for method, sets in METHODS:
            r = run(args, method, sets, gbps)
            ok = ok and r is not None
            if r:
                results["%s@%g" % (method, gbps)] = r
    print("\nbench model at dp %d, %d steps; link: 0 = this node's transport, else emulated Gbit/s per rank"
          % (args.ranks, args.steps))
    print("  %-9s %6s  %12s %7s  %11s  %9s %7s  %8s %9s" % ("method", "link", "bytes/step", "ratio", "compress ms",
                                                           "step ms", "vs none", "loss", "vs none"))
    for gbps in args.links:
        base = results.get("none@%g" % gbps)
        for method, _ in METHODS:
            r = results.get("%s@%g" % (method, gbps))
            if not r or not base:
                continue
            r["bytes_ratio"] = r["bytes"] / base["bytes"] if base["bytes"] else 0
            r["step_ratio"] = r["step_ms"] / base["step_ms"]
            r["loss_diff"] = r["loss"] - base["loss"]
            print("  %-9s %6s  %12d %7.4f  %11.2f  %9.1f %7.3f  %8.4f %+9.4f"
                  % (method, "node" if gbps == 0 else "%g" % gbps, r["bytes"], r["bytes_ratio"], r["compress_ms"],
                     r["step_ms"], r["step_ratio"], r["loss"], r["loss_diff"]))
    print(json.dumps({"ranks": args.ranks, "steps": args.steps, "results": results}, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
