#!/usr/bin/env python3
"""Runs the Slurm and PBS job scripts with fake srun, scontrol and mpirun and checks what they ask for.

    python3 regression/jobscript_cases.py --workdir build/jobscript-cases CASE

There is no scheduler here: the fakes, first on PATH, record their arguments and environment and
exit with the status a case chooses, so a case checks the command line loom would get (run.dir,
checkpoint.dir, checkpoint.resume, threads, MPI flags) and what the script does with loom's exit
status. Standard library only.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
JOBSCRIPTS = os.path.join(os.path.dirname(HERE), "jobscripts")
SLURM = os.path.join(JOBSCRIPTS, "slurm.sbatch")
PBS = os.path.join(JOBSCRIPTS, "pbs.sh")
CTEST = os.path.join(JOBSCRIPTS, "ctest.sbatch")

# Each call writes its arguments (NUL-separated) and environment to NAME.N.argv / NAME.N.env.
FAKE = r"""#!/usr/bin/env bash
name=$(basename "$0")
if [ "$name" = mpirun ] && [ "${1:-}" = --version ]; then
  printf '%s\n' "$FAKE_MPIRUN_VERSION"
  exit 0
fi
n=$(find "$FAKE_LOG" -name "$name.*.argv" | wc -l)
printf '%s\0' "$@" > "$FAKE_LOG/$name.$n.argv"
env > "$FAKE_LOG/$name.$n.env"
if [ -n "${FAKE_WAIT_FOR_TERM:-}" ]; then  # a launcher the scheduler signals with its whole job: the
  # ranks save and exit 3, which this launcher loses (exit 0)
  trap 'echo 3 > "$LOOM_STATUS_FILE"; exit 0' TERM
  touch "$FAKE_LOG/waiting"
  while :; do sleep 0.05; done
fi
status_var="FAKE_${name^^}_STATUS"
# FAKE_<NAME>_LOOM_STATUS: what loom's rank 0 would write to LOOM_STATUS_FILE (a launcher that loses it)
loom_status_var="FAKE_${name^^}_LOOM_STATUS"
if [ -n "${!loom_status_var:-}" ] && [ -n "${LOOM_STATUS_FILE:-}" ]; then echo "${!loom_status_var}" > "$LOOM_STATUS_FILE"; fi
exit "${!status_var:-0}"
"""

HYDRA_VERSION = "HYDRA build details:\n    Version:                                 4.0.2"
OPEN_MPI_VERSION = "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/"


class Job:
    """One run of a job script in its own submit directory, with the fakes first on PATH."""

    def __init__(self, workdir, tag, script, args=(), env=None, deck_lines=("[train]", "steps = 4"), files=(),
                 fakes=("srun", "scontrol", "mpirun"), build_loom=True):
        self.dir = os.path.join(workdir, tag)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.bin = os.path.join(self.dir, "bin")
        self.log = os.path.join(self.dir, "log")
        os.makedirs(self.bin)
        os.makedirs(self.log)
        for name in fakes:
            path = os.path.join(self.bin, name)
            with open(path, "w") as f:
                f.write(FAKE)
            os.chmod(path, 0o755)
        for name in files:  # empty files in the submit directory, for globs to match
            open(os.path.join(self.dir, name), "w").close()
        if build_loom:  # the submit directory is a source checkout: build/loom (never run: the launcher is fake)
            os.makedirs(os.path.join(self.dir, "build"))
            with open(os.path.join(self.dir, "build", "loom"), "w") as f:
                f.write("#!/bin/sh\nexit 0\n")
            os.chmod(os.path.join(self.dir, "build", "loom"), 0o755)
        self.deck = os.path.join(self.dir, "tiny.deck")
        with open(self.deck, "w") as f:
            f.write("\n".join(deck_lines) + "\n")
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "PBS_", "OMP_", "LOOM", "RUN_NAME", "SETS", "DECK", "THREADS"))}
        full_env.update(PATH=self.bin + os.pathsep + os.environ.get("PATH", ""), FAKE_LOG=self.log,
                        SLURM_SUBMIT_DIR=self.dir, PBS_O_WORKDIR=self.dir)
        full_env.update(env or {})
        cmd = ["bash", script] + ([self.deck] if script == SLURM else []) + list(args)
        if script == PBS:
            full_env.setdefault("DECK", self.deck)
        print("$ " + " ".join("%s=%s" % kv for kv in (env or {}).items()) + " " + " ".join(cmd), flush=True)
        if not full_env.get("FAKE_WAIT_FOR_TERM"):
            p = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=60)
            self.status, self.stdout, self.stderr = p.returncode, p.stdout, p.stderr
        else:  # SIGTERM to the job's whole process group once the launcher runs, as PBS sends at walltime
            p = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)
            deadline = time.time() + 30
            while time.time() < deadline and not os.path.exists(os.path.join(self.log, "waiting")):
                time.sleep(0.02)
            os.killpg(p.pid, signal.SIGTERM)
            try:
                self.stdout, self.stderr = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                self.stdout, self.stderr = p.communicate()
            self.status = p.returncode
        sys.stdout.write(self.stdout + self.stderr)

    def calls(self, name):
        """[(argv, env)] of every call of the fake `name`, in order."""
        out, n = [], 0
        while os.path.exists(os.path.join(self.log, "%s.%d.argv" % (name, n))):
            with open(os.path.join(self.log, "%s.%d.argv" % (name, n))) as f:
                argv = f.read().split("\0")[:-1]
            with open(os.path.join(self.log, "%s.%d.env" % (name, n))) as f:
                env = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)
            out.append((argv, env))
            n += 1
        return out

    def launch(self):
        """(argv, env) of the one launcher call (srun or mpirun) that started loom."""
        calls = self.calls("srun") + self.calls("mpirun")
        if len(calls) != 1:
            raise AssertionError("expected one launch of loom, got %d" % len(calls))
        return calls[0]


def set_values(argv, key):
    """Every value of KEY given with --set in argv, in order."""
    values = []
    for previous, arg in zip([""] + argv, argv):
        for text in ((arg,) if previous == "--set" else ()) + ((arg[6:],) if arg.startswith("--set=") else ()):
            if text.startswith(key + "="):
                values.append(text[len(key) + 1:])
    return values


def effective(argv, key):
    """The value loom would use for KEY (the last --set wins), or None."""
    values = set_values(argv, key)
    return values[-1] if values else None


def expect(failures, ok, what):
    print(("ok: " if ok else "FAIL: ") + what)
    if not ok:
        failures.append(what)


def case_syntax(workdir, failures):
    for script in (SLURM, PBS, CTEST, os.path.join(JOBSCRIPTS, "local.sh")):
        p = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        expect(failures, p.returncode == 0, "bash -n %s %s" % (os.path.basename(script), p.stderr.strip()))
        with open(script) as f:
            lines = f.read().splitlines()
        expect(failures, len(lines) > 1 and lines[1].startswith("#") and
               any(l.startswith("#   ") and ("sbatch" in l or "qsub" in l or "local.sh" in l) for l in lines[:4]),
               "%s begins with a comment showing how to run it" % os.path.basename(script))


def case_slurm_user_run_dir_wins(workdir, failures):
    job = Job(workdir, "slurm_user_run_dir_wins", SLURM, ["--set", "run.dir=mine"], {"SLURM_JOB_ID": "101"})
    argv, _ = job.launch()
    expect(failures, set_values(argv, "run.dir") == ["mine"], "run.dir given once, the user's: %s" % set_values(argv, "run.dir"))
    job = Job(workdir, "slurm_user_run_dir_wins_eq", SLURM, ["--set=run.dir=mine"], {"SLURM_JOB_ID": "101"})
    argv, _ = job.launch()
    expect(failures, effective(argv, "run.dir") == "mine" and len(set_values(argv, "run.dir")) == 1,
           "--set=run.dir=mine is the only run.dir: %s" % set_values(argv, "run.dir"))
    job = Job(workdir, "slurm_default_run_dir", SLURM, [], {"SLURM_JOB_ID": "101"})
    argv, _ = job.launch()
    expect(failures, effective(argv, "run.dir") == "runs/tiny/slurm-101",
           "without one, run.dir is per job: %s" % effective(argv, "run.dir"))


def case_slurm_checkpoint_dir_same_across_jobs(workdir, failures):
    dirs, run_dirs = [], []
    for job_id in ("101", "202"):
        job = Job(workdir, "slurm_chain_" + job_id, SLURM, [], {"SLURM_JOB_ID": job_id})
        argv, _ = job.launch()
        dirs.append(effective(argv, "checkpoint.dir"))
        run_dirs.append(effective(argv, "run.dir"))
    expect(failures, dirs[0] is not None and dirs[0] == dirs[1] and "101" not in dirs[0],
           "checkpoint.dir is the same for jobs 101 and 202: %s" % dirs)
    expect(failures, run_dirs[0] != run_dirs[1], "run.dir differs per job: %s" % run_dirs)
    # Another experiment (other --set values) starts a chain of its own; the same command continues its own.
    chains = []
    for tag, sets in (("a", ["--set", "train.lr=1e-3"]), ("a_again", ["--set", "train.lr=1e-3"]), ("b", ["--set", "train.lr=3e-3"])):
        job = Job(workdir, "slurm_chain_sets_" + tag, SLURM, sets, {"SLURM_JOB_ID": "404"})
        argv, _ = job.launch()
        chains.append(effective(argv, "checkpoint.dir"))
    expect(failures, chains[0] == chains[1] and chains[0] != chains[2] and chains[0] != "runs/tiny/checkpoints",
           "checkpoint chains by overrides (lr 1e-3, lr 1e-3 again, lr 3e-3): %s" % chains)
    job = Job(workdir, "slurm_chain_named", SLURM, [], {"SLURM_JOB_ID": "303", "RUN_NAME": "study"})
    argv, _ = job.launch()
    expect(failures, effective(argv, "checkpoint.dir") == "runs/study/checkpoints",
           "RUN_NAME names the chain: %s" % effective(argv, "checkpoint.dir"))
    job = Job(workdir, "slurm_user_checkpoint_dir", SLURM, ["--set", "checkpoint.dir=/scratch/ck"], {"SLURM_JOB_ID": "1"})
    argv, _ = job.launch()
    expect(failures, set_values(argv, "checkpoint.dir") == ["/scratch/ck"],
           "the user's checkpoint.dir is the only one: %s" % set_values(argv, "checkpoint.dir"))
    job = Job(workdir, "slurm_deck_checkpoint_dir", SLURM, [], {"SLURM_JOB_ID": "1"},
              deck_lines=("[train]", "steps = 4", "[checkpoint]", "dir = /scratch/deck  # in the deck", "every = 2"))
    argv, _ = job.launch()
    expect(failures, set_values(argv, "checkpoint.dir") == [],
           "a deck that names checkpoint.dir keeps it: %s" % set_values(argv, "checkpoint.dir"))


def case_slurm_resume_auto(workdir, failures):
    job = Job(workdir, "slurm_resume_auto", SLURM, [], {"SLURM_JOB_ID": "101"})
    argv, _ = job.launch()
    expect(failures, set_values(argv, "checkpoint.resume") == ["auto"],
           "checkpoint.resume=auto is passed: %s" % set_values(argv, "checkpoint.resume"))
    job = Job(workdir, "slurm_resume_user", SLURM, ["--set", "checkpoint.resume=latest"], {"SLURM_JOB_ID": "101"})
    argv, _ = job.launch()
    expect(failures, set_values(argv, "checkpoint.resume") == ["latest"],
           "the user's checkpoint.resume is the only one: %s" % set_values(argv, "checkpoint.resume"))


def case_slurm_threads(workdir, failures):
    job = Job(workdir, "slurm_threads", SLURM, [], {"SLURM_JOB_ID": "101", "SLURM_CPUS_PER_TASK": "4"})
    argv, env = job.launch()
    expect(failures, env.get("OMP_NUM_THREADS") == "4", "OMP_NUM_THREADS follows SLURM_CPUS_PER_TASK=4: %s" % env.get("OMP_NUM_THREADS"))
    expect(failures, "--cpus-per-task=4" in argv, "srun gets --cpus-per-task=4")
    job = Job(workdir, "slurm_threads_unset", SLURM, [], {"SLURM_JOB_ID": "101"})
    argv, env = job.launch()
    expect(failures, env.get("OMP_NUM_THREADS") == "1", "OMP_NUM_THREADS is 1 without --cpus-per-task: %s" % env.get("OMP_NUM_THREADS"))


def case_slurm_requeue_on_interrupt(workdir, failures):
    job = Job(workdir, "slurm_interrupted", SLURM, [], {"SLURM_JOB_ID": "4242", "FAKE_SRUN_STATUS": "3"})
    requeues = [argv for argv, _ in job.calls("scontrol")]
    expect(failures, requeues == [["requeue", "4242"]], "srun exit 3 -> scontrol requeue 4242: %s" % requeues)
    expect(failures, job.status == 0, "the requeued job's script exits 0: %d" % job.status)
    for status in ("0", "1", "2"):
        job = Job(workdir, "slurm_exit_" + status, SLURM, [], {"SLURM_JOB_ID": "4242", "FAKE_SRUN_STATUS": status})
        expect(failures, job.calls("scontrol") == [], "srun exit %s -> no scontrol call" % status)
        expect(failures, job.status == int(status), "srun exit %s -> script exit %d" % (status, job.status))
    job = Job(workdir, "slurm_requeue_refused", SLURM, [],
              {"SLURM_JOB_ID": "4242", "FAKE_SRUN_STATUS": "3", "FAKE_SCONTROL_STATUS": "1"})
    expect(failures, job.status == 3, "a refused requeue leaves exit status 3 (for an afternotok chain): %d" % job.status)


def case_launcher_loses_status(workdir, failures):
    """A launcher that exits 0 though loom's ranks exited 3 (MPICH's mpiexec, signalled): the scripts
    take loom's own status from LOOM_STATUS_FILE, so Slurm requeues and PBS releases its chain."""
    job = Job(workdir, "slurm_lost_status", SLURM, [],
              {"SLURM_JOB_ID": "4243", "FAKE_SRUN_STATUS": "0", "FAKE_SRUN_LOOM_STATUS": "3"})
    requeues = [argv for argv, _ in job.calls("scontrol")]
    expect(failures, requeues == [["requeue", "4243"]], "srun exit 0, loom 3 -> scontrol requeue 4243: %s" % requeues)
    _, env = job.launch()
    expect(failures, env.get("LOOM_STATUS_FILE", "").startswith("/"), "srun gets LOOM_STATUS_FILE: %s"
           % env.get("LOOM_STATUS_FILE"))
    job, _ = pbs_job(workdir, "pbs_lost_status", HYDRA_VERSION, {"FAKE_MPIRUN_STATUS": "0", "FAKE_MPIRUN_LOOM_STATUS": "3"})
    expect(failures, job.status == 3, "mpirun exit 0, loom 3 -> script exit 3: %d" % job.status)
    job, _ = pbs_job(workdir, "pbs_both_zero", HYDRA_VERSION, {"FAKE_MPIRUN_STATUS": "0", "FAKE_MPIRUN_LOOM_STATUS": "0"})
    expect(failures, job.status == 0, "mpirun exit 0, loom 0 -> script exit 0: %d" % job.status)
    job, _ = pbs_job(workdir, "pbs_lost_status_5", HYDRA_VERSION, {"FAKE_MPIRUN_STATUS": "5", "FAKE_MPIRUN_LOOM_STATUS": "3"})
    expect(failures, job.status == 3, "mpirun exit 5, loom 3 -> script exit 3 (every rank saved): %d" % job.status)
    # The scheduler signals the whole job (script, launcher, ranks): the script outlives it and reads
    # loom's status.
    job, _ = pbs_job(workdir, "pbs_job_signalled", HYDRA_VERSION, {"FAKE_WAIT_FOR_TERM": "1"})
    expect(failures, job.status == 3, "SIGTERM to the whole job, loom 3, mpirun 0 -> script exit 3: %d" % job.status)
    # No writable temporary directory: the launcher's status decides, as before the file existed.
    job, _ = pbs_job(workdir, "pbs_no_tmp", HYDRA_VERSION, {"FAKE_MPIRUN_STATUS": "3", "TMPDIR": "/nonexistent"})
    expect(failures, job.status == 3, "TMPDIR missing: the job still runs, mpirun 3 -> script exit 3: %d" % job.status)


def case_slurm_mpi_flavour(workdir, failures):
    job = Job(workdir, "slurm_mpi_default", SLURM, [], {"SLURM_JOB_ID": "1"})
    argv, _ = job.launch()
    expect(failures, not any(a.startswith("--mpi") for a in argv), "no --mpi by default: %s" % argv)
    job = Job(workdir, "slurm_mpi_pmi2", SLURM, [], {"SLURM_JOB_ID": "1", "LOOM_SRUN_MPI": "pmi2"})
    argv, _ = job.launch()
    expect(failures, "--mpi=pmi2" in argv, "LOOM_SRUN_MPI=pmi2 -> srun --mpi=pmi2: %s" % argv)
    loom_at = argv.index("build/loom") if "build/loom" in argv else -1
    expect(failures, loom_at > 0 and argv[loom_at + 1:loom_at + 3] == ["run", job.deck],
           "srun runs build/loom run DECK: %s" % argv)
    # Submitted from elsewhere (no build/loom there): the loom on PATH, an installed one; none: refused.
    job = Job(workdir, "slurm_loom_on_path", SLURM, [], {"SLURM_JOB_ID": "1"}, fakes=("srun", "scontrol", "loom"),
              build_loom=False)
    argv, _ = job.launch()
    expect(failures, os.path.join(job.bin, "loom") in argv, "without build/loom, the loom on PATH runs: %s" % argv)
    job = Job(workdir, "slurm_no_loom", SLURM, [], {"SLURM_JOB_ID": "1", "PATH": "/usr/bin:/bin"}, build_loom=False)
    expect(failures, job.status == 2 and "no loom" in job.stderr and "set LOOM=" in job.stderr,
           "no build/loom and no loom on PATH: exit 2 saying so (%d, %s)" % (job.status, job.stderr.strip()[-200:]))


def pbs_job(workdir, tag, version, env=None, files=()):
    nodefile = os.path.join(workdir, tag + ".nodes")
    os.makedirs(workdir, exist_ok=True)
    with open(nodefile, "w") as f:
        f.write("node1\nnode1\nnode2\nnode2\n")
    full = {"PBS_NODEFILE": nodefile, "PBS_JOBID": "77.server", "FAKE_MPIRUN_VERSION": version}
    full.update(env or {})
    return Job(workdir, tag, PBS, [], full, files=files), nodefile


def case_pbs_hostfile_flag(workdir, failures):
    for tag, version, flag in (("pbs_hydra", HYDRA_VERSION, "-f"), ("pbs_openmpi", OPEN_MPI_VERSION, "--hostfile"),
                               ("pbs_unknown", "Some MPI 1.0", "-machinefile")):
        job, nodefile = pbs_job(workdir, tag, version)
        argv, _ = job.launch()
        expect(failures, argv[:4] == ["-n", "4", flag, nodefile], "%s: mpirun -n 4 %s NODEFILE: %s" % (tag, flag, argv[:4]))


def case_pbs_defaults(workdir, failures):
    dirs = []
    for job_id in ("77.server", "78.server"):
        job, _ = pbs_job(workdir, "pbs_chain_" + job_id, HYDRA_VERSION, {"PBS_JOBID": job_id})
        argv, env = job.launch()
        dirs.append(effective(argv, "checkpoint.dir"))
        expect(failures, set_values(argv, "checkpoint.resume") == ["auto"], "checkpoint.resume=auto is passed")
        expect(failures, env.get("OMP_NUM_THREADS") == "1", "OMP_NUM_THREADS=1 by default")
    expect(failures, dirs[0] is not None and dirs[0] == dirs[1], "checkpoint.dir is the same for two jobs: %s" % dirs)
    job, _ = pbs_job(workdir, "pbs_user_sets", HYDRA_VERSION,
                     {"SETS": "--set run.dir=mine --set checkpoint.resume=latest --set data.source=tokens:*.bin",
                      "THREADS": "2"}, files=["data.source=tokens:shard.bin"])
    argv, env = job.launch()
    expect(failures, set_values(argv, "run.dir") == ["mine"], "the user's run.dir wins: %s" % set_values(argv, "run.dir"))
    expect(failures, set_values(argv, "checkpoint.resume") == ["latest"], "the user's checkpoint.resume is the only one")
    expect(failures, env.get("OMP_NUM_THREADS") == "2", "THREADS=2 -> OMP_NUM_THREADS=2")
    expect(failures, set_values(argv, "data.source") == ["tokens:*.bin"],
           "a glob in SETS reaches loom unexpanded: %s" % set_values(argv, "data.source"))
    job, _ = pbs_job(workdir, "pbs_interrupted", HYDRA_VERSION, {"FAKE_MPIRUN_STATUS": "3"})
    expect(failures, job.status == 3, "mpirun exit 3 -> script exit 3 (releases an afternotok chain): %d" % job.status)


def case_slurm_ctest(workdir, failures):
    """The suite inside an allocation: a build tree whose MPI launcher is srun, then ctest -L LABEL."""
    fakes = ("srun", "cmake", "ctest")
    job = Job(workdir, "slurm_ctest", CTEST, ["regression"], {"SLURM_JOB_ID": "7", "LOOM_SRUN_MPI": "pmi2"},
              fakes=fakes)
    srun = os.path.join(job.bin, "srun")
    cmake = [argv for argv, _ in job.calls("cmake")]
    ctest = [argv for argv, _ in job.calls("ctest")]
    expect(failures, job.status == 0, "exit status 0: %d" % job.status)
    expect(failures, len(cmake) == 2 and "-DMPIEXEC_EXECUTABLE=" + srun in cmake[0] and "-DMPIEXEC_NUMPROC_FLAG=-n" in cmake[0]
           and "-DMPIEXEC_PREFLAGS=--mpi=pmi2" in cmake[0], "configured with srun as the MPI launcher: %s" % cmake[:1])
    expect(failures, len(cmake) == 2 and cmake[1][:2] == ["--build", "build-srun"], "then built: %s" % cmake[1:])
    expect(failures, len(ctest) == 1 and ctest[0][:2] == ["--test-dir", "build-srun"] and ctest[0][-4:] == ["-L", "regression", "-LE", "local_ranks"],
           "ctest on that tree with the label: %s" % ctest)
    job = Job(workdir, "slurm_ctest_all", CTEST, ["all"], {"SLURM_JOB_ID": "8"}, fakes=fakes)
    ctest = [argv for argv, _ in job.calls("ctest")]
    expect(failures, len(ctest) == 1 and "-L" not in ctest[0] and ctest[0][-2:] == ["-LE", "local_ranks"],
           "label all selects every test that srun can run: %s" % ctest)
    job = Job(workdir, "slurm_ctest_no_srun", CTEST, [], {"PATH": job.bin.replace("slurm_ctest_all", "none") + ":/usr/bin:/bin"},
              fakes=())
    expect(failures, job.status == 2 and "srun is not on PATH" in job.stderr, "without srun: exit 2 saying so (%d)" % job.status)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main():
    global JOBSCRIPTS, SLURM, PBS, CTEST
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--jobscripts", default=JOBSCRIPTS, help="the folder of the scripts under test (default: jobscripts/)")
    ap.add_argument("case", choices=sorted(CASES))
    args = ap.parse_args()
    JOBSCRIPTS = os.path.abspath(args.jobscripts)
    SLURM = os.path.join(JOBSCRIPTS, "slurm.sbatch")
    PBS = os.path.join(JOBSCRIPTS, "pbs.sh")
    CTEST = os.path.join(JOBSCRIPTS, "ctest.sbatch")
    failures = []
    try:
        CASES[args.case](os.path.join(os.path.abspath(args.workdir), args.case), failures)
    except AssertionError as e:
        failures.append(str(e))
        print("FAIL: %s" % e)
    print("jobscripts %s: %s" % (args.case, "FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
