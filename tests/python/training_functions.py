"""Custom Functions and models for the training tests: one per parity scenario."""

import numpy as np
import torch

F = torch.nn.functional


class BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return F.gelu(x + bias)

    @staticmethod
    def backward(ctx, g):
        x, bias = ctx.saved_tensors
        with torch.enable_grad():
            y = x.detach().requires_grad_() + bias.detach()
            (gy,) = torch.autograd.grad(F.gelu(y), y, g)
        return gy, gy.reshape(-1, gy.shape[-1]).sum(0)


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class Constants(torch.autograd.Function):
    """float, bool, int and tuple arguments stored on ctx, checked by type and value in backward."""

    @staticmethod
    def forward(ctx, x, f, b, i, t):
        ctx.f, ctx.b, ctx.i, ctx.t = f, b, i, t
        return x * f * i + (1.0 if b else 0.0) + sum(t)

    @staticmethod
    def backward(ctx, g):
        for value, expected in ((ctx.f, 0.1), (ctx.b, True), (ctx.i, 3), (ctx.t, (1, 2))):
            if type(value) is not type(expected) or value != expected:
                raise AssertionError(f"backward saw {value!r}, forward got {expected!r}")
        return g * ctx.f * ctx.i, None, None, None, None


class TensorNotFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, x, shift, mode):
        ctx.scale = scale * (2.0 if mode == "double" else 3.0)
        return x * ctx.scale + shift

    @staticmethod
    def backward(ctx, g):
        return None, g * ctx.scale, g.sum(0), None


class TwoOutputs(torch.autograd.Function):
    """Hand-written Jacobian of (x * y, x + sin(y))."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y, x + torch.sin(y)

    @staticmethod
    def backward(ctx, g_prod, g_sum):
        x, y = ctx.saved_tensors
        return g_prod * y + g_sum, g_prod * x + g_sum * torch.cos(y)


class WithCounts(torch.autograd.Function):
    """Passes an int64 buffer through as a second, non-differentiable output."""

    @staticmethod
    def forward(ctx, x, counts):
        ctx.mark_non_differentiable(counts)
        return x * 2, counts

    @staticmethod
    def backward(ctx, g, g_counts):
        return g * 2, None


def make_unused_output(materialize: bool):
    class UnusedOutput(torch.autograd.Function):
        """Two outputs, the model uses the first: backward gets zeros or None for the second."""

        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(materialize)
            return x * 3, x * 4

        @staticmethod
        def backward(ctx, g_used, g_unused):
            if materialize and not (isinstance(g_unused, torch.Tensor) and not g_unused.any()):
                raise AssertionError(f"expected zeros for the unused output, got {g_unused!r}")
            if not materialize and g_unused is not None:
                raise AssertionError(f"expected None for the unused output, got {g_unused!r}")
            return g_used * 3

    UnusedOutput.__qualname__ = f"UnusedOutput_{materialize}"
    return UnusedOutput


class RunsSubmodule(torch.autograd.Function):
    """Checkpoint style: forward runs a submodule without autograd, backward reruns it with
    autograd, which accumulates the submodule's parameter gradients."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        ctx.save_for_backward(x)
        with torch.no_grad():
            return module(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            torch.autograd.backward(ctx.module(x), g)
        return x.grad, None


class NotDifferentiable(torch.autograd.Function):
    backward_calls = 0

    @staticmethod
    def forward(ctx, x):
        mask = (x > 0).to(x.dtype)
        ctx.mark_non_differentiable(mask)
        return mask

    @staticmethod
    def backward(ctx, g):
        NotDifferentiable.backward_calls += 1
        raise AssertionError("backward of a non-differentiable Function ran")


class SiLUSavingInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


class First:
    class Twin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x + 1

        @staticmethod
        def backward(ctx, g):
            return g


class Second:
    class Twin(torch.autograd.Function):  # same class name, another Function
        @staticmethod
        def forward(ctx, x):
            return x * 5

        @staticmethod
        def backward(ctx, g):
            return g * 5


class Detached(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.detach()

    @staticmethod
    def backward(ctx, g):
        return g


class DoubleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class NumpyScale(torch.autograd.Function):
    """numpy in forward and backward: not traceable by torch."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return torch.from_numpy(np.ascontiguousarray(x.detach().numpy() * factor))

    @staticmethod
    def backward(ctx, g):
        return torch.from_numpy(np.ascontiguousarray(g.numpy() * ctx.factor)), None


class FailsOnRequest(torch.autograd.Function):
    """Raises in forward or backward when told to, after the capture."""

    fail_forward = False
    fail_backward = False

    @staticmethod
    def forward(ctx, x):
        if FailsOnRequest.fail_forward:
            raise ValueError("forward failed on request")
        return x * 2

    @staticmethod
    def backward(ctx, g):
        if FailsOnRequest.fail_backward:
            raise ValueError("backward failed on request")
        return g * 2


class Apply(torch.nn.Module):
    """Linear layers around `body(self, h)`: the Function's inputs come from ONNX Runtime
    and its outputs go back into it."""

    def __init__(self, body, width=6, out=3, **parameters):
        super().__init__()
        self.body = body
        self.inner = torch.nn.Linear(4, width)
        self.outer = torch.nn.Linear(width, out)
        for name, value in parameters.items():
            setattr(self, name, value)

    def forward(self, x):
        return self.outer(self.body(self, self.inner(x)))


class Stacked(torch.nn.Module):
    def __init__(self, width=8, depth=10):
        super().__init__()
        self.inner = torch.nn.Linear(4, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.outer = torch.nn.Linear(width, 2)

    def forward(self, x):
        h = self.inner(x)
        for layer in self.layers:
            h = SiLUSavingInput.apply(layer(h))
        return self.outer(h)


class Doubled(torch.autograd.Function):
    """Output dim 0 is twice the input's: infer_shape says so, for dynamic sizes."""

    @staticmethod
    def forward(ctx, x):
        return torch.cat([x, x])

    @staticmethod
    def backward(ctx, g):
        half = g.shape[0] // 2
        return g[:half] + g[half:]

    @staticmethod
    def infer_shape(node, shapes, dtypes):
        ((rows, cols),) = shapes
        return [[2 * rows, cols]], dtypes
