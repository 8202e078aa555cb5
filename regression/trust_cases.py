#!/usr/bin/env python3
"""Regression cases for runs a cluster user can trust: non-finite values, the run directory, write
failures, interruption, resume checks and the numbers a run reports.

    /usr/bin/python3 regression/trust_cases.py --loom build/loom --workdir build/trust CASE

CASE is one of:
  nonfinite_stop_dp2        a NaN in one rank's step 4 (LOOM_INJECT_FAULT where=nan) with checkpoint.every = 1
                            and keep = 1: exit 1 naming step 4, the tensor and the rank; latest still names
                            the step-3 checkpoint; summary.json says failed
  nonfinite_weights_never_saved  a NaN written into rank 1's weights after step 4's update: the step-4
                            checkpoint is not written (named tensor, rank 1), the step-3 one stays and loads
  nonfinite_skip_dp2        train.on_nonfinite = skip: the NaN step is dropped on both ranks alike (the loss
                            curve equals one process's with the same skipped step), counted, exit 0
  nonfinite_skip_limit      with skip, weights that stay NaN stop the run after train.max_skipped in a row
  nonfinite_last_step       a NaN on the last step exits 1 (not 0 with "val loss -nan")
  resume_refuses_nonfinite  a checkpoint holding a NaN is refused naming the tensor; run.dir byte-identical
  resume_refuses_other_model  model.heads or model.layers other than the checkpoint's: refused naming both
                            values; the directory (metrics.jsonl included) byte-identical
  resume_refuses_bad_step   a step attribute that disagrees with optimizer_steps, or is negative: refused
  resume_refuses_no_file    checkpoint.resume naming a directory, or auto over checkpoints without `latest`:
                            refused saying so (the latter naming the newest checkpoint); run.dir unchanged
  resume_keeps_metrics      a resume from an earlier checkpoint keeps the metrics rows up to it, sets the
                            later rows aside in metrics.jsonl.superseded, and prints the training-key diff
  fresh_refused_over_checkpoints  a fresh run into a directory with checkpoints is refused naming them and
                            leaves it byte-identical (`loom check` refuses it too); run.overwrite = true
                            replaces them
  resume_auto_and_at_end    checkpoint.resume = auto starts fresh, then resumes; checkpoint.at_end saves the
                            last step when train.steps is not a multiple of checkpoint.every
  lock_one_run_per_dir      a second run in a directory in use is refused naming the holder's host and pid,
                            and so are a checkpoint.dir or run.dir inside it, and loom check of it;
                            the lock goes with the holder when it is killed
  write_failure_np1, write_failure_np2  a checkpoint write that crosses a file-size limit exits 1 naming
                            the file and "File too large", no segmentation fault; earlier checkpoint intact
  write_failure_metrics     a metrics.jsonl write that crosses the limit exits 1 naming the file
  interrupt_exit_status     SIGTERM to the ranks of a 2-rank job and SIGINT to one process: a checkpoint,
                            exit status 3, summary.json status interrupted; resume = auto continues;
                            SIGTERM to the 2-rank job's launcher: LOOM_STATUS_FILE holds 3
  numbers                   per-step comm bytes of a resumed run equal the uninterrupted run's; parameters
                            is the model's count at tp = 2; report.json has the command line and the --set
                            keys; metrics rows carry elapsed_s, eta_s, time and mfu
The file edits use h5py: run with /usr/bin/python3 (Debian's python3-h5py).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import losses, rows, snapshot, summary  # noqa: E402

DECK = common.small_deck(steps=8, val_fraction=0.1)


class Case(common.Case):
    def __init__(self, args, name):
        super().__init__(args, name, DECK, "trust.deck")


def latest(ckdir):
    p = os.path.join(ckdir, "latest")
    return open(p).read().strip() if os.path.exists(p) else ""


def close(a, b, tol):
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def case_nonfinite(c, name):
    ck = ["checkpoint.every=1", "checkpoint.keep=1"]
    if name == "nonfinite_stop_dp2":
        p, rundir = c.loom("run", 2, ["parallel.dp=2"] + ck, env={"LOOM_INJECT_FAULT": "rank=1,step=3,where=nan"}, expect=1)
        print(p.stderr.strip())
        c.expect(p.stderr, [r"step 4: loss nan, gradient norm nan: not finite; first non-finite: gradient \S+ \(nan on rank \d: dp \d, tp 0, pp 0\)",
                            r"the loss was not finite on rank\(s\) 1;", r"train\.on_nonfinite = stop"], "stderr")
        ckdir = os.path.join(rundir, "checkpoints")
        print("checkpoints: %s, latest -> %s" % (sorted(os.listdir(ckdir)), latest(ckdir)))
        c.check(latest(ckdir) == "ckpt-00000003.h5", "latest should still name ckpt-00000003.h5")
        c.check(os.path.exists(os.path.join(ckdir, "ckpt-00000003.h5")), "the last good checkpoint was deleted")
        c.check(not os.path.exists(os.path.join(ckdir, "ckpt-00000004.h5")), "the non-finite step was checkpointed")
        s = summary(rundir)
        c.check(s["status"] == "failed" and s["exit_status"] == 1, "summary.json: %s/%s" % (s["status"], s["exit_status"]))
    elif name == "nonfinite_weights_never_saved":
        p, rundir = c.loom("run", 2, ["parallel.dp=2"] + ck, env={"LOOM_INJECT_FAULT": "rank=1,step=3,where=nan_weights"}, expect=1)
        print(p.stderr.strip())
        c.expect(p.stderr, [r"not saving the checkpoint of step 4: parameter \S+ \(nan on rank 1: dp 1, tp 0, pp 0\) is not finite; "
                            r"the last good checkpoint stays \(.*latest -> ckpt-00000003\.h5\)"], "stderr")
        ckdir = os.path.join(rundir, "checkpoints")
        c.check(latest(ckdir) == "ckpt-00000003.h5", "latest names %r" % latest(ckdir))
        c.check(not os.path.exists(os.path.join(ckdir, "ckpt-00000004.h5")), "non-finite weights were checkpointed")
        # The checkpoint that stayed is good: a resume from it continues.
        c.loom("resumed", 2, ["parallel.dp=2", "checkpoint.resume=latest", "checkpoint.dir=" + ckdir])
    elif name == "nonfinite_skip_dp2":
        skip = ["train.on_nonfinite=skip"]
        p, rundir = c.loom("dp2", 2, ["parallel.dp=2"] + skip, env={"LOOM_INJECT_FAULT": "rank=1,step=3,where=nan"})
        print(p.stdout[-1500:])
        c.expect(p.stdout, [r"step 4: loss nan, gradient norm nan: not finite.*update skipped \(train\.on_nonfinite = skip; 1 in a row, 1 in all\)"], "stdout")
        s = summary(rundir)
        c.check(s["status"] == "finished" and s["skipped_steps"] == 1, "summary.json: %s, skipped %s" % (s["status"], s["skipped_steps"]))
        r = rows(rundir)
        c.check(r[3].get("skipped") is True, "metrics row of step 4 is not marked skipped")
        # One process skipping the same step: the same model continues (both replicas dropped the update).
        _, one = c.loom("one", 1, skip, env={"LOOM_INJECT_FAULT": "rank=0,step=3,where=nan"})
        a, b = losses(rundir), losses(one)
        after = [x for i, x in enumerate(a) if i != 3], [x for i, x in enumerate(b) if i != 3]
        print("losses dp 2: %s\nlosses one : %s" % (a, b))
        c.check(close(after[0], after[1], 1e-5), "dp 2 with a skipped step does not train the same model as one process")
    elif name == "nonfinite_skip_limit":
        p, rundir = c.loom("run", 1, ["train.on_nonfinite=skip", "train.max_skipped=2"],
                           env={"LOOM_INJECT_FAULT": "rank=0,step=2,where=nan_weights"}, expect=1)
        print(p.stderr.strip())
        c.expect(p.stderr, [r"3 steps in a row were not finite \(train\.max_skipped = 2\): stopping"], "stderr")
        c.check(summary(rundir)["status"] == "failed", "summary.json does not say failed")
    elif name == "nonfinite_last_step":
        p, rundir = c.loom("run", 1, [], env={"LOOM_INJECT_FAULT": "rank=0,step=7,where=nan"}, expect=1)
        print(p.stderr.strip())
        c.expect(p.stderr, [r"step 8: loss nan"], "stderr")
        c.check(summary(rundir)["status"] == "failed", "summary.json does not say failed")


def loom_checksum(values):
    """io/checkpoint.cpp's checksum of a whole tensor one rank owns: the sum, modulo 2^64, of
    mix64((index * 0x9e3779b97f4a7c15) ^ the float's bits) over its elements in row-major order."""
    import numpy
    bits = numpy.ascontiguousarray(values, dtype=numpy.float32).reshape(-1).view(numpy.uint32).astype(numpy.uint64)
    with numpy.errstate(over="ignore"):
        z = (numpy.arange(bits.size, dtype=numpy.uint64) * numpy.uint64(0x9e3779b97f4a7c15)) ^ bits
        z = z + numpy.uint64(0x9e3779b97f4a7c15)  # core/base/rng.hpp's mix64 (splitmix64's finaliser)
        z = (z ^ (z >> numpy.uint64(30))) * numpy.uint64(0xbf58476d1ce4e5b9)
        z = (z ^ (z >> numpy.uint64(27))) * numpy.uint64(0x94d049bb133111eb)
        z = z ^ (z >> numpy.uint64(31))
        total = int(z.sum(dtype=numpy.uint64))
    return total - (1 << 64) if total >= (1 << 63) else total  # as the int64 attribute holds it


def saved_run(c, tag="first", sets=(), ranks=1):
    """8 steps with checkpoints every 2 (keep 4): returns the run directory."""
    _, rundir = c.loom(tag, ranks, ["checkpoint.every=2", "checkpoint.keep=4"] + list(sets))
    return rundir


def case_resume(c, name):
    rundir = saved_run(c)
    ckdir = os.path.join(rundir, "checkpoints")
    ckpt = os.path.join(ckdir, "ckpt-00000004.h5")
    if name == "resume_refuses_nonfinite":
        import h5py
        import numpy
        # A NaN written as a diverged run writes it (its checksum the file's own, loom's formula, checked
        # first against the untouched tensor), then one from damaged bytes (the checksum left as it was).
        damaged = os.path.join(ckdir, "damaged.h5")
        shutil.copy(ckpt, damaged)
        with h5py.File(ckpt, "r+") as f:
            d = f["params/wte.weight"]
            v = d[...]
            c.check(loom_checksum(v) == int(d.attrs["checksum"]), "the test's checksum is not loom's: %d against %d" %
                    (loom_checksum(v), int(d.attrs["checksum"])))
            v[3, 5] = float("nan")
            d[...] = v
            d.attrs["checksum"] = numpy.int64(loom_checksum(v))
        with h5py.File(damaged, "r+") as f:
            d = f["params/wte.weight"]
            v = d[...]
            v[3, 5] = float("nan")
            d[...] = v
        before = snapshot(rundir)
        p, _ = c.loom("first", 1, ["checkpoint.resume=" + ckpt], expect=2)
        print(p.stderr.strip())
        c.expect(p.stderr, [re.escape(ckpt), r"tensor /params/wte\.weight holds non-finite values", r"diverged"], "stderr")
        p, _ = c.loom("first", 1, ["checkpoint.resume=" + damaged], expect=2)
        print(p.stderr.strip())
        c.expect(p.stderr, [re.escape(damaged), r"tensor /params/wte\.weight does not match its checksum: the file is corrupt"],
                 "stderr")
        c.check(snapshot(rundir) == before, "the refused resumes changed the run directory")
        os.remove(damaged)
    elif name == "resume_refuses_other_model":
        before = snapshot(rundir)
        for sets, rx in ((["model.heads=2"], r"model\.heads = 4 in the checkpoint, 2 in this deck"),
                         (["model.layers=1"], r"model\.layers = 2 in the checkpoint, 1 in this deck")):
            p, _ = c.loom("first", 1, sets + ["checkpoint.resume=latest"], expect=2)
            print(p.stderr.strip())
            c.expect(p.stderr, [rx, r"holds another model"], "stderr")
            # `loom check` of the same deck says so before a job is queued.
            cmd = [c.args.loom, "check", c.deck, "--set", "run.dir=" + rundir] + \
                sum((["--set", s] for s in sets + ["checkpoint.resume=latest"]), [])
            print("$ " + " ".join(cmd), flush=True)
            q = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            print(q.stderr.strip())
            c.check(q.returncode == 2, "loom check of a resume of another model exited %d, not 2" % q.returncode)
            c.expect(q.stderr, [r"checkpoint\.resume = latest", rx, r"holds another model"], "loom check's stderr")
        c.check(snapshot(rundir) == before, "a refused resume changed the run directory (metrics.jsonl?)")
    elif name == "resume_refuses_bad_step":
        import h5py
        for step, rx in ((5, r"has step = 5, optimizer_steps = 4"), (-1, r"has step = -1")):
            bad = os.path.join(c.dir, "bad%d.h5" % step)
            shutil.copy(ckpt, bad)
            with h5py.File(bad, "r+") as f:
                f.attrs["step"] = step
            p, _ = c.loom("bad%d" % step, 1, ["checkpoint.resume=" + bad], expect=2)
            print(p.stderr.strip())
            c.expect(p.stderr, [rx, r"step must be optimizer_steps \+ skipped_steps"], "stderr")
    elif name == "resume_refuses_no_file":
        # checkpoint.resume naming the checkpoint directory instead of a file; checkpoint.resume = auto
        # over checkpoints whose `latest` is gone (it would start afresh over them).
        before = snapshot(rundir)
        p, _ = c.loom("first", 1, ["checkpoint.resume=" + ckdir], expect=2)
        print(p.stderr.strip())
        c.expect(p.stderr, [re.escape(ckdir), r"is a directory, not a checkpoint file", r"checkpoint\.resume = latest"],
                 "stderr")
        latest = os.path.join(ckdir, "latest")
        kept = open(latest).read()
        os.remove(latest)
        p, _ = c.loom("first", 1, ["checkpoint.resume=auto"], expect=2)
        print(p.stderr.strip())
        c.expect(p.stderr, [r"checkpoint\.resume = auto", r"no 'latest' file",
                            r"--set checkpoint\.resume=" + re.escape(os.path.join(ckdir, "ckpt-00000008.h5"))], "stderr")
        with open(latest, "w") as f:
            f.write(kept)
        c.check(snapshot(rundir) == before, "a refused resume changed the run directory")
    elif name == "resume_keeps_metrics":
        first = rows(rundir)
        p, _ = c.loom("first", 1, ["checkpoint.resume=" + ckpt, "train.lr=2e-3", "train.steps=10"])
        print(p.stdout[-2500:])
        c.expect(p.stdout, [r"train\.lr: 3e-3 -> 2e-3", r"train\.steps: 8 -> 10",
                            r"continues on the curve for 10 steps: at step 5 the rate is",
                            r"4 row\(s\) past step 4 from the earlier run moved to .*metrics\.jsonl\.superseded"], "stdout")
        now = rows(rundir)
        aside = rows(rundir, "metrics.jsonl.superseded")
        print("steps now %s; set aside %s" % ([r["step"] for r in now], [r["step"] for r in aside]))
        c.check([r["step"] for r in now] == list(range(1, 11)), "metrics.jsonl does not hold steps 1..10")
        c.check(now[:4] == first[:4], "the rows up to the resumed step changed")
        c.check(aside == first[4:], "the earlier run's rows 5..8 were not set aside whole")


def case_directory(c, name):
    if name == "fresh_refused_over_checkpoints":
        rundir = saved_run(c)
        before = snapshot(rundir)
        p, _ = c.loom("first", 1, [], expect=2)
        print(p.stderr.strip())
        c.expect(p.stderr, [r"holds an earlier run's checkpoints \(ckpt-00000002\.h5, ckpt-00000004\.h5, ckpt-00000006\.h5, ckpt-00000008\.h5, latest\)",
                            r"checkpoint\.resume=auto", r"run\.overwrite = true"], "stderr")
        # `loom check` of the same deck refuses it as the run does (it passed, and the job failed).
        cmd = [c.args.loom, "check", c.deck, "--set", "run.dir=" + rundir]
        print("$ " + " ".join(cmd), flush=True)
        q = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        print(q.stderr.strip())
        c.check(q.returncode == 2, "loom check of a fresh run over checkpoints exited %d, not 2" % q.returncode)
        c.expect(q.stderr, [r"holds an earlier run's checkpoints", r"run\.overwrite = true"], "loom check's stderr")
        c.check(snapshot(rundir) == before, "the refused run changed the directory")
        p, _ = c.loom("first", 1, ["run.overwrite=true", "train.steps=3", "checkpoint.every=3"])
        left = sorted(os.listdir(os.path.join(rundir, "checkpoints")))
        print("after run.overwrite = true: %s" % left)
        c.check(left == ["ckpt-00000003.h5", "latest"], "run.overwrite left %s" % left)
    elif name == "resume_auto_and_at_end":
        auto = ["checkpoint.resume=auto", "train.steps=6", "checkpoint.every=4"]
        p, rundir = c.loom("run", 1, auto)
        ckdir = os.path.join(rundir, "checkpoints")
        files = sorted(os.listdir(ckdir))
        print("first job: %s, latest -> %s" % (files, latest(ckdir)))
        c.check(files == ["ckpt-00000004.h5", "ckpt-00000006.h5", "latest"] and latest(ckdir) == "ckpt-00000006.h5",
                "checkpoint.at_end did not save step 6")
        p, _ = c.loom("run", 1, ["checkpoint.resume=auto", "train.steps=8", "checkpoint.every=4"])
        c.expect(p.stdout, [r"resumed from .*ckpt-00000006\.h5 at step 6"], "stdout")
        c.check([r["step"] for r in rows(rundir)] == list(range(1, 9)), "the chain's metrics are not steps 1..8")
    elif name == "lock_one_run_per_dir":
        cmd, rundir = c.command("shared", 1, ["train.steps=100000000", "train.schedule=constant"])
        holder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        try:
            deadline = time.time() + 60
            while time.time() < deadline and len(rows(rundir)) < 3:
                time.sleep(0.05)
            before = rows(rundir)
            p, _ = c.loom("shared", 1, [], expect=2)
            print(p.stderr.strip())
            c.expect(p.stderr, [r"run\.dir = '.*shared' is in use by another loom run \(host \S+ pid %d since " % holder.pid],
                     "stderr")
            # A checkpoint.dir or a run.dir inside the holder's directory is refused (the checkpoint.dir
            # ran, sharing the holder's `latest` and keep rotation), and loom check says the lock is held.
            nested = ["checkpoint.dir=" + os.path.join(rundir, "checkpoints"), "checkpoint.every=1", "train.steps=2"]
            for tag, sets, said in [("other", nested, r"checkpoint\.dir = '.*shared/checkpoints' lies inside '.*shared', "
                                                       r"which is in use by another loom run \(host \S+ pid %d" % holder.pid),
                                    ("shared/nested", ["train.steps=2"], r"run\.dir = '.*shared/nested' lies inside")]:
                p, _ = c.loom(tag, 1, sets, expect=2)
                c.expect(p.stderr, [said], "stderr")
            cmd, _ = c.command("shared", 1, [])
            cmd[cmd.index("run")] = "check"
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            c.check(p.returncode == 2 and "is in use by another loom run" in p.stderr,
                    "loom check of a held run.dir: exit %d, %s" % (p.returncode, p.stderr.strip()[-200:]))
            c.check(holder.poll() is None, "the first run stopped")
            c.check(rows(rundir)[: len(before)] == before, "the refused run touched the holder's metrics")
        finally:
            holder.kill()
            holder.communicate()
        # Killed without a chance to clean up: the kernel released the lock, a new run may start (over
        # the killed run's metrics, asked with run.overwrite).
        p, _ = c.loom("shared", 1, ["train.steps=2", "run.overwrite=true"])
        c.check(not os.path.exists(os.path.join(rundir, "loom.lock")), "loom.lock left behind after a finished run")
        # run.dir = X with checkpoint.dir = X is one directory, locked once (it was refused as "in use",
        # naming its own pid).
        same = os.path.join(c.dir, "same")
        c.loom("same", 1, ["train.steps=2", "checkpoint.dir=" + same, "checkpoint.every=1"])


def case_write_failure(c, name):
    # UCX (MPICH's transport) keeps shared-memory segments as files: keep them out of the file-size
    # limit by using its TCP transport, which works within one node too.
    env = {"UCX_TLS": "self,tcp"}
    if name == "write_failure_metrics":
        p, rundir = c.loom("run", 1, [], env=env, expect=1, shell_prefix="ulimit -f 2")
        print(p.stderr.strip())
        c.expect(p.stderr, [r"cannot write '.*metrics\.jsonl': File too large"], "stderr")
        c.check("Segmentation" not in p.stderr, "a crash")
        return
    ranks = 2 if name.endswith("np2") else 1
    dp = ["parallel.dp=%d" % ranks]
    rundir = saved_run(c, sets=dp, ranks=ranks)
    ckdir = os.path.join(rundir, "checkpoints")
    before = {f: open(os.path.join(ckdir, f), "rb").read() for f in ("ckpt-00000008.h5", "latest")}
    p, _ = c.loom("first", ranks, dp + ["checkpoint.resume=latest", "train.steps=10", "checkpoint.every=1"],
                  env=env, expect=1, shell_prefix="ulimit -f 150")
    print(p.stderr.strip())
    c.expect(p.stderr, [r"checkpoint '.*ckpt-00000009\.h5\.tmp': cannot write dataset \S+ \(File too large\)",
                        r"the earlier checkpoints and `latest` are unchanged"], "stderr")
    c.check("Segmentation" not in p.stderr and "signal 11" not in p.stderr, "a crash")
    for f, data in before.items():
        c.check(open(os.path.join(ckdir, f), "rb").read() == data, "%s changed" % f)
    if ranks == 1:
        c.check(not os.path.exists(os.path.join(ckdir, "ckpt-00000009.h5.tmp")), "the .tmp was left behind")
        c.check(summary(rundir)["status"] == "failed", "summary.json does not say failed")


def loom_pids(root):
    """The loom processes among `root` and its descendants (read from /proc)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open("/proc/%s/stat" % d).read()
                parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        try:
            if open("/proc/%d/comm" % pid).read().strip() == "loom":
                found.append(pid)
        except OSError:
            pass
        frontier += [p for p, pp in parent.items() if pp == pid]
    return found


def case_interrupt(c, name):
    const = ["train.schedule=constant", "train.steps=100000000"]
    for tag, ranks, sig in (("sigterm_np2", 2, signal.SIGTERM), ("sigint_np1", 1, signal.SIGINT)):
        sets = ["parallel.dp=%d" % ranks] + const
        cmd, rundir = c.command(tag, ranks, sets)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        deadline = time.time() + 60
        while time.time() < deadline and len(rows(rundir)) < 3:
            time.sleep(0.05)
        # To the ranks themselves, as Slurm's --signal does (a signalled mpirun passes it on, but its own
        # exit status then does not reliably carry the ranks').
        for pid in loom_pids(proc.pid):
            os.kill(pid, sig)
        out, err = proc.communicate(timeout=120)
        print("%s: exit %d\n%s%s" % (tag, proc.returncode, out[-700:], err[-700:]))
        c.check(proc.returncode == 3, "%s: exit status %d, expected 3" % (tag, proc.returncode))
        s = summary(rundir)
        c.check(s["status"] == "interrupted", "%s: summary.json status %r" % (tag, s["status"]))
        ckdir = os.path.join(rundir, "checkpoints")
        c.check(re.match(r"ckpt-\d+\.h5$", latest(ckdir)) is not None, "%s: no checkpoint on the signal" % tag)
        # The next job of the chain: the same command with resume = auto continues.
        p, _ = c.loom(tag, ranks, ["parallel.dp=%d" % ranks, "train.schedule=constant", "checkpoint.resume=auto",
                                   "train.steps=%d" % (int(latest(ckdir)[5:13]) + 2)])
        c.expect(p.stdout, [r"resumed from"], "%s resume stdout" % tag)
    # SIGTERM to the launcher itself (as a user's kill, or a scheduler that signals only it): the
    # ranks save and exit 3, which the launcher may not pass on (MPICH's mpiexec often exits 0), so
    # loom's rank 0 writes it to LOOM_STATUS_FILE for job scripts.
    status_file = os.path.join(c.dir, "status")
    cmd, rundir = c.command("sigterm_launcher_np2", 2, ["parallel.dp=2"] + const)
    if cmd[0] == c.args.loom:
        return
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OPENBLAS_NUM_THREADS="1", LOOM_STATUS_FILE=status_file))
    deadline = time.time() + 60
    while time.time() < deadline and len(rows(rundir)) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # nothing of this job may outlive the case
        for pid in loom_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        out, err = proc.communicate()
        c.check(False, "sigterm_launcher_np2: the job did not end within 120 s of SIGTERM to its launcher")
    written = open(status_file).read().strip() if os.path.exists(status_file) else "(no file)"
    print("sigterm_launcher_np2: the launcher exited %d; LOOM_STATUS_FILE holds %s" % (proc.returncode, written))
    c.check(written == "3", "LOOM_STATUS_FILE holds %r after SIGTERM to the launcher, expected 3" % written)
    c.check(summary(rundir)["status"] == "interrupted", "sigterm_launcher_np2: summary.json status %r"
            % summary(rundir)["status"])


def case_numbers(c, name):
    dp2 = ["parallel.dp=2"]
    _, full = c.loom("full", 2, dp2 + ["checkpoint.every=4"])
    _, part = c.loom("part", 2, dp2 + ["checkpoint.resume=" + os.path.join(full, "checkpoints", "ckpt-00000004.h5")])
    a, b = summary(full)["comm"]["dp"]["bytes_sent_per_step"], summary(part)["comm"]["dp"]["bytes_sent_per_step"]
    print("dp bytes per step: uninterrupted %.0f, resumed for 4 of 8 steps %.0f" % (a, b))
    c.check(abs(a - b) <= 1e-3 * a, "per-step bytes of the resumed run are not the uninterrupted run's")
    _, one = c.loom("one", 1, [])
    p, tp = c.loom("tp2", 2, ["parallel.tp=2"])
    s1, s2 = summary(one), summary(tp)
    print("parameters: one process %d; tp 2 %d (rank 0 holds %d)" % (s1["parameters"], s2["parameters"], s2["parameters_rank0"]))
    c.check(s1["parameters"] == s2["parameters"] == s1["parameters_rank0"], "parameters is not the model's count")
    c.check(s2["parameters_rank0"] < s2["parameters"], "rank 0's shard at tp 2 is not smaller than the model")
    report = json.load(open(os.path.join(tp, "report.json")))
    c.check("run" in report["command_line"] and report["set_on_command_line"].get("parallel.tp") == "2",
            "report.json lacks the command line or the --set keys")
    for r in rows(tp):
        for k in ("elapsed_s", "eta_s", "time", "mfu"):
            c.check(k in r, "metrics row of step %d has no %s" % (r["step"], k))
    c.check(rows(tp)[-1]["eta_s"] == 0, "the last row's ETA is not 0")
    c.expect(p.stdout, [r"MFU +: against [0-9.]+ TFLOP/s \(measured matrix-product rate, summed over 2 ranks\)",
                        r"\| MFU [0-9.]+% \|", r"ETA 0 s"], "stdout")


CASES = {
    "nonfinite_stop_dp2": case_nonfinite, "nonfinite_weights_never_saved": case_nonfinite,
    "nonfinite_skip_dp2": case_nonfinite, "nonfinite_skip_limit": case_nonfinite, "nonfinite_last_step": case_nonfinite,
    "resume_refuses_nonfinite": case_resume, "resume_refuses_other_model": case_resume,
    "resume_refuses_bad_step": case_resume, "resume_refuses_no_file": case_resume, "resume_keeps_metrics": case_resume,
    "fresh_refused_over_checkpoints": case_directory, "resume_auto_and_at_end": case_directory,
    "lock_one_run_per_dir": case_directory,
    "write_failure_np1": case_write_failure, "write_failure_np2": case_write_failure,
    "write_failure_metrics": case_write_failure,
    "interrupt_exit_status": case_interrupt,
    "numbers": case_numbers,
}


def main():
    args = common.case_arguments(__doc__, CASES)
    c = Case(args, args.case)
    CASES[args.case](c, args.case)
    return c.done(args.case)


if __name__ == "__main__":
    sys.exit(main())
