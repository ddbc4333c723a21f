"""What OrtModule's check of each call costs: before a captured graph runs, OrtModule reads what
decides whether the capture still serves the call (OrtModule.lookup: every submodule's train/eval
mode, grad mode, autocast and the other settings, hooks, the arguments' signature, parameters'
requires_grad, the plain values among the modules' attributes). This is a fixed cost per step,
growing with the number of modules, not with the work: the table gives it per call (median over
--repeats repeats) next to the eager training step of the same model from the same run
(forward, loss, backward, AdamW step), and their ratio. The "attributes" column is the part that
compares the modules' plain attribute values (model_state.Constants.hold). A parameter's dtype,
device and size are checked where the graph binds it, only when its buffer changes (no cost
here). --timm adds train_step.py's timm models.
"""

from __future__ import annotations

import argparse
import sys

from common import medians, versions
from train_step import block_case, cnn_case, timm_cases, trainer

import ortbridge


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--target", type=float, default=0.2, help="seconds per repeat")
    parser.add_argument("--quick", action="store_true", help="one model, few repeats (a smoke test)")
    parser.add_argument("--timm", action="store_true", help="also timm models")
    args = parser.parse_args()
    cases = [("Block", lambda: block_case(8, 32, 64)), ("CNN", lambda: cnn_case(8, 64))]
    if args.timm and not args.quick:
        cases += [(name, lambda make=make, sizes=sizes: make(sizes[0])) for name, make, sizes in timm_cases()]
    if args.quick:
        cases, args.repeats, args.target = cases[:1], 3, 0.05
    print(versions())
    print(f"{'model':24} {'modules':>7} {'check us':>9} {'attributes us':>14} {'eager step ms':>14} {'check/step':>11}")
    for name, make in cases:
        model, x, y, loss_fn, _ = make()
        wrapped = ortbridge.OrtModule(model)
        loss_fn(wrapped(x), y).backward()  # (captured)
        key, capture = wrapped.lookup((x,), 1, [x])
        assert capture is not None, f"{name}: the check finds no capture for the call it was made for"
        eager_step = trainer(model, x, y, loss_fn)
        check, attributes, step = medians(
            [lambda: wrapped.lookup((x,), 1, [x]), capture.constants.hold, eager_step],
            args.repeats,
            args.target,
            warmup=3,
        )
        modules = sum(1 for _ in model.modules())
        print(
            f"{name:24} {modules:7d} {check * 1e6:9.2f} {attributes * 1e6:14.2f} {step * 1e3:14.2f} "
            f"{check / step:10.3%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
