#!/usr/bin/env python3
"""The C++ and CUDA sources follow .clang-format (regression.format).

  format_check.py --root SRC            every tracked *.cpp *.hpp *.h *.cu *.cuh formats to itself
  format_check.py --root SRC --planted  the same check refuses a copy of one file with a line
                                        squeezed together, so it cannot pass by checking nothing

Formatting differs between clang-format versions, so the check runs with the version the style
was applied with (Debian 12's clang-format 14); with another, or none, it skips and says so.
Fix a failure with: clang-format -i FILE (the failing files are listed)."""
import argparse, os, re, shutil, subprocess, sys, tempfile

SKIP = 77  # SKIP_RETURN_CODE in regression/CMakeLists.txt
MAJOR = 14
PATTERNS = ("*.cpp", "*.hpp", "*.h", "*.cu", "*.cuh")


def clang_format():
    for exe in (f"clang-format-{MAJOR}", "clang-format"):
        path = shutil.which(exe)
        if not path:
            continue
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"version (\d+)", out)
        if m and int(m.group(1)) == MAJOR:
            return path
    return None


def sources(root):
    if os.path.isdir(os.path.join(root, ".git")):
        out = subprocess.run(["git", "-C", root, "ls-files", *PATTERNS], capture_output=True, text=True, check=True)
        return [f for f in out.stdout.split("\n") if f]
    found = []
    for d, _, files in os.walk(root):
        if os.path.relpath(d, root).split(os.sep)[0] in ("build", ".git"):
            continue
        found += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith((".cpp", ".hpp", ".h", ".cu", ".cuh"))]
    return sorted(found)


def misformatted(exe, root, files):
    bad = []
    for i in range(0, len(files), 40):
        chunk = files[i:i + 40]
        r = subprocess.run([exe, "--dry-run", "-Werror", "--style=file", *chunk], cwd=root, capture_output=True, text=True)
        if r.returncode != 0:
            bad += sorted({f for f in chunk if f + ":" in r.stderr})
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--planted", action="store_true")
    a = ap.parse_args()
    exe = clang_format()
    if not exe:
        print(f"SKIP: clang-format {MAJOR} (Debian 12's, the one the style was applied with) is not installed; "
              "setup.sh installs it")
        return SKIP
    files = sources(a.root)
    if not files:
        print(f"FAIL: no C++ sources under {a.root}")
        return 1
    if a.planted:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(os.path.join(a.root, ".clang-format"), tmp)
            name = "core/engine/plan_terms.hpp"
            os.makedirs(os.path.join(tmp, os.path.dirname(name)))
            text = open(os.path.join(a.root, name)).read()
            planted = text.replace("namespace loom {\n", "namespace loom {\nint  planted ( int x ){return x;}\n", 1)
            assert planted != text
            open(os.path.join(tmp, name), "w").write(planted)
            bad = misformatted(exe, tmp, [name])
            if bad != [name]:
                print(f"FAIL: a planted misformatted line in {name} was not refused")
                return 1
            print(f"OK: a planted misformatted line in {name} is refused")
            return 0
    bad = misformatted(exe, a.root, files)
    if bad:
        print(f"FAIL: {len(bad)} of {len(files)} files do not follow .clang-format; fix with\n  clang-format -i " +
              " ".join(bad))
        return 1
    print(f"OK: {len(files)} C++/CUDA files follow .clang-format ({exe})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
