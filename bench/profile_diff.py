#!/usr/bin/env python3
"""Per-operation GPU times of two loom runs side by side (LOOM_CUDA_PROFILE's tables: before, after).

Usage:
  python3 bench/profile_diff.py BEFORE.log AFTER.log [--steps N] [--top K]

Each log holds what `LOOM_CUDA_PROFILE=1 loom run ...` printed on stderr (bench/gpu_session.sh's
steps.log or bench.log of a profile step, or a run's own log): the table after "CUDA operation times
on device 0". With several tables in one log, the last is read. Prints, per operation, the calls and
milliseconds of each run (per step with --steps N: the runs' step count, the first step included,
as the table is), after / before, and the operations found in one run only; then the totals. The
start-up measurement of the product rate (matmul_forward 4096x4096x4096, absent with
run.peak_tflops) is left out of the totals and said so. Exit 2 when a log holds no table.
"""
import argparse
import re
import sys

HEADER = re.compile(r"CUDA operation times on device (\d+) \(LOOM_CUDA_PROFILE\), ([0-9.]+) ms in all")
ROW = re.compile(r"^\s{2}(\S.*?)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)%\s*$")
STARTUP = "matmul_forward 4096x4096x4096"


def read_table(path):
    """{operation: (calls, ms)} of the last table in the log."""
    tables, current = [], None
    with open(path, errors="replace") as f:
        for line in f:
            if HEADER.search(line):
                current = {}
                tables.append(current)
                continue
            if current is None:
                continue
            m = ROW.match(line.rstrip("\n"))
            if m:
                current[m.group(1)] = (int(m.group(2)), float(m.group(3)))
            elif line.strip() and not line.lstrip().startswith("operation"):
                current = None  # the table ended
    if not tables or not tables[-1]:
        sys.stderr.write("profile_diff: %s holds no LOOM_CUDA_PROFILE table (run with LOOM_CUDA_PROFILE=1)\n" % path)
        sys.exit(2)
    return tables[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--steps", type=int, default=0, help="divide times and calls by this many steps")
    ap.add_argument("--top", type=int, default=0, help="only the K operations slowest before or after")
    args = ap.parse_args()
    a, b = read_table(args.before), read_table(args.after)
    per = float(args.steps) if args.steps > 0 else 1.0
    unit = "ms/step" if args.steps > 0 else "ms"
    ops = sorted(set(a) | set(b), key=lambda k: -max(a.get(k, (0, 0))[1], b.get(k, (0, 0))[1]))
    if args.top > 0:
        ops = ops[:args.top]
    print("%-44s %7s %10s %7s %10s %7s" % ("operation", "calls", "before " + unit, "calls", "after " + unit,
                                           "after/before"))
    for k in ops:
        ca, ma = a.get(k, (0, 0.0))
        cb, mb = b.get(k, (0, 0.0))
        if k in a and k in b:
            ratio = "%.2f" % (mb / ma) if ma > 0 else "-"
        else:
            ratio = "gone" if k not in b else "new"
        print("%-44s %7s %10.3f %7s %10.3f %7s" % (k[:44], ("%g" % (ca / per)) if k in a else "-", ma / per,
                                                 ("%g" % (cb / per)) if k in b else "-", mb / per, ratio))
    ta = sum(ms for k, (_, ms) in a.items() if k != STARTUP)
    tb = sum(ms for k, (_, ms) in b.items() if k != STARTUP)
    print("%-44s %7s %10.3f %7s %10.3f %7s" % ("total (without the start-up product)", "", ta / per, "", tb / per,
                                             "%.2f" % (tb / ta) if ta > 0 else "-"))
    if STARTUP in a or STARTUP in b:
        print("(%s is the start-up measurement of the product rate, not part of a step)" % STARTUP)
    return 0


if __name__ == "__main__":
    sys.exit(main())
