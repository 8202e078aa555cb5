#!/usr/bin/env python3
"""Tensor parallelism against one rank on the bench model, measured in one run.

    python3 bench/tensor_parallel.py --loom build/loom [--steps 20]

Trains bench/bench.deck (the same global batch every time) at tp = 1, tp = 2, and tp = 2 with
sequence parallelism, one BLAS thread per rank, and prints for each: tokens/s and the ratio to
tp = 1, the share of the step spent waiting on communication, the tp bytes each rank sent per step,
and the parameter and activation memory per rank from the ledger. On two cores, tp = 2 uses both
cores for one model: the ratio says what splitting each layer costs and gains here.
Standard library only. A benchmark, not a test.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(loom, mpirun, tp, sp, steps, workdir):
    rundir = os.path.join(workdir, "tp%d%s" % (tp, "-sp" if sp else ""))
    cmd = [mpirun, "-n", str(tp), loom, "run", os.path.join(HERE, "bench.deck"), "--set", "parallel.tp=%d" % tp,
           "--set", "train.steps=%d" % steps, "--set", "train.log_every=1", "--set", "run.dir=" + rundir,
           "--set", "run.overwrite=true"]
    if tp > 1:
        cmd += ["--set", "tensor.sequence_parallel=%s" % ("true" if sp else "false")]
    print("$ " + " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr)
        sys.exit("loom failed at tp = %d" % tp)
    with open(os.path.join(rundir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(rundir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f][1:]  # the first step pays for first-touch allocation
    tp_bytes = sum(r["comm"].get("tp", {}).get("bytes_sent", 0) for r in recs) / max(1, len(recs))
    return summary, tp_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--workdir", default="build/bench-tp")
    args = ap.parse_args()
    rows = []
    for tp, sp in ((1, False), (2, False), (2, True)):
        s, tp_bytes = run(args.loom, args.mpirun, tp, sp, args.steps, args.workdir)
        rows.append((tp, sp, s, tp_bytes))
    base = rows[0][2]["tokens_per_s"]
    print()
    print("bench model (%d parameters), global batch 8 x 128 tokens, %d steps" % (rows[0][2]["parameters"], args.steps))
    print("  %-12s %10s %8s %10s %14s %14s %14s" % ("layout", "tokens/s", "vs tp1", "comm wait", "tp bytes/step",
                                                    "params/rank", "activ./rank"))
    out = []
    for tp, sp, s, tp_bytes in rows:
        mem = s["mem_peak_bytes"]
        name = "tp %d%s" % (tp, " + SP" if sp else "")
        print("  %-12s %10.1f %8.3f %9.1f%% %14.0f %11.2f MiB %11.2f MiB" % (
            name, s["tokens_per_s"], s["tokens_per_s"] / base, 100 * s["comm_wait_share"], tp_bytes,
            mem["params"] / 2**20, mem["activations"] / 2**20))
        out.append({"layout": name, "tokens_per_s": s["tokens_per_s"], "ratio_vs_tp1": s["tokens_per_s"] / base,
                    "comm_wait_share": s["comm_wait_share"], "tp_bytes_per_step": tp_bytes,
                    "params_bytes_per_rank": mem["params"], "activation_bytes_per_rank": mem["activations"]})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
