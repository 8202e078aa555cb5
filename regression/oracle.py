#!/usr/bin/python3
"""The PyTorch oracle: loom (float32, or bf16 with --dtype bf16) against independent PyTorch references.

Usage:
  /usr/bin/python3 regression/oracle.py --loom build/loom --deck regression/oracle.deck \
      --workdir build/oracle [--dtype fp32|bf16] [--set k=v ...] [--single] [--h5 FILE]

Runs `loom export DECK OUT.h5` (one process), reads the initial weights and the batches loom
trained on, and replays the same training in float64 PyTorch (regression/torch_gpt.py) with its own
AdamW, clipping and schedule. The architecture is the recorded deck's model.arch: gpt2 (also when
absent) or llama (torch_gpt.Llama, shaped by model.kv_heads, ffn_hidden, norm_eps, rope_theta and
tie_embeddings, each at its default when absent); the case header names it for llama. The
tolerances below were derived and measured on GPT-2. Only the initial weights and the token batches
are taken from loom; every other number is recomputed and compared with what loom recorded:
  loss       loss of every step                         vs /metrics/loss
  grads      every parameter's step-0 gradient          vs /grads/step0 (per tensor)
  grad_norm  global norm before clipping, every step    vs /metrics/grad_norm
  lr         lr_at(step) computed here, every step      vs /metrics/lr
  params     every parameter after the last step        vs /params/final
The deck is run twice so that both the clipped and the unclipped path are exercised: case A as
written (plus --set), case B with train.grad_clip=0 when A clipped on some step, otherwise with a
grad_clip of a quarter of A's smallest gradient norm (so clipping engages). --single: case A only.
--h5 FILE: check an existing export file instead of running loom (case A only).

--dtype bf16 (default fp32: the above) runs loom with --set precision.dtype=bf16 (given before the
user's --set, so a later --set precision.dtype=fp32 or fp16 checks that run against the bf16
references instead: it must fail) and checks it, on the same initial weights and batches, against:
  emulated   the float64 reference with every model matrix product's operands (input, weight,
             output gradient; forward and both backward products) rounded to bf16 as loom rounds
             them (torch_gpt.set_operand_dtype): all of the checks above, with tolerances for
             rounding-boundary flips, plus the share of the bf16 effect on the step-0 gradients
             (plain float64 vs emulated) that loom leaves unexplained: this row is what catches a
             missing rounding;
  autocast   a float32 torch model run under torch.autocast("cpu", dtype=torch.bfloat16) with the
             same AdamW, clipping and schedule: loss, step-0 gradients and grad_norm, with
             tolerances in units of bf16's u = 2^-8 (autocast also rounds outputs, attention and
             GELU, which loom keeps in float32).
Every row prints observed/tolerance; the tolerances and their derivation are in the comment blocks
below.
Exit status 0 when every check passes, 1 otherwise (also when loom fails or the file is malformed).
"""
import argparse
import math
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import torch_gpt  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Tolerances: float32 (loom) against float64 (reference). float32 has a unit roundoff of 6e-8; a
# reduction over n terms errs by ~sqrt(n)*6e-8 relative to the sum of magnitudes, and the oracle
# model's reductions have 64 to a few thousand terms (C=64, 4C=256, B*T=128 tokens, V=256), chained
# through 2 layers forward and backward: ~1e-6 relative. Observed on this deck: loom 0.1.0 (efbd975)
# loss 7e-9 rel, gradients 8.3e-7 of max|g|, grad_norm 7.5e-7 rel, final params 1.7e-7 on
# sign-stable elements (a float32 PyTorch run: 1e-7, 6.7e-7, 2e-7, 1.7e-7). Every run prints
# observed/tolerance for each check.
#
# LOSS_RTOL       1e-5: step-0 loss is a float32 forward pass (~1e-7 rel); later steps also carry the
#                 tiny trajectory difference described under PARAM_*.
# GRAD_RTOL/ATOL  per tensor: max|g_loom - g_ref| <= GRAD_RTOL * max|g_ref| + GRAD_ATOL, against
#                 each tensor's own largest element so LayerNorm and bias gradients are held to the
#                 same standard as the matrices. 3e-5 is ~45x the float32 PyTorch error; it is also
#                 the level that still catches the exact (erf) GELU in place of the tanh form, whose
#                 gradients differ by 5.6e-5 of max|g| at this init scale (wrong signs, scales,
#                 transposes or missing terms show up at >= 1e-3).
# NORM_RTOL       1e-5: the global gradient norm, every step (a sum of squares of ~10^5 gradients).
# LR_RTOL         1e-6: lr may be evaluated in float32 by loom (6e-8 relative); nothing more.
# PARAM_*         AdamW's first update is lr * g/(|g|+eps) ~ lr*sign(g): an element whose float32
#                 gradient is so small that its rounding error flips its sign (or that is below eps)
#                 legitimately moves by up to 2*lr per step in the other direction. Let
#                 BOUND = sum_t lr_t * r_t, r_t the Cauchy-Schwarz bound on |m_hat/sqrt(v_hat)| at
#                 step t (1 at t=1; torch_gpt.adam_update_bound): no element moves further than BOUND,
#                 so two runs end at most 2*BOUND apart. If every gradient of an element has a
#                 relative error <= d, its update errs by <= 2*d*r_t*lr_t per step (first order), so:
#                 (a) "sign-stable" elements, whose reference gradient is at every step at least
#                     STABLE_REL of its tensor's largest (so the tolerated gradient error is
#                     <= GRAD_RTOL/STABLE_REL of it and cannot flip it), must ALL be within
#                     TIGHT = 2*(GRAD_RTOL/STABLE_REL)*BOUND + PARAM_TIGHT_ABS (the abs term: float32
#                     storage of a weight of size ~1);
#                 (b) at least PARAM_FRACTION of the elements must be within LOOSE, the same bound for
#                     a gradient of LOOSE_REL of its tensor's largest, counting only elements whose
#                     reference gradient is not structurally zero (>= ZERO_REL of its tensor's largest
#                     at some step): the key bias's gradient is exactly zero (softmax is shift
#                     invariant), so in float32 it is pure rounding noise that AdamW may blow up to
#                     +-lr per step, and those 2*C elements alone are 0.1% of the oracle model;
#                 (c) every element must be within 2*BOUND + PARAM_TIGHT_ABS, the largest distance two
#                     AdamW runs can drift apart at all.
#                 Not detectable at this scale, honestly: weight decay (lr*wd*|p| ~ 1e-6 per step on
#                 0.02-sized weights, below float32 noise of the update) and the 1e-6 inside the clip
#                 coefficient (AdamW is invariant to a constant gradient scale). Clipping itself is
#                 visible: dropping it fails case A by 20x.
# ---------------------------------------------------------------------------------------------
LOSS_RTOL = 1e-5
GRAD_RTOL = 3e-5
GRAD_ATOL = 1e-7
NORM_RTOL = 1e-5
LR_RTOL = 1e-6
STABLE_REL = 1e-1
LOOSE_REL = 1e-2
ZERO_REL = 1e-9
PARAM_TIGHT_ABS = 1e-6
PARAM_FRACTION = 0.999

# ---------------------------------------------------------------------------------------------
# --dtype bf16: loom with precision.dtype = bf16 against two references on the same initial weights
# and batches. u = 2^-8 is bf16's unit roundoff (8 significant bits, round to nearest even).
#
# (a) "emulated": the float64 reference with every model matrix product's operands (input, weight,
#     output gradient; forward and both backward products, tied head included) rounded to bf16
#     exactly as loom does (torch_gpt.set_operand_dtype); biases, bias gradients (from the unrounded
#     output gradient) and everything else unrounded. The arithmetic is loom's: on a model small
#     enough that usually no operand lands near a rounding boundary (layers 1, d_model 16, heads 2,
#     seq_len 8, vocab 32, batch 2x1; 17 of train.seed 0..19) loom agrees with it to <= 2.8e-7 of
#     max|g|, loss <= 3e-8, norm <= 4.4e-7: float32 level, where unrounded arithmetic is 4e-3..8e-3 off.
#     What keeps the tolerances from being float32's: a bf16 operand whose float32 value (loom) and
#     float64 value (here) straddle a rounding boundary rounds one bf16 step (2u relative) apart, a
#     chance of about (float32 error)/(bf16 spacing) per element: measured 0 in 3*8192 LayerNorm
#     outputs, 2 in 32768 GELU outputs. One flip moves one of the K terms of a product output by 2u
#     of that term, i.e. by ~1/sqrt(K) of the output's own bf16 spacing (1/8 at K = 64), and each
#     output feeds further rounded operands, so every flip starts a cascade: counted on this deck
#     (torch float32 vs float64, same emulation, step 0) the first 2 flips, in layer 0's fc-proj
#     input, become 265 in layer 1's forward and ~7000 in backward, in 77 of the 128 token rows. An
#     infected token differs at the bf16 level itself, so loom vs emulated is not ~1e-6 but a
#     sizeable share of the whole bf16 effect. Measured on this deck over train.seed 1..12 (loom
#     0.1.0): step-0 gradients 1.4e-3..3.0e-3 of max|g| (an independent correct bf16 path, torch
#     float32 with the same emulation: 1.6e-3..3.3e-3), loss <= 2e-5 rel, grad_norm <= 3.3e-4 rel.
#     BF16_EMU_LOSS_RTOL   1e-4: an infected token's logits shift by <= u|z| (|z| <~ 1 at this init),
#                          its loss by <= 2u|z|; over B*T = 128 tokens of random sign that is
#                          <= 2u/sqrt(128)/ln(V) ~ 1.3e-4 relative. Observed 7e-6 (seed 7), <= 2e-5.
#     BF16_EMU_GRAD_RTOL   2u = 7.8e-3 of each tensor's max|g|: an infected contribution errs by <= u
#                          of its own size; x2 for the sums with cancellation (LayerNorm, biases).
#                          Observed 2.8e-3 (seed 7), <= 3.0e-3. This row catches gross faults (a
#                          transposed attn.proj gradient: 1.03); it does NOT catch a missing rounding
#                          (loom's fp32 path: 4.7e-3..7.0e-3, seed 7 6.7e-3).
#     BF16_EMU_EFFECT      0.45: the row that catches a wrong bf16 path. With E = the step-0 gradients
#                          of the plain (unrounded) float64 reference minus the emulated ones (the
#                          bf16 effect, |E| = 3.4e-3 |g| on this deck) and D = loom's minus the
#                          emulated ones (all tensors as one vector), |D|/|E| is the share of the bf16
#                          effect loom leaves unexplained: 0 without flips, 1 for unrounded
#                          arithmetic. Observed: correct loom <= 0.35 over train.seed 1..40 (0.348 at
#                          the deck's seed 7, the largest; the next 0.26), torch float32 emulation
#                          0.03..0.23. Simulated defects (torch float32 emulation with one rounding
#                          left out, seeds 1..12): weight unrounded 1.04..1.15, tied head unrounded
#                          0.78..0.84, input unrounded 0.57..0.70, output gradient unrounded
#                          0.42..0.51 (seed 7: 0.50, caught); input unrounded in dW only 0.34..0.40
#                          and the bias gradient summed from the rounded output gradient 0.27..0.33
#                          (seeds 1, 2, 7) are inside the flip noise: NOT detectable. loom's fp32
#                          export: 1.00 (2.2x over), its fp16: 1.01. If this row alone fails after a
#                          change to loom's float32 kernels only, the flips have moved: rerun with a
#                          few --set train.seed=N to see whether seed 7 has become an outlier.
#     BF16_EMU_NORM_RTOL   u/4 = 9.8e-4: the norm is dominated by the largest gradients, whose
#                          infected parts err by <= u with random signs. Observed 1.3e-4 (seed 7),
#                          <= 3.3e-4. The lr and parameter checks are fp32's (PARAM_* with
#                          BF16_EMU_GRAD_RTOL in place of GRAD_RTOL).
#     Neither the loss nor the norm tells bf16 from fp32 here (the logits are ~0.2 at this init:
#     rounding moves the loss by <= 3e-5 and the norm by <= 1e-3); only the gradients do.
# (b) "autocast": a float32 torch model whose forward runs under torch.autocast("cpu",
#     dtype=torch.bfloat16), backward following the dtypes it recorded; same AdamW, clipping and
#     schedule. Autocast rounds much more than loom: every product's output to bf16 (loom keeps
#     fp32), and on this torch (1.13, CPU) the attention scores, their softmax, att*v and the GELU
#     run in bf16 too; only the embeddings, the residual stream, the LayerNorms and the loss stay
#     float32. So ~10 more roundings of <= u per layer, forward and backward.
#     BF16_AUTO_LOSS_RTOL  u/4 = 9.8e-4: the logits are rounded (|dz| <= u|z|, |z| <~ 1), so a token's
#                          loss moves by <= 2u|z| ~ 8e-3, <= 1.4e-3 relative to ln(V) = 5.5 with no
#                          averaging; the 128 tokens average it down. Observed 7.7e-5 (seed 7),
#                          <= 3.2e-4 over seeds 1..12 (step 0 <= 1.7e-5; later steps add trajectory).
#     BF16_AUTO_GRAD_RTOL  64u = 0.25 of each tensor's max|g|: ~40 extra roundings of u on the way
#                          back through 2 layers, amplified in the LayerNorm and bias gradients (sums
#                          over 128 tokens of terms ~10x larger than the result). Observed 0.127 = 33u
#                          (seed 7, blocks.1.ln1.bias), 12u..33u over seeds 1..12; matrices stay near
#                          10u. Catches transposes, missing terms and scale errors beyond ~1.3x, not
#                          subtle faults: that is (a)'s job.
#     BF16_AUTO_NORM_RTOL  4u = 1.6e-2: the global norm averages the per-element errors; observed
#                          3.7e-3 (seed 7), <= 5.7e-3 = 1.5u over seeds 1..12.
#     The autocast check cannot tell loom's bf16 from its fp32 (the fp32 export passes it: loss
#     5e-5, grads 0.127, norm 4.4e-3): autocast differs from both by more than they differ from
#     each other.
# ---------------------------------------------------------------------------------------------
BF16_U = 2.0 ** -8
BF16_EMU_LOSS_RTOL = 1e-4
BF16_EMU_GRAD_RTOL = 2 * BF16_U
BF16_EMU_EFFECT = 0.45
BF16_EMU_NORM_RTOL = BF16_U / 4
BF16_AUTO_LOSS_RTOL = BF16_U / 4
BF16_AUTO_GRAD_RTOL = 64 * BF16_U
BF16_AUTO_NORM_RTOL = 4 * BF16_U

TOLS = dict(
    fp32=dict(loss=LOSS_RTOL, grad=GRAD_RTOL, grad_atol=GRAD_ATOL, norm=NORM_RTOL, lr=LR_RTOL, params=True),
    bf16_emulated=dict(loss=BF16_EMU_LOSS_RTOL, grad=BF16_EMU_GRAD_RTOL, grad_atol=GRAD_ATOL,
                       effect=BF16_EMU_EFFECT, norm=BF16_EMU_NORM_RTOL, lr=LR_RTOL, params=True),
    bf16_autocast=dict(loss=BF16_AUTO_LOSS_RTOL, grad=BF16_AUTO_GRAD_RTOL, grad_atol=GRAD_ATOL,
                       norm=BF16_AUTO_NORM_RTOL, lr=None, params=False),
)

INT_ATTRS = ("layers", "d_model", "heads", "seq_len", "vocab", "batch", "micro_batches", "steps",
             "warmup")
FLOAT_ATTRS = ("lr", "lr_min", "weight_decay", "beta1", "beta2", "eps", "grad_clip")


class Malformed(Exception):
    pass


def _scalar(v):
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        if v.size != 1:
            raise Malformed(f"attribute of shape {v.shape}, expected a scalar")
        v = v.reshape(()).item()
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, bytes):
        v = v.decode()
    return v


def _tensors(group):
    """{name: array} of every dataset under `group`; nested groups are joined with '.', so both
    /params/init/blocks.0.ln1.weight and /params/init/blocks/0/ln1/weight are accepted."""
    out = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            out[name.replace("/", ".")] = obj[()]
    group.visititems(visit)
    return out


def _deck_value(deck, section, key):
    """`key` of `[section]` in the resolved deck text loom stores in the file ('?' when absent)."""
    current = None
    for line in str(deck).splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1].strip()
        elif current == section and "=" in line and line.split("=", 1)[0].strip() == key:
            return line.split("=", 1)[1].strip()
    return "?"


# The [model] keys of the recorded deck that choose and shape the architecture, with their defaults
# when the deck (or the key) is absent, as loom of before model.arch wrote it: torch_gpt.MODEL_DEFAULTS
# (kv_heads 0 = heads, ffn_hidden 0 = torch_gpt.llama_ffn_hidden(d_model)).
ARCH_INT_KEYS = ("kv_heads", "ffn_hidden", "experts", "moe_every", "experts_per_token", "moe_ffn_hidden")
ARCH_FLOAT_KEYS = ("norm_eps", "rope_theta", "expert_capacity", "moe_aux_loss", "moe_z_loss")
TRAIN_SECTION_KEYS = ("moe_aux_loss", "moe_z_loss")  # read from [train]


def _arch_keys(path, deck):
    """{arch, kv_heads, ffn_hidden, norm_eps, rope_theta, tie_embeddings} from the deck text; arch
    'gpt2' when absent. For llama the defaults are resolved (kv_heads = heads etc. happen in
    torch_gpt.llama_config; the values here are the deck's)."""
    out = {}
    for k, default in torch_gpt.MODEL_DEFAULTS.items():
        v = _deck_value(deck, "train" if k in TRAIN_SECTION_KEYS else "model", k) if deck else "?"
        if v in ("?", ""):
            v = default
        try:
            if k in ARCH_INT_KEYS:
                v = int(float(v))
            elif k in ARCH_FLOAT_KEYS:
                v = float(v)
            elif k == "tie_embeddings":  # auto: gpt2's head is tied, llama's is not (arch is read first)
                v = out["arch"] == "gpt2" if str(v).strip().lower() == "auto" else torch_gpt._flag(v)
            else:
                v = str(v).strip().lower()
        except ValueError as e:
            raise Malformed(f"{path}: deck model.{k} = '{v}': {e}")
        out[k] = v
    if out["arch"] not in torch_gpt.ARCHS:
        raise Malformed(f"{path}: deck model.arch = '{out['arch']}' is none of {', '.join(torch_gpt.ARCHS)}")
    return out


def _arch_text(cfg):
    """The case header's architecture words: '' for gpt2 (the header as before model.arch), else
    'arch llama kv_heads KV ffn_hidden F norm_eps E rope_theta R tied|untied head '."""
    if cfg.get("experts", 0):
        return (f"{cfg['experts']} experts top-{cfg['experts_per_token']} every {cfg['moe_every']} block(s), "
                f"width {cfg['moe_ffn_hidden'] or 4 * cfg['d_model']}, "
                f"capacity {cfg['expert_capacity']:g}, aux {cfg['moe_aux_loss']:g} z {cfg['moe_z_loss']:g}, ")
    if cfg.get("arch", "gpt2") == "gpt2":
        return ""
    lc = torch_gpt.llama_config(cfg)
    return (f"arch {cfg['arch']} kv_heads {lc['kv_heads']} ffn_hidden {lc['ffn_hidden']} "
            f"norm_eps {lc['norm_eps']:g} rope_theta {lc['rope_theta']:g} "
            f"{'tied' if lc['tie_embeddings'] else 'untied'} head, ")


def load_export(path):
    with h5py.File(path, "r") as f:
        cfg = {}
        for k in INT_ATTRS + FLOAT_ATTRS + ("schedule",):
            if k not in f.attrs:
                raise Malformed(f"{path}: root attribute '{k}' missing")
            v = _scalar(f.attrs[k])
            cfg[k] = int(v) if k in INT_ATTRS else (float(v) if k in FLOAT_ATTRS else str(v))
        cfg["loom_version"] = str(_scalar(f.attrs["loom_version"])) if "loom_version" in f.attrs else "?"
        deck = _scalar(f.attrs["deck"]) if "deck" in f.attrs else ""
        cfg["precision"] = _deck_value(deck, "precision", "dtype") if deck else "?"
        cfg.update(_arch_keys(path, deck))
        if cfg["schedule"] not in ("constant", "cosine"):
            raise Malformed(f"{path}: schedule '{cfg['schedule']}' is neither constant nor cosine")
        for g in ("params/init", "params/final", "grads/step0", "batches/inputs", "batches/targets",
                  "metrics/loss", "metrics/lr", "metrics/grad_norm"):
            if g not in f:
                raise Malformed(f"{path}: '/{g}' missing")
        data = dict(
            cfg=cfg,
            init=_tensors(f["params/init"]),
            final=_tensors(f["params/final"]),
            grads0=_tensors(f["grads/step0"]),
            inputs=np.asarray(f["batches/inputs"][()]),
            targets=np.asarray(f["batches/targets"][()]),
            loss=np.asarray(f["metrics/loss"][()], dtype=np.float64).reshape(-1),
            lr=np.asarray(f["metrics/lr"][()], dtype=np.float64).reshape(-1),
            grad_norm=np.asarray(f["metrics/grad_norm"][()], dtype=np.float64).reshape(-1),
        )
    S, B, T, V = cfg["steps"], cfg["batch"], cfg["seq_len"], cfg["vocab"]
    for k in ("inputs", "targets"):
        if data[k].shape != (S, B, T):
            raise Malformed(f"{path}: /batches/{k} has shape {data[k].shape}, expected {(S, B, T)}")
        if data[k].min() < 0 or data[k].max() >= V:
            raise Malformed(f"{path}: /batches/{k} holds tokens outside [0, {V})")
    for k in ("loss", "lr", "grad_norm"):
        if data[k].shape != (S,):
            raise Malformed(f"{path}: /metrics/{k} has {data[k].shape[0]} entries, expected {S}")
    names = torch_gpt.param_names(cfg)
    try:
        ref = dict(torch_gpt.build_model(cfg).named_parameters())
    except (AssertionError, ValueError) as e:
        raise Malformed(f"{path}: the recorded model cannot be built: {e}")
    for k in ("init", "final", "grads0"):
        got = set(data[k])
        if got != set(names):
            raise Malformed(f"{path}: {k} tensors differ from the model: missing "
                            f"{sorted(set(names) - got)[:4]}, unexpected {sorted(got - set(names))[:4]}")
        for n in names:
            if tuple(data[k][n].shape) != tuple(ref[n].shape):
                raise Malformed(f"{path}: {k} {n} has shape {data[k][n].shape}, "
                                f"expected {tuple(ref[n].shape)}")
    if B % cfg["micro_batches"] != 0:
        raise Malformed(f"{path}: batch {B} is not divisible by micro_batches {cfg['micro_batches']}")
    return data


def reference(data, dtype=torch.float64, operand_dtype=None, autocast=None):
    """Replays the training in `dtype` (float64: the reference). operand_dtype: round every model
    matrix product's operands to it (torch_gpt.set_operand_dtype; bf16 = loom's arithmetic);
    autocast: run each forward under torch.autocast("cpu", dtype=autocast), backward following the
    dtypes autocast recorded (PyTorch's recommended use). Returns per-step loss, norm, lr, the step-0
    gradients and the final parameters, all as numpy float64."""
    cfg = data["cfg"]
    torch.manual_seed(0)
    model = torch_gpt.build_model(cfg, dtype)
    torch_gpt.set_operand_dtype(model, operand_dtype)
    torch_gpt.load_params(model, data["init"])
    opt = torch_gpt.make_optimizer(model, cfg)
    params = list(model.parameters())
    losses, norms, lrs, grads0 = [], [], [], None
    # min over steps of |g| / max|g| per element (relative to its tensor): the sign-stable test
    rel_min = {n: np.full(tuple(p.shape), np.inf) for n, p in model.named_parameters()}
    rel_max = {n: np.zeros(tuple(p.shape)) for n, p in model.named_parameters()}
    for s in range(cfg["steps"]):
        opt.zero_grad(set_to_none=True)
        inp = torch.from_numpy(data["inputs"][s].astype(np.int64))
        tgt = torch.from_numpy(data["targets"][s].astype(np.int64))
        if autocast is None:
            _, loss = model(inp, tgt)  # mean over the whole global batch (= mean of micro-batch means)
        else:
            with torch.autocast("cpu", dtype=autocast):
                _, loss = model(inp, tgt)
        # the experts' auxiliary losses are per-sequence and per-token means too
        (loss + getattr(model, "aux_objective", 0.0)).backward()
        if s == 0:
            grads0 = {n: p.grad.detach().double().numpy().copy() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            g = np.abs(p.grad.detach().double().numpy())
            rel_min[n] = np.minimum(rel_min[n], g / max(float(g.max()), 1e-300))
            rel_max[n] = np.maximum(rel_max[n], g / max(float(g.max()), 1e-300))
        norms.append(torch_gpt.clip_grad_norm(params, cfg["grad_clip"]))
        lr = torch_gpt.lr_at(s, cfg)
        torch_gpt.set_lr(opt, lr)
        opt.step()
        losses.append(float(loss.detach()))
        lrs.append(lr)
    final = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
    return dict(loss=np.array(losses), grad_norm=np.array(norms), lr=np.array(lrs), grads0=grads0,
                final=final, stable={n: r >= STABLE_REL for n, r in rel_min.items()},
                live={n: r >= ZERO_REL for n, r in rel_max.items()})


def _finite(a):
    return bool(np.all(np.isfinite(a)))


def compare(data, ref, tol=None, prefix="", plain=None):
    """Returns rows (check, worst, observed, tolerance, ok, ratio) where ratio = observed/tolerance.
    tol: one of TOLS (default fp32's); its lr None skips the lr check, params False the parameters'.
    plain: the unrounded float64 reference, for the emulated bf16 check's share-of-the-effect row."""
    tol = tol or TOLS["fp32"]
    cfg = data["cfg"]
    S = cfg["steps"]
    rows = []
    grad_rtol = tol["grad"]

    def rel_rows(check, loom, want, rtol):
        err = np.abs(loom - want) / np.maximum(np.abs(want), 1e-300)
        if not _finite(loom):
            rows.append((check, f"step {int(np.argmin(np.isfinite(loom)))}", "non-finite", rtol, False,
                         math.inf))
            return
        s = int(np.argmax(err))
        rows.append((check, f"step {s} ({loom[s]:.9g} vs {want[s]:.9g})", float(err[s]), rtol,
                     bool(err[s] <= rtol), float(err[s]) / rtol))

    rel_rows(f"{prefix}loss, {S} steps (rel)", data["loss"], ref["loss"], tol["loss"])

    # Step-0 gradients, per tensor.
    worst = None
    for n, g_ref in ref["grads0"].items():
        g = data["grads0"][n].astype(np.float64)
        scale = float(np.max(np.abs(g_ref)))
        t = grad_rtol * scale + tol["grad_atol"]
        err = float(np.max(np.abs(g - g_ref))) if _finite(g) else math.inf
        r = err / t
        if worst is None or r > worst[0]:
            worst = (r, n, err, scale, t)
    r, n, err, scale, t = worst
    rows.append((f"{prefix}grads step 0, {len(ref['grads0'])} tensors (max|d|/max|g|)",
                 f"{n} (max|g| {scale:.3g})", err / scale if scale > 0 else err,
                 t / scale if scale > 0 else t, bool(r <= 1.0), r))

    if plain is not None:
        # How much of the bf16 effect on the step-0 gradients (plain float64 vs emulated) loom leaves
        # unexplained: 0 reproduces the emulation, 1 is as far from it as unrounded arithmetic.
        names = list(ref["grads0"])

        def flat(g):
            return np.concatenate([np.asarray(g[n], dtype=np.float64).ravel() for n in names])
        emu, got = flat(ref["grads0"]), flat(data["grads0"])
        effect = float(np.linalg.norm(flat(plain["grads0"]) - emu))
        miss = float(np.linalg.norm(got - emu)) if _finite(got) else math.inf
        share = miss / effect if effect > 0 else math.inf
        rows.append((f"{prefix}grads step 0, bf16 effect unexplained |g-g_emu|/|g_plain-g_emu|",
                     f"|g_plain-g_emu|/|g_emu| {effect / float(np.linalg.norm(emu)):.2g}", share,
                     tol["effect"], bool(share <= tol["effect"]), share / tol["effect"]))

    rel_rows(f"{prefix}grad_norm, {S} steps (rel)", data["grad_norm"], ref["grad_norm"], tol["norm"])
    if tol["lr"] is not None:
        rel_rows(f"{prefix}lr, {S} steps (rel)", data["lr"], ref["lr"], tol["lr"])
    if not tol["params"]:
        return rows

    # Final parameters.
    bound = torch_gpt.adam_update_bound(cfg)
    tight = 2.0 * (grad_rtol / STABLE_REL) * bound + PARAM_TIGHT_ABS
    loose = 2.0 * (grad_rtol / LOOSE_REL) * bound + PARAM_TIGHT_ABS
    hard = 2.0 * bound + PARAM_TIGHT_ABS
    total = inside = n_stable = n_all = 0
    worst_hard = (-1.0, "", 0.0)
    worst_stable = (-1.0, "")
    worst_frac = (2.0, "", 0)
    for n, p_ref in ref["final"].items():
        p = data["final"][n].astype(np.float64)
        d = np.abs(p - p_ref) if _finite(p) else np.full(p.shape, np.inf)
        live = ref["live"][n]
        k = int(np.sum(d[live] <= loose))
        total += int(live.sum())
        inside += k
        n_all += d.size
        m = float(np.max(d))
        if m > worst_hard[0]:
            worst_hard = (m, n, float(np.percentile(d, 99.9)))
        st = ref["stable"][n]
        n_stable += int(st.sum())
        if st.any() and float(np.max(d[st])) > worst_stable[0]:
            worst_stable = (float(np.max(d[st])), n)
        if live.any() and k / live.sum() < worst_frac[0]:
            worst_frac = (k / live.sum(), n, int(live.sum()) - k)
    frac = inside / total
    rows.append((f"{prefix}params final, sign-stable ({n_stable / n_all:.1%}) max|d|", worst_stable[1],
                 worst_stable[0], tight, bool(worst_stable[0] <= tight), worst_stable[0] / tight))
    rows.append((f"{prefix}params final, fraction within {loose:.2g} ({n_all - total} zero-grad skipped)",
                 f"{worst_frac[1]} ({worst_frac[2]} outside)" if worst_frac[2] else "all inside",
                 frac, PARAM_FRACTION, bool(frac >= PARAM_FRACTION),
                 (1.0 - frac) / (1.0 - PARAM_FRACTION)))
    rows.append((f"{prefix}params final, every element max|d|",
                 f"{worst_hard[1]} (p99.9 {worst_hard[2]:.2g})", worst_hard[0], hard,
                 bool(worst_hard[0] <= hard), worst_hard[0] / hard))
    return rows


def print_table(rows):
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"  {'check':<{w0}}  {'worst':<{w1}}  {'observed':>10}  {'tolerance':>10}  {'obs/tol':>8}  status")
    for check, worst, obs, tol, ok, ratio in rows:
        o = obs if isinstance(obs, str) else f"{obs:.3g}"
        print(f"  {check:<{w0}}  {worst:<{w1}}  {o:>10}  {tol:>10.3g}  {ratio:>8.3g}  "
              f"{'PASS' if ok else 'FAIL'}")


def run_loom(loom, deck, out, sets, log, launch=()):
    cmd = list(launch) + [loom, "export", deck, out] + [a for s in sets for a in ("--set", s)]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0 or not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-4000:]
        print(tail)
        raise Malformed(f"loom export exited with status {p.returncode}"
                        + ("" if os.path.exists(out) else f" and wrote no {out}") + f" (log: {log})")
    print(f"  loom export took {time.time() - t0:.1f} s; log in {log}")


def check_case(label, data, expect=None, dtype="fp32"):
    cfg = data["cfg"]
    rows_extra = []
    if expect:
        for k, v in expect.items():
            got = cfg[k]
            ok = math.isclose(got, v, rel_tol=1e-12, abs_tol=0.0)
            rows_extra.append((f"attribute {k} follows --set", f"{got:.9g}", abs(got - v), 0.0, ok,
                               0.0 if ok else math.inf))
    t0 = time.time()
    if dtype == "fp32":
        ref = reference(data)
        rows = compare(data, ref)
        took = f"reference (float64 torch) took {time.time() - t0:.1f} s"
    else:
        ref = reference(data, operand_dtype=torch.bfloat16)
        plain = reference(data)
        t1 = time.time()
        rows = compare(data, ref, TOLS["bf16_emulated"], "emulated: ", plain=plain)
        took = (f"references: emulated and plain (float64 torch, with and without bf16 operands) took "
                f"{t1 - t0:.1f} s")
        if cfg.get("experts", 0):  # autocast rounds the router's logits to bf16: another routing, another model
            took += ("; autocast not compared: it rounds the router's logits to bf16, so near-tie routing "
                     "decisions can go otherwise than on loom's fp32 logits (another model, not a rounding)")
        else:
            auto = reference(data, dtype=torch.float32, autocast=torch.bfloat16)
            rows += compare(data, auto, TOLS["bf16_autocast"], "autocast: ")
            took += f", autocast (float32 torch, bf16 autocast) {time.time() - t1:.1f} s"
    rows += rows_extra
    clip = cfg["grad_clip"]
    engaged = [s for s, n in enumerate(ref["grad_norm"]) if clip > 0 and torch_gpt.clip_coef(n, clip) < 1.0]
    print(f"\ncase {label}: {_arch_text(cfg)}layers {cfg['layers']} d_model {cfg['d_model']} "
          f"heads {cfg['heads']} "
          f"seq_len {cfg['seq_len']} vocab {cfg['vocab']} batch {cfg['batch']}x{cfg['micro_batches']} "
          f"micro, {cfg['steps']} steps, {cfg['schedule']} lr {cfg['lr']:g}, loom {cfg['loom_version']}, "
          f"precision.dtype {cfg['precision']}")
    norms = ", ".join(f"{n:.4g}" for n in ref["grad_norm"])
    if clip > 0:
        print(f"  grad_clip {clip:g}; reference norms [{norms}]; clipping engaged on steps {engaged}"
              + (" (clipped path exercised)" if engaged else " (clip on, never engaged)"))
    else:
        print(f"  grad_clip 0 (unclipped path exercised); reference norms [{norms}]")
    print("  " + took)
    print_table(rows)
    return all(r[4] for r in rows), ref, engaged


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--deck", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "oracle.deck"))
    ap.add_argument("--workdir", default="build/oracle")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    ap.add_argument("--single", action="store_true", help="run case A only")
    ap.add_argument("--ranks", type=int, default=1,
                    help="launch loom export on this many ranks (a context-parallel ring: --set parallel.cp=N)")
    common.add_launcher_arguments(ap)
    ap.add_argument("--h5", help="check this export file instead of running loom")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="fp32 (default): loom's plain path against float64; bf16: loom with "
                         "precision.dtype=bf16 against the emulated and the autocast reference")
    args = ap.parse_args()

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    def describe(t):
        out = (f"loss rel {t['loss']:.3g}, grads {t['grad']:.3g}*max|g|+{t['grad_atol']:g}, "
               + (f"bf16 effect unexplained {t['effect']:g}, " if "effect" in t else "")
               + f"grad_norm rel {t['norm']:.3g}")
        if t["lr"] is not None:
            out += f", lr rel {t['lr']:g}"
        if t["params"]:
            out += (f", params: sign-stable all within {2 * t['grad'] / STABLE_REL:g}*B+{PARAM_TIGHT_ABS:g}, "
                    f"{PARAM_FRACTION:.1%} of all within {2 * t['grad'] / LOOSE_REL:g}*B+"
                    f"{PARAM_TIGHT_ABS:g}, every element within 2*B+{PARAM_TIGHT_ABS:g} "
                    f"(B: AdamW drift bound)")
        return out
    if args.dtype == "fp32":
        print(f"loom oracle: torch {torch.__version__} float64 reference; tolerances: "
              f"{describe(TOLS['fp32'])}")
    else:
        print(f"loom oracle, bf16: torch {torch.__version__}; loom run with precision.dtype=bf16\n"
              f"  emulated (float64, bf16 operands) tolerances: {describe(TOLS['bf16_emulated'])}\n"
              f"  autocast (float32 under torch.autocast bf16) tolerances: {describe(TOLS['bf16_autocast'])}")
    dtype_sets = ["precision.dtype=bf16"] if args.dtype == "bf16" else []
    all_ok = True
    try:
        if args.h5:
            ok, _, _ = check_case(f"file {args.h5}", load_export(args.h5), dtype=args.dtype)
            all_ok = ok
        else:
            loom = os.path.abspath(args.loom)
            deck = os.path.abspath(args.deck)
            work = os.path.abspath(args.workdir)
            os.makedirs(work, exist_ok=True)
            user_sets_run_dir = any(s.split("=", 1)[0].strip() == "run.dir" for s in args.sets)

            def export(tag, extra):
                out = os.path.join(work, f"oracle_{tag}.h5")
                if not os.access(loom, os.X_OK):
                    raise Malformed(f"{loom} is not an executable (build loom first)")
                if os.path.exists(out):
                    os.remove(out)
                sets = ([] if user_sets_run_dir else [f"run.dir={os.path.join(work, 'run-' + tag)}"])
                run_loom(loom, deck, out, sets + dtype_sets + args.sets + extra,
                         os.path.join(work, f"export_{tag}.log"), common.launch_prefix(args, args.ranks))
                return load_export(out)

            data_a = export("A", [])
            ok, ref_a, engaged = check_case("A (deck as written)", data_a, dtype=args.dtype)
            all_ok = ok
            if not args.single:
                if engaged:
                    clip_b, why = 0.0, "A clipped, so B runs unclipped"
                else:
                    clip_b = float(f"{0.25 * float(np.min(ref_a['grad_norm'])):.3g}")
                    why = "A never clipped, so B clips at a quarter of A's smallest norm"
                print(f"\n{why}: --set train.grad_clip={clip_b:g}")
                data_b = export("B", [f"train.grad_clip={clip_b:g}"])
                ok, _, engaged_b = check_case(f"B (train.grad_clip={clip_b:g})", data_b,
                                              expect={"grad_clip": clip_b}, dtype=args.dtype)
                if clip_b > 0 and not engaged_b:
                    print("  FAIL: clipping did not engage in case B")
                    ok = False
                all_ok = all_ok and ok
    except (Malformed, OSError) as e:
        print(f"\nFAIL: {e}")
        return 1
    print("\noracle: " + ("PASS" if all_ok else "FAIL"))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
