"""Random operators inside captured graphs draw from torch's generator, as eager does: a seed
reproduces a run, and where eager draws in the same order, the values are eager's (dropout's
mask in the output and in the gradient). The models compute with small integers, so that ONNX
Runtime's arithmetic is exact and any difference from eager is the draw's."""

from __future__ import annotations

import pytest
import torch

import ortbridge

F = torch.nn.functional


class Random(torch.nn.Module):
    """`draw(h)` after an integer-valued Linear."""

    def __init__(self, draw, width: int = 6):
        super().__init__()
        self.draw = draw
        self.linear = torch.nn.Linear(width, width)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randint(-3, 4, (width, width)))
            self.linear.bias.copy_(torch.randint(-3, 4, (width,)))

    def forward(self, x):
        return self.draw(self.linear(x))


def _x(rows: int = 4, width: int = 6) -> torch.Tensor:
    return torch.randint(-3, 4, (rows, width), generator=torch.Generator().manual_seed(rows)).float()


def _step(model, wrapped, x, seed: int) -> tuple:
    """The output, the gradients of the parameters and the generator's next draw after a step
    of `wrapped` seeded with `seed`."""
    torch.manual_seed(seed)
    out = wrapped(x)
    weights = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) % 5 - 2  # (integers: exact sums)
    (out * weights).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads, torch.rand(3)


def _assert_equal(actual: tuple, expected: tuple, exact: bool = True):
    """Outputs and next draws equal; gradients too where `exact` (values of few bits: the sums of
    ONNX Runtime's matrix products round as torch's), otherwise within float32 rounding."""
    out, grads, next_draw = actual
    assert torch.equal(out, expected[0]), (out, expected[0])
    for g, e in zip(grads, expected[1]):
        if exact:
            assert torch.equal(g, e), (g, e)
        else:
            torch.testing.assert_close(g, e)
    assert torch.equal(next_draw, expected[2]), "the generator was not left where eager leaves it"


def _like_eager(draw, wrap=ortbridge.OrtModule, seeds=(1, 2, 1), exact: bool = True):
    """Steps of the wrapped model (the first one captures) equal eager's, seed by seed: the
    capture draws nothing, and backward reads forward's mask (a second draw would move the
    generator on)."""
    torch.manual_seed(0)
    model = Random(draw)
    wrapped, x = wrap(model), _x()
    for seed in seeds:
        _assert_equal(_step(model, wrapped, x, seed), _step(model, model, x, seed), exact)
    return model, wrapped


# (scale 2 or 4: exact products; other scales and alpha dropout's affine map are not)
DROPOUTS = {
    "dropout": (torch.nn.Dropout(0.5), True),
    "dropout_p03": (torch.nn.Dropout(0.3), False),
    "two_in_a_row": (torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Dropout(0.75)), True),
    # (independent draws: ONNX Runtime may run either first, eager draws the first first)
    "side_by_side": (lambda h: F.dropout(h, 0.5) + F.dropout(h * 2, 0.5) * F.dropout(h - 1, 0.75), True),
    "dropout2d": (lambda h: F.dropout2d(h.reshape(1, 2, 3, 4), 0.5).reshape(h.shape), True),
    # (eager's mask is drawn in the memory order of its input, a transposed view here)
    "of_transposed": (lambda h: F.dropout(h.reshape(2, 2, 6).transpose(0, 2), 0.5), True),
    "rand_like_of_transposed": (lambda h: h.t() * torch.rand_like(h.t()), False),
    "alpha_dropout": (torch.nn.AlphaDropout(0.5), False),
}


@pytest.mark.parametrize("draw, exact", DROPOUTS.values(), ids=DROPOUTS.keys())
def test_dropout_like_eager(draw, exact):
    _like_eager(draw, exact=exact)


def test_dropout_torch_compile_like_eager():
    torch._dynamo.reset()
    try:
        _like_eager(
            torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Dropout(0.5)),
            wrap=lambda m: torch.compile(m, backend="ortbridge"),
        )
    finally:
        torch._dynamo.reset()


def test_transformer_encoder_layer_like_eager():
    """Four dropouts, one in attention, one of attention's transposed output (batch_first)."""
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.25, batch_first=True)
    wrapped, x = ortbridge.OrtModule(model), torch.randn(2, 5, 16)
    for seed in (1, 2, 1):
        out, grads, next_draw = _step(model, wrapped, x, seed)
        expected = _step(model, model, x, seed)
        torch.testing.assert_close((out, grads), expected[:2])
        assert torch.equal(next_draw, expected[2])


def test_dropout_dynamic_shapes_like_eager():
    model, wrapped = _like_eager(torch.nn.Dropout(0.5), wrap=lambda m: ortbridge.OrtModule(m, dynamic=True))
    x = _x(rows=7)  # (another size: the same capture)
    _assert_equal(_step(model, wrapped, x, 5), _step(model, model, x, 5))


def test_dropout_seed_reproduces_run_not_another():
    torch.manual_seed(0)
    model = Random(torch.nn.Dropout(0.5), width=32)
    wrapped, x = ortbridge.OrtModule(model), _x(rows=16, width=32)
    torch.manual_seed(7)
    first, second = wrapped(x), wrapped(x)
    torch.manual_seed(7)
    assert torch.equal(wrapped(x), first)
    assert not torch.equal(first, second)  # (a new mask each call)


# Random operators beside dropout, each as the traced graph has it (named in the id).
OPERATORS = {
    "rand_like": lambda h: h + torch.rand_like(h),
    "randn_like": lambda h: h * torch.randn_like(h),
    "rand": lambda h: h + torch.rand(h.shape),
    "randn": lambda h: h * torch.randn(h.shape[-1]),
    "randint_low": lambda h: h + torch.randint(-2, 3, h.shape),
    "randint_like": lambda h: h + torch.randint_like(h, 5),
    "bernoulli": lambda h: h * torch.bernoulli(torch.sigmoid(h.detach())),
    "bernoulli_p": lambda h: h * h.detach().bernoulli(0.3),
    "normal_Tensor_float": lambda h: h + torch.normal(h.detach(), 2.0),
    "normal_Tensor_Tensor": lambda h: h + torch.normal(h.detach(), torch.ones_like(h)),
    "normal_functional": lambda h: h + torch.empty_like(h).normal_(1.0, 2.0),
    "uniform": lambda h: h + torch.empty_like(h).uniform_(-1.0, 1.0),
    "exponential": lambda h: h + torch.empty_like(h).exponential_(),
    "poisson": lambda h: h + torch.poisson(torch.ones_like(h)),
    "multinomial": lambda h: h[torch.multinomial(torch.ones(h.shape[0]), 3)],
    "randperm": lambda h: h[torch.randperm(h.shape[0])],
    "rrelu_with_noise_functional": lambda h: F.rrelu(h, training=True),
}


@pytest.mark.parametrize("draw", OPERATORS.values(), ids=OPERATORS.keys())
def test_random_operator_like_eager(draw):
    model, wrapped = _like_eager(draw, seeds=(1, 2), exact=False)
    with torch.no_grad():  # (the inference graph)
        torch.manual_seed(4)
        out, next_draw = wrapped(_x()), torch.rand(3)
        torch.manual_seed(4)
        assert torch.equal(out, model(_x())) and torch.equal(next_draw, torch.rand(3))


def test_model_file_keeps_onnx_dropout():
    """ortbridge.export writes dropout as ONNX's Dropout: a model file runs without PyTorch."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train()
    proto = ortbridge.export(model, (torch.randn(2, 4),), training=True)
    assert "Dropout" in {n.op_type for n in proto.graph.node}
    assert "PythonOp" not in {n.op_type for n in proto.graph.node}
