"""A PyTorch GPT-2 that mirrors loom's model, optimizer and schedule exactly.

Used by regression/oracle.py (in float64, as the independent reference) and by
bench/gpt_vs_torch.py (in float32, as the speed peer).

The contract (DESIGN.md and the oracle spec):
  parameters  wte.weight [V,C], wpe.weight [T,C], blocks.{l}.{ln1,attn.qkv,attn.proj,ln2,mlp.fc,mlp.proj},
              ln_f; linear weights are [out, in] (y = x @ W.T + b)
  forward     x = wte[idx] + wpe[:T]; x += attn.proj(attn(ln1(x))); x += mlp.proj(gelu_tanh(mlp.fc(ln2(x))));
              ln_f; logits = x @ wte.T (tied head, no bias); loss = mean cross-entropy over B*T tokens.
              LayerNorm eps 1e-5; q,k,v split in that order along the last dim of qkv; causal
              softmax(q k^T / sqrt(hs)) v; no dropout.
  optimizer   torch.optim.AdamW; weight decay only on parameters with dim >= 2.
  clipping    global L2 norm over all gradients, exactly torch.nn.utils.clip_grad_norm_; 0 = off.
  schedule    linear warm-up over `warmup` steps, then constant or cosine down to lr_min.
  llama       model.arch = llama (build_model dispatches on cfg["arch"], default gpt2): the class Llama,
              parameters wte.weight [V,C], blocks.{l}.{ln1, attn.q [NH*hs,C], attn.k [KV*hs,C],
              attn.v [KV*hs,C], attn.proj [C,NH*hs], ln2, mlp.gate [F,C], mlp.up [F,C],
              mlp.down [C,F]}.weight, ln_f.weight, lm_head.weight [V,C] unless tie_embeddings (then
              the head is wte); no biases, no position table. x = wte[idx];
              x += proj(attn(rope(q), rope(k), v)) on rmsnorm(x, ln1);
              x += down(silu(gate(h)) * up(h)), h = rmsnorm(x, ln2); rmsnorm(x, ln_f); logits.
              rmsnorm(x, w) = x / sqrt(mean(x^2) + norm_eps) * w; rotary on interleaved pairs
              (2i, 2i+1) of each head, angle t * rope_theta^(-2i/hs) (t = position 0..T-1, float64);
              grouped-query attention: query head g reads kv head g // (NH/KV); F = ffn_hidden, 0
              meaning 256 * ceil(floor(8C/3) / 256) (llama_ffn_hidden).
  experts     model.experts = E > 0 (gpt2 only): blocks l with (l + 1) % moe_every == 0 replace mlp by
              MoE: mlp.router.weight [E,C] (no bias), mlp.experts.{e}.{fc,proj} each an MLP. probs =
              softmax(x Wr^T); each token's k = experts_per_token largest (ties: the lower index),
              gates = those probabilities over their sum; per sequence, expert e keeps at most
              ceil(expert_capacity * T * k / E) assignments (0: all), taken in token order, each token's
              choices in the router's order (causal: a token's routing never depends on later tokens); out = sum over kept (gate * expert(x)). The objective adds, per such
              block (each expert's MLP moe_ffn_hidden wide, 0: 4C), moe_aux_loss * mean over sequences of E * sum_e f_e P_e (f_e: the share of the
              sequence's T*k choices that picked e, dropped or not; P_e: its mean probability) and
              moe_z_loss * mean over tokens of logsumexp(logits)^2 (model.aux_objective after a forward;
              the returned loss stays the cross-entropy).
  precision   set_operand_dtype(model, torch.bfloat16) emulates loom's precision.dtype = bf16 in any
              model dtype: every model matrix product (QKV, attention projection, MLP fc and proj,
              the tied head; Llama's q, k, v, proj, gate, up, down and head; forward and both
              backward products) rounds its operands (input, weight, output gradient) to bf16 and
              multiplies in the model's dtype; so do the attention's two products written out
              (q k^T and att v, their operands q, k, v, the probabilities, the output's gradient and
              the scores' gradient rounded: loom's unfused attention in a bf16 run on the host);
              biases, bias gradients and everything else (scores and softmax, norms, rotary,
              activations) stay unrounded. None (the default) is the plain path.
"""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# Model shape keys, training keys and their defaults (the deck's defaults do not matter here: the
# oracle always reads every value from the export file).
MODEL_KEYS = ("layers", "d_model", "heads", "seq_len", "vocab")
TRAIN_DEFAULTS = dict(
    batch=8, micro_batches=1, steps=1, warmup=0, lr=1e-3, lr_min=0.0, weight_decay=0.1,
    beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=1.0, schedule="cosine",
)
# The architecture keys and their defaults (kv_heads 0 = heads, ffn_hidden 0 = llama_ffn_hidden).
ARCHS = ("gpt2", "llama")
MODEL_DEFAULTS = dict(arch="gpt2", kv_heads=0, ffn_hidden=0, norm_eps=1e-5, rope_theta=10000.0,
                      tie_embeddings=False, experts=0, moe_every=1, experts_per_token=2, expert_capacity=0.0,
                      moe_aux_loss=0.01, moe_z_loss=0.001, moe_ffn_hidden=0)
MOE_KEYS = ("experts", "moe_every", "experts_per_token", "expert_capacity", "moe_aux_loss", "moe_z_loss",
            "moe_ffn_hidden")


def round_to(x, dtype):
    """x rounded to `dtype` (nearest even) and back to x's dtype. From float64, torch rounds to
    float32 first and then to bf16: that is what loom's fp32 value of the same quantity would round
    to, so it is the right emulation of loom (which rounds float32 values)."""
    return x.to(dtype).to(x.dtype)


class _RoundedOperandsLinear(torch.autograd.Function):
    """y = r(x) r(W)^T + b, r = round_to(., dtype); backward dx = r(dy) r(W), dW = r(dy)^T r(x) over
    all leading dims, db = sum of the unrounded dy: loom's Backend::matmul_forward/_backward with
    Precision::matmul = bf16 (or fp16), the accumulation in the model's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        xr, wr = round_to(x, dtype), round_to(weight, dtype)
        ctx.save_for_backward(xr, wr)
        ctx.dtype = dtype
        ctx.has_bias = bias is not None
        y = xr @ wr.t()
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        xr, wr = ctx.saved_tensors
        dyr = round_to(dy, ctx.dtype)
        dx = dyr @ wr
        dw = dyr.reshape(-1, dyr.shape[-1]).t() @ xr.reshape(-1, xr.shape[-1])
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db, None


class _RoundedOperandsBmm(torch.autograd.Function):
    """y = alpha * r(a) @ r(b) over a batch, r = round_to(., dtype); backward da = alpha * r(dy) r(b)^T,
    db = alpha * r(a)^T r(dy): loom's unfused attention products in a bf16 run (host back end), the
    scale applied to the product as its output scale, not to a rounded operand."""

    @staticmethod
    def forward(ctx, a, b, alpha, dtype):
        ar, br = round_to(a, dtype), round_to(b, dtype)
        ctx.save_for_backward(ar, br)
        ctx.alpha, ctx.dtype = alpha, dtype
        return alpha * torch.bmm(ar, br)

    @staticmethod
    def backward(ctx, dy):
        ar, br = ctx.saved_tensors
        dyr = round_to(dy, ctx.dtype)
        return ctx.alpha * torch.bmm(dyr, br.transpose(1, 2)), ctx.alpha * torch.bmm(ar.transpose(1, 2), dyr), None, None


def causal_attention(q, k, v, mask_add, operand_dtype=None):
    """softmax(q k^T / sqrt(hs) + mask) v over [batch, T, hs] tensors: plain (the score product fused
    with the mask by baddbmm), or with loom's rounded operands in both products."""
    T, hs = q.shape[1], q.shape[2]
    if operand_dtype is None:
        att = torch.baddbmm(mask_add[:T, :T], q, k.transpose(1, 2), alpha=1.0 / math.sqrt(hs))
        return torch.bmm(F.softmax(att, dim=-1), v)
    rounded = _RoundedOperandsBmm.apply
    att = mask_add[:T, :T] + rounded(q, k.transpose(1, 2), 1.0 / math.sqrt(hs), operand_dtype)
    return rounded(F.softmax(att, dim=-1), v, 1.0, operand_dtype)


def linear(x, weight, bias=None, operand_dtype=None):
    """x @ weight.T (+ bias); with operand_dtype, loom's rounded-operand product."""
    if operand_dtype is None:
        return F.linear(x, weight, bias)
    return _RoundedOperandsLinear.apply(x, weight, bias, operand_dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) whose product follows `operand_dtype`."""
    operand_dtype = None

    def forward(self, x):
        return linear(x, self.weight, self.bias, self.operand_dtype)


class CausalSelfAttention(nn.Module):
    # True: F.scaled_dot_product_attention(is_causal=True) (PyTorch 2.0 on; fused flash kernels on a
    # GPU, the peer of loom's model.attention = flash); False: the scores written out, as loom's unfused.
    use_sdpa = False
    operand_dtype = None  # the written-out products'; set_operand_dtype sets it with every Linear's

    def __init__(self, d_model, heads, seq_len):
        super().__init__()
        assert d_model % heads == 0
        self.heads = heads
        self.qkv = Linear(d_model, 3 * d_model)
        self.proj = Linear(d_model, d_model)
        # Additive causal mask (0 on and below the diagonal, -inf above), fused into the score
        # product by baddbmm: ~15% faster on one CPU thread than scale + masked_fill (torch 1.13
        # has no scaled_dot_product_attention). It follows the module's dtype.
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("mask_add", torch.zeros(seq_len, seq_len).masked_fill(mask, float("-inf")),
                             persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        NH = self.heads
        hs = C // NH
        # qkv's last dim is [q | k | v], each C = NH x hs (head-major): the same as splitting into
        # q, k, v of [B, T, C] and viewing each as [B, T, NH, hs].
        qkv = self.qkv(x).view(B, T, 3, NH, hs).permute(2, 0, 3, 1, 4)  # [3, B, NH, T, hs]
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # [B, NH, T, hs]
            return self.proj(y.transpose(1, 2).reshape(B, T, C))
        q = qkv[0].reshape(B * NH, T, hs)
        k = qkv[1].reshape(B * NH, T, hs)
        v = qkv[2].reshape(B * NH, T, hs)
        y = causal_attention(q, k, v, self.mask_add, self.operand_dtype)
        y = y.view(B, NH, T, hs).transpose(1, 2).reshape(B, T, C)  # heads concatenated
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d_model, hidden=0):
        super().__init__()
        hidden = hidden or 4 * d_model
        self.fc = Linear(d_model, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.proj = Linear(hidden, d_model)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class MoE(nn.Module):
    """The experts of a block (the module docstring's contract), written from it: every expert runs on
    every token and is weighted by its gate (0 where the token did not pick it or it was dropped)."""

    def __init__(self, d_model, experts, k, capacity, aux_weight, z_weight, hidden=0):
        super().__init__()
        self.router = Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList([MLP(d_model, hidden) for _ in range(experts)])
        self.k, self.capacity, self.aux_weight, self.z_weight = int(k), float(capacity), aux_weight, z_weight
        self.aux = self.z = self.objective = None

    def forward(self, x):
        B, T, _ = x.shape
        E, k = len(self.experts), self.k
        logits = self.router(x)  # [B, T, E]
        probs = F.softmax(logits, dim=-1)
        # the k largest, ties to the lower index (a stable descending sort keeps index order among ties)
        order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[..., :k]  # [B, T, k]
        chosen = probs.gather(-1, order)
        gates = chosen / chosen.sum(-1, keepdim=True)
        onehot = F.one_hot(order, E).to(x.dtype)  # [B, T, k, E]
        kept = torch.ones(B, T, k, dtype=x.dtype)
        if self.capacity > 0:
            cap = math.ceil(self.capacity * T * k / E)
            queue = onehot.reshape(B, T * k, E)  # in token order, each token's choices in the router's order
            place = (queue.cumsum(1) - queue).reshape(B, T, k, E)  # earlier takers of e
            kept = ((place * onehot).sum(-1) < cap).to(x.dtype)
        f = onehot.sum((1, 2)) / (T * k)  # [B, E]
        self.aux = (E * (f * probs.mean(1)).sum(-1)).mean()
        self.z = (torch.logsumexp(logits, dim=-1) ** 2).mean()
        self.objective = self.aux_weight * self.aux + self.z_weight * self.z
        weight = (gates * kept).unsqueeze(-1) * onehot  # [B, T, k, E]
        out = 0
        for e, expert in enumerate(self.experts):
            out = out + weight[..., e].sum(-1, keepdim=True) * expert(x)
        return out


class Block(nn.Module):
    def __init__(self, d_model, heads, seq_len, moe=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=1e-5)
        self.attn = CausalSelfAttention(d_model, heads, seq_len)
        self.ln2 = nn.LayerNorm(d_model, eps=1e-5)
        self.mlp = MoE(d_model, **moe) if moe else MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    operand_dtype = None  # the tied head's; set_operand_dtype sets it with every Linear's

    def __init__(self, layers, d_model, heads, seq_len, vocab, moe=None, moe_every=1):
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList([Block(d_model, heads, seq_len, moe if (l + 1) % moe_every == 0 else None)
                                     for l in range(layers)])
        self.ln_f = nn.LayerNorm(d_model, eps=1e-5)
        # GPT-2 style initial values; the oracle overwrites them with loom's.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("ln1.weight") or name.endswith("ln2.weight") or name == "ln_f.weight":
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.seq_len
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        # the experts' auxiliary losses (0 without experts): what the objective adds to the loss
        self.aux_objective = sum((b.mlp.objective for b in self.blocks if isinstance(b.mlp, MoE)), 0.0)
        if self.operand_dtype is None:
            logits = x @ self.wte.weight.t()
        else:
            logits = linear(x, self.wte.weight, None, self.operand_dtype)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss


# ---------------------------------------------------------------------------------------------
# Llama (model.arch = llama). Written from the contract in the module docstring; no Hugging Face.
# ---------------------------------------------------------------------------------------------
def llama_ffn_hidden(d_model, ffn_hidden=0):
    """The SwiGLU width: ffn_hidden when > 0, else Llama's rounding of 2/3 of 4C up to a multiple of
    256: 256 * ceil(floor(8C/3) / 256) (integer arithmetic)."""
    if int(ffn_hidden) > 0:
        return int(ffn_hidden)
    h = (8 * int(d_model)) // 3
    return 256 * ((h + 255) // 256)


def rms_norm(x, weight, eps):
    """x / sqrt(mean(x^2 over the last dim) + eps) * weight, in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RMSNorm(nn.Module):
    def __init__(self, d_model, eps):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_tables(seq_len, head_size, theta):
    """cos, sin of the rotary angles t * theta^(-2i/hs), t = 0..seq_len-1, i = 0..hs/2-1: [T, hs/2],
    computed in float64."""
    assert head_size % 2 == 0, f"rotary needs an even head size, got {head_size}"
    i = torch.arange(head_size // 2, dtype=torch.float64)
    inv_freq = float(theta) ** (-2.0 * i / head_size)
    angle = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angle), torch.sin(angle)


def apply_rotary(x, cos, sin):
    """Rotate the interleaved pairs (x[..., 2i], x[..., 2i+1]) of the last dim by the angles of
    cos/sin [T, hs/2] (x: [..., T, hs]): (a, b) -> (a cos - b sin, a sin + b cos)."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def gqa_attention(q, k, v, mask_add=None, operand_dtype=None):
    """Causal softmax(q k^T / sqrt(hs)) v with grouped-query heads: q [B, NH, T, hs], k and v
    [B, KV, T, hs], NH % KV == 0; query head g reads kv head g // (NH / KV). mask_add: the additive
    causal mask [>= T, >= T] (0 on and below the diagonal, -inf above); None builds one. Returns
    [B, NH, T, hs]."""
    B, NH, T, hs = q.shape
    KV = k.shape[1]
    assert NH % KV == 0, f"heads {NH} is not a multiple of kv_heads {KV}"
    if KV != NH:
        k = k.repeat_interleave(NH // KV, dim=1)  # index g holds kv head g // (NH/KV)
        v = v.repeat_interleave(NH // KV, dim=1)
    if mask_add is None:
        mask_add = torch.zeros(T, T, dtype=q.dtype).masked_fill(
            torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = causal_attention(q.reshape(B * NH, T, hs), k.reshape(B * NH, T, hs), v.reshape(B * NH, T, hs), mask_add,
                         operand_dtype)
    return y.view(B, NH, T, hs)


class LlamaAttention(nn.Module):
    use_sdpa = False  # as CausalSelfAttention.use_sdpa (needs PyTorch 2.0)
    operand_dtype = None  # as CausalSelfAttention.operand_dtype

    def __init__(self, d_model, heads, kv_heads, seq_len, rope_theta):
        super().__init__()
        assert d_model % heads == 0, f"d_model {d_model} is not a multiple of heads {heads}"
        assert heads % kv_heads == 0, f"heads {heads} is not a multiple of kv_heads {kv_heads}"
        self.heads, self.kv_heads, self.hs = heads, kv_heads, d_model // heads
        hs = self.hs
        self.q = Linear(d_model, heads * hs, bias=False)
        self.k = Linear(d_model, kv_heads * hs, bias=False)
        self.v = Linear(d_model, kv_heads * hs, bias=False)
        self.proj = Linear(heads * hs, d_model, bias=False)
        cos, sin = rope_tables(seq_len, hs, rope_theta)
        # Buffers follow the module's dtype (float64 tables rounded once to float32 for a float32 model).
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("mask_add", torch.zeros(seq_len, seq_len).masked_fill(mask, float("-inf")),
                             persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        NH, KV, hs = self.heads, self.kv_heads, self.hs
        q = self.q(x).view(B, T, NH, hs).transpose(1, 2)  # [B, NH, T, hs]
        k = self.k(x).view(B, T, KV, hs).transpose(1, 2)  # [B, KV, T, hs]
        v = self.v(x).view(B, T, KV, hs).transpose(1, 2)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.use_sdpa:
            rep = NH // KV
            y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               is_causal=True)
        else:
            y = gqa_attention(q, k, v, self.mask_add, self.operand_dtype)
        return self.proj(y.transpose(1, 2).reshape(B, T, NH * hs))  # heads concatenated


class SwiGLU(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.gate = Linear(d_model, hidden, bias=False)
        self.up = Linear(d_model, hidden, bias=False)
        self.down = Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, d_model, heads, kv_heads, seq_len, hidden, norm_eps, rope_theta):
        super().__init__()
        self.ln1 = RMSNorm(d_model, norm_eps)
        self.attn = LlamaAttention(d_model, heads, kv_heads, seq_len, rope_theta)
        self.ln2 = RMSNorm(d_model, norm_eps)
        self.mlp = SwiGLU(d_model, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class Llama(nn.Module):
    """Llama: RMSNorm, rotary (interleaved pairs), grouped-query attention, SwiGLU, no biases; the head
    is lm_head.weight, or wte.weight when tie_embeddings. named_parameters() is param_names' order."""
    operand_dtype = None  # the head's; set_operand_dtype sets it with every Linear's

    def __init__(self, layers, d_model, heads, seq_len, vocab, kv_heads=0, ffn_hidden=0, norm_eps=1e-5,
                 rope_theta=10000.0, tie_embeddings=False):
        super().__init__()
        kv_heads = int(kv_heads) or heads
        self.seq_len = seq_len
        self.tie_embeddings = bool(tie_embeddings)
        self.ffn_hidden = llama_ffn_hidden(d_model, ffn_hidden)
        self.wte = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList([LlamaBlock(d_model, heads, kv_heads, seq_len, self.ffn_hidden, norm_eps,
                                                rope_theta) for _ in range(layers)])
        self.ln_f = RMSNorm(d_model, norm_eps)
        self.lm_head = None if self.tie_embeddings else Linear(d_model, vocab, bias=False)
        # Initial values; the oracle overwrites them with loom's.
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            else:
                nn.init.ones_(p)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.seq_len
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(x, head, None, self.operand_dtype)  # F.linear when operand_dtype is None
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss


def set_operand_dtype(model, dtype):
    """Round the operands of every model matrix product to `dtype` (torch.bfloat16 emulates loom's
    precision.dtype = bf16); None restores the plain products. Returns the model."""
    for m in model.modules():
        if isinstance(m, (Linear, GPT, Llama, CausalSelfAttention, LlamaAttention)):
            m.operand_dtype = dtype
    return model


def _get(cfg, key):
    defaults = TRAIN_DEFAULTS if key in TRAIN_DEFAULTS else MODEL_DEFAULTS
    if isinstance(cfg, dict):
        return cfg[key] if key in cfg else defaults[key]
    return getattr(cfg, key) if hasattr(cfg, key) else defaults[key]


def _flag(v):
    """A deck boolean (true/false, on/off, yes/no, 1/0; bool or int) as a bool."""
    if isinstance(v, str):
        t = v.strip().lower()
        if t in ("true", "on", "yes", "1"):
            return True
        if t in ("false", "off", "no", "0", ""):
            return False
        raise ValueError(f"not a boolean: {v!r}")
    return bool(v)


def arch_of(cfg):
    """cfg's model.arch ('gpt2' when absent); anything but gpt2 and llama is refused."""
    arch = str(_get(cfg, "arch")).strip().lower()
    if arch not in ARCHS:
        raise ValueError(f"model.arch '{arch}' is none of {', '.join(ARCHS)}")
    return arch


def llama_config(cfg):
    """The Llama keys of cfg with the defaults resolved: kv_heads (0 or absent: heads), ffn_hidden (0 or
    absent: llama_ffn_hidden(d_model)), norm_eps, rope_theta, tie_embeddings."""
    heads, d_model = int(_get(cfg, "heads")), int(_get(cfg, "d_model"))
    return dict(kv_heads=int(_get(cfg, "kv_heads")) or heads,
                ffn_hidden=llama_ffn_hidden(d_model, int(_get(cfg, "ffn_hidden"))),
                norm_eps=float(_get(cfg, "norm_eps")), rope_theta=float(_get(cfg, "rope_theta")),
                tie_embeddings=_flag(_get(cfg, "tie_embeddings")))


def moe_config(cfg):
    """GPT's keyword arguments for cfg's experts: {} when model.experts is 0."""
    if int(_get(cfg, "experts")) == 0:
        return {}
    return dict(moe=dict(experts=int(_get(cfg, "experts")), k=int(_get(cfg, "experts_per_token")),
                         capacity=float(_get(cfg, "expert_capacity")), aux_weight=float(_get(cfg, "moe_aux_loss")),
                         z_weight=float(_get(cfg, "moe_z_loss")), hidden=int(_get(cfg, "moe_ffn_hidden"))),
                moe_every=int(_get(cfg, "moe_every")))


def build_model(cfg, dtype=torch.float32):
    """cfg: dict (or object) with layers, d_model, heads, seq_len, vocab, and arch (absent: gpt2; llama
    also reads kv_heads, ffn_hidden, norm_eps, rope_theta, tie_embeddings, see llama_config)."""
    shape = [int(_get(cfg, k)) for k in MODEL_KEYS]
    m = Llama(*shape, **llama_config(cfg)) if arch_of(cfg) == "llama" else GPT(*shape, **moe_config(cfg))
    return m.to(dtype)


def param_names(cfg):
    """loom's parameter names in loom's order (identical to build_model(cfg).named_parameters()).
    cfg: the model config (dict or object, as build_model's); a bare int is GPT-2's layer count."""
    if isinstance(cfg, int):
        cfg = dict(layers=cfg)
    layers = int(_get(cfg, "layers"))
    if arch_of(cfg) == "llama":
        names = ["wte.weight"]
        for l in range(layers):
            for sub in ("ln1.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.proj.weight",
                        "ln2.weight", "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"):
                names.append(f"blocks.{l}.{sub}")
        names.append("ln_f.weight")
        if not llama_config(cfg)["tie_embeddings"]:
            names.append("lm_head.weight")
        return names
    names = ["wte.weight", "wpe.weight"]
    E, every = int(_get(cfg, "experts")), int(_get(cfg, "moe_every"))
    for l in range(layers):
        mlp = ("mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias")
        if E > 0 and (l + 1) % every == 0:
            mlp = ("mlp.router.weight",) + tuple(f"mlp.experts.{e}.{t}" for e in range(E)
                                                  for t in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"))
        for sub in ("ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                    "attn.proj.bias", "ln2.weight", "ln2.bias") + mlp:
            names.append(f"blocks.{l}.{sub}")
    names += ["ln_f.weight", "ln_f.bias"]
    return names


@torch.no_grad()
def load_params(model, params):
    """Copy a {name: numpy array} dict into the model; every parameter must be present with its shape."""
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(params))
    extra = sorted(set(params) - set(own))
    if missing or extra:
        raise KeyError(f"parameter names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, p in own.items():
        a = np.asarray(params[name])
        if tuple(a.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(p.shape)}")
        p.copy_(torch.from_numpy(a.astype(np.float64)).to(p.dtype))


def lr_at(step, cfg):
    """Learning rate of 0-based step `step`."""
    lr, warmup = float(_get(cfg, "lr")), int(_get(cfg, "warmup"))
    if step < warmup:
        return lr * (step + 1) / warmup
    if str(_get(cfg, "schedule")) == "constant":
        return lr
    steps, lr_min = int(_get(cfg, "steps")), float(_get(cfg, "lr_min"))
    ratio = (step - warmup) / max(1, steps - warmup)
    return lr_min + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - lr_min)


def param_groups(model, weight_decay):
    """Weight decay on every parameter of dim >= 2 (all matrices incl. wte and wpe, Llama's lm_head), none
    on the rest (biases, LayerNorm and RMSNorm weights)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=float(weight_decay)),
            dict(params=no_decay, weight_decay=0.0)]


def make_optimizer(model, cfg, **kw):
    """torch.optim.AdamW with loom's groups and hyper-parameters; set the lr per step with set_lr."""
    return torch.optim.AdamW(
        param_groups(model, _get(cfg, "weight_decay")), lr=float(_get(cfg, "lr")),
        betas=(float(_get(cfg, "beta1")), float(_get(cfg, "beta2"))), eps=float(_get(cfg, "eps")), **kw)


def set_lr(opt, lr):
    for g in opt.param_groups:
        g["lr"] = lr


def grad_norm(params):
    """Global L2 norm over all gradients (computed in the gradients' dtype, like clip_grad_norm_)."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.norm(torch.stack([torch.norm(g.detach(), 2.0) for g in grads]), 2.0)


def clip_grad_norm(params, grad_clip):
    """Returns the global norm before clipping, as a float. grad_clip > 0: scale every gradient by
    min(1, grad_clip / (norm + 1e-6)) exactly as torch.nn.utils.clip_grad_norm_; 0: no clipping."""
    params = list(params)
    if grad_clip and grad_clip > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, float(grad_clip)))
    return float(grad_norm(params))


def clip_coef(norm, grad_clip):
    """The factor clip_grad_norm applies (1.0 when clipping is off or does not engage)."""
    if not grad_clip or grad_clip <= 0:
        return 1.0
    return min(1.0, float(grad_clip) / (norm + 1e-6))


def adam_update_bound(cfg, steps=None):
    """Largest possible |change| of one element over `steps` AdamW steps, ignoring weight decay:
    sum_t lr_t * max|m_hat_t / (sqrt(v_hat_t) + eps)|, with the ratio bounded by Cauchy-Schwarz:
    |m_hat_t| / sqrt(v_hat_t) <= sqrt((1-b2^t) sum_k (1-b1)^2 b1^2k / ((1-b2) b2^k)) / (1-b1^t)
    (k = 0..t-1; equals 1 at t = 1). Two runs whose gradients differ can therefore end at most
    2 * bound apart in any element (plus the weight-decay term, which only shrinks differences)."""
    steps = int(_get(cfg, "steps")) if steps is None else steps
    b1, b2 = float(_get(cfg, "beta1")), float(_get(cfg, "beta2"))
    total = 0.0
    for s in range(steps):
        t = s + 1
        acc = sum((1 - b1) ** 2 * b1 ** (2 * k) / ((1 - b2) * b2 ** k) for k in range(t))
        ratio = math.sqrt((1 - b2 ** t) * acc) / (1 - b1 ** t)
        total += lr_at(s, cfg) * ratio
    return total


def train_step(model, opt, inputs, targets, step, cfg, micro_batches=1):
    """One loom step: mean loss over the global batch (optionally accumulated over micro-batches),
    global-norm clip, AdamW at lr_at(step). Returns (loss, grad_norm_before_clip, lr)."""
    opt.zero_grad(set_to_none=True)
    B = inputs.shape[0]
    assert B % micro_batches == 0
    mb = B // micro_batches
    total = 0.0
    for i in range(micro_batches):
        _, loss = model(inputs[i * mb:(i + 1) * mb], targets[i * mb:(i + 1) * mb])
        ((loss + getattr(model, "aux_objective", 0.0)) / micro_batches).backward()
        total += float(loss.detach()) / micro_batches
    norm = clip_grad_norm(model.parameters(), float(_get(cfg, "grad_clip")))
    lr = lr_at(step, cfg)
    set_lr(opt, lr)
    opt.step()
    return total, norm, lr
