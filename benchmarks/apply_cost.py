"""What ortbridge costs a torch.autograd.Function call it does not export or capture, and what the
release-specific keeper of a training context costs.

1. Function.apply with ortbridge imported and without. ortbridge routes apply only while it
   records, exports or captures (torch_private.route_apply); outside, apply is torch's own and a
   call must cost what it costs without ortbridge (goal: at most 2% or 0.1 us more). Each side
   runs in fresh processes, alternated (--processes of each); in each, the median over --repeats
   repeats of N calls of `Fn.apply(x)` on a 16-element tensor, in train (x requires grad, no
   backward) and no_grad. The table gives the median over the processes of each side.

2. The node owner (torch 2.12 and older, where a Function's ctx does not own its autograd node:
   torch_private.CONTEXT_OWNS_NODE). A training PythonOp then keeps, with the context, the grad_fn
   of a view of an output. Its cost per call, next to one Function.apply in train mode in the same
   process (the owner is timed on every release, used only where needed), and the memory each
   live one holds (RSS over --owners of them held at once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import psutil
import torch


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def per_call_us(call, repeats: int, target: float) -> float:
    """Median over `repeats` of the time of one call, in a loop of N calls that lasts `target` s."""

    def run(n):
        started = time.perf_counter()
        for _ in range(n):
            call()
        return time.perf_counter() - started

    n = 1000
    while run(n) < target:
        n *= 2
    return statistics.median(run(n) / n for _ in range(repeats)) * 1e6


def child(with_ortbridge: bool, repeats: int, target: float) -> None:
    """One process's measure of Function.apply: prints {"train": us, "no_grad": us}."""
    if with_ortbridge:
        import ortbridge  # noqa: F401 (routes nothing by itself: only recording, export and capture do)
    x, xg = torch.randn(16), torch.randn(16, requires_grad=True)
    apply = Scale.apply
    with torch.no_grad():
        no_grad = per_call_us(lambda: apply(x), repeats, target)
    print(json.dumps({"train": per_call_us(lambda: apply(xg), repeats, target), "no_grad": no_grad}))


def function_apply(processes: int, repeats: int, target: float) -> dict:
    """{"without"/"with": {"train"/"no_grad": [us per call, one per process]}}."""
    results = {"without": {"train": [], "no_grad": []}, "with": {"train": [], "no_grad": []}}
    for _ in range(processes):
        for side in ("without", "with"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", side, "--repeats", str(repeats), "--target", str(target)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for mode, us in json.loads(out.splitlines()[-1]).items():
                results[side][mode].append(us)
    return results


def node_owner(repeats: int, target: float, owners: int) -> tuple[float, float, float]:
    """(us per owner made, us per Function.apply in train mode, bytes per owner held)."""
    from ortbridge._compat import torch_private

    x = torch.randn(16, requires_grad=True)
    out = Scale.apply(x)
    make = torch_private._node_owner  # (the function itself: on releases that do not need it too)
    owner_us, apply_us = [], []
    for _ in range(3):  # (interleaved)
        owner_us.append(per_call_us(lambda: make(out), repeats, target))
        apply_us.append(per_call_us(lambda: Scale.apply(x), repeats, target))
    outputs = [Scale.apply(x) for _ in range(owners)]
    process = psutil.Process()
    before = process.memory_info().rss
    held = [make(o) for o in outputs]
    per_owner = (process.memory_info().rss - before) / len(held)
    return statistics.median(owner_us), statistics.median(apply_us), per_owner


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--target", type=float, default=0.2, help="seconds per repeat")
    parser.add_argument("--owners", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="a short run that checks the script works")
    parser.add_argument("--child", choices=("with", "without"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child == "with", args.repeats, args.target)
    if args.quick:
        args.processes, args.repeats, args.target, args.owners = 1, 3, 0.02, 10_000
    from ortbridge._compat import torch_private

    print(
        f"torch {torch.__version__}, Python {sys.version.split()[0]}; Function.apply in C: "
        f"{torch_private.APPLY_IN_C}; a context owns its node: {torch_private.CONTEXT_OWNS_NODE}"
    )
    results = function_apply(args.processes, args.repeats, args.target)
    print(f"\n1. Function.apply, us per call (median of {args.processes} processes each, alternated)")
    print(f"{'mode':>8} {'without':>9} {'with':>9} {'with-without':>13} {'ratio':>7}  goal: <= 1.02 or +0.1 us")
    for mode in ("train", "no_grad"):
        without = statistics.median(results["without"][mode])
        with_ = statistics.median(results["with"][mode])
        met = with_ / without <= 1.02 or with_ - without <= 0.1
        print(
            f"{mode:>8} {without:9.3f} {with_:9.3f} {with_ - without:+13.3f} {with_ / without:7.3f}  "
            f"{'met' if met else 'MISSED'}"
        )

    owner_us, apply_us, per_owner = node_owner(args.repeats, args.target, args.owners)
    used = "used on this release" if torch_private.node_owner is not None else "not used on this release"
    print(
        f"\n2. Node owner ({used}): {owner_us:.3f} us to make one, next to {apply_us:.3f} us per "
        f"Function.apply in train mode ({owner_us / apply_us:.2f} x); {per_owner:.0f} bytes per live one "
        f"(RSS over {args.owners} held)"
    )


if __name__ == "__main__":
    main()
