#!/usr/bin/python3
"""Hugging Face's Llama files in and out of loom (`loom ckpt hf`, model.init_from = DIR).

    /usr/bin/python3 regression/hf_llama_checks.py --loom build/loom --workdir build/hf-checks CASE

  roundtrip_bitwise   a Llama checkpoint -> `loom ckpt hf` -> model.init_from = DIR -> the weights loom
                      starts from (export's /params/init) equal the checkpoint's, bit for bit (grouped-query
                      with an untied head, and multi-query tied).
  transformers_loss   the files read by this script's own safetensors reader (below, 12 lines), the names
                      mapped as transformers' LlamaForCausalLM has them, and the forward written here as
                      transformers' modeling_llama computes it (rotate_half: channel pairs (i, i + hs/2),
                      repeat_kv), in float64: its loss on loom's first batch equals loom's loss from the same
                      files within 1e-5 relative. The same weights without loom's row permutation must miss
                      by more than ten times that (the check sees the convention it guards). loom from the files at tp 2, pp 2 and
                      ZeRO-3 dp 2 starts within 1e-5 of one process.
  refusals            model.init_from = DIR under a GPT-2 deck, with other kv heads (both named), a truncated
                      model.safetensors, a missing config.json, rope_scaling set: exit 2, named
                      (GPT-2's files: hf_gpt2_checks.py).
"""
import json
import os
import struct
import subprocess
import sys

import h5py
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

DECK = """[model]
arch = llama
layers = 2
d_model = 64
heads = 4
kv_heads = 2
seq_len = 32
vocab = 200
rope_theta = 500
[data]
source = synthetic
[train]
steps = 1
batch = 4
seed = 7
eval_every = 0
"""


run = common.run_checked


def read_safetensors(path):
    """name -> float64 array: the 8-byte header length, the JSON header, the row-major data."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", t["dtype"]
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + b:8 + n + e], dtype="<f4").reshape(t["shape"]).astype(np.float64)
    return out


def transformers_loss(t, config, inputs, targets):
    """LlamaForCausalLM's forward as transformers' modeling_llama writes it (float64), mean cross-entropy."""
    T = lambda a: torch.from_numpy(a)  # noqa: E731
    C, NH, KV = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hs, eps, L = C // NH, config["rms_norm_eps"], config["num_hidden_layers"]
    idx, tgt = torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(targets.astype(np.int64))
    B, S = idx.shape
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))
    freqs = torch.outer(torch.arange(S, dtype=torch.float64), inv_freq)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rotate_half(x):
        return torch.cat((-x[..., hs // 2:], x[..., :hs // 2]), dim=-1)

    x = T(t["model.embed_tokens.weight"])[idx]
    mask = torch.full((S, S), float("-inf"), dtype=torch.float64).triu(1)
    for l in range(L):
        p = "model.layers.%d." % l
        h = rms(x, T(t[p + "input_layernorm.weight"]))
        q = (h @ T(t[p + "self_attn.q_proj.weight"]).T).view(B, S, NH, hs).transpose(1, 2)
        k = (h @ T(t[p + "self_attn.k_proj.weight"]).T).view(B, S, KV, hs).transpose(1, 2)
        v = (h @ T(t[p + "self_attn.v_proj.weight"]).T).view(B, S, KV, hs).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(NH // KV, dim=1), v.repeat_interleave(NH // KV, dim=1)  # repeat_kv
        att = torch.softmax(q @ k.transpose(-1, -2) / hs ** 0.5 + mask, dim=-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, S, C) @ T(t[p + "self_attn.o_proj.weight"]).T
        h = rms(x, T(t[p + "post_attention_layernorm.weight"]))
        g, u = h @ T(t[p + "mlp.gate_proj.weight"]).T, h @ T(t[p + "mlp.up_proj.weight"]).T
        x = x + (torch.nn.functional.silu(g) * u) @ T(t[p + "mlp.down_proj.weight"]).T
    x = rms(x, T(t["model.norm.weight"]))
    head = t["model.embed_tokens.weight"] if config["tie_word_embeddings"] else t["lm_head.weight"]
    logits = x @ T(head).T
    return float(torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1)))


def trained_hf(c, tag, sets):
    """A 3-step checkpoint of the case's deck with `sets`, and its Hugging Face folder."""
    p, rundir = c.loom(tag, 1, sets + ["train.steps=3", "checkpoint.every=3"])
    ckpt = os.path.join(rundir, "checkpoints", "ckpt-00000003.h5")
    out = os.path.join(c.dir, tag + "-hf")
    print(run([c.args.loom, "ckpt", "hf", ckpt, out]).stdout.strip())
    return ckpt, out


def export(c, tag, sets):
    h5 = os.path.join(c.dir, tag + ".h5")
    run([c.args.loom, "export", c.deck, h5, "--set", "run.dir=" + os.path.join(c.dir, tag + "-run")]
        + sum((["--set", s] for s in sets), []))
    return h5


def case_roundtrip_bitwise(args, c):
    for tag, sets in (("gqa_untied", []), ("mqa_tied", ["model.kv_heads=1", "model.tie_embeddings=true"])):
        ckpt, hf = trained_hf(c, tag, sets)
        back = export(c, tag + "-back", sets + ["model.init_from=" + hf])
        with h5py.File(ckpt, "r") as a, h5py.File(back, "r") as b:
            names = list(a["params"])
            differ = [n for n in names if not np.array_equal(a["params"][n][()].view(np.uint32),
                                                             b["params/init"][n][()].view(np.uint32))]
        print("%s: %d tensors through Hugging Face's files; bitwise different: %s" % (tag, len(names), differ))
        if differ or len(names) < 2 + 9 * 2:
            c.failures.append("%s: round trip not bit for bit: %s (%d tensors)" % (tag, differ, len(names)))


def case_transformers_loss(args, c):
    # A large learning rate, so that q and k (and with them the rotary order) weigh in the scores.
    _, hf = trained_hf(c, "trained", ["train.lr=3e-2"])
    config = json.load(open(os.path.join(hf, "config.json")))
    tensors = read_safetensors(os.path.join(hf, "model.safetensors"))
    h5 = export(c, "from-hf", ["model.init_from=" + hf])
    with h5py.File(h5, "r") as f:
        B, S = int(f.attrs["batch"]), int(f.attrs["seq_len"])
        inputs = f["batches/inputs"][()][:B].reshape(B, S)
        targets = f["batches/targets"][()][:B].reshape(B, S)
        loom_loss = float(f["metrics/loss"][0])
    ref = transformers_loss(tensors, config, inputs, targets)
    rel = abs(loom_loss - ref) / abs(ref)
    print("loom's loss from the files %.12g, transformers' forward (float64, this script) %.12g: %.2e relative"
          % (loom_loss, ref, rel))
    if rel > 1e-5:
        c.failures.append("loom %.12g vs transformers' convention %.12g (%.2e relative)" % (loom_loss, ref, rel))
    # Loom's own order (no permutation) read with transformers' rotary must not reproduce it.
    unpermuted = dict(tensors)
    hs = config["hidden_size"] // config["num_attention_heads"]
    for name in tensors:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w = tensors[name]
            heads = w.shape[0] // hs
            unpermuted[name] = w.reshape(heads, 2, hs // 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)
    wrong = transformers_loss(unpermuted, config, inputs, targets)
    print("the same weights in loom's rotary order read as transformers' (the defect guarded): %.12g (%.2e relative)"
          % (wrong, abs(wrong - loom_loss) / abs(loom_loss)))
    if abs(wrong - loom_loss) <= 1e-4 * abs(loom_loss):  # ten times the tolerance above
        c.failures.append("the rotary permutation makes no difference: the check cannot see it")
    for tag, ranks, sets in (("tp2", 2, ["parallel.tp=2"]), ("pp2", 2, ["parallel.pp=2"]),
                             ("zero3_dp2", 2, ["parallel.dp=2", "zero.stage=3"])):
        p, rundir = c.loom(tag, ranks, sets + ["model.init_from=" + hf])
        loss = common.rows(rundir)[0]["loss"]
        print("%s from the files: first loss %.12g (%.2e relative to one process)" % (tag, loss, abs(loss - loom_loss) / loom_loss))
        if abs(loss - loom_loss) > 1e-5 * abs(loom_loss):
            c.failures.append("%s: first loss %.12g, one process %.12g" % (tag, loss, loom_loss))


def case_refusals(args, c):
    ckpt, hf = trained_hf(c, "good", [])
    st = open(os.path.join(hf, "model.safetensors"), "rb").read()
    trunc = os.path.join(c.dir, "truncated")
    os.makedirs(trunc, exist_ok=True)
    open(os.path.join(trunc, "model.safetensors"), "wb").write(st[:len(st) // 2])
    open(os.path.join(trunc, "config.json"), "w").write(open(os.path.join(hf, "config.json")).read())
    noconfig = os.path.join(c.dir, "noconfig")
    os.makedirs(noconfig, exist_ok=True)
    scaled = os.path.join(c.dir, "scaled")
    os.makedirs(scaled, exist_ok=True)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    json.dump(cfg, open(os.path.join(scaled, "config.json"), "w"))
    open(os.path.join(scaled, "model.safetensors"), "wb").write(st)
    cases = [("gpt2_deck", ["model.init_from=" + hf, "model.arch=gpt2", "model.kv_heads=0"],
              ["holds a Hugging Face Llama", "model.arch = gpt2"]),
             ("other_kv", ["model.init_from=" + hf, "model.kv_heads=1"],
              ["model.kv_heads = 1 in the deck, num_key_value_heads = 2 in config.json"]),
             ("truncated", ["model.init_from=" + trunc], ["model.safetensors", "truncated"]),
             ("no_config", ["model.init_from=" + noconfig], ["config.json", "cannot be read"]),
             ("rope_scaling", ["model.init_from=" + scaled], ["rope_scaling", "no scaling"])]
    for tag, sets, words in cases:
        p, _ = c.loom(tag, 1, sets, expect=2)
        msg = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        print("%s: %s" % (tag, msg))
        for w in words:
            if w not in p.stderr:
                c.failures.append("%s: the error does not say %r: %s" % (tag, w, msg))


def main():
    args = common.case_arguments(__doc__)
    case = {"roundtrip_bitwise": case_roundtrip_bitwise, "transformers_loss": case_transformers_loss,
            "refusals": case_refusals}[args.case]
    c = common.Case(args, args.case, DECK)
    case(args, c)
    return common.finish(c.failures)


if __name__ == "__main__":
    sys.exit(main())
