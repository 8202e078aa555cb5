#!/usr/bin/env python3
"""`loom plan`'s cluster descriptions (issue 16, the part built so far).

    python3 regression/plan_checks.py --loom build/loom --workdir build/plan-checks CASE

  presets            a100-80gb, h100-sxm, h200 load, each naming its datasheet; --set overrides a key
  calibrate_np2      `loom plan --calibrate` on 2 ranks writes a cluster file whose every figure is
                     positive, which `--cluster FILE --show` reads back to the same values; on 1 rank
                     it is refused (it measures the links between ranks)
  cluster_refusals   a missing key, a value out of range, an unknown key, links inside a node slower
                     than between nodes, a name that is neither a file nor a preset: exit 2, named
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
[network]
intra_node_gbs = 200
intra_node_latency_us = 2
inter_node_gbs = 20
inter_node_latency_us = 6
"""


def run(cmd, expect=0):
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    if expect is not None and p.returncode != expect:
        sys.stdout.write(p.stdout[-2000:] + p.stderr[-2000:])
        raise SystemExit("FAIL: exit %d, expected %d" % (p.returncode, expect))
    return p


def figures(text):
    """The numbers of `--show`, in order."""
    return [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text.split("source:")[0])]


def main():
    args = common.case_arguments(__doc__)
    failures = []
    d = os.path.join(args.workdir, args.case)
    os.makedirs(d, exist_ok=True)
    loom = args.loom
    if args.case == "presets":
        for name, words in (("a100-80gb", ["A100", "312", "80 GiB"]), ("h100-sxm", ["H100", "989", "80 GiB"]),
                            ("h200", ["H200", "989", "141 GiB"])):
            p = run([loom, "plan", "--cluster", name, "--show"])
            print(p.stdout.strip())
            for w in words + ["datasheet", "32 devices"]:
                if w not in p.stdout:
                    failures.append("preset %s does not say %r" % (name, w))
        p = run([loom, "plan", "--cluster", "h100-sxm", "--set", "cluster.nodes=8", "--show"])
        if "64 devices" not in p.stdout:
            failures.append("--set cluster.nodes=8 does not give 64 devices: " + p.stdout)
    elif args.case == "calibrate_np2":
        out = os.path.join(d, "cal", "cluster.ini")
        p = run(common.launch_prefix(args, 2, always=True) + [loom, "plan", "--calibrate", "-o", out])
        print(p.stdout.strip())
        shown = run([loom, "plan", "--cluster", out, "--show"]).stdout
        a, b = figures(p.stdout), figures(shown)
        print("calibrated figures %s, read back %s" % (a, b))
        if not a or a != b:
            failures.append("the file does not read back to what calibration printed: %s vs %s" % (a, b))
        nums = figures(shown)
        if any(x <= 0 for x in nums[3:]):  # nodes, devices, memory, rates, links, latencies
            failures.append("a calibrated figure is not positive: %s" % nums)
        if "1 node(s) x 2 device(s)" not in shown:
            failures.append("2 ranks on one node should calibrate as 1 node x 2 devices: " + shown)
        p = run([loom, "plan", "--calibrate", "-o", os.path.join(d, "one.ini")], expect=2)
        if "2 ranks" not in p.stderr or os.path.exists(os.path.join(d, "one.ini")):
            failures.append("calibration on 1 rank is not refused saying why: " + p.stderr)
    elif args.case == "cluster_refusals":
        cases = [
            ("missing", GOOD.replace("inter_node_gbs = 20\n", ""), [], ["network.inter_node_gbs is missing"]),
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
        p = run([loom, "plan", "--cluster", "h1000", "--show"], expect=2)
        if "h1000" not in p.stderr or "h100-sxm" not in p.stderr:
            failures.append("an unknown cluster is not refused listing the presets: " + p.stderr)
        good = os.path.join(d, "good.ini")
        with open(good, "w") as f:
            f.write(GOOD)
        p = run([loom, "plan", "--cluster", good, "--show"])
        if "2 node(s) x 4 device(s) = 8 devices" not in p.stdout:
            failures.append("a good file does not read: " + p.stdout)
    return common.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
