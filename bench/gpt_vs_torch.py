#!/usr/bin/python3
"""loom against PyTorch on one CPU thread: the same GPT (bench/bench.deck), one rank, fp32 and bf16.

Usage:
  /usr/bin/python3 bench/gpt_vs_torch.py --loom build/loom --sgemm build/bench/sgemm_peak [--steps N]

  1. build/bench/sgemm_peak: single-thread GFLOP/s of OpenBLAS sgemm, oneDNN fp32 and oneDNN bf16 on
     the model's matrix-product shapes (the peaks of loom's own kernels).
  2. OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 loom run bench/bench.deck --set train.steps=N
     --set run.dir=DIR [--set precision.dtype=bf16], then DIR/summary.json: tokens_per_s (steady
     state, first step excluded), model_flops_per_token, tflops.
  3. The same architecture and AdamW hyper-parameters (read from the deck) in PyTorch float32 with
     torch.set_num_threads(1), and the same under torch.autocast("cpu", dtype=torch.bfloat16): 2
     warm-up steps, then N timed steps on random token batches (stopped after --torch-max-seconds,
     60, once 2 are done: bf16 autocast on a CPU without bf16 arithmetic is ~20x slower than fp32).
  2 and 3 run in --rounds interleaved rounds (3; the order of loom and PyTorch alternates), and
  every figure is the median over the rounds (each round's value in the JSON line, *_rounds).
  4. A table with issue 44's targets (loom fp32 >= 1.5x PyTorch fp32; loom bf16 >= 1.5x PyTorch bf16
     autocast; loom's achieved FLOP/s >= 0.8 of its own kernels' peak, oneDNN fp32 or bf16, in each)
     and one JSON line with every number.
A benchmark, not a test: the exit status is 0 when every part ran (whatever the ratios), 1 otherwise.
--torch-only / --no-sgemm / --fp32-only skip parts.
"""
import argparse
import configparser
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OPENBLAS_SONAME = "libopenblas.so.0"


def _corename_probe():
    """The core OpenBLAS picks by itself here (without OPENBLAS_CORETYPE), probed in a child process
    because the choice is fixed when the library loads. None when OpenBLAS cannot be loaded."""
    code = ("import ctypes; l = ctypes.CDLL(%r); l.openblas_get_corename.restype = ctypes.c_char_p; "
            "print(l.openblas_get_corename().decode())" % OPENBLAS_SONAME)
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return (p.stdout.strip() or None) if p.returncode == 0 else None


def select_openblas_core():
    """loom's rule (driver/blas_core.cpp, also in bench/sgemm_peak.cpp): when OPENBLAS_CORETYPE is
    unset and OpenBLAS picked a pre-AVX core (common on virtual machines) although the CPU has
    AVX-512 or AVX2+FMA, use SkylakeX or Haswell. PyTorch here calls the same OpenBLAS, so it gets
    the same kernels as loom and sgemm_peak. Returns a note for the output."""
    if os.environ.get("OPENBLAS_CORETYPE"):
        return f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']} (set by the caller)"
    core = _corename_probe()
    if core not in ("Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Sandybridge"):
        return f"OpenBLAS core {core or 'unknown'} (own detection)"
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    better = ("SkylakeX" if {"avx512f", "avx512bw", "avx512vl"} <= flags else
              "Haswell" if {"avx2", "fma"} <= flags else None)
    if not better:
        return f"OpenBLAS core {core} (own detection)"
    os.environ["OPENBLAS_CORETYPE"] = better
    return f"OPENBLAS_CORETYPE={better} set like loom does (OpenBLAS detected {core})"


# Before torch loads OpenBLAS: the kernel set loom uses, and one thread for PyTorch's own pools and
# for the BLAS it links.
CORE_NOTE = select_openblas_core()
for _k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_k] = "1"
import torch  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "regression"))
import torch_gpt  # noqa: E402

# Issue 44's targets. (loom bf16 over loom fp32 is printed beside them: a ratio of the CPU more than of loom.)
TARGETS = {"loom_fp32_over_torch_fp32": 1.5, "loom_bf16_over_torch_bf16": 1.5,
           "loom_fp32_fraction_of_peak": 0.8, "loom_bf16_fraction_of_peak": 0.8}


def read_deck(path, sets):
    """The deck's keys as {'section.key': 'value'}, after --set overrides (both loom and torch
    use the same numbers)."""
    cp = configparser.ConfigParser(inline_comment_prefixes=("#", ";"), interpolation=None)
    with open(path) as f:
        cp.read_file(f)
    v = {f"{s}.{k}": val.strip() for s in cp.sections() for k, val in cp[s].items()}
    for s in sets:
        k, val = s.split("=", 1)
        v[k.strip()] = val.strip()
    return v


def torch_cfg(deck):
    need_int = ("model.layers", "model.d_model", "model.heads", "model.seq_len", "model.vocab",
                "train.batch", "train.warmup", "train.micro_batches")
    need_float = ("train.lr", "train.lr_min", "train.weight_decay", "train.beta1", "train.beta2",
                  "train.eps", "train.grad_clip")
    missing = [k for k in need_int + need_float + ("train.schedule",) if k not in deck]
    if missing:
        raise SystemExit(f"bench deck lacks {missing}: keep every model/optimizer key explicit")
    cfg = {k.split(".")[1]: int(deck[k]) for k in need_int}
    cfg.update({k.split(".")[1]: float(deck[k]) for k in need_float})
    cfg["schedule"] = deck["train.schedule"]
    # Llama's block (--set model.arch=llama ...): torch_gpt builds the same architecture.
    for k in ("arch", "kv_heads", "ffn_hidden", "norm_eps", "rope_theta", "tie_embeddings"):
        if "model." + k in deck:
            cfg[k] = deck["model." + k]
    if cfg.get("tie_embeddings") == "auto":
        cfg["tie_embeddings"] = "true" if cfg.get("arch", "gpt2") == "gpt2" else "false"
    return cfg


def model_flops_per_token(c):
    """Matmul FLOPs per trained token (forward + backward = 3x forward): per layer qkv, proj, fc,
    mlp.proj (24 C^2) and attention scores and values over the full T x T (4 T C), plus the tied
    head (2 C V). Used only when loom's summary is unavailable."""
    L, C, T, V = c["layers"], c["d_model"], c["seq_len"], c["vocab"]
    return 3 * (L * (24 * C * C + 4 * T * C) + 2 * C * V)


def torch_blas_core():
    """The OpenBLAS core this (torch) process actually runs with."""
    try:
        import ctypes
        lib = ctypes.CDLL(OPENBLAS_SONAME)
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return lib.openblas_get_corename().decode()
    except (OSError, AttributeError):
        return "unknown"


def run_sgemm(path):
    p = subprocess.run([path], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    if p.returncode != 0:
        raise RuntimeError(f"{path} exited with {p.returncode}: {p.stderr.strip()[-500:]}")
    line = [ln for ln in p.stdout.splitlines() if ln.strip().startswith("{")][-1]
    out = json.loads(line)
    # the kernels each library ran ("bf16 cblas_sgemm (oneDNN refused ...)" where oneDNN has no bf16 kernel)
    kernels = [ln for ln in p.stdout.splitlines() if ln.startswith("kernels: ")]
    if kernels:
        out["kernels"] = kernels[-1][len("kernels: "):]
    return out


def run_loom(loom, deck_path, steps, run_dir, sets):
    # a fresh folder each run: loom refuses to start over an earlier run's results
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir, exist_ok=True)
    summary = os.path.join(run_dir, "summary.json")
    cmd = [loom, "run", deck_path, "--set", f"train.steps={steps}", "--set", f"run.dir={run_dir}"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    print("$ OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 " + " ".join(cmd), flush=True)
    log = os.path.join(run_dir, "bench.log")
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    wall = time.time() - t0
    if p.returncode != 0 or not os.path.exists(summary):
        with open(log) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"loom run exited with {p.returncode}"
                           + ("" if os.path.exists(summary) else f", no {summary}") + f"; log {log}:\n{tail}")
    with open(summary) as f:
        s = json.load(f)
    for k in ("tokens_per_s", "model_flops_per_token"):
        if k not in s:
            raise RuntimeError(f"{summary} lacks '{k}'")
    s["_wall_s"] = wall
    return s


def run_torch(cfg, steps, seed=0, bf16=False, max_seconds=None):
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = torch_gpt.build_model(cfg, torch.float32)
    model.train()
    # foreach=False: the single-tensor AdamW is faster than the multi-tensor one on one CPU thread.
    opt = torch_gpt.make_optimizer(model, cfg, foreach=False)
    B, T, V = cfg["batch"], cfg["seq_len"], cfg["vocab"]
    sched = dict(cfg, steps=steps + 2)
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, V, (2, B, T), generator=g) for _ in range(steps + 2)]
    losses = []

    def step(s):
        x, y = batches[s][0], batches[s][1]
        loss, _, _ = torch_gpt.train_step(model, opt, x, y, s, sched, cfg["micro_batches"])
        losses.append(loss)

    # bf16: autocast over the forward, the backward and the update (the update's ops are not
    # autocast ops: fp32 parameters and AdamW state, as in loom).
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for s in range(2):  # warm-up: allocator, BLAS buffers, optimizer state
            step(s)
        t0 = time.perf_counter()
        done = 0
        for s in range(2, steps + 2):
            step(s)
            done += 1
            # bf16 autocast on a CPU without bf16 arithmetic runs at a few percent of fp32: a few
            # steps measure it as well as twenty
            if max_seconds and done >= 2 and time.perf_counter() - t0 > max_seconds:
                break
        dt = time.perf_counter() - t0
    return dict(tokens_per_s=done * B * T / dt, step_ms=dt / done * 1e3, seconds=dt, steps=done,
                loss_first=losses[0], loss_last=losses[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default="build/loom")
    ap.add_argument("--sgemm", default="build/bench/sgemm_peak")
    ap.add_argument("--deck", default=os.path.join(HERE, "bench.deck"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--run-dir", default="build/bench-run")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                    help="deck override, applied to loom and torch alike")
    ap.add_argument("--torch-only", action="store_true", help="skip loom")
    ap.add_argument("--no-sgemm", action="store_true", help="skip the matrix-product peaks")
    ap.add_argument("--fp32-only", action="store_true", help="skip the bf16 runs")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    ap.add_argument("--torch-max-seconds", type=float, default=60.0,
                    help="stop a PyTorch run's timed steps after this long (at least 2 steps)")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (loom's tokens_per_s excludes the first step)")

    deck = read_deck(args.deck, args.sets)
    cfg = torch_cfg(deck)
    tokens_per_step = cfg["batch"] * cfg["seq_len"]
    dtypes = ["fp32"] if args.fp32_only else ["fp32", "bf16"]
    print(f"bench: layers {cfg['layers']} d_model {cfg['d_model']} heads {cfg['heads']} seq_len "
          f"{cfg['seq_len']} vocab {cfg['vocab']} batch {cfg['batch']} ({tokens_per_step} tokens/step), "
          f"{' and '.join(dtypes)}, {args.steps} timed steps")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()} (interop "
          f"{torch.get_num_interop_threads()}), python {platform.python_version()}, "
          f"cpu {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible")
    res_core = torch_blas_core()
    print(f"BLAS: {CORE_NOTE}; torch runs OpenBLAS core {res_core}")

    ok = True
    res = dict(steps=args.steps, tokens_per_step=tokens_per_step, torch_version=torch.__version__,
               torch_threads=torch.get_num_threads(), torch_blas_core=res_core)

    if not args.no_sgemm:
        try:
            sg = run_sgemm(os.path.abspath(args.sgemm))
            res["sgemm_gflops"] = sg["sgemm_gflops"]
            res["sgemm_blas_core"] = sg.get("core", "unknown")
            for k in ("onednn_f32_gflops", "onednn_bf16_gflops"):
                if sg.get(k):
                    res[k] = sg[k]
            res["gemm_kernels"] = sg.get("kernels", "")
            print(f"matrix-product peaks, one thread: OpenBLAS sgemm {sg['sgemm_gflops']:.1f} GFLOP/s (core "
                  f"{res['sgemm_blas_core']}), oneDNN fp32 {res.get('onednn_f32_gflops', 0):.1f}, oneDNN bf16 "
                  f"{res.get('onednn_bf16_gflops', 0):.1f}\n  kernels: {res['gemm_kernels']}")
        except (OSError, RuntimeError, ValueError, IndexError, KeyError) as e:
            print(f"sgemm_peak failed: {e}")
            ok = False

    # Rounds, interleaved: each round runs loom and PyTorch for each type, the order alternating from
    # one round to the next, so that drift and a neighbour's load hit both alike; the medians count.
    per_round = {}

    def note(key, value):
        per_round.setdefault(key, []).append(value)

    def run_loom_round(dt, r):
        sets = args.sets + (["precision.dtype=bf16"] if dt == "bf16" else [])
        lo = run_loom(os.path.abspath(args.loom), os.path.abspath(args.deck), args.steps,
                      os.path.abspath(args.run_dir) + ("" if dt == "fp32" else "-" + dt), sets)
        note(f"loom_{dt}_tokens_per_s", float(lo["tokens_per_s"]))
        res["model_flops_per_token"] = float(lo["model_flops_per_token"])

    def run_torch_round(dt, r):
        print(f"torch {dt}{' autocast' if dt == 'bf16' else ''}: training (round {r + 1}) ...", flush=True)
        to = run_torch(cfg, args.steps, bf16=dt == "bf16", max_seconds=args.torch_max_seconds)
        note(f"torch_{dt}_tokens_per_s", to["tokens_per_s"])
        note(f"torch_{dt}_step_ms", to["step_ms"])

    for r in range(args.rounds):
        for dt in dtypes:
            order = [run_loom_round, run_torch_round] if r % 2 == 0 else [run_torch_round, run_loom_round]
            for run in order:
                if run is run_loom_round and args.torch_only:
                    continue
                try:
                    run(dt, r)
                except (OSError, RuntimeError, ValueError) as e:
                    print(f"{'loom' if run is run_loom_round else 'torch'} {dt} failed: {e}")
                    ok = False
    for key, values in per_round.items():
        res[key] = statistics.median(values)
        res[key + "_rounds"] = values
    res["rounds"] = args.rounds

    flops_tok = res.get("model_flops_per_token")
    flops_src = "loom summary"
    if flops_tok is None:
        flops_tok, flops_src = float(model_flops_per_token(cfg)), "bench estimate"
        res["model_flops_per_token_estimate"] = flops_tok
    for who in ("loom", "torch"):
        for dt in dtypes:
            if f"{who}_{dt}_tokens_per_s" in res:
                res[f"{who}_{dt}_gflops"] = res[f"{who}_{dt}_tokens_per_s"] * flops_tok / 1e9
    if "loom_fp32_tokens_per_s" in res:  # the names earlier versions printed (compare_commits.py)
        res["loom_tokens_per_s"] = res["loom_fp32_tokens_per_s"]
        res["loom_gflops"] = res["loom_fp32_gflops"]
    if "torch_fp32_tokens_per_s" in res:
        res["torch_tokens_per_s"] = res["torch_fp32_tokens_per_s"]

    def ratio(name, a, b):
        if a in res and b in res:
            res[name] = res[a] / res[b]
    ratio("loom_fp32_over_torch_fp32", "loom_fp32_tokens_per_s", "torch_fp32_tokens_per_s")
    ratio("loom_bf16_over_loom_fp32", "loom_bf16_tokens_per_s", "loom_fp32_tokens_per_s")
    ratio("loom_bf16_over_torch_bf16", "loom_bf16_tokens_per_s", "torch_bf16_tokens_per_s")
    ratio("torch_bf16_over_torch_fp32", "torch_bf16_tokens_per_s", "torch_fp32_tokens_per_s")
    ratio("loom_fp32_fraction_of_peak", "loom_fp32_gflops", "onednn_f32_gflops")
    ratio("loom_bf16_fraction_of_peak", "loom_bf16_gflops", "onednn_bf16_gflops")
    ratio("loom_fraction_of_sgemm_peak", "loom_fp32_gflops", "sgemm_gflops")
    ratio("ratio_loom_over_torch", "loom_fp32_tokens_per_s", "torch_fp32_tokens_per_s")

    def f(key, fmt):
        return format(res[key], fmt) if key in res else "-"

    rows = [(f"{who} {dt} tokens/s", f(f"{who}_{dt}_tokens_per_s", ".1f")) for dt in dtypes for who in ("loom", "torch")]
    rows += [(f"{who} {dt} achieved GFLOP/s", f(f"{who}_{dt}_gflops", ".2f")) for dt in dtypes for who in ("loom", "torch")]
    rows += [("model FLOPs/token (" + flops_src + ")", format(flops_tok, ".4g")),
             ("OpenBLAS sgemm peak GFLOP/s", f("sgemm_gflops", ".2f")),
             ("oneDNN fp32 peak GFLOP/s", f("onednn_f32_gflops", ".2f")),
             ("oneDNN bf16 peak GFLOP/s", f("onednn_bf16_gflops", ".2f")),
             ("torch bf16 / torch fp32", f("torch_bf16_over_torch_fp32", ".3f")),
             ("loom bf16 / loom fp32", f("loom_bf16_over_loom_fp32", ".3f")),
             ("rounds (medians)", str(args.rounds))]
    for k, t in TARGETS.items():
        rows.append((f"{k.replace('_', ' ')} (target >= {t})", f(k, ".3f")))
    w = max(len(r[0]) for r in rows)
    print()
    for name, val in rows:
        print(f"  {name:<{w}}  {val:>12}")
    met = {k: res[k] >= t for k, t in TARGETS.items() if k in res}
    res["targets_met"] = met
    print("\n  targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items()))
    print(json.dumps(res, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
