#!/usr/bin/env python3
"""The GPU path's cases (run.backend). One case per invocation:

  refusal       run.backend = cuda where it cannot run is refused with exit 2 saying why: on a machine
                without a GPU (or a loom built without CUDA) at one and two ranks; on a GPU machine with
                more ranks than the node has GPUs (unless run.share_gpu). auto runs on what there is and
                says so in the banner.
  matches_host  (label gpu; skipped, exit 77, without a GPU) the CUDA back end trains the same model
                as the host back end step for step: fp32 within 1e-4 relative per step over 20 steps
                (two shapes: head size 8, whose qkv slices are only 32-byte aligned, held to 1e-6, and
                a wider one), bf16 matrix products within 1e-3, model.attention = flash (the fused
                kernels against the host's twin, head size 64) within 5e-3, model.attention = cudnn
                (cuDNN's kernels against the host's flash twin; where cuDNN runs) within 5e-3;
                checkpoints cross over: a GPU run resumes the host's step-10 checkpoint and the host
                resumes the GPU's, each within 1e-4 of the uninterrupted run (cudnn against flash: 5e-3).
  fenced        (every machine) every strategy's device path without a GPU: each layout of LAYOUTS (data,
                tensor with and without sequence parallelism, the three pipeline schedules, ZeRO 1-3,
                bf16, fp16 with loss scaling, int8, top-k and PowerSGD compression, int8 on ZeRO-2's pieces,
                flash attention with bf16 on tp 2 and with recompute on pp 2, experts over ep 2 and on tp 2;
                2 and 4 ranks) on
                run.backend = fenced, whose tensors the host cannot touch and whose communicators stage
                device buffers through host copies: the host's losses and gradient norms, bit for bit;
                and checkpoints cross over (CROSSOVER layouts): each back end resumes the other's
                mid-run checkpoint and goes on bit for bit as the uninterrupted host run.
  cuda_layouts  (label gpu) the same layouts on the CUDA back end, the ranks sharing the GPU
                (run.share_gpu: device buffers through host copies and MPI, as NCCL refuses two ranks
                on one GPU): the host's losses over 20 steps, fp32 within 1e-4 relative, 16-bit 2e-3;
                flash attention 2e-3 (its bf16 operands); where cuDNN runs, model.attention = cudnn
                on tp 2 (bf16) and pp 2 (recompute) against the host's flash twin, 5e-3; checkpoints
                cross over as in `fenced`, within the same bounds.
  decks         (label gpu) every one-rank deck of inputs/ (quickstart, synthetic, bf16, fp16 with its
                loss scaling, memory_saving with recompute and micro-batches, long_context with flash
                attention), 30 steps with their evaluation and checkpoints on each back end: the same
                losses, every step, within 1e-4 (fp32) or 2e-3 (16-bit, or flash attention) relative;
                where cuDNN runs, long_context with model.attention = cudnn against the host's flash
                twin, 5e-3.
  plan_memory   (label gpu) `loom plan` of cuda decks against the CUDA back end's ledger, rank by rank and
                category by category within 5% + 4 KiB (the workspace beyond cuBLASLt's 32 MiB): one rank
                in each precision, with flash attention and with recompute; with a device per rank
                (on the emulated device, regression.gpu.emulated_plan) dp, tp with sequence
                parallelism, 1F1B, ZeRO-3, int8 and top-k compression and dp x tp over NCCL too.
  bundle        (CUDA builds) bench/gpu_bundle.sh packs this build for a node without loom's
                libraries and bench/gpu_session.sh runs its smoke stage from the bundle: its loom, test
                program and MPI launcher find their libraries (refusal passes at 1 and 2 ranks), and
                without a GPU the kernel test says it was skipped and the session fails.

  gpu_checks.py --loom build/loom --workdir build/gpu-checks [--mpirun mpiexec ...] CASE
"""
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Case, case_arguments, losses, rows  # noqa: E402

SKIP = 77  # CTest's SKIP_RETURN_CODE for these cases

TINY = ("[model]\nlayers = 2\nd_model = 32\nheads = 4\nseq_len = 16\nvocab = 64\n"
        "[train]\nsteps = 20\nbatch = 8\nlr = 3e-3\nwarmup = 2\nseed = 42\neval_every = 0\n"
        "[data]\nval_fraction = 0\n")
WIDER = ["model.layers=4", "model.d_model=256", "model.heads=4", "model.seq_len=128", "model.vocab=512",
         "train.batch=8"]


def gpu_visible(case):
    """Whether this loom runs on a GPU here: an `auto` run's banner says which back end it took."""
    # run.peak_tflops given: no timing products (4096-wide on a device: 30 s on the emulated one)
    p, _ = case.loom("probe_auto", 1, ["run.backend=auto", "train.steps=1", "run.peak_tflops=1"])
    m = re.search(r"backend : run\.backend = auto: (\w+)", p.stdout)
    case.check(m is not None, "the banner names the back end auto chose:\n" + p.stdout[:2000])
    if m and m.group(1) == "host":
        case.expect(p.stdout, [r"auto: no CUDA device \(.+\)"], "the banner of auto on the host")
    return bool(m) and m.group(1) == "cuda", p.stdout


def gpu_case(args, name):
    """The case `name`, or None (having said why) where loom sees no GPU."""
    c = Case(args, name, TINY)
    on_gpu, _ = gpu_visible(c)
    if not on_gpu:
        print("SKIPPED: no GPU visible to loom here (run.backend = auto took the host)")
        return None
    return c


def relative_gap(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")


def refusal(args):
    c = Case(args, "refusal", TINY)
    on_gpu, _ = gpu_visible(c)
    if not on_gpu:
        for ranks in (1, 2):  # every rank refuses alike, and none hangs
            p, _ = c.loom("cuda_%d_ranks" % ranks, ranks, ["run.backend=cuda", "parallel.dp=%d" % ranks], expect=2)
            c.expect(p.stderr, [r"run\.backend = cuda: (no CUDA device is visible on this node|this loom was built "
                                r"without the CUDA back end|.*libloom_cuda\.so)",
                                r"run\.backend = host"], "the refusal without a GPU at %d ranks" % ranks)
    else:
        p, _ = c.loom("cuda_two_ranks", 2, ["run.backend=cuda", "parallel.dp=2"], expect=2)
        c.expect(p.stderr, [r"run\.backend = cuda: 2 ranks on this node but 1 CUDA device", r"run\.share_gpu"],
                 "the refusal of two ranks on one GPU")
    p, _ = c.loom("bad_value", 1, ["run.backend=gpu"], expect=2)
    c.expect(p.stderr, [r"run\.backend", r"host, cuda, auto|host\|cuda\|auto|cuda"], "the refusal of run.backend = gpu")
    return c.done("refusal")


def against_host(c, shapes, steps=20):
    """One rank: each (name, sets, tolerance, first-step tolerance) trained on the host and on cuda;
    the cuda run's losses within `tolerance` relative of the host's every step, its first step's
    (before any update has amplified a rounding) within the first-step tolerance."""
    for shape in shapes:
        name, sets, tol, first_tol = shape[:4]
        # model.attention = cudnn runs on the host as its twin there, flash (the same contract and roundings)
        host_sets = [x.replace("model.attention=cudnn", "model.attention=flash") for x in sets]
        _, host = c.loom(name + "_host", 1, host_sets + ["run.backend=host", "train.steps=%d" % steps])
        p, dev = c.loom(name + "_cuda", 1, sets + ["run.backend=cuda", "train.steps=%d" % steps])
        c.expect(p.stdout, [r"backend : run\.backend = cuda: cuda \(device 0: "], name + " banner")
        lh, ld = losses(host), losses(dev)
        gap, first = relative_gap(ld, lh), relative_gap(ld[:1], lh[:1])
        print("%s: %d steps, host %.9f -> %.9f, cuda %.9f -> %.9f, largest relative gap %.2e (tolerance %g), "
              "first step %.2e (tolerance %g)" % (name, len(lh), lh[0] if lh else 0, lh[-1] if lh else 0,
                                                  ld[0] if ld else 0, ld[-1] if ld else 0, gap, tol, first, first_tol))
        c.check(len(lh) == steps and len(ld) == steps, "%s: %d steps each (host %d, cuda %d)"
                % (name, steps, len(lh), len(ld)))
        c.check(gap <= tol, "%s: the cuda run's losses are %.2e from the host's (tolerance %g)" % (name, gap, tol))
        c.check(first <= first_tol, "%s: the first step's loss is %.2e from the host's (tolerance %g)"
                % (name, first, first_tol))


def checkpoints_cross(c, cuda_sets=()):
    """One rank: a GPU run resumes the host's step-10 checkpoint and the host the GPU's, each within
    1e-4 of the uninterrupted run (cuda_sets: the GPU runs' own keys, e.g. model.attention = cudnn, whose
    host side is flash, held to the flash path's 5e-3)."""
    ck = ["checkpoint.every=10", "train.steps=20"]
    cuda_sets = list(cuda_sets)
    host_sets = ["model.attention=flash"] if cuda_sets else []
    tol = 5e-3 if cuda_sets else 1e-4
    suffix = "_cudnn" if cuda_sets else ""
    _, host = c.loom("ckpt_host" + suffix, 1, ck + host_sets + ["run.backend=host"])
    _, dev = c.loom("ckpt_cuda" + suffix, 1, ck + cuda_sets + ["run.backend=cuda"])
    for tag, frm, backend, whole, sets in [("cuda_resumes_host", host, "cuda", host, cuda_sets),
                                           ("host_resumes_cuda", dev, "host", dev, host_sets)]:
        ckpt = os.path.join(frm, "checkpoints", "ckpt-00000010.h5")
        c.check(os.path.exists(ckpt), "%s: %s was written" % (tag, ckpt))
        p, resumed = c.loom(tag + suffix, 1, ck + sets + ["run.backend=" + backend, "checkpoint.resume=" + ckpt,
                                                          "checkpoint.dir=" + os.path.join(c.dir, tag + suffix + "_ckpt")])
        tail, ref = losses(resumed), losses(whole)[10:]
        gap = relative_gap(tail, ref)
        print("%s%s: steps 11-20 from %s, largest relative gap to the uninterrupted run %.2e" % (tag, suffix, ckpt, gap))
        c.check(len(tail) == 10 and gap <= tol, "%s%s: %d steps, gap %.2e (tolerance %g)" % (tag, suffix, len(tail), gap,
                                                                                          tol))


def cudnn_refused(c):
    """Why this device's loom refuses model.attention = cudnn for WIDER's shape (None: it runs). A GPU
    without cuDNN says so in the log and the cudnn cases are not run."""
    p, _ = c.loom("cudnn_probe", 1, WIDER + ["model.attention=cudnn", "run.backend=cuda", "train.steps=1"],
                  expect=None)
    if p.returncode == 0:
        return None
    why = (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
    print("model.attention = cudnn refused on this GPU, its cases not run: %s" % why)
    return why


def matches_host(args):
    c = gpu_case(args, "matches_host")
    if c is None:
        return SKIP
    # The bound is 1e-4 over 20 steps in fp32; the tiny model is held far tighter (it agrees
    # to ~1e-8), so a kernel bug that moves the loss by less than 1e-4 still shows there.
    # flash: the device's fused kernels against the host's twin (the same bf16 roundings; the
    # tensor cores' summation order tips a few), at a head size of 64 as GPT-2's. A tipped bf16
    # rounding is 2^-8 of an operand, and WIDER's training (lr 3e-3, gradient norms up to 8) amplifies
    # it: on the emulated device (the same kernels' source, in fp32 wmma sums of another order than
    # the host twin's) the first step agrees to 8e-8 and step 16 only to 1.1e-3, so the old 1e-3
    # over 20 steps would fail there, and a GPU's tensor cores differ from the host more; 5e-3 over
    # 20 steps, and the first step, before any update has amplified a tipped rounding, to 1e-4.
    # (Bounds from the emulated device; on an H200, wider_flash's largest gap was 7.97e-04, its first
    # step 1.36e-07.)
    against_host(c, [("tiny_fp32", [], 1e-6, 1e-6), ("wider_fp32", WIDER, 1e-4, 1e-5),
                     ("tiny_bf16", ["precision.dtype=bf16"], 1e-3, 1e-4),
                     ("wider_flash", WIDER + ["model.attention=flash"], 5e-3, 1e-4),
                     ("tiny_llama_fp32", ["model.arch=llama", "model.kv_heads=2"], 1e-6, 1e-6)])
    # cudnn: cuDNN's kernels against the host's flash twin, with the flash path's 5e-3 over 20 steps;
    # cuDNN rounds its normalised probabilities to bf16 where the twin rounds its tiles', so the first
    # step is held to 1e-3 (not yet measured on a GPU), and the cuda run resumes the host's checkpoint.
    if cudnn_refused(c) is None:
        against_host(c, [("wider_cudnn", WIDER + ["model.attention=cudnn"], 5e-3, 1e-3)])
        checkpoints_cross(c, ["model.attention=cudnn"])
    checkpoints_cross(c)
    return c.done("matches_host")


def decks(args):
    """Every one-rank deck of inputs/, 30 steps on each back end."""
    c = gpu_case(args, "decks")
    if c is None:
        return SKIP
    inputs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "inputs")
    runs = [(d, []) for d in ("quickstart", "synthetic", "bf16", "fp16", "memory_saving", "long_context", "llama")]
    if cudnn_refused(c) is None:  # long_context with cuDNN's attention, the host running its flash twin
        runs.append(("long_context", ["model.attention=cudnn"]))
    for deck, sets in runs:
        text = open(os.path.join(inputs, deck + ".deck")).read()
        tol = 2e-3 if re.search(r"dtype\s*=\s*(bf16|fp16)|attention\s*=\s*flash", text) else 1e-4
        tol = 5e-3 if sets else tol
        name = deck + ("_cudnn" if sets else "")
        common = sets + ["train.steps=30", "train.log_every=1", "checkpoint.dir=" + os.path.join(c.dir, name + "_%s_ckpt")]
        path = os.path.abspath(os.path.join(inputs, deck + ".deck"))
        got = {}
        for backend in ("host", "cuda"):
            cmd_sets = [x.replace("%s", backend) for x in common] + ["run.backend=" + backend]
            cmd_sets = host_sets(cmd_sets) if backend == "host" else cmd_sets
            _, rundir = c.loom(name + "_" + backend, 1, cmd_sets, deck=path)
            got[backend] = rows(rundir)
        lh = [r["loss"] for r in got["host"]]
        ld = [r["loss"] for r in got["cuda"]]
        vh = [r["val_loss"] for r in got["host"] if "val_loss" in r]
        vd = [r["val_loss"] for r in got["cuda"] if "val_loss" in r]
        gap = relative_gap(ld, lh)
        print("%s: %d steps, loss host %.6f cuda %.6f, largest relative gap %.2e%s (tolerance %g)"
              % (name, len(lh), lh[-1] if lh else 0, ld[-1] if ld else 0, gap,
                 ", validation gap %.2e" % relative_gap(vd, vh) if vh else "", tol))
        c.check(len(lh) == 30 and gap <= tol, "%s: %d steps, gap %.2e (tolerance %g)" % (name, len(lh), gap, tol))
        c.check(relative_gap(vd, vh) <= tol if vh else True, "%s: validation losses differ" % name)
    return c.done("decks")


# Every strategy on a device back end, as (name, ranks, --set overrides): the layouts of several
# ranks that the regression cases hold, on the host, to training the same model as one process.
LAYOUTS = [
    ("dp2", 2, ["parallel.dp=2"]),
    ("tp2", 2, ["parallel.tp=2"]),
    ("tp2_sp", 2, ["parallel.tp=2", "tensor.sequence_parallel=true"]),
    ("pp2_gpipe", 2, ["parallel.pp=2", "train.micro_batches=4"]),
    ("pp2_1f1b_tied_grads", 2, ["parallel.pp=2", "train.micro_batches=4", "pipeline.schedule=1f1b"]),
    ("pp2_interleaved", 2, ["parallel.pp=2", "train.micro_batches=4", "pipeline.schedule=1f1b",
                            "pipeline.virtual_stages=2", "model.layers=4"]),
    ("zero1_dp2", 2, ["parallel.dp=2", "zero.stage=1"]),
    ("zero2_dp2", 2, ["parallel.dp=2", "zero.stage=2"]),
    ("zero3_dp2", 2, ["parallel.dp=2", "zero.stage=3", "zero.bucket_mb=0.01"]),
    ("bf16_dp2", 2, ["parallel.dp=2", "precision.dtype=bf16"]),
    ("fp16_dp2_loss_scaling", 2, ["parallel.dp=2", "precision.dtype=fp16", "precision.reduce_dtype=fp16"]),
    ("int8_dp2", 2, ["parallel.dp=2", "compression.method=int8", "compression.start_step=2"]),
    ("topk_dp2", 2, ["parallel.dp=2", "compression.method=topk", "compression.ratio=0.1",
                     "compression.start_step=2"]),
    ("powersgd_dp2", 2, ["parallel.dp=2", "compression.method=powersgd", "compression.rank=2",
                         "compression.start_step=2"]),
    ("int8_zero2_dp2_micro2", 2, ["parallel.dp=2", "zero.stage=2", "train.micro_batches=2",
                                  "compression.method=int8"]),
    ("dp2_tp2", 4, ["parallel.dp=2", "parallel.tp=2"]),
    ("dp2_pp2_zero1_bf16", 4, ["parallel.dp=2", "parallel.pp=2", "zero.stage=1", "train.micro_batches=2",
                               "precision.dtype=bf16"]),
    # model.attention = flash (head size 16: TINY's d_model over 2 heads): the device's fused kernels
    # against the host's twin, with recompute and a 16-bit saved output.
    ("flash_tp2_bf16", 2, ["model.heads=2", "model.attention=flash", "parallel.tp=2", "precision.dtype=bf16"]),
    ("flash_pp2_recompute", 2, ["model.heads=2", "model.attention=flash", "parallel.pp=2", "train.micro_batches=4",
                                "model.recompute=true"]),
    # Context parallelism: the ring's kernels (attention_ring_*, copy_rows) with fp32 operands, and with
    # flash's bf16 ones under bf16 products.
    ("cp2", 2, ["parallel.cp=2"]),
    ("flash_cp2_bf16", 2, ["model.heads=2", "model.attention=flash", "parallel.cp=2", "precision.dtype=bf16"]),
    # Experts (the expert row kernels, the router's host round trip): 4 experts over ep 2 in bf16 (the
    # all-to-all of device rows), and on tp 2 (each expert split; the gate gradients summed over tp).
    ("moe_ep2_bf16", 2, ["model.experts=4", "model.expert_capacity=1.25", "parallel.dp=2", "parallel.ep=2",
                         "precision.dtype=bf16"]),
    ("moe_tp2", 2, ["model.experts=4", "parallel.tp=2"]),
    # Llama's block (RMSNorm, rotary GQA, SwiGLU kernels): multi-query on tp 2 (the kv head whole on both
    # ranks, its gradient summed), and flash attention on a bf16 pipeline.
    ("llama_tp2_mqa", 2, ["model.arch=llama", "model.kv_heads=1", "parallel.tp=2"]),
    ("llama_flash_pp2_bf16", 2, ["model.arch=llama", "model.heads=2", "model.kv_heads=1", "model.attention=flash",
                                 "parallel.pp=2", "train.micro_batches=4", "precision.dtype=bf16"]),
]


# model.attention = cudnn (head size 16): cuDNN's kernels against the host's flash twin, on a GPU where
# cuDNN takes them (cuda_layouts adds them then; the host has no cuDNN, the emulated device neither).
CUDNN_LAYOUTS = [
    ("cudnn_tp2_bf16", 2, ["model.heads=2", "model.attention=cudnn", "parallel.tp=2", "precision.dtype=bf16"]),
    ("cudnn_pp2_recompute", 2, ["model.heads=2", "model.attention=cudnn", "parallel.pp=2", "train.micro_batches=4",
                                "model.recompute=true"]),
]


def host_sets(sets):
    """What the host runs for a device's sets: model.attention = cudnn as its twin there, flash."""
    return [x.replace("model.attention=cudnn", "model.attention=flash") for x in sets]


def layouts_on(c, backend, steps, extra, compare, only=None, env=None, tag="", banner=None, more=()):
    """Each of LAYOUTS (or those named in `only`), and `more`, trained on the host and on `backend` (its
    runs with `env` added to the environment, named with `tag`, their banners matching `banner` if
    given); compare(name, sets, host rows, device rows, steps) checks them."""
    for name, ranks, sets in LAYOUTS + list(more):
        if only is not None and name not in only:
            continue
        common = sets + ["train.steps=%d" % steps, "train.log_every=1", "run.peak_tflops=1"]
        _, host = c.loom(name + "_host", ranks, host_sets(common) + ["run.backend=host"])
        p, dev = c.loom(name + "_" + backend + tag, ranks, common + ["run.backend=" + backend] + extra, env=env)
        if banner:
            c.expect(p.stdout, [banner], name + tag + " banner")
        elif backend == "fenced":
            c.expect(p.stdout, [r"backend : run\.backend = fenced: fenced"], name + " banner")
        else:  # ranks sharing a GPU stage through host copies (NCCL refuses them); on several GPUs, NCCL
            c.expect(p.stdout, [r"device buffers between ranks: (host copies over MPI \(ranks share a GPU\)|NCCL)"],
                     name + " banner")
        compare(name, sets, rows(host), rows(dev), steps)


# Layouts whose checkpoints cross between the back ends: sharded tensors (tp, ZeRO-3 shares), pipeline
# stages, compression's error-feedback residuals (host memory on a device back end), 16-bit masters.
CROSSOVER = ["tp2_sp", "pp2_1f1b_tied_grads", "zero3_dp2", "int8_dp2", "dp2_pp2_zero1_bf16"]


def crossover(c, backend, extra, steps, compare, only=CROSSOVER):
    """Checkpoints of CROSSOVER layouts (or those named in `only`) cross between the host and
    `backend`: each writes one at step steps/2; the other resumes it; compare(name, sets,
    uninterrupted host rows, resumed rows)."""
    half = steps // 2
    for name, ranks, sets in [x for x in LAYOUTS if x[0] in only]:
        common = sets + ["train.steps=%d" % steps, "train.log_every=1", "run.peak_tflops=1",
                         "checkpoint.every=%d" % half]
        runs = {}
        for b, more in (("host", []), (backend, extra)):
            _, runs[b] = c.loom("%s_ckpt_%s" % (name, b), ranks, common + ["run.backend=" + b] + more)
        for frm, to, more in (("host", backend, extra), (backend, "host", [])):
            ckpt = os.path.join(runs[frm], "checkpoints", "ckpt-%08d.h5" % half)
            c.check(os.path.exists(ckpt), "%s: %s was written" % (name, ckpt))
            tag = "%s_%s_resumes_%s" % (name, to, frm)
            _, resumed = c.loom(tag, ranks, common + ["run.backend=" + to, "checkpoint.resume=" + ckpt,
                                                       "checkpoint.dir=" + os.path.join(c.dir, tag + "_ckpt")] + more)
            compare(tag, sets, rows(runs["host"])[half:], rows(resumed))


def fenced(args):
    """Every strategy's device path without a GPU: bit for bit the host's model."""
    c = Case(args, "fenced", TINY)

    def same(name, sets, host, dev, steps):
        lh = [(r["loss"], r.get("grad_norm")) for r in host]
        ld = [(r["loss"], r.get("grad_norm")) for r in dev]
        print("%s: %d steps, host loss %s, fenced %s" % (name, len(ld), lh[-1][0] if lh else None,
                                                          ld[-1][0] if ld else None))
        c.check(len(lh) == steps and lh == ld, "%s: fenced losses and gradient norms are not the host's, bit "
                "for bit:\n  host   %s\n  fenced %s" % (name, lh, ld))

    layouts_on(c, "fenced", 6, [], same)
    crossover(c, "fenced", [], 8, lambda name, sets, host, dev: same(name, sets, host, dev, 4))
    return c.done("fenced")


def close_to_host(c, norms=False):
    """The comparison of a cuda run's rows with the host's: fp32 within 1e-4 relative per step; 16-bit
    products, or flash attention's bf16 operands, whose roundings the device's other summation order
    tips now and then, 2e-3. With `norms`, the gradient norms too (a reduction of stale gradients
    shows there first)."""
    def close(name, sets, host, dev, steps):
        sixteen = any(x.startswith("precision.dtype=") and not x.endswith("fp32") for x in sets)
        tol = 2e-3 if sixteen or "model.attention=flash" in sets else 1e-4
        if "model.attention=cudnn" in sets:  # cuDNN against the host's flash twin: other rounding points
            tol = 5e-3
        lh, ld = [r["loss"] for r in host], [r["loss"] for r in dev]
        gap = relative_gap(ld, lh)
        norm_gap = relative_gap([r.get("grad_norm", 0) for r in dev], [r.get("grad_norm", 0) for r in host])
        # Compression quantizes the gradients: an element the other summation order moves across an
        # int8 step changes the norm by a step (int8 on ZeRO-2: 1.8e-4 here), the loss far less; bf16's
        # norms differ by 1.0e-3 here (fp32 layouts by 2e-7): 5e-3 for both, on any CPU's BLAS.
        quantized = sixteen or any(x.startswith("compression.method=") for x in sets)
        norm_tol = 5e-3 if quantized else tol
        print("%s: %d steps, loss host %.6f cuda %.6f, largest relative gap %.2e (tolerance %g)%s"
              % (name, len(ld), lh[-1] if lh else 0, ld[-1] if ld else 0, gap, tol,
                 ", gradient norms %.2e (tolerance %g)" % (norm_gap, norm_tol) if norms else ""))
        c.check(len(lh) == steps and gap <= tol, "%s: %d steps, gap %.2e (tolerance %g)" % (name, len(ld), gap, tol))
        c.check(not norms or norm_gap <= norm_tol, "%s: gradient norms %.2e apart (tolerance %g)"
                % (name, norm_gap, norm_tol))
    return close


def cuda_layouts(args):
    """Every strategy on the CUDA back end, ranks sharing the GPU where there is one: the host's model,
    fp32 within 1e-4 relative per step, 16-bit within 2e-3."""
    c = gpu_case(args, "cuda_layouts")
    if c is None:
        return SKIP
    close = close_to_host(c)
    # 20 steps on a GPU; the emulated device's run in the suite (regression.gpu.emulated_layouts)
    # takes fewer (LOOM_GPU_CASE_STEPS), its kernels being the CPU's emulation of the device's.
    steps = int(os.environ.get("LOOM_GPU_CASE_STEPS", "20"))
    cudnn = CUDNN_LAYOUTS if cudnn_refused(c) is None else []
    layouts_on(c, "cuda", steps, ["run.share_gpu=true"], close, more=cudnn)
    crossover(c, "cuda", ["run.share_gpu=true"], steps,
              lambda name, sets, host, dev: close(name, sets, host, dev, steps - steps // 2))
    return c.done("cuda_layouts")


# Over the NCCL communicator (core/cuda/comm_nccl.cpp), each rank on an emulated device of its own:
# every NCCL operation loom issues (all-reduce; reduce-scatter, even and as a group of reduces;
# all-gather, even and as a group of broadcasts; send and receive; bf16 and fp16 sums), at 2 and 4 ranks.
NCCL_LAYOUTS = ["dp2", "tp2_sp", "pp2_1f1b_tied_grads", "zero2_dp2", "zero3_dp2", "bf16_dp2", "fp16_dp2_loss_scaling",
                "int8_zero2_dp2_micro2", "topk_dp2", "powersgd_dp2", "dp2_tp2"]


def emulated_environment(c, library):
    """What a user sets wrong around the emulated device: each refused with exit 2 naming the variable
    and what would do, a run.backend = auto that falls back to the host warning that the library it
    was given failed; and the emulated device's own NCCL taken where LOOM_NCCL_LIBRARY is unset."""
    two = {"LOOM_CUDA_EMU_DEVICES": "2"}
    dp2 = ["run.backend=cuda", "parallel.dp=2", "train.steps=1"]
    p, _ = c.loom("nccl_missing", 2, dp2, env=dict(two, LOOM_NCCL_LIBRARY="/nonexistent/libnccl.so.2"), expect=2)
    c.expect(p.stderr, [r"LOOM_NCCL_LIBRARY = /nonexistent/libnccl\.so\.2 cannot be loaded", r"run\.share_gpu = true"],
             "a LOOM_NCCL_LIBRARY that does not load")
    c.check(p.stderr.count("device buffers need NCCL") == 1, "the NCCL refusal said once:\n" + p.stderr)
    p, _ = c.loom("nccl_default", 2, dp2, env=dict(two, LOOM_NCCL_LIBRARY=""))
    c.expect(p.stdout, [r"device buffers between ranks: NCCL 0\.0\.0"], "the emulated device's own NCCL, unnamed")
    for value in ("2x", "-1"):
        p, _ = c.loom("devices_" + value, 1, ["run.backend=cuda"], env={"LOOM_CUDA_EMU_DEVICES": value}, expect=2)
        c.expect(p.stderr, [r"LOOM_CUDA_EMU_DEVICES = '%s' is not a number of emulated devices" % re.escape(value)],
                 "LOOM_CUDA_EMU_DEVICES = %s" % value)
    p, _ = c.loom("library_dir", 1, ["run.backend=cuda"], env={"LOOM_CUDA_BACKEND_LIBRARY": os.path.dirname(library)},
                  expect=2)
    c.expect(p.stderr, [r"LOOM_CUDA_BACKEND_LIBRARY = \S+ is a directory"], "a directory as the back-end library")
    core = os.path.join(os.path.dirname(library), "libloom_core.so")
    p, _ = c.loom("library_core", 1, ["run.backend=cuda"], env={"LOOM_CUDA_BACKEND_LIBRARY": core}, expect=2)
    c.expect(p.stderr, [r"LOOM_CUDA_BACKEND_LIBRARY = \S+libloom_core\.so lacks the entry points .* not a loom CUDA "
                        r"back end"], "another library as the back-end library")
    # One GPU per rank from the scheduler (Slurm --gpus-per-task=1, --gpu-bind; a per-rank
    # CUDA_VISIBLE_DEVICES): each rank sees one device, its ordinal 0, another on each; told apart by
    # UUID, they train over NCCL (this was refused: "2 ranks on this node but 1 CUDA device"). Both
    # given the same one: refused as one device for two ranks. A CUDA_VISIBLE_DEVICES naming none of
    # the node's devices: no device, saying so.
    rank = "${PMI_RANK:-${PMIX_RANK:-${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-0}}}}"  # MPICH, PMIx, Open MPI, srun
    p, _ = c.loom("gpu_per_rank", 2, dp2, env=two, per_rank="export CUDA_VISIBLE_DEVICES=" + rank)
    c.expect(p.stdout, [r"device 0: loom CUDA emulator", r"device buffers between ranks: NCCL"],
             "one GPU per rank, each its ordinal 0")
    p, _ = c.loom("gpu_per_rank_same", 2, dp2, env=two, per_rank="export CUDA_VISIBLE_DEVICES=1", expect=2)
    c.expect(p.stderr, [r"2 ranks on this node but 1 CUDA device \(one device per rank\)"],
             "two ranks given the same GPU")
    p, _ = c.loom("visible_none", 1, ["run.backend=cuda"], env=dict(two, CUDA_VISIBLE_DEVICES="5"), expect=2)
    c.expect(p.stderr, [r"no CUDA device is visible on this node .*CUDA_VISIBLE_DEVICES = '5' names none of the "
                        r"node's 2 emulated devices"], "CUDA_VISIBLE_DEVICES naming no device")
    # A model larger than the device (80 GiB emulated) is refused once the device is open, before the
    # first allocation, naming both numbers; two ranks sharing it are summed; loom check defers to the run.
    huge = ["run.backend=cuda", "model.layers=8", "model.d_model=8192", "model.heads=64", "train.batch=1",
            "train.steps=1"]
    p, d = c.loom("device_memory", 1, huge, expect=2)
    c.expect(p.stderr, [r"memory: rank 0 needs \S+ GiB \(.*\) of the \S+ GiB free on CUDA device 0 \(of 80\.00 "
                        r"GiB\): out of memory by \S+ GiB\. `loom plan .* --devices 1 --set "
                        r"cluster\.device_memory_gib=\S+`"], "a model larger than the device")
    c.check(not os.path.exists(os.path.join(d, "metrics.jsonl")), "the refused run wrote metrics")
    p, _ = c.loom("device_memory_shared", 2, huge[:1] + ["parallel.dp=2", "run.share_gpu=true", "model.layers=4"] +
                  huge[2:4] + ["train.batch=2", "train.steps=1"], expect=2)
    c.expect(p.stderr, [r"memory: the 2 ranks on CUDA device 0 \(0, 1\) need \S+ GiB \(the largest, rank \d "
                        r"\S+ GiB: .*\) of the \S+ GiB free on CUDA device 0"], "two ranks sharing the device")
    cmd = [c.args.loom, "check", c.deck] + sum([["--set", x] for x in huge], [])
    q = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    c.expect(q.stdout, [r"# memory: not checked here \(run\.backend = cuda: .* the run checks it then"],
             "loom check of a cuda deck")
    p, _ = c.loom("auto_broken", 1, ["run.backend=auto", "train.steps=1"],
                  env={"LOOM_CUDA_BACKEND_LIBRARY": "/nonexistent/libloom_cuda.so"})
    c.expect(p.stderr, [r"warning: run\.backend = auto trains on the host: .*LOOM_CUDA_BACKEND_LIBRARY"],
             "auto with a back-end library that does not load")


def emulated(args):
    """The CUDA back end on the emulated device (LOOM_CUDA_BACKEND_LIBRARY = libloom_cuda_emu.so, set by
    CTest): its own host code, launch wrappers and kernels, with cuBLASLt's and the runtime's calls
    checked (core/cuda/emu/), trained against the host as a GPU is: matches_host's one-rank shapes
    (TINY only: WIDER takes minutes per run here) and checkpoints crossing both ways; the refusal of
    two ranks on its one device; NCCL_LAYOUTS with each rank on a device of its own, through the NCCL
    communicator (LOOM_NCCL_LIBRARY = the emulated device's NCCL, set by CTest too). The layouts with
    ranks sharing the device are cuda_layouts itself, which CTest runs on it too
    (regression.gpu.emulated_layouts)."""
    library = os.environ.get("LOOM_CUDA_BACKEND_LIBRARY", "")
    c = Case(args, "emulated", TINY + "[run]\npeak_tflops = 1\n")  # MFU's rate given: no timing products
    c.check(os.path.exists(library), "LOOM_CUDA_BACKEND_LIBRARY names the emulated back end (got %r)" % library)
    on_gpu, banner = gpu_visible(c)
    c.check(on_gpu, "run.backend = auto takes the emulated device")
    c.expect(banner, [r"cuda \(device 0: loom CUDA emulator"], "the banner names the emulated device")
    if c.failures:
        return c.done("emulated")
    flash = ["model.d_model=64", "model.heads=4", "model.seq_len=32", "model.attention=flash"]  # head size 16
    against_host(c, [("tiny_fp32", [], 1e-6, 1e-6), ("tiny_bf16", ["precision.dtype=bf16"], 1e-3, 1e-4),
                     ("small_flash", flash, 2e-3, 1e-5)], steps=10)
    checkpoints_cross(c)
    p, _ = c.loom("cuda_two_ranks", 2, ["run.backend=cuda", "parallel.dp=2"], expect=2)
    c.expect(p.stderr, [r"run\.backend = cuda: 2 ranks on this node but 1 CUDA device", r"run\.share_gpu"],
             "the refusal of two ranks on one device")
    emulated_environment(c, library)
    if os.environ.get("LOOM_NCCL_LIBRARY"):
        # A stalled rank fails in a minute, naming what waited, before the harness's own limit.
        devices = {"LOOM_CUDA_EMU_DEVICES": "4", "LOOM_CUDA_EMU_WAIT_TIMEOUT": "60"}
        # 4 steps: the comparison is per step, and most of each run's time on the emulated device is its start.
        layouts_on(c, "cuda", 4, ["run.comm_timeout=60"], close_to_host(c, norms=True), only=NCCL_LAYOUTS,
                   env=devices, tag="_nccl", banner=r"device buffers between ranks: NCCL 0\.0\.0")
    else:
        c.check(False, "LOOM_NCCL_LIBRARY names the emulated device's NCCL (CTest sets it)")
    return c.done("emulated")


# `loom plan` of a cuda run against the CUDA back end's own ledger: a model whose operand copies and
# attention scratch are large beside the 4 KiB floor; each layout's own ranks on devices of their own.
PLAN_MODEL = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.seq_len=64", "model.vocab=256",
              "train.batch=4"]
PLAN_LAYOUTS = [
    ("fp32", 1, []),
    ("bf16", 1, ["precision.dtype=bf16"]),
    ("fp16", 1, ["precision.dtype=fp16"]),
    ("bf16_flash", 1, ["precision.dtype=bf16", "model.attention=flash"]),
    ("bf16_recompute_micro2", 1, ["precision.dtype=bf16", "model.recompute=true", "train.micro_batches=2"]),
    ("dp2", 2, ["parallel.dp=2"]),
    ("tp2_sp_bf16", 2, ["parallel.tp=2", "tensor.sequence_parallel=true", "precision.dtype=bf16"]),
    ("pp2_1f1b", 2, ["parallel.pp=2", "train.micro_batches=2", "pipeline.schedule=1f1b"]),
    ("zero3_bf16_dp2", 2, ["parallel.dp=2", "zero.stage=3", "precision.dtype=bf16"]),
    ("int8_dp2", 2, ["parallel.dp=2", "compression.method=int8"]),
    ("topk_dp2", 2, ["parallel.dp=2", "compression.method=topk", "compression.ratio=0.1"]),
    ("dp2_tp2", 4, ["parallel.dp=2", "parallel.tp=2"]),
]
CUBLASLT_WORKSPACE = 32 << 20  # core/backend/workspace_plan.hpp kCublasLtWorkspaceBytes
CATEGORIES = ["params", "grads", "master", "optimizer", "activations", "workspace", "comm"]


def plan_memory(args):
    """`loom plan DECK --set run.backend=cuda --json` against the ledger of the same deck run for 2
    steps on the CUDA back end, rank by rank and category by category, as regression.plan.memory_vs_ledger
    holds the host's: |predicted - measured| <= 5% of measured + 4 KiB, the workspace's beyond cuBLASLt's
    32 MiB (which both must hold) so that the operands' 16-bit copies and the attention's scratch are
    seen, and comm without ring-scratch pools (NCCL keeps its own buffers). On one GPU the one-rank
    layouts; where there are devices for every rank (nvidia-smi's GPUs, or the emulated device's
    LOOM_CUDA_EMU_DEVICES) the rest over NCCL too."""
    import json
    c = gpu_case(args, "plan_memory")
    if c is None:
        return SKIP
    devices = int(os.environ.get("LOOM_CUDA_EMU_DEVICES", "0") or 0)
    if not devices and shutil.which("nvidia-smi"):  # a GPU node: its GPUs, one per rank
        devices = len([l for l in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
                       if l.startswith("GPU ")])
    worst = []
    for name, ranks, sets in PLAN_LAYOUTS:
        if ranks > 1 and devices < ranks:
            print("%s: not run (%d ranks need a device each; %d here)" % (name, ranks, devices))
            continue
        over = PLAN_MODEL + sets + ["run.backend=cuda", "train.steps=2", "train.log_every=1", "run.peak_tflops=1"]
        p = subprocess.run([args.loom, "plan", c.deck, "--cluster", "h100-sxm", "--json"] +
                           sum((["--set", x] for x in over), []), capture_output=True, text=True)
        c.check(p.returncode == 0, "%s: loom plan exit %d: %s" % (name, p.returncode, p.stderr[-2000:]))
        if p.returncode != 0:
            continue
        pred = json.loads(p.stdout)
        c.check(pred.get("backend") == "cuda", "%s: the plan is not for the cuda back end: %s" % (name, pred.get("backend")))
        _, run_dir = c.loom(name, ranks, over)
        summary_file = os.path.join(run_dir, "summary.json")
        if not os.path.exists(summary_file):
            continue
        meas = json.load(open(summary_file))["mem_peak_bytes_by_rank"]
        c.check(len(meas) == len(pred["mem_peak_bytes_by_rank"]), "%s: %d ranks measured, %d predicted"
                % (name, len(meas), len(pred["mem_peak_bytes_by_rank"])))
        for r, (m, pr) in enumerate(zip(meas, pred["mem_peak_bytes_by_rank"])):
            for cat in CATEGORIES:
                got, want = pr[cat], m[cat]
                if cat == "workspace":
                    c.check(got >= CUBLASLT_WORKSPACE and want >= CUBLASLT_WORKSPACE,
                            "%s rank %d: workspace predicted %d, measured %d: cuBLASLt's 32 MiB missing" % (name, r, got, want))
                    got, want = got - CUBLASLT_WORKSPACE, want - CUBLASLT_WORKSPACE
                gap = got - want
                worst.append((abs(gap) / max(want, 1), name, r, cat, got, want))
                c.check(abs(gap) <= 0.05 * want + 4096, "%s rank %d %s%s: predicted %d bytes, measured %d (%+.1f%%)"
                        % (name, r, cat, " beyond cuBLASLt's" if cat == "workspace" else "", got, want,
                           100.0 * gap / max(want, 1)))
    worst.sort(reverse=True)
    print("largest relative gaps (predicted vs the CUDA back end's ledger; workspace beyond cuBLASLt's 32 MiB):")
    for rel, name, r, cat, got, want in worst[:8]:
        print("  %-22s rank %d %-11s predicted %9d measured %9d  %6.2f%%" % (name, r, cat, got, want, 100 * rel))
    return c.done("plan_memory")


def bundle(args):
    """bench/gpu_bundle.sh packs this build for a node without loom's libraries, and bench/gpu_session.sh
    runs from it (its `smoke` stage: one CUDA kernel test and the refusal case): the bundle's loom, test
    program and MPI launcher find their libraries (refusal runs at 1 and 2 ranks through them), and a
    test that sees no GPU is reported as skipped, which fails the session; on a GPU both pass. Then one
    step by name under a step timeout it cannot meet: stopped, noted as timed out, the session failed."""
    c = Case(args, "bundle", TINY)
    on_gpu, _ = gpu_visible(c)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    build = os.path.dirname(os.path.abspath(args.loom))
    if not os.path.exists(os.path.join(build, "lib", "libloom_cuda.so")):
        print("SKIPPED: this loom was built without the CUDA back end (no bundle to make)")
        return SKIP
    tarball = os.path.join(os.path.abspath(args.workdir), "gpu-bundle.tar.xz")
    out = os.path.join(os.path.abspath(args.workdir), "bundle-session")
    # xz's fastest preset: the suite checks what the bundle holds and runs, not how small it packs.
    p = subprocess.run(["bash", "bench/gpu_bundle.sh", build, tarball], cwd=root, capture_output=True, text=True,
                       env=dict(os.environ, LOOM_BUNDLE_XZ_LEVEL="0"))
    print(p.stdout + p.stderr)
    c.check(p.returncode == 0, "gpu_bundle.sh exit %d" % p.returncode)
    if p.returncode != 0:
        return c.done("bundle")
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run(["bash", "bench/gpu_session.sh", tarball, out, "smoke"], cwd=root, capture_output=True, text=True)
    print(p.stdout + p.stderr)
    summary_file = os.path.join(out, "summary.log")
    summary = open(summary_file).read() if os.path.exists(summary_file) else ""
    c.expect(summary, [r"gpu_checks refusal: exit 0"], "the session's refusal step (the bundle's loom and mpiexec)")
    if on_gpu:
        c.check(p.returncode == 0, "on a GPU the session passes every step:\n" + summary)
    else:
        c.check(p.returncode == 1, "without a GPU the session fails (exit 1, got %d)" % p.returncode)
        c.expect(summary, [r"loom_cuda_tests: exit 77 \(skipped"], "the session's kernel test without a GPU")
    # A step by name, stopped by the step timeout (a hung step must not take the rest of the lease).
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run(["bash", "bench/gpu_session.sh", tarball, out, "refusal"], cwd=root, capture_output=True,
                       text=True, env=dict(os.environ, LOOM_GPU_STEP_TIMEOUT="0.05"))
    print(p.stdout + p.stderr)
    summary = open(summary_file).read() if os.path.exists(summary_file) else ""
    c.expect(summary, [r"gpu_checks refusal: exit 124 \(timed out"], "a step past LOOM_GPU_STEP_TIMEOUT")
    c.check(p.returncode == 1, "a session with a step timed out fails (exit 1, got %d)" % p.returncode)
    return c.done("bundle")


def main():
    args = case_arguments(__doc__)
    cases = {"refusal": refusal, "matches_host": matches_host, "decks": decks, "fenced": fenced,
             "cuda_layouts": cuda_layouts, "bundle": bundle, "emulated": emulated, "plan_memory": plan_memory}
    if args.case not in cases:
        print("unknown case %s; cases: %s" % (args.case, ", ".join(cases)))
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    return cases[args.case](args)


if __name__ == "__main__":
    sys.exit(main())
