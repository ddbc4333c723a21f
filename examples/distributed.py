"""Training with torch's distributed engines, each block of the model an OrtModule:
    torchrun --nproc-per-node 2 examples/distributed.py [--fsdp]
DistributedDataParallel (default) or FSDP2's fully_shard of each block, gloo on the CPU (NCCL on
CUDA devices when there are as many as processes). Rank 0 prints the loss of each step."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import ortbridge


class ScaledGelu(torch.autograd.Function):
    """x * sigmoid(1.702 x), with a hand-written backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return grad * (s + 1.702 * x * s * (1 - s))


class Block(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(ScaledGelu.apply(self.up(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp", action="store_true", help="fully_shard each block and the model (default: DDP)")
    parser.add_argument("--eager", action="store_true", help="the blocks without OrtModule, for comparison")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # the same initial model on every rank
    blocks = [Block().to(device) for _ in range(4)]
    if not args.eager:
        blocks = [ortbridge.OrtModule(block) for block in blocks]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(16, 1).to(device))
    if args.fsdp:
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if rank == 0:
        print(
            f"{dist.get_backend()} on {device}, {'FSDP2' if args.fsdp else 'DDP'}, "
            f"{'eager' if args.eager else 'OrtModule'} blocks",
            flush=True,
        )
    generator = torch.Generator(device=device).manual_seed(rank)  # each rank its own data
    for step in range(args.steps):
        x = torch.randn(32, 16, device=device, generator=generator)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    # DDP's reducer goes while the process group lives (destroyed after it, gloo can hang at exit);
    # every rank done before any tears the group down.
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
