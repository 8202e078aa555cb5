#!/usr/bin/env python3
"""docs/keys.md is what `loom keys --markdown` prints: the key reference cannot drift from the code.

    python3 regression/keys_reference_check.py --loom build/loom [--planted]

With --planted, the check is shown to fail: a copy of the page with one default changed must be
refused, naming the line. Regenerate the page with `loom keys --markdown > docs/keys.md`.
Standard library only.
"""
import argparse
import difflib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "keys.md")


def drift(loom, page_text):
    """The lines where page_text and the command's output differ (empty when they agree)."""
    env = {k: v for k, v in os.environ.items() if k != "LOOM_PLUGIN_PATH"}  # the shipped strategies only
    p = subprocess.run([loom, "keys", "--markdown"], capture_output=True, text=True, env=env, timeout=60)
    if p.returncode != 0:
        return ["loom keys --markdown: exit %d: %s" % (p.returncode, p.stderr.strip())]
    return [l for l in difflib.unified_diff(page_text.splitlines(), p.stdout.splitlines(), "docs/keys.md",
                                            "loom keys --markdown", lineterm="", n=0)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", required=True)
    ap.add_argument("--planted", action="store_true")
    args = ap.parse_args()
    text = open(PAGE).read()
    if args.planted:
        planted = text.replace("| `train.steps` | integer | ", "| `train.steps` | integer | 7", 1)
        if planted == text:
            print("FAIL: the page has no train.steps row to plant a change in")
            return 1
        found = drift(args.loom, planted)
        print("\n".join(found))
        if not any("train.steps" in l for l in found):
            print("FAIL: a changed default in the page was not found")
            return 1
        print("OK: the planted change to train.steps's default is refused")
        return 0
    found = drift(args.loom, text)
    if found:
        print("\n".join(found[:60]))
        print("FAIL: docs/keys.md differs from `loom keys --markdown` (regenerate it: loom keys --markdown > docs/keys.md)")
        return 1
    print("OK: docs/keys.md is `loom keys --markdown` (%d lines)" % len(text.splitlines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
