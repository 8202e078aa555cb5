#!/usr/bin/env python3
"""`loom data prepare` against SentencePiece's own spm_encode, and training on prepared shards against
training on text bytes, in the same run.

Usage:
  python3 bench/data_prepare.py --loom build/loom [--rounds 3] [--workdir /tmp/loom-data-bench]

  0. The text: the reStructuredText sources of Python's documentation (Debian's python3.11-doc, 497
     files, 11 MB), concatenated into one file; a SentencePiece BPE of 4,096 tokens trained on it by
     loom data prepare (not timed).
  1. Encoding, one core each, --rounds interleaved rounds (the order alternates): the wall time of
     `spm_encode --model M --output_format=id < TEXT > /dev/null` and of `loom data prepare --input TEXT
     --tokenizer M --threads 1` into a fresh folder (scan, UTF-8 check, hashing, encoding, shards and
     manifest: the whole command); MB of text per second per core, medians, and loom / spm_encode.
  2. Scaling: loom's own encode time (its `encode:` line, the slowest rank) at 1 rank x 1 thread, 2 ranks x
     1 thread and 1 rank x 2 threads, medians, and the speed-ups over 1 x 1 (a 2-core machine tops at 2).
  3. Training, one rank: tokens/s of inputs/quickstart.deck's model at model.vocab = 4096 and seq_len 128
     on the shards (tokens:) and on the text's bytes (text:, the same vocabulary size), 60 steps, median
     over the rounds of summary.json's tokens_per_s, and shards / text; and the loader's own time a step
     (metrics.jsonl's times_ms.data, mean over the steps after the first), where the two can differ.
A benchmark, not a test: exit 0 when every part ran, whatever the ratios. One JSON line ends the output.
"""
import argparse
import glob
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

DOCS = "/usr/share/doc/python3.11/html/_sources"


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit("bench: %s failed (%d):\n%s%s" % (" ".join(cmd[:4]), p.returncode, p.stdout[-2000:],
                                                   p.stderr[-2000:]))
    return p


def timed(cmd, **kw):
    t0 = time.perf_counter()
    p = run(cmd, **kw)
    return time.perf_counter() - t0, p


def encode_seconds(out):
    m = re.search(r"encode: [\d.]+ MB in ([\d.]+) s", out)
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/loom-data-bench")
    ap.add_argument("--mpirun", default="mpiexec")
    a = ap.parse_args()
    loom = os.path.abspath(a.loom)
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    text = os.path.join(a.workdir, "pydocs.txt")
    files = sorted(glob.glob(DOCS + "/*.txt") + glob.glob(DOCS + "/*/*.txt"))
    with open(text, "wb") as out:
        for f in files:
            out.write(open(f, "rb").read())
    mb = os.path.getsize(text) / 1e6
    ref = os.path.join(a.workdir, "ref")
    run([loom, "data", "prepare", "--input", text, "--out", ref, "--vocab", "4096", "--val-fraction", "0.02"])
    model = ref + "/tokenizer.model"
    env1 = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    spm, loom_s = [], []
    scale = {"1x1": [], "2x1": [], "1x2": []}
    train = {"tokens": [], "text": []}
    data_ms = {"tokens": [], "text": []}
    for r in range(a.rounds):
        order = ["spm", "loom"] if r % 2 == 0 else ["loom", "spm"]
        for who in order:
            if who == "spm":
                spm.append(_spm(model, text))
            else:
                out = os.path.join(a.workdir, "enc%d" % r)
                t, p = timed([loom, "data", "prepare", "--input", text, "--out", out, "--tokenizer", model,
                              "--threads", "1"])
                loom_s.append(t)
                scale["1x1"].append(encode_seconds(p.stdout))
        for key, pre, threads in [("2x1", [a.mpirun, "-n", "2"], "1"), ("1x2", [], "2")]:
            out = os.path.join(a.workdir, "scale%s%d" % (key, r))
            p = run(pre + [loom, "data", "prepare", "--input", text, "--out", out, "--tokenizer", model,
                           "--threads", threads])
            scale[key].append(encode_seconds(p.stdout))
        for kind in (["tokens", "text"] if r % 2 == 0 else ["text", "tokens"]):
            src = ["--set", "data.source=tokens:%s/train_*.bin" % ref, "--set",
                   "data.val_source=tokens:%s/val_*.bin" % ref] if kind == "tokens" else \
                  ["--set", "data.source=text:" + text]
            rd = os.path.join(a.workdir, "train-%s-%d" % (kind, r))
            run([loom, "run", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "inputs",
                                           "quickstart.deck"), "--set", "run.dir=" + rd, "--set", "train.steps=60",
                 "--set", "model.vocab=4096", "--set", "model.seq_len=128", "--set", "train.eval_every=0",
                 "--set", "run.threads=1"] + src, env=env1)
            train[kind].append(json.load(open(rd + "/summary.json"))["tokens_per_s"])
            rows = [json.loads(l) for l in open(rd + "/metrics.jsonl")]
            data_ms[kind].append(statistics.mean(r["times_ms"]["data"] for r in rows[1:]))
    med = statistics.median
    res = {"machine": platform.processor() or platform.machine(), "text_mb": round(mb, 3),
           "spm_encode_s": spm, "loom_prepare_s": loom_s,
           "spm_mb_s": mb / med(spm), "loom_mb_s": mb / med(loom_s), "loom_over_spm": med(spm) / med(loom_s),
           "encode_s": scale, "speedup_2_ranks": med(scale["1x1"]) / med(scale["2x1"]),
           "speedup_2_threads": med(scale["1x1"]) / med(scale["1x2"]),
           "train_tokens_per_s": train, "shards_over_text": med(train["tokens"]) / med(train["text"]),
           "data_ms_per_step": data_ms}
    print("text: %.1f MB (%d files of Python's documentation sources); tokenizer: BPE 4096" % (mb, len(files)))
    print("encode, one core:   spm_encode %.2f MB/s (median %.2f s) | loom data prepare %.2f MB/s (median "
          "%.2f s, the whole command) | loom / spm_encode = %.2fx" % (res["spm_mb_s"], med(spm), res["loom_mb_s"],
                                                                      med(loom_s), res["loom_over_spm"]))
    print("encode scaling:     1 rank x 1 thread %.2f s | 2 ranks x 1 thread %.2f s (%.2fx) | 1 rank x 2 threads "
          "%.2f s (%.2fx)" % (med(scale["1x1"]), med(scale["2x1"]), res["speedup_2_ranks"], med(scale["1x2"]),
                              res["speedup_2_threads"]))
    print("training, 1 rank:   shards %.0f tokens/s | text bytes %.0f tokens/s | shards / text = %.3f | the "
          "loader's time a step: shards %.3f ms, text %.3f ms" % (med(train["tokens"]), med(train["text"]),
                                                                 res["shards_over_text"], med(data_ms["tokens"]),
                                                                 med(data_ms["text"])))
    print(json.dumps(res))


def _spm(model, text):
    with open(text, "rb") as fin:
        t0 = time.perf_counter()
        p = subprocess.run(["spm_encode", "--model", model, "--output_format=id"], stdin=fin,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit("bench: spm_encode failed: " + p.stderr.decode()[-500:])
    return t


if __name__ == "__main__":
    main()
