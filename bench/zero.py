#!/usr/bin/env python3
"""ZeRO stages 0-3 against each other on the bench model, measured in one run.

    python3 bench/zero.py --loom build/loom [--steps 20] [--ranks 2 4] [--layers 16]

For each dp size N, trains bench/bench.deck (4 layers; --layers L: L instead, to see how the
buffers loom adds shrink against the model as it deepens; per-rank batch 8, one BLAS thread per rank,
zero.bucket_mb = data_parallel.bucket_mb = 4) at zero.stage = 0 (plain data parallelism), 1, 2 and 3 (prefetch
depth 1), and stages 1-3 once more with nothing overlapped (zero.overlap_comm = false, and at stage 3
zero.prefetch_depth = 0: every gather waited when its unit is used), and prints for each:
  - tokens/s and the step time against stage 0's (median of the steady steps, the first excluded);
  - rank 0's peak memory per category (parameters, gradients, AdamW, from the ledger) and the model
    state they add up to, against the textbook
    (stage 0 16P, 1: 4P + 4P + 8P/N, 2: 4P + 4P/N + 8P/N, 3: 16P/N) and the buffers loom adds (the
    collectives' scratch, gradient staging, gathered parameters);
  - the bytes rank 0 sent per step against the textbook (2(N-1)/N M for stages 0-2, 3(N-1)/N M for 3);
  - the share of the step spent waiting on communication, and the share of the waiting the overlap
    hid: 1 - wait(overlapped) / wait(nothing overlapped).
Then one JSON line with everything. Standard library only. A benchmark, not a test: the numbers
depend on what else the machine is doing; exit 0 when every run worked.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(args, n, stage, workdir, overlap=True):
    rundir = os.path.join(workdir, "dp%d-zero%d%s-L%s" % (n, stage, "" if overlap else "-serial", args.layers or "deck"))
    cmd = [args.mpirun, "-n", str(n), args.loom, "run", os.path.join(HERE, "bench.deck"),
           "--set", "parallel.dp=%d" % n, "--set", "train.batch=%d" % (8 * n), "--set", "train.steps=%d" % args.steps,
           "--set", "run.dir=" + rundir, "--set", "run.overwrite=true", "--set", "data_parallel.bucket_mb=4",
           "--set", "zero.stage=%d" % stage, "--set", "zero.bucket_mb=4", "--set", "train.log_every=1"]
    if not overlap:
        cmd += ["--set", "zero.overlap_comm=false", "--set", "zero.prefetch_depth=0"]
    if args.layers:
        cmd += ["--set", "model.layers=%d" % args.layers]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        return None, (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
    rows = [json.loads(line) for line in open(os.path.join(rundir, "metrics.jsonl")) if line.strip()][1:]
    summary = json.load(open(os.path.join(rundir, "summary.json")))
    return {"summary": summary, "rows": rows}, None


def median(rows, key):
    return statistics.median(r.get(key, 0) for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--workdir", default="build/bench-zero")
    ap.add_argument("--layers", type=int, default=0, help="model.layers instead of the bench deck's")
    args = ap.parse_args()
    out, ok = {}, True
    for n in args.ranks:
        base = None
        serial_wait = {}
        for stage in (1, 2, 3):
            res, err = run(args, n, stage, args.workdir, overlap=False)
            if res is None:
                print("dp %d, zero.stage %d, nothing overlapped: failed: %s" % (n, stage, err))
                ok = False
                continue
            serial_wait[stage] = statistics.median(r["comm"]["dp"]["wait_ms"] for r in res["rows"])
            out["dp%d_zero%d_serial" % (n, stage)] = {"step_ms": median(res["rows"], "step_ms"), "wait_ms": serial_wait[stage]}
        for stage in (0, 1, 2, 3):
            res, err = run(args, n, stage, args.workdir)
            key = "dp%d_zero%d" % (n, stage)
            if res is None:
                print("dp %d, zero.stage %d: failed: %s" % (n, stage, err))
                out[key] = {"error": err}
                ok = False
                continue
            rows, summ = res["rows"], res["summary"]
            P = summ["parameters_rank0"]
            step_ms = median(rows, "step_ms")
            mem = rows[-1]["mem_peak_bytes"]
            state = mem["params"] + mem["grads"] + mem["optimizer"]
            # The textbook per category: parameters, gradients, AdamW moments.
            book = {0: (4 * P, 4 * P, 8 * P), 1: (4 * P, 4 * P, 8 * P / n), 2: (4 * P, 4 * P / n, 8 * P / n),
                    3: (4 * P / n, 4 * P / n, 8 * P / n)}[stage]
            textbook_state = sum(book)
            sent = statistics.median(sum(g["bytes_sent"] for g in r["comm"].values()) for r in rows)
            formula = (3 if stage == 3 else 2) * (n - 1) / n * 4 * P
            wait = median(rows, "comm_wait_share")
            wait_ms = statistics.median(r["comm"]["dp"]["wait_ms"] for r in rows)
            hidden = 1 - wait_ms / serial_wait[stage] if serial_wait.get(stage) else None
            if base is None:
                base = step_ms
            staging, gathered = rows[-1].get("zero_grad_staging_bytes", 0), rows[-1].get("zero_param_gather_bytes", 0)
            rec = {"tokens_per_s": summ["tokens_per_s"], "step_ms": step_ms, "step_vs_stage0": step_ms / base,
                   "model_state_bytes": state, "model_state_textbook_bytes": textbook_state,
                   "optimizer_bytes": mem["optimizer"], "comm_scratch_bytes": mem["comm"], "grad_staging_bytes": staging,
                   "param_gather_bytes": gathered, "bytes_sent": sent, "bytes_formula": formula,
                   "comm_wait_share": wait, "wait_hidden_share": hidden}
            out[key] = rec
            rec["by_category"] = {"params": [mem["params"], book[0]], "grads": [mem["grads"], book[1]],
                                  "optimizer": [mem["optimizer"], book[2]]}
            print("dp %d, zero.stage %d: %8.0f tokens/s, step %.1f ms (x%.3f of stage 0) | model state %.2f MiB "
                  "(textbook %.2f MiB; + staging %.2f, gathered %.2f) + comm scratch %.2f MiB | sent %.2f MiB/step "
                  "(textbook %.2f MiB, x%.3f) | waiting %.1f%% of the step%s"
                  % (n, stage, rec["tokens_per_s"], step_ms, rec["step_vs_stage0"], state / 2**20, textbook_state / 2**20,
                     staging / 2**20, gathered / 2**20, mem["comm"] / 2**20, sent / 2**20, formula / 2**20, sent / formula,
                     100 * wait, "" if hidden is None else ", %.0f%% of the waiting hidden by overlap" % (100 * hidden)))
            print("    peak per category (textbook): parameters %.2f (%.2f) MiB, gradients %.2f (%.2f) MiB, AdamW %.2f (%.2f) MiB"
                  % (mem["params"] / 2**20, book[0] / 2**20, mem["grads"] / 2**20, book[1] / 2**20,
                     mem["optimizer"] / 2**20, book[2] / 2**20))
    print(json.dumps(out, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
