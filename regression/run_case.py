#!/usr/bin/env python3
"""Runs one loom regression case (a JSON file in regression/cases/) and checks it.

    python3 regression/run_case.py --loom build/loom --case regression/cases/golden-synthetic.json \
        --workdir build/regression [--regenerate]

A case records its deck lines and what to check, LAMMPS-style:
  "deck":     the deck, as a list of lines (so the case is self-contained)
  "sets":     --set overrides for the run under test
  "ranks":    MPI ranks (default 1; launched with mpirun -n R when R > 1 or "mpirun" is true)
  "env":      extra environment (@BUILD@ stands for the directory of the loom binary)
  "command":  the loom command (default "run"; "check" validates the deck and its layout only)
  "files":    files made in the run's directory before the run (bad input cases), name -> one of
                {"text": "..."}   a file holding that text ("" for an empty file)
                {"dir": true}     a directory
                {"fifo": true}    a FIFO (named pipe), which no reader may wait on
                {"llmc_shard": {"header_tokens": N, "tokens": M}}  an llm.c token shard whose
                                  header counts N tokens and which holds M (token i is i % 64)
              (a name may hold a folder: "checkpoints/latest"); "@RUN@" in "sets" stands for that directory
  "deck_file": the name of one of "files" to run as the deck instead of "deck"
  "timeout":  seconds before the run counts as hung (default 600)
  "check":    one of
     "golden"   compare the per-step losses (and the final val loss) with "golden", values recorded at
                full precision by --regenerate; nobody types golden numbers by hand
     "same_as"  run the deck again with "reference_sets" and compare the loss curves step by step
                on "reference_ranks" (default 1) ranks, e.g. dp = 4 against one process; with
                "differs": true the curves must also differ somewhere (the path under test ran)
     "learns"   the final loss must fall below "max_final_loss" and below the first loss by "min_drop"
     "error"    the run must fail with exit status "exit" and stderr matching every regex in "stderr"
  "epsilon":  {"base": e, "scale": {"loss": s, "val_loss": s}}: tolerance for a quantity is
              base * scale[quantity] relative to the reference (|a - b| <= eps * max(1, |b|));
              "same_as" also compares the per-step gradient norm when the scale names "grad_norm", and
              with "same_routing": true every step's expert load (moe_load) exactly.
Standard library only: runs with any python3.
"""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def write_deck(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def make_file(path, spec):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if spec.get("dir"):
        os.makedirs(path)
    elif spec.get("fifo"):
        os.mkfifo(path)
    elif "text" in spec:
        with open(path, "w") as f:
            f.write(spec["text"])
    elif "llmc_shard" in spec:
        shard = spec["llmc_shard"]
        header = struct.pack("<3i", 20240520, 1, shard["header_tokens"]) + bytes(1024 - 12)
        tokens = struct.pack("<%dH" % shard["tokens"], *(i % 64 for i in range(shard["tokens"])))
        with open(path, "wb") as f:
            f.write(header + tokens)
    else:
        raise ValueError("unknown file spec %r" % spec)


def run_loom(args, case, workdir, tag, sets, ranks=None):
    """Runs loom on the case's deck; returns (exit status, stdout, stderr, metrics records)."""
    rundir = os.path.join(workdir, tag)
    shutil.rmtree(rundir, ignore_errors=True)
    os.makedirs(rundir)
    for name, spec in case.get("files", {}).items():
        make_file(os.path.join(rundir, name), spec)
    deck = os.path.join(rundir, case.get("deck_file", "case.deck"))
    if "deck_file" not in case:
        write_deck(deck, case["deck"])
    cmd = [args.loom, case.get("command", "run"), deck, "--set", "run.dir=" + rundir]
    for s in sets:
        cmd += ["--set", s.replace("@RUN@", rundir)]
    ranks = int(case.get("ranks", 1) if ranks is None else ranks)
    if ranks > 1 or case.get("mpirun", False):
        cmd = common.launch_prefix(args, ranks, always=True) + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    for k, v in case.get("env", {}).items():
        env[k] = v.replace("@BUILD@", os.path.dirname(os.path.abspath(args.loom)))
    print("$ " + " ".join("%s=%s" % kv for kv in case.get("env", {}).items()) + (" " if case.get("env") else "") + " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=case.get("timeout", 600))
    except subprocess.TimeoutExpired as e:
        return 124, e.stdout or "", "timed out after %s s (a hang?)\n" % case.get("timeout", 600), []
    records = []
    mpath = os.path.join(rundir, "metrics.jsonl")
    if os.path.exists(mpath):
        with open(mpath) as f:
            records = [json.loads(line) for line in f if line.strip()]
    return p.returncode, p.stdout, p.stderr, records


def curve(records):
    loss = [r["loss"] for r in records]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"loss": loss, "val_loss": val[-1] if val else None, "grad_norm": [r.get("grad_norm") for r in records],
            "moe_load": [r.get("moe_load") for r in records]}


def tolerance(case, quantity):
    eps = case.get("epsilon", {})
    return eps.get("base", 1e-6) * eps.get("scale", {}).get(quantity, 1.0)


def compare(case, got, ref):
    """Step-by-step comparison; returns a list of failure strings and prints a table."""
    failures = []
    tol = tolerance(case, "loss")
    if len(got["loss"]) != len(ref["loss"]):
        return ["loss curve has %d steps, reference %d" % (len(got["loss"]), len(ref["loss"]))]
    worst = 0.0
    for i, (a, b) in enumerate(zip(got["loss"], ref["loss"])):
        err = abs(a - b) / max(1.0, abs(b))
        worst = max(worst, err)
        if err > tol:
            failures.append("step %d: loss %.10g, reference %.10g (rel. error %.3g > %.3g)" % (i + 1, a, b, err, tol))
    print("loss curve: %d steps, worst relative error %.3g (tolerance %.3g)" % (len(ref["loss"]), worst, tol))
    if case.get("differs") and worst == 0.0:
        failures.append("the loss curve equals the reference's bit for bit: the path under test did not run")
    if "grad_norm" in case.get("epsilon", {}).get("scale", {}):  # compared when the case gives a tolerance
        tn = tolerance(case, "grad_norm")
        errs = [abs(a - b) / max(1.0, abs(b)) for a, b in zip(got["grad_norm"], ref["grad_norm"])]
        print("gradient norm: worst relative error %.3g (tolerance %.3g)" % (max(errs), tn))
        failures += ["step %d: gradient norm %.10g, reference %.10g (rel. error %.3g > %.3g)" % (i + 1, a, b, e, tn)
                     for i, (a, b, e) in enumerate(zip(got["grad_norm"], ref["grad_norm"], errs)) if e > tn]
    if case.get("same_routing"):  # model.experts: every step's routed share of each expert, exactly
        if not any(ref.get("moe_load", [])):
            failures.append("the reference run reports no expert load (moe_load): the case has no experts")
        steps = [i + 1 for i, (a, b) in enumerate(zip(got.get("moe_load", []), ref.get("moe_load", []))) if a != b]
        print("routing: %d of %d steps route every token as the reference does" % (len(ref["loss"]) - len(steps),
                                                                                  len(ref["loss"])))
        if steps:
            failures.append("the experts' load differs from the reference's on steps %s: other routing decisions" %
                            steps[:5])
    if ref.get("val_loss") is not None:
        tv = tolerance(case, "val_loss")
        if got.get("val_loss") is None:
            failures.append("no val_loss in this run")
        else:
            err = abs(got["val_loss"] - ref["val_loss"]) / max(1.0, abs(ref["val_loss"]))
            print("val loss: %.10g vs %.10g, relative error %.3g (tolerance %.3g)" % (got["val_loss"], ref["val_loss"], err, tv))
            if err > tv:
                failures.append("val_loss %.10g, reference %.10g (rel. error %.3g > %.3g)" % (got["val_loss"], ref["val_loss"], err, tv))
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--workdir", required=True)
    common.add_launcher_arguments(ap)
    ap.add_argument("--regenerate", action="store_true", help="rewrite the case's golden values from this run")
    args = ap.parse_args()

    with open(args.case) as f:
        case = json.load(f)
    name = os.path.splitext(os.path.basename(args.case))[0]
    workdir = os.path.join(args.workdir, name)
    print("case %s: %s" % (name, case.get("description", "")))
    check = case["check"]
    status, out, err, records = run_loom(args, case, workdir, "run", case.get("sets", []))
    sys.stdout.write(out[-4000:])
    failures = []

    if check == "error":
        want = case.get("exit", 2)
        if want == "nonzero":
            if status == 0 or status == 124:
                failures.append("exit status %d, expected a failure (not a hang)" % status)
        elif status != want:
            failures.append("exit status %d, expected %d" % (status, want))
        for rx in case.get("stderr", []):
            if not re.search(rx, err):
                failures.append("stderr does not match /%s/" % rx)
        print("stderr: " + err.strip())
    else:
        if status != 0:
            sys.stderr.write(err)
            print("FAIL: loom exited with %d" % status)
            return 1
        got = curve(records)
        if check == "golden":
            if args.regenerate:
                case["golden"] = got
                with open(args.case, "w") as f:
                    json.dump(case, f, indent=2)
                    f.write("\n")
                print("regenerated %s (%d steps)" % (args.case, len(got["loss"])))
                return 0
            if "golden" not in case:
                failures.append("no golden values: run with --regenerate")
            else:
                failures += compare(case, got, case["golden"])
        elif check == "same_as":
            st, _, err2, rec2 = run_loom(args, case, workdir, "reference", case.get("reference_sets", []),
                                         ranks=case.get("reference_ranks", 1))
            if st != 0:
                sys.stderr.write(err2)
                failures.append("reference run exited with %d" % st)
            else:
                failures += compare(case, got, curve(rec2))
        elif check == "learns":
            first, last = got["loss"][0], got["loss"][-1]
            final = got["val_loss"] if got["val_loss"] is not None else last
            print("first loss %.4f, final loss %.4f, final val loss %s" % (first, last, got["val_loss"]))
            if final > case["max_final_loss"]:
                failures.append("final loss %.4f above %.4f" % (final, case["max_final_loss"]))
            if first - last < case.get("min_drop", 0.0):
                failures.append("loss fell by %.4f, expected at least %.4f" % (first - last, case["min_drop"]))
        else:
            failures.append("unknown check '%s'" % check)

    for f_ in failures:
        print("FAIL: " + f_)
    print("case %s: %s" % (name, "FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
