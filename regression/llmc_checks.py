#!/usr/bin/python3
"""Weights in and out of loom through llm.c's model file, and `loom sample`.

    /usr/bin/python3 regression/llmc_checks.py --loom build/loom --workdir build/llmc-checks CASE

  oracle_file_same_loss  `loom export` gives the initial weights and the first batch; PyTorch
                         (regression/torch_gpt.py) loads them and writes an llm.c model file the way
                         llm.c's train_gpt2.py does (its own writer below: header, padded vocabulary,
                         layer-stacked tensors). loom reads it (model.init_from): its first loss is
                         bit for bit the loss of its own initialisation, and PyTorch's float64 loss
                         within 1e-5 relative; llm.c's bf16 file (version 5) too. Also at dp 2, tp 2, pp 2 and ZeRO-3 dp 2 (every rank
                         takes its own elements of the file), within 1e-5 relative of one process.
  roundtrip_bitwise      a checkpoint -> `loom ckpt llmc` -> model.init_from -> the weights loom
                         starts from (export's /params/init) equal the checkpoint's, bit for bit; the
                         file is byte-identical to PyTorch's writer given the same weights.
  refusals               another model (naming both shapes), a truncated file, a tokenizer file
                         given as a model, a missing file, a longer seq_len than the file's: exit 2,
                         named (`loom check` too); a shorter seq_len is taken.
  sample_quickstart      the quickstart deck trained briefly; `loom sample` on its checkpoint prints
                         text whose every character occurs in the training text, as many bytes as
                         asked, the same for the same seed and different for another; --tokens and an
                         llm.c tokenizer file decode alike; greedy (--temperature 0) is deterministic.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

import h5py
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import torch_gpt  # noqa: E402

DECK = common.SMALL_GPT2_DECK
REPO = os.path.dirname(HERE)
QUICKSTART = os.path.join(REPO, "inputs", "quickstart.deck")
GPL = "/usr/share/common-licenses/GPL-3"


def write_llmc(model, cfg, path, bf16=False):
    """llm.c's train_gpt2.py write_model: version 3 (fp32) or 5 (bf16), the vocabulary padded to a
    multiple of 128 with zero rows."""
    if bf16:  # bf16's bits are the high half of the fp32 of the rounded value
        sd = {k: (v.detach().to(torch.bfloat16).to(torch.float32).cpu().numpy().view(np.uint32) >> 16).astype(np.uint16)
              for k, v in model.state_dict().items()}
    else:
        sd = {k: v.detach().to(torch.float32).cpu().numpy() for k, v in model.state_dict().items()}
    L, C, V, T = cfg["layers"], cfg["d_model"], cfg["vocab"], cfg["seq_len"]
    Vp = (V + 127) // 128 * 128
    header = np.zeros(256, dtype=np.int32)
    header[:8] = [20240326, 5 if bf16 else 3, T, V, L, cfg["heads"], C, Vp]
    wte = np.zeros((Vp, C), dtype=np.uint16 if bf16 else np.float32)
    wte[:V] = sd["wte.weight"]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(wte.tobytes())
        f.write(sd["wpe.weight"].tobytes())
        for sub in ("ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
                    "ln2.weight", "ln2.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"):
            for l in range(L):
                f.write(sd["blocks.%d.%s" % (l, sub)].tobytes())
        f.write(sd["ln_f.weight"].tobytes())
        f.write(sd["ln_f.bias"].tobytes())


run = common.run_checked


def first_loss(rundir):
    return common.rows(rundir)[0]["loss"]


def export_and_model(args, d, deck):
    h5 = os.path.join(d, "export.h5")
    run([args.loom, "export", deck, h5, "--set", "run.dir=" + os.path.join(d, "export-run")])
    with h5py.File(h5, "r") as f:
        cfg = {k: int(f.attrs[k]) for k in ("layers", "d_model", "heads", "seq_len", "vocab", "batch")}
        params = {k: f["params/init"][k][()] for k in f["params/init"]}
        inputs = f["batches/inputs"][()]
        targets = f["batches/targets"][()]
        loss0 = float(f["metrics/loss"][0])
    model = torch_gpt.build_model(cfg, torch.float64)
    torch_gpt.load_params(model, params)
    return cfg, params, model, inputs, targets, loss0


def case_oracle_file_same_loss(args, c):
    cfg, _, model, inputs, targets, loss0 = export_and_model(args, c.dir, c.deck)
    B, T = cfg["batch"], cfg["seq_len"]
    with torch.no_grad():
        _, ref = model(torch.from_numpy(inputs[:B].reshape(B, T).astype(np.int64)),
                       torch.from_numpy(targets[:B].reshape(B, T).astype(np.int64)))
    ref = float(ref)
    path = os.path.join(c.dir, "torch.bin")
    write_llmc(model, cfg, path)
    p, rundir = c.loom("one", 1, ["model.init_from=" + path])
    got = first_loss(rundir)
    print("loss of loom's own initialisation %.17g, from PyTorch's llm.c file %.17g, PyTorch float64 %.17g"
          % (loss0, got, ref))
    if got != loss0:
        c.failures.append("loss from the llm.c file %.17g is not bit for bit loom's %.17g" % (got, loss0))
    if abs(got - ref) > 1e-5 * abs(ref):
        c.failures.append("loss from the llm.c file %.17g differs from PyTorch's %.17g by more than 1e-5 relative" % (got, ref))
    # llm.c's bf16 file (version 5): loom widens the bf16 weights exactly; PyTorch on the same rounded weights.
    path16 = os.path.join(c.dir, "torch_bf16.bin")
    write_llmc(model, cfg, path16, bf16=True)
    rounded = torch_gpt.build_model(cfg, torch.float64)
    with torch.no_grad():
        for (_, a), (_, b) in zip(rounded.named_parameters(), model.named_parameters()):
            a.copy_(b.to(torch.bfloat16).to(torch.float64))
        _, ref16 = rounded(torch.from_numpy(inputs[:B].reshape(B, T).astype(np.int64)),
                           torch.from_numpy(targets[:B].reshape(B, T).astype(np.int64)))
    ref16 = float(ref16)
    p, rundir = c.loom("bf16_file", 1, ["model.init_from=" + path16])
    got16 = first_loss(rundir)
    print("bf16 file (version 5): loom %.17g, PyTorch float64 on the bf16 weights %.17g" % (got16, ref16))
    if abs(got16 - ref16) > 1e-5 * abs(ref16) or got16 == got:
        c.failures.append("bf16 file: loom %.17g, PyTorch %.17g (fp32 file: %.17g)" % (got16, ref16, got))
    for tag, ranks, sets in (("dp2", 2, ["parallel.dp=2"]), ("tp2", 2, ["parallel.tp=2"]), ("pp2", 2, ["parallel.pp=2"]),
                             ("zero3_dp2", 2, ["parallel.dp=2", "zero.stage=3"])):
        p, rundir = c.loom(tag, ranks, sets + ["model.init_from=" + path])
        if p.returncode == 0:
            loss = first_loss(rundir)
            print("%s: first loss %.17g (relative difference %.2e)" % (tag, loss, abs(loss - got) / got))
            if abs(loss - got) > 1e-5 * abs(got):
                c.failures.append("%s: first loss %.17g, one process %.17g" % (tag, loss, got))


def case_roundtrip_bitwise(args, c):
    p, rundir = c.loom("trained", 1, ["train.steps=3", "checkpoint.every=3"])
    ckpt = os.path.join(rundir, "checkpoints", "ckpt-00000003.h5")
    out = os.path.join(c.dir, "loom.bin")
    p = run([args.loom, "ckpt", "llmc", ckpt, out])
    print(p.stdout.strip())
    p = run([args.loom, "export", c.deck, os.path.join(c.dir, "back.h5"), "--set", "model.init_from=" + out,
             "--set", "run.dir=" + os.path.join(c.dir, "back-run")])
    with h5py.File(ckpt, "r") as a, h5py.File(os.path.join(c.dir, "back.h5"), "r") as b:
        names = list(a["params"])
        differ = [n for n in names if not np.array_equal(a["params"][n][()].view(np.uint32),
                                                         b["params/init"][n][()].view(np.uint32))]
        params = {n: a["params"][n][()] for n in names}
    print("%d tensors through llm.c's format; bitwise different: %s" % (len(names), differ))
    if differ or len(names) != 2 + 12 * 2 + 2:
        c.failures.append("round trip not bit for bit: %s (%d tensors)" % (differ, len(names)))
    cfg = {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 32, "vocab": 200}
    model = torch_gpt.build_model(cfg, torch.float32)
    torch_gpt.load_params(model, params)
    theirs = os.path.join(c.dir, "torch.bin")
    write_llmc(model, cfg, theirs)
    same = open(out, "rb").read() == open(theirs, "rb").read()
    print("loom's file and PyTorch's writer's file are byte-identical: %s (%d bytes)" % (same, os.path.getsize(out)))
    if not same:
        c.failures.append("loom's llm.c file differs from the one llm.c's writer makes of the same weights")


def case_refusals(args, c):
    cfg, _, model, _, _, _ = export_and_model(args, c.dir, c.deck)
    good = os.path.join(c.dir, "good.bin")
    write_llmc(model, cfg, good)
    data = open(good, "rb").read()
    cases = []
    trunc = os.path.join(c.dir, "truncated.bin")
    open(trunc, "wb").write(data[:len(data) // 2])
    cases.append(("truncated", ["model.init_from=" + trunc], ["truncated.bin", "bytes", "truncated"]))
    tok = os.path.join(c.dir, "tokenizer.bin")
    open(tok, "wb").write(struct.pack("<256I", 20240328, 2, 200, 0, *([0] * 252)) + b"\x01a" * 200)
    cases.append(("tokenizer_as_model", ["model.init_from=" + tok], ["tokenizer.bin", "20240328", "tokenizer file"]))
    cases.append(("missing", ["model.init_from=" + os.path.join(c.dir, "nope.bin")], ["nope.bin", "cannot be opened"]))
    cases.append(("other_model", ["model.init_from=" + good, "model.layers=3", "model.d_model=32"],
                  ["model.layers = 3 in the deck, num_layers = 2", "model.d_model = 32 in the deck, channels = 64"]))
    cases.append(("longer_context", ["model.init_from=" + good, "model.seq_len=64"],
                  ["model.seq_len = 64", "max_seq_len = 32"]))
    for tag, sets, words in cases:
        p, _ = c.loom(tag, 1, sets, expect=2)
        msg = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        print("%s: %s" % (tag, msg))
        for w in words:
            if w not in p.stderr:
                c.failures.append("%s: the error does not say %r: %s" % (tag, w, msg))
    # `loom check` reads the file too, before any job starts.
    p = run([args.loom, "check", c.deck, "--set", "model.init_from=" + good, "--set", "model.layers=3"], expect=2)
    if "num_layers = 2 in the file" not in p.stderr:
        c.failures.append("loom check does not refuse another model's file: " + p.stderr[-300:])
    # A shorter context than the file's is taken (llm.c does the same): the first seq_len positions.
    p, rundir = c.loom("shorter_context", 1, ["model.init_from=" + good, "model.seq_len=16"])


def case_sample_quickstart(args, c):
    rundir = os.path.join(c.dir, "quickstart")
    run([args.loom, "run", QUICKSTART, "--set", "run.dir=" + rundir, "--set", "train.steps=120",
         "--set", "checkpoint.every=120"])
    ckpt = os.path.join(rundir, "checkpoints")
    alphabet = set(open(GPL, "rb").read())

    def sample(*extra, expect=0):
        cmd = [args.loom, "sample", ckpt] + list(extra)
        print("$ " + " ".join(cmd), flush=True)
        p = subprocess.run(cmd, capture_output=True, timeout=600)  # bytes: a sample need not be UTF-8
        if p.returncode != expect:
            raise SystemExit("FAIL: exit %d, expected %d: %s" % (p.returncode, expect, p.stderr.decode(errors="replace")))
        out = p.stdout[:-1] if p.stdout.endswith(b"\n") else p.stdout
        return out, p.stderr.decode(errors="replace")

    prompt = b"The GNU General"
    text, err = sample("--prompt", prompt.decode(), "--steps", "200", "--seed", "5")
    print(err.strip())
    print("sample: %r" % text)
    if not text.startswith(prompt) or len(text) != len(prompt) + 200:
        c.failures.append("sample: not the prompt followed by 200 bytes (%d bytes)" % len(text))
    outside = sorted(set(text) - alphabet)
    if outside:
        c.failures.append("sample: bytes that never occur in the training text: %s" % outside)
    again, _ = sample("--prompt", prompt.decode(), "--steps", "200", "--seed", "5")
    other, _ = sample("--prompt", prompt.decode(), "--steps", "200", "--seed", "6")
    if again != text:
        c.failures.append("sample: the same seed gave another text")
    if other == text:
        c.failures.append("sample: another seed gave the same text")
    g1, _ = sample("--prompt", "the ", "--steps", "40", "--temperature", "0")
    g2, _ = sample("--prompt", "the ", "--steps", "40", "--temperature", "0", "--seed", "9")
    print("greedy: %r" % g1)
    if g1 != g2:
        c.failures.append("greedy sampling depends on the seed")
    # Token ids in, the same bytes out as the prompt; and an llm.c tokenizer file that maps every id to
    # its byte decodes exactly that text.
    ids = ",".join(str(b) for b in b"The ")
    by_ids, _ = sample("--tokens", ids, "--steps", "30", "--seed", "5", "--top-k", "10")
    by_prompt, _ = sample("--prompt", "The ", "--steps", "30", "--seed", "5", "--top-k", "10")
    if by_ids != by_prompt:
        c.failures.append("--tokens %s and --prompt 'The ' differ: %r, %r" % (ids, by_ids, by_prompt))
    tok = os.path.join(c.dir, "bytes_tokenizer.bin")
    with open(tok, "wb") as f:
        f.write(struct.pack("<256I", 20240328, 2, 256, 0, *([0] * 252)))
        for b in range(256):
            f.write(bytes([1, b]))
    decoded, _ = sample("--tokens", ids, "--steps", "30", "--seed", "5", "--top-k", "10", "--tokenizer", tok)
    if decoded != by_ids:
        c.failures.append("the tokenizer file decodes %r, the byte vocabulary %r" % (decoded, by_ids))
    _, err = sample("--tokens", "65,300", expect=2)
    if "300" not in err or "[0, 255]" not in err:
        c.failures.append("an id past the vocabulary is not refused by name: " + err)
    # Another vocabulary: ids, the prompt's first, then " | ", then the generated ones, each in range.
    p, small = c.loom("small", 1, ["checkpoint.every=1"])
    q = run([args.loom, "sample", os.path.join(small, "checkpoints"), "--tokens", "1,2,3", "--steps", "5"])
    words = q.stdout.split()
    print("vocab 200: " + q.stdout.strip())
    if len(words) != 9 or words[:4] != ["1", "2", "3", "|"] or not all(0 <= int(w) < 200 for w in words[4:]):
        c.failures.append("vocab 200: expected '1 2 3 | ' and 5 ids below 200: %r" % q.stdout)
    _, err = sample("--prompt", "x", expect=0)  # the quickstart's byte vocabulary takes text
    p = run([args.loom, "sample", os.path.join(small, "checkpoints"), "--prompt", "abc"], expect=2)
    if "--tokens" not in p.stderr:
        c.failures.append("--prompt on a non-byte vocabulary is not refused pointing at --tokens: " + p.stderr)


def main():
    args = common.case_arguments(__doc__)
    case = {"oracle_file_same_loss": case_oracle_file_same_loss, "roundtrip_bitwise": case_roundtrip_bitwise,
            "refusals": case_refusals, "sample_quickstart": case_sample_quickstart}[args.case]
    c = common.Case(args, args.case, DECK)
    case(args, c)
    return common.finish(c.failures)


if __name__ == "__main__":
    sys.exit(main())
