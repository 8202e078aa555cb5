#!/usr/bin/env python3
"""ZeRO traffic and memory per rank, stages 1-3, checked against the textbook and loom's own schedule.

    python3 regression/zero_checks.py --loom build/loom --workdir build/zero-checks [--ranks 2]

Trains a 6-layer version of the small deck with 2 micro-batches at dp = N, zero.stage = 0, 1, 2 and 3,
and checks every step of rank 0's metrics. M = 4P bytes (P parameters, all fp32); S = P elements cut
into N shares of P//N or P//N + 1 (shard_counts), share_q rank q's; a unit (the embeddings, a block,
the head) is one run of the flat range, and own_q(u) is how many of its elements rank q owns. The
collectives are rings, so rank 0 sends every block but its own in a reduce-scatter and every block but
rank 1's in an all-gather:
  1. bytes
     stage 1: reduce-scatter once after the micro-batches, all-gather after the update:
              2(N-1)/N M to within 2N x 4 bytes of share rounding;
     stage 2: each unit reduce-scattered every micro-batch, m x 4(S - share_0), plus the refresh
              all-gather 4(S - share_1); m = 1 would be the textbook 2(N-1)/N M;
     stage 3: the same reduce-scatter, and one all-gather of unit u per use, 4(len_u - own_1(u)) each:
              after the first step (which records the order of use) every block twice per micro-batch
              (forward, backward), the head once (kept from its forward to its backward), the tied
              embedding 2m + 1 times (the embedding's forward, the head's, the embedding's backward;
              the last backward's copy serves the next micro-batch's first forward); the textbook
              3(N-1)/N M counts each tensor twice per step;
     every stage: at most 2(N-1) x 8 bytes a step of scalar all-reduces (the loss mean) besides.
  2. memory: the ledger's model state on rank 0 (parameters + gradients + AdamW moments) is exactly the
     textbook share plus the buffers loom adds, named in the metrics:
     stage 1: 4P + 4P + 8 share_0 (textbook 4P + 4P + 8P/N);
     stage 2: 4P + 4 share_0 + 8 share_0 + staging (textbook 4P + 4P/N + 8P/N), the gradient staging
              being the embeddings', the head's and two blocks' gradients (the block backward writes
              and the one whose reduce-scatter is in flight): the full gradient buffer (4P) is never
              allocated;
     stage 3: 16 share_0 + staging + gathered (textbook 16P/N), the gathered parameters at most the
              embeddings, the head and two blocks (the block computing and the one fetched ahead);
     and the collectives' scratch is named (zero_comm_scratch_bytes).
  3. the loss curve equals stage 0's to the dp cases' tolerance (1e-5 relative).
Standard library only.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LAYERS, C, T, V, MICRO = 6, 32, 16, 64, 2
DECK = common.small_deck(steps=6, log_every=1).replace("layers = 2", "layers = %d" % LAYERS) \
    .replace("[train]\n", "[train]\nmicro_batches = %d\n" % MICRO)


def units():
    """Element counts of the model's units in order: embeddings, blocks, head (tp = 1)."""
    block = [C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C]
    return [("embeddings", V * C + T * C)] + [("blocks.%d" % i, sum(block)) for i in range(LAYERS)] + [("head", 2 * C)]


def shard_offsets(total, n):
    counts = [total // n + (1 if q < total % n else 0) for q in range(n)]
    off = [0]
    for c in counts:
        off.append(off[-1] + c)
    return off


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    common.add_launcher_arguments(ap)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    n, m = args.ranks, MICRO
    c = common.Case(args, "zero_np%d" % n, DECK, "zero.deck")
    runs = {}
    for stage in range(4):
        sets = ["parallel.dp=%d" % n, "zero.stage=%d" % stage, "run.overwrite=true"]
        _, runs[stage] = c.loom("stage%d" % stage, n, sets)
    P = common.summary(runs[1]).get("parameters_rank0", 0)
    us = units()
    c.check(sum(k for _, k in us) == P, "the unit table sums to %d elements, loom reports P = %d" % (sum(k for _, k in us), P))
    off = shard_offsets(P, n)
    share = [off[q + 1] - off[q] for q in range(n)]
    lo = [0]
    for _, k in us:
        lo.append(lo[-1] + k)

    def own(q, u):
        return max(0, min(lo[u + 1], off[q + 1]) - max(lo[u], off[q]))

    length = [k for _, k in us]
    emb, head, block = length[0], length[-1], max(length[1:-1])
    rs_formula = m * 4 * (P - share[0])
    uses = [2 * m + 1] + [2 * m] * LAYERS + [m]
    ag3 = sum(g * 4 * (length[u] - own(1 % n, u)) for u, g in enumerate(uses))
    base = common.rows(runs[0])
    c.check(len(base) == 6, "stage 0: 6 steps logged")
    for stage in (1, 2, 3):
        rows = common.rows(runs[stage])
        c.check(len(rows) == 6, "stage %d: 6 steps logged" % stage)
        for r0, r in zip(base, rows):
            s = r["step"]
            tag = "stage %d step %d" % (stage, s)
            rs, ag, ar = r["zero_reduce_scatter_bytes"], r["zero_all_gather_bytes"], r["zero_all_reduce_bytes"]
            textbook = (3 if stage == 3 else 2) * (n - 1) / n * 4 * P
            c.check(abs(r["zero_textbook_bytes"] - textbook) < 1e-6, "%s: zero_textbook_bytes %s, expected %s" % (tag, r["zero_textbook_bytes"], textbook))
            c.check(ar <= 2 * (n - 1) * 8, "%s: %d bytes of scalar all-reduces" % (tag, ar))
            mem = r["mem_peak_bytes"]
            state = r["zero_state_bytes"]
            staging, gathered = r.get("zero_grad_staging_bytes", 0), r.get("zero_param_gather_bytes", 0)
            if stage == 1:
                c.check(abs(rs + ag - textbook) <= 2 * n * 4, "%s: sent %d bytes, textbook %.1f" % (tag, rs + ag, textbook))
                c.check(mem["params"] == 4 * P and mem["grads"] == 4 * P, "%s: parameters/gradients not 4P" % tag)
                c.check(state == 8 * P + 8 * share[0], "%s: model state %d, expected %d" % (tag, state, 8 * P + 8 * share[0]))
            else:
                c.check(rs == rs_formula, "%s: reduce-scatter sent %d bytes, expected m x 4(S - share_0) = %d" % (tag, rs, rs_formula))
                c.check(r["zero_share_elements"] == share[0], "%s: share %d, expected %d" % (tag, r["zero_share_elements"], share[0]))
                c.check(staging == 4 * (emb + head + 2 * block),
                        "%s: gradient staging %d bytes, expected the embeddings', the head's and two blocks' %d"
                        % (tag, staging, 4 * (emb + head + 2 * block)))
                c.check(mem["grads"] == 4 * share[0] + staging and mem["grads"] < 4 * P,
                        "%s: gradients %d bytes, expected 4 x share_0 + staging = %d (< 4P = %d)"
                        % (tag, mem["grads"], 4 * share[0] + staging, 4 * P))
                c.check(mem["optimizer"] == 8 * share[0], "%s: AdamW state %d, expected 8 x %d" % (tag, mem["optimizer"], share[0]))
            if stage == 2:
                expected = 4 * (P - share[1 % n])
                c.check(ag == expected, "%s: all-gather sent %d bytes, expected 4(S - share_1) = %d" % (tag, ag, expected))
                c.check(mem["params"] == 4 * P, "%s: parameters %d, expected 4P" % (tag, mem["params"]))
                c.check(state == 4 * P + 12 * share[0] + staging, "%s: model state %d, expected 4P + 12 share_0 + staging = %d"
                        % (tag, state, 4 * P + 12 * share[0] + staging))
                c.check(abs(r["zero_state_textbook_bytes"] - (4 * P + 12 * P / n)) < 1e-6, "%s: textbook state" % tag)
            if stage == 3:
                if s > 1:  # the first step records the order of use
                    c.check(ag == ag3, "%s: all-gather sent %d bytes, expected %d (each unit's gathers)" % (tag, ag, ag3))
                    c.check(r["zero_unit_gathers"] == sum(uses), "%s: %d unit gathers, expected %d" % (tag, r["zero_unit_gathers"], sum(uses)))
                c.check(0 < gathered <= 4 * (emb + head + 2 * block), "%s: gathered parameters %d bytes, at most %d"
                        % (tag, gathered, 4 * (emb + head + 2 * block)))
                c.check(mem["params"] == 4 * share[0] + gathered, "%s: parameters %d, expected 4 share_0 + gathered" % (tag, mem["params"]))
                c.check(state == 16 * share[0] + staging + gathered, "%s: model state %d, expected 16 share_0 + staging + gathered = %d"
                        % (tag, state, 16 * share[0] + staging + gathered))
                c.check(abs(r["zero_state_textbook_bytes"] - 16 * P / n) < 1e-6, "%s: textbook state" % tag)
            c.check(abs(state - r["zero_state_textbook_bytes"] - staging - gathered) <= 16 * n,
                    "%s: model state minus the named buffers is off the textbook by more than share rounding" % tag)
            c.check(r["zero_comm_scratch_bytes"] > 0, "%s: the collectives' scratch is not named" % tag)
            c.check(abs(r["loss"] - r0["loss"]) <= 1e-5 * max(1.0, abs(r0["loss"])), "%s: loss %r, stage 0 %r" % (tag, r["loss"], r0["loss"]))
        last = rows[-1]
        print("stage %d, P = %d, N = %d, m = %d: sent %d bytes in the last step (textbook %.0f, ratio %.4f); model state %d bytes "
              "(textbook %.0f + staging %d + gathered %d); collectives' scratch %d"
              % (stage, P, n, m, last["zero_reduce_scatter_bytes"] + last["zero_all_gather_bytes"] + last["zero_all_reduce_bytes"],
                 last["zero_textbook_bytes"], last["zero_ratio"], last["zero_state_bytes"], last["zero_state_textbook_bytes"],
                 last.get("zero_grad_staging_bytes", 0), last.get("zero_param_gather_bytes", 0), last["zero_comm_scratch_bytes"]))
    return c.done("zero_checks np%d" % n)


if __name__ == "__main__":
    sys.exit(main())
