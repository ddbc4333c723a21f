"""A backward graph in stages (OrtModule(backward_stages=N), training/stages.py): each stage's
gradients reach autograd, and their hooks, before the next stage runs; training equals eager's
for models with Functions, attention, batch norm, frozen parameters, dynamic shapes; create_graph,
retain_graph, autograd.grad of a part, autocast (AOTAutograd's runtime) stay right."""

from __future__ import annotations

import copy

import pytest
import torch
import training_functions as tf
from conftest import needs_bfloat16_binding
from side_by_side import assert_close, train_side_by_side
from test_training import _all_captures, transformer_block

import ortbridge
from ortbridge.training import stages

nn = torch.nn
EVENTS: list = []


class Logged(tf.BiasGelu):
    """gelu(x + bias), its backward logged in EVENTS."""

    @staticmethod
    def backward(ctx, g):
        EVENTS.append("Function backward")
        return tf.BiasGelu.backward(ctx, g)


class Block(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.bias = nn.Parameter(torch.zeros(4 * width))

    def forward(self, x):
        return x + self.down(Logged.apply(self.up(x), self.bias))


def _blocks(count: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(count)))


def _staged(count: int):
    return lambda m: ortbridge.OrtModule(m, backward_stages=count)


def _backward_of(wrapped) -> object:
    (capture,) = _all_captures(wrapped)
    return capture.sessions[1]


def _order(wrapped) -> list:
    """What one backward of the 4-block model did, in order: each Function's backward, and each
    parameter (by its block) as its gradient was accumulated."""
    EVENTS.clear()
    handles = [
        p.register_post_accumulate_grad_hook(lambda p, k=k: EVENTS.append(k))
        for k, block in enumerate(wrapped.module)
        for p in block.parameters()
    ]
    try:
        wrapped(torch.randn(8, 16)).square().sum().backward()
    finally:
        for h in handles:
            h.remove()
    return list(EVENTS)


def test_the_last_blocks_gradients_are_accumulated_before_the_first_blocks_function_runs():
    staged = _staged(4)(_blocks())
    order = _order(staged)
    assert _backward_of(staged).count == 4
    first_function = len(order) - 1 - order[::-1].index("Function backward")  # (block 0's: the last to run)
    block3 = [k for k, e in enumerate(order) if e == 3]
    assert len(block3) == 5 and max(block3) < first_function, order
    # The stages in order: each block's parameters before the next earlier block's Function.
    assert order.index(3) < order.index(2) < order.index(1) < order.index(0), order
    # In one piece, every gradient is accumulated once the whole graph has run (the test can fail).
    whole = _staged(1)(_blocks())
    order = _order(whole)
    assert order[:4] == ["Function backward"] * 4 and sorted(order[4:]) == sorted([0, 1, 2, 3] * 5), order


def _batch(shape=(8, 16), requires_grad=True):
    def batch(step):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
        return (x.requires_grad_(requires_grad),), {}

    return batch


def _mean_square(out, step):
    return out.square().mean()


class _Frozen(nn.Module):
    """Blocks whose second is frozen (fine-tuning): its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.blocks = _blocks(3)
        for p in self.blocks[1].parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.blocks(x)


class _Convolutional(nn.Module):
    """Convolutions with batch norm (buffers updated by the forward) and a Function."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.bias = nn.Parameter(torch.zeros(8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.norm(self.a(x)).permute(0, 2, 3, 1)
        h = tf.BiasGelu.apply(h, self.bias).permute(0, 3, 1, 2)
        return self.head(self.b(h).mean((2, 3)))


MODELS = {
    "blocks with a Function": (_blocks, _batch()),
    "transformer block": (lambda: transformer_block(32), _batch((2, 6, 32))),
    "frozen middle block": (_Frozen, _batch()),
    "batch norm and convolutions": (_Convolutional, _batch((2, 3, 8, 8))),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_staged_training_equals_eager(name):
    make, batch = MODELS[name]
    torch.manual_seed(0)
    wrapped = train_side_by_side(make(), batch, _mean_square, wrap=_staged(3))
    assert _backward_of(wrapped).count > 1, "the backward graph ran in one piece"


def test_staged_with_dynamic_shapes_equals_eager():
    torch.manual_seed(0)
    sizes = [8, 5, 11]

    def batch(step):
        return (torch.randn(sizes[step], 16, generator=torch.Generator().manual_seed(step)).requires_grad_(),), {}

    wrap = lambda m: ortbridge.OrtModule(m, dynamic=True, backward_stages=3)  # noqa: E731
    wrapped = train_side_by_side(_blocks(), batch, _mean_square, wrap=wrap)
    assert len(_all_captures(wrapped)) == 1


def test_create_graph_gives_first_order_gradients_as_eager():
    eager = _blocks()
    staged = _staged(3)(copy.deepcopy(eager))
    x = torch.randn(8, 16)
    grads = [torch.autograd.grad(m(x).square().sum(), list(m.parameters()), create_graph=True) for m in (eager, staged)]
    assert_close(grads[1], grads[0], "first-order gradients")
    with pytest.raises(RuntimeError, match="double backward"):
        grads[1][0].sum().backward()


def _plain_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 4))


def test_retain_graph_runs_the_stages_again():
    """Without Functions (whose contexts the first backward releases), a second backward through
    the same graph gives the same gradients again."""
    eager = _plain_layers()
    staged = _staged(3)(copy.deepcopy(eager))
    x = torch.randn(8, 16)
    for m in (eager, staged):
        loss = m(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert _backward_of(staged).count > 1
    for (name, p), q in zip(eager.named_parameters(), staged.parameters()):
        assert_close(q.grad, p.grad, f"{name}.grad after two backwards")


def test_gradients_of_only_the_last_block():
    eager = _blocks()
    staged = _staged(4)(copy.deepcopy(eager))
    x = torch.randn(8, 16)
    wanted = [
        list(m[3].parameters()) if isinstance(m, nn.Sequential) else list(m.module[3].parameters())
        for m in (eager, staged)
    ]
    grads = [torch.autograd.grad(m(x).square().sum(), w) for m, w in zip((eager, staged), wanted)]
    assert_close(grads[1], grads[0], "the last block's gradients")
    assert ortbridge.context_pool_size() == 0


@needs_bfloat16_binding
def test_under_autocast_aotautograds_runtime_runs_the_stages_in_one_call():
    """Under autocast AOTAutograd's runtime runs the graphs: it calls the staged backward whole."""
    eager = _plain_layers()
    staged = _staged(3)(copy.deepcopy(eager))
    x = torch.randn(8, 16)
    for m in (eager, staged):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x).float().square().mean()
        loss.backward()
    assert _all_captures(staged)[0].step is None and _backward_of(staged).count > 1
    for (name, p), q in zip(eager.named_parameters(), staged.parameters()):
        assert_close(q.grad, p.grad, f"{name}.grad", rtol=2e-2, atol=2e-3)


def test_one_stage_by_default_in_one_process():
    wrapped = ortbridge.OrtModule(_blocks())
    wrapped(torch.randn(8, 16)).sum().backward()
    assert not isinstance(_backward_of(wrapped), stages.StagedBackward)
