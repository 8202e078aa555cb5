#!/usr/bin/env python3
"""Pipeline parallelism against one rank on the bench model, measured in one run.

    python3 bench/pipeline.py --loom build/loom [--steps 12]

Trains bench/bench.deck (the same global batch of 8 every time) at pp = 1, then at pp = 2 with the
GPipe and 1F1B schedules and m = 1, 2, 4, 8 micro-batches (and interleaved 1F1B with 2 virtual
stages at m = 2, 4, 8), one BLAS thread per rank, and prints for
each: tokens/s and the ratio to pp = 1, the measured pipeline bubble (median over steps after the
first of the per-step bubble) next to the bubble of the step's schedule replayed with its measured
op times and free communication (pp_bubble_expected: measured - replay is what the messages cost)
and the textbook (p-1)/(vm+p-1), the peak activation memory of
stage 0 and stage 1 from the ledger, and the most micro-batches each stage held activations for at
once. GPipe holds all m on stage 0; 1F1B holds at most p, so its activation memory stops growing
with m while the bubble still shrinks. Standard library only. A benchmark, not a test.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PP = 2
MICRO_BATCHES = (1, 2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")


def run(loom, mpirun, pp, schedule, m, steps, workdir, timeout, virtual=1):
    rundir = os.path.join(workdir, "pp1" if pp == 1 else "pp%d-%s-v%d-m%d" % (pp, schedule, virtual, m))
    cmd = [mpirun, "-n", str(pp), loom, "run", os.path.join(HERE, "bench.deck"), "--set", "parallel.pp=%d" % pp]
    if pp > 1:
        cmd += ["--set", "pipeline.schedule=" + schedule, "--set", "pipeline.virtual_stages=%d" % virtual]
    cmd += ["--set", "train.micro_batches=%d" % m, "--set", "train.steps=%d" % steps,
            "--set", "train.log_every=1", "--set", "run.dir=" + rundir,
           "--set", "run.overwrite=true"]
    print("$ " + " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    # Own process group, so a hung run can be killed with all its ranks and nothing else.
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        sys.stderr.write(out[-3000:] + err)
        sys.exit("loom hung at pp = %d, %s, m = %d (killed after %d s)" % (pp, schedule, m, timeout))
    if p.returncode != 0:
        sys.stderr.write(out[-3000:] + err)
        sys.exit("loom failed at pp = %d, %s, m = %d" % (pp, schedule, m))
    with open(os.path.join(rundir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(rundir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return summary, recs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workdir", default="build/bench-pipeline")
    ap.add_argument("--timeout", type=int, default=300, help="seconds before one loom run counts as hung")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is excluded)")

    base, _ = run(args.loom, args.mpirun, 1, None, 1, args.steps, args.workdir, args.timeout)
    rows = []
    # GPipe and 1F1B at every m; interleaved 1F1B (2 virtual stages: 4 chunks of one layer) where m is
    # a multiple of pp, as it requires.
    plan = [(sch, 1, m) for sch in SCHEDULES for m in MICRO_BATCHES] + \
           [("1f1b", 2, m) for m in MICRO_BATCHES if m % PP == 0]
    for schedule, virtual, m in plan:
            s, recs = run(args.loom, args.mpirun, PP, schedule, m, args.steps, args.workdir, args.timeout, virtual)
            steady = recs[1:]  # the first step pays for first-touch allocation
            last = recs[-1]
            rows.append({
                "schedule": schedule if virtual == 1 else "1f1b v%d" % virtual, "m": m,
                "tokens_per_s": s["tokens_per_s"],
                "ratio_vs_pp1": s["tokens_per_s"] / base["tokens_per_s"],
                "bubble": statistics.median(r["pp_bubble"] for r in steady),
                "bubble_replay": statistics.median(r["pp_bubble_expected"] for r in steady),
                "bubble_textbook": (PP - 1) / (virtual * m + PP - 1),
                "activation_bytes": [last["pp_stage%d_activation_bytes" % st] for st in range(PP)],
                "inflight_max": [int(last["pp_stage%d_inflight_max" % st]) for st in range(PP)],
            })

    print()
    print("bench model (%d parameters), global batch 8 x 128 tokens, pp = %d, %d steps" % (
        base["parameters"], PP, args.steps))
    print("  %-8s %3s %10s %8s %8s %8s %9s %12s %12s %9s %9s" % (
        "schedule", "m", "tokens/s", "vs pp1", "bubble", "replay", "textbook", "act. st0", "act. st1", "infl st0",
        "infl st1"))
    print("  %-8s %3d %10.1f %8.3f %8s %8s %9s %8.2f MiB %12s %9s %9s" % (
        "pp 1", 1, base["tokens_per_s"], 1.0, "-", "-", "-", base["mem_peak_bytes"]["activations"] / 2**20, "-", "-",
        "-"))
    for r in rows:
        print("  %-8s %3d %10.1f %8.3f %8.3f %8.3f %9.3f %8.2f MiB %8.2f MiB %9d %9d" % (
            r["schedule"], r["m"], r["tokens_per_s"], r["ratio_vs_pp1"], r["bubble"], r["bubble_replay"],
            r["bubble_textbook"],
            r["activation_bytes"][0] / 2**20, r["activation_bytes"][1] / 2**20,
            r["inflight_max"][0], r["inflight_max"][1]))
    print()

    gp = {r["m"]: r for r in rows if r["schedule"] == "gpipe"}
    fb = {r["m"]: r for r in rows if r["schedule"] == "1f1b"}
    ok_gp = all(gp[m]["inflight_max"][0] == m for m in MICRO_BATCHES)
    ok_fb = all(fb[m]["inflight_max"][0] == min(m, PP) for m in MICRO_BATCHES)
    print("stage-0 in flight: gpipe %s (= m: %s), 1f1b %s (= min(m, p): %s)" % (
        "/".join(str(gp[m]["inflight_max"][0]) for m in MICRO_BATCHES), "yes" if ok_gp else "NO",
        "/".join(str(fb[m]["inflight_max"][0]) for m in MICRO_BATCHES), "yes" if ok_fb else "NO"))
    mt = MICRO_BATCHES[-1]
    a_gp, a_fb = gp[mt]["activation_bytes"][0], fb[mt]["activation_bytes"][0]
    print("stage-0 activation memory at m = %d: gpipe %.2f MiB / 1f1b %.2f MiB = %.2fx" % (
        mt, a_gp / 2**20, a_fb / 2**20, a_gp / a_fb if a_fb else float("nan")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
