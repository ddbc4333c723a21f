"""Training-step time of a BERT encoder with each form of its embeddings' gradient in the ONNX
Runtime graph, against eager PyTorch: the cost of not using ONNX Runtime's ScatterND with a
reduction, whose CPU kernel loses updates to a repeated index on several threads
(ortbridge/_tracing/kernels.py, UNSAFE_KERNELS).

What is measured
----------------
Copies of one Hugging Face BertForSequenceClassification built from a config (by default the case
of the issue that found the race: 4 layers, width 256, 4 heads, BERT's vocabulary of 30,522), each
trained on the same batch of 12 x 91 tokens (two token types, right padding on half the batch).
One step = forward, loss, backward (no optimizer: every copy keeps the same weights).
  eager             plain PyTorch
  pytorch           ortbridge.OrtModule as it is: embedding_dense_backward runs in PyTorch (a
                    fallback node, eager's own kernel)
  scatter_elements  OrtModule with the gradient as ONNX ScatterElements(reduction="add") (a
                    scatter_add decomposition; that kernel runs on one thread, which the audit checks)
  scatter_nd        OrtModule as before: torch's decomposition, ScatterND(reduction="add"): wrong
                    on several threads (its largest gradient difference says by how much)
The table gives the median step time over --repeats repeats (interleaved), its ratio to eager's
from the same run (lower is better), and the largest difference of any gradient from eager's on
--check-batches batches (before timing; the same model, no optimizer step). ONNX Runtime and torch
use --threads threads (default 2).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys

import torch
from common import medians, versions

import ortbridge
from ortbridge._compat.torch_private import onnx_opsets
from ortbridge._tracing import fallback, kernels

EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default


def _as_scatter_add(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    """embedding_dense_backward as a scatter_add (ONNX ScatterElements with reduction "add")."""
    rows, width = indices.reshape(-1), grad.shape[-1]
    grad = grad.reshape(-1, width)
    if padding_idx >= 0:
        grad = torch.where((rows == padding_idx)[:, None], 0.0, grad)
    if scale_grad_by_freq:
        counts = torch.zeros(num_weights, dtype=grad.dtype).scatter_add(
            0, rows, torch.ones_like(rows, dtype=grad.dtype)
        )
        grad = grad / counts[rows][:, None]
    return grad.new_zeros(num_weights, width).scatter_add(0, rows[:, None].expand(-1, width), grad)


@contextlib.contextmanager
def _gradient_form(form: str):
    """While capturing: the embeddings' gradient written in `form` (see the variants above)."""
    if form == "pytorch":
        yield
        return
    _, table = fallback._decompositions(onnx_opsets(None)[1])
    saved = (table[EMBEDDING_BACKWARD], set(fallback._ACCUMULATING_WRITES), kernels.UNSAFE_KERNELS)
    fallback.PYTORCH_PREFERRED.discard(EMBEDDING_BACKWARD)
    if form == "scatter_elements":
        table[EMBEDDING_BACKWARD] = _as_scatter_add
    else:  # (scatter_nd: the deny list and the routing of accumulating writes off)
        fallback._ACCUMULATING_WRITES.clear()
        kernels.UNSAFE_KERNELS = ()
    try:
        yield
    finally:
        fallback.PYTORCH_PREFERRED.add(EMBEDDING_BACKWARD)
        table[EMBEDDING_BACKWARD] = saved[0]
        fallback._ACCUMULATING_WRITES.update(saved[1])
        kernels.UNSAFE_KERNELS = saved[2]


def _batch(batch: int, length: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[: batch // 2, length - length // 8 :] = 0
    return dict(
        input_ids=torch.randint(0, vocab, (batch, length), generator=g),
        token_type_ids=torch.randint(0, 2, (batch, length), generator=g),
        attention_mask=mask,
        labels=torch.randint(0, 2, (batch,), generator=g),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--target", type=float, default=0.5, help="seconds per repeat")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", default="12x91", help="batch x length")
    parser.add_argument("--check-batches", type=int, default=4, help="batches each copy's gradients are compared on")
    parser.add_argument("--quick", action="store_true", help="a small model, few repeats (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.target, args.layers, args.width, args.batch, args.check_batches = 3, 0.05, 1, 64, "4x32", 1
    import transformers

    torch.set_num_threads(args.threads)
    batch, length = map(int, args.batch.split("x"))
    config = transformers.BertConfig(
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        intermediate_size=4 * args.width,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    if args.quick:
        config.vocab_size = 1000
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    inputs = _batch(batch, length, config.vocab_size)  # (the timed steps')
    print(versions())
    print(
        f"BERT {args.layers} layers, width {args.width}, batch {args.batch}; {args.threads} threads; median of {args.repeats} repeats\n"
    )

    copies = {"eager": copy.deepcopy(model)}
    for form in ("pytorch", "scatter_elements", "scatter_nd"):
        copies[form] = ortbridge.OrtModule(copy.deepcopy(model))
        with _gradient_form(form):
            copies[form](**inputs).loss.backward()  # (the capture)

    def step(m):
        def run():
            m.zero_grad(set_to_none=True)
            m(**inputs).loss.backward()

        return run

    differences = dict.fromkeys(copies, 0.0)
    for seed in range(args.check_batches):  # (the race loses updates in some runs, not all)
        checked = _batch(batch, length, config.vocab_size, seed)
        for m in copies.values():
            m.zero_grad(set_to_none=True)
            m(**checked).loss.backward()
        eager_grads = [p.grad for p in copies["eager"].parameters()]
        for name, m in copies.items():
            difference = max((p.grad - g).abs().max().item() for p, g in zip(m.parameters(), eager_grads))
            differences[name] = max(differences[name], difference)
    steps = {name: step(m) for name, m in copies.items()}
    times = dict(zip(steps, medians(list(steps.values()), args.repeats, args.target, warmup=2)))
    print(f"{'variant':>17} {'step ms':>9} {'ratio':>6} {'largest gradient difference':>28}")
    for name, seconds in times.items():
        print(f"{name:>17} {seconds * 1e3:9.2f} {seconds / times['eager']:6.2f} {differences[name]:28.2e}")
    if max(differences["pytorch"], differences["scatter_elements"]) > 1e-4:
        print("the correct forms must give eager's gradients")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
