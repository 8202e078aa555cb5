#!/usr/bin/env python3
"""run.tensorboard = true: the TensorBoard event files of a run against its metrics.jsonl, read by a reader
of this script's own (no tensorboard or tensorflow package; its own CRC32C and protobuf decoding), so a
fault in loom's writer is not repeated by the check.

    /usr/bin/python3 regression/tensorboard_check.py --loom build/loom --workdir build/tensorboard-checks CASE
    /usr/bin/python3 regression/tensorboard_check.py --compare RUN_DIR      (any run's files, no loom run)

What is checked of a run directory: every events.out.tfevents.* file (read in name order, as TensorBoard
does) is whole TFRecords, both masked CRC32Cs right; its first event is file_version "brain.Event:2"; a
SessionLog START at step S drops the steps >= S read before it (TensorBoard's purge); then every row of
metrics.jsonl has one event at its step holding every numeric scalar of the row (nested objects joined
with "/", array elements by index, booleans 0/1, strings left out, "step" the event's own), equal to
float32 rounding, and no tag the row lacks (but numbers the row writes as null: not finite).

CASE is one of:
  val_np1          6 steps, validation every 2 steps (val_loss at steps 2, 4, 6)
  val_dp2          the same at 2 ranks (parallel.dp = 2): only rank 0 writes, comm/ tags present
  resume           6 steps with checkpoints every 2, then resumed from step 2's for 8 steps: a second event
                   file whose START drops the first file's steps 3..6; the merged steps 1..8 equal
                   metrics.jsonl
  rollback         a loss spike at step 31 (bad data injected, train.on_spike = rollback) rolled back to
                   step 28: the file holds steps 29..31 twice, and its START at 29 drops the undone ones
                   as metrics.jsonl sets their rows aside
  defects          the check fails on planted defects of a good run's files: one byte of a row event's
                   data changed (data CRC mismatch naming the record and offset), one byte of a length
                   (length CRC mismatch), a file cut short, a metrics value changed, a scalar the
                   events lack
Standard library only.
"""
import glob
import json
import math
import os
import re
import shutil
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


# --- The reader ---------------------------------------------------------------------------------------

def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked(c):
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class BadFile(Exception):
    pass


def records(path):
    """The data of each TFRecord of `path`, as (index, offset, bytes); BadFile names the record, its
    offset and what is wrong."""
    data = open(path, "rb").read()
    at, i = 0, 0
    while at < len(data):
        where = "%s: record %d at offset %d" % (path, i, at)
        if at + 12 > len(data):
            raise BadFile("%s: cut short in its header (%d of 12 bytes)" % (where, len(data) - at))
        length, stored = struct.unpack_from("<QI", data, at)
        if masked(crc32c(data[at:at + 8])) != stored:
            raise BadFile("%s: length CRC mismatch (stored 0x%08x, computed 0x%08x)"
                          % (where, stored, masked(crc32c(data[at:at + 8]))))
        end = at + 12 + length
        if end + 4 > len(data):
            raise BadFile("%s: cut short (%d data bytes + 4 CRC bytes, %d left)" % (where, length, len(data) - at - 12))
        body = data[at + 12:end]
        (stored,) = struct.unpack_from("<I", data, end)
        if masked(crc32c(body)) != stored:
            raise BadFile("%s: data CRC mismatch (stored 0x%08x, computed 0x%08x)" % (where, stored, masked(crc32c(body))))
        yield i, at, body
        at, i = end + 4, i + 1


def varint(buf, pos):
    shift = value = 0
    while True:
        if pos >= len(buf):
            raise BadFile("a varint runs past the end of its message")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return value, pos
        shift += 7


def fields(buf):
    """(field number, wire type, value) of a protobuf message: an int (varint), bytes (length-delimited,
    fixed32, fixed64)."""
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise BadFile("wire type %d (field %d) is not one an Event uses" % (wire, field))
        if pos > len(buf):
            raise BadFile("field %d runs past the end of its message" % field)
        yield field, wire, value


def decode_event(buf):
    """An Event (tensorflow/core/util/event.proto) as a dict: wall_time, step, file_version, values
    ([(tag, simple_value)] of its Summary), start (a SessionLog START)."""
    ev = {"step": 0, "values": [], "start": False}
    for field, wire, v in fields(buf):
        if field == 1 and wire == 1:
            ev["wall_time"] = struct.unpack("<d", v)[0]
        elif field == 2 and wire == 0:
            ev["step"] = v - (1 << 64) if v >= 1 << 63 else v
        elif field == 3 and wire == 2:
            ev["file_version"] = v.decode()
        elif field == 5 and wire == 2:
            for f, w, value in fields(v):  # Summary.value
                if f == 1 and w == 2:
                    tag, simple = None, None
                    for vf, vw, x in fields(value):  # Summary.Value
                        if vf == 1 and vw == 2:
                            tag = x.decode()
                        elif vf == 2 and vw == 5:
                            simple = struct.unpack("<f", x)[0]
                    ev["values"].append((tag, simple))
        elif field == 6 and wire == 2:
            ev["start"] = any(f == 1 and value == 1 for f, _, value in fields(v))
    return ev


EVENT_NAME = re.compile(r"^events\.out\.tfevents\.\d{10}\.[^/]+$")


def event_files(rundir):
    return sorted(glob.glob(os.path.join(rundir, "*tfevents*")))


def read_run(rundir, failures):
    """{step: {tag: value}} as TensorBoard would show the run: files in name order, a SessionLog START
    at step S dropping the steps >= S read before it."""
    steps = {}
    files = event_files(rundir)
    if not files:
        failures.append("%s: no events.out.tfevents.* file" % rundir)
    for path in files:
        if not EVENT_NAME.match(os.path.basename(path)):
            failures.append("%s: not named events.out.tfevents.<unix seconds>.<host>" % path)
        try:
            for i, at, body in records(path):
                ev = decode_event(body)
                if i == 0:
                    if ev.get("file_version") != "brain.Event:2" or not ev.get("wall_time", 0) > 1e9:
                        failures.append("%s: first event is not file_version brain.Event:2 with a wall_time: %s"
                                        % (path, ev))
                    continue
                if ev["start"]:
                    steps = {s: v for s, v in steps.items() if s < ev["step"]}
                    continue
                if ev["step"] in steps:
                    failures.append("%s: record %d at offset %d: step %d logged twice"
                                    % (path, i, at, ev["step"]))
                steps[ev["step"]] = dict(ev["values"])
        except BadFile as e:
            failures.append(str(e))
    return steps


def flatten(value, tag="", out=None):
    """A metrics row's numbers by tag, as loom names them (None: a number written as null)."""
    out = {} if out is None else out
    prefix = tag + "/" if tag else ""
    if isinstance(value, dict):
        for k, v in value.items():
            if not (tag == "" and k == "step"):
                flatten(v, prefix + k, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            flatten(v, prefix + str(i), out)
    elif isinstance(value, bool):
        out[tag] = 1.0 if value else 0.0
    elif isinstance(value, (int, float)):
        out[tag] = float(value)
    elif value is None:
        out[tag] = None
    return out


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def compare(rundir):
    """Failures of the run's event files against its metrics.jsonl (empty: they agree)."""
    failures = []
    events = read_run(rundir, failures)
    rows = common.rows(rundir)
    if not rows:
        failures.append("%s: no metrics.jsonl rows" % rundir)
    for row in rows:
        step = row["step"]
        if step not in events:
            failures.append("step %d: in metrics.jsonl, no event" % step)
            continue
        got = events.pop(step)
        for tag, want in flatten(row).items():
            if want is None:  # not finite: null in JSON, the value itself in the event
                if tag in got and math.isfinite(got[tag]):
                    failures.append("step %d: %s is null in metrics.jsonl but %r in the event" % (step, tag, got[tag]))
            elif tag not in got:
                failures.append("step %d: %s = %r is not in the event" % (step, tag, want))
            elif got[tag] != f32(want):
                failures.append("step %d: %s = %r in the event, %r in metrics.jsonl (float32 %r)"
                                % (step, tag, got[tag], want, f32(want)))
        extra = sorted(set(got) - set(flatten(row)))
        if extra:
            failures.append("step %d: tags not in metrics.jsonl: %s" % (step, ", ".join(extra)))
    for step in sorted(events):
        failures.append("step %d: an event, no metrics.jsonl row" % step)
    return failures


def report(rundir, failures):
    events = read_run(rundir, [])
    tags = sorted({t for v in events.values() for t in v})
    print("%s: %d file(s), %d steps, %d tags: %s" % (rundir, len(event_files(rundir)), len(events), len(tags),
                                                   " ".join(tags)))
    for f in failures:
        print("  " + f)
    return tags


# --- The cases ----------------------------------------------------------------------------------------

DECK = common.small_deck(steps=6, val_fraction=0.1)
ON = ["run.tensorboard=true", "train.eval_every=2"]


def checked_run(c, tag, ranks, sets):
    p, rundir = c.loom(tag, ranks, ON + sets)
    c.expect(p.stdout, [r"events  : \S+/events\.out\.tfevents\.\d+\.\S+ \(run\.tensorboard"], "stdout")
    failures = compare(rundir)
    tags = report(rundir, failures)
    c.failures += failures
    val_steps = [r["step"] for r in common.rows(rundir) if "val_loss" in r]
    c.check(val_steps == [2, 4, 6], "val_loss at steps %s, expected 2, 4, 6" % val_steps)
    for t in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "times_ms/forward", "val_loss"):
        c.check(t in tags, "no tag %s" % t)
    c.check(any(t.startswith("mem_peak_bytes/") for t in tags), "no mem_peak_bytes/ tag")
    return rundir, tags


def case_val(c, name):
    ranks = 2 if name.endswith("dp2") else 1
    rundir, tags = checked_run(c, "run", ranks, ["parallel.dp=%d" % ranks])
    if ranks == 2:
        c.check(any(t.startswith("comm/") for t in tags), "no comm/ tag at 2 ranks")
        c.check(len(event_files(rundir)) == 1, "%d event files: only rank 0 writes one" % len(event_files(rundir)))
    # Off by default: no event file.
    _, off = c.loom("off", 1, ["train.steps=1"])
    c.check(not event_files(off), "run.tensorboard defaults to false, yet an event file was written")


def case_resume(c, name):
    rundir, _ = checked_run(c, "run", 1, ["checkpoint.every=2", "checkpoint.keep=4"])
    first = event_files(rundir)
    ckpt = os.path.join(rundir, "checkpoints", "ckpt-00000002.h5")
    p, _ = c.loom("run", 1, ON + ["checkpoint.resume=" + ckpt, "train.steps=8"])
    files = event_files(rundir)
    c.check(len(files) == 2 and files[0] == first[0], "after the resume: %s (before: %s)" % (files, first))
    c.check([r["step"] for r in common.rows(rundir)] == list(range(1, 9)), "metrics.jsonl steps after the resume")
    c.check(len(common.rows(rundir, "metrics.jsonl.superseded")) == 4, "steps 3..6 not set aside in metrics.jsonl")
    failures = compare(rundir)
    report(rundir, failures)
    c.failures += failures


def case_rollback(c, name):
    sets = ["train.steps=60", "train.eval_batches=16", "checkpoint.every=4", "checkpoint.keep=2",
            "train.spike_window=16", "train.on_spike=rollback", "train.spike_skip_batches=3"]
    p, rundir = c.loom("run", 1, ON + sets, env={"LOOM_INJECT_FAULT": "rank=0,step=30,where=bad_data"})
    c.expect(p.stdout, [r"loss spike at step 31: rolled back to step 28"], "stdout")
    undone = [r["step"] for r in common.rows(rundir, "metrics.jsonl.superseded")]
    written = [decode_event(body)["step"] for path in event_files(rundir) for i, _, body in records(path) if i > 0]
    print("metrics.jsonl.superseded: steps %s; event steps written (START included): %d" % (undone, len(written)))
    c.check(undone == [29, 30, 31], "steps set aside by the rollback: %s, expected 29, 30, 31" % undone)
    c.check(all(written.count(s) >= 2 for s in undone), "the undone steps were not written twice")
    failures = compare(rundir)
    report(rundir, failures)
    c.failures += failures


def expect_defect(c, rundir, what, pattern):
    failures = compare(rundir)
    print("planted %s: %s" % (what, failures[:2]))
    c.check(any(re.search(pattern, f) for f in failures),
            "planted %s: no failure matching /%s/ (got %s)" % (what, pattern, failures[:3]))


def planted(c, good, name, edit):
    """A copy of the good run's folder with `edit(event file path, metrics path)` applied."""
    d = os.path.join(c.dir, name)
    shutil.copytree(good, d)
    edit(event_files(d)[0], os.path.join(d, "metrics.jsonl"))
    return d


def flip(path, at):
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0x01
    open(path, "wb").write(bytes(data))


def case_defects(c, name):
    good, _ = checked_run(c, "run", 1, [])
    path = event_files(good)[0]
    offsets = [at for _, at, _ in records(path)]
    third = offsets[2]  # the first row's event (after file_version and SessionLog START)
    d = planted(c, good, "data_byte", lambda ev, m: flip(ev, third + 12 + 20))
    expect_defect(c, d, "a changed data byte", r"record 2 at offset %d: data CRC mismatch" % third)
    d = planted(c, good, "length_byte", lambda ev, m: flip(ev, offsets[3]))
    expect_defect(c, d, "a changed length byte", r"record 3 at offset %d: length CRC mismatch" % offsets[3])
    d = planted(c, good, "cut", lambda ev, m: open(ev, "r+b").truncate(os.path.getsize(ev) - 3))
    expect_defect(c, d, "a file cut short", r"record %d at offset %d: cut short" % (len(offsets) - 1, offsets[-1]))

    def change_row(m, fn):
        lines = open(m).read().splitlines()
        rows = [json.loads(l) for l in lines]
        fn(rows[1])
        open(m, "w").write("".join(json.dumps(r) + "\n" for r in rows))
    d = planted(c, good, "value", lambda ev, m: change_row(m, lambda r: r.update(loss=r["loss"] * (1 + 1e-5))))
    expect_defect(c, d, "a changed loss", r"step 2: loss = \S+ in the event, \S+ in metrics\.jsonl")
    d = planted(c, good, "missing", lambda ev, m: change_row(m, lambda r: r["times_ms"].update(extra=1.0)))
    expect_defect(c, d, "a scalar the events lack", r"step 2: times_ms/extra = 1\.0 is not in the event")
    c.check(not compare(good), "the unplanted run fails: %s" % compare(good)[:3])


CASES = {"val_np1": case_val, "val_dp2": case_val, "resume": case_resume, "rollback": case_rollback, "defects": case_defects}


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--compare":
        failures = compare(sys.argv[2])
        report(sys.argv[2], failures)
        return common.finish(failures)
    args = common.case_arguments(__doc__, CASES)
    c = common.Case(args, args.case, DECK, "tensorboard.deck", label="tensorboard")
    CASES[args.case](c, args.case)
    return c.done(args.case)


if __name__ == "__main__":
    sys.exit(main())
