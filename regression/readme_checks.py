#!/usr/bin/env python3
"""What README.md shows of decks, held to the files and to what loom prints, so that it cannot drift:

    python3 regression/readme_checks.py --loom build/loom --workdir build/readme-checks decks

  decks: the "Decks" section's ini block is inputs/quickstart.deck, whole; and each `loom: error:`
         line it quotes for a bad deck is what `loom check` prints for that deck today (up to the
         README's "..." where it shortens one).
Standard library only.
"""
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


def main():
    args = common.case_arguments(__doc__)
    failures = []
    {"decks": check_decks}[args.case](args, failures)
    sys.exit(common.finish(failures))


if __name__ == "__main__":
    main()
