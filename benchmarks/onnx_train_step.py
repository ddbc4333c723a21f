"""A training step of an ONNX model as ortbridge.OnnxModule against the eager torch module it was
exported from.

What is measured
----------------
An MLP (8 -> 256 -> 256 -> 10, ReLU) and a small CNN (two 3x3 convolutions with ReLU and max
pooling, global average pooling, a linear head) are exported with ortbridge.export, loaded back
as OnnxModule (every initializer a Parameter; the backward graph from onnxruntime-training's
builder where that is the installed onnxruntime, else from torch: the last column says), and trained with AdamW on a fixed batch: the step
is forward, loss, backward and the optimizer step. Eager runs the same step on the torch original.
Before timing, the first steps' losses of both must agree. The table gives each step's median
time (ms) over --repeats interleaved repeats and the ratio OnnxModule / eager.
"""

from __future__ import annotations

import argparse
import copy
import io
import sys

import torch
import torch.nn.functional as F
from common import medians, versions
from train_step import trainer

import ortbridge

nn = torch.nn


def mlp():
    return nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--target", type=float, default=0.3, help="seconds per repeat")
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke test)")
    args = parser.parse_args()
    repeats, target = (3, 0.05) if args.quick else (args.repeats, args.target)
    cases = [("MLP", mlp, (64, 8)), ("CNN", cnn, (16, 3, 32, 32))]
    print(versions())
    print(f"torch threads {torch.get_num_threads()}; median of {repeats} repeats\n")
    print(f"{'model':>5} {'input':>16} {'eager ms':>9} {'OnnxModule ms':>14} {'ratio':>6}  gradient builder")
    for name, make, shape in cases:
        torch.manual_seed(0)
        model = make()
        x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
        f = io.BytesIO()
        ortbridge.export(copy.deepcopy(model), (x,), f)
        module = ortbridge.OnnxModule(f.getvalue())
        steps = [trainer(m, x, y, F.cross_entropy) for m in (model, module)]
        first = [s() for s in steps]  # (captures OnnxModule's graphs)
        if not torch.allclose(first[1], first[0], rtol=1e-4, atol=1e-6):
            print(f"{name}: OnnxModule's loss {first[1].item()} differs from eager's {first[0].item()}")
            return 1
        eager, onnx_module = (t * 1e3 for t in medians(steps, repeats, target, warmup=3))
        size = " x ".join(map(str, shape))
        print(
            f"{name:>5} {size:>16} {eager:9.3f} {onnx_module:14.3f} {onnx_module / eager:6.2f}  "
            f"{module.forward_backward.gradient_builder}"
        )
    assert ortbridge.context_pool_size() == 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
