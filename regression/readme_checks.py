#!/usr/bin/env python3
"""What README.md and DESIGN.md state that the files and loom can check, held to them so that it
cannot drift:

    python3 regression/readme_checks.py --loom build/loom --workdir build/readme-checks decks|abi|usage|blocks

  decks: the "Decks" section's ini block is inputs/quickstart.deck, whole; and each `loom: error:`
         line it quotes for a bad deck is what `loom check` prints for that deck today (up to the
         README's "..." where it shortens one).
  abi:   the plugin ABI (LOOM_PLUGIN_ABI_VERSION, core/engine/plugin.hpp) as DESIGN.md states it, the
         README's `loom plugins` line shows it and `loom plugins` prints it. (The CUDA back end's ABI moves
         with every operation added; DESIGN.md names it without its number.)
  usage: every command of README's Commands table is in `loom --help`; `loom plan|sample|ckpt --help`
         print that command's usage and exit 0.
  blocks: every block of commands in README.md, CONTRIBUTING.md, DESIGN.md and docs/*.md (a ```sh or
         ```bash block, or any block with `$ ` lines) has, on the line before it, either
         <!-- block: run --> (this check runs it) or <!-- block: not run here: WHY -->. A run block runs in
         a scratch folder holding the checkout's inputs/, jobscripts/ and build/loom, `loom` on PATH and
         `mpirun` the launcher CMake found: a sh block whole (bash -e, in order), a transcript's `$ ` lines
         one by one, each exiting 0, or 2 with the `loom: error:` line the block shows after it.
  blocks_planted: the same check refuses an unmarked block, a run block whose command fails, and a
         transcript whose quoted error is not what loom prints (copies in the work folder).
Standard library only.
"""
import re
import os
import shlex
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
        "the guide's `loom plugins` line": re.findall(r"plugin lossguard [0-9.]+ \(ABI (\d+)\)", readme),
        "`loom plugins`": re.findall(r"plugin ABI (\d+)", p.stdout),
    }
    for what, found in stated.items():
        want = plugin
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


BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
MARK = re.compile(r"^<!-- block: (run|not run here: .+) -->$")


def doc_files(root):
    names = ["README.md", "CONTRIBUTING.md", "DESIGN.md"]
    names += sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
    return [n for n in names if os.path.exists(os.path.join(root, n))]


def command_blocks(root):
    """(file, line, kind, text, mark) of every block a user would run; mark None when unmarked."""
    out = []
    for name in doc_files(root):
        with open(os.path.join(root, name)) as f:
            text = f.read()
        for m in BLOCK.finditer(text):
            kind, body = m.group(1), m.group(2)
            if kind not in ("sh", "bash") and not re.search(r"^\$ ", body, re.M):
                continue  # a deck, a table, output
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.match(before)
            out.append((name, line, "sh" if kind in ("sh", "bash") else "transcript", body,
                        mark.group(1) if mark else None))
    return out


def scratch(args, where):
    """A folder like a checkout with a build: inputs/, jobscripts/, build/loom; `loom` and `mpirun` on PATH."""
    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(os.path.join(where, "build"))
    os.makedirs(os.path.join(where, ".bin"))
    for d in ("inputs", "jobscripts"):
        os.symlink(os.path.join(ROOT, d), os.path.join(where, d))
    loom = os.path.abspath(args.loom)
    os.symlink(loom, os.path.join(where, "build", "loom"))
    os.symlink(os.path.join(os.path.dirname(loom), "lib"), os.path.join(where, "build", "lib"))
    os.symlink(loom, os.path.join(where, ".bin", "loom"))
    with open(os.path.join(where, ".bin", "mpirun"), "w") as f:  # the docs' `mpirun -n N`: CMake's launcher
        f.write('#!/bin/sh\nif [ "$1" = -n ]; then n=$2; shift 2; exec %s %s "$n" %s "$@"; fi\nexec %s "$@"\n'
                % (shlex.quote(args.mpirun), shlex.quote(args.np_flag), args.mpi_preflags, shlex.quote(args.mpirun)))
    os.chmod(os.path.join(where, ".bin", "mpirun"), 0o755)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PATH=os.path.join(where, ".bin") + os.pathsep + os.environ.get("PATH", ""))
    return env


def run_block(args, name, line, kind, body, where, failures):
    env = scratch(args, where)
    tag = "%s:%d" % (name, line)
    if kind == "sh":
        print("--- %s (sh, bash -e)\n%s" % (tag, body.rstrip()), flush=True)
        p = subprocess.run(["bash", "-e", "-c", body], cwd=where, env=env, capture_output=True, text=True,
                           timeout=600)
        if p.returncode != 0:
            failures.append("%s: the block exits %d:\n%s%s" % (tag, p.returncode, p.stdout[-1500:], p.stderr[-1500:]))
        return
    lines = body.splitlines()
    for i, l in enumerate(lines):
        if not l.startswith("$ "):
            continue
        cmd = l[2:]
        shown = []
        for o in lines[i + 1:]:
            if o.startswith("$ "):
                break
            shown.append(o)
        errors = [o for o in shown if o.startswith("loom: error: ")]
        p = subprocess.run(["bash", "-c", cmd], cwd=where, env=env, capture_output=True, text=True, timeout=600)
        print("--- %s: $ %s  (exit %d)" % (tag, cmd, p.returncode), flush=True)
        if errors:
            got = [o for o in p.stderr.splitlines() if o.startswith("loom: error: ")]
            want = errors[-1].split("...")[0]
            if p.returncode != 2 or not got or not got[-1].startswith(want):
                failures.append("%s: `%s` shows\n  %s\nbut printed (exit %d)\n  %s" % (
                    tag, cmd, errors[-1], p.returncode, got[-1] if got else p.stderr[-500:]))
        elif p.returncode != 0:
            failures.append("%s: `%s` exits %d:\n%s%s" % (tag, cmd, p.returncode, p.stdout[-1000:], p.stderr[-1000:]))


def check_blocks(args, failures, root=ROOT):
    blocks = command_blocks(root)
    unmarked = ["%s:%d" % (n, l) for n, l, _, _, m in blocks if m is None]
    for u in unmarked:
        failures.append("%s: a block of commands with neither <!-- block: run --> nor "
                        "<!-- block: not run here: WHY --> on the line before it" % u)
    run = [b for b in blocks if b[4] == "run"]
    print("%d blocks of commands: %d run here, %d not (each saying why), %d unmarked"
          % (len(blocks), len(run), len(blocks) - len(run) - len(unmarked), len(unmarked)), flush=True)
    for k, (name, line, kind, body, _) in enumerate(run):
        where = os.path.join(os.path.abspath(args.workdir), "blocks-" + os.path.basename(root), "block%d" % k)
        run_block(args, name, line, kind, body, where, failures)


def check_blocks_planted(args, failures):
    """Copies of the docs with one defect each: the check must fail on every one."""
    cases = {
        "unmarked": "```sh\nloom --help\n```\n",
        "failing sh": "<!-- block: run -->\n```sh\nloom run no-such.deck\n```\n",
        "wrong error": "<!-- block: run -->\n```\n$ loom check inputs/quickstart.deck --set train.lr=fast\n"
                       "loom: error: --set train.lr=fast: something else\n```\n",
    }
    for what, block in cases.items():
        root = os.path.join(os.path.abspath(args.workdir), "planted-" + what.replace(" ", "_"))
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(os.path.join(root, "docs"))
        with open(os.path.join(root, "docs", "page.md"), "w") as f:
            f.write("# A page\n\n" + block)
        got = []
        check_blocks(args, got, root=root)
        print("planted %s: %s" % (what, got[0].splitlines()[0] if got else "NOT refused"))
        if not got:
            failures.append("a planted %s block was not refused" % what)


def main():
    args = common.case_arguments(__doc__)
    failures = []
    {"decks": check_decks, "abi": check_abi, "usage": check_usage, "blocks": check_blocks,
     "blocks_planted": check_blocks_planted}[args.case](args, failures)
    sys.exit(common.finish(failures))


if __name__ == "__main__":
    main()
