"""Fine-tuning on batches whose shape changes every step, as real data gives them: how many
captures OrtModule makes and what the run costs with them, against eager PyTorch.

What is measured
----------------
A Hugging Face BertForSequenceClassification built from a config (4 layers, width 256, 4 heads,
BERT's vocabulary; dropout off, so that every variant computes the same losses) whose GELU is a
custom autograd.Function (a PythonOp / PythonOpGrad pair). --steps AdamW steps, each on a batch of
one of --lengths sequence lengths and --batches batch sizes (right padding on half of each batch),
in an order drawn once, so that every variant sees the same batches:
  eager      plain PyTorch
  static     ortbridge.OrtModule(model): a capture per new (batch, length)
  dynamic    ortbridge.OrtModule(model, dynamic=True): symbolic sizes
Each variant starts from the same weights. The table gives for each: captures made, the run's total
time (captures included) and its ratio to eager's, then the steady step: the median over
--repeats repeats of one step on each shape already captured (interleaved variants; ratio to
eager's from the same run). Before the table each variant's loss at every step is checked against
eager's (relative difference below 1e-3, as rounding apart over the run); otherwise the script
exits with status 1. ONNX Runtime and torch use --threads threads (default 2).

From benchmarks/: python3 varlen_train.py [--quick] [--steps N] [--repeats N] [--threads N].
"""

from __future__ import annotations

import argparse
import copy
import logging
import random
import statistics
import sys
import time

import torch
import transformers
from common import versions

import ortbridge


@ortbridge.register(name="ortbridge_bench.Gelu")
class Gelu(torch.autograd.Function):
    """GELU (tanh form) with a hand-written backward: a custom kernel's shape."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.gelu(x, approximate="tanh")

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        inner = 0.7978845608028654 * (x + 0.044715 * x**3)
        t = torch.tanh(inner)
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * x * x))


class GeluModule(torch.nn.Module):
    def forward(self, x):
        return Gelu.apply(x)


class Captures(logging.Handler):
    """Counts OrtModule's captures (its log: "capturing <name>")."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("capturing ")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    model = transformers.BertForSequenceClassification(config).train()
    for layer in model.bert.encoder.layer:
        layer.intermediate.intermediate_act_fn = GeluModule()
    return model


def make_batches(steps: int, lengths: list, sizes: list) -> list:
    """`steps` batches, each of a (size, length) drawn from the grid: ids, mask, labels."""
    draw = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        size, length = draw.choice(sizes), draw.choice(lengths)
        ids = torch.randint(1, 30000, (size, length), generator=generator)
        mask = torch.ones_like(ids)
        for row in range(0, size, 2):  # (right padding on half the rows)
            keep = int(torch.randint(1, length + 1, (), generator=generator))
            mask[row, keep:] = 0
            ids[row, keep:] = 0
        batches.append((ids, mask, torch.randint(0, 3, (size,), generator=generator)))
    return batches


def step(model, optimizer, batch) -> float:
    ids, mask, labels = batch
    optimizer.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="6 steps over 2 lengths, batch size 4, 1 repeat")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    lengths, sizes = [24, 40, 56, 72, 88, 104, 120, 128], [8, 12, 16]
    if args.quick:
        args.steps, args.repeats, lengths, sizes = 6, 1, [24, 40], [4]
    torch.set_num_threads(args.threads)
    captures = Captures()
    logging.getLogger("ortbridge").addHandler(captures)
    logging.getLogger("ortbridge").setLevel(logging.INFO)
    batches = make_batches(args.steps, lengths, sizes)
    base = make_model()
    wrappers = {
        "eager": lambda m: m,
        "static": ortbridge.OrtModule,
        "dynamic": lambda m: ortbridge.OrtModule(m, dynamic=True),
    }
    runs = {}
    for name, wrap in wrappers.items():
        model = wrap(copy.deepcopy(base))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        captures.count = 0
        started = time.perf_counter()
        losses = [step(model, optimizer, batch) for batch in batches]
        runs[name] = dict(model=model, optimizer=optimizer, losses=losses, captures=captures.count)
        runs[name]["total"] = time.perf_counter() - started
    failed = False
    for name, run in runs.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], runs["eager"]["losses"]))
        print(f"{name}: losses of {args.steps} steps, largest relative difference from eager's {worst:.1e}")
        failed |= worst > 1e-3
    if failed:
        print("FAILED: a variant's losses differ from eager's")
        return 1
    # The steady step: one step on each shape seen (each captured already), variants interleaved.
    shapes = list({tuple(b[0].shape): b for b in batches}.values())
    steady = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            for batch in shapes:
                step(run["model"], run["optimizer"], batch)
            steady[name].append((time.perf_counter() - started) / len(shapes))
    print(versions())
    print(
        f"{args.steps} steps over {len({tuple(b[0].shape) for b in batches})} shapes "
        f"(lengths {lengths}, batch sizes {sizes}), {args.threads} threads"
    )
    print(f"{'variant':<9} {'captures':>8} {'total s':>9} {'x eager':>8} {'steady ms':>10} {'x eager':>8}")
    eager_steady = statistics.median(steady["eager"])
    for name, run in runs.items():
        median = statistics.median(steady[name])
        print(
            f"{name:<9} {run['captures']:>8} {run['total']:>9.2f} {run['total'] / runs['eager']['total']:>8.2f} "
            f"{median * 1e3:>10.2f} {median / eager_steady:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
