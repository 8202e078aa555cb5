#!/usr/bin/env python3
"""What README.md and DESIGN.md state that the files and loom can check, held to them so that it
cannot drift:

    python3 regression/readme_checks.py --loom build/loom --workdir build/readme-checks decks|abi|usage

  decks: the "Decks" section's ini block is inputs/quickstart.deck, whole; and each `loom: error:`
         line it quotes for a bad deck is what `loom check` prints for that deck today (up to the
         README's "..." where it shortens one).
  abi:   the plugin ABI (LOOM_PLUGIN_ABI_VERSION, core/engine/plugin.hpp) and the CUDA back end's
         (LOOM_CUDA_ABI_VERSION, core/backend/backend_select.hpp) as DESIGN.md states them, and the plugin ABI
         README's `loom plugins` line shows and `loom plugins` prints.
  usage: every command of README's Commands table is in `loom --help`; `loom plan|sample|ckpt --help`
         print that command's usage and exit 0.
Standard library only.
"""
import re
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def section(readme, title):
    start = readme.index("\n## " + title + "\n")
    end = readme.find("\n## ", start + 1)
    return readme[start:end if end >= 0 else len(readme)]


def check_decks(args, failures):
    with open(os.path.join(ROOT, "README.md")) as f:
        decks = section(f.read(), "Decks")
    with open(os.path.join(ROOT, "inputs", "quickstart.deck")) as f:
        quickstart = f.read()
    block = decks.split("```ini\n", 1)[1].split("```\n", 1)[0]
    if block != quickstart:
        failures.append("README's Decks section shows a quickstart deck that is not inputs/quickstart.deck")
    quoted = [line for line in decks.splitlines() if line.startswith("loom: error: ")]

    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    lines = quickstart.splitlines()
    # case.deck: the quickstart deck with a misspelt train.lr on line 17.
    train = lines.index("[train]")
    lines = lines[:train + 1] + [""] * (16 - train - 1) + ["learning_rate = 2e-3"] + lines[train + 1:]
    with open(os.path.join(work, "case.deck"), "w") as f:
        f.write("\n".join(lines) + "\n")
    shutil.copy(os.path.join(ROOT, "inputs", "quickstart.deck"), os.path.join(work, "quickstart.deck"))
    calls = [("case.deck", []), ("quickstart.deck", ["train.lr=fast"]),
             ("quickstart.deck", ["train.batch=8", "train.micro_batches=3"])]
    if len(quoted) != len(calls):
        failures.append("README's Decks section quotes %d errors, this check runs %d" % (len(quoted), len(calls)))
    for (deck, sets), want in zip(calls, quoted):
        cmd = [os.path.abspath(args.loom), "check", deck] + sum((["--set", s] for s in sets), [])
        p = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=60)
        got = [line for line in p.stderr.splitlines() if line.startswith("loom: error: ")]
        shown = want.split("...")[0]
        print("$ " + " ".join(cmd[1:]) + "  (exit %d)\n  %s" % (p.returncode, got[-1] if got else p.stderr[-300:]))
        if p.returncode != 2 or not got or not got[-1].startswith(shown) or ("..." not in want and got[-1] != want):
            failures.append("README quotes\n  %s\nbut `loom %s` printed (exit %d)\n  %s"
                            % (want, " ".join(cmd[1:]), p.returncode, got[-1] if got else p.stderr[-300:]))


def check_abi(args, failures):
    def define(path, name):
        with open(os.path.join(ROOT, path)) as f:
            return int(re.search(r"#define %s (\d+)" % name, f.read()).group(1))
    plugin, cuda = define("core/engine/plugin.hpp", "LOOM_PLUGIN_ABI_VERSION"), define("core/backend/backend_select.hpp",
                                                                              "LOOM_CUDA_ABI_VERSION")
    with open(os.path.join(ROOT, "DESIGN.md")) as f:
        design = f.read()
    readme = ""  # README.md and the user guide it points to (docs/*.md)
    for name in ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))):
        with open(os.path.join(ROOT, name)) as f:
            readme += f.read()
    p = subprocess.run([args.loom, "plugins"], capture_output=True, text=True, timeout=60)
    print("plugin ABI %d, CUDA ABI %d; loom plugins: %s" % (plugin, cuda, p.stdout.splitlines()[0] if p.stdout else ""))
    stated = {
        "DESIGN.md's abi_version": re.findall(r"`abi_version` \((\d+),", design),
        "DESIGN.md's LOOM_CUDA_ABI_VERSION": re.findall(r"`LOOM_CUDA_ABI_VERSION` \((\d+),", design),
        "the guide's `loom plugins` line": re.findall(r"plugin lossguard [0-9.]+ \(ABI (\d+)\)", readme),
        "`loom plugins`": re.findall(r"plugin ABI (\d+)", p.stdout),
    }
    for what, found in stated.items():
        want = cuda if "CUDA" in what else plugin
        if not found or any(int(n) != want for n in found):
            failures.append("%s says ABI %s; the code's is %d" % (what, ", ".join(found) or "nothing", want))


def check_usage(args, failures):
    with open(os.path.join(ROOT, "README.md")) as f:
        commands = section(f.read(), "Commands")
    table = sorted({m for m in re.findall(r"^\| `loom (\w+)", commands, re.M)} - {"--help"})
    p = subprocess.run([args.loom, "--help"], capture_output=True, text=True, timeout=60)
    listed = set(re.findall(r"^  (\w+)", p.stdout, re.M))
    print("README's commands: %s; loom --help lists: %s" % (" ".join(table), " ".join(sorted(listed))))
    if p.returncode != 0 or not table:
        failures.append("loom --help: exit %d; README's table gave %s" % (p.returncode, table))
    for c in table:
        if c not in listed:
            failures.append("README's Commands table has `loom %s`, which `loom --help` does not list" % c)
    for c in ("plan", "sample", "ckpt"):
        p = subprocess.run([args.loom, c, "--help"], capture_output=True, text=True, timeout=60)
        print("$ loom %s --help  (exit %d)\n%s" % (c, p.returncode, p.stdout[:200]))
        if p.returncode != 0 or not p.stdout.startswith("usage:\n  %s " % c):
            failures.append("loom %s --help: exit %d, printed %r" % (c, p.returncode, (p.stdout + p.stderr)[:200]))


def main():
    args = common.case_arguments(__doc__)
    failures = []
    {"decks": check_decks, "abi": check_abi, "usage": check_usage}[args.case](args, failures)
    sys.exit(common.finish(failures))


if __name__ == "__main__":
    main()
