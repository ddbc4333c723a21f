"""The torch.autograd.Functions the fuzz graphs call, registered under "fuzz.*" names.

Deterministic and cheap, each covering a kind of Function the kernels treat differently: plain,
several outputs, a view of the input, no autograd context, in-place, and outputs whose size differs
from the input's (which matters once a mutated tensor_reuse_map hands them the input's buffer).
"""

from __future__ import annotations

import torch

import ortbridge


def _first_tensor(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("no tensor argument")


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class Pass(torch.autograd.Function):
    """Any arguments (tensors and constants); returns a copy of the first tensor. The constants are
    only received, so every constant kind can be sent through it."""

    @staticmethod
    def forward(ctx, *args):
        ctx.first = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        ctx.count = len(args)
        return _first_tensor(args).clone()

    @staticmethod
    def backward(ctx, g):
        return tuple(g if i == ctx.first else None for i in range(ctx.count))


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x * alpha

    @staticmethod
    def backward(ctx, g):
        return g * ctx.alpha, None


class Saving(torch.autograd.Function):
    """Saves its input for backward (the saved copy must outlive ORT's input buffer)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 + x * 0


class TwoOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, x + 1

    @staticmethod
    def backward(ctx, g1, g2):
        return g1 * 2 + g2


class Add(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return x + y

    @staticmethod
    def backward(ctx, g):
        return g, g


class View(torch.autograd.Function):
    """Returns a view of its input (flattened)."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.view(-1)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape)


class NoGrad(torch.autograd.Function):
    """Its output never needs a gradient, so a training call keeps no context (ctx is None)."""

    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return g


class InPlace(torch.autograd.Function):
    """Updates its input in place and returns it (declared with tensor_reuse_map)."""

    @staticmethod
    def forward(ctx, x):
        if x.dtype == torch.bool:
            x.logical_not_()
        else:
            x.add_(1)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class Shrink(torch.autograd.Function):
    """Same rank, fewer elements than the input."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x[:-1].clone() if x.dim() else x.clone()

    @staticmethod
    def backward(ctx, g):
        out = g.new_zeros(ctx.shape)
        if g.dim():
            out[:-1] = g
        return out


class Grow(torch.autograd.Function):
    """Same rank, more elements than the input."""

    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[0] if x.dim() else None
        return torch.cat([x, x]) if x.dim() else x.clone()

    @staticmethod
    def backward(ctx, g):
        return g if ctx.n is None else g[: ctx.n] + g[ctx.n :]


class Make(torch.autograd.Function):
    """No tensor inputs: a float32 tensor of n values, all `value`."""

    @staticmethod
    def forward(ctx, n, value):
        return torch.full((n,), float(value))

    @staticmethod
    def backward(ctx, g):
        return None, None


FUNCTIONS = {
    f"fuzz.{cls.__name__}": cls
    for cls in (Identity, Pass, Scale, Saving, TwoOut, Add, View, NoGrad, InPlace, Shrink, Grow, Make)
}

for _name, _cls in FUNCTIONS.items():
    ortbridge.register(_cls, name=_name)

from .graphs import FUNCTION_NAMES  # noqa: E402  (the generator's copy of these names)

assert sorted(FUNCTION_NAMES) == sorted(FUNCTIONS), "tests/fuzz/graphs.py FUNCTION_NAMES is out of date"
