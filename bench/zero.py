#!/usr/bin/env python3
"""ZeRO against plain data parallelism on the bench model, measured in one run.

    python3 bench/zero.py --loom build/loom [--steps 20] [--ranks 2 4]

For each dp size N, trains bench/bench.deck (per-rank batch 8, one BLAS thread per rank,
zero.bucket_mb = data.bucket_mb = 4) at zero.stage = 0 (plain data parallelism) and each ZeRO stage
this loom builds (today: 1; 2 and 3 are refused and reported as not built), and prints for each:
  - tokens/s and the step time against stage 0's (steady steps, first excluded);
  - rank 0's peak memory per category from the ledger (parameters, gradients, AdamW state,
    communication scratch) and the model state against the textbook: stage 0 4P + 4P + 8P,
    stage 1 4P + 4P + 8P/N;
  - the bytes rank 0 sent per step against the formula (2(N-1)/N M for stages 0 and 1);
  - the share of the step spent waiting on communication (the part not hidden behind compute).
Then one JSON line with everything. Standard library only. A benchmark, not a test: the numbers
depend on what else the machine is doing; exit 0 when every run that should work did.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(args, n, stage, workdir):
    rundir = os.path.join(workdir, "dp%d-zero%d" % (n, stage))
    cmd = [args.mpirun, "-n", str(n), args.loom, "run", os.path.join(HERE, "bench.deck"),
           "--set", "parallel.dp=%d" % n, "--set", "train.batch=%d" % (8 * n), "--set", "train.steps=%d" % args.steps,
           "--set", "run.dir=" + rundir, "--set", "run.overwrite=true", "--set", "data.bucket_mb=4",
           "--set", "zero.stage=%d" % stage, "--set", "zero.bucket_mb=4", "--set", "train.log_every=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        return None, (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
    rows = [json.loads(line) for line in open(os.path.join(rundir, "metrics.jsonl")) if line.strip()][1:]
    summary = json.load(open(os.path.join(rundir, "summary.json")))
    return {"summary": summary, "rows": rows}, None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--workdir", default="build/bench-zero")
    args = ap.parse_args()
    out, ok = {}, True
    for n in args.ranks:
        base = None
        for stage in (0, 1, 2, 3):
            res, err = run(args, n, stage, args.workdir)
            key = "dp%d_zero%d" % (n, stage)
            if res is None:
                print("dp %d, zero.stage %d: not run: %s" % (n, stage, err))
                out[key] = {"error": err}
                ok = ok and stage >= 2  # stages 2 and 3 are refused while not built
                continue
            rows, summ = res["rows"], res["summary"]
            P = summ["parameters_rank0"]
            step_ms = statistics.median(r["step_ms"] for r in rows)
            mem = rows[-1]["mem_peak_bytes"]
            state = mem["params"] + mem["grads"] + mem["optimizer"]
            textbook_state = 8 * P + (8 * P if stage == 0 else 8 * P / n)
            sent = statistics.median(sum(g["bytes_sent"] for g in r["comm"].values()) for r in rows)
            formula = 2 * (n - 1) / n * 4 * P
            wait = statistics.median(r["comm_wait_share"] for r in rows)
            if base is None:
                base = step_ms
            rec = {"tokens_per_s": summ["tokens_per_s"], "step_ms": step_ms, "step_vs_stage0": step_ms / base,
                   "model_state_bytes": state, "model_state_textbook_bytes": textbook_state,
                   "optimizer_bytes": mem["optimizer"], "comm_scratch_bytes": mem["comm"], "bytes_sent": sent,
                   "bytes_formula": formula, "comm_wait_share": wait}
            out[key] = rec
            print("dp %d, zero.stage %d: %8.0f tokens/s, step %.1f ms (x%.3f of stage 0) | model state %.2f MiB "
                  "(textbook %.2f MiB; AdamW %.2f MiB) + comm scratch %.2f MiB | sent %.2f MiB/step (formula %.2f MiB) | "
                  "waiting %.1f%% of the step"
                  % (n, stage, rec["tokens_per_s"], step_ms, rec["step_vs_stage0"], state / 2**20, textbook_state / 2**20,
                     mem["optimizer"] / 2**20, mem["comm"] / 2**20, sent / 2**20, formula / 2**20, 100 * wait))
    print(json.dumps(out, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
