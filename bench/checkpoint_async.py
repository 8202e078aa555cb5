#!/usr/bin/env python3
"""What a checkpoint costs the training, written synchronously and in the background
(checkpoint.async), measured in the same run of this script.

    python3 bench/checkpoint_async.py --loom build/loom [--layers 8] [--steps 24] [--every 4] [--ranks 1]

Trains bench/bench.deck (deepened with --layers, so the file takes time to write) for --steps steps,
saving every --every, once with checkpoint.async = false and once with true, one BLAS thread per rank.
From metrics.jsonl (each row's wall_ms: the step with its evaluation and its checkpoint) it prints,
for each: the median wall time of an ordinary step, of a checkpointing step, and of the steps during
which an async write was in flight (they share the machine with the writer), the checkpoint step's
ratio to an ordinary one, and the whole loop's time. Then one JSON line. Standard library only. A
benchmark, not a test: timings depend on what else the machine is doing.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(args, asynchronous):
    rundir = os.path.join(args.workdir, "async" if asynchronous else "sync")
    shutil.rmtree(rundir, ignore_errors=True)
    cmd = ([args.mpirun, "-n", str(args.ranks)] if args.ranks > 1 else []) + [
        args.loom, "run", os.path.join(HERE, "bench.deck"), "--set", "parallel.dp=%d" % args.ranks,
        "--set", "model.layers=%d" % args.layers, "--set", "train.batch=%d" % (2 * args.ranks),
        "--set", "train.steps=%d" % args.steps, "--set", "train.log_every=1", "--set", "run.dir=" + rundir,
        "--set", "checkpoint.every=%d" % args.every, "--set", "checkpoint.keep=2", "--set", "checkpoint.at_end=false",
        "--set", "checkpoint.async=%s" % ("true" if asynchronous else "false")]
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    if p.returncode != 0:
        sys.exit(p.stdout[-2000:] + p.stderr)
    rows = [json.loads(x) for x in open(os.path.join(rundir, "metrics.jsonl"))][1:]  # the first pays first touch
    saving = [r for r in rows if "checkpoint" in r]
    writing, in_flight = [], False
    for r in rows:  # an async write is in flight from its step until the row that reports it written
        if "checkpoint_written" in r:
            in_flight = False
        if in_flight:
            writing.append(r)
        if "checkpoint" in r and asynchronous:
            in_flight = True
    plain = [r for r in rows if r not in saving and r not in writing]
    med = lambda rs: statistics.median(r["wall_ms"] for r in rs) if rs else float("nan")  # noqa: E731
    with open(os.path.join(rundir, "summary.json")) as f:
        s = json.load(f)
    return {"ordinary_ms": med(plain), "checkpoint_step_ms": med(saving), "while_writing_ms": med(writing),
            "train_s": s["train_time_s"], "loop_s": sum(r["wall_ms"] for r in rows) / 1e3,
            "write_s": s["checkpoint"]["write_s"], "saves": s["checkpoint"]["saves"],
            "mb": s["checkpoint"]["write_bytes"] / 1e6 / max(1, s["checkpoint"]["saves"])}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", required=True)
    ap.add_argument("--mpirun", default="mpiexec")
    ap.add_argument("--workdir", default="build/bench-checkpoint-async")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=1)
    args = ap.parse_args()
    res = {"sync": run(args, False), "async": run(args, True)}
    print("\n%-6s %10s %14s %16s %8s %12s %10s" % ("", "ordinary", "checkpointing", "while writing", "ratio",
                                                   "loop (s)", "MB/ckpt"))
    for k, r in res.items():
        print("%-6s %8.1f ms %11.1f ms %13.1f ms %7.2fx %12.2f %10.1f" % (
            k, r["ordinary_ms"], r["checkpoint_step_ms"], r["while_writing_ms"],
            r["checkpoint_step_ms"] / r["ordinary_ms"], r["loop_s"], r["mb"]))
    print("async loop / sync loop: %.3f" % (res["async"]["loop_s"] / res["sync"]["loop_s"]))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
