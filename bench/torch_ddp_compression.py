#!/usr/bin/python3
"""PyTorch's peer of bench/compression_learning.py: the same GPT-2 (regression/torch_gpt.py, loom's
model, AdamW, clipping and schedule) under DistributedDataParallel at 2 ranks (gloo, one thread each),
uncompressed and with PyTorch's powerSGD_hook (rank 2, from step 11, error feedback, warm start), on
a text file's bytes (the first 90%: random windows of seq_len + 1 bytes, drawn per seed, rank and
step); prints one JSON line: the mean of the last 20 steps' loss (over ranks) per configuration.

    /usr/bin/python3 bench/torch_ddp_compression.py --text FILE --seed 1 [--steps 300] [--configs none powersgd_r2]

Its data differ from loom's (another sampler), so compare each framework's gap to its own
uncompressed runs, not losses across frameworks. Run with the Python that has torch.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "regression"))
import torch_gpt  # noqa: E402

CFG = dict(layers=2, d_model=64, heads=4, seq_len=64, vocab=256, lr=1e-3, lr_min=1e-4, schedule="cosine", warmup=20,
           weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=1.0, batch_per_rank=8)


def train(rank, world, args, config, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = dict(CFG, steps=args.steps)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = torch_gpt.build_model(cfg)
    ddp = DDP(model)
    if config == "powersgd_r2":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10,
                                   min_compression_rate=2, use_error_feedback=True, warm_start=True,
                                   random_seed=args.seed)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch_gpt.make_optimizer(model, cfg)
    data = np.frombuffer(open(args.text, "rb").read(), dtype=np.uint8)
    data = torch.from_numpy(data[: int(0.9 * len(data))].astype(np.int64))
    T, B = cfg["seq_len"], cfg["batch_per_rank"]
    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed((args.seed * 1000003 + step) * 64 + rank)
        starts = torch.randint(0, len(data) - T - 1, (B,), generator=g)
        x = torch.stack([data[s:s + T] for s in starts])
        y = torch.stack([data[s + 1:s + T + 1] for s in starts])
        torch_gpt.set_lr(opt, torch_gpt.lr_at(step, cfg))
        opt.zero_grad(set_to_none=True)
        _, loss = ddp(x, y)
        loss.backward()
        torch_gpt.clip_grad_norm(model.parameters(), cfg["grad_clip"])
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"loss": sum(losses[-20:]) / 20}, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--configs", nargs="+", default=["none", "powersgd_r2"])
    ap.add_argument("--workdir", default="build/bench-torch-ddp")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    result = {}
    for i, config in enumerate(args.configs):
        out = os.path.join(args.workdir, "%s-s%d.json" % (config, args.seed))
        mp.spawn(train, args=(2, args, config, 29500 + (os.getpid() + i) % 1000, out), nprocs=2, join=True)
        result[config] = json.load(open(out))["loss"]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
