"""The cost of dropout drawing from torch's generator: a training step of a small MLP with
dropout, OrtModule with dropout in ONNX Runtime against OrtModule with dropout in PyTorch.

What is measured
----------------
One step = forward, mean-squared loss, backward, AdamW step, zero_grad, of an MLP
Linear(w, 4w), ReLU, Dropout(0.1), Linear(4w, w), Dropout(0.1) on a batch x w input, on three
copies of the same model:
  eager        plain PyTorch
  ORT's RNG    ortbridge.OrtModule with random operators written as ONNX (Dropout), drawing from
               ONNX Runtime's own generator, which torch.manual_seed does not seed (as before
               random operators ran in PyTorch)
  torch's RNG  ortbridge.OrtModule as it is: each dropout one fallback node (native_dropout,
               run by PyTorch on ONNX Runtime's buffers), its mask saved for backward
Seeded alike, the torch's RNG copy must give eager's loss at the first step (graphs are
captured then, outside the timing). The table gives the median step time over --repeats
repeats and the ratios to eager from the same run (lower is better).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from common import medians, versions

import ortbridge
from ortbridge._tracing import fallback

nn = torch.nn


def mlp(width: int, p: float = 0.1) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, 4 * width), nn.ReLU(), nn.Dropout(p), nn.Linear(4 * width, width), nn.Dropout(p)
    )


def trainer(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def first_step(step, random_in_onnx: bool = False) -> torch.Tensor:
    """The first (capturing) step, seeded; with `random_in_onnx`, captured with random operators
    left to torch's ONNX exporter (ONNX Runtime's generator)."""
    random = fallback._random
    if random_in_onnx:
        fallback._random = lambda op: False
    try:
        torch.manual_seed(1)
        return step()
    finally:
        fallback._random = random


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--target", type=float, default=0.3, help="seconds per repeat")
    parser.add_argument("--quick", action="store_true", help="the small size, few repeats (a smoke test)")
    parser.add_argument("--threads", type=int, help="torch's (and so ONNX Runtime's) thread count")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [(32, 64)] if args.quick else [(32, 64), (256, 256)]
    repeats, target = (3, 0.05) if args.quick else (args.repeats, args.target)
    print(versions())
    print(f"torch threads {torch.get_num_threads()}; median of {repeats} repeats\n")
    print(f"{'batch x width':>14} {'eager ms':>9} {'ORT RNG ms':>11} {'ratio':>6} {'torch RNG ms':>13} {'ratio':>6}")
    for batch, width in sizes:
        torch.manual_seed(0)
        model, x, y = mlp(width), torch.randn(batch, width), torch.randn(batch, width)
        steps = [
            trainer(m, x, y)
            for m in (
                copy.deepcopy(model),
                ortbridge.OrtModule(copy.deepcopy(model)),
                ortbridge.OrtModule(copy.deepcopy(model)),
            )
        ]
        eager, onnx_rng, torch_rng = first_step(steps[0]), first_step(steps[1], True), first_step(steps[2])
        if not torch.allclose(torch_rng, eager, rtol=1e-5) or not torch.isfinite(onnx_rng):
            print(
                f"{batch} x {width}: first losses {eager.item()} (eager), {onnx_rng.item()} (ORT's RNG), "
                f"{torch_rng.item()} (torch's RNG): torch's RNG should give eager's"
            )
            return 1
        eager, *wrapped = (t * 1e3 for t in medians(steps, repeats, target, warmup=3))
        print(
            f"{f'{batch} x {width}':>14} {eager:9.3f}"
            + "".join(f" {t:{w}.3f} {t / eager:6.2f}" for t, w in zip(wrapped, (11, 13)))
        )
    assert ortbridge.context_pool_size() == 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
