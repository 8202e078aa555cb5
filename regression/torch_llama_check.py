#!/usr/bin/python3
"""Self-check of torch_gpt's Llama (the oracle's reference for model.arch = llama), without loom.

Usage: /usr/bin/python3 regression/torch_llama_check.py        exit 0 when every check passes, else 1

  (a) gradcheck   torch.autograd.gradcheck (float64) of one block written with torch_gpt's pieces:
                  rmsnorm, q/k/v, rotary, grouped-query attention (heads 4, kv_heads 2), proj, rmsnorm,
                  SwiGLU; w.r.t. the input and every weight.
  (b) attention   gqa_attention with kv_heads = heads equals plain multi-head attention written out
                  with an explicit lower-triangular mask, bit for bit; with kv_heads < heads (2 and 1)
                  query head g equals single-head attention on kv head g // (heads/kv_heads).
  (c) rotary      position 0 is the identity (bit for bit); every interleaved pair (2i, 2i+1) keeps
                  its norm at every other position; equals Meta's complex form (pairs as complex
                  numbers times e^(i t theta^(-2i/hs))).
  (e) whole model Llama's loss (untied, tied; kv_heads 2 and 1, a given ffn_hidden and the default
                  one) equals an independent numpy forward written per token and per head; its
                  gradient of one element of every tensor equals that forward's central difference;
                  names and shapes are param_names'; weight decay goes to exactly the matrices; with
                  bf16 operands every product (7 per block and the head) rounds.
  (d) planted     each defect is put into torch_gpt for one run of the checks above and must be caught:
                  rotary on the pairs (i, i + hs/2), kv head g % kv_heads instead of g // (heads/kv_heads),
                  RMSNorm's eps outside the square root. Each prints the loss it moves and the checks
                  that fail.
"""
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt as tg  # noqa: E402

torch.set_num_threads(1)
DT = torch.float64
CFGS = [  # the models (e) compares with the numpy forward
    dict(arch="llama", layers=2, d_model=16, heads=4, kv_heads=2, seq_len=6, vocab=11, ffn_hidden=24),
    dict(arch="llama", layers=1, d_model=16, heads=4, kv_heads=1, seq_len=5, vocab=13, ffn_hidden=0,
         tie_embeddings=True, norm_eps=1e-3, rope_theta=500.0),
]


def half_rotary(x, cos, sin):
    """Planted defect: rotate (i, i + hs/2) (the GPT-NeoX / HF 'rotate_half' layout)."""
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def modulo_gqa(q, k, v, mask_add=None, operand_dtype=None):
    """Planted defect: query head g reads kv head g % kv_heads."""
    rep = q.shape[1] // k.shape[1]
    return GOOD["gqa_attention"](q, k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1), mask_add, operand_dtype)


def eps_outside(x, weight, eps):
    """Planted defect: x / (sqrt(mean(x^2)) + eps) * weight."""
    return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * weight


GOOD = dict(apply_rotary=tg.apply_rotary, gqa_attention=tg.gqa_attention, rms_norm=tg.rms_norm)
DEFECTS = [("rotary on pairs (i, i+hs/2)", "apply_rotary", half_rotary),
           ("kv head g % kv_heads", "gqa_attention", modulo_gqa),
           ("rmsnorm eps outside the sqrt", "rms_norm", eps_outside)]


# ------------------------------------------------------------------------------------------------
# (a) gradcheck of the block composite
def block_fn(x, ln1, wq, wk, wv, wp, ln2, wg, wu, wd, NH=4, KV=2, eps=1e-5, theta=10000.0):
    B, T, C = x.shape
    hs = C // NH
    cos, sin = tg.rope_tables(T, hs, theta)
    h = tg.rms_norm(x, ln1, eps)
    q = tg.linear(h, wq).view(B, T, NH, hs).transpose(1, 2)
    k = tg.linear(h, wk).view(B, T, KV, hs).transpose(1, 2)
    v = tg.linear(h, wv).view(B, T, KV, hs).transpose(1, 2)
    y = tg.gqa_attention(tg.apply_rotary(q, cos, sin), tg.apply_rotary(k, cos, sin), v)
    x = x + tg.linear(y.transpose(1, 2).reshape(B, T, C), wp)
    h2 = tg.rms_norm(x, ln2, eps)
    return x + tg.linear(F.silu(tg.linear(h2, wg)) * tg.linear(h2, wu), wd)


def check_gradcheck():
    g = torch.Generator().manual_seed(1)
    B, T, C, NH, KV, Fh = 2, 5, 16, 4, 2, 12  # hs 4: two rotary pairs per head
    hs = C // NH

    def r(*s, scale=0.3):
        return (torch.randn(*s, generator=g, dtype=DT) * scale).requires_grad_()
    args = (r(B, T, C, scale=1.0), 1 + r(C), r(NH * hs, C), r(KV * hs, C), r(KV * hs, C), r(C, NH * hs),
            1 + r(C), r(Fh, C), r(Fh, C), r(C, Fh))
    args = tuple(a.detach().requires_grad_() for a in args)
    ok = torch.autograd.gradcheck(lambda *a: block_fn(*a, NH=NH, KV=KV), args, eps=1e-6, atol=1e-8,
                                  rtol=1e-6, raise_exception=False)
    return [("(a) gradcheck: rmsnorm+q/k/v+rotary+GQA(4/2)+proj+rmsnorm+SwiGLU, float64", "", ok)]


# ------------------------------------------------------------------------------------------------
# (b) attention
def plain_mha(q, k, v):
    """Causal multi-head attention written out: one score matrix per head, tril mask, softmax."""
    T, hs = q.shape[-2], q.shape[-1]
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hs)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v)


def check_attention():
    g = torch.Generator().manual_seed(2)
    B, NH, T, hs = 2, 4, 7, 4
    q = torch.randn(B, NH, T, hs, generator=g, dtype=DT)
    rows = []
    k = torch.randn(B, NH, T, hs, generator=g, dtype=DT)
    v = torch.randn(B, NH, T, hs, generator=g, dtype=DT)
    d = float((tg.gqa_attention(q, k, v) - plain_mha(q, k, v)).abs().max())
    rows.append(("(b) kv_heads = heads: gqa_attention vs plain MHA, max|d|", f"{d:.3g}", d < 1e-14))
    for KV in (2, 1):
        k = torch.randn(B, KV, T, hs, generator=g, dtype=DT)
        v = torch.randn(B, KV, T, hs, generator=g, dtype=DT)
        y = tg.gqa_attention(q, k, v)
        d = max(float((y[:, h:h + 1] - plain_mha(q[:, h:h + 1], k[:, h // (NH // KV)][:, None],
                                                 v[:, h // (NH // KV)][:, None])).abs().max())
                for h in range(NH))
        rows.append((f"(b) heads 4 kv_heads {KV}: head g vs MHA on kv head g//{NH // KV}, max|d|", f"{d:.3g}",
                     d < 1e-14))
    return rows


# ------------------------------------------------------------------------------------------------
# (c) rotary
def check_rotary():
    g = torch.Generator().manual_seed(3)
    T, hs, theta = 9, 8, 10000.0
    x = torch.randn(3, T, hs, generator=g, dtype=DT)
    cos, sin = tg.rope_tables(T, hs, theta)
    y = tg.apply_rotary(x, cos, sin)
    rows = [("(c) rotary at position 0 is the identity (bit for bit)", "", bool(torch.equal(y[:, 0], x[:, 0])))]
    pn = lambda z: z[..., 0::2] ** 2 + z[..., 1::2] ** 2  # noqa: E731
    d = float(((pn(y) - pn(x)).abs() / pn(x)).max())
    moved = float((y[:, 1:] - x[:, 1:]).abs().min(dim=-1).values.min())
    rows.append(("(c) rotary keeps every pair (2i, 2i+1)'s norm, max rel d", f"{d:.3g}", d < 1e-13 and moved > 0))
    freqs = theta ** (-torch.arange(0, hs, 2, dtype=DT) / hs)
    rot = torch.polar(torch.ones(T, hs // 2, dtype=DT), torch.arange(T, dtype=DT)[:, None] * freqs)
    meta = torch.view_as_real(torch.view_as_complex(x.reshape(3, T, hs // 2, 2).contiguous()) * rot).flatten(-2)
    d = float((y - meta).abs().max())
    rows.append(("(c) rotary equals the complex form x_pair * e^(i t theta^(-2i/hs)), max|d|", f"{d:.3g}", d < 1e-14))
    return rows


# ------------------------------------------------------------------------------------------------
# (e) the whole model against a numpy forward written per token and per head
def numpy_loss(cfg, P, idx, tgt):
    lc = tg.llama_config(cfg)
    L, C, NH = cfg["layers"], cfg["d_model"], cfg["heads"]
    KV, eps, theta = lc["kv_heads"], lc["norm_eps"], lc["rope_theta"]
    hs, rep = C // NH, NH // KV
    B, T = idx.shape

    def rms(x, w):
        return x / math.sqrt(float(np.mean(x * x)) + eps) * w

    def rope(vec, t):
        out = vec.copy()
        for h in range(len(vec) // hs):
            for i in range(hs // 2):
                a, b = vec[h * hs + 2 * i], vec[h * hs + 2 * i + 1]
                ang = t * theta ** (-2.0 * i / hs)
                out[h * hs + 2 * i] = a * math.cos(ang) - b * math.sin(ang)
                out[h * hs + 2 * i + 1] = a * math.sin(ang) + b * math.cos(ang)
        return out
    total = 0.0
    for bi in range(B):
        xs = [P["wte.weight"][idx[bi, t]].copy() for t in range(T)]
        for l in range(L):
            w = lambda n: P[f"blocks.{l}.{n}.weight"]  # noqa: E731
            hs_ = [rms(x, w("ln1")) for x in xs]
            qs = [rope(w("attn.q") @ h, t) for t, h in enumerate(hs_)]
            ks = [rope(w("attn.k") @ h, t) for t, h in enumerate(hs_)]
            vs = [w("attn.v") @ h for h in hs_]
            for t in range(T):
                y = np.zeros(NH * hs)
                for g in range(NH):
                    j = g // rep
                    q = qs[t][g * hs:(g + 1) * hs]
                    sc = [float(q @ ks[s][j * hs:(j + 1) * hs]) / math.sqrt(hs) for s in range(t + 1)]
                    m = max(sc)
                    e = [math.exp(z - m) for z in sc]
                    y[g * hs:(g + 1) * hs] = sum(e[s] / sum(e) * vs[s][j * hs:(j + 1) * hs] for s in range(t + 1))
                xs[t] = xs[t] + w("attn.proj") @ y
            for t in range(T):
                h = rms(xs[t], w("ln2"))
                a = w("mlp.gate") @ h
                xs[t] = xs[t] + w("mlp.down") @ (a / (1.0 + np.exp(-a)) * (w("mlp.up") @ h))
        head = P["wte.weight"] if lc["tie_embeddings"] else P["lm_head.weight"]
        for t in range(T):
            z = head @ rms(xs[t], P["ln_f.weight"])
            m = float(z.max())
            total += m + math.log(float(np.exp(z - m).sum())) - float(z[tgt[bi, t]])
    return total / (B * T)


def check_model(cfg, tag):
    torch.manual_seed(4)
    m = tg.build_model(cfg, DT)
    with torch.no_grad():  # not the init's exact ones: norm weights that matter
        for n, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.1))
    g = torch.Generator().manual_seed(5)
    B, T, V = 2, cfg["seq_len"], cfg["vocab"]
    idx = torch.randint(0, V, (B, T), generator=g)
    tgt = torch.randint(0, V, (B, T), generator=g)
    _, loss = m(idx, tgt)
    loss.backward()
    P = {n: p.detach().numpy().copy() for n, p in m.named_parameters()}
    ref = numpy_loss(cfg, P, idx.numpy(), tgt.numpy())
    d = abs(float(loss) - ref) / ref
    rows = [(f"(e) {tag}: loss vs numpy forward (rel)", f"{float(loss):.12g} vs {ref:.12g}", d < 1e-13)]
    worst, h = 0.0, 1e-5
    for n, p in m.named_parameters():
        i = int(torch.argmax(p.grad.abs()))
        a = P[n].reshape(-1)
        keep = a[i]
        a[i] = keep + h
        up = numpy_loss(cfg, P, idx.numpy(), tgt.numpy())
        a[i] = keep - h
        dn = numpy_loss(cfg, P, idx.numpy(), tgt.numpy())
        a[i] = keep
        fd, ag = (up - dn) / (2 * h), float(p.grad.reshape(-1)[i])
        worst = max(worst, abs(fd - ag) / max(abs(ag), 1e-12))
    rows.append((f"(e) {tag}: largest grad of every tensor vs central difference (rel)", f"{worst:.3g}",
                 worst < 1e-6))
    return rows, float(loss)


def check_structure():
    rows = []
    for cfg in CFGS + [dict(CFGS[0], kv_heads=0, ffn_hidden=0)]:
        m = tg.build_model(cfg, DT)
        lc = tg.llama_config(cfg)
        C, NH, KV = cfg["d_model"], cfg["heads"], lc["kv_heads"]
        Fh, V, hs = lc["ffn_hidden"], cfg["vocab"], cfg["d_model"] // cfg["heads"]
        want = {"wte.weight": (V, C), "ln_f.weight": (C,), "lm_head.weight": (V, C)}
        for l in range(cfg["layers"]):
            want.update({f"blocks.{l}.ln1.weight": (C,), f"blocks.{l}.attn.q.weight": (NH * hs, C),
                         f"blocks.{l}.attn.k.weight": (KV * hs, C), f"blocks.{l}.attn.v.weight": (KV * hs, C),
                         f"blocks.{l}.attn.proj.weight": (C, NH * hs), f"blocks.{l}.ln2.weight": (C,),
                         f"blocks.{l}.mlp.gate.weight": (Fh, C), f"blocks.{l}.mlp.up.weight": (Fh, C),
                         f"blocks.{l}.mlp.down.weight": (C, Fh)})
        got = [(n, tuple(p.shape)) for n, p in m.named_parameters()]
        ok = [n for n, _ in got] == tg.param_names(cfg) and all(want[n] == s for n, s in got)
        ok = ok and (("lm_head.weight" in dict(got)) != lc["tie_embeddings"])
        dec = {id(p) for p in tg.param_groups(m, 0.1)[0]["params"]}
        mats = {n for n, p in m.named_parameters() if id(p) in dec}
        ok = ok and mats == {n for n in dict(got) if not n.endswith(("ln1.weight", "ln2.weight", "ln_f.weight"))}
        calls = [0]
        orig = tg._RoundedOperandsLinear.apply

        def counting(*a):
            calls[0] += 1
            return orig(*a)
        tg._RoundedOperandsLinear.apply = counting
        try:
            tg.set_operand_dtype(m, torch.bfloat16)
            m(torch.zeros(1, 3, dtype=torch.long))
        finally:
            tg._RoundedOperandsLinear.apply = orig
        ok = ok and calls[0] == 7 * cfg["layers"] + 1
        rows.append((f"(e) kv_heads {KV} F {Fh} {'tied' if lc['tie_embeddings'] else 'untied'}: names, shapes, "
                     f"decay on matrices, bf16 products", f"{calls[0]} rounded products", ok))
    rows.append(("(e) llama_ffn_hidden: C 64 -> 256, 4096 -> 11008, 96 -> 256, given 24 -> 24",
                 "", [tg.llama_ffn_hidden(c, f) for c, f in ((64, 0), (4096, 0), (96, 0), (16, 24))]
                 == [256, 11008, 256, 24]))
    return rows


def run_all(verbose=True):
    rows = check_gradcheck() + check_attention() + check_rotary()
    losses = []
    for i, cfg in enumerate(CFGS):
        r, loss = check_model(cfg, f"model {i} (kv_heads {cfg['kv_heads']}, "
                                   f"{'tied' if cfg.get('tie_embeddings') else 'untied'})")
        rows += r
        losses.append(loss)
    rows += check_structure()
    if verbose:
        for name, obs, ok in rows:
            print(f"  {'PASS' if ok else 'FAIL'}  {name}" + (f": {obs}" if obs else ""))
    return rows, losses


def main():
    print(f"torch {torch.__version__}: torch_gpt.Llama self-check")
    rows, losses = run_all()
    ok = all(r[2] for r in rows)
    for label, fn_name, bad in DEFECTS:
        setattr(tg, fn_name, bad)
        try:
            drows, dlosses = run_all(verbose=False)
        finally:
            setattr(tg, fn_name, GOOD[fn_name])
        failed = [r[0] for r in drows if not r[2]]
        moved = max(abs(a - b) / abs(b) for a, b in zip(dlosses, losses))
        caught = bool(failed) and moved > 0
        print(f"  {'PASS' if caught else 'FAIL'}  (d) planted defect '{label}': loss moved {moved:.3g} (rel); "
              f"{len(failed)} checks fail" + "".join(f"\n          fails: {f}" for f in failed))
        ok = ok and caught
    print("torch_llama_check: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
