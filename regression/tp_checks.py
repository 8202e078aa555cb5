#!/usr/bin/env python3
"""Tensor-parallel traffic and memory, checked against the formulas for the layout.

    python3 regression/tp_checks.py --loom build/loom --workdir build/tp-checks [--ranks 2]

Runs a small deck at tp = N without and with sequence parallelism (and one process for reference),
then checks, step by step:
  1. the bytes each rank's tp communicator sent equal the textbook volume of the collectives the
     layout needs (ring all-reduce 2(N-1)/N M, reduce-scatter and all-gather (N-1)/N M each):
       per micro-batch, M = rows x T x C x 4 bytes:
         without SP: forward 1 + 2L all-reduces (embedding, attention and MLP outputs),
                     backward 1 + 2L all-reduces (head input, the two column-parallel inputs);
         with SP:    forward 1 reduce-scatter + L x (2 all-gather + 2 reduce-scatter) + 1 all-gather,
                     backward 1 all-gather + 1 reduce-scatter (head) + L x (4 all-gather + 2
                     reduce-scatter) + 1 all-gather (embedding) -- the LayerNorm outputs are gathered
                     again in backward rather than kept whole;
         vocabulary-parallel cross-entropy: a max all-reduce of the row maxima (N floats) and two
         sum all-reduces of N doubles; with SP, one all-reduce of the replicated gradients that each
         rank saw only in part ((6L + 2) C floats);
       plus the replica check (an all-gather of 2 floats: a hash of the replicated parameters and
       gradients) and the scalar all-reduce of the gradient norm (at most 2(N-1) x 8 bytes);
  0. the replicated tensors (LayerNorms, row-parallel biases, position embedding) stay identical
     on every rank of the group at every step (tp_replicas_identical);
  2. parameters, gradients and optimizer state per rank are the split share (1/N) of the one-process
     figure plus the replicated LayerNorms, biases of row-parallel layers and position embedding;
  3. sequence parallelism lowers the activation memory the ledger reports.
Standard library only.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

L, C, H, T, V, B = 2, 64, 4, 32, 256, 4  # the deck below


def run(args, ranks, sets, workdir, tag):
    loom = args.loom
    rundir = os.path.join(workdir, tag)
    shutil.rmtree(rundir, ignore_errors=True)  # each check starts afresh (a fresh run refuses earlier results)
    os.makedirs(rundir)
    deck = os.path.join(rundir, "tp.deck")
    with open(deck, "w") as f:
        f.write("[model]\nlayers = %d\nd_model = %d\nheads = %d\nseq_len = %d\nvocab = %d\n"
                "[train]\nsteps = 3\nbatch = %d\neval_every = 0\n[data]\nval_fraction = 0\n" % (L, C, H, T, V, B))
    cmd = common.launch_prefix(args, ranks) + [loom, "run", deck, "--set", "run.dir=" + rundir]
    for s in sets:
        cmd += ["--set", s]
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    if p.returncode != 0:
        sys.exit(p.stdout[-2000:] + p.stderr)
    with open(os.path.join(rundir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    common.add_launcher_arguments(ap)
    args = ap.parse_args()
    n = args.ranks
    failures = []

    rows = B * T
    M = rows * C * 4
    ar = lambda m: 2.0 * (n - 1) / n * m      # ring all-reduce, per rank
    half = lambda m: 1.0 * (n - 1) / n * m    # ring reduce-scatter or all-gather of m bytes in all
    ce = ar(rows * 4) + 2 * ar(rows * 8)
    replica_check = half(2 * n * 4)
    expected = {
        False: (1 + 2 * L) * ar(M) + (1 + 2 * L) * ar(M) + ce + replica_check,
        True: ((1 + 4 * L + 1) + (2 + 6 * L + 1)) * half(M) + ce + ar((6 * L + 2) * C * 4) + replica_check,
    }
    scalar_slack = 2 * (n - 1) * 8

    one = run(args, 1, [], args.workdir, "tp1")
    base_mem = one[-1]["mem_peak_bytes"]
    act = {}
    for sp in (False, True):
        recs = run(args, n, ["parallel.tp=%d" % n, "tensor.sequence_parallel=%s" % str(sp).lower()],
                   args.workdir, "tp%d-sp%d" % (n, sp))
        for r in recs:
            if r.get("tp_replicas_identical") != 1:
                failures.append("sp=%s step %d: replicated tensors differ across the tp group" % (sp, r["step"]))
            got = r["comm"]["tp"]["bytes_sent"]
            want = expected[sp]
            ok = want <= got <= want + scalar_slack
            print("sp=%-5s step %d: tp bytes sent per rank %d, formula %.0f (+ at most %d for the norm scalar): %s"
                  % (sp, r["step"], got, want, scalar_slack, "ok" if ok else "MISMATCH"))
            if not ok:
                failures.append("sp=%s step %d: tp bytes %d, formula %.0f" % (sp, r["step"], got, want))
        mem = recs[-1]["mem_peak_bytes"]
        act[sp] = mem["activations"]
        # Split tensors: wte, qkv, fc (weights and biases), proj weights. Replicated: the rest.
        replicated = (T * C + L * (6 * C) + 2 * C) * 4
        split = base_mem["params"] - replicated
        want_params = split / n + replicated
        print("sp=%-5s params per rank %d bytes; one process %d; expected split/%d + replicated = %.0f"
              % (sp, mem["params"], base_mem["params"], n, want_params))
        for cat, factor in (("params", 1), ("grads", 1), ("optimizer", 2)):
            if abs(mem[cat] - factor * want_params) > 0.5:
                failures.append("sp=%s %s per rank %d, expected %.0f" % (sp, cat, mem[cat], factor * want_params))
    print("activations per rank: one process %d, tp=%d %d, tp=%d with SP %d bytes"
          % (base_mem["activations"], n, act[False], n, act[True]))
    if not act[True] < act[False] < base_mem["activations"]:
        failures.append("activation memory does not fall from one process to tp to tp+SP")
    for f in failures:
        print("FAIL: " + f)
    print("tp checks: %s" % ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
