#!/usr/bin/env python3
"""The command line explains itself: each command's --help gives its usage and where to read more, and a
mistyped command or option gets one line with the nearest word, not the whole usage.

    python3 regression/cli_checks.py --loom build/loom help|mistyped|wait

  help      `loom COMMAND --help` for every command of `loom --help`: exit 0, its own usage line, a
            "more:" line, at most 25 lines (`loom run --help` no longer prints the 100-line key
            table; `loom keys` and `loom run --help-deck` do)
  mistyped  `loom rnu`, `loom run DECK --sett ...`, `loom plan DECK --devise 4`, `loom sample --stpes 3`:
            exit 2, one line naming the nearest command or option and `loom COMMAND --help`; a word
            near nothing (`loom frobnicate`) gets no guess
  wait      ranks x threads beyond the CPUs: OMP_WAIT_POLICY=PASSIVE set by loom (banner, report.json);
            a caller's OMP_WAIT_POLICY kept; nothing changed within the CPUs
  attention model.attention = auto resolved and said: on the host -> unfused, on the emulated device
            (--emulated LIB) -> flash, not cudnn, with cuDNN's refusal in the banner; the checkpoint records
            the kind run (`loom ckpt info`), and `loom plan` of a cuda run resolves it to cudnn
Standard library only.
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECK = os.path.join(ROOT, "inputs", "quickstart.deck")
COMMANDS = ["run", "check", "export", "ckpt", "sample", "plan", "keys", "plugins"]


def loom(args, argv):
    p = subprocess.run([args.loom] + argv, capture_output=True, text=True, timeout=120)
    print("$ loom %s  (exit %d)\n%s%s" % (" ".join(argv), p.returncode, p.stdout[:1500], p.stderr[:1500]))
    return p


def case_help(args, failures):
    listed = loom(args, ["--help"]).stdout
    for c in COMMANDS:
        if "  " + c not in listed:
            failures.append("loom --help does not list %s" % c)
        p = loom(args, [c, "--help"])
        lines = p.stdout.splitlines()
        if p.returncode != 0 or not lines or lines[0] != "usage:":
            failures.append("loom %s --help: exit %d, first line %r" % (c, p.returncode, lines[:1]))
            continue
        if not any(l.startswith("  " + c) for l in lines):
            failures.append("loom %s --help does not give its own usage line" % c)
        if not any(l.startswith("more: ") for l in lines):
            failures.append("loom %s --help does not say where to read more" % c)
        if len(lines) > 25:
            failures.append("loom %s --help prints %d lines (the key table belongs to loom keys)" % (c, len(lines)))
    keys = loom(args, ["run", "--help-deck"])
    if keys.returncode != 0 or "train.lr" not in keys.stdout:
        failures.append("loom run --help-deck no longer prints the key table")


def one_line(p, failures, what, want):
    err = p.stderr.strip()
    if p.returncode != 2:
        failures.append("%s: exit %d, expected 2" % (what, p.returncode))
    if len(err.splitlines()) != 1:
        failures.append("%s: %d lines on stderr, expected one" % (what, len(err.splitlines())))
    for w in want:
        if w not in err:
            failures.append("%s: stderr does not say %r: %s" % (what, w, err))


def case_mistyped(args, failures):
    one_line(loom(args, ["rnu", DECK]), failures, "loom rnu", ["unknown command 'rnu'", "did you mean run?", "loom --help"])
    one_line(loom(args, ["run", DECK, "--sett", "train.steps=1"]), failures, "loom run --sett",
             ["did you mean --set?", "loom run --help"])
    one_line(loom(args, ["plan", DECK, "--devise", "4"]), failures, "loom plan --devise",
             ["did you mean --devices?", "loom plan --help"])
    one_line(loom(args, ["sample", "x.h5", "--stpes", "3"]), failures, "loom sample --stpes",
             ["did you mean --steps?", "loom sample --help"])
    one_line(loom(args, ["check"]), failures, "loom check (no deck)", ["expects DECK", "loom check --help"])
    p = loom(args, ["frobnicate"])
    one_line(p, failures, "loom frobnicate", ["unknown command 'frobnicate'"])
    if "did you mean" in p.stderr:
        failures.append("loom frobnicate: a guess for a word near no command: " + p.stderr.strip())


def case_wait(args, failures):
    """A node's ranks x threads beyond its CPUs: loom re-executes itself with OMP_WAIT_POLICY=PASSIVE
    (core/backend/wait_policy.hpp), says so in the banner and report.json; a caller's own choice is
    kept; within the CPUs nothing changes."""
    import json
    import shutil
    import tempfile
    cpus = len(os.sched_getaffinity(0))
    cases = [  # (environment, expected policy in report.json, expected banner text or None)
        ({"MPI_LOCALNRANKS": str(cpus + 1), "OMP_NUM_THREADS": "2"}, "PASSIVE", "OMP_WAIT_POLICY=PASSIVE set by loom"),
        ({"MPI_LOCALNRANKS": str(cpus + 1), "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE",
         "OMP_WAIT_POLICY=ACTIVE (set by the caller)"),
        ({"MPI_LOCALNRANKS": "1", "OMP_NUM_THREADS": "1"}, "", None),
    ]
    for env_add, policy, banner in cases:
        run_dir = tempfile.mkdtemp(prefix="loom-wait-")
        try:
            env = {k: v for k, v in os.environ.items()
                   if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK",
                                "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")}
            env.update(env_add)
            argv = [args.loom, "run", DECK, "--set", "train.steps=1", "--set", "run.dir=" + run_dir]
            p = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
            what = " ".join("%s=%s" % kv for kv in env_add.items())
            print("$ %s loom run quickstart.deck (exit %d)" % (what, p.returncode))
            if p.returncode != 0:
                failures.append("%s: exit %d: %s" % (what, p.returncode, (p.stdout + p.stderr)[-1500:]))
                continue
            with open(os.path.join(run_dir, "report.json")) as f:
                got = json.load(f).get("omp_wait_policy")
            if got != policy:
                failures.append("%s: report.json omp_wait_policy %r, expected %r" % (what, got, policy))
            if banner and banner not in p.stdout:
                failures.append("%s: the banner does not say %r" % (what, banner))
            if not banner and "OMP_WAIT_POLICY" in p.stdout:
                failures.append("%s: a wait policy note where nothing was decided" % what)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)


def case_attention(args, failures):
    import shutil
    import tempfile
    runs = [("host", {}, ["--set", "run.backend=host"], "unfused", "the host back end")]
    if args.emulated:
        runs.append(("emulated device", {"LOOM_CUDA_BACKEND_LIBRARY": args.emulated}, ["--set", "run.backend=cuda"],
                     "flash", "not cudnn: the emulated device runs no cuDNN"))
    for where, env_add, sets, kind, why in runs:
        run_dir = tempfile.mkdtemp(prefix="loom-attention-")
        try:
            env = dict(os.environ)
            env.update(env_add)
            argv = [args.loom, "run", DECK, "--set", "train.steps=1", "--set", "model.attention=auto",
                    "--set", "checkpoint.every=1", "--set", "run.dir=" + run_dir] + sets
            p = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
            print("$ loom run quickstart.deck --set model.attention=auto on the %s (exit %d)\n%s" %
                  (where, p.returncode, "\n".join(l for l in p.stdout.splitlines() if "attention" in l)))
            if p.returncode != 0:
                failures.append("%s: exit %d: %s" % (where, p.returncode, (p.stdout + p.stderr)[-1500:]))
                continue
            line = "attention: model.attention = auto -> %s (%s" % (kind, why)
            if line not in p.stdout:
                failures.append("%s: the banner does not say %r" % (where, line))
            with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
                ckpt = os.path.join(run_dir, "checkpoints", f.read().strip())
            info = subprocess.run([args.loom, "ckpt", "info", ckpt], capture_output=True, text=True, timeout=120)
            if "attention = %s" % kind not in info.stdout:
                failures.append("%s: the checkpoint's deck does not record model.attention = %s:\n%s" %
                                (where, kind, info.stdout[-1500:]))
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    gpu_deck = os.path.join(ROOT, "bench", "gpu.deck")
    p = loom(args, ["plan", gpu_deck, "--cluster", "h100-sxm", "--set", "model.attention=auto", "--json"])
    if p.returncode != 0 or '"attention": "cudnn"' not in p.stdout:
        failures.append("loom plan of a cuda run with model.attention = auto did not plan cudnn")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", required=True)
    ap.add_argument("--emulated", default="", help="libloom_cuda_emu.so, for the attention case's device run")
    ap.add_argument("case", choices=["help", "mistyped", "wait", "attention"])
    args = ap.parse_args()
    failures = []
    {"help": case_help, "mistyped": case_mistyped, "wait": case_wait, "attention": case_attention}[args.case](
        args, failures)
    return common.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
