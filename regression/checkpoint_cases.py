#!/usr/bin/env python3
"""Checkpoint regression cases: restart exactly, restart on another layout, refuse bad files, survive
a crash mid-write and a SIGTERM.

    python3 regression/checkpoint_cases.py --loom build/loom --workdir build/ckpt CASE

CASE is one of:
  bitwise_dp2        dp = 2, saved at step 4 of 8, resumed on dp = 2: steps 5..8 have the same losses,
                     bit for bit, as the uninterrupted run
  bitwise_pp2        the same at pp = 2 (1F1B, 2 micro-batches): every stage writes its own layers
  bitwise_zero1_dp2  the same with ZeRO stage 1 at dp = 2: each rank writes the share of the parameters
                     and AdamW state it owns, and reads back the whole parameters and its share
  layout_dp2_to_dp1, layout_dp2_to_dp4, layout_tp2_to_tp1, layout_tp1_to_dp2_tp2_sp,
  layout_pp2_to_pp1, layout_pp1_to_pp2_dp2, layout_pp2_interleaved_to_pp1 (4 layers, 2 virtual stages),
  bitwise_zero2_dp2, bitwise_zero3_dp2  the same at ZeRO stages 2 and 3 (stage 3: each rank writes and reads
                     only its share of the parameters too)
  layout_zero1_dp2_to_dp1, layout_dp2_to_zero1_dp4, layout_zero1_pp2_dp2_to_pp1,
  layout_zero3_dp4_to_dp1, layout_dp2_to_zero2_dp4, layout_zero2_dp2_to_zero3_dp4 (ZeRO on either side)
                     saved on one layout, resumed on another: the same model continues (losses within
                     the cross-layout tolerance of the uninterrupted run)
  bitwise_llama_zero3_dp2, layout_llama_tp2_to_pp2  the same for Llama's block (model.arch = llama,
                     kv_heads 1: whole on every tp rank)
  bitwise_moe_zero3_dp2, layout_moe_tp2_to_pp2_dp2  the same with 4 experts in every block (the
                     routing follows the weights: the same routing after the restart)
  bitwise_moe_ep2, layout_moe_ep2_to_ep4, layout_moe_ep4_to_ep1  experts split over ep ranks (each
                     writes the experts it holds, by global index), resumed on the same or another split
  bitwise_moe_ep2_zero1_dp4, layout_moe_ep2_zero1_dp4_to_ep4  the same under ZeRO-1 at dp 4 (each rank
                     writes its share: of the dense tensors over dp, of its experts over their 2 holders)
  refuse_other_arch  a Llama checkpoint resumed by a GPT-2 deck, or with other kv heads, or one with 4
                     experts by a deck with 8: exit status 2, both values named
  refuse_missing_latest  checkpoint.resume = latest with no `latest` in checkpoint.dir: exit status 2,
                     the path named (a damaged or foreign file's refusals are the C++ test's,
                     io/test_mpi/test_checkpoint.cpp, mpi.checkpoint.np*)
  verify             `loom ckpt verify` on a checkpoint.dir: intact; the newest checkpoint damaged (named
                     with its tensor, the older one advised, and resuming from it continues exactly); a
                     directory of damaged files (each file's damage alone is the C++ test's): a FIFO, a
                     NaN loss scale, a tensor linked into another file; a path that does not exist (uses
                     h5py)
  kill_mid_write     rank 1 dies while the step-4 checkpoint is being written: the step-2 checkpoint
                     is intact, `latest` still names it, and a resume from `latest` continues the run
  sigterm            SIGTERM to a running job: it saves a checkpoint, points `latest` at it and exits
                     with status 3 (interrupted), summary.json saying so;
                     a resume from `latest` reproduces the uninterrupted run
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DECK = common.small_deck(steps=8)
LLAMA = ["model.arch=llama", "model.kv_heads=1"]  # Llama's block, multi-query
MOE = ["model.experts=4", "model.expert_capacity=1.25"]  # 4 experts top-2 in every block
CROSS_LAYOUT_TOL = 1e-5  # relative, per step: reduction order is the only difference between layouts


def saved(c, ranks, sets, tag="full"):
    """The uninterrupted run, saving every 4 steps; returns (losses, path of the step-4 checkpoint)."""
    c.loom(tag, ranks, sets + ["checkpoint.every=4", "checkpoint.keep=5"])
    rundir = os.path.join(c.dir, tag)
    return c.losses(rundir), os.path.join(rundir, "checkpoints", "ckpt-00000004.h5")


def main():
    args = common.case_arguments(__doc__)
    name = args.case
    c = common.Case(args, name, DECK, "ckpt.deck", label="checkpoint case", env={"OPENBLAS_NUM_THREADS": "1"})

    layouts = {
        "layout_dp2_to_dp1": ((2, ["parallel.dp=2"]), (1, [])),
        "layout_dp2_to_dp4": ((2, ["parallel.dp=2"]), (4, ["parallel.dp=4"])),
        "layout_tp2_to_tp1": ((2, ["parallel.tp=2"]), (1, [])),
        "layout_tp1_to_dp2_tp2_sp": ((1, []), (4, ["parallel.dp=2", "parallel.tp=2", "tensor.sequence_parallel=true"])),
        "layout_pp2_to_pp1": ((2, ["parallel.pp=2", "train.micro_batches=2"]), (1, [])),
        "layout_pp1_to_pp2_dp2": ((1, []), (4, ["parallel.pp=2", "parallel.dp=2", "pipeline.schedule=gpipe"])),
        "layout_pp2_interleaved_to_pp1": ((2, ["model.layers=4", "parallel.pp=2", "pipeline.virtual_stages=2",
                                               "train.micro_batches=2"]), (1, ["model.layers=4"])),
        "layout_zero1_dp2_to_dp1": ((2, ["parallel.dp=2", "zero.stage=1"]), (1, [])),
        "layout_dp2_to_zero1_dp4": ((2, ["parallel.dp=2"]), (4, ["parallel.dp=4", "zero.stage=1"])),
        "layout_zero1_pp2_dp2_to_pp1": ((4, ["parallel.pp=2", "parallel.dp=2", "train.micro_batches=2", "zero.stage=1"]),
                                        (1, [])),
        "layout_zero3_dp4_to_dp1": ((4, ["parallel.dp=4", "zero.stage=3"]), (1, [])),
        "layout_dp2_to_zero2_dp4": ((2, ["parallel.dp=2"]), (4, ["parallel.dp=4", "zero.stage=2"])),
        "layout_zero2_dp2_to_zero3_dp4": ((2, ["parallel.dp=2", "zero.stage=2"]), (4, ["parallel.dp=4", "zero.stage=3"])),
        # Llama multi-query: its kv head whole on both tp ranks when saved, on one pipeline stage when resumed.
        "layout_llama_tp2_to_pp2": ((2, LLAMA + ["parallel.tp=2"]), (2, LLAMA + ["parallel.pp=2", "train.micro_batches=2"])),
        # Context parallelism: the weights are whole on every cp rank, so its checkpoints are dp's.
        "layout_cp2_to_cp1": ((2, ["parallel.cp=2"]), (1, [])),
        "layout_cp2_dp2_to_dp4": ((4, ["parallel.cp=2", "parallel.dp=2"]), (4, ["parallel.dp=4"])),
        "layout_zero3_cp2_to_cp4": ((2, ["parallel.cp=2", "zero.stage=3"]), (4, ["parallel.cp=4"])),
        # Experts by global index (blocks.<l>.mlp.experts.<e>.*): split over tp, then on pipeline stages.
        "layout_moe_tp2_to_pp2_dp2": ((2, MOE + ["parallel.tp=2"]),
                                      (4, MOE + ["parallel.pp=2", "parallel.dp=2", "train.micro_batches=2"])),
        # Expert parallelism: each ep rank writes its experts; read back on another split of them.
        "layout_moe_ep2_to_ep4": ((2, MOE + ["parallel.dp=2", "parallel.ep=2"]), (4, MOE + ["parallel.dp=4", "parallel.ep=4"])),
        "layout_moe_ep4_to_ep1": ((4, MOE + ["parallel.dp=4", "parallel.ep=4"]), (1, MOE)),
        # ZeRO-1 with experts: each rank writes its share, dense over dp, an expert's over its holders.
        "layout_moe_ep2_zero1_dp4_to_ep4": ((4, MOE + ["parallel.dp=4", "parallel.ep=2", "zero.stage=1"]),
                                            (4, MOE + ["parallel.dp=4", "parallel.ep=4"])),
    }
    bitwise = {"bitwise_dp2": ["parallel.dp=2"], "bitwise_pp2": ["parallel.pp=2", "train.micro_batches=2"],
               "bitwise_zero1_dp2": ["parallel.dp=2", "zero.stage=1"],
               "bitwise_zero2_dp2": ["parallel.dp=2", "zero.stage=2"],
               "bitwise_zero3_dp2": ["parallel.dp=2", "zero.stage=3"],
               "bitwise_llama_zero3_dp2": LLAMA + ["parallel.dp=2", "zero.stage=3"],
               "bitwise_cp2": ["parallel.cp=2"],
               "bitwise_moe_zero3_dp2": MOE + ["parallel.dp=2", "zero.stage=3"],
               "bitwise_moe_ep2": MOE + ["parallel.dp=2", "parallel.ep=2"],
               "bitwise_moe_ep2_zero1_dp4": MOE + ["parallel.dp=4", "parallel.ep=2", "zero.stage=1"]}
    if name in bitwise:
        ranks = 4 if "dp=4" in " ".join(bitwise[name]) else 2
        ref, ckpt = saved(c, ranks, bitwise[name])
        c.loom("resumed", ranks, bitwise[name] + ["checkpoint.resume=" + ckpt])
        c.compare(c.losses(os.path.join(c.dir, "resumed")), ref, 0.0)
    elif name in layouts:
        (r0, s0), (r1, s1) = layouts[name]
        ref, ckpt = saved(c, r0, s0)
        c.loom("resumed", r1, s1 + ["checkpoint.resume=" + ckpt])
        c.compare(c.losses(os.path.join(c.dir, "resumed")), ref, CROSS_LAYOUT_TOL)
    elif name == "refuse_other_arch":
        # A Llama checkpoint is not a GPT-2 one (nor the reverse): refused before step 1, naming both.
        _, ckpt = saved(c, 1, LLAMA)
        p, _ = c.loom("refused", 1, ["checkpoint.resume=" + ckpt], expect=2)
        c.expect_error(p, [r"model\.arch = llama in the checkpoint, gpt2 in this deck"])
        p, _ = c.loom("refused_kv", 1, LLAMA[:1] + ["model.kv_heads=2", "checkpoint.resume=" + ckpt], expect=2)
        c.expect_error(p, [r"model\.kv_heads = 1 in the checkpoint, 2 in this deck"])
        # Experts: another count of experts is another model.
        _, ckpt = saved(c, 1, MOE, tag="moe")
        p, _ = c.loom("refused_experts", 1, ["model.experts=8", "checkpoint.resume=" + ckpt], expect=2)
        c.expect_error(p, [r"model\.experts = 4 in the checkpoint, 8 in this deck"])
    elif name == "refuse_missing_latest":
        # (The file format's refusals, of a damaged or foreign file, are io/test_mpi/test_checkpoint.cpp's.)
        _, ckpt = saved(c, 1, [])
        sets = ["checkpoint.resume=latest", "checkpoint.dir=" + os.path.join(c.dir, "empty")]
        patterns = [r"checkpoint\.resume = latest, but '.*empty/latest' does not exist"]
        before = open(ckpt, "rb").read()
        p, _ = c.loom("refused", 1, sets, expect=2)
        c.expect_error(p, patterns)
        if open(ckpt, "rb").read() != before:
            c.failures.append("the checkpoint that was read changed")
    elif name == "verify":
        # `loom ckpt verify` on a run's checkpoint.dir: intact, then with the newest checkpoint damaged
        # (it names the tensor and says which checkpoint to resume from, and that resume continues
        # the run exactly), a tensor missing, an unfinished write and a path that does not exist.
        import h5py  # run this case with /usr/bin/python3, which has it
        import numpy
        ref, ckpt4 = saved(c, 1, [])
        ckdir = os.path.dirname(ckpt4)
        ckpt8 = os.path.join(ckdir, "ckpt-00000008.h5")

        def verify(target, expect, patterns):
            before = {f: open(os.path.join(ckdir, f), "rb").read() for f in os.listdir(ckdir)}
            cmd = [args.loom, "ckpt", "verify", target]
            print("$ " + " ".join(cmd), flush=True)
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            print(p.stdout + p.stderr, end="")
            if p.returncode != expect:
                c.failures.append("%s: exit status %d, expected %d" % (" ".join(cmd), p.returncode, expect))
            for rx in patterns:
                if not re.search(rx, p.stdout + p.stderr):
                    c.failures.append("%s: the output does not match /%s/" % (" ".join(cmd), rx))
            if {f: open(os.path.join(ckdir, f), "rb").read() for f in os.listdir(ckdir)} != before:
                c.failures.append("%s changed the checkpoint directory" % " ".join(cmd))

        verify(ckdir, 0, [r"ckpt-00000004\.h5': step 4, written at dp 1 x tp 1 x pp 1, \d+ tensors \([\d.]+ MB\) read: intact",
                          r"latest: ckpt-00000008\.h5, intact", r"2 of 2 checkpoints intact"])
        with h5py.File(ckpt8, "r") as f:
            offset = f["optimizer/m/blocks.0.attn.proj.weight"].id.get_offset()
        with open(ckpt8, "r+b") as f:  # garbage over one tensor's data, the file structure intact
            f.seek(offset + 64)
            f.write(b"\x5a" * 64)
        open(os.path.join(ckdir, "ckpt-00000012.h5.tmp"), "wb").write(b"half")
        verify(ckdir, 1, [r"ckpt-00000008\.h5': step 8, .* read: DAMAGED\n"
                          r"  tensor /optimizer/m/blocks\.0\.attn\.proj\.weight does not match its checksum",
                          r"ckpt-00000012\.h5\.tmp': an unfinished write",
                          r"latest: ckpt-00000008\.h5, which is damaged; the newest intact checkpoint is ckpt-00000004\.h5: "
                          r"resume with checkpoint\.resume = " + re.escape(ckpt4), r"1 of 2 checkpoints intact"])
        os.remove(os.path.join(ckdir, "ckpt-00000012.h5.tmp"))
        c.loom("resumed", 1, ["checkpoint.resume=" + ckpt4])  # as it advises: the run continues exactly
        c.compare(c.losses(os.path.join(c.dir, "resumed")), ref, 0.0)
        # loom's `latest` pointer named as the checkpoint: verify takes its directory; a resume says
        # what to give instead of calling the pointer a corrupt HDF5 file.
        pointer = os.path.join(ckdir, "latest")
        verify(pointer, 1, [r"latest' is the pointer to the newest checkpoint: verifying its directory",
                            r"latest: ckpt-00000008\.h5, which is damaged"])
        p, _ = c.loom("resume_pointer", 1, ["checkpoint.resume=" + pointer], expect=2)
        c.expect_error(p, [r"is the pointer to the newest checkpoint \(it names ckpt-00000008\.h5\), not a checkpoint: "
                           r"give checkpoint\.resume = latest with checkpoint\.dir = "])
        # The deck attribute rewritten in h5py, which stores a Python str as a variable-length UTF-8
        # string (loom writes fixed-length ASCII): the same deck, read (it was called unreadable).
        vlen = os.path.join(c.dir, "vlen_deck.h5")
        shutil.copy(ckpt4, vlen)
        with h5py.File(vlen, "r+") as f:
            deck = f.attrs["deck"]
            deck = deck.decode() if isinstance(deck, bytes) else str(deck)
            del f.attrs["deck"]
            f.attrs["deck"] = deck
            if h5py.check_string_dtype(f.attrs.get_id("deck").dtype).length is not None:
                c.failures.append("h5py did not write the deck as a variable-length string")
        verify(vlen, 0, [r"vlen_deck\.h5': step 4, .*: intact"])
        p = subprocess.run([args.loom, "ckpt", "info", vlen], capture_output=True, text=True, timeout=120)
        if p.returncode != 0 or "# loom deck, resolved" not in p.stdout:
            c.failures.append("ckpt info of a checkpoint with a variable-length deck attribute does not show the deck: "
                              "exit %d\n%s%s" % (p.returncode, p.stdout[-400:], p.stderr))
        c.loom("vlen_deck_resume", 1, ["checkpoint.resume=" + vlen, "train.steps=6"], expect=0)
        # Beside the run's directory (a FIFO there would block the snapshot's reads): a FIFO named as a
        # checkpoint (opening it would wait for a writer), a damaged loss scale, a tensor that is a link
        # into another file (loom never writes one; it would pass another checkpoint's values off).
        odd = os.path.join(c.dir, "odd")
        os.makedirs(odd)
        os.mkfifo(os.path.join(odd, "ckpt-00000050.h5"))
        shutil.copy(ckpt4, os.path.join(odd, "ckpt-00000004.h5"))
        with h5py.File(os.path.join(odd, "ckpt-00000004.h5"), "r+") as f:
            f.attrs["loss_scale"] = float("nan")
        shutil.copy(ckpt4, os.path.join(odd, "ckpt-00000008.h5"))
        with h5py.File(os.path.join(odd, "ckpt-00000008.h5"), "r+") as f:
            del f["params/wpe.weight"]
            f["params/wpe.weight"] = h5py.ExternalLink(ckpt8, "/params/wpe.weight")
        # Attributes that hold arrays where loom writes one value (read into one value's room, they
        # overran it: a segfault): unreadable, named.
        shutil.copy(ckpt4, os.path.join(odd, "ckpt-00000012.h5"))
        with h5py.File(os.path.join(odd, "ckpt-00000012.h5"), "r+") as f:
            f.attrs["step"] = numpy.arange(1000, dtype=numpy.int64)
        shutil.copy(ckpt4, os.path.join(odd, "ckpt-00000016.h5"))
        with h5py.File(os.path.join(odd, "ckpt-00000016.h5"), "r+") as f:
            f["params/wte.weight"].attrs["checksum"] = numpy.arange(1000, dtype=numpy.int64)
        verify(odd, 1, [r"ckpt-00000050\.h5': DAMAGED\n  is not a regular file \(a FIFO",
                        r"ckpt-00000004\.h5': DAMAGED\n  records loss_scale = nan: corrupt",
                        r"ckpt-00000008\.h5': step 4, .* DAMAGED\n  tensor /params/wpe\.weight is a link",
                        r"ckpt-00000012\.h5': DAMAGED\n  has no readable attribute step: corrupt",
                        r"ckpt-00000016\.h5': step 4, .* DAMAGED\n  tensor /params/wte\.weight has no readable checksum "
                        r"attribute \(one integer\)",
                        r"latest: none; no checkpoint here is intact", r"0 of 5 checkpoints intact"])
        p, _ = c.loom("array_checksum", 1, ["checkpoint.resume=" + os.path.join(odd, "ckpt-00000016.h5")], expect=2)
        c.expect_error(p, [r"tensor /params/wte\.weight has no readable checksum attribute"])
        verify(os.path.join(c.dir, "nowhere"), 2, [r"nowhere' does not exist: name a checkpoint file or a checkpoint directory"])
        # ckpt llmc writes an llm.c model file, never over the checkpoint it reads nor over another one
        # (it replaced the checkpoint with the .bin, exit 0).
        with open(ckpt4, "rb") as f:
            before = f.read()
        for out, said in [(ckpt4, r"is the checkpoint it reads"), (os.path.join(odd, "ckpt-00000004.h5"),
                                                                     r"is a checkpoint \(an HDF5 file\)")]:
            try:
                p = subprocess.run([args.loom, "ckpt", "llmc", ckpt4, out], capture_output=True, text=True, timeout=120)
            except subprocess.TimeoutExpired:
                c.failures.append("ckpt llmc %s %s: did not end in 120 s" % (ckpt4, out))
                continue
            if p.returncode != 2 or not re.search(said, p.stderr):
                c.failures.append("ckpt llmc %s %s: exit %d, expected 2 saying /%s/: %s"
                                  % (ckpt4, out, p.returncode, said, p.stderr.strip()[-300:]))
        with open(ckpt4, "rb") as f:
            if f.read() != before:
                c.failures.append("ckpt llmc changed the checkpoint it read: " + ckpt4)
    elif name == "kill_mid_write":
        ref, _ = saved(c, 2, ["parallel.dp=2"], tag="reference")
        sets = ["parallel.dp=2", "checkpoint.every=2", "checkpoint.keep=1"]
        p, rundir = c.loom("killed", 2, sets, env={"LOOM_INJECT_FAULT": "rank=1,step=4,where=checkpoint"}, expect=None)
        print("stderr: " + p.stderr.strip())
        if p.returncode == 0:
            c.failures.append("the job did not fail")
        if not re.search(r"rank 1: error: injected fault while writing checkpoint", p.stderr):
            c.failures.append("no message from rank 1 about the failed write")
        ckdir = os.path.join(rundir, "checkpoints")
        latest = open(os.path.join(ckdir, "latest")).read().strip() if os.path.exists(os.path.join(ckdir, "latest")) else ""
        print("after the crash: %s; latest -> %s" % (sorted(os.listdir(ckdir)), latest))
        if latest != "ckpt-00000002.h5":
            c.failures.append("latest names %r, expected the intact ckpt-00000002.h5" % latest)
        if os.path.exists(os.path.join(ckdir, "ckpt-00000004.h5")):
            c.failures.append("a half-written ckpt-00000004.h5 carries a final name")
        c.loom("resumed", 2, ["parallel.dp=2", "checkpoint.resume=latest", "checkpoint.dir=" + ckdir])
        c.compare(c.losses(os.path.join(c.dir, "resumed")), ref, 0.0)
    elif name == "sigterm":
        # A constant schedule, so that the learning rate does not depend on train.steps: the job runs
        # "forever" until signalled, and the reference is then trained to just past that step.
        const = ["train.schedule=constant"]
        proc, rundir = c.loom("signalled", 1, const + ["train.steps=100000000"], popen=True)
        metrics = os.path.join(rundir, "metrics.jsonl")
        deadline = time.time() + 60
        while time.time() < deadline and (not os.path.exists(metrics) or sum(1 for _ in open(metrics)) < 3):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        print(out[-600:] + err)
        if proc.returncode != 3:
            c.failures.append("exit status %d after SIGTERM, expected 3 (saved and stopped: interrupted, not finished)" % proc.returncode)
        summary = json.load(open(os.path.join(rundir, "summary.json")))
        if summary.get("status") != "interrupted":
            c.failures.append("summary.json status %r, expected 'interrupted'" % summary.get("status"))
        ckdir = os.path.join(rundir, "checkpoints")
        latest = open(os.path.join(ckdir, "latest")).read().strip() if os.path.exists(os.path.join(ckdir, "latest")) else ""
        m = re.match(r"ckpt-(\d+)\.h5$", latest)
        if not m or "on a stop signal; stopping" not in out:
            c.failures.append("no checkpoint saved on SIGTERM (latest = %r)" % latest)
        else:
            step = int(m.group(1))
            print("SIGTERM: saved at step %d, latest -> %s" % (step, latest))
            upto = ["train.steps=%d" % (step + 5)]
            c.loom("reference", 1, const + upto)
            c.loom("resumed", 1, const + upto + ["checkpoint.resume=latest", "checkpoint.dir=" + ckdir])
            c.compare(c.losses(os.path.join(c.dir, "resumed")), c.losses(os.path.join(c.dir, "reference")), 0.0)
    elif name == "sighup":
        forever = ["train.schedule=constant", "train.steps=100000000"]

        def started(rundir):
            metrics, deadline = os.path.join(rundir, "metrics.jsonl"), time.time() + 60
            while time.time() < deadline and (not os.path.exists(metrics) or sum(1 for _ in open(metrics)) < 3):
                time.sleep(0.05)

        # A hang-up saves and stops as SIGTERM does (UCX's debug handler took it: the run went on).
        proc, rundir = c.loom("hungup", 1, forever, popen=True)
        started(rundir)
        proc.send_signal(signal.SIGHUP)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # the hang-up was ignored: the run went on
            proc.kill()
            out, err = proc.communicate()
        print(out[-400:] + err)
        if proc.returncode != 3 or "on a stop signal; stopping" not in out:
            c.failures.append("SIGHUP: exit status %d, expected 3 after a checkpoint" % proc.returncode)
        path = os.path.join(rundir, "summary.json")
        summary = json.load(open(path)) if os.path.exists(path) else {}
        if summary.get("status") != "interrupted" or summary.get("stop_signal") != signal.SIGHUP:
            c.failures.append("summary.json after SIGHUP: status %r, stop_signal %r"
                              % (summary.get("status"), summary.get("stop_signal")))
    else:
        sys.exit("unknown case " + name)
    return c.done(name)


if __name__ == "__main__":
    sys.exit(main())
