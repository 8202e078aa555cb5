#!/usr/bin/env python3
"""Runs the `build/loom data prepare ...` line of a deck's opening comment, as written, in --workdir
(with --loom for build/loom): a deck whose data must be prepared first is tested with the very
command it tells its reader to run."""
import argparse
import os
import shlex
import subprocess
import sys

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--loom", required=True)
ap.add_argument("--deck", required=True)
ap.add_argument("--workdir", required=True)
args = ap.parse_args()
lines = [l[1:].strip() for l in open(args.deck) if l.startswith("#") and "build/loom data prepare" in l]
if len(lines) != 1:
    sys.exit("%s: expected one `build/loom data prepare` line in its opening comment, found %d" % (args.deck, len(lines)))
words = shlex.split(lines[0])
if words[0] != "build/loom":
    sys.exit("%s: the prepare line should start with build/loom: %s" % (args.deck, lines[0]))
os.makedirs(args.workdir, exist_ok=True)
cmd = [args.loom] + words[1:]
print("$ (cd %s && %s)" % (args.workdir, " ".join(shlex.quote(w) for w in cmd)), flush=True)
sys.exit(subprocess.call(cmd, cwd=args.workdir))
