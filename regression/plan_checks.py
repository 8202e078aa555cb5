#!/usr/bin/env python3
"""`loom plan`'s cluster descriptions.

    python3 regression/plan_checks.py --loom build/loom --workdir build/plan-checks CASE

  presets            a100-80gb, h100-sxm, h200 load, each naming its datasheet and showing its memory
                     bandwidth, attention rate (measured on an H100, scaled by HBM bandwidth for the
                     others) and PCIe link; --set overrides a key; compression.deck on h100-sxm pays for its
                     host passes at host_gbs and its copies over host_link_gbs
  calibrate_np2      `loom plan --calibrate` on 2 ranks writes a cluster file whose every figure is
                     positive (the three fixed costs, per product call and per sequence and head of the
                     unfused and the fused attention, and the waits at synchronisations, at least 0), which
                     `--cluster FILE --show` reads back to the same values; on 1 rank it is
                     refused (it measures the links between ranks). inputs/long_context.deck (model.attention
                     = flash) is priced at the file's fused-attention rate, and differently from its unfused
                     run; on the a100-80gb preset, which has no fused rate, as the unfused kernels, saying
                     so; on h100-sxm and h200 at their measured fused rate, below the unfused
  memory_vs_ledger   `loom plan DECK --json` against the ledger of the same deck run for 2 steps (past
                     compression.start_step, where the method's state is made), rank by rank and category
                     by category, for every deck of inputs/ and the layouts of the regression cases (dp, tp,
                     sequence parallel, pp with each schedule, ZeRO 1-3, bf16, fp16, recompute,
                     combinations): |predicted - measured| <= 5% of measured + 4 KiB (the floor covers the
                     world's few-byte scalar collectives), comm included: a run reserves its communicators'
                     ring-scratch pools from the same step plan at start-up (Session), so a collective
                     in flight beyond the plan, or of a size class it does not list, shows as measured
                     above predicted; and the reservation (summary.json comm_scratch_bytes_by_rank) at
                     most twice what the collectives needed (per size class, the most buffers out at
                     once), so a plan that counts collectives in flight together that never are shows.
                     Compression's int8, top-k and PowerSGD (their own buffers and collectives) are among
                     the layouts. The worst cases are printed.
  cluster_refusals   a missing key (memory_gbs, matmul_efficiency_bf16, matmul_call_us, attention_head_us,
                     optimizer_gbs, sync_wait_share, host_gbs, host_link_gbs among them), a value out of range
                     (attention_tflops = 0, optimizer_gbs = 0, a negative fixed cost, sync_wait_share or
                     host_link_gbs, a share above 1), the fused attention's fixed cost without its rate, widths out
                     of order,
                     an unknown key, links inside a node slower than between nodes, a name that is
                     neither a file nor a preset, a fused rate below 1e-6 (not 0): exit 2, named; a bad
                     --set of --calibrate named as the --set's, and a fused fixed cost given to it alone
                     written with the rate it measures (1 rank, the network figures given)
  (the pipeline span's closed forms and the replay's units under recompute are
  driver/plan/test/test_plan_arithmetic.cpp's, PlanTime.Pipeline*: tighter, and without a process each)
Standard library only.
"""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

GOOD = """[cluster]
name = test
source = made up for a test
nodes = 2
devices_per_node = 4
device_memory_gib = 40
peak_tflops_fp32 = 10
peak_tflops_bf16 = 100
peak_tflops_fp16 = 100
matmul_efficiency_fp32 = 64:0.5 512:1
matmul_efficiency_bf16 = 0.8
matmul_efficiency_fp16 = 1
matmul_call_us = 4
attention_tflops = 5
attention_head_us = 2
memory_gbs = 500
optimizer_gbs = 400
sync_wait_share = 0.05
host_gbs = 10
host_link_gbs = 25
[network]
intra_node_gbs = 200
intra_node_latency_us = 2
inter_node_gbs = 20
inter_node_latency_us = 6
"""


def run(cmd, expect=0, env=None):
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=dict(env or os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    if expect is not None and p.returncode != expect:
        sys.stdout.write(p.stdout[-2000:] + p.stderr[-2000:])
        raise SystemExit("FAIL: exit %d, expected %d" % (p.returncode, expect))
    return p


def figures(text):
    """The numbers of `--show`, in order."""
    return [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text.split("source:")[0])]


CATEGORIES = ["params", "grads", "optimizer", "master", "activations", "comm", "workspace"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYN = os.path.join(ROOT, "inputs", "synthetic.deck")
# (tag, deck, ranks, --set overrides): the layouts the regression cases train.
LAYOUTS = [
    ("dp2", SYN, 2, ["parallel.dp=2"]),
    ("tp2", SYN, 2, ["parallel.tp=2"]),
    ("tp2_sp", SYN, 2, ["parallel.tp=2", "tensor.sequence_parallel=true"]),
    ("pp2_1f1b", SYN, 2, ["parallel.pp=2", "train.micro_batches=4"]),
    ("pp2_gpipe", SYN, 2, ["parallel.pp=2", "train.micro_batches=4", "pipeline.schedule=gpipe"]),
    ("pp2_interleaved", SYN, 2, ["parallel.pp=2", "train.micro_batches=4", "pipeline.virtual_stages=2",
                                 "model.layers=4"]),
    ("zero1", SYN, 2, ["parallel.dp=2", "zero.stage=1"]),
    ("zero2", SYN, 2, ["parallel.dp=2", "zero.stage=2"]),
    ("zero3", SYN, 2, ["parallel.dp=2", "zero.stage=3"]),
    ("bf16_dp2", SYN, 2, ["parallel.dp=2", "precision.dtype=bf16"]),
    ("llama_tp2_mqa", SYN, 2, ["parallel.tp=2", "model.arch=llama", "model.kv_heads=1"]),
    ("llama_bf16_pp2", SYN, 2, ["parallel.pp=2", "train.micro_batches=4", "model.arch=llama",
                                "precision.dtype=bf16"]),
    ("fp16", SYN, 1, ["precision.dtype=fp16"]),
    ("bf16_zero1", SYN, 2, ["parallel.dp=2", "zero.stage=1", "precision.dtype=bf16"]),
    ("bf16_zero2", SYN, 2, ["parallel.dp=2", "zero.stage=2", "precision.dtype=bf16"]),
    ("bf16_zero3", SYN, 2, ["parallel.dp=2", "zero.stage=3", "precision.dtype=bf16"]),
    ("recompute_micro", SYN, 1, ["model.recompute=true", "train.micro_batches=2"]),
    ("dp2_tp2", SYN, 4, ["parallel.dp=2", "parallel.tp=2"]),
    # Context parallelism: the ring's blocks (comm) and running output (workspace), ZeRO over dp x cp.
    ("cp2", SYN, 2, ["parallel.cp=2"]),
    ("cp2_zero3_bf16", SYN, 2, ["parallel.cp=2", "zero.stage=3", "precision.dtype=bf16"]),
    # Experts: their tables (N*k rows), the router's, and tp's gate-gradient sum.
    ("moe_tp2_bf16", SYN, 2, ["parallel.tp=2", "model.experts=4", "precision.dtype=bf16"]),
    ("moe_zero3_dp2", SYN, 2, ["parallel.dp=2", "zero.stage=3", "model.experts=4", "model.moe_every=2"]),
    ("moe_ep2_bf16", SYN, 2, ["parallel.dp=2", "parallel.ep=2", "model.experts=4", "precision.dtype=bf16"]),
    # ZeRO-1 with experts: the dense tensors' masters and AdamW state over dp 4, the experts' over 2.
    ("moe_ep2_zero1_bf16_dp4", SYN, 4, ["parallel.dp=4", "parallel.ep=2", "zero.stage=1", "model.experts=4",
                                        "precision.dtype=bf16"]),
    ("dp2_pp2", SYN, 4, ["parallel.dp=2", "parallel.pp=2", "train.micro_batches=2"]),
    ("bf16_zero1_dp2_pp2", SYN, 4, ["parallel.dp=2", "parallel.pp=2", "train.micro_batches=2", "zero.stage=1",
                                    "precision.dtype=bf16"]),
    ("tp2_pp2_sp_bf16", SYN, 4, ["parallel.tp=2", "parallel.pp=2", "tensor.sequence_parallel=true",
                                 "precision.dtype=bf16", "train.micro_batches=2"]),
    ("int8_dp2", SYN, 2, ["parallel.dp=2", "compression.method=int8"]),
    ("topk_dp2", SYN, 2, ["parallel.dp=2", "compression.method=topk"]),
    # The sparsity warm-up: the whole sum's ring scratch, and pairs' buffers for its largest fraction.
    ("topk_warmup_dp2", SYN, 2, ["parallel.dp=2", "compression.method=topk", "compression.warmup_steps=4"]),
    # int8 on ZeRO-2's pieces: per-tensor residuals beside each piece's scratch, every micro-batch.
    ("int8_zero2_micro2", SYN, 2, ["parallel.dp=2", "zero.stage=2", "compression.method=int8", "train.micro_batches=2"]),
    # Several buckets (data_parallel.bucket_mb): PowerSGD's all-reduces complete within each bucket's reduction,
    # so they are not in flight beside the other buckets' (the pool check fails a plan that says so).
    ("powersgd_dp2", SYN, 2, ["parallel.dp=2", "compression.method=powersgd", "compression.rank=2",
                              "compression.start_step=0", "data_parallel.bucket_mb=0.01"]),
]


def deck_ranks(path):
    text = open(path).read()
    n = 1
    for key in ("dp", "tp", "pp", "cp"):
        m = re.search(r"^\s*%s\s*=\s*(\d+)" % key, text, re.M)
        if m:
            n *= int(m.group(1))
    return n


def start_step(args, deck, sets):
    """PowerSGD's compression.start_step for the deck with its --set words, its default filled in by
    `loom check` (0 for every other method): the method's state is made at its first compressed
    step, which the plan counts."""
    text = run([args.loom, "check", deck] + sum((["--set", x] for x in sets), [])).stdout
    section, keys = "", {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and section == "compression":
            k, v = line.split("=", 1)
            keys[k.strip()] = v.strip()
    return int(keys["start_step"]) if keys.get("method") == "powersgd" else 0


def prepared_data(args, deck, where):
    """For a deck whose opening comment prepares its data (`build/loom data prepare ...`), that line run
    in `where` (once; regression/deck_prepare.py), which is returned: the deck runs there. Else None."""
    if "build/loom data prepare" not in open(deck).read():
        return None
    if not os.path.exists(os.path.join(where, "done")):
        run([sys.executable, os.path.join(ROOT, "regression", "deck_prepare.py"), "--loom", os.path.abspath(args.loom), "--deck", deck,
             "--workdir", where])
        open(os.path.join(where, "done"), "w").close()
    return where


def memory_vs_ledger(args, d, failures):
    import json
    cases = [(os.path.basename(p)[:-5], p, deck_ranks(p), []) for p in
             sorted(os.path.join(ROOT, "inputs", f) for f in os.listdir(os.path.join(ROOT, "inputs")) if f.endswith(".deck"))]
    worst, pools = [], []
    here = os.getcwd()
    for tag, deck, ranks, sets in cases + LAYOUTS:
        os.chdir(prepared_data(args, deck, os.path.join(d, tag + "-data")) or here)
        run_dir = os.path.join(d, tag)
        over = sets + ["train.steps=%d" % (2 + start_step(args, deck, sets)), "train.eval_every=0", "train.log_every=1", "run.dir=" + run_dir,
                       "run.overwrite=true", "checkpoint.dir=" + os.path.join(run_dir, "ckpt"), "checkpoint.every=0"]
        sargs = sum((["--set", x] for x in over), [])
        pred = json.loads(run([args.loom, "plan", deck, "--cluster", "h100-sxm", "--json"] + sargs).stdout)
        run(common.launch_prefix(args, ranks) + [args.loom, "run", deck] + sargs)
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
        meas = summary["mem_peak_bytes_by_rank"]
        # The collectives' pools, reserved from the plan: never outgrown (beyond the world's unplanned
        # scalar collectives), and at most twice what the
        # collectives needed (the plan's worst case, every bucket of a window in flight at once).
        for r, pool in enumerate(summary["comm_scratch_bytes_by_rank"]):
            pools.append((pool["reserved"] / max(pool["needed"], 1), tag, r, pool["reserved"], pool["needed"]))
            if pool["needed"] > pool["reserved"] + 4096 or pool["reserved"] > 2 * pool["needed"] + 4096:
                failures.append("%s rank %d: ring-scratch pools reserved %d bytes, the collectives needed %d" %
                                (tag, r, pool["reserved"], pool["needed"]))
        if len(meas) != len(pred["mem_peak_bytes_by_rank"]):
            failures.append("%s: %d ranks measured, %d predicted" % (tag, len(meas), len(pred["mem_peak_bytes_by_rank"])))
            continue
        for r, (m, p) in enumerate(zip(meas, pred["mem_peak_bytes_by_rank"])):
            for c in CATEGORIES:
                gap = p[c] - m[c]
                rel = abs(gap) / m[c] if m[c] else (0.0 if gap == 0 else float("inf"))
                worst.append((rel, tag, r, c, p[c], m[c]))
                if abs(gap) > 0.05 * m[c] + 4096:
                    failures.append("%s rank %d %s: predicted %d bytes, measured %d (%+.1f%%)" %
                                    (tag, r, c, p[c], m[c], 100 * gap / max(m[c], 1)))
    os.chdir(here)
    worst.sort(reverse=True)
    print("largest relative gaps (predicted vs the ledger's peak, per rank and category):")
    for rel, tag, r, c, p, m in worst[:12]:
        print("  %-18s rank %d %-11s predicted %11d measured %11d  %6.2f%%" %
              (tag, r, c, p, m, 100 * rel if rel != float("inf") else float("inf")))
    pools.sort(reverse=True)
    print("ring-scratch pools, reserved from the plan against what the collectives needed (largest ratios): " +
          ", ".join("%s rank %d %d / %d" % (t, r, res, need) for _, t, r, res, need in pools[:4]))
    big = [w for w in worst if w[5] >= 1 << 20]
    if big:
        print("largest among categories of 1 MiB or more: %s rank %d %s %.3f%%" % (big[0][1], big[0][2], big[0][3], 100 * max(b[0] for b in big)))


def main():
    args = common.case_arguments(__doc__)
    failures = []
    d = os.path.join(args.workdir, args.case)
    os.makedirs(d, exist_ok=True)
    loom = args.loom
    if args.case == "presets":
        for name, words in (("a100-80gb", ["A100", "312", "80 GiB", "memory 2039 GB/s", "attention 21.5 TFLOP/s", "fused attention (model.attention = flash) not measured", "waits at synchronisations 0%",
                                           "host copies 32 GB/s", "PCIe Gen4"]),
                            ("h100-sxm", ["H100", "989", "80 GiB", "memory 3350 GB/s", "attention 35.4 TFLOP/s", "fused attention (model.attention = flash) 52.4 TFLOP/s", "host copies 64 GB/s", "PCIe Gen5"]),
                            ("h200", ["H200", "989", "141 GiB", "memory 4800 GB/s", "attention 43.2 TFLOP/s", "fused attention (model.attention = flash) 52.9 TFLOP/s", "host copies 64 GB/s"])):
            p = run([loom, "plan", "--cluster", name, "--show"])
            print(p.stdout.strip())
            for w in words + ["datasheet", "32 devices"]:
                if w not in p.stdout:
                    failures.append("preset %s does not say %r" % (name, w))
        p = run([loom, "plan", "--cluster", "h100-sxm", "--set", "cluster.nodes=8", "--show"])
        if "64 devices" not in p.stdout:
            failures.append("--set cluster.nodes=8 does not give 64 devices: " + p.stdout)
        # A GPU's compression runs on a host copy of each bucket (DESIGN.md "The GPU path"): its passes go
        # at host_gbs and its copies over host_link_gbs, not at the HBM's speed.
        import json
        deck = os.path.join(ROOT, "inputs", "compression.deck")
        def compute_ms(*sets):
            return json.loads(run([loom, "plan", deck, "--cluster", "h100-sxm", "--json"] +
                                  sum((["--set", x] for x in sets), [])).stdout)["compute_ms"]
        base, no_copies, faster_host = compute_ms(), compute_ms("cluster.host_link_gbs=0"), compute_ms("cluster.host_gbs=20")
        print("compression.deck on h100-sxm: compute %.4f ms; without host copies %.4f ms; host passes at 20 GB/s %.4f ms" %
              (base, no_copies, faster_host))
        if not no_copies < base:
            failures.append("host_link_gbs = 0 does not drop the compression deck's host copies: %s vs %s" % (no_copies, base))
        if not faster_host < base:
            failures.append("a faster host_gbs does not speed the compression deck's host passes: %s vs %s" % (faster_host, base))
        # The human plan of a small machine: its rate readable (not "0.0 TFLOP/s"), the run's whole time,
        # and, without --cluster and calibration file, a loud word on which machine it prices.
        quick = os.path.join(ROOT, "inputs", "quickstart.deck")
        p = run([loom, "plan", quick, "--cluster", "h100-sxm", "--set", "cluster.peak_tflops_fp32=0.047"])
        print(p.stdout.strip())
        for w in ["x 47.0 GFLOP/s (fp32)", "the run: 300 steps (train.steps) x ", "NOTE: this deck runs on the host back end"]:
            if w not in p.stdout:
                failures.append("loom plan of quickstart.deck on a 47 GFLOP/s device does not say %r" % w)
        if "0.0 TFLOP/s" in p.stdout:
            failures.append("loom plan rounds a small rate to 0.0 TFLOP/s")
        bare = {k: v for k, v in os.environ.items() if k != "XDG_CONFIG_HOME"}
        p = run([loom, "plan", quick], env=dict(bare, HOME=d))  # no calibration file under this HOME
        if not p.stdout.startswith("loom plan: NOTE: priced on the preset h100-sxm, not on this machine"):
            failures.append("loom plan without --cluster or calibration does not say first which machine it prices: "
                            + p.stdout[:200])
    elif args.case == "calibrate_np2":
        out = os.path.join(d, "cal", "cluster.ini")
        p = run(common.launch_prefix(args, 2, always=True) + [loom, "plan", "--calibrate", "-o", out])
        print(p.stdout.strip())
        shown = run([loom, "plan", "--cluster", out, "--show"]).stdout
        a, b = figures(p.stdout), figures(shown)
        print("calibrated figures %s, read back %s" % (a, b))
        if not a or a != b:
            failures.append("the file does not read back to what calibration printed: %s vs %s" % (a, b))
        # Fixed costs are what a measurement has left over beyond its rate, floored at 0: on a busy
        # machine (ctest -j) noise can leave none, which is a figure loom plan takes. The rest are rates,
        # sizes and latencies, positive.
        fixed_rx = r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?) us per (?:product call|sequence and head)"
        fixed = [float(x) for x in re.findall(fixed_rx, shown)]
        # Likewise the waits at synchronisations (sync_wait_share): 0 where the ranks kept in step.
        wait_rx = r"waits at synchronisations ([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)% of compute"
        waits = [float(x) for x in re.findall(wait_rx, shown)]
        if len(waits) != 1 or waits[0] < 0:
            failures.append("the waits at synchronisations are not one share >= 0: %s" % waits)
        nums = figures(re.sub(wait_rx, "", re.sub(fixed_rx, "", shown)))
        if any(x <= 0 for x in nums[3:]):  # nodes, devices, memory, rates, links, latencies
            failures.append("a calibrated figure is not positive: %s" % nums)
        if len(fixed) != 3 or any(x < 0 for x in fixed):
            failures.append("the fixed costs (per product call, per sequence and head unfused and fused) are not 3 "
                            "figures >= 0: %s" % fixed)
        import json
        deck = os.path.join(ROOT, "inputs", "long_context.deck")
        def attention(cluster, kind):
            return json.loads(run([loom, "plan", deck, "--cluster", cluster, "--json", "--set",
                                   "model.attention=" + kind]).stdout)
        flash, unfused = attention(out, "flash"), attention(out, "unfused")
        print("long_context.deck on the calibrated file: attention %.3f ms fused (priced as %s), %.3f ms unfused" %
              (flash["attention_ms"], flash["attention_priced_as"], unfused["attention_ms"]))
        if flash["attention_priced_as"] != "flash" or flash["attention_ms"] == unfused["attention_ms"]:
            failures.append("a flash run is not priced at the calibrated fused-attention rate: %s" % flash)
        preset = attention("a100-80gb", "flash")
        if preset["attention_priced_as"] != "unfused":
            failures.append("a preset without a fused rate does not price flash as unfused: %s" % preset)
        text = run([loom, "plan", deck, "--cluster", "a100-80gb"]).stdout
        if "priced as the unfused kernels" not in text:
            failures.append("the plan of a flash run on a preset does not say it is priced as unfused: " + text)
        for name in ("h100-sxm", "h200"):  # measured on those GPUs
            fused, plain = attention(name, "flash"), attention(name, "unfused")
            if fused["attention_priced_as"] != "flash" or not fused["attention_ms"] < plain["attention_ms"]:
                failures.append("preset %s does not price flash at its measured fused rate, below unfused: %s, %s" %
                                (name, fused, plain))
        if "1 node(s) x 2 device(s)" not in shown:
            failures.append("2 ranks on one node should calibrate as 1 node x 2 devices: " + shown)
        p = run([loom, "plan", "--calibrate", "-o", os.path.join(d, "one.ini")], expect=2)
        if "2 ranks" not in p.stderr or os.path.exists(os.path.join(d, "one.ini")):
            failures.append("calibration on 1 rank is not refused saying why: " + p.stderr)
        p = run([loom, "plan", "--calibrate", "-o", os.path.join(d, "one.ini"), "--set", "network.intra_node_gbs=100"],
                expect=2)
        if "not given: network.intra_node_latency_us, network.inter_node_gbs, network.inter_node_latency_us" not in p.stderr:
            failures.append("calibration on 1 rank with some network figures does not name the missing ones: " + p.stderr)
    elif args.case == "memory_vs_ledger":
        memory_vs_ledger(args, d, failures)
    elif args.case == "cluster_refusals":
        cases = [
            ("missing", GOOD.replace("inter_node_gbs = 20\n", ""), [], ["network.inter_node_gbs is missing"]),
            ("missing_memory", GOOD.replace("memory_gbs = 500\n", ""), [], ["cluster.memory_gbs is missing"]),
            ("missing_call", GOOD.replace("matmul_call_us = 4\n", ""), [], ["cluster.matmul_call_us is missing"]),
            ("missing_head", GOOD.replace("attention_head_us = 2\n", ""), [], ["cluster.attention_head_us is missing"]),
            ("missing_optimizer", GOOD.replace("optimizer_gbs = 400\n", ""), [], ["cluster.optimizer_gbs is missing"]),
            ("missing_sync", GOOD.replace("sync_wait_share = 0.05\n", ""), [], ["cluster.sync_wait_share is missing"]),
            ("missing_host", GOOD.replace("host_gbs = 10\n", ""), [], ["cluster.host_gbs is missing"]),
            ("missing_host_link", GOOD.replace("host_link_gbs = 25\n", ""), [], ["cluster.host_link_gbs is missing"]),
            ("negative_host_link", GOOD.replace("host_link_gbs = 25", "host_link_gbs = -1"), [], ["host_link_gbs", "range"]),
            ("negative_sync", GOOD.replace("sync_wait_share = 0.05", "sync_wait_share = -0.1"), [],
             ["sync_wait_share", "range"]),
            ("missing_efficiency", GOOD.replace("matmul_efficiency_bf16 = 0.8\n", ""), [],
             ["cluster.matmul_efficiency_bf16 is missing"]),
            ("bad_efficiency", GOOD.replace("64:0.5 512:1", "512:0.5 64:1"), [],
             ["matmul_efficiency_fp32", "widths increasing"]),
            ("efficiency_above_1", GOOD.replace("matmul_efficiency_bf16 = 0.8", "matmul_efficiency_bf16 = 1.5"), [],
             ["matmul_efficiency_bf16", "(0, 1]"]),
            ("zero_optimizer", GOOD.replace("optimizer_gbs = 400", "optimizer_gbs = 0"), [], ["optimizer_gbs", "range"]),
            ("negative_call", GOOD.replace("matmul_call_us = 4", "matmul_call_us = -1"), [], ["matmul_call_us", "range"]),
            ("negative_head", GOOD.replace("attention_head_us = 2", "attention_head_us = -2"), [],
             ["attention_head_us", "range"]),
            ("zero_attention", GOOD.replace("attention_tflops = 5", "attention_tflops = 0"), [],
             ["attention_tflops", "range"]),
            ("flash_cost_without_rate", GOOD.replace("attention_head_us = 2\n", "attention_head_us = 2\nflash_attention_head_us = 3\n"),
             [], ["flash_attention_head_us = 3", "without cluster.flash_attention_tflops"]),
            ("tiny_flash_rate", GOOD.replace("attention_head_us = 2\n", "attention_head_us = 2\nflash_attention_tflops = 1e-320\n"),
             [], ["flash_attention_tflops = 1e-320", "0, not measured, or 1e-06"]),
            ("negative", GOOD.replace("device_memory_gib = 40", "device_memory_gib = -40"), [],
             ["device_memory_gib", "range"]),
            ("unknown", GOOD + "nvlink_gen = 4\n", [], ["nvlink_gen"]),
            ("swapped", GOOD.replace("intra_node_gbs = 200", "intra_node_gbs = 2"), [],
             ["intra_node_gbs = 2", "inter_node_gbs = 20"]),
            ("bad_set", GOOD, ["--set", "cluster.nodes=0"], ["cluster.nodes"]),
        ]
        for tag, text, extra, words in cases:
            path = os.path.join(d, tag + ".ini")
            with open(path, "w") as f:
                f.write(text)
            p = run([loom, "plan", "--cluster", path, "--show"] + extra, expect=2)
            msg = p.stderr.strip()
            print("%s: %s" % (tag, msg))
            for w in words:
                if w not in msg:
                    failures.append("%s: the error does not say %r: %s" % (tag, w, msg))
        for tag, path, words in (("directory", d, ["is a directory, not a cluster file"]),
                                 ("empty", os.path.join(d, "empty.ini"), ["cluster file", "is empty", "--cluster-keys"])):
            if tag == "empty":
                open(path, "w").close()
            p = run([loom, "plan", "--cluster", path, "--show"], expect=2)
            print("%s: %s" % (tag, p.stderr.strip()))
            for w in words:
                if w not in p.stderr:
                    failures.append("%s: the error does not say %r: %s" % (tag, w, p.stderr.strip()))
        p = run([loom, "plan", "--cluster", "h1000", "--show"], expect=2)
        if "h1000" not in p.stderr or "h100-sxm" not in p.stderr:
            failures.append("an unknown cluster is not refused listing the presets: " + p.stderr)
        # --calibrate's --set values are its own, not a preset's: a bad one is refused naming them.
        net = sum((["--set", s] for s in ("network.intra_node_gbs=100", "network.intra_node_latency_us=2",
                                          "network.inter_node_gbs=10", "network.inter_node_latency_us=5")), [])
        p = run([loom, "plan", "--calibrate", "-o", os.path.join(d, "cal.ini"), "--set", "cluster.flash_attention_tflops=-1"]
                + net, expect=2)
        print("calibrate_bad_set: " + p.stderr.strip())
        if "preset" in p.stderr or "flash_attention_tflops = -1" not in p.stderr or "--set" not in p.stderr:
            failures.append("a bad --set of --calibrate is not refused as the --set's: " + p.stderr)
        p = run([loom, "plan", "--calibrate", "-o", os.path.join(d, "cal.ini"), "--set", "cluster.flash_attention_tflops=1e-9"]
                + net, expect=2)
        print("calibrate_tiny_flash_rate: " + p.stderr.strip())
        if "loom plan --calibrate --set" not in p.stderr or "0, not measured" not in p.stderr or \
                "calibrate" in p.stdout.lower():
            failures.append("--calibrate --set cluster.flash_attention_tflops=1e-9 is not refused before measuring: " +
                            p.stdout[-300:] + p.stderr)
        # ... and a fixed cost given alone joins the rate it measures (it was refused as a preset's rule).
        cal = os.path.join(d, "cal.ini")
        p = run([loom, "plan", "--calibrate", "-o", cal, "--set", "cluster.flash_attention_head_us=3"] + net)
        text = open(cal).read() if os.path.exists(cal) else ""
        if not re.search(r"^flash_attention_head_us = 3$", text, re.M) or not re.search(r"^flash_attention_tflops = [0-9.e+-]+$", text, re.M):
            failures.append("--calibrate --set cluster.flash_attention_head_us=3 did not write it with a measured rate: " +
                            p.stderr + text[:300])
        good = os.path.join(d, "good.ini")
        with open(good, "w") as f:
            f.write(GOOD)
        p = run([loom, "plan", "--cluster", good, "--show"])
        if "2 node(s) x 4 device(s) = 8 devices" not in p.stdout:
            failures.append("a good file does not read: " + p.stdout)
    return common.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
