"""What the regression case scripts share: a case's folder and deck, running loom (under mpirun for
several ranks) with --set overrides, and reading a run's metrics and summary.

    from common import Case, rows, losses, summary
"""
import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys


def case_arguments(doc, cases=None):
    """The command line every case script takes: --loom, --workdir, --mpirun and the case's name (one of
    `cases` when given)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", required=True)
    ap.add_argument("--workdir", required=True)
    add_launcher_arguments(ap)
    ap.add_argument("case", choices=sorted(cases) if cases else None)
    return ap.parse_args()


def add_launcher_arguments(ap):
    """The MPI launcher, as CMake found it (MPIEXEC_EXECUTABLE, MPIEXEC_NUMPROC_FLAG, MPIEXEC_PREFLAGS):
    CTest passes all three, so that `cmake -DMPIEXEC_EXECUTABLE=$(command -v srun)` runs every case
    under srun inside an allocation."""
    ap.add_argument("--mpirun", default=os.environ.get("LOOM_MPIEXEC", "mpiexec"), help="the MPI launcher")
    ap.add_argument("--np-flag", default="-n", help="its rank-count flag (MPIEXEC_NUMPROC_FLAG)")
    ap.add_argument("--mpi-preflags", default="", help="flags before the program (MPIEXEC_PREFLAGS), one string")


def launch_prefix(args, ranks, always=False):
    """The launcher words in front of loom for `ranks` ranks (none for one rank unless `always`)."""
    if ranks <= 1 and not always:
        return []
    return [args.mpirun, args.np_flag, str(ranks)] + shlex.split(args.mpi_preflags)


def run_noting(cmd, failures, expect=0, timeout=600, **kw):
    """Runs cmd (printed first), capturing its output; an exit other than `expect` (None: any) shows
    the output's tail and adds a line to `failures`."""
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if expect is not None and p.returncode != expect:
        sys.stdout.write(p.stdout[-3000:] + p.stderr[-3000:])
        failures.append("%s: exit %d, expected %d" % (" ".join(cmd[:3]), p.returncode, expect))
    return p


# The small GPT-2 the weight-file checks (llmc_checks.py, hf_gpt2_checks.py) train, export and reload.
SMALL_GPT2_DECK = """[model]
layers = 2
d_model = 64
heads = 4
seq_len = 32
vocab = 200
[data]
source = synthetic
[train]
steps = 1
batch = 4
seed = 7
eval_every = 0
"""


def run_checked(cmd, expect=0, env=None, **kw):
    """Runs cmd (printed first) on one thread each of OpenMP and OpenBLAS, capturing its output; an exit
    other than `expect` (None: any) shows the output's tail and ends the script with FAIL."""
    print("$ " + " ".join(cmd), flush=True)
    e = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    e.update(env or {})
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=e, **kw)
    if expect is not None and p.returncode != expect:
        sys.stdout.write(p.stdout[-3000:] + p.stderr[-3000:])
        raise SystemExit("FAIL: exit %d, expected %d: %s" % (p.returncode, expect, " ".join(cmd)))
    return p


def finish(failures):
    """The exit status of a script that collected `failures`, after saying FAIL (each) or OK."""
    if failures:
        print("FAIL\n  " + "\n  ".join(failures))
        return 1
    print("OK")
    return 0


def small_deck(steps=8, val_fraction=0, log_every=None):
    """The 2-layer, d_model 32 model the MPI cases train in seconds, as deck text."""
    return ("[model]\nlayers = 2\nd_model = 32\nheads = 4\nseq_len = 16\nvocab = 64\n"
            "[train]\nsteps = %d\nbatch = 8\nlr = 3e-3\nwarmup = 2\nseed = 42\neval_every = 0\n" % steps
            + ("log_every = %d\n" % log_every if log_every else "")
            + "[data]\nval_fraction = %s\n" % val_fraction)


def snapshot(path):
    """Every file under `path` with its bytes' hash: equal snapshots mean a byte-identical tree."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, path)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # a Case's loom runs: one thread a rank


class Case:
    """One case: a fresh folder under args.workdir holding `deck` (deck text, or the path of a deck file to
    copy); failures collected, then done(). `label` names the case in done()'s last line ("<label> <name>:
    passed"); `env` is what every loom run of the case sets over the caller's environment."""

    def __init__(self, args, name, deck, deck_name="case.deck", label="case", env=ONE_THREAD):
        self.args = args
        self.label = label
        self.env = dict(env)
        self.dir = os.path.join(args.workdir, name)
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.deck = os.path.join(self.dir, deck_name)
        if "\n" not in deck and os.path.isfile(deck):
            shutil.copyfile(deck, self.deck)
        else:
            with open(self.deck, "w") as f:
                f.write(deck)
        self.failures = []

    def command(self, tag, ranks, sets, deck=None, per_rank=None):
        """loom run of the case's deck (or `deck`, another file) with run.dir=<case>/<tag> and `sets`;
        `per_rank`: shell words each rank runs before loom (e.g. an environment per rank, as a
        scheduler's binding sets it; the rank is $PMI_RANK under MPICH, $OMPI_COMM_WORLD_RANK under Open
        MPI, $SLURM_PROCID under srun)."""
        rundir = os.path.join(self.dir, tag)
        wrap = ["sh", "-c", per_rank + ' && exec "$@"', "sh"] if per_rank else []
        cmd = launch_prefix(self.args, ranks) + wrap + [self.args.loom, "run", deck or self.deck,
                                                        "--set", "run.dir=" + rundir]
        for s in sets:
            cmd += ["--set", s]
        return cmd, rundir

    def loom(self, tag, ranks, sets, env=None, expect=0, shell_prefix=None, deck=None, per_rank=None,
             popen=False, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
        """Runs command()'s loom with `env` over the case's; returns (the completed process, its run
        folder). An exit other than `expect` (None: any) shows the output's tail and is a failure.
        `popen`: started, not waited for, and returned as a Popen, its output to `stdout` and `stderr`."""
        cmd, rundir = self.command(tag, ranks, sets, deck, per_rank)
        e = dict(os.environ, **self.env)
        e.update(env or {})
        shown = " ".join("%s=%s" % kv for kv in (env or {}).items()) + " " + " ".join(cmd)
        if shell_prefix:  # e.g. a file-size limit, set in a shell that then runs loom
            cmd = ["bash", "-c", shell_prefix + ' && exec "$@"', "bash"] + cmd
            shown = shell_prefix + "; " + shown
        print("$ " + shown.strip(), flush=True)
        if popen:
            return subprocess.Popen(cmd, env=e, stdout=stdout, stderr=stderr, text=True), rundir
        p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=300)
        if expect is not None and p.returncode != expect:
            sys.stdout.write(p.stdout[-3000:])
            sys.stdout.write(p.stderr[-3000:])
            self.failures.append("%s: exit status %d, expected %d" % (tag, p.returncode, expect))
        return p, rundir

    def losses(self, rundir):
        """{step: loss} of the run's metrics (the module's losses() is the list)."""
        return {r["step"]: r["loss"] for r in rows(rundir)}

    def compare(self, got, ref, tol):
        """Each step's loss of a resumed run (`got`, from losses()) within relative `tol` of the
        uninterrupted run's (`ref`)."""
        worst = 0.0
        for step, loss in sorted(got.items()):
            err = abs(loss - ref[step]) / max(1.0, abs(ref[step]))
            worst = max(worst, err)
            if err > tol:
                self.failures.append("step %d: loss %.10g, uninterrupted run %.10g (rel. error %.3g > %.3g)"
                                     % (step, loss, ref[step], err, tol))
        print("steps %s: worst relative error against the uninterrupted run %.3g (tolerance %.3g)"
              % (sorted(got), worst, tol))
        if not got:
            self.failures.append("the resumed run logged no steps")

    def expect(self, text, patterns, what):
        for rx in patterns:
            if not re.search(rx, text):
                self.failures.append("%s does not match /%s/" % (what, rx))

    def expect_error(self, p, patterns):
        """Shows a run's stderr and checks it for every pattern."""
        print("stderr: " + p.stderr.strip())
        self.expect(p.stderr, patterns, "stderr")

    def check(self, ok, message):
        if not ok:
            self.failures.append(message)

    def done(self, name):
        for f in self.failures:
            print("FAIL: " + f)
        print("%s %s: %s" % (self.label, name, "FAILED" if self.failures else "passed"))
        return 1 if self.failures else 0


def rows(rundir, name="metrics.jsonl"):
    path = os.path.join(rundir, name)
    if not os.path.exists(path):
        return []
    # Only whole lines: a run that is still writing may have half of its next row on disk.
    return [json.loads(line) for line in open(path) if line.endswith("\n") and line.strip()]


def losses(rundir):
    return [r["loss"] for r in rows(rundir)]


def summary(rundir):
    with open(os.path.join(rundir, "summary.json")) as f:
        return json.load(f)
