"""DistributedDataParallel around an OrtModule, 2 processes with the gloo backend: gradients
equal to DDP around the eager model. Run by test_training.py; prints one line per rank."""

import copy
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import ortbridge
import training_functions as tf

WORLD = 2


def worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # the same initial model in every process
    model = tf.Apply(lambda m, h: tf.BiasGelu.apply(h, m.bias), bias=torch.nn.Parameter(torch.randn(6)))
    eager, wrapped = DDP(copy.deepcopy(model)), DDP(ortbridge.OrtModule(copy.deepcopy(model)))
    local = copy.deepcopy(model)  # this process's data alone, without DDP
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, wrapped)]
    worst, averaged = 0.0, False
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))  # each rank its own data
        for m in (eager, wrapped):
            m(x).square().mean().backward()
        local(x).square().mean().backward()
        for p, q, r in zip(eager.parameters(), wrapped.parameters(), local.parameters()):
            worst = max(worst, (p.grad - q.grad).abs().max().item())
            averaged |= not torch.allclose(p.grad, r.grad)  # DDP's all-reduce changed the gradient
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        local.zero_grad()
        local.load_state_dict(eager.module.state_dict())
    assert ortbridge.context_pool_size() == 0
    results = [None] * WORLD
    dist.all_gather_object(results, (worst, averaged))
    if rank == 0:  # one process prints, so that the lines do not interleave
        for r, (difference, reduced) in enumerate(results):
            print(f"rank {r}: max gradient difference {difference:.3g}, all-reduced {reduced}")
    dist.destroy_process_group()
    # Leave without interpreter finalization: gloo's worker thread may still be destroying the
    # all-gather's work, whose tensors it then decrefs, taking the GIL of a finalizing interpreter:
    # pthread_exit through a noexcept destructor in torch's ProcessGroupGloo::runLoop, std::terminate
    # (gdb backtrace, about 1 run in 4 on a loaded machine).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(worker, args=(free_port,), nprocs=WORLD)
    sys.exit(0)
