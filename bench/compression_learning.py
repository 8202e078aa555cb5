#!/usr/bin/env python3
"""Does compressed data parallelism learn? Final loss against uncompressed training over seeds, on two
text decks, with the bytes each method sends, in one run.

    python3 bench/compression_learning.py --loom build/loom [--seeds 5] [--steps 300] [--only topk]

A GPT-2 of 2 blocks (d_model 64, 4 heads, 64 bytes of context, byte vocabulary) at dp 2, batch 16,
AdamW at lr 1e-3 (cosine to 1e-4, 20 warm-up steps: a rate at which seeds agree), one BLAS thread a
rank, on two texts: the GPL-3 (Debian's /usr/share/common-licenses/GPL-3, 35 kB) and the
reStructuredText sources of Python's documentation (python3.11-doc, 11 MB, concatenated as
bench/moe.py does). For each configuration and seed: the mean of the last 20 steps' training loss
(the issue's measure), its gap to the uncompressed run of the same seed, and the bytes rank 0 sent
for the gradients over the whole run against the uncompressed collective's. It prints, per deck and
configuration, the mean gap over the seeds with its spread (min .. max) and the bytes ratio, and
the uncompressed runs' own spread over seeds; then one JSON line with everything.

Configurations: none, fp16, int8, powersgd (rank 2, from step 11, the vocabulary table at its default
rank 8; with it at rank 2 as PyTorch's hook has it, and at 16; from step 41; and with train.beta1 = 0
and 0.5, and uncompressed with those, to tell the optimizer's part from compression's); top-k at ratio 0.01 as it was
(topk_plain: every technique off), with each technique alone (compression.warmup_steps = 60,
momentum_masking, momentum_correction, local_clip = 1), with its defaults (momentum correction and
local clipping), and with the warm-up added to masking and to the defaults. Then the peer: the same model
in PyTorch under DistributedDataParallel, uncompressed and with PyTorch's powerSGD_hook (rank 2, from
step 11), through bench/torch_ddp_compression.py with --torch-python (default /usr/bin/python3; --no-torch
skips it): its gap to its own uncompressed runs, seed by seed (its data sampler is not loom's).
--arch llama trains Llama blocks (untied output layer) instead, loom only. Standard
library only here. A benchmark, not a test.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from moe import default_text  # noqa: E402  (Python's documentation, concatenated)

DECK = """# written by bench/compression_learning.py
[model]
layers = 2
d_model = 64
heads = 4
seq_len = 64
vocab = 256
[data]
source = text:{text}
val_fraction = 0.1
[train]
steps = {steps}
batch = 16
lr = 1e-3
lr_min = 1e-4
schedule = cosine
warmup = 20
eval_every = 0
log_every = 1
[parallel]
dp = 2
"""
TOPK = ["compression.method=topk", "compression.ratio=0.01"]
POWERSGD = ["compression.method=powersgd", "compression.rank=2", "compression.start_step=10"]
# Today's top-k, then each technique alone, then the defaults and all together.
PLAIN = ["compression.warmup_steps=0", "compression.momentum_masking=false", "compression.momentum_correction=false",
         "compression.local_clip=0"]
CONFIGS = [
    ("none", []),
    ("fp16", ["compression.method=fp16"]),
    ("int8", ["compression.method=int8"]),
    ("powersgd_r2", POWERSGD),
    ("powersgd_r2+emb_r2", POWERSGD + ["compression.embedding_rank=2"]),
    ("powersgd_r2+emb_r16", POWERSGD + ["compression.embedding_rank=16"]),
    ("powersgd_r2+start_40", POWERSGD + ["compression.start_step=40"]),
    ("powersgd_r2+beta1_0", POWERSGD + ["train.beta1=0"]),
    ("powersgd_r2+beta1_0.5", POWERSGD + ["train.beta1=0.5"]),
    # The same optimizer changes uncompressed: what they do to training itself.
    ("none+beta1_0", ["train.beta1=0"]),
    ("none+beta1_0.5", ["train.beta1=0.5"]),
    ("topk_plain", TOPK + PLAIN),
    ("topk+warmup", TOPK + PLAIN + ["compression.warmup_steps=60"]),
    ("topk+masking", TOPK + PLAIN + ["compression.momentum_masking=true"]),
    ("topk+correction", TOPK + PLAIN + ["compression.momentum_correction=true"]),
    ("topk+local_clip", TOPK + PLAIN + ["compression.local_clip=1"]),
    ("topk_defaults", TOPK),
    ("topk+warmup+masking", TOPK + PLAIN + ["compression.warmup_steps=60", "compression.momentum_masking=true"]),
    ("topk_defaults+warmup", TOPK + ["compression.warmup_steps=60"]),
]


def run(args, deck, tag, seed, sets):
    rundir = os.path.join(args.workdir, "%s-%s-s%d" % (os.path.basename(deck)[:-5], tag, seed))
    cmd = [args.mpirun, "-n", "2", args.loom, "run", deck, "--set", "run.dir=" + rundir, "--set", "run.overwrite=true",
           "--set", "train.seed=%d" % seed]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-2000:])
        sys.exit("loom failed: " + " ".join(cmd))
    rows = [json.loads(line) for line in open(os.path.join(rundir, "metrics.jsonl")) if line.endswith("\n")]
    last = [r["loss"] for r in rows[-20:]]
    sent = sum(r.get("compression_bytes", r.get("dp_allreduce_bytes", 0)) for r in rows)
    plain = sum(r.get("compression_uncompressed_bytes", r.get("dp_allreduce_bytes", 0)) for r in rows)
    return {"loss": sum(last) / len(last), "bytes_ratio": sent / plain if plain else 1.0}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--only", nargs="*", help="configurations to run besides none (default: all)")
    ap.add_argument("--workdir", default="build/bench-compression-learning")
    ap.add_argument("--torch-python", default="/usr/bin/python3")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    texts = {"gpl3": "/usr/share/common-licenses/GPL-3", "pydocs": default_text(args.workdir)}
    configs = [c for c in CONFIGS if c[0] == "none" or not args.only or c[0] in args.only]
    results = {}
    for name, text in texts.items():
        deck = os.path.join(args.workdir, name + ("" if args.arch == "gpt2" else "-" + args.arch) + ".deck")
        with open(deck, "w") as f:
            f.write(DECK.format(text=text, steps=args.steps).replace("[model]\n", "[model]\narch = %s\n" % args.arch))
        for tag, sets in configs:
            for seed in range(1, args.seeds + 1):
                results.setdefault(name, {}).setdefault(tag, {})[seed] = run(args, deck, tag, seed, sets)
                print("%s %s seed %d: %s" % (name, tag, seed, results[name][tag][seed]), flush=True)
    peer = {}
    if not args.no_torch and args.arch == "gpt2":
        for name, text in texts.items():
            for seed in range(1, args.seeds + 1):
                cmd = [args.torch_python, os.path.join(HERE, "torch_ddp_compression.py"), "--text", text, "--seed",
                       str(seed), "--steps", str(args.steps), "--workdir", os.path.join(args.workdir, "torch")]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0:
                    sys.stderr.write(p.stdout[-2000:] + p.stderr[-2000:])
                    sys.exit("the PyTorch peer failed: " + " ".join(cmd))
                peer.setdefault(name, {})[seed] = json.loads(p.stdout.strip().splitlines()[-1])
                print("%s pytorch seed %d: %s" % (name, seed, peer[name][seed]), flush=True)
    print("\n%s 2 x 64 at dp 2, %d steps, %d seeds: mean of the last 20 steps' loss against uncompressed, same seed"
          % ({"gpt2": "GPT-2", "llama": "Llama"}[args.arch], args.steps, args.seeds))
    for name, by in results.items():
        base = {s: r["loss"] for s, r in by["none"].items()}
        vals = list(base.values())
        print("  %s: uncompressed %.4f (seeds %.4f .. %.4f, spread %.2f%% of the mean)"
              % (name, statistics.mean(vals), min(vals), max(vals), 100 * (max(vals) - min(vals)) / statistics.mean(vals)))
        print("    %-22s %10s %20s %12s" % ("configuration", "mean gap", "spread (min .. max)", "bytes ratio"))
        for tag, runs in by.items():
            if tag == "none":
                continue
            gaps = [r["loss"] / base[s] - 1 for s, r in runs.items()]
            ratio = statistics.mean(r["bytes_ratio"] for r in runs.values())
            print("    %-22s %+9.2f%% %8.2f%% .. %+6.2f%% %12.4f"
                  % (tag, 100 * statistics.mean(gaps), 100 * min(gaps), 100 * max(gaps), ratio))
        if name in peer:
            gaps = [r["powersgd_r2"] / r["none"] - 1 for r in peer[name].values()]
            base = [r["none"] for r in peer[name].values()]
            print("    %-22s %+9.2f%% %8.2f%% .. %+6.2f%%   (PyTorch's own uncompressed: %.4f)"
                  % ("pytorch powerSGD r2", 100 * statistics.mean(gaps), 100 * min(gaps), 100 * max(gaps),
                     statistics.mean(base)))
    print(json.dumps({"steps": args.steps, "seeds": args.seeds, "results": results, "pytorch": peer}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
