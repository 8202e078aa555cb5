#!/usr/bin/python3
"""Hugging Face's GPT-2 files in and out of loom (`loom ckpt hf`, model.init_from = DIR).

    /usr/bin/python3 regression/hf_gpt2_checks.py --loom build/loom --workdir build/hf-gpt2-checks CASE

  roundtrip_bitwise   a GPT-2 checkpoint -> `loom ckpt hf` -> model.init_from = DIR: the weights loom starts
                      from equal the checkpoint's bit for bit, on one process (export's /params/init) and at
                      tp 2, pp 2 and ZeRO-3 dp 2 (a step at lr 0, whose checkpoint holds the weights read);
                      each layout's first loss within 1e-5 relative of one process's.
  transformers_loss   the files read by this script's own safetensors reader (below), the names mapped as
                      transformers' GPT2LMHeadModel has them (Conv1D: y = x W + b, W [in, out]), the forward
                      written here as transformers' modeling_gpt2 computes it (gelu_new, scores / sqrt(hs),
                      tied head), in float64. The writer: its loss on step 4's batch equals loom's own step-4
                      loss on the weights the files were written from within 1e-5 relative; the same files
                      read as torch.nn.Linear ([out, in], a missing transpose) must miss by more than ten
                      times that. The reader: loom started from the files gives its loss on the first batch.
  file_variants       files transformers or others write that loom must read: BF16 and F16 tensors (loom's
                      loss equals this script's forward on the same rounded weights within 1e-5), and the
                      Hub's layout (names without "transformer.", an explicit lm_head.weight equal to wte):
                      the weights bit for bit; `--tokenizer` copies a SentencePiece model byte for byte
                      beside a tokenizer_config.json naming its own special pieces.
  refusals            model.init_from = DIR with config.json's n_head other than the deck's, under a Llama
                      deck, a missing tensor, a truncated model.safetensors, an erf GELU, an lm_head that is
                      not wte; `--tokenizer` of a file that is not a SentencePiece model, and of one with more
                      pieces than the vocabulary: exit 2, the file and the key named.
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

DECK = common.SMALL_GPT2_DECK
TOLERANCE = 1e-5  # float32 loom against the float64 forward: ~1e-7 seen; a layout's reduction order too


run = common.run_checked


DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_safetensors(path):
    """name -> float64 tensor: the 8-byte header length, the JSON header, the row-major data."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        flat = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=DTYPES[t["dtype"]])
        out[name] = flat.reshape(t["shape"]).to(torch.float64)
    return out


def write_safetensors(path, tensors, dtype="F32"):
    """name -> tensor written as `dtype` (what transformers' save_pretrained writes, in any order)."""
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        b = t.to(DTYPES[dtype]).contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def gpt2_loss(t, config, inputs, targets, conv1d=True):
    """GPT2LMHeadModel's forward as transformers' modeling_gpt2 writes it (float64), mean cross-entropy.
    conv1d=False reads each product weight as torch.nn.Linear's [out, in] (the defect the check guards)."""
    F = torch.nn.functional
    C, NH, L, eps = config["n_embd"], config["n_head"], config["n_layer"], config["layer_norm_epsilon"]
    hs = C // NH
    idx, tgt = torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(targets.astype(np.int64))
    B, S = idx.shape

    def conv(x, p):  # transformers' Conv1D: addmm(bias, x, weight) with weight [nx, nf]
        w = t[p + ".weight"]
        return x @ (w if conv1d else w.reshape(w.shape[1], w.shape[0]).T) + t[p + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1.0 + torch.tanh((2.0 / torch.pi) ** 0.5 * (x + 0.044715 * x.pow(3))))

    def ln(x, p):
        return F.layer_norm(x, (C,), t[p + ".weight"], t[p + ".bias"], eps)

    x = t["transformer.wte.weight"][idx] + t["transformer.wpe.weight"][:S]
    mask = torch.full((S, S), float("-inf"), dtype=torch.float64).triu(1)
    for l in range(L):
        p = "transformer.h.%d." % l
        q, k, v = conv(ln(x, p + "ln_1"), p + "attn.c_attn").split(C, dim=-1)
        q, k, v = (a.view(B, S, NH, hs).transpose(1, 2) for a in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / hs ** 0.5 + mask, dim=-1)
        x = x + conv((att @ v).transpose(1, 2).reshape(B, S, C), p + "attn.c_proj")
        x = x + conv(gelu_new(conv(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    x = ln(x, "transformer.ln_f")
    logits = x @ t.get("lm_head.weight", t["transformer.wte.weight"]).T  # tied: the token table
    return float(F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1)))


def trained_hf(c, tag, sets, tokenizer=None, expect=0):
    """A 3-step checkpoint of the case's deck with `sets`, and its Hugging Face folder."""
    p, rundir = c.loom(tag, 1, sets + ["train.steps=3", "checkpoint.every=3"])
    ckpt = os.path.join(rundir, "checkpoints", "ckpt-00000003.h5")
    out = os.path.join(c.dir, tag + "-hf")
    print(run([c.args.loom, "ckpt", "hf", ckpt, out] + (["--tokenizer", tokenizer] if tokenizer else []),
              expect).stdout.strip())
    return ckpt, out


def export(c, tag, sets, step=0):
    """loom export from the deck with `sets`: (/params/init, step `step`'s batch, loom's loss on it)."""
    h5 = os.path.join(c.dir, tag + ".h5")
    run([c.args.loom, "export", c.deck, h5, "--set", "run.dir=" + os.path.join(c.dir, tag + "-run")]
        + sum((["--set", s] for s in sets), []))
    with h5py.File(h5, "r") as f:
        params = {n: f["params/init"][n][()] for n in f["params/init"]}
        return params, f["batches/inputs"][()][step], f["batches/targets"][()][step], float(f["metrics/loss"][step])


def bitwise_differences(a, b):
    return [n for n in a if n not in b or not np.array_equal(a[n].view(np.uint32), b[n].view(np.uint32))]


def checkpoint_params(path):
    with h5py.File(path, "r") as f:
        return {n: f["params"][n][()] for n in f["params"]}


def case_roundtrip_bitwise(args, c):
    ckpt, hf = trained_hf(c, "trained", [])
    original = checkpoint_params(ckpt)
    params, _, _, one_loss = export(c, "one", ["model.init_from=" + hf])
    differ = bitwise_differences(original, params)
    print("one process: %d tensors through Hugging Face's files; bitwise different: %s" % (len(original), differ))
    if differ or len(original) != 2 + 12 * 2 + 2:
        c.failures.append("one process: round trip not bit for bit: %s (%d tensors)" % (differ, len(original)))
    for tag, sets in (("tp2", ["parallel.tp=2"]), ("pp2", ["parallel.pp=2"]),
                      ("zero3_dp2", ["parallel.dp=2", "zero.stage=3"])):
        # lr 0: the step's checkpoint holds the weights the run started from, gathered from every rank.
        p, rundir = c.loom(tag, 2, sets + ["model.init_from=" + hf, "train.lr=0", "checkpoint.every=1"])
        differ = bitwise_differences(original, checkpoint_params(
            os.path.join(rundir, "checkpoints", "ckpt-00000001.h5")))
        loss = common.rows(rundir)[0]["loss"]
        rel = abs(loss - one_loss) / one_loss
        print("%s from the files: bitwise different tensors %s; first loss %.12g (%.2e relative to one process)"
              % (tag, differ, loss, rel))
        if differ:
            c.failures.append("%s: weights read are not the checkpoint's: %s" % (tag, differ))
        if rel > TOLERANCE:
            c.failures.append("%s: first loss %.12g, one process %.12g" % (tag, loss, one_loss))


def case_transformers_loss(args, c):
    # A large learning rate, so that every tensor has moved from its start (biases from 0, LayerNorm from 1).
    sets = ["train.lr=3e-2", "train.steps=4"]
    # loom's own loss on its step-3 weights: step 4 of the run whose checkpoint at 3 goes out (no file read).
    _, rundir = c.loom("trained", 1, sets + ["checkpoint.every=3"])
    own_loss = c.losses(rundir)[4]
    ckpt = os.path.join(rundir, "checkpoints", "ckpt-00000003.h5")
    hf = os.path.join(c.dir, "trained-hf")
    print(run([c.args.loom, "ckpt", "hf", ckpt, hf]).stdout.strip())
    config = json.load(open(os.path.join(hf, "config.json")))
    print("config.json: " + json.dumps({k: config[k] for k in ("architectures", "n_embd", "n_layer", "n_head",
                                                               "n_positions", "vocab_size", "activation_function",
                                                               "layer_norm_epsilon", "tie_word_embeddings")}))
    tensors = read_safetensors(os.path.join(hf, "model.safetensors"))
    if "lm_head.weight" in tensors:
        c.failures.append("model.safetensors holds lm_head.weight; save_pretrained leaves the tied head out")
    # The writer: step 4's batch (the data are a function of the seed alone), through the files only here.
    _, inputs, targets, _ = export(c, "batches", sets, step=3)
    ref = gpt2_loss(tensors, config, inputs, targets)
    rel = abs(own_loss - ref) / abs(ref)
    print("loom's loss on its own weights (step 4) %.12g, transformers' GPT-2 forward on the files (float64, this "
          "script) %.12g: %.2e relative" % (own_loss, ref, rel))
    if rel > TOLERANCE:
        c.failures.append("writer: loom %.12g vs transformers' GPT-2 %.12g (%.2e relative)" % (own_loss, ref, rel))
    wrong = gpt2_loss(tensors, config, inputs, targets, conv1d=False)
    print("the same files read as [out, in] (no Conv1D transpose, the defect guarded): %.12g (%.2e relative)"
          % (wrong, abs(wrong - own_loss) / abs(own_loss)))
    if abs(wrong - own_loss) <= 10 * TOLERANCE * abs(own_loss):
        c.failures.append("the Conv1D layout makes no difference: the check cannot see it")
    # The reader: loom started from the files, on its first batch.
    _, inputs, targets, loom_loss = export(c, "from-hf", ["model.init_from=" + hf])
    ref = gpt2_loss(tensors, config, inputs, targets)
    rel = abs(loom_loss - ref) / abs(ref)
    print("loom's loss from the files (step 1) %.12g, transformers' GPT-2 forward %.12g: %.2e relative"
          % (loom_loss, ref, rel))
    if rel > TOLERANCE:
        c.failures.append("reader: loom %.12g vs transformers' GPT-2 %.12g (%.2e relative)" % (loom_loss, ref, rel))


def sentencepiece_model(pieces):
    """A minimal SentencePiece ModelProto: field 1 per piece {1: text, 2: score, 3: type}, then an
    empty trainer_spec (field 2), as spm_train serialises them."""
    def varint(n):
        out = b""
        while True:
            out += bytes([(n & 0x7f) | (0x80 if n > 0x7f else 0)])
            n >>= 7
            if not n:
                return out
    body = b""
    for text, kind in pieces:
        p = text.encode()
        inner = b"\x0a" + varint(len(p)) + p + b"\x15" + struct.pack("<f", 0.0) + b"\x18" + varint(kind)
        body += b"\x0a" + varint(len(inner)) + inner
    return body + b"\x12\x00"


def case_file_variants(args, c):
    ckpt, hf = trained_hf(c, "trained", ["train.lr=3e-2"])
    config = json.load(open(os.path.join(hf, "config.json")))
    tensors = read_safetensors(os.path.join(hf, "model.safetensors"))
    original = checkpoint_params(ckpt)
    for dtype in ("BF16", "F16"):
        d = os.path.join(c.dir, dtype.lower())
        os.makedirs(d, exist_ok=True)
        shutil.copy(os.path.join(hf, "config.json"), d)
        write_safetensors(os.path.join(d, "model.safetensors"), tensors, dtype)
        rounded = read_safetensors(os.path.join(d, "model.safetensors"))
        _, inputs, targets, loom_loss = export(c, dtype, ["model.init_from=" + d])
        ref = gpt2_loss(rounded, config, inputs, targets)
        rel = abs(loom_loss - ref) / abs(ref)
        print("%s file: loom's loss %.12g, this script's forward on the same %s weights %.12g: %.2e relative"
              % (dtype, loom_loss, dtype, ref, rel))
        if rel > TOLERANCE:
            c.failures.append("%s: loom %.12g vs %.12g (%.2e relative)" % (dtype, loom_loss, ref, rel))
    hub = os.path.join(c.dir, "hub")
    os.makedirs(hub, exist_ok=True)
    shutil.copy(os.path.join(hf, "config.json"), hub)
    renamed = {n[len("transformer."):]: t for n, t in tensors.items()}
    renamed["lm_head.weight"] = tensors["transformer.wte.weight"]
    write_safetensors(os.path.join(hub, "model.safetensors"), dict(reversed(list(renamed.items()))))
    params, _, _, _ = export(c, "hub", ["model.init_from=" + hub])
    differ = bitwise_differences(original, params)
    print("the Hub's layout (no \"transformer.\", lm_head.weight = wte, reversed order): bitwise different: %s"
          % differ)
    if differ:
        c.failures.append("the Hub's layout: weights differ: %s" % differ)
    spm = os.path.join(c.dir, "tok.model")
    pieces = [("<unk>", 2), ("<s>", 3), ("</s>", 3)] + [("\u2581t%d" % i, 1) for i in range(60)]
    open(spm, "wb").write(sentencepiece_model(pieces))
    p = run([args.loom, "ckpt", "hf", ckpt, os.path.join(c.dir, "tok-hf"), "--tokenizer", spm])
    print(p.stdout.strip())
    same = open(spm, "rb").read() == open(os.path.join(c.dir, "tok-hf", "tokenizer.model"), "rb").read()
    tc = json.load(open(os.path.join(c.dir, "tok-hf", "tokenizer_config.json")))
    print("tokenizer.model the same bytes: %s; tokenizer_config.json: %s" % (same, json.dumps(tc, sort_keys=True)))
    want = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
            "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    if not same or any(tc.get(k) != v for k, v in want.items()):
        c.failures.append("--tokenizer: copied %s, tokenizer_config.json %s" % (same, tc))


def case_refusals(args, c):
    ckpt, hf = trained_hf(c, "good", [])
    st = open(os.path.join(hf, "model.safetensors"), "rb").read()
    tensors = read_safetensors(os.path.join(hf, "model.safetensors"))

    def variant(name, config_edit=None, data=None, tensor_edit=None):
        d = os.path.join(c.dir, name)
        os.makedirs(d, exist_ok=True)
        cfg = json.load(open(os.path.join(hf, "config.json")))
        cfg.update(config_edit or {})
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        if tensor_edit:
            t = dict(tensors)
            tensor_edit(t)
            write_safetensors(os.path.join(d, "model.safetensors"), t)
        else:
            open(os.path.join(d, "model.safetensors"), "wb").write(st if data is None else data)
        return d

    cases = [("other_n_head", [variant("heads8", {"n_head": 8})],
              ["model.heads = 4 in the deck, n_head = 8 in config.json"]),
             ("llama_deck", [hf, "model.arch=llama"], ["holds a Hugging Face GPT-2", "model.arch = llama"]),
             ("missing", [variant("missing", tensor_edit=lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))],
              ["model.safetensors", "has no tensor transformer.h.1.mlp.c_fc.bias"]),
             ("truncated", [variant("truncated", data=st[:len(st) // 2])], ["model.safetensors", "truncated"]),
             ("erf_gelu", [variant("gelu", {"activation_function": "gelu"})],
              ["config.json", "activation_function = \"gelu\"", "gelu_new"]),
             ("untied_head", [variant("untied", tensor_edit=lambda t: t.update(
                 {"lm_head.weight": t["transformer.wte.weight"] * 2}))],
              ["model.safetensors", "lm_head.weight differs", "wte.weight"])]
    for tag, sets, words in cases:
        p, _ = c.loom(tag, 1, ["model.init_from=" + sets[0]] + sets[1:], expect=2)
        msg = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        print("%s: %s" % (tag, msg))
        for w in words:
            if w not in p.stderr:
                c.failures.append("%s: the error does not say %r: %s" % (tag, w, msg))
    text = os.path.join(c.dir, "tok.vocab")
    open(text, "w").write("<unk>\t0\n<s>\t0\n")
    big = os.path.join(c.dir, "big.model")
    open(big, "wb").write(sentencepiece_model([("<unk>", 2)] + [("p%d" % i, 1) for i in range(300)]))
    for tag, tok, words in (("not_sentencepiece", text, ["tok.vocab", "not a SentencePiece model"]),
                            ("too_many_pieces", big, ["big.model", "301 pieces", "200 (model.vocab)"])):
        out = os.path.join(c.dir, tag + "-hf")
        p = run([args.loom, "ckpt", "hf", ckpt, out, "--tokenizer", tok], expect=2)
        print("%s: %s (DIR left unwritten: %s)" % (tag, p.stderr.strip(), not os.path.exists(out)))
        for w in words:
            if w not in p.stderr:
                c.failures.append("%s: the error does not say %r: %s" % (tag, w, p.stderr[-300:]))
        if os.path.exists(out):
            c.failures.append("%s: %s written before the refusal" % (tag, out))


def main():
    args = common.case_arguments(__doc__)
    case = {"roundtrip_bitwise": case_roundtrip_bitwise, "transformers_loss": case_transformers_loss,
            "file_variants": case_file_variants, "refusals": case_refusals}[args.case]
    c = common.Case(args, args.case, DECK)
    case(args, c)
    return common.finish(c.failures)


if __name__ == "__main__":
    sys.exit(main())
