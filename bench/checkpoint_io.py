#!/usr/bin/env python3
"""Checkpoint write and read bandwidth at 1 and 2 ranks against a plain sequential file write and
read of the same bytes, measured in the same run.

    python3 bench/checkpoint_io.py --loom build/loom [--layers 8]

For each rank count, loom trains the bench model (bench/bench.deck, deepened with --layers so the
file is large enough to time) for two steps, saving a checkpoint after each; then a second run
resumes from the last one. loom reports the bytes and seconds of every write and of the read. The
peer is Python writing the same number of bytes to one file in 4 MiB blocks and syncing it (loom's
file is flushed to disk, MPI_File_sync, before it is renamed), then reading them back, in the same
directory; both reads come from the page cache. Standard library only. A benchmark, not a test.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def loom_run(args, ranks, rundir, extra):
    cmd = [args.mpirun, "-n", str(ranks), args.loom, "run", os.path.join(HERE, "bench.deck"),
           "--set", "parallel.dp=%d" % ranks, "--set", "model.layers=%d" % args.layers, "--set", "train.batch=%d" % (2 * ranks),
           "--set", "run.dir=" + rundir, "--set", "checkpoint.every=1", "--set", "checkpoint.keep=3"] + extra
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    if p.returncode != 0:
        sys.exit(p.stdout[-2000:] + p.stderr)
    with open(os.path.join(rundir, "summary.json")) as f:
        return json.load(f)["checkpoint"]


def plain_io(path, nbytes):
    block = os.urandom(4 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())  # loom's checkpoint is synced to disk before it is renamed: so is the peer
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(4 << 20):
            pass
    read_s = time.perf_counter() - t0
    os.remove(path)
    return nbytes / 1e6 / write_s, nbytes / 1e6 / read_s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--workdir", default="build/bench-ckpt")
    args = ap.parse_args()
    rows = []
    for ranks in (1, 2):
        rundir = os.path.join(args.workdir, "np%d" % ranks)
        for d in (rundir, rundir + "-resumed"):  # fresh folders: loom refuses to train over an old run
            shutil.rmtree(d, ignore_errors=True)
        w = loom_run(args, ranks, rundir, ["--set", "train.steps=2"])
        r = loom_run(args, ranks, rundir + "-resumed",
                     ["--set", "train.steps=3", "--set", "checkpoint.resume=" + os.path.join(rundir, "checkpoints", "ckpt-00000002.h5")])
        nbytes = int(w["write_bytes"] / w["saves"])
        pw, pr = plain_io(os.path.join(args.workdir, "plain.bin"), nbytes)
        rows.append((ranks, nbytes, w["write_mb_per_s"], pw, r["read_mb_per_s"], pr))
    print()
    print("checkpoint of the bench model at %d layers (parameters + AdamW moments, fp32)" % args.layers)
    print("  %-6s %10s %12s %12s %8s %12s %12s %8s" % ("ranks", "MB", "write MB/s", "plain write", "ratio",
                                                      "read MB/s", "plain read", "ratio"))
    for ranks, nbytes, w, pw, r, pr in rows:
        print("  %-6d %10.1f %12.1f %12.1f %8.2f %12.1f %12.1f %8.2f" % (ranks, nbytes / 1e6, w, pw, w / pw, r, pr, r / pr))
    print(json.dumps([{"ranks": a, "bytes": b, "write_mb_s": c, "plain_write_mb_s": d, "read_mb_s": e,
                       "plain_read_mb_s": f} for a, b, c, d, e, f in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
