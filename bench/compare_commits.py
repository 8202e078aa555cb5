#!/usr/bin/env python3
"""Two commits of loom against each other in one session: is the new one slower than its noise?

    python3 bench/compare_commits.py --old REV --new REV [--rounds 3] [--steps 20] [--work build/bench-cmp]
    python3 bench/compare_commits.py --old main --new worktree --new-build build   # uncommitted work

REV is anything `git rev-parse` accepts (main~1, a hash, a tag), or `worktree`: the current working
tree's own build (--old-build / --new-build DIR, default build/; not built here, run its build first).

  1. Builds each commit once: a `git clone --shared` of this repository checked out at the commit in
     WORK/<hash12>/src (so the build's banner names the commit), cmake -DCMAKE_BUILD_TYPE=Release
     -DLOOM_BUILD_TESTS=OFF and `cmake --build --target loom` (the driver and its plugins) into
     WORK/<hash12>/build; log in WORK/<hash12>/build.log. A folder whose BUILT stamp holds the commit's
     full hash is reused as it is.
  2. Runs, interleaved, K rounds of each benchmark on both builds (the order alternates each round:
     old new, new old, ... so drift and warm-up hit both alike), one BLAS thread per rank, each build
     on its own commit's bench/bench.deck (the script says whether the two decks differ):
       single  1 rank, loom run bench.deck (as bench/gpt_vs_torch.py runs loom)
       bf16    the same with precision.dtype=bf16 (gpt_vs_torch.py's loom bf16 run)
       dp2     mpirun -n 2, parallel.dp=2, per-rank batch 8, data_parallel.bucket_mb=4 (as bench/weak_scaling.py)
       pp2     mpirun -n 2, parallel.pp=2, 1F1B, m = 4 micro-batches (as bench/pipeline.py)
     and reads tokens_per_s (steady state, first step excluded) from each run's summary.json.
  3. PyTorch's tokens/s on the same model, once, for scale (bench/gpt_vs_torch.py --torch-only under
     /usr/bin/python3, when that has torch; --no-torch skips it).
  4. Per benchmark: every round's tokens/s for old and new, the median of each, new/old of the medians,
     each commit's run-to-run noise (max - min) / median over its rounds, and the verdict
     "within noise" when |ratio - 1| <= max(noise old, noise new), else SLOWER or FASTER; then one
     JSON line with everything.

Standard library only. A benchmark, not a test: exit 0 when every build and run succeeded (whatever
the verdicts), 1 otherwise. Runs go to WORK/runs/ (replaced each time); the builds stay for reuse.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHES = ("single", "bf16", "dp2", "pp2")
DESCRIPTION = {
    "single": "1 rank (gpt_vs_torch.py's loom run)",
    "bf16": "1 rank, precision.dtype=bf16 (gpt_vs_torch.py's loom bf16 run)",
    "dp2": "dp = 2, per-rank batch 8 (weak_scaling.py)",
    "pp2": "pp = 2, 1F1B, m = 4 (pipeline.py)",
}


class Failure(Exception):
    pass


def git(repo, *args):
    p = subprocess.run(["git", "-C", repo] + list(args), capture_output=True, text=True)
    if p.returncode != 0:
        raise Failure("git %s: %s" % (" ".join(args), p.stderr.strip()))
    return p.stdout.strip()


def tail(path, n=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def build_commit(repo, rev, work, jobs):
    """WORK/<hash12>/{src,build}: cloned, configured and built once per commit; reused after."""
    full = git(repo, "rev-parse", "--verify", rev + "^{commit}")
    subject = git(repo, "log", "-1", "--format=%s", full)
    folder = os.path.join(work, full[:12])
    src, bld = os.path.join(folder, "src"), os.path.join(folder, "build")
    stamp, log = os.path.join(folder, "BUILT"), os.path.join(folder, "build.log")
    loom = os.path.join(bld, "loom")
    info = dict(rev=rev, commit=full, subject=subject, loom=loom, deck=os.path.join(src, "bench", "bench.deck"))
    if os.path.exists(stamp) and open(stamp).read().strip() == full and os.access(loom, os.X_OK):
        print("[%s] %s %s: reusing %s" % (rev, full[:12], subject[:60], folder), flush=True)
        info["built"] = "reused"
        return info
    os.makedirs(folder, exist_ok=True)
    if os.path.isdir(os.path.join(src, ".git")) and git(src, "rev-parse", "HEAD") == full:
        pass  # an earlier build stopped part way: keep the checkout and the build folder
    else:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(bld, ignore_errors=True)
        # --shared: the objects stay in this repository (nothing copied, nothing registered in it).
        git(repo, "clone", "-q", "--shared", "--no-checkout", os.path.abspath(git(repo, "rev-parse", "--show-toplevel")), src)
        git(src, "checkout", "-q", "--detach", full)
    print("[%s] %s %s: building in %s (log %s) ..." % (rev, full[:12], subject[:60], folder, log), flush=True)
    t0 = time.time()
    with open(log, "a") as f:
        for cmd in (["cmake", "-S", src, "-B", bld, "-DCMAKE_BUILD_TYPE=Release", "-DLOOM_BUILD_TESTS=OFF"],
                    ["cmake", "--build", bld, "-j%d" % jobs, "--target", "loom"]):
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
            if p.returncode != 0:
                raise Failure("build of %s failed (%s exited %d); %s ends:\n%s"
                              % (rev, cmd[1], p.returncode, log, tail(log)))
    with open(stamp, "w") as f:
        f.write(full + "\n")
    print("[%s] built in %.0f s" % (rev, time.time() - t0), flush=True)
    info["built"] = "built in %.0f s" % (time.time() - t0)
    return info


def worktree_build(repo, build_dir):
    """`worktree`: the working tree's own build, as it is (this script does not build it)."""
    top = git(repo, "rev-parse", "--show-toplevel")
    loom = os.path.abspath(os.path.join(top, build_dir) if not os.path.isabs(build_dir) else build_dir)
    loom = os.path.join(loom, "loom")
    if not os.access(loom, os.X_OK):
        raise Failure("worktree: no executable %s (build the working tree first)" % loom)
    head = git(repo, "rev-parse", "HEAD")
    dirty = bool(git(repo, "status", "--porcelain", "--untracked-files=no"))
    print("[worktree] %s at HEAD %s%s" % (loom, head[:12], " + uncommitted changes" if dirty else ""), flush=True)
    return dict(rev="worktree", commit=head + ("+dirty" if dirty else ""), subject="working tree", loom=loom,
                deck=os.path.join(top, "bench", "bench.deck"), built="not built here")


def bucket_key(build):
    """data_parallel.bucket_mb, or data.bucket_mb for a loom from before the data-parallel keys had
    their own section."""
    if "bucket_key" not in build:
        # an empty run.dir: `loom check` refuses one that holds an earlier run's results (exit 2),
        # which must not read as "the key is unknown"
        with tempfile.TemporaryDirectory() as empty:
            p = subprocess.run([build["loom"], "check", build["deck"], "--set", "data_parallel.bucket_mb=4",
                                "--set", "run.dir=" + empty], capture_output=True, text=True)
        build["bucket_key"] = "data_parallel.bucket_mb" if p.returncode == 0 else "data.bucket_mb"
    return build["bucket_key"]


def bench_cmd(name, build, mpirun, steps, rundir):
    deck = build["deck"]
    common = ["--set", "train.steps=%d" % steps, "--set", "run.dir=" + rundir]
    if name == "single":
        return [build["loom"], "run", deck] + common
    if name == "bf16":
        return [build["loom"], "run", deck, "--set", "precision.dtype=bf16"] + common
    if name == "dp2":
        return [mpirun, "-n", "2", build["loom"], "run", deck, "--set", "parallel.dp=2", "--set", "train.batch=16",
                "--set", bucket_key(build) + "=4"] + common
    if name == "pp2":
        return [mpirun, "-n", "2", build["loom"], "run", deck, "--set", "parallel.pp=2",
                "--set", "pipeline.schedule=1f1b", "--set", "pipeline.virtual_stages=1",
                "--set", "train.micro_batches=4", "--set", "train.log_every=1"] + common
    raise ValueError(name)


def run_bench(name, label, build, rnd, args):
    rundir = os.path.join(args.work, "runs", "%s-%s-r%d" % (name, label, rnd))
    shutil.rmtree(rundir, ignore_errors=True)  # a fresh run folder: loom refuses to train over an old run
    os.makedirs(os.path.dirname(rundir), exist_ok=True)
    cmd = bench_cmd(name, build, args.mpirun, args.steps, rundir)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    log = rundir + ".log"
    with open(log, "w") as f:
        f.write("$ OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 " + " ".join(cmd) + "\n")
        f.flush()
        # Own process group, so a hung run is killed with all its ranks and nothing else.
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise Failure("%s on %s hung (killed after %d s); log %s" % (name, label, args.timeout, log))
    summary = os.path.join(rundir, "summary.json")
    if rc != 0 or not os.path.exists(summary):
        raise Failure("%s on %s exited %d%s; %s ends:\n%s" % (name, label, rc, "" if os.path.exists(summary)
                                                              else ", no summary.json", log, tail(log)))
    with open(summary) as f:
        return float(json.load(f)["tokens_per_s"])


def torch_tokens_per_s(deck, steps, python):
    """PyTorch on the same model, one thread, via gpt_vs_torch.py --torch-only (None when no torch)."""
    if not os.access(python, os.X_OK) or subprocess.run([python, "-c", "import torch"], capture_output=True).returncode:
        print("torch: %s has no torch, skipped" % python, flush=True)
        return None
    cmd = [python, os.path.join(HERE, "gpt_vs_torch.py"), "--torch-only", "--no-sgemm", "--deck", deck,
           "--steps", str(steps)]
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise Failure("gpt_vs_torch.py --torch-only exited %d:\n%s" % (p.returncode, (p.stdout + p.stderr)[-3000:]))
    return float(json.loads(lines[-1])["torch_tokens_per_s"])


def summarize(old, new):
    mo, mn = statistics.median(old), statistics.median(new)
    no, nn = (max(old) - min(old)) / mo, (max(new) - min(new)) / mn
    ratio = mn / mo
    noise = max(no, nn)
    verdict = "within noise" if abs(ratio - 1) <= noise else ("SLOWER" if ratio < 1 else "FASTER")
    return dict(old=old, new=new, median_old=mo, median_new=mn, ratio_new_over_old=ratio,
                noise_old=no, noise_new=nn, verdict=verdict)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="git revision, or 'worktree'")
    ap.add_argument("--new", required=True, help="git revision, or 'worktree'")
    ap.add_argument("--old-build", default="build", help="the working tree's build folder when --old worktree")
    ap.add_argument("--new-build", default="build", help="the working tree's build folder when --new worktree")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each benchmark on each commit")
    ap.add_argument("--steps", type=int, default=20, help="training steps per run (the first is not timed)")
    ap.add_argument("--work", default="build/bench-cmp", help="builds (kept, reused) and runs")
    ap.add_argument("--bench", default=",".join(BENCHES), help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--jobs", type=int, default=2, help="parallel build jobs")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--timeout", type=int, default=600, help="seconds before one loom run counts as hung")
    ap.add_argument("--torch-python", default="/usr/bin/python3", help="the python with torch")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (loom's tokens_per_s excludes the first step)")
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the noise is the spread over each commit's rounds)")
    benches = [b.strip() for b in args.bench.split(",") if b.strip()]
    bad = [b for b in benches if b not in BENCHES]
    if bad or not benches:
        ap.error("--bench: unknown %s (choose from %s)" % (bad, ",".join(BENCHES)))
    args.work = os.path.abspath(args.work)
    os.makedirs(args.work, exist_ok=True)
    repo = os.path.dirname(HERE)

    try:
        builds = {}
        for label, rev, bdir in (("old", args.old, args.old_build), ("new", args.new, args.new_build)):
            builds[label] = (worktree_build(repo, bdir) if rev == "worktree"
                             else build_commit(repo, rev, args.work, args.jobs))
    except Failure as e:
        print("error: %s" % e, file=sys.stderr)
        return 1
    with open(builds["old"]["deck"], "rb") as a, open(builds["new"]["deck"], "rb") as b:
        same_deck = a.read() == b.read()
    print("bench/bench.deck: %s" % ("the same in both" if same_deck else
                                    "DIFFERS between the two (each build runs its own)"), flush=True)

    ok = True
    torch_tps = None
    if not args.no_torch:
        try:
            torch_tps = torch_tokens_per_s(builds["new"]["deck"], args.steps, args.torch_python)
            if torch_tps is not None:
                print("torch tokens/s (1 thread, bench model, %d steps): %.1f" % (args.steps, torch_tps), flush=True)
        except Failure as e:
            print("torch failed: %s" % e, file=sys.stderr)
            ok = False

    load_start = os.getloadavg()[0]
    t0 = time.time()
    res = {b: {"old": [], "new": []} for b in benches}
    try:
        for rnd in range(args.rounds):
            order = ("old", "new") if rnd % 2 == 0 else ("new", "old")
            for b in benches:
                for label in order:
                    tps = run_bench(b, label, builds[label], rnd, args)
                    res[b][label].append(tps)
                    print("round %d  %-6s %-3s %10.1f tokens/s" % (rnd + 1, b, label, tps), flush=True)
    except Failure as e:
        print("error: %s" % e, file=sys.stderr)
        return 1
    load_end = os.getloadavg()[0]

    print()
    print("old: %s %s (%s)" % (builds["old"]["rev"], builds["old"]["commit"][:12], builds["old"]["subject"][:70]))
    print("new: %s %s (%s)" % (builds["new"]["rev"], builds["new"]["commit"][:12], builds["new"]["subject"][:70]))
    print("%d rounds x %d steps, interleaved (order alternating per round), one BLAS thread per rank; "
          "load average %.2f at start, %.2f at end, %.0f s" % (args.rounds, args.steps, load_start, load_end,
                                                               time.time() - t0))
    if torch_tps is not None:
        print("torch tokens/s (1 thread, for scale): %.1f" % torch_tps)
    out = {}
    for b in benches:
        s = summarize(res[b]["old"], res[b]["new"])
        out[b] = s
        print()
        print("%s: %s, tokens/s" % (b, DESCRIPTION[b]))
        print("  %-12s %s" % ("old rounds", "  ".join("%9.1f" % v for v in s["old"])))
        print("  %-12s %s" % ("new rounds", "  ".join("%9.1f" % v for v in s["new"])))
        print("  median old %9.1f   new %9.1f   new/old %.3f" % (s["median_old"], s["median_new"],
                                                                s["ratio_new_over_old"]))
        print("  noise  old %9.3f   new %9.3f   ((max - min) / median)" % (s["noise_old"], s["noise_new"]))
        print("  verdict: %s (|%.3f - 1| = %.3f %s max noise %.3f)" % (
            s["verdict"], s["ratio_new_over_old"], abs(s["ratio_new_over_old"] - 1),
            "<=" if s["verdict"] == "within noise" else ">", max(s["noise_old"], s["noise_new"])))
        if b == "single" and torch_tps is not None:
            s["new_over_torch"] = s["median_new"] / torch_tps
            s["old_over_torch"] = s["median_old"] / torch_tps
            print("  loom/torch: old %.3f, new %.3f" % (s["old_over_torch"], s["new_over_torch"]))
    print(json.dumps({
        "old": {k: builds["old"][k] for k in ("rev", "commit", "loom")},
        "new": {k: builds["new"][k] for k in ("rev", "commit", "loom")},
        "rounds": args.rounds, "steps": args.steps, "same_deck": same_deck, "torch_tokens_per_s": torch_tps,
        "load_start": load_start, "load_end": load_end, "benchmarks": out}, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
