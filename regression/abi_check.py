#!/usr/bin/env python3
"""A plugin built against an older installed loom keeps loading, and computes the same, after a
back-end operation is added (DESIGN.md "The plugin face").

    python3 regression/abi_check.py --build build --workdir build/abi-check [--mpirun mpiexec ...]

1. Installs the build tree into a prefix NEW: today's loom.
2. Makes OLD, the package as it was before an operation was added: NEW with the first operation of
   LOOM_BACKEND_OPS (the whole back end's list, core/backend/backend_ops.hpp) taken out of its
   installed headers. The first is the worst place to add one: every later slot of Backend's vtable
   moves. (Only headers differ: libloom_core exports the same symbols either way, so what a plugin
   compiles against OLD is what it would have been before the operation came.)
3. Builds, against OLD alone, the plugin template (plugins/example/, lossguard) and a copy of the
   compression strategy (plugins/compression/, which calls a dozen back-end operations: copies, fills,
   products, int8 and top-k kernels) as an out-of-tree plugin of the same name.
4. Runs NEW's loom with those old plugins first on LOOM_PLUGIN_PATH: each loads (the plugin ABI did
   not change), and runs of the synthetic deck at dp 2 with int8 and with PowerSGD compression (plus
   lossguard) give bit for bit the losses of NEW's own compression plugin.
5. Shows the check can fail: a compression plugin built against PLANTED, NEW with an operation it
   does not call taken out of the plugin face (LOOM_FACE_OPS) instead, must not give those losses
   (the slots it calls moved).
Standard library only.
"""
import argparse
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OPS_HEADER = os.path.join("include", "loom", "core", "backend", "backend_ops.hpp")

# An out-of-tree build of a copy of plugins/compression/ against an installed loom.
COMPRESSION_CMAKE = """cmake_minimum_required(VERSION 3.18)
project(loom_compression_copy LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(loom REQUIRED)
add_library(loom_compression MODULE plugins/compression/compression.cpp plugins/compression/compress.cpp)
target_include_directories(loom_compression PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(loom_compression PRIVATE loom::plugin)
set_target_properties(loom_compression PROPERTIES PREFIX "lib" OUTPUT_NAME "loom_compression")
install(TARGETS loom_compression LIBRARY DESTINATION ${CMAKE_INSTALL_PREFIX})
"""


run = common.run_noting


def drop_operation(header, macro, name=None):
    """Takes the OP(...) entry `name` (the first if None) of `#define macro(OP)` out of `header`;
    returns its name."""
    text = open(header).read()
    start = text.index("#define %s(OP)" % macro)
    at = text.index("OP(", text.index("\n", start))
    while name and not re.match(r"OP\(\s*[^,]+,\s*%s\b" % name, text[at:]):
        at = text.index("OP(", at + 3)
    depth, end = 0, at + 2
    while True:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            break
        end += 1
    name = re.match(r"OP\(\s*[^,]+,\s*(\w+)", text[at:]).group(1)
    # The entry and the continuation backslashes of its lines, up to the next entry.
    rest = text.index("OP(", end)
    with open(header, "w") as f:
        f.write(text[:at] + text[rest:])
    return name


def package_without(new, where, macro, name=None):
    """A copy of the installed package `new` whose headers lack operation `name` (the first if None)
    of `macro`."""
    shutil.copytree(new, where, symlinks=True)
    header = os.path.join(where, OPS_HEADER)
    os.chmod(header, 0o644)
    return drop_operation(header, macro, name)


def build_plugins(package, work, label, env, failures, template=True):
    """Builds the compression copy (and the template) against `package`; returns their folder."""
    out = os.path.join(work, label + "-plugins")
    os.makedirs(out)
    src = os.path.join(work, label + "-compression")
    shutil.copytree(os.path.join(REPO, "plugins", "compression"), os.path.join(src, "plugins", "compression"),
                    ignore=shutil.ignore_patterns("test"))
    with open(os.path.join(src, "CMakeLists.txt"), "w") as f:
        f.write(COMPRESSION_CMAKE)
    sources = [src]
    if template:
        t = os.path.join(work, label + "-lossguard")
        shutil.copytree(os.path.join(REPO, "plugins", "example"), t)
        sources.append(t)
    for s in sources:
        obj = s + "-build"
        run(["cmake", "-S", s, "-B", obj, "-DCMAKE_PREFIX_PATH=" + package, "-DCMAKE_INSTALL_PREFIX=" + out,
             "-DCMAKE_BUILD_TYPE=Release"], failures, env=env)
        run(["cmake", "--build", obj, "-j", "2"], failures, env=env)
    for s in sources:
        for f in os.listdir(s + "-build"):
            if f.startswith("libloom_") and f.endswith(".so"):
                shutil.copy(os.path.join(s + "-build", f), out)
    return out


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
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_PLUGIN_PATH", "CMAKE_PREFIX_PATH", "LD_LIBRARY_PATH")}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

    new = os.path.join(work, "new")
    run(["cmake", "--install", build, "--prefix", new], failures)
    loom = os.path.join(new, "bin", "loom")
    old = os.path.join(work, "old")
    added = package_without(new, old, "LOOM_BACKEND_OPS")
    print("OLD: the installed package without Backend::%s (the first of LOOM_BACKEND_OPS)" % added, flush=True)
    old_plugins = build_plugins(old, work, "old", env, failures)
    if failures:
        return common.finish(failures)

    deck = os.path.join(new, "share", "loom", "inputs", "synthetic.deck")
    base = ["--set", "train.steps=6", "--set", "train.eval_every=0", "--set", "train.log_every=1",
            "--set", "parallel.dp=2"]
    cases = {"int8": ["--set", "compression.method=int8"],
             "powersgd": ["--set", "compression.method=powersgd", "--set", "compression.start_step=2"]}

    def train(label, case, plugin_path, expect=0):
        rundir = os.path.join(work, "runs", label + "-" + case)
        e = dict(env, LOOM_PLUGIN_PATH=plugin_path) if plugin_path else env
        # lossguard (which only watches the loss) rides along with the old plugins
        guard = ["--set", "run.plugins=lossguard"] if plugin_path == old_plugins else []
        p = run(common.launch_prefix(args, 2) + [loom, "run", deck, "--set", "run.dir=" + rundir] + base + cases[case] + guard,
                failures if expect is not None else [], expect=expect, env=e, cwd=work)
        return p, common.losses(rundir)

    p = run([loom, "plugins"], failures, env=dict(env, LOOM_PLUGIN_PATH=old_plugins))
    for name in ("compression", "lossguard"):
        line = [l for l in p.stdout.splitlines() if os.path.join(old_plugins, "libloom_%s.so" % name) in l]
        if not line:
            failures.append("`loom plugins` does not load the old %s plugin:\n%s" % (name, p.stdout[-2000:]))
        else:
            print("loaded: " + line[0].strip())
    new_losses = {}
    for case in cases:
        _, want = new_losses[case] = train("new", case, None)
        p, got = train("old", case, old_plugins)
        if "strategy: lossguard" not in p.stdout + p.stderr:
            failures.append("the %s run did not use the old lossguard" % case)
        if not want or got != want:
            failures.append("%s: the old plugin's losses %s differ from the new one's %s" % (case, got, want))
        else:
            print("%s: old plugin, new loom: the same %d losses bit for bit (last %r)" % (case, len(got), got[-1]))

    # The planted defect: an operation taken out of the face moves the slots the plugin calls.
    planted = os.path.join(work, "planted")
    # (crossentropy_row_max: one the compression strategy does not call, before those it does)
    moved = package_without(new, planted, "LOOM_FACE_OPS", "crossentropy_row_max")
    planted_plugins = build_plugins(planted, work, "planted", env, failures, template=False)
    p, got = train("planted", "int8", planted_plugins, expect=None)
    want = new_losses["int8"][1]
    if p.returncode == 0 and got == want:
        failures.append("a plugin built without BackendFace::%s (the face's slots moved) still gave the same losses: "
                        "this check cannot tell a changed face" % moved)
    else:
        print("planted: without BackendFace::%s the old plugin %s (as a changed face must)"
              % (moved, "failed, exit %d" % p.returncode if p.returncode else "gave other losses"))
    return common.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
