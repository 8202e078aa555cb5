#!/usr/bin/python3
"""Plots of loom runs and sweeps (matplotlib, Agg: no display needed).

    loom_plot.py RUN_DIR... [-o OUTDIR]
        OUTDIR/loss.png: the training loss against step of each run (metrics.jsonl), and its
        validation loss where the run has one (dashed, markers), one colour per run, labelled by
        the run directory's name. For runs with experts (model.experts; metrics' moe_load) also
        OUTDIR/expert_load.png: per run, each expert's share of its block's assignments times the
        experts (1 = its fair share; the mean over blocks solid, the busiest block's dotted) against
        step, and the share of assignments dropped over capacity.
    loom_plot.py --sweep RESULT.csv --x KEY [-o OUTDIR]
        RESULT.csv: the CSV table `jube result` writes for jobscripts/sweep.xml (or a JUBE run
        directory, e.g. sweep_runs/000000, after `jube result -a sweep_runs`). One PNG per numeric
        column (final loss, val loss, tokens/s, MFU, peak memory, comm share, bubble) against the
        swept key KEY (e.g. train.lr), one line per combination of the other swept keys.
    loom_plot.py --summary RUN_DIR
        prints the numbers a sweep tabulates, one key=value a line (n/a where the run has none):
        what jobscripts/sweep.xml's JUBE patterns read. Needs no matplotlib.

OUTDIR defaults to the current directory. Exit status 2, naming the file, for a missing run
directory or table, a run without metrics.jsonl, or an unknown column.
"""
import argparse
import csv
import glob
import json
import math
import os
import sys

# The sweep table's numeric columns (titles in jobscripts/sweep.xml) and how to label them.
METRICS = [
    ("final_loss", "final training loss (nats/token)"),
    ("val_loss", "validation loss (nats/token)"),
    ("tokens_per_s", "throughput (tokens/s)"),
    ("mfu", "MFU (model FLOP/s / peak)"),
    ("peak_mem_bytes", "peak memory per rank (MiB)"),
    ("comm_share", "communication wait share of a step"),
    ("bubble", "pipeline bubble share"),
]
# Columns of the table that are neither swept keys nor plotted.
OTHER_COLUMNS = {"overrides", "status", "ranks", "point", "run_dir", "exit_status", "steps"}


def fail(message):
    print("loom_plot: error: " + message, file=sys.stderr)
    sys.exit(2)


def read_rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isdir(run_dir):
        fail("%s: no such run directory" % run_dir)
    if not os.path.isfile(path):
        fail("%s: no metrics.jsonl (not a loom run directory, or the run wrote nothing)" % path)
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.endswith("\n") or not line.strip():
                continue  # a run still writing may have half a line on disk
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                fail("%s:%d: not JSON (%s)" % (path, n, e))
    return rows


def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---------------------------------------------------------------- --summary

def summary_values(run_dir, exit_status=None):
    """The flat numbers of one run: summary.json first, metrics.jsonl for what it lacks."""
    s = {}
    spath = os.path.join(run_dir, "summary.json")
    if os.path.isfile(spath):
        try:
            with open(spath) as f:
                s = json.load(f)
        except ValueError:
            s = {}
    rows = []
    if os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        rows = read_rows(run_dir)
    train = [r for r in rows if finite(r.get("loss"))]
    vals = [r for r in rows if finite(r.get("val_loss"))]
    last = train[-1] if train else {}

    def pick(*candidates):
        for c in candidates:
            if finite(c):
                return c
        return None

    layout = s.get("layout") or {}
    pp = layout.get("pp", 1)
    status = s.get("status")
    if status is None:
        status = "no-summary" if exit_status in (None, 0) else "failed"
    out = {
        "status": status,
        "exit_status": pick(s.get("exit_status"), exit_status),
        "ranks": s.get("ranks"),
        "steps": pick(s.get("steps_run"), last.get("step")),
        "final_loss": pick(s.get("final_loss"), last.get("loss")),
        "val_loss": pick(s.get("final_val_loss"), vals[-1]["val_loss"] if vals else None),
        "tokens_per_s": pick(s.get("tokens_per_s")),
        "mfu": pick(s.get("mfu")),
        "peak_mem_bytes": pick((s.get("mem_peak_bytes") or {}).get("total"),
                               (last.get("mem_peak_bytes") or {}).get("total")),
        "comm_share": pick(s.get("comm_wait_share"), last.get("comm_wait_share")),
        # No pipeline, no bubble: 0 at pp = 1 (only when the run said so), else the measured share.
        "bubble": pick(s.get("pp_bubble"), last.get("pp_bubble"), 0.0 if s and pp == 1 else None),
    }
    return out


def print_summary(run_dir, exit_status):
    if os.path.isdir(run_dir):
        values = summary_values(run_dir, exit_status)
    elif exit_status:  # loom refused the run before it made its directory (e.g. a bad layout)
        values = dict.fromkeys([k for k, _ in METRICS] + ["ranks", "steps"])
        values.update(status="failed", exit_status=exit_status)
    else:
        fail("%s: no such run directory" % run_dir)
    for k, v in values.items():
        if v is None:
            v = "n/a"
        elif isinstance(v, float) and v == int(v) and k in ("ranks", "steps", "exit_status", "peak_mem_bytes"):
            v = int(v)
        print("%s=%s" % (k, v))


# ---------------------------------------------------------------- plots

def pyplot():
    try:
        import matplotlib
    except ImportError:
        fail("matplotlib is not installed for %s (Debian: apt-get install python3-matplotlib; "
             "LOOM_PYTHON names another Python for loom plot)" % sys.executable)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def labels_for(dirs):
    """Each run's directory name, with as many parent names as it takes to tell them apart."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [os.path.normpath(d) for d in dirs]


def plot_runs(dirs, outdir):
    plt = pyplot()
    runs = [(d, read_rows(d)) for d in dirs]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    any_val = False
    n = len(runs)
    for i, ((d, rows), label) in enumerate(zip(runs, labels_for(dirs))):
        steps = [r["step"] for r in rows if finite(r.get("loss")) and "step" in r]
        loss = [r["loss"] for r in rows if finite(r.get("loss")) and "step" in r]
        if not loss:
            fail("%s: no training loss in metrics.jsonl" % os.path.join(d, "metrics.jsonl"))
        # Earlier runs drawn wider, so a run that follows another exactly (dp changes no loss) shows.
        width = 1.2 + 2.0 * (n - 1 - i) / max(1, n - 1) if n > 1 else 1.5
        line, = ax.plot(steps, loss, "-", linewidth=width, label=label)
        vsteps = [r["step"] for r in rows if finite(r.get("val_loss")) and "step" in r]
        vloss = [r["val_loss"] for r in rows if finite(r.get("val_loss")) and "step" in r]
        if vloss:
            any_val = True
            ax.plot(vsteps, vloss, "--o", color=line.get_color(), markersize=3 + width, linewidth=width * 0.8)
    if any_val:  # one legend entry per run (its colour), and what solid and dashed mean
        ax.plot([], [], "-", color="0.3", label="training loss (solid)")
        ax.plot([], [], "--o", color="0.3", markersize=4, label="validation loss (dashed)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("training loss" + (" and validation loss (dashed)" if any_val else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(outdir, exist_ok=True)
    out = os.path.join(outdir, "loss.png")
    fig.savefig(out)
    plt.close(fig)
    print("wrote " + out)
    plot_expert_load([(d, rows, label) for (d, rows), label in zip(runs, labels_for(dirs))], outdir, plt)


def plot_expert_load(runs, outdir, plt):
    """OUTDIR/expert_load.png for the runs whose metrics carry moe_load ([blocks][experts] shares)."""
    runs = [(d, [r for r in rows if r.get("moe_load") and "step" in r], label) for d, rows, label in runs]
    runs = [r for r in runs if r[1]]
    if not runs:
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 3.2 * len(runs)), dpi=110, squeeze=False)
    for ax, (d, rows, label) in zip(axes[:, 0], runs):
        steps = [r["step"] for r in rows]
        E = len(rows[0]["moe_load"][0])
        for e in range(E):
            mean = [E * sum(b[e] for b in r["moe_load"]) / len(r["moe_load"]) for r in rows]
            worst = [E * max(b[e] for b in r["moe_load"]) for r in rows]
            line, = ax.plot(steps, mean, "-", linewidth=1.2, label="expert %d" % e)
            ax.plot(steps, worst, ":", color=line.get_color(), linewidth=0.8)
        ax.axhline(1.0, color="0.3", linestyle="--", linewidth=0.8)
        drop = [100.0 * r.get("moe_dropped", 0.0) for r in rows]
        ax.set_title("%s: expert load x %d experts (1 = fair share; dotted: busiest block), %.1f%% dropped on "
                     "average" % (label, E, sum(drop) / len(drop)), fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("load / fair share")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=min(E, 8))
    fig.tight_layout()
    out = os.path.join(outdir, "expert_load.png")
    fig.savefig(out)
    plt.close(fig)
    print("wrote " + out)


def find_table(path):
    if os.path.isdir(path):  # a JUBE run directory: its result/ folder, after `jube result`
        found = sorted(glob.glob(os.path.join(path, "result", "*.csv")) + glob.glob(os.path.join(path, "result", "*.dat")))
        found = [f for f in found if open(f).readline().startswith("overrides")]
        if not found:
            fail("%s: no sweep table in %s/result (run `jube result -a %s` first)"
                 % (path, path, os.path.dirname(os.path.normpath(path)) or "."))
        return found[0]
    if not os.path.isfile(path):
        fail("%s: no such file" % path)
    return path


def number(s):
    try:
        v = float(s)
        return v if math.isfinite(v) else None
    except (TypeError, ValueError):
        return None


def plot_sweep(table, key, outdir):
    plt = pyplot()
    path = find_table(table)
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f)]
    if not rows:
        fail("%s: no data rows" % path)
    # The swept keys: each key=value of the overrides column, and any column the table adds.
    points = []
    for r in rows:
        p = {}
        for item in (r.get("overrides") or "").split():
            if "=" in item:
                k, v = item.split("=", 1)
                p[k] = v
        for c, v in r.items():
            if c not in OTHER_COLUMNS and c not in dict(METRICS) and c is not None:
                p[c] = v
        points.append(p)
    swept = []
    for p in points:
        swept += [k for k in p if k not in swept]
    if key not in swept:
        fail("%s: unknown column '%s'; the swept keys are: %s" % (path, key, ", ".join(swept) or "(none)"))
    others = [k for k in swept if k != key and len({p.get(k) for p in points}) > 1]
    xs_numeric = all(number(p.get(key)) is not None for p in points)
    plotted = [(c, t) for c, t in METRICS if c in rows[0] and any(number(r[c]) is not None for r in rows)]
    if not plotted:
        fail("%s: none of the columns %s holds a number" % (path, ", ".join(c for c, _ in METRICS)))
    xvals = sorted({p.get(key) for p in points}, key=lambda v: number(v) if xs_numeric else str(v))
    os.makedirs(outdir, exist_ok=True)
    for col, title in plotted:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        groups = {}
        for p, r in zip(points, rows):
            groups.setdefault(tuple(p.get(k) for k in others), []).append((p.get(key), number(r[col])))
        for i, (g, pts) in enumerate(sorted(groups.items(), key=lambda kv: tuple(str(v) for v in kv[0]))):
            pts = [(x, y) for x, y in pts if y is not None]
            if col == "peak_mem_bytes":
                pts = [(x, y / 2.0 ** 20) for x, y in pts]
            if xs_numeric:
                pts.sort(key=lambda t: number(t[0]))
                xs = [number(x) for x, _ in pts]
            else:
                xs = [xvals.index(x) for x, _ in pts]
            label = ", ".join("%s=%s" % kv for kv in zip(others, g)) or "all points"
            # Markers and dashes differ per line, so lines that coincide (dp changes no loss) show.
            ax.plot(xs, [y for _, y in pts], linestyle=["-", "--", ":", "-."][i % 4], marker="osD^v<>"[i % 7],
                    markersize=max(3, 9 - 2 * i), label=label)
        if xs_numeric:
            nx = [number(v) for v in xvals]
            if min(nx) > 0 and max(nx) / min(nx) >= 10:
                ax.set_xscale("log")
            ax.set_xticks(nx)
            ax.set_xticklabels(xvals)
            ax.minorticks_off()
        else:
            ax.set_xticks(range(len(xvals)))
            ax.set_xticklabels(xvals)
        ax.set_xlabel(key)
        ax.set_ylabel(title)
        ax.set_title("%s against %s" % (title.split(" (")[0], key))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = os.path.join(outdir, "%s.png" % col)
        fig.savefig(out)
        plt.close(fig)
        print("wrote " + out)


def main():
    ap = argparse.ArgumentParser(prog="loom plot", description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s RUN_DIR... [-o OUTDIR] | --sweep RESULT.csv --x KEY [-o OUTDIR]"
                                       " | --summary RUN_DIR")
    ap.add_argument("run_dirs", nargs="*", metavar="RUN_DIR")
    ap.add_argument("-o", "--outdir", default=".")
    ap.add_argument("-s", "--sweep", metavar="RESULT.csv")
    ap.add_argument("-x", "--x", metavar="KEY")
    ap.add_argument("--summary", metavar="RUN_DIR")
    ap.add_argument("--exit-status", type=int, help=argparse.SUPPRESS)  # loom's, for --summary
    a = ap.parse_args()
    if a.summary:
        print_summary(a.summary, a.exit_status)
    elif a.sweep:
        if not a.x:
            ap.error("--sweep needs --x KEY (a swept key, e.g. train.lr)")
        plot_sweep(a.sweep, a.x, a.outdir)
    elif a.run_dirs:
        plot_runs(a.run_dirs, a.outdir)
    else:
        ap.error("give run directories, --sweep RESULT.csv --x KEY, or --summary RUN_DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
