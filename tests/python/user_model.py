"""A user's module: custom Functions (registered on import) and a model that calls them.

tests/python/test_export.py exports `Net`; a fresh process that imports only this module runs
the saved file.
"""

import numpy as np
import torch

import ortbridge
from ortbridge._compat.torch_private import RELEASE

# Before torch 2.13, apply binds a setup_context Function's keyword arguments but then passes them
# on to its C function, which refuses them ("apply() takes no keyword arguments"), in eager too.
APPLY_TAKES_KEYWORDS = RELEASE >= (2, 13)


@ortbridge.register
class BiasGelu(torch.autograd.Function):
    """Tensor not first, a float constant that needs float64, keyword argument bound by setup_context."""

    @staticmethod
    def forward(alpha, x, bias, approximate="tanh"):
        return torch.nn.functional.gelu(x * alpha + bias, approximate=approximate)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


@ortbridge.register
class NumpyTopK(torch.autograd.Function):
    """Untraceable forward: numpy, .item() and a data-dependent branch; two outputs of two dtypes,
    the int64 one not differentiable."""

    @staticmethod
    def forward(ctx, x, k):
        values = np.sort(x.detach().numpy(), axis=-1)[..., ::-1][..., :k].copy()
        if x.abs().max().item() > 1e6:
            values = values * 0
        indices = torch.from_numpy(np.argsort(-x.detach().numpy(), axis=-1, kind="stable")[..., :k].copy())
        ctx.mark_non_differentiable(indices)
        return torch.from_numpy(values), indices

    @staticmethod
    def backward(ctx, gv, gi):
        raise NotImplementedError


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.bias = torch.nn.Parameter(torch.linspace(-1, 1, width))

    def forward(self, x):
        if APPLY_TAKES_KEYWORDS:
            return BiasGelu.apply(0.1, self.linear(x), self.bias, approximate="none")
        return BiasGelu.apply(0.1, self.linear(x), self.bias, "none")


class Net(torch.nn.Module):
    def __init__(self, width=6, k=3):
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(width), Block(width))  # the same Function, called twice
        self.k = k

    def forward(self, x):
        values, indices = NumpyTopK.apply(self.blocks(x), self.k)
        return values * 2, indices


def example(batch=4, width=6):
    torch.manual_seed(0)
    return Net(width).eval(), torch.randn(batch, width)
