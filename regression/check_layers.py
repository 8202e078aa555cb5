#!/usr/bin/env python3
"""Holds the source tree to its layers (DESIGN.md "Layers"): a file includes only from its own layer
or the ones below, a plugin includes from no other plugin, a plugin calls no MPI function itself
(its waits go through the communicators, which run.comm_timeout watches), and a plugin sees the back
end only through its face (BackendFace, core/backend/backend_face.hpp: the part of the plugin ABI that
an added back-end operation does not move), never naming Backend or including the headers of the
whole back end, and the driver knows no strategy: no string in driver/ (its tests aside) names a plugin's deck key
(the sections the plugins declare, `zero.`, `precision.`, ...) or compares with a plugin's name.

    python3 regression/check_layers.py [--root DIR]     # exit 1 naming each upward include
    python3 regression/check_layers.py --planted        # proves it fails: a copy of the tree with
                                                        # an upward include, a cross-plugin include, a
                                                        # direct MPI call and a use of the whole Backend
                                                        # in a plugin planted

Layers, lowest first:
    core/base < core/comm < core/backend < core/model < core/engine < io < plugins < driver
core/cuda (the CUDA back-end library) sits beside core/model: it may include base, comm and backend,
and nothing in core outside it includes it. A test folder belongs to the layer it tests (core/test, core/test_mpi
and the CUDA back end's tests to the whole core). bench/ and regression/ are above everything. Generated
headers (loom/build_info.hpp) count as core/base.
"""
import argparse
import os
import re
import shutil
import sys
import tempfile

ORDER = ["core/base", "core/comm", "core/backend", "core/model", "core/engine", "io", "plugins", "driver", "top"]
RANK = {name: i for i, name in enumerate(ORDER)}
SOURCE_EXT = (".hpp", ".cpp", ".h", ".cu", ".cuh", ".in")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# A plugin waits only through the communicators (run.comm_timeout watches them): a direct MPI call
# would be a wait that no watchdog sees.
MPI_CALL = re.compile(r"\bMPI_[A-Z][a-z_]+\s*\(")
# A plugin calls the back end through BackendFace: the slots of the whole Backend move when an
# operation is added, which would break a plugin built against an older loom.
WHOLE_BACKEND = re.compile(r"\bBackend\b")
WHOLE_BACKEND_HEADERS = ("core/backend/backend.hpp", "core/backend/forwarding_backend.hpp", "core/backend/kernels.hpp",
                         "core/backend/backend_ops.hpp")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
# A plugin declares its keys as int_key("zero.stage", ...), choice_key(...), ...
KEY_DECL = re.compile(r'\b(?:int|float|bool|string|choice)_key\(\s*"([a-z_0-9]+)\.')


def plugin_knowledge(root):
    """The key sections and the names of the plugins under root/plugins."""
    sections, names = set(), set()
    base = os.path.join(root, "plugins")
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        folder = os.path.join(base, name)
        if not os.path.isdir(folder) or name == "test":
            continue
        for dirpath, _, files in os.walk(folder):
            if "/test" in dirpath.replace(os.sep, "/")[len(folder):]:
                continue
            for f in files:
                if f.endswith(SOURCE_EXT):
                    with open(os.path.join(dirpath, f), encoding="utf-8", errors="replace") as fh:
                        text = fh.read()
                    sections.update(KEY_DECL.findall(text))
                    names.update(re.findall(r'\{LOOM_PLUGIN_ABI_VERSION,\s*"([a-z_0-9]+)"', text))
    return sections, names


def strategy_mentions(rel, text, sections, names):
    """Where a driver file names a plugin's key or compares with a plugin's name."""
    out = []
    code = COMMENT.sub(lambda c: " " * len(c.group(0)), text)
    key = re.compile(r"\b(%s)\.[a-z_]" % "|".join(sorted(sections))) if sections else None
    compare = re.compile(r'(?:[=!]=\s*"(%s)")|(?:"(%s)"\s*[=!]=)' % ("|".join(sorted(names)), "|".join(sorted(names)))) if names else None
    for m in STRING.finditer(code):
        if key and key.search(m.group(0)):
            line = text.count("\n", 0, m.start()) + 1
            out.append("%s:%d: names the plugin key %s; the driver knows no strategy: the plugin says it through "
                       "its StrategyInfo (its plan terms, summary lines, traits)" % (rel, line, m.group(0)))
    for m in compare.finditer(code) if compare else []:
        line = text.count("\n", 0, m.start()) + 1
        out.append("%s:%d: compares with the plugin name %s; the driver knows no strategy" % (rel, line, m.group(0).strip()))
    return out


def layer_of(path):
    """The layer a tree path belongs to: (name, rank), or None for a path outside the layers."""
    p = path.replace(os.sep, "/")
    if p.startswith("loom/"):  # generated build_info.hpp
        return "core/base", RANK["core/base"]
    if p.startswith("core/cuda/") and "/test/" in p:
        return "core tests", RANK["core/engine"]
    if p.startswith("core/cuda/"):
        return "core/cuda", RANK["core/backend"] + 0.5
    if p.startswith(("core/test/", "core/test_mpi/")):
        return "core tests", RANK["core/engine"]
    for name in ORDER[:6]:
        if p.startswith(name + "/"):
            return name, RANK[name]
    if p.startswith("plugins/"):
        return "plugins", RANK["plugins"]
    if p.startswith("driver/"):
        return "driver", RANK["driver"]
    if p.startswith(("bench/", "regression/")):
        return "top", RANK["top"]
    return None


def plugin_of(path):
    parts = path.split("/")
    # plugins/<name>/..., and plugins/test/ (the loader's own test plugins) as a plugin of its own
    return parts[1] if len(parts) > 2 and parts[0] == "plugins" else None


def check(root):
    problems = []
    checked = 0
    sections, names = plugin_knowledge(root)
    for top in ("core", "io", "plugins", "driver", "bench", "regression"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if not f.endswith(SOURCE_EXT):
                    continue
                full = os.path.join(dirpath, f)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                mine = layer_of(rel)
                if mine is None:
                    continue
                with open(full, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                checked += 1
                # (the driver's tests plan and run decks with strategies set, as a user does)
                if mine[0] == "driver" and "/test/" not in rel:
                    problems.extend(strategy_mentions(rel, text, sections, names))
                # (a plugin's tests are not loaded as a plugin: they may test against the whole back end)
                plugin_code = mine[0] == "plugins" and "/test/" not in rel
                if plugin_code:
                    for m in WHOLE_BACKEND.finditer(COMMENT.sub(lambda c: " " * len(c.group(0)), text)):
                        line = text.count("\n", 0, m.start()) + 1
                        problems.append("%s:%d: names Backend; a plugin sees the back end as BackendFace "
                                        "(core/backend/backend_face.hpp), whose slots an added operation does not "
                                        "move" % (rel, line))
                if mine[0] == "plugins" and "/test/" not in rel:
                    for m in MPI_CALL.finditer(text):
                        line = text.count("\n", 0, m.start()) + 1
                        problems.append("%s:%d: calls %s) directly; a plugin waits through the grid's "
                                        "communicators, which run.comm_timeout watches" % (rel, line, m.group(0).rstrip()))
                for m in INCLUDE.finditer(text):
                    inc = m.group(1)
                    theirs = layer_of(inc)
                    if theirs is None:
                        continue  # a sibling header by a relative name, or a system one in quotes
                    line = text.count("\n", 0, m.start()) + 1
                    where = "%s:%d: includes \"%s\"" % (rel, line, inc)
                    if plugin_code and inc in WHOLE_BACKEND_HEADERS:
                        problems.append("%s: a plugin includes the back end's face (core/backend/backend_face.hpp, "
                                        "through core/engine/plugin.hpp), not the whole back end" % where)
                    elif theirs[1] > mine[1]:
                        problems.append("%s: %s (layer %s) is above %s (layer %s)" % (where, inc, theirs[0], rel, mine[0]))
                    elif theirs[0] == "core/cuda" and mine[0] not in ("core/cuda", "core tests", "top"):
                        problems.append("%s: only the CUDA back end's own files and tests include core/cuda/" % where)
                    elif mine[0] == "plugins" and theirs[0] == "plugins" and plugin_of(inc) != plugin_of(rel):
                        problems.append("%s: plugin '%s' includes plugin '%s'; what two strategies share belongs "
                                        "in core" % (where, plugin_of(rel), plugin_of(inc)))
                    elif mine[0] == "core/cuda" and theirs[0] in ("core/model", "core/engine"):
                        problems.append("%s: the CUDA back end sits beside core/model and includes only base, comm and "
                                        "backend" % where)
    return checked, problems


def planted():
    """Copies the sources, plants an upward include, a cross-plugin include and a direct MPI call in a
    plugin, and requires each named."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="loom-layers-") as tmp:
        for top in ("core", "io", "plugins", "driver"):
            shutil.copytree(os.path.join(root, top), os.path.join(tmp, top),
                            ignore=shutil.ignore_patterns("*.json", "*.deck", "*.h5"))
        checked, clean = check(tmp)
        if clean:
            print("check_layers --planted: the copy fails before planting:\n  " + "\n  ".join(clean))
            return 1
        with open(os.path.join(tmp, "core/base/dtype.hpp"), "a") as fh:
            fh.write('\n#include "driver/session.hpp"\n')
        with open(os.path.join(tmp, "plugins/zero/zero.cpp"), "a") as fh:
            fh.write('\n#include "plugins/compression/compress.hpp"\n')
        with open(os.path.join(tmp, "plugins/pipeline/schedule.cpp"), "a") as fh:
            fh.write('\nvoid planted_wait() { MPI_Barrier(MPI_COMM_WORLD); }\n')
        with open(os.path.join(tmp, "plugins/data/data_parallel.cpp"), "a") as fh:
            fh.write('\n#include "core/backend/kernels.hpp"\nvoid planted_call(loom::Backend& be);\n')
        with open(os.path.join(tmp, "driver/plan/memo.cpp"), "a") as fh:
            fh.write('\nstatic const char* planted_key = "zero.stage=1";\n'
                     'static bool planted_name(const std::string& s) { return s == "zero"; }\n')
        _, found = check(tmp)
        want = ["core/base/dtype.hpp", "plugins/zero/zero.cpp", "plugins/pipeline/schedule.cpp",
                "plugins/data/data_parallel.cpp", "plugins/data/data_parallel.cpp", "driver/plan/memo.cpp",
                "driver/plan/memo.cpp"]
        missed = [w for w in want if not any(p.startswith(w + ":") for p in found)]
        for p in found:
            print("planted and found: " + p)
        if missed or len(found) != len(want):
            print("check_layers --planted: expected exactly the %d planted lines, missed %s" % (len(want), missed))
            return 1
        print("check_layers --planted: the upward include, the cross-plugin include, the direct MPI call, "
              "the plugin's include and use of the whole back end, and the driver's plugin key and plugin name "
              "all refused (%d files checked)" % checked)
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--planted", action="store_true", help="check that a planted upward include is refused")
    args = ap.parse_args()
    if args.planted:
        return planted()
    checked, problems = check(args.root)
    for p in problems:
        print(p)
    if problems:
        print("check_layers: %d line(s) against the layers in %d files (DESIGN.md \"Layers\")" % (len(problems), checked))
        return 1
    print("check_layers: %d files, every include within its layer or below, no plugin key or name in driver/" % checked)
    return 0


if __name__ == "__main__":
    sys.exit(main())
