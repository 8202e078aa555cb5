#!/usr/bin/python3
"""Attention alone on one GPU: loom's flash kernels and cuDNN's through loom (build/bench/attention_gpu)
against PyTorch's scaled_dot_product_attention, forward + backward, causal, bf16, the same shapes in
one run, and the ratios.

Usage (on a machine with a GPU):
  /usr/bin/python3 bench/attention_gpu.py --bench build/bench/attention_gpu [--iters N] [--shape B,T,NH,HS ...]

  1. attention_gpu: per shape and kernel (flash, cudnn), milliseconds per forward + backward as the
     model calls them under bf16 (qkv fp32, out saved bf16; median of N after 3 warm-ups), or why the
     device refuses that kernel.
  2. PyTorch: q, k, v [B, NH, T, HS] bf16 on the same GPU, scaled_dot_product_attention(is_causal=True)
     and its backward (torch picks its backend: flash, cuDNN or memory-efficient), timed the same way
     (a torch without it, before 2.0: the attention written out, named "manual" in the table).
  3. A line per shape: each kernel's ms, its TFLOP/s as `loom plan` counts attention (12 B T^2 C, the
     whole T x T), and speed relative to PyTorch (PyTorch's ms / the kernel's; issue 45's target for
     cudnn: >= 1.0).
Shapes by default: GPT-2 124M's (16, 1024, 12, 64), T 4096, and head size 128 at both T.
A benchmark, not a test: exit 0 when every part ran, 1 otherwise; no GPU: exit 77 saying so.

--smoke runs all of it where there is no GPU, to check the script, not to measure: one tiny shape,
loom's cuda back end on the emulated device (LOOM_CUDA_BACKEND_LIBRARY = build/lib/libloom_cuda_emu.so,
which the caller sets; cuDNN is refused there, and says so) and PyTorch on the CPU.
"""
import argparse
import json
import subprocess
import sys
import time

DEFAULT_SHAPES = [(16, 1024, 12, 64), (4, 4096, 12, 64), (16, 1024, 6, 128), (4, 4096, 6, 128)]
SMOKE_SHAPES = [(1, 64, 2, 16)]


def torch_ms(torch, shape, iters, device):
    B, T, NH, hs = shape
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(B, NH, T, hs, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(B, NH, T, hs, generator=g, device=device, dtype=torch.bfloat16)
    sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if sdpa is None:  # torch before 2.0 (Debian 12's): the attention written out, and said so in the table
        mask = torch.ones(T, T, device=device, dtype=torch.bool).tril()

        def sdpa(q, k, v, is_causal):
            s = (q @ k.transpose(-2, -1)) * hs ** -0.5
            return s.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    def once():
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=True).backward(dout)
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        once()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        once()
        ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    return ms[len(ms) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", required=True, help="build/bench/attention_gpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shape", action="append", default=[], help="B,T,NH,HS (repeatable)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    import torch
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("attention_gpu.py: no GPU visible to PyTorch (torch %s): nothing measured" % torch.__version__)
        return 77
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] or (SMOKE_SHAPES if args.smoke
                                                                          else DEFAULT_SHAPES)
    iters = 2 if args.smoke else args.iters
    argv = [args.bench, "--iters", str(iters)] + [str(x) for s in shapes for x in s]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    sys.stderr.write(p.stderr)
    loom = {}
    for line in p.stdout.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "error" in r and "kernel" not in r:
            print("attention_gpu: %s" % r["error"])
            return 1
        loom[(r["B"], r["T"], r["heads"], r["head_size"], r["kernel"])] = r
    ok = p.returncode == 0
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke: not a measurement)"
    print("attention forward + backward, causal, bf16, on %s; torch %s; ms per call (median of %d)" %
          (name, torch.__version__, iters))
    print("%-20s %-7s %10s %9s %10s %11s" % ("shape B,T,NH,HS", "kernel", "ms", "TFLOP/s", "torch ms",
                                            "vs torch"))
    for shape in shapes:
        t = torch_ms(torch, shape, iters, device)
        C = shape[2] * shape[3]
        flops = 12.0 * shape[0] * shape[1] * shape[1] * C
        peer = "torch" if hasattr(torch.nn.functional, "scaled_dot_product_attention") else "manual"
        print("%-20s %-7s %10.3f %9.2f %10s %11s" % (",".join(map(str, shape)), peer, t, flops / (t * 1e-3) / 1e12,
                                                     "", ""))
        for kernel in ("flash", "cudnn"):
            r = loom.get(shape + (kernel,))
            if r is None:
                print("%-20s %-7s (no result)" % (",".join(map(str, shape)), kernel))
                ok = False
            elif "refused" in r:
                print("%-20s %-7s refused: %s" % (",".join(map(str, shape)), kernel, r["refused"]))
            elif "error" in r:
                print("%-20s %-7s error: %s" % (",".join(map(str, shape)), kernel, r["error"]))
                ok = False
            else:
                print("%-20s %-7s %10.3f %9.2f %10.3f %10.3fx" % (",".join(map(str, shape)), kernel, r["ms"],
                                                                  r["tflops"], t, t / r["ms"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
