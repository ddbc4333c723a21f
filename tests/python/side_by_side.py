"""A model trained eagerly and wrapped (ortbridge.OrtModule, torch.compile(backend="ortbridge"))
side by side on the same inputs, compared after every step: test_real_models.py (CPU) and
test_cuda.py (CUDA). Imported by the tests as a top-level module (as they import conftest)."""

from __future__ import annotations

import copy

import torch

import ortbridge

nn = torch.nn

RTOL, ATOL = 1e-4, 1e-5


def tensors_of(out) -> list:
    """Every tensor in `out` (a tensor, None, or nested tuples, lists, dicts, ModelOutputs)."""
    return [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def assert_close(actual, expected, what: str, rtol: float = RTOL, atol: float = ATOL):
    """The tensors of `actual` equal those of `expected` (eager's): as many, each with the same
    dtype, shape and device, values within rtol / atol. `what` starts the message."""
    a, e = tensors_of(actual), tensors_of(expected)
    assert len(a) == len(e), f"{what}: {len(a)} tensors, eager has {len(e)}"
    for x, y in zip(a, e):
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, (
            f"{what}: {x.dtype}{list(x.shape)} on {x.device} vs {y.dtype}{list(y.shape)} on {y.device}"
        )
        torch.testing.assert_close(x.detach(), y.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _inner(wrapped):
    """The module whose parameters the wrapper trains (OrtModule.module, OptimizedModule._orig_mod)."""
    return getattr(wrapped, "module", getattr(wrapped, "_orig_mod", wrapped))


def train_side_by_side(
    model: nn.Module,
    batch,
    loss_fn,
    *,
    steps: int = 3,
    optimizer: str = "sgd",
    lr: float | None = None,
    wrap=None,
    rtol: float = RTOL,
    atol: float = ATOL,
):
    """Trains `model` (eager) and `wrap(deepcopy(model))` (OrtModule by default) on the same
    inputs; batch(step) -> (args, kwargs), loss_fn(outputs, step) -> loss; optimizer "sgd" (momentum
    0.9, lr 0.01 unless given) or "adamw" (lr 1e-3 unless given). After each step: outputs, loss,
    input gradients, every parameter's gradient equal (same dtype, shape and device too), no
    context left; at the end every parameter and buffer. Returns the wrapped model."""
    eager = model
    wrapped = (wrap or ortbridge.OrtModule)(copy.deepcopy(model))
    inner = _inner(wrapped)

    def make_opt(m):
        if optimizer == "sgd":
            return torch.optim.SGD(m.parameters(), lr=lr or 0.01, momentum=0.9)
        assert optimizer == "adamw", f"optimizer {optimizer!r}: 'sgd' or 'adamw'"
        # AdamW divides each gradient by its own size: a gradient that is zero in exact arithmetic
        # (attention's key bias, a batch-norm bias feeding another batch norm) is rounding noise
        # in both runs, which it turns into steps of random sign. So SGD for most models, AdamW
        # with eps 1e-6 (not 1e-8, which scales ~1e-9 noise up to lr/10) where that stays small.
        return torch.optim.AdamW(m.parameters(), lr=lr or 1e-3, weight_decay=0.01, eps=1e-6)

    opts = [make_opt(eager), make_opt(inner)]
    for step in range(steps):
        args, kwargs = batch(step)
        results = []
        for m in (eager, wrapped):
            a, k = copy.deepcopy(args), copy.deepcopy(kwargs)
            out = m(*a, **k)
            loss = loss_fn(out, step)
            loss.backward()
            results.append((out, loss, a))
        assert ortbridge.context_pool_size() == 0, f"step {step}: contexts left after backward"
        (out_e, loss_e, a_e), (out_w, loss_w, a_w) = results
        assert_close(out_w, out_e, f"step {step}: outputs", rtol, atol)
        assert_close(loss_w, loss_e, f"step {step}: loss", rtol, atol)
        for i, (x, y) in enumerate(zip(tensors_of(a_w), tensors_of(a_e))):
            if y.requires_grad:
                assert x.grad is not None, f"step {step}: input {i} has no gradient"
                assert_close(x.grad, y.grad, f"step {step}: input {i} gradient", rtol, atol)
        for (name, p), q in zip(eager.named_parameters(), inner.parameters()):
            assert (q.grad is None) == (p.grad is None), f"step {step}: {name}.grad is {q.grad} (eager {p.grad})"
            if p.grad is not None:
                assert_close(q.grad, p.grad, f"step {step}: {name}.grad", rtol, atol)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(eager.named_parameters(), inner.parameters()):
        assert_close(q, p, f"parameter {name} after training", rtol, atol)
    for (name, b), c in zip(eager.named_buffers(), inner.buffers()):
        assert_close(c, b, f"buffer {name} after training", rtol, atol)
    return wrapped
