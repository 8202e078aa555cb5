#!/usr/bin/env python3
"""`cmake --install` gives a loom a user can build a plugin against and run from anywhere.

    python3 regression/install_check.py --build build --workdir build/install-check

1. Installs the build tree into a fresh prefix P: P/bin/loom, P/lib/libloom_{core,io}.so, the plugins
   in P/lib/loom/, the headers, the CMake package, P/share/loom/{inputs,jobscripts,examples/plugin}.
   The package names nothing in the source or build tree, and no installed RUNPATH points outside P.
2. Copies the repository's plugin template (plugins/example/) elsewhere and builds it with
   find_package(loom) + loom::plugin against P alone, installing it into P/lib/loom.
3. Moves P (the installed tree must not depend on where it was installed) and, from another
   directory with LOOM_PLUGIN_PATH unset, runs P/bin/loom: `plugins` lists lossguard; a deck with
   run.plugins=lossguard finishes; with a guard that must trip, the run stops with its reason (exit 1).
4. The installed job script P/share/loom/jobscripts/local.sh runs the installed quickstart deck with
   no LOOM set and no loom on PATH: it finds P/bin/loom beside it and says so.
Standard library only.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


run = common.run_noting


def runpaths(path):
    p = subprocess.run(["readelf", "-d", path], capture_output=True, text=True)
    return [line.split("[", 1)[1].rstrip("]") for line in p.stdout.splitlines() if "RUNPATH" in line or "RPATH" in line]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True)
    ap.add_argument("--workdir", required=True)
    common.add_launcher_arguments(ap)
    args = ap.parse_args()
    build, work = os.path.abspath(args.build), os.path.abspath(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    failures = []
    prefix = os.path.join(work, "prefix")
    run(["cmake", "--install", build, "--prefix", prefix], failures)
    for rel in ("bin/loom", "lib/libloom_core.so", "lib/libloom_io.so", "lib/loom/libloom_data.so",
                "lib/loom/libloom_tensor.so", "lib/loom/libloom_pipeline.so", "lib/loom/libloom_zero.so",
                "lib/loom/libloom_mixed_precision.so", "lib/loom/libloom_compression.so",
                "include/loom/core/engine/plugin.hpp", "include/loom/io/deck.hpp", "include/loom/loom/build_info.hpp",
                "lib/cmake/loom/loomConfig.cmake", "lib/cmake/loom/loomTargets.cmake",
                "share/loom/inputs/quickstart.deck", "share/loom/jobscripts/slurm.sbatch",
                "share/loom/examples/plugin/CMakeLists.txt"):
        if not os.path.exists(os.path.join(prefix, rel)):
            failures.append("not installed: P/" + rel)
    for root, _, files in os.walk(os.path.join(prefix, "lib", "cmake", "loom")):
        for f in files:
            text = open(os.path.join(root, f)).read()
            for tree in (REPO, build):
                if tree + "/" in text:
                    failures.append("the package's %s names %s" % (f, tree))
    # Each binary's RUNPATH is relative to where it lies and leads to the libraries it needs.
    for rel, needs in (("bin/loom", "libloom_core.so"), ("lib/libloom_io.so", "libloom_core.so"),
                       ("lib/loom/libloom_data.so", "libloom_core.so"), ("lib/loom/libloom_zero.so", "libloom_io.so")):
        here = os.path.dirname(os.path.join(prefix, rel))
        paths = [rp for entry in runpaths(os.path.join(prefix, rel)) for rp in entry.split(":")]
        if any(not rp.startswith("$ORIGIN") for rp in paths):
            failures.append("P/%s has RUNPATH %s (not relative to where it lies)" % (rel, paths))
        if not any(os.path.exists(os.path.join(rp.replace("$ORIGIN", here), needs)) for rp in paths):
            failures.append("P/%s: its RUNPATH %s does not lead to %s" % (rel, paths, needs))
    print("installed: " + ", ".join(sorted(os.listdir(prefix))), flush=True)

    # The template, copied as a user would, built against the installed package only.
    src = os.path.join(work, "my-plugin")
    shutil.copytree(os.path.join(REPO, "plugins", "example"), src)
    obj = os.path.join(work, "my-plugin-build")
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_PLUGIN_PATH", "CMAKE_PREFIX_PATH", "LD_LIBRARY_PATH")}
    run(["cmake", "-S", src, "-B", obj, "-DCMAKE_PREFIX_PATH=" + prefix], failures, env=env)
    run(["cmake", "--build", obj], failures, env=env)
    run(["cmake", "--install", obj], failures, env=env)
    if not os.path.exists(os.path.join(prefix, "lib", "loom", "libloom_lossguard.so")):
        failures.append("the template's plugin is not in P/lib/loom")

    # Moved, and run from elsewhere.
    moved = os.path.join(work, "moved-prefix")
    os.rename(prefix, moved)
    loom = os.path.join(moved, "bin", "loom")
    elsewhere = os.path.join(work, "elsewhere")
    os.makedirs(elsewhere)
    env = dict(env, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = run([loom, "plugins"], failures, env=env, cwd=elsewhere)
    if "lossguard 1.0.0" not in p.stdout or os.path.join(moved, "lib", "loom", "libloom_lossguard.so") not in p.stdout:
        failures.append("`loom plugins` does not list lossguard from the moved prefix:\n" + p.stdout[:1500])
    p = subprocess.run(["ldd", loom], capture_output=True, text=True)
    core = [line for line in p.stdout.splitlines() if "libloom_core" in line]
    where = os.path.realpath(core[0].split("=>", 1)[1].split("(")[0].strip()) if core else ""
    if os.path.dirname(where) != os.path.join(moved, "lib"):
        failures.append("P/bin/loom loads libloom_core from elsewhere: %s" % core)
    deck = os.path.join(moved, "share", "loom", "inputs", "synthetic.deck")
    base = [loom, "run", deck, "--set", "run.plugins=lossguard", "--set", "train.steps=20"]
    p = run(base + ["--set", "run.dir=guarded"], failures, env=env, cwd=elsewhere)
    if "strategy: lossguard 1.0.0" not in p.stdout + p.stderr:
        failures.append("the run did not use lossguard")
    p = run(base + ["--set", "run.dir=tripped", "--set", "lossguard.after=0", "--set", "lossguard.max_ratio=1"],
            failures, expect=1, env=env, cwd=elsewhere)
    if "lossguard: step" not in p.stderr:
        failures.append("a tripped guard did not stop the run with its reason: " + p.stderr[-500:])
    else:
        line = [l for l in p.stderr.splitlines() if "lossguard: step" in l][0]
        print("tripped: " + line)
        # The step it names is the step lines' and metrics.jsonl's (counted from 1), with that loss.
        m = re.search(r"lossguard: step (\d+) loss (\S+)", line)
        with open(os.path.join(elsewhere, "tripped", "metrics.jsonl")) as f:
            losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r and "step" in r}
        step, loss = int(m.group(1)), float(m.group(2))
        if step not in losses or abs(losses[step] - loss) > 1e-5 * abs(loss):
            failures.append("lossguard names step %d loss %g, but metrics.jsonl has %s at that step (steps count from 1)"
                            % (step, loss, losses.get(step)))
    p = run(base + ["--set", "run.dir=typo", "--set", "lossguard.max_rato=3"], failures, expect=2, env=env, cwd=elsewhere)
    if "lossguard.max_ratio" not in p.stderr:
        failures.append("a misspelt plugin key is not refused with the right name: " + p.stderr[-500:])

    # The installed job script finds the installed loom by itself.
    script = os.path.join(moved, "share", "loom", "jobscripts", "local.sh")
    quick = os.path.join(moved, "share", "loom", "inputs", "quickstart.deck")
    path = [d for d in env.get("PATH", "").split(":") if d and not os.access(os.path.join(d, "loom"), os.X_OK)]
    js_env = {k: v for k, v in env.items() if k != "LOOM"}
    js_env.update(PATH=":".join(path), MPIRUN=args.mpirun, MPIRUN_NP_FLAG=args.np_flag, MPIRUN_PREFLAGS=args.mpi_preflags)
    p = run(["bash", script, quick, "--set", "train.steps=2", "--set", "run.dir=jobscript"], failures, env=js_env,
            cwd=elsewhere)
    print(p.stdout[:400])
    if "of " + loom not in p.stdout:
        failures.append("the installed local.sh does not say it runs the installed " + loom + ": " + p.stdout[:300])

    return common.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
