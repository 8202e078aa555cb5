#!/usr/bin/env python3
"""Parameter sweeps with JUBE (jobscripts/sweep.xml) and the plots (jobscripts/loom_plot.py).

    python3 regression/sweep_cases.py --loom build/loom --mpirun mpiexec --workdir build/sweep-cases CASE

CASE is one of:
  jube_sweep
      jobscripts/sweep.xml, its sweep set replaced by train.lr 2e-3,4e-3 x parallel.dp 1,2, on a
      2-layer deck of 6 steps (LOOM_SWEEP_DECK), run locally by `jube run` with the launcher
      (LOOM_MPIEXEC = --mpirun); then `jube result -a`: the CSV table has exactly 4 data rows, one per
      point, each finished with a numeric final loss, validation loss, tokens/s and peak memory; the
      rank count JUBE derived (dp x tp x pp through `loom check`, never given) is what each run
      reports (summary.json "ranks" and layout.dp equal the point's dp: the dp 2 points really ran
      on 2 ranks), and the pretty table has the same 4 rows.
  plot_runs
      two 6-step runs (lr 1e-3 and 4e-3); `loom_plot.py RUN RUN -o OUT` writes OUT/loss.png, a PNG
      (signature, IHDR) of at least 400 x 300 pixels and 10 KiB to 2 MiB, and no expert_load.png; a run
      with 4 experts gets OUT/expert_load.png (the same checks) as well; a missing run directory and
      one without metrics.jsonl are refused with exit status 2, naming the path.
  plot_sweep
      the sweep of jube_sweep (run again here); `loom_plot.py --sweep CSV --x train.lr` writes one PNG
      per numeric column (final_loss, val_loss, tokens_per_s, mfu, peak_mem_bytes, comm_share,
      bubble), and the same from the JUBE run directory (sweep_runs/000000) in place of the CSV; an
      unknown column (--x optim.lr) is refused with exit status 2, naming the table and the swept keys.
JUBE is `jube` on PATH (or $JUBE). Standard library only (loom_plot.py runs with its own
#!/usr/bin/python3, which needs matplotlib).
"""
import csv
import io
import math
import os
import re
import shutil
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_XML = os.path.join(ROOT, "jobscripts", "sweep.xml")
PLOT = os.path.join(ROOT, "jobscripts", "loom_plot.py")
LRS = ["2e-3", "4e-3"]
DPS = [1, 2]
METRIC_PNGS = ["final_loss", "val_loss", "tokens_per_s", "mfu", "peak_mem_bytes", "comm_share", "bubble"]
TINY_DECK = ("[model]\nlayers = 2\nd_model = 32\nheads = 4\nseq_len = 16\nvocab = 256\n"
             "[data]\nsource = text:/usr/share/common-licenses/GPL-3\nval_fraction = 0.1\n"
             "[train]\nsteps = 6\nbatch = 8\nlr = 3e-3\nwarmup = 2\nseed = 42\neval_every = 3\nlog_every = 1\n")


def run(cmd, env=None, cwd=None):
    print("$ " + " ".join(cmd), flush=True)
    e = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    e.update(env or {})
    return subprocess.run(cmd, env=e, cwd=cwd, capture_output=True, text=True, timeout=600)


def number(s):
    try:
        v = float(s)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def jube_sweep(c):
    """Run the 4-point sweep under c.dir; return (runs dir, `jube result` output) or (None, None)."""
    jube = os.environ.get("JUBE") or shutil.which("jube")
    if not jube or not shutil.which(jube):
        c.check(False, "no JUBE: %s (the Debian package jube puts `jube` on PATH; or set JUBE)"
                % (jube + " is not an executable" if jube else "no `jube` on PATH"))
        return None, None
    bench = os.path.join(c.dir, "bench")
    os.makedirs(bench)
    # The repository's sweep.xml, with this case's sweep set in place of the example one.
    xml = open(SWEEP_XML).read()
    mine = ('<parameterset name="sweep">\n'
            '      <parameter name="lr">%s</parameter>\n'
            '      <parameter name="dp" type="int">%s</parameter>\n'
            '      <parameter name="sets">--set train.lr=$lr --set parallel.dp=$dp</parameter>\n'
            '    </parameterset>' % (",".join(LRS), ",".join(map(str, DPS))))
    xml, n = re.subn(r'<parameterset name="sweep">.*?</parameterset>', lambda m: mine, xml, count=1, flags=re.S)
    c.check(n == 1, "%s has no <parameterset name=\"sweep\">" % SWEEP_XML)
    with open(os.path.join(bench, "sweep.xml"), "w") as f:
        f.write(xml)
    shutil.copy(PLOT, os.path.join(bench, "loom_plot.py"))  # sweep.xml finds it next to itself
    runs = os.path.join(c.dir, "sweep_runs")
    env = {"LOOM": os.path.abspath(shutil.which(c.args.loom) or c.args.loom), "LOOM_MPIEXEC": c.args.mpirun, "LOOM_MPIEXEC_NP_FLAG": c.args.np_flag,
           "LOOM_MPIEXEC_PREFLAGS": c.args.mpi_preflags,
           "LOOM_SWEEP_DECK": os.path.abspath(c.deck)}
    p = run([jube, "run", os.path.join(bench, "sweep.xml"), "-o", runs, "--hide-animation"], env=env, cwd=c.dir)
    print(p.stdout[-1500:])
    if p.returncode != 0 or not os.path.isdir(os.path.join(runs, "000000")):
        sys.stdout.write(p.stderr[-3000:])
        c.check(False, "jube run: exit status %d" % p.returncode)
        return None, None
    c.check(re.search(r"\|\s+run \|\s+4 \|\s+0 \|\s+0 \|\s+0 \|\s+4 \|", p.stdout),
            "jube run: the run step did not end with 4 work packages done, none in error")
    r = run([jube, "result", "-a", runs], cwd=c.dir)
    print(r.stdout)
    if r.returncode != 0:
        sys.stdout.write(r.stderr[-3000:])
        c.check(False, "jube result: exit status %d" % r.returncode)
        return None, None
    return runs, r.stdout


def check_table(c, out):
    lines = out.splitlines()
    head = [i for i, l in enumerate(lines) if l.startswith("overrides,")]
    c.check(len(head) == 1, "jube result printed %d CSV headers (overrides,...), expected 1" % len(head))
    if len(head) != 1:
        return []
    body = []
    for l in lines[head[0]:]:
        if not l.strip():
            break
        body.append(l)
    rows = list(csv.DictReader(io.StringIO("\n".join(body) + "\n")))
    c.check(len(rows) == 4, "the CSV table has %d data rows, expected 4 (2 lr x 2 dp)" % len(rows))
    pretty = [l for l in lines if re.match(r"\|\s+\d+ \|", l)]
    c.check(len(pretty) == 4, "the pretty table has %d data rows, expected 4" % len(pretty))
    seen = set()
    for r in rows:
        sets = dict(kv.split("=", 1) for kv in r["overrides"].split())
        lr, dp = sets.get("train.lr"), int(sets.get("parallel.dp", 0))
        seen.add((lr, dp))
        what = "point %s (%s)" % (r["point"], r["overrides"])
        if r["status"] != "finished":
            c.check(False, "%s: status %s, expected finished (see %s/loom.err)"
                    % (what, r["status"], os.path.dirname(r["run_dir"])))
            continue
        for col in ("final_loss", "val_loss", "tokens_per_s", "peak_mem_bytes", "mfu", "comm_share", "bubble"):
            c.check(number(r[col]) is not None, "%s: %s = %r is not a number" % (what, col, r[col]))
        c.check(number(r["tokens_per_s"]) and number(r["tokens_per_s"]) > 0, "%s: tokens_per_s not positive" % what)
        c.check(number(r["peak_mem_bytes"]) and number(r["peak_mem_bytes"]) > 0, "%s: peak memory not positive" % what)
        c.check(r["ranks"] == str(dp), "%s: the table says %s ranks, the point's dp is %d" % (what, r["ranks"], dp))
        try:
            s = common.summary(r["run_dir"])
        except OSError as e:
            c.check(False, "%s: %s" % (what, e))
            continue
        print("%s: summary.json ranks %s, layout %s, final loss %s" % (what, s.get("ranks"), s.get("layout"), s.get("final_loss")))
        c.check(s.get("ranks") == dp and (s.get("layout") or {}).get("dp") == dp,
                "%s: summary.json has ranks %s, layout %s: it did not run on %d ranks" % (what, s.get("ranks"), s.get("layout"), dp))
        c.check(abs(s.get("final_loss", float("nan")) - number(r["final_loss"])) < 1e-9,
                "%s: the table's final loss is not summary.json's" % what)
    want = {(lr, dp) for lr in LRS for dp in DPS}
    c.check(seen == want, "the points are %s, expected %s" % (sorted(seen), sorted(want)))
    # dp changes no loss: the two dp of one lr agree (the sum over ranks is the one-rank gradient)
    for lr in LRS:
        got = [number(r["final_loss"]) for r in rows if ("train.lr=" + lr) in r["overrides"].split()]
        if len(got) == 2 and None not in got:
            c.check(abs(got[0] - got[1]) < 1e-4, "lr %s: final loss %g at dp 1 but %g at dp 2" % (lr, got[0], got[1]))
    return rows


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", head[16:24])


def check_png(c, path):
    if not os.path.isfile(path):
        c.check(False, "%s was not written" % path)
        return
    size, dims = os.path.getsize(path), png_size(path)
    print("%s: %d bytes, %s pixels" % (path, size, "x".join(map(str, dims)) if dims else "not a PNG"))
    c.check(dims is not None, "%s is not a PNG" % path)
    c.check(10 * 1024 <= size <= 2 * 1024 * 1024, "%s has %d bytes, expected 10 KiB to 2 MiB" % (path, size))
    c.check(dims is None or (dims[0] >= 400 and dims[1] >= 300), "%s is %s pixels, expected at least 400 x 300" % (path, dims))


def expect_refusal(c, cmd, path_named, what):
    p = run(cmd)
    print(p.stderr.strip())
    c.check(p.returncode == 2, "%s: exit status %d, expected 2" % (what, p.returncode))
    c.check(path_named in p.stderr, "%s: the message does not name %s" % (what, path_named))


def main():
    args = common.case_arguments(__doc__)
    name = args.case
    if name not in ("jube_sweep", "plot_runs", "plot_sweep"):
        sys.exit("unknown case " + name)
    c = common.Case(args, name, TINY_DECK)

    if name == "jube_sweep":
        runs, out = jube_sweep(c)
        if out is not None:
            check_table(c, out)
        return c.done(name)

    if name == "plot_runs":
        _, a = c.loom("lr1e-3", 1, ["train.lr=1e-3"])
        _, b = c.loom("lr4e-3", 1, ["train.lr=4e-3"])
        out = os.path.join(c.dir, "plots")
        p = run([c.args.loom, "plot", a, b, "-o", out])  # the driver runs loom_plot.py
        print(p.stdout + p.stderr)
        c.check(p.returncode == 0, "loom plot RUN RUN: exit status %d" % p.returncode)
        check_png(c, os.path.join(out, "loss.png"))
        c.check(not os.path.exists(os.path.join(out, "expert_load.png")), "expert_load.png written for runs without experts")
        # A run with experts gets the experts' load over steps too.
        _, m = c.loom("moe", 1, ["model.experts=4", "model.expert_capacity=1.0"])
        p = run([c.args.loom, "plot", m, "-o", out + "-moe"])
        print(p.stdout + p.stderr)
        c.check(p.returncode == 0, "loom plot MOE_RUN: exit status %d" % p.returncode)
        check_png(c, os.path.join(out + "-moe", "expert_load.png"))
        missing = os.path.join(c.dir, "no-such-run")
        expect_refusal(c, [PLOT, a, missing, "-o", out], missing, "a missing run directory")
        empty = os.path.join(c.dir, "empty-run")
        os.makedirs(empty)
        expect_refusal(c, [PLOT, empty, "-o", out], os.path.join(empty, "metrics.jsonl"), "a directory without metrics.jsonl")
        return c.done(name)

    if name == "plot_sweep":
        runs, out = jube_sweep(c)
        if out is None:
            return c.done(name)
        table = os.path.join(runs, "000000", "result", "loom_csv.dat")
        c.check(os.path.isfile(table), "jube result wrote no %s" % table)
        for tag, source in (("csv", table), ("jube_dir", os.path.join(runs, "000000"))):
            outdir = os.path.join(c.dir, "plots-" + tag)
            p = run(([c.args.loom, "plot"] if tag == "csv" else [PLOT]) + ["--sweep", source, "--x", "train.lr", "-o", outdir])
            print(p.stdout + p.stderr)
            c.check(p.returncode == 0, "loom_plot.py --sweep %s: exit status %d" % (source, p.returncode))
            for col in METRIC_PNGS:
                check_png(c, os.path.join(outdir, col + ".png"))
        expect_refusal(c, [PLOT, "--sweep", table, "--x", "optim.lr", "-o", os.path.join(c.dir, "plots-bad")],
                       table, "an unknown column")
        return c.done(name)


if __name__ == "__main__":
    sys.exit(main())
