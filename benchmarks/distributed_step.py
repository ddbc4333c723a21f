"""A training step under torch's distributed engines, 2 processes with gloo on the CPU: eager PyTorch
against OrtModule, and how much of DistributedDataParallel's all-reduce overlaps the backward run.

    python benchmarks/distributed_step.py [--quick]

The model: BLOCKS of examples/distributed.py's blocks (Linear(WIDTH, 4 WIDTH), a Function
x * sigmoid(1.702 x) with a hand-written backward, Linear(4 WIDTH, WIDTH), a residual), on a batch
of BATCH rows; SGD. Variants, each
on the same data in the same run, their repeats interleaved:
  eager          the plain model.
  OrtModule      OrtModule(model): one forward and one backward graph for all blocks; under
                 torch.distributed its backward graph runs in stages by default (stages.py:
                 one per STAGE_BYTES of gradients), each stage's gradients released to DDP.
  one piece      OrtModule(model, backward_stages=1): the backward graph in one run (DDP only).
  per block      each block an OrtModule (the usual pattern, as under FSDP2).
  compile        torch.compile(DDP(model), backend="ortbridge") (DDP only): dynamo splits the
                 model's graph where DDP's buckets end, each piece a capture of its own.
under DDP (bucket size 1 MB, so that several buckets are all-reduced) and under FSDP2 (fully_shard
of each block and of the model; eager and per block: a whole-model OrtModule cannot be sharded).

A step: forward, loss, backward, optimizer step, zero_grad. Its time is the median over --repeats
of the mean of --steps steps, after warm-up; the ratio is the variant's over eager's.

Overlap (DDP): a communication hook records when each bucket's all-reduce starts and when it ends
(its future's callback), a post-accumulate-grad hook on each parameter when its gradient reached
autograd; the backward run is from backward()'s call to the last gradient. Overlap = the part of
the all-reduce time (summed over buckets) inside the backward run, over all of it, median over the
timed steps of rank 0. Eager's DDP starts a bucket's all-reduce while the rest of backward runs;
an OrtModule's parameters get their gradients when the backward run (or stage) that computes them
ends: in one piece, only the last bucket's all-reduce can start, after the whole graph.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import versions
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import ortbridge

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from distributed import Block  # noqa: E402 (the example's block: Linear, a Function, Linear, residual)

WORLD = 2
BLOCKS, WIDTH, BATCH = 6, 256, 64


def _model(per_block: bool) -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [Block(WIDTH) for _ in range(BLOCKS)]
    return torch.nn.Sequential(*(ortbridge.OrtModule(b) if per_block else b for b in blocks))


class Timeline:
    """What one step's communication and gradients did, in time.perf_counter() seconds."""

    def __init__(self, module: torch.nn.Module, ddp: DDP):
        self.buckets: list = []  # [start, end] per all-reduce
        self.ready: list = []  # when each parameter's gradient reached autograd
        self.backward_start = 0.0
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self.ready.append(time.perf_counter()))
        ddp.register_comm_hook(None, self._all_reduce)

    def _all_reduce(self, state, bucket):
        interval = [time.perf_counter(), None]
        self.buckets.append(interval)
        tensor = bucket.buffer().div_(dist.get_world_size())

        def done(future):
            interval[1] = time.perf_counter()
            return future.value()[0]

        return dist.all_reduce(tensor, async_op=True).get_future().then(done)

    def reset(self):
        self.buckets, self.ready = [], []

    def overlap(self) -> float:
        """The part of the all-reduce time inside the backward run."""
        end = max(self.ready)
        total = sum(b - a for a, b in self.buckets)
        inside = sum(max(0.0, min(b, end) - max(a, self.backward_start)) for a, b in self.buckets)
        return inside / total if total else 0.0


def _variants(engine: str) -> dict:
    base = _model(per_block=False)
    variants = {}
    if engine == "ddp":
        whole = copy.deepcopy(base)
        variants["eager"] = (DDP(copy.deepcopy(base), bucket_cap_mb=1), None)
        variants["OrtModule"] = (DDP(ortbridge.OrtModule(whole), bucket_cap_mb=1), None)
        variants["one piece"] = (
            DDP(ortbridge.OrtModule(copy.deepcopy(base), backward_stages=1), bucket_cap_mb=1),
            None,
        )
        per_block = torch.nn.Sequential(*(ortbridge.OrtModule(copy.deepcopy(b)) for b in base))
        variants["per block"] = (DDP(per_block, bucket_cap_mb=1), None)
        variants["compile"] = (DDP(copy.deepcopy(base), bucket_cap_mb=1), None)
        for name, (ddp, _) in variants.items():
            variants[name] = (ddp, Timeline(ddp.module, ddp))
        ddp, timeline = variants["compile"]  # (dynamo splits its graph at DDP's buckets: a capture each)
        variants["compile"] = (torch.compile(ddp, backend="ortbridge"), timeline)
    else:
        for name, per_block in (("eager", False), ("per block", True)):
            model = torch.nn.Sequential(
                *(ortbridge.OrtModule(copy.deepcopy(b)) if per_block else copy.deepcopy(b) for b in base)
            )
            for block in model:
                fully_shard(block)
            variants[name] = (fully_shard(model), None)
    return variants


def _step(model, optimizer, x, timeline):
    loss = model(x).square().mean()
    if timeline is not None:
        timeline.backward_start = time.perf_counter()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def worker(rank: int, port: int, repeats: int, steps: int, warmup: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)  # (two processes on a 2-core machine)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    rows = []
    for engine in ("ddp", "fsdp"):
        variants = _variants(engine)
        optimizers = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, (m, _) in variants.items()}
        times = {n: [] for n in variants}
        overlaps = {n: [] for n in variants}
        for name, (model, timeline) in variants.items():
            for _ in range(warmup):
                _step(model, optimizers[name], x, timeline)
        for _ in range(repeats):
            for name, (model, timeline) in variants.items():  # (interleaved)
                dist.barrier()
                started = time.perf_counter()
                for _ in range(steps):
                    if timeline is not None:
                        timeline.reset()
                    _step(model, optimizers[name], x, timeline)
                    if timeline is not None:
                        overlaps[name].append(timeline.overlap())
                times[name].append((time.perf_counter() - started) / steps)
        eager = statistics.median(times["eager"])
        for name in variants:
            t = statistics.median(times[name])
            overlap = f"{statistics.median(overlaps[name]):.2f}" if overlaps[name] else "n/a"
            rows.append((engine.upper(), name, t * 1e3, t / eager, overlap))
    assert ortbridge.context_pool_size() == 0
    if rank == 0:
        print(f"{'engine':<6} {'variant':<10} {'ms/step':>8} {'/ eager':>8} {'overlap':>8}")
        for engine, name, ms, ratio, overlap in rows:
            print(f"{engine:<6} {name:<10} {ms:>8.2f} {ratio:>8.2f} {overlap:>8}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (as tests/python/distributed_train.py: gloo's threads at interpreter exit)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 repeats of 2 steps")
    args = p.parse_args(argv)
    repeats, steps, warmup = (2, 2, 2) if args.quick else (args.repeats, args.steps, 5)
    print(versions())
    print(
        f"2 processes, gloo, 1 torch thread each; {BLOCKS} blocks of width {WIDTH}, batch {BATCH}; "
        f"{repeats} repeats of {steps} steps (median)"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, repeats, steps, warmup), nprocs=WORLD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
