#!/usr/bin/env python3
"""Collective watchdog cases: a rank that stalls mid-training ends the job within run.comm_timeout,
named by the rank that waited for it, and the waiting rank does not burn a core meanwhile.

    python3 regression/watchdog_cases.py --loom build/loom --workdir build/watchdog CASE

CASE is one of:
  stalled_rank_dp2   dp = 2: once training runs, world rank 1 is stopped (SIGSTOP). The job must exit
                     non-zero no sooner than run.comm_timeout and within run.comm_timeout + 20 s after
                     the stop, rank 0's message must name the communicator and operation it waited in
                     and world rank 1 as the rank whose part never came, and rank 0 must use well under
                     a core while it waits (CPU time over 2 s of the wait < 30% of the wall time; 50% over
                     the emulated device's NCCL, whose polls run the emulator's progress engine)
  stalled_stage_pp2  the same at pp = 2 (8 micro-batches): stage 0 waits in the pipeline's send/recv
                     (or the pp all-reduce of the loss and the gradient norm)
  stalled_rank_dp2_nccl, stalled_rank_zero3_nccl, stalled_rank_tp2_nccl
                     the same on the CUDA back end, each rank on a device of its own of the emulated
                     device (libloom_cuda_emu.so), so that dp's, ZeRO-3's and tp's device buffers go
                     through the NCCL communicator: its watchdog names the operation and NCCL, which
                     cannot say whose part is missing
  timeout_off        run.comm_timeout = 0 (wait forever) is accepted and a short dp = 2 run trains;
                     a negative value is refused naming the key

A stop that lands after rank 1's last message of a step leaves rank 0 waiting in the world
all-reduce at the step's end: that is a right answer too, and the cases accept it.
"""
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DECK = """[model]
layers = 2
d_model = 64
heads = 4
seq_len = 64
vocab = 64
[train]
steps = 100000000
batch = 8
lr = 3e-3
warmup = 2
seed = 42
eval_every = 0
[data]
val_fraction = 0
"""
TIMEOUT = 6          # run.comm_timeout of the stalled cases: long enough to measure the CPU inside it
GRACE = 20           # seconds past the timeout by which the job must be gone
CPU_WINDOW = (1, 3)  # seconds after the stop: past the wait's flat-out polling, before the timeout
MAX_CPU_SHARE = 0.30
# Over the emulated device's NCCL each poll of the wait runs the emulator's own progress engine on the
# polling thread (a GPU's stream query does not), so a waiting rank costs more there: 5-22% here alone,
# 32% once in a full suite on 2 cores. A wait that spins flat out takes a whole core (100%).
MAX_CPU_SHARE_EMULATED = 0.50


def children_of(root):
    """Every process below `root`, from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass  # gone meanwhile
    found, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def loom_ranks(mpirun_pid):
    """{world rank: pid} of the loom processes under this mpirun (the launcher tells each its rank in
    PMI_RANK)."""
    ranks = {}
    for pid in children_of(mpirun_pid):
        try:
            with open("/proc/%d/comm" % pid) as f:
                if f.read().strip() != "loom":
                    continue
            with open("/proc/%d/environ" % pid, "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        rank = env.get(b"PMI_RANK") or env.get(b"PMIX_RANK") or env.get(b"OMPI_COMM_WORLD_RANK")
        if rank is not None:
            ranks[int(rank)] = pid
    return ranks


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class Case(common.Case):
    def __init__(self, args, name):
        # Not OMP_NUM_THREADS: timeout_off runs with the caller's, stalled() sets it to 1.
        super().__init__(args, name, DECK, "watchdog.deck", label="watchdog case", env={"OPENBLAS_NUM_THREADS": "1"})

    def stalled(self, sets, waited_in, env=None):
        """Stops world rank 1 of a 2-rank run once it trains; checks how the job ends."""
        out_path, err_path = os.path.join(self.dir, "stdout"), os.path.join(self.dir, "stderr")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            job, _ = self.loom("run", 2, sets + ["run.comm_timeout=%d" % TIMEOUT],
                               env=dict(OMP_NUM_THREADS="1", **(env or {})), popen=True, stdout=out, stderr=err)
        ranks = {}
        try:
            # Training is under way once rank 0 has logged a few steps.
            deadline = time.time() + 120
            while time.time() < deadline and job.poll() is None:
                with open(out_path) as f:
                    steps = len(re.findall(r"^step\s+\d+", f.read(), re.M))
                ranks = loom_ranks(job.pid)
                if steps >= 3 and len(ranks) == 2:
                    break
                time.sleep(0.1)
            else:
                self.failures.append("the job never started training (exit status %s)" % job.poll())
                return
            os.kill(ranks[1], signal.SIGSTOP)
            stopped_at = time.time()
            print("world rank 1 (pid %d) stopped; rank 0 is pid %d" % (ranks[1], ranks[0]))

            time.sleep(CPU_WINDOW[0])
            t0, c0 = time.time(), cpu_seconds(ranks[0])
            time.sleep(CPU_WINDOW[1] - CPU_WINDOW[0])
            share = (cpu_seconds(ranks[0]) - c0) / (time.time() - t0)
            print("rank 0 while it waits: %.1f%% of a core" % (100 * share))
            limit = MAX_CPU_SHARE_EMULATED if env and "LOOM_NCCL_LIBRARY" in env else MAX_CPU_SHARE
            if share >= limit:
                self.failures.append("rank 0 used %.0f%% of a core while waiting (limit %.0f%%)" % (100 * share, 100 * limit))

            try:
                status = job.wait(timeout=max(0.0, stopped_at + TIMEOUT + GRACE - time.time()))
            except subprocess.TimeoutExpired:
                self.failures.append("the job was still running %d s after the stop (run.comm_timeout = %d)"
                                     % (TIMEOUT + GRACE, TIMEOUT))
                return
            took = time.time() - stopped_at
            print("the job exited with status %d %.1f s after the stop" % (status, took))
            if status == 0:
                self.failures.append("the job exited with status 0")
            if took < TIMEOUT:
                self.failures.append("the job ended %.1f s after the stop, before run.comm_timeout = %d" % (took, TIMEOUT))
            with open(err_path) as f:
                stderr = f.read()
            print("stderr: " + stderr.strip())
            named = (r"rank 0: error: (?:%s) waited [0-9.]+ s \(run\.comm_timeout = %d\) for world rank 1"
                     r"(?: \((?:dp|pp) rank 1\))?: (?:its message never arrived|it never took the message sent to it)"
                     % (waited_in, TIMEOUT))
            if env and "LOOM_NCCL_LIBRARY" in env:  # NCCL does not say which rank's part is missing
                named = (r"rank 0: error: (?:%s) \(NCCL, rank 0 of 2\) did not complete in [0-9.]+ s \(run\.comm_timeout = %d\): "
                         r"a rank of this communicator is stalled or dead|%s" % (waited_in, TIMEOUT, named))
            self.expect(stderr, [named], "stderr")
        finally:
            for pid in ranks.values():  # nothing of this job may outlive the case
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            if job.poll() is None:
                job.kill()
                job.wait()


# Stalls over the NCCL communicator: the layout, and the operations rank 0 may be found waiting in.
NCCL_CASES = {
    "stalled_rank_dp2_nccl": (["parallel.dp=2"], "dp all_reduce"),
    "stalled_rank_zero3_nccl": (["parallel.dp=2", "zero.stage=3"], "dp (?:all_reduce|all_gather|reduce_scatter)"),
    "stalled_rank_tp2_nccl": (["parallel.tp=2"], "tp (?:all_reduce|all_gather|reduce_scatter)"),
}


def main():
    args = common.case_arguments(__doc__)
    name = args.case
    c = Case(args, name)
    world_all_reduce = "world all_reduce"
    if name == "stalled_rank_dp2":
        c.stalled(["parallel.dp=2"], "dp all_reduce|" + world_all_reduce)
    elif name == "stalled_stage_pp2":
        c.stalled(["parallel.pp=2", "train.micro_batches=8"], "pp (?:send|recv|all_reduce)|" + world_all_reduce)
    elif name in NCCL_CASES:
        # The CUDA back end on the emulated device, one device per rank, so device buffers go through
        # the NCCL communicator (its NCCL carried by MPI): its own watchdog must end the job as MPI's does.
        lib = os.path.join(os.path.dirname(os.path.abspath(args.loom)), "lib", "libloom_cuda_emu.so")
        sets, waited_in = NCCL_CASES[name]
        c.stalled(sets + ["run.backend=cuda", "run.peak_tflops=1"], waited_in + "|" + world_all_reduce,
                  env={"LOOM_CUDA_BACKEND_LIBRARY": lib, "LOOM_NCCL_LIBRARY": lib, "LOOM_CUDA_EMU_DEVICES": "2"})
    elif name == "timeout_off":
        p, _ = c.loom("run", 2, ["parallel.dp=2", "train.steps=4", "run.comm_timeout=0"], expect=None)
        print(p.stdout[-600:] + p.stderr)
        if p.returncode != 0:
            c.failures.append("run.comm_timeout = 0: exit status %d, expected 0" % p.returncode)
        elif not re.search(r"^step\s+4/4", p.stdout, re.M):
            c.failures.append("run.comm_timeout = 0: step 4 of 4 was not logged")
        p = subprocess.run([args.loom, "check", c.deck, "--set", "run.comm_timeout=-1"], capture_output=True, text=True,
                           timeout=60)
        print("run.comm_timeout = -1: exit status %d: %s" % (p.returncode, p.stderr.strip()))
        if p.returncode != 2 or "run.comm_timeout" not in p.stderr:
            c.failures.append("run.comm_timeout = -1 was not refused with exit status 2 naming the key")
    else:
        sys.exit("unknown case " + name)
    return c.done(name)


if __name__ == "__main__":
    sys.exit(main())
