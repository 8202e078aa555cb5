#!/usr/bin/python3
"""loom's CUDA back end against PyTorch on one GPU: GPT-2 124M (bench/gpu.deck), bf16 products; with
--set model.arch=llama (and the Llama keys), the Llama block of the same width, depth and heads.

Usage (on a machine with a GPU):
  /usr/bin/python3 bench/gpu.py --loom build/loom [--steps N] [--peak-tflops P] [--batch B] [--set KEY=VALUE]
                                [--torch-attention manual|sdpa]

  1. loom run bench/gpu.deck --set train.steps=N --set run.dir=DIR [--set train.batch=B], then
     DIR/summary.json: tokens_per_s (steady state, first step excluded) and the model FLOPs per token.
  2. The same architecture and AdamW (regression/torch_gpt.py, the oracle's model) in PyTorch on the
     same GPU under torch.autocast("cuda", dtype=torch.bfloat16), fused AdamW: 3 warm-up steps, then
     N timed steps on random token batches.
  3. MFU of both against the GPU's dense bf16 peak (--peak-tflops; by default from the device name:
     A100 312, H100 SXM / H200 989.4 TFLOP/s, NVIDIA's datasheets), the ratio loom / PyTorch, and
     llm.c's figure for reference (about 60% MFU on A100, from its README; not measured here).
A benchmark, not a test: exit 0 when both parts ran, 1 otherwise; no GPU: exit 77 saying so.
--set of the model's shape and of train.* reach both: loom's run and PyTorch's model and optimizer; so
do model.arch and the Llama keys (kv_heads, ffn_hidden, norm_eps, rope_theta, tie_embeddings), PyTorch
running regression/torch_gpt.py's Llama (issue 46: Llama's MFU beside GPT-2's).

--smoke runs all of it where there is no GPU, to check the script, not to measure: a small model
(SMOKE_SETS), loom's cuda back end on the emulated device (LOOM_CUDA_BACKEND_LIBRARY =
build/lib/libloom_cuda_emu.so, which the caller sets) and PyTorch on the CPU (autocast bf16, AdamW
unfused), 3 steps, a peak of 1 TFLOP/s assumed (regression.gpu.emulated_bench).
"""
import argparse
import configparser
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "regression"))

PEAKS = [("H200", 989.4), ("H100", 989.4), ("A100", 312.0)]  # dense bf16 TFLOP/s (SXM datasheets)
SMOKE_SETS = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.seq_len=64", "model.vocab=256",
              "train.batch=4"]


def deck_values(path, sets):
    """The deck's model and train sections, with the --set overrides of those sections applied."""
    cp = configparser.ConfigParser(inline_comment_prefixes=("#",))
    cp.read(path)
    model = {k: int(cp["model"][k]) for k in ("layers", "d_model", "heads", "seq_len", "vocab")}
    train = {k: cp["train"][k] for k in cp["train"]}
    for kv in sets:
        key, _, value = kv.partition("=")
        section, _, name = key.partition(".")
        if section == "model" and name in model:
            model[name] = int(value)
        elif section == "model" and name in ARCH_KEYS:
            model[name] = value
        elif section == "train":
            train[name] = value
    return model, train


ARCH_KEYS = ("arch", "kv_heads", "ffn_hidden", "norm_eps", "rope_theta", "tie_embeddings")


def flops_per_token(m):
    """loom's count (GPT::flops_per_token): 6 x matrix weights + attention's 12 L T C. A Llama block's
    weights: q and the output C^2 each, k and v C x (kv_heads x head size) each, gate, up, down C x F."""
    L, C, T, V = m["layers"], m["d_model"], m["seq_len"], m["vocab"]
    if m.get("arch", "gpt2") == "llama":
        import torch_gpt
        cfg = torch_gpt.llama_config(m)
        ck = cfg["kv_heads"] * (C // m["heads"])
        block = 2.0 * C * C + 2.0 * C * ck + 3.0 * C * cfg["ffn_hidden"]
    else:
        block = 12.0 * C * C
    return 6.0 * (L * block + V * C) + 12.0 * L * T * C


def run_loom(args, model, batch):
    rundir = os.path.abspath(os.path.join(args.workdir, "loom"))
    cmd = [args.loom, "run", os.path.join(HERE, "gpu.deck"), "--set", "train.steps=%d" % args.steps,
           "--set", "run.dir=" + rundir, "--set", "train.batch=%d" % batch, "--set", "run.overwrite=true",
           "--set", "run.peak_tflops=%g" % args.peak_tflops]
    for kv in args.set:
        cmd += ["--set", kv]
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write("\n".join(l for l in p.stdout.splitlines() if l.startswith(("  backend", "step", "  MFU"))) + "\n")
    if p.returncode != 0:
        sys.stdout.write(p.stdout[-3000:] + p.stderr[-3000:])
        return None
    with open(os.path.join(rundir, "summary.json")) as f:
        return json.load(f)


def run_torch(args, model, train, batch, compiled=False):
    """PyTorch's tokens/s on the same model: eager, or under torch.compile (compiled; its compilation
    falls in the warm-up steps, outside the timing)."""
    import torch
    import torch_gpt
    kind = "cpu" if args.smoke else "cuda"
    dev = torch.device(kind)
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    torch.manual_seed(1)
    if args.torch_attention == "sdpa":
        if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
            raise RuntimeError("--torch-attention sdpa: torch %s has no scaled_dot_product_attention (PyTorch 2.0 "
                               "or newer)" % torch.__version__)
        torch_gpt.CausalSelfAttention.use_sdpa = True
        torch_gpt.LlamaAttention.use_sdpa = True
    net = torch_gpt.build_model(model).to(dev)
    fwd = torch.compile(net) if compiled else net
    opt = torch_gpt.make_optimizer(net, train, **({"fused": True} if kind == "cuda" else {}))
    T, V = model["seq_len"], model["vocab"]

    def step():
        idx = torch.randint(0, V, (batch, T + 1), device=dev)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(kind, dtype=torch.bfloat16):
            _, loss = fwd(idx[:, :-1], idx[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), float(train.get("grad_clip", 1.0)))
        opt.step()

    for _ in range(3):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    return batch * T * args.steps / (time.perf_counter() - t0), torch.__version__


def gpu_name():
    """(the GPU's name, "") or ("", why there is none)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return "", "no GPU: torch.cuda.is_available() is False; nothing to measure"
        return torch.cuda.get_device_name(0), ""
    except ImportError:
        try:
            name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                  text=True).stdout.strip()
        except FileNotFoundError:  # no NVIDIA driver here
            name = ""
        return name, "" if name else "no GPU (and no PyTorch): nothing to measure"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", required=True)
    ap.add_argument("--steps", type=int, default=0, help="timed steps (default 20; 3 with --smoke)")
    ap.add_argument("--batch", type=int, default=0, help="sequences per step (default: the deck's)")
    ap.add_argument("--peak-tflops", type=float, default=0)
    ap.add_argument("--workdir", default="build/gpu-bench")
    ap.add_argument("--loom-only", action="store_true")
    ap.add_argument("--torch-attention", choices=("manual", "sdpa"), default="manual",
                    help="PyTorch's attention: the [T,T] scores written out (manual, as loom's unfused) or "
                         "scaled_dot_product_attention (sdpa: fused, the peer of --set model.attention=flash)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a deck override for loom's run (repeatable), e.g. --set run.tf32=false; the model's "
                         "shape (model.layers, d_model, heads, seq_len, vocab) and train.* apply to PyTorch's run "
                         "too (model.attention: --torch-attention)")
    ap.add_argument("--torch-compile", action="store_true",
                    help="also run PyTorch's model under torch.compile (the peer llm.c measures itself against) "
                         "and print loom's ratio to it")
    ap.add_argument("--smoke", action="store_true",
                    help="check the script without a GPU: a small model on the emulated device and PyTorch on the CPU")
    args = ap.parse_args()
    args.steps = args.steps or (3 if args.smoke else 20)
    if args.batch and any(kv.startswith("train.batch=") for kv in args.set):
        print("--batch and --set train.batch both set the batch: give one")
        return 2
    if args.smoke:
        args.set = SMOKE_SETS + args.set
        args.peak_tflops = args.peak_tflops or 1.0
        if not os.environ.get("LOOM_CUDA_BACKEND_LIBRARY"):
            print("--smoke runs loom on the emulated device: set LOOM_CUDA_BACKEND_LIBRARY=build/lib/libloom_cuda_emu.so")
            return 2
        name = "smoke: loom on its emulated device, PyTorch on the CPU (nothing measured)"
    else:
        name, why = gpu_name()
        if not name:
            print(why)
            return 77
    if args.peak_tflops <= 0:
        args.peak_tflops = next((p for key, p in PEAKS if key in name), 0) or 989.4
    os.makedirs(args.workdir, exist_ok=True)
    model, train = deck_values(os.path.join(HERE, "gpu.deck"), args.set)
    batch = args.batch or int(train["batch"])
    fpt = flops_per_token(model)
    arch = "Llama" if model.get("arch", "gpt2") == "llama" else "GPT-2"
    print("device: %s, dense bf16 peak %.1f TFLOP/s; %s %d layers, d %d, T %d, vocab %d; batch %d; %.3g FLOP/token"
          % (name, args.peak_tflops, arch, model["layers"], model["d_model"], model["seq_len"], model["vocab"], batch,
             fpt))
    s = run_loom(args, model, batch)
    out = {"device": name, "peak_tflops": args.peak_tflops, "batch": batch, "steps": args.steps, "arch": arch}
    ok = s is not None
    if s and abs(s["model_flops_per_token"] - fpt) > 1e-9 * fpt:  # PyTorch's model is not loom's
        print("loom's run counts %.6g FLOP/token, this script's model %.6g: the two models differ" % (s["model_flops_per_token"], fpt))
        ok = False
    if s:
        out["loom_tokens_per_s"] = s["tokens_per_s"]
        out["loom_mfu"] = s["tokens_per_s"] * fpt / (args.peak_tflops * 1e12)
        print("loom    : %10.0f tokens/s  MFU %5.1f%%" % (out["loom_tokens_per_s"], 100 * out["loom_mfu"]))
    if not args.loom_only:
        try:
            tps, version = run_torch(args, model, train, batch)
            out["torch_tokens_per_s"], out["torch_version"] = tps, version
            out["torch_mfu"] = tps * fpt / (args.peak_tflops * 1e12)
            out["torch_attention"] = args.torch_attention
            print("PyTorch : %10.0f tokens/s  MFU %5.1f%%  (torch %s, autocast bf16, %s AdamW, %s attention)"
                  % (tps, 100 * out["torch_mfu"], version, "unfused" if args.smoke else "fused",
                     "scaled_dot_product_attention" if args.torch_attention == "sdpa" else "manual"))
            if s:
                out["ratio_loom_over_torch"] = out["loom_tokens_per_s"] / tps
                print("ratio   : loom / PyTorch = %.2f" % out["ratio_loom_over_torch"])
        except Exception as e:  # noqa: BLE001 - a benchmark reports what failed and goes on
            print("PyTorch peer failed: %s" % e)
            ok = False
        if args.torch_compile:
            try:
                t0 = time.perf_counter()
                tps, _ = run_torch(args, model, train, batch, compiled=True)
                out["torch_compile_tokens_per_s"] = tps
                out["torch_compile_mfu"] = tps * fpt / (args.peak_tflops * 1e12)
                print("PyTorch compiled: %10.0f tokens/s  MFU %5.1f%%  (torch.compile, %.0f s with its compilation)"
                      % (tps, 100 * out["torch_compile_mfu"], time.perf_counter() - t0))
                if s:
                    out["ratio_loom_over_torch_compile"] = out["loom_tokens_per_s"] / tps
                    print("ratio   : loom / PyTorch compiled = %.2f" % out["ratio_loom_over_torch_compile"])
            except Exception as e:  # noqa: BLE001
                print("PyTorch peer under torch.compile failed: %s" % e)
                ok = False
    print("llm.c   : about 60% MFU on A100 (its README's figure, for reference; not measured here)")
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
