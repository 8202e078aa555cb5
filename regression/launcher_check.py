#!/usr/bin/env python3
"""Every test that starts ranks does so through the launcher CMake found (MPIEXEC_EXECUTABLE), so that
`cmake -DMPIEXEC_EXECUTABLE=$(command -v srun)` moves the whole suite onto srun inside an allocation.

    python3 regression/launcher_check.py --build build --mpiexec /usr/bin/mpiexec --wrapper regression/launch_wrapper.sh

1. From `ctest --show-only=json-v1`: every test labelled `mpi` names MPIEXEC_EXECUTABLE (as its command,
   a --mpirun argument or MPIRUN in its environment), every test that runs it directly is labelled
   `mpi`, and no test names another launcher (mpirun, mpiexec, srun) of its own.
2. One test of each family (the script or program it runs) is run again with MPIEXEC_EXECUTABLE
   replaced by the recording wrapper (regression/launch_wrapper.sh) and its own work folder: it must
   pass, and the wrapper must have recorded its launches. A family whose test still started ranks
   some other way (a hard-coded `mpirun` in a script) leaves the wrapper's log empty and fails here.
   A test that exits with its SKIP_RETURN_CODE having started nothing (the timing check without
   LOOM_TIMING=1) is printed as skipped, not failed.
Standard library only.
"""
import argparse
import json
import re
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import tempfile

LAUNCHER_NAMES = ("mpirun", "mpiexec", "srun", "mpiexec.hydra", "mpiexec.mpich", "mpirun.mpich")


def properties(test):
    return {p["name"]: p["value"] for p in test.get("properties", [])}


def names_launcher(test, mpiexec):
    """Runs MPIEXEC_EXECUTABLE itself, hands it to a script (--mpirun) or to a job script (MPIRUN)."""
    cmd = test.get("command", [])
    env = properties(test).get("ENVIRONMENT", [])
    handed = any(a == "--mpirun" and b == mpiexec for a, b in zip(cmd, cmd[1:]))
    return (cmd[:1] == [mpiexec]) or handed or any(e == "MPIRUN=" + mpiexec for e in env)


def family(test, mpiexec):
    """The script or program a test runs: one of each is run again under the wrapper."""
    cmd = test["command"]
    if cmd[0] == mpiexec:  # mpiexec -n N [preflags] PROGRAM: the first existing file after the count
        return os.path.basename(next((w for w in cmd[3:] if os.path.isfile(w)), cmd[-1]))
    if os.path.basename(cmd[0]).startswith("python"):
        return os.path.basename(cmd[1])
    return os.path.basename(cmd[0])


def test_files_copy(build, workdir):
    """The build's CTestTestfile.cmake files (they name every test by absolute paths) copied under
    workdir: `ctest --show-only` rewrites its test directory's Testing/Temporary/LastTest.log, which in
    the build itself is the log of the suite this check runs inside."""
    copy = os.path.join(os.path.abspath(workdir), "test-files")
    shutil.rmtree(copy, ignore_errors=True)
    for dirpath, _, files in os.walk(build):
        if "CTestTestfile.cmake" in files:
            rel = os.path.relpath(dirpath, build)
            os.makedirs(os.path.join(copy, rel), exist_ok=True)
            shutil.copy(os.path.join(dirpath, "CTestTestfile.cmake"), os.path.join(copy, rel))
    return copy


def two_ranks(name):
    return any(w in name for w in ("dp2", "np2", "pp2", "tp2")) or name == "regression.pp_trace"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True)
    ap.add_argument("--mpiexec", required=True, help="MPIEXEC_EXECUTABLE as configured")
    ap.add_argument("--wrapper", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--static-only", action="store_true")
    ap.add_argument("--rerun-install", action="store_true", help="rerun the install-labelled families too")
    args = ap.parse_args()
    p = subprocess.run(["ctest", "--test-dir", test_files_copy(args.build, args.workdir), "--show-only=json-v1"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("ctest --show-only failed: " + p.stderr)
    tests = json.loads(p.stdout)["tests"]
    failures = []
    launching = []
    for t in tests:
        labels = properties(t).get("LABELS", [])
        uses = names_launcher(t, args.mpiexec)
        if "mpi" in labels and not uses:
            failures.append("%s is labelled mpi but does not name MPIEXEC_EXECUTABLE (%s): %s"
                            % (t["name"], args.mpiexec, " ".join(t.get("command", []))))
        if t.get("command", [])[:1] == [args.mpiexec] and "mpi" not in labels:
            failures.append("%s starts ranks through %s but is not labelled mpi" % (t["name"], args.mpiexec))
        own = [w for w in t.get("command", []) if os.path.basename(w) in LAUNCHER_NAMES and w != args.mpiexec]
        if own:
            failures.append("%s names a launcher of its own: %s" % (t["name"], own))
        if uses and "mpi" in labels:
            launching.append(t)
    print("%d tests, %d labelled mpi start ranks through %s" % (len(tests), len(launching), args.mpiexec))

    if not args.static_only:
        chosen = {}
        # Of each family, one whose name says it runs 2 ranks, else any; of those the cheapest by its
        # COST property (set on the long tests, which start first), else the first.
        def rank(t):
            return (not two_ranks(t["name"]), float(properties(t).get("COST", 0)))
        for t in launching:
            f = family(t, args.mpiexec)
            if f not in chosen or rank(t) < rank(chosen[f]):
                chosen[f] = t
        os.makedirs(args.workdir, exist_ok=True)
        for f, t in sorted(chosen.items()):
            labels = properties(t).get("LABELS", [])
            if "install" in labels and not args.rerun_install:
                # Each builds and installs a package first (half a minute alone, minutes beside the suite):
                # its script is read instead for a launcher of its own (the static check above already
                # holds its command to MPIEXEC_EXECUTABLE). --rerun-install runs it under the wrapper too.
                script = next((w for w in t["command"] if w.endswith(".py") and os.path.isfile(w)), None)
                text = open(script).read() if script else ""
                own = sorted({n for n in LAUNCHER_NAMES if re.search(r"[\"']%s[\"']" % re.escape(n), text)})
                print("  %s: read, not rerun (label install): %s" % (t["name"], "launchers named in %s: %s" % (
                    os.path.basename(script), own) if own else "no launcher of its own in " + str(script)))
                if own:
                    failures.append("%s names a launcher of its own: %s" % (script, own))
                continue
            shutil.rmtree(os.path.join(args.workdir, t["name"]), ignore_errors=True)  # its runs start afresh
            log = tempfile.NamedTemporaryFile(prefix="launches-", dir=args.workdir, delete=False).name
            cmd, rewrite_next = [], False
            for w in t["command"]:
                if rewrite_next:
                    w = os.path.join(args.workdir, t["name"])
                    rewrite_next = False
                elif w == args.mpiexec:
                    w = os.path.abspath(args.wrapper)
                elif w.startswith("run.dir="):
                    w = "run.dir=" + os.path.join(args.workdir, t["name"])
                rewrite_next = w == "--workdir"
                cmd.append(w)
            props = properties(t)
            # The real launcher behind the wrapper: the configured one, unless that is the wrapper itself
            # (a suite configured with it), whose own real launcher then stays.
            same = os.path.realpath(args.mpiexec) == os.path.realpath(args.wrapper)
            real = os.environ.get("LOOM_REAL_MPIEXEC", "mpiexec") if same else args.mpiexec
            env = dict(os.environ, LOOM_LAUNCH_LOG=log, LOOM_REAL_MPIEXEC=real)
            for e in props.get("ENVIRONMENT", []):
                k, v = e.split("=", 1)
                env[k] = os.path.abspath(args.wrapper) if (k == "MPIRUN" and v == args.mpiexec) else v
            print("$ " + " ".join(cmd), flush=True)
            r = subprocess.run(cmd, env=env, cwd=props.get("WORKING_DIRECTORY"), capture_output=True, text=True,
                               timeout=600)
            launches = open(log).read().splitlines()
            os.unlink(log)
            print("  %s: exit %d, %d launches through the wrapper%s" % (t["name"], r.returncode, len(launches),
                  (": " + launches[0]) if launches else ""), flush=True)
            skip = props.get("SKIP_RETURN_CODE")
            if skip is not None and r.returncode == int(skip) and not launches:
                # A test that skips here (no GPU; the timing check unless LOOM_TIMING=1) says so and
                # starts nothing: its family's launches cannot be seen, which is printed, not failed.
                print("  %s skipped here (exit %s): %s" % (t["name"], skip, (r.stdout + r.stderr).strip()[-300:]))
                continue
            if r.returncode != 0:
                sys.stdout.write(r.stdout[-2000:] + r.stderr[-2000:])
                failures.append("%s failed under the wrapper (exit %d)" % (t["name"], r.returncode))
            if not launches:
                failures.append("%s started no ranks through MPIEXEC_EXECUTABLE (the wrapper recorded nothing)"
                                % t["name"])
    return common.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
