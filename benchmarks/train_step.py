"""Training-step time of a small transformer block with a custom Function: OrtModule and
torch.compile(backend="ortbridge") against eager PyTorch.

What is measured
----------------
One step = forward, mean-squared loss, backward, AdamW step, zero_grad, on a pre-norm
transformer block (LayerNorm, 4-head self-attention, LayerNorm, MLP) whose MLP activation is a
custom autograd.Function (bias + GeLU, hand-written backward). Three copies of the same model,
trained on the same batch:
  eager     plain PyTorch
  OrtModule ortbridge.OrtModule: ONNX Runtime runs the forward and backward graphs, the
            Function runs in PyTorch as a PythonOp / PythonOpGrad pair
  compile   torch.compile(model, backend="ortbridge"): dynamo captures the graph (it inlines this
            traceable Function, so ONNX Runtime runs its operators), ONNX Runtime runs it
Before timing, each wrapped copy must give eager's loss at the first step (graphs are captured
then, outside the timing). The table gives the median step time over --repeats repeats and the
ratio to eager from the same run (lower is better; 1.0 = as fast as eager). ONNX Runtime and
torch use their default thread counts.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import ortbridge
from common import medians, versions

F = torch.nn.functional


class BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return F.gelu(x + bias)

    @staticmethod
    def backward(ctx, g):
        x, bias = ctx.saved_tensors
        y = x + bias
        cdf = 0.5 * (1 + torch.erf(y * 0.7071067811865476))
        pdf = torch.exp(-0.5 * y * y) * 0.3989422804014327
        gy = g * (cdf + y * pdf)
        return gy, gy.reshape(-1, gy.shape[-1]).sum(0)


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int = 4):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(4 * width))
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.down(BiasGelu.apply(self.up(self.norm2(x)), self.bias))


def trainer(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--target", type=float, default=0.3, help="seconds per repeat")
    parser.add_argument("--quick", action="store_true", help="one small shape, few repeats (a smoke test)")
    args = parser.parse_args()
    shapes = [(8, 16, 64)] if args.quick else [(8, 16, 64), (16, 64, 128)]
    repeats, target = (3, 0.05) if args.quick else (args.repeats, args.target)
    print(versions())
    print(f"torch threads {torch.get_num_threads()}; median of {repeats} repeats\n")
    print(f"{'batch x seq x width':>20} {'eager ms':>9} {'OrtModule ms':>13} {'ratio':>6} {'compile ms':>11} {'ratio':>6}")
    for batch, seq, width in shapes:
        torch.manual_seed(0)
        model = Block(width)
        x, y = torch.randn(batch, seq, width), torch.randn(batch, seq, width)
        torch._dynamo.reset()
        steps = [trainer(m, x, y) for m in (copy.deepcopy(model), ortbridge.OrtModule(copy.deepcopy(model)),
                                            torch.compile(copy.deepcopy(model), backend="ortbridge"))]
        first = [s() for s in steps]  # captures the graphs
        for name, loss in zip(("OrtModule", "compile"), first[1:]):
            if not torch.allclose(loss, first[0], rtol=1e-4, atol=1e-6):
                print(f"{name} loss {loss.item()} differs from eager's {first[0].item()}")
                return 1
        eager, ort_module, compiled = (t * 1e3 for t in medians(steps, repeats, target, warmup=3))
        print(f"{f'{batch} x {seq} x {width}':>20} {eager:9.3f} {ort_module:13.3f} {ort_module / eager:6.2f} "
              f"{compiled:11.3f} {compiled / eager:6.2f}")
    assert ortbridge.context_pool_size() == 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
