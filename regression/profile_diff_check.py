#!/usr/bin/env python3
"""bench/profile_diff.py on real LOOM_CUDA_PROFILE tables: two one-step runs on the emulated device
(LOOM_CUDA_BACKEND_LIBRARY, set by the caller), unfused then fused attention, must show the unfused
attention as gone, the fused as new, and the operations both run with their calls; a log without a
table exits 2 naming it.

  python3 regression/profile_diff_check.py --loom build/loom --workdir DIR
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DIFF = os.path.join(HERE, "..", "bench", "profile_diff.py")
SMALL = ["model.layers=2", "model.d_model=32", "model.heads=2", "model.seq_len=16", "model.vocab=64",
         "train.batch=2", "train.steps=1", "run.peak_tflops=1", "run.overwrite=true"]


def profile(args, attention):
    log = os.path.join(args.workdir, attention + ".log")
    cmd = [args.loom, "run", os.path.join(HERE, "..", "bench", "gpu.deck")]
    for kv in SMALL + ["model.attention=" + attention, "run.dir=" + os.path.join(args.workdir, attention)]:
        cmd += ["--set", kv]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, LOOM_CUDA_PROFILE="1")).returncode
    if rc != 0:
        sys.exit("profile_diff_check: %s exited %d (log %s)" % (" ".join(cmd), rc, log))
    return log


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    if not os.environ.get("LOOM_CUDA_BACKEND_LIBRARY"):
        print("profile_diff_check: set LOOM_CUDA_BACKEND_LIBRARY (the emulated device)")
        return 2
    before, after = profile(args, "unfused"), profile(args, "flash")
    p = subprocess.run([sys.executable, DIFF, before, after, "--steps", "1"], capture_output=True, text=True)
    print(p.stdout + p.stderr)
    failures = []
    if p.returncode != 0:
        failures.append("exit %d" % p.returncode)
    rows = {l.split()[0]: l.split() for l in p.stdout.splitlines() if l.strip()}
    if rows.get("attention_forward", [""])[-1] != "gone":
        failures.append("the unfused attention is not shown as gone")
    if rows.get("attention_forward_flash", [""])[-1] != "new":
        failures.append("the fused attention is not shown as new")
    ln = rows.get("layernorm_forward")
    if not ln or ln[1] != ln[3] or ln[1] == "-":
        failures.append("layernorm_forward: not the same calls in both runs: %s" % ln)
    if not any(l.startswith("total") for l in p.stdout.splitlines()):
        failures.append("no total")
    q = subprocess.run([sys.executable, DIFF, os.path.join(HERE, "..", "bench", "gpu.deck"), after],
                       capture_output=True, text=True)
    if q.returncode != 2 or "gpu.deck holds no LOOM_CUDA_PROFILE table" not in q.stderr:
        failures.append("a log without a table: exit %d, %r" % (q.returncode, q.stderr))
    for f in failures:
        print("FAIL " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
