#!/usr/bin/env python3
"""`loom data prepare`, tokenizers, `loom eval` and `loom sample --prompt`, checked from outside.

Cases (each its own folder under --workdir; text from Debian's python3.11-doc reStructuredText sources):
  roundtrip      prepare (SentencePiece BPE trained here) at 1 rank x 2 threads and at 2 ranks x 1 thread (and a
                 unigram model, --verify; and a given spm_train model that adds a dummy prefix, whose ids
                 are Python's sentencepiece's for each file whole):
                 the same shards byte for byte; the shards read by this script's own reader (header,
                 counts, ids below the vocabulary, the manifest's counts and sizes); the train shard
                 decoded by SentencePiece's own spm_decode is the inputs' text byte for byte; and the ids
                 with loom's newline pieces left out are spm_encode's ids line by line.
  noop_resume    a rerun on the same inputs does nothing (files untouched); a run killed after 2 chunks
                 (LOOM_PREPARE_STOP_AFTER, exit 137) resumes and ends with the uninterrupted run's shards;
                 one killed on part of the inputs keeps nothing when rerun on all (nor a stray shard).
  refusals       non-UTF-8 input (file and byte offset), a missing input, a --tokenizer that is not a
                 model, other options over a finished folder, a shard of a wrong header, a deck whose
                 model.vocab is not the manifest's or data.tokenizer's: each exit 2 naming file and key.
  eval           a run on prepared shards with validation; `loom eval` of its last checkpoint at 1 rank
                 and at dp 2, tp 2 and cp 2 gives the run's own final validation loss and bits per byte; bits per
                 byte = loss x tokens / bytes / ln 2 with the bytes counted here from the shards' pieces.
  sample         `loom sample --prompt` encodes with the run's tokenizer: the output begins with the prompt.
  wide           a version-2 shard (uint32 ids) written by this script trains a model of vocabulary 70,000;
                 one cut short is refused.
"""
import glob
import json
import math
import os
import shutil
import struct
import subprocess
import sys

from common import case_arguments, finish, launch_prefix, run_noting

DOCS = "/usr/share/doc/python3.11/html/_sources"
TUTORIAL = DOCS + "/tutorial/*.txt"  # 17 files, 0.3 MB: the small corpus of these checks
MAGIC = 20240520


def read_shard(path):
    """(version, ids) of a token shard, by the format's own definition."""
    with open(path, "rb") as f:
        data = f.read()
    magic, version, count = struct.unpack("<3i", data[:12])
    assert magic == MAGIC, "%s: magic %d" % (path, magic)
    width = {1: 2, 2: 4}[version]
    assert len(data) == 1024 + width * count, "%s: %d bytes for %d tokens" % (path, len(data), count)
    fmt = "<%d%s" % (count, "H" if width == 2 else "I")
    return version, list(struct.unpack(fmt, data[1024:]))


def prepare(args, out, extra=(), ranks=1, expect=0, failures=None, env=None, inputs=(TUTORIAL,)):
    cmd = launch_prefix(args, ranks) + [args.loom, "data", "prepare", "--out", out]
    if "--vocab" not in extra:
        cmd += ["--vocab", "1000"]
    for i in inputs:
        cmd += ["--input", i]
    return run_noting(cmd + list(extra), failures if failures is not None else [], expect=expect, env=env)


def check_roundtrip(args, work, failures):
    a, b = work + "/a", work + "/b"
    prepare(args, a, ["--threads", "2", "--val-fraction", "0", "--verify"], failures=failures)
    prepare(args, b, ["--threads", "1", "--val-fraction", "0"], ranks=2, failures=failures)
    # A unigram model, byte-exact on the same text (--verify decodes every chunk).
    prepare(args, work + "/unigram", ["--model-type", "unigram", "--vocab", "1200", "--verify"], failures=failures)
    # A given model that puts a space mark before each input (add_dummy_prefix, as Llama's does),
    # trained by SentencePiece's own spm_train: loom encodes the text whole, so it decodes back.
    files = sorted(glob.glob(TUTORIAL))
    run_noting(["spm_train", "--input=" + ",".join(files), "--model_prefix=" + work + "/dummy", "--vocab_size=800",
                "--normalization_rule_name=identity", "--add_dummy_prefix=true", "--byte_fallback=true",
                "--remove_extra_whitespaces=false",
                "--minloglevel=1"], failures)
    prepare(args, work + "/given", ["--tokenizer", work + "/dummy.model", "--verify", "--val-fraction", "0"],
            failures=failures)
    # Its ids are SentencePiece's own for each file whole (Python's sentencepiece, /usr/bin/python3),
    # then the end of document: per line, each line would begin with a space mark the text lacks.
    oracle = ("import sentencepiece as s, sys, json; p = s.SentencePieceProcessor(model_file=sys.argv[1]); "
              "print(json.dumps([i for f in sys.argv[2:] for i in p.encode(open(f, encoding='utf-8', newline='')"
              ".read()) + [p.eos_id()]]))")
    p = subprocess.run(["/usr/bin/python3", "-c", oracle, work + "/dummy.model"] + files, capture_output=True, text=True)
    if p.returncode != 0:
        failures.append("python3-sentencepiece: " + p.stderr[-300:])
    else:
        theirs = json.loads(p.stdout)
        ours = read_shard(work + "/given/train_000000.bin")[1] if os.path.exists(work + "/given/train_000000.bin") else []
        print("a model with add_dummy_prefix: loom %d ids, SentencePiece on each file whole %d ids, equal: %s" %
              (len(ours), len(theirs), ours == theirs))
        if ours != theirs:
            failures.append("a given model with add_dummy_prefix: loom's ids are not SentencePiece's for the whole text")
    for name in ["train_000000.bin", "manifest.json"]:
        if not os.path.exists(os.path.join(a, name)):
            failures.append("%s missing" % name)
            return
    if open(a + "/train_000000.bin", "rb").read() != open(b + "/train_000000.bin", "rb").read():
        failures.append("1 rank x 2 threads and 2 ranks x 1 thread wrote different shards")
    m = json.load(open(a + "/manifest.json"))
    version, ids = read_shard(a + "/train_000000.bin")
    vocab = m["tokenizer"]["vocab"]
    if version != 1 or vocab != 1000 or max(ids) >= vocab:
        failures.append("version %d, vocab %d, max id %d" % (version, vocab, max(ids)))
    if len(ids) != m["splits"]["train"]["tokens"] or m["splits"]["val"]["tokens"] != 0:
        failures.append("shard holds %d tokens, manifest says %s" % (len(ids), m["splits"]))
    files = sorted(glob.glob(TUTORIAL))
    text = b"".join(open(f, "rb").read() for f in files)
    eos = m["tokenizer"]["eos_id"]
    if ids.count(eos) != len(files):
        failures.append("%d end-of-document tokens for %d files" % (ids.count(eos), len(files)))
    # SentencePiece's own decoder (it drops the control piece eos).
    p = subprocess.run(["spm_decode", "--model", a + "/tokenizer.model", "--input_format=id"],
                       input=" ".join(map(str, ids)) + "\n", capture_output=True, text=True)
    decoded = p.stdout.encode()[:-1] if p.stdout.endswith("\n") else p.stdout.encode()
    print("spm_decode of the shard: %d bytes, the inputs: %d bytes, equal: %s" % (len(decoded), len(text),
                                                                                decoded == text))
    if decoded != text:
        failures.append("the shard does not decode to the inputs' text (spm_decode)")
    # spm_encode, line by line: the same ids once loom's newline pieces and eos are left out.
    p = subprocess.run(["spm_encode", "--model", a + "/tokenizer.model", "--output_format=id"], input=text.decode(),
                       capture_output=True, text=True)
    theirs = [int(t) for t in p.stdout.split()]
    nl = 3 + 10  # <0x0A>: the byte pieces follow <unk>, <s>, </s>
    ours = [t for t in ids if t not in (nl, eos)]
    print("spm_encode: %d ids; loom without newline and eos pieces: %d ids; equal: %s" % (len(theirs), len(ours),
                                                                                          theirs == ours))
    if theirs != ours:
        failures.append("loom's ids differ from spm_encode's (line by line)")


def check_noop_resume(args, work, failures):
    a, b = work + "/a", work + "/b"
    prepare(args, a, ["--threads", "1"], failures=failures)
    stamps = {f: os.stat(f).st_mtime_ns for f in glob.glob(a + "/*")}
    p = prepare(args, a, ["--threads", "1"], failures=failures)
    if "up to date" not in p.stdout or {f: os.stat(f).st_mtime_ns for f in glob.glob(a + "/*")} != stamps:
        failures.append("a rerun on the same inputs was not a no-op: " + p.stdout[-300:])
    env = dict(os.environ, LOOM_PREPARE_STOP_AFTER="2")
    prepare(args, b, ["--threads", "1"], expect=137, failures=failures, env=env)
    if os.path.exists(b + "/manifest.json"):
        failures.append("the killed run wrote a manifest")
    p = prepare(args, b, ["--threads", "1"], failures=failures)
    print(p.stdout)
    if "resumed: 2 of" not in p.stdout or "was trained for these inputs and options already" not in p.stdout:
        failures.append("the second run did not resume (kept tokenizer, 2 chunks done)")
    for f in ["train_000000.bin", "val_000000.bin", "tokenizer.model"]:
        if open(a + "/" + f, "rb").read() != open(b + "/" + f, "rb").read():
            failures.append("%s differs between the resumed and the uninterrupted run" % f)
    # Killed on a part of the inputs, resumed on all of them: nothing of the part's is kept (its
    # tokenizer trained on other text), and an earlier stray shard does not outlive the run.
    c = work + "/c"
    prepare(args, c, ["--threads", "1"], expect=137, failures=failures, env=env,
            inputs=(DOCS + "/tutorial/c*.txt",))
    os.makedirs(c, exist_ok=True)
    shutil.copy(a + "/train_000000.bin", c + "/train_000009.bin")
    p = prepare(args, c, ["--threads", "1"], failures=failures)
    if "already" in p.stdout or os.path.exists(c + "/train_000009.bin"):
        failures.append("a run on other inputs kept the killed run's work or a stray shard: " + p.stdout[-400:])
    for f in ["train_000000.bin", "val_000000.bin", "tokenizer.model"]:
        if open(a + "/" + f, "rb").read() != open(c + "/" + f, "rb").read():
            failures.append("%s differs from the uninterrupted run after a killed run on other inputs" % f)


def refused(args, failures, cmd, *needles, env=None):
    p = run_noting(cmd, failures, expect=2, env=env)
    msg = p.stderr + p.stdout
    for n in needles:
        if n not in msg:
            failures.append("%s: the message lacks %r: %s" % (" ".join(cmd[1:4]), n, msg.strip()[-400:]))
    print("  -> " + msg.strip().splitlines()[-1][:300] if msg.strip() else "  -> (nothing)")


def deck_args(args, run_dir, data_dir, extra=()):
    return [args.loom, "run", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "inputs",
                                           "quickstart.deck"),
            "--set", "run.dir=" + run_dir, "--set", "data.source=tokens:%s/train_*.bin" % data_dir,
            "--set", "data.val_source=tokens:%s/val_*.bin" % data_dir, "--set", "model.vocab=1000",
            "--set", "train.steps=2"] + [w for kv in extra for w in ("--set", kv)]


def check_refusals(args, work, failures):
    bad = work + "/latin1.txt"
    with open(bad, "wb") as f:
        f.write(b"caf\xc3\xa9 ok\nna\xefve\n")  # UTF-8, then latin-1's 0xef at byte offset 11
    refused(args, failures, [args.loom, "data", "prepare", "--input", bad, "--out", work + "/x"],
            bad, "byte offset 11", "not UTF-8")
    refused(args, failures, [args.loom, "data", "prepare", "--input", work + "/none*.txt", "--out", work + "/x"],
            "none*.txt", "matches no file")
    refused(args, failures, [args.loom, "data", "prepare", "--input", TUTORIAL, "--out", work + "/x",
                             "--tokenizer", bad], "--tokenizer", bad, "not a SentencePiece model")
    good = work + "/good"
    prepare(args, good, ["--threads", "1"], failures=failures)
    refused(args, failures, [args.loom, "data", "prepare", "--input", TUTORIAL, "--out", good, "--vocab", "900"],
            good, "other inputs or options", "first difference: option tokenizer", "--overwrite")
    # A deck against the manifest's tokenizer, and against data.tokenizer.
    refused(args, failures, deck_args(args, work + "/r1", good, ["model.vocab=2000"]),
            "model.vocab = 2000", "manifest.json", "1000 tokens")
    other = work + "/other"
    prepare(args, other, ["--threads", "1", "--vocab", "700"], failures=failures)
    refused(args, failures, deck_args(args, work + "/r2", good, ["data.tokenizer=%s/tokenizer.model" % other]),
            "data.tokenizer", other + "/tokenizer.model", "700 tokens")
    # A shard whose header is wrong (version 7), and one cut short.
    broken = work + "/broken"
    shutil.copytree(good, broken)
    with open(broken + "/train_000000.bin", "r+b") as f:
        f.seek(4)
        f.write(struct.pack("<i", 7))
    refused(args, failures, deck_args(args, work + "/r3", broken), "train_000000.bin", "byte offset 4",
            "unsupported version")
    shutil.copy(good + "/train_000000.bin", broken + "/train_000000.bin")
    with open(broken + "/val_000000.bin", "r+b") as f:
        f.truncate(os.path.getsize(broken + "/val_000000.bin") - 3)
    refused(args, failures, deck_args(args, work + "/r4", broken), "val_000000.bin", "truncated")


def final_val(run_dir):
    s = json.load(open(run_dir + "/summary.json"))
    return s["final_val_loss"], s.get("final_val_bpb")


def check_eval(args, work, failures):
    data, run = work + "/data", work + "/run"
    prepare(args, data, ["--threads", "1", "--val-fraction", "0.2"], failures=failures)
    run_noting(deck_args(args, run, data, ["train.steps=12", "train.eval_every=6", "checkpoint.every=12",
                                            "train.eval_batches=4"]), failures)
    loss, bpb = final_val(run)
    print("run: final validation loss %.9f, %.9f bits/byte" % (loss, bpb))
    # Bits per byte from outside: the pieces' bytes over exactly the samples are the run's business;
    # here the whole validation split's bytes per token bound it (same text, sampled windows).
    m = json.load(open(data + "/manifest.json"))
    ratio = m["splits"]["val"]["text_bytes"] / m["splits"]["val"]["tokens"]
    if abs(bpb - loss / ratio / math.log(2)) > 0.15 * bpb:
        failures.append("bits per byte %.4f far from loss / (%.3f bytes per token) / ln 2 = %.4f" %
                        (bpb, ratio, loss / ratio / math.log(2)))
    # Bytes as tokens (text:PATH): bits per byte is the loss over ln 2 exactly.
    qs = work + "/bytes"
    run_noting([args.loom, "run", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "inputs",
                                               "quickstart.deck"), "--set", "run.dir=" + qs, "--set", "train.steps=2"],
               failures)
    b_loss, b_bpb = final_val(qs)
    print("bytes: final validation loss %.9f, %.9f bits/byte (loss / ln 2 = %.9f)" % (b_loss, b_bpb,
                                                                                     b_loss / math.log(2)))
    if abs(b_bpb - b_loss / math.log(2)) > 1e-12 * b_bpb:
        failures.append("bytes: bits per byte %.12f is not loss / ln 2 = %.12f" % (b_bpb, b_loss / math.log(2)))
    for ranks, layout in [(1, []), (2, ["--set", "parallel.dp=2"]), (2, ["--set", "parallel.tp=2"]),
                          (2, ["--set", "parallel.cp=2", "--set", "parallel.dp=1"])]:
        p = run_noting(launch_prefix(args, ranks) + [args.loom, "eval", run + "/checkpoints", "--json"] + layout,
                       failures)
        try:
            j = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            failures.append("loom eval printed no JSON: " + p.stdout[-300:])
            continue
        print("eval %s: loss %.9f, %.9f bits/byte" % (j["layout"], j["loss"], j["bits_per_byte"]))
        tol = 0 if ranks == 1 else 1e-6
        if abs(j["loss"] - loss) > tol * loss or abs(j["bits_per_byte"] - bpb) > tol * bpb + 1e-12:
            failures.append("eval at %s: %.9f, the run's validation %.9f (tolerance %g relative)" %
                            (j["layout"], j["loss"], loss, tol))


def check_sample(args, work, failures):
    data, run = work + "/data", work + "/run"
    prepare(args, data, ["--threads", "1"], failures=failures)
    run_noting(deck_args(args, run, data, ["train.steps=4", "checkpoint.every=4"]), failures)
    prompt = "The Python interpreter"
    p = run_noting([args.loom, "sample", run + "/checkpoints", "--prompt", prompt, "--steps", "10",
                    "--seed", "1"], failures)
    print(p.stdout)
    if not p.stdout.startswith(prompt) or len(p.stdout) <= len(prompt) + 1:
        failures.append("the sample does not continue the prompt: %r" % p.stdout[:200])


def check_wide(args, work, failures):
    os.makedirs(work, exist_ok=True)
    vocab = 70000
    ids = [(i * 7919) % vocab for i in range(20000)]
    for name, n in [("train", 16000), ("val", 4000)]:
        part = ids[:n] if name == "train" else ids[16000:]
        with open("%s/%s_000000.bin" % (work, name), "wb") as f:
            f.write(struct.pack("<3i", MAGIC, 2, len(part)) + b"\0" * 1012 + struct.pack("<%dI" % len(part), *part))
    common = ["--set", "model.d_model=32", "--set", "model.layers=1", "--set", "model.heads=2",
              "--set", "model.vocab=%d" % vocab]
    p = run_noting(deck_args(args, work + "/run", work) + common, failures)
    if "2 files" not in p.stdout and "(1 file, 16000 tokens" not in p.stdout:
        failures.append("the uint32 shard was not read: " + p.stdout[-400:])
    with open(work + "/val_000000.bin", "r+b") as f:
        f.truncate(1024 + 4 * 4000 - 2)
    refused(args, failures, deck_args(args, work + "/run2", work) + common, "val_000000.bin", "truncated")


CASES = {"roundtrip": check_roundtrip, "noop_resume": check_noop_resume, "refusals": check_refusals,
         "eval": check_eval, "sample": check_sample, "wide": check_wide}


def main():
    args = case_arguments(__doc__, CASES)
    work = os.path.join(os.path.abspath(args.workdir), args.case)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    failures = []
    CASES[args.case](args, work, failures)
    return finish(failures)


if __name__ == "__main__":
    sys.exit(main())
