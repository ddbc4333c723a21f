"""Decomposed or run by PyTorch? For each backward operator that torch's ONNX exporter can only
write through a decomposition, the training step of a one-layer model both ways.

What is measured
----------------
For each layer below, one step = forward, a weighted-sum loss, backward (gradient of the input
and of every parameter), on three copies of the same layer:
  eager       plain PyTorch
  decomposed  ortbridge.OrtModule with the operator out of fallback.PYTORCH_PREFERRED: torch's
              decomposition, run by ONNX Runtime's operators (where the decomposition ends in an
              accumulating index write, that write a fallback node: ONNX Runtime's ScatterND
              computes it wrongly)
  pytorch     ortbridge.OrtModule with the operator in fallback.PYTORCH_PREFERRED: one PythonOp
              node runs the operator itself in PyTorch on ONNX Runtime's buffers
Each copy's input gradient must match eager's before timing. The table gives the median step
time over --repeats repeats, and the ratios to eager from the same run (lower is better). An
operator belongs in PYTORCH_PREFERRED (python/ortbridge/_tracing/fallback.py) when "pytorch" beats
"decomposed" at both sizes. (embedding_dense_backward is no choice: its decomposition is a ScatterND
that ONNX Runtime computes wrongly on several threads; embedding_step.py times its forms.)
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from common import medians, versions

import ortbridge
from ortbridge._tracing import fallback

aten = torch.ops.aten
nn = torch.nn

# (operator, layer, input shape at the small and the large size)
CASES = [
    (aten.max_pool2d_with_indices_backward.default, lambda: nn.MaxPool2d(3, 2, 1), [(8, 16, 16, 16), (16, 32, 32, 32)]),
    (aten.native_layer_norm_backward.default, lambda: nn.LayerNorm(64), [(8, 32, 64), (32, 128, 64)]),
    (aten.native_group_norm_backward.default, lambda: nn.GroupNorm(4, 16), [(8, 16, 16, 16), (16, 16, 32, 32)]),
    (aten._log_softmax_backward_data.default, lambda: nn.LogSoftmax(-1), [(64, 100), (512, 1000)]),
]


def _step(model, x, weights):
    def step():
        x.grad = None
        (model(x) * weights).sum().backward()
        for p in model.parameters():
            p.grad = None
        return x.grad

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--target", type=float, default=0.2, help="seconds per repeat")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (a smoke test)")
    args = parser.parse_args()
    repeats, target = (3, 0.03) if args.quick else (args.repeats, args.target)
    print(versions())
    print(f"torch threads {torch.get_num_threads()}; median of {repeats} repeats\n")
    print(f"{'operator':>38} {'input':>18} {'eager ms':>9} {'decomposed':>11} {'ratio':>6} {'pytorch':>9} {'ratio':>6}")
    for op, layer, shapes in CASES:
        for shape in shapes[:1] if args.quick else shapes:
            torch.manual_seed(0)
            model = layer()
            x = torch.randn(*shape, requires_grad=True)
            weights = torch.randn_like(model(x))
            copies = [
                copy.deepcopy(model),
                ortbridge.OrtModule(copy.deepcopy(model)),
                ortbridge.OrtModule(copy.deepcopy(model)),
            ]
            steps = [_step(m, x, weights) for m in copies]
            reference = steps[0]().clone()
            preferred = op in fallback.PYTORCH_PREFERRED
            try:
                fallback.PYTORCH_PREFERRED.discard(op)
                steps[1]()  # captured with the decomposition
                fallback.PYTORCH_PREFERRED.add(op)
                steps[2]()  # captured with the operator run by PyTorch
            finally:
                (fallback.PYTORCH_PREFERRED.add if preferred else fallback.PYTORCH_PREFERRED.discard)(op)
            names = [_fallback_ops(c) for c in copies[1:]]
            if str(op).replace("aten.", "aten::") in names[0] or str(op).replace("aten.", "aten::") not in names[1]:
                print(f"{op}: expected the decomposition in the first copy, the operator in the second; got {names}")
                return 1
            for s in steps[1:]:
                torch.testing.assert_close(s(), reference, rtol=1e-4, atol=1e-5)
            eager, decomposed, pytorch = (t * 1e3 for t in medians(steps, repeats, target, warmup=3))
            print(
                f"{str(op):>38} {'x'.join(map(str, shape)):>18} {eager:9.3f} {decomposed:11.3f} "
                f"{decomposed / eager:6.2f} {pytorch:9.3f} {pytorch / eager:6.2f}"
            )
    return 0


def _fallback_ops(wrapped) -> set[str]:
    sessions = [s for cs in wrapped._captures.values() for c in cs for s in c.sessions if s.model is not None]
    return {
        a.s.decode()
        for s in sessions
        for n in s.model.graph.node
        if n.domain == "ortbridge"
        for a in n.attribute
        if a.name == "func_name"
    }


if __name__ == "__main__":
    sys.exit(main())
