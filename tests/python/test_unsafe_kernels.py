"""No graph the package runs or writes has a node of a kernel on the deny list
(kernels.UNSAFE_KERNELS, found by test_ort_kernel_audit.py); what it would have computed gives
eager's results on several intra-op threads, on every path: OrtModule,
torch.compile(backend="ortbridge"), both exporters.
- Index writes that add up the values written to one place (embedding gradients,
  index_put(accumulate=True), index_add, their boolean-mask forms): torch's ONNX exporter writes
  them as ScatterND with reduction "add", whose ONNX Runtime CPU kernel loses updates to a repeated
  index when it runs on more than one thread. ortbridge runs them in PyTorch, and refuses them on
  the TorchScript path, whose exporter writes them wrongly on any thread count.
- topk and sort: ONNX's TopK orders equal values by index, torch.topk otherwise. Training graphs
  run them in PyTorch; a model file keeps TopK, as ONNX defines it.
- Products over an empty inner dimension: ONNX Runtime 1.19's MatMul leaves its output unwritten.
  On 1.19 they run in PyTorch.
"""

from __future__ import annotations

import io
import logging

import numpy as np
import onnxruntime as ort
import pytest
import torch
from side_by_side import train_side_by_side

import ortbridge
from ortbridge._tracing import fallback, kernels

THREADS = 4  # intra-op threads of every session here (the race needs two; more make it likelier)
RUNS = 3


@pytest.fixture(autouse=True)
def threads():
    """torch on THREADS threads, and so OrtModule's sessions (its default: torch's thread count)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(previous)


def _options() -> ort.SessionOptions:
    options = ortbridge.session_options()
    options.intra_op_num_threads = THREADS
    return options


WRAPPERS = {"OrtModule": ortbridge.OrtModule, "compile": lambda m: torch.compile(m, backend="ortbridge")}


def _sessions(wrapped: ortbridge.OrtModule) -> list:
    """The GraphSessions of an OrtModule's captures."""
    return [s for captures in wrapped._captures.values() for c in captures for s in c.sessions if s.model is not None]


class _Embeddings(torch.nn.Module):
    """BERT's embeddings (word, position, token type) summed, then a linear layer."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.words = torch.nn.Embedding(99, width, padding_idx=0)
        self.positions = torch.nn.Embedding(128, width)
        self.types = torch.nn.Embedding(2, width)
        self.out = torch.nn.Linear(width, 4)

    def forward(self, ids, types):
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return self.out(self.words(ids) + self.positions(positions) + self.types(types))


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_embedding_gradients_equal_eager_on_several_threads(wrapper):
    """32 x 128 tokens: each position's row updated 32 times, each token type's ~2,000 times, each
    word's ~40 times. Every gradient within 1e-5 of eager's at each of several steps (with the
    embeddings' gradients in ScatterND, as before: failed in 4 runs of 4, each wrapper)."""
    torch._dynamo.reset()
    torch.manual_seed(0)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return (torch.randint(0, 99, (32, 128), generator=g), torch.randint(0, 2, (32, 128), generator=g)), {}

    def loss(out, step):
        return (out * torch.linspace(-1, 1, 4)).mean()

    wrapped = train_side_by_side(_Embeddings(), batch, loss, steps=RUNS, wrap=WRAPPERS[wrapper], rtol=1e-5, atol=1e-5)
    if wrapper == "OrtModule":  # (the race needs several threads: the graphs have them)
        assert {s.session.get_session_options().intra_op_num_threads for s in _sessions(wrapped)} == {THREADS}


class _Writes(torch.nn.Module):
    """Every accumulating index write a forward can make, each with repeated indices."""

    def forward(self, x, rows, cols, v):
        put = x.index_put((rows,), v, accumulate=True)  # (rows: many times each row)
        grid = x.index_put((cols[:4, None], cols[None, :]), x[:4, : cols.shape[0]], accumulate=True)
        added = x.index_add(0, rows, v, alpha=0.5)
        masked = x.clone()
        masked[x > 0] += 1.0  # (a read, an add and a write: no accumulation, as in eager)
        masked.index_put_((x < 0,), torch.tensor(2.0), accumulate=True)
        into = torch.zeros_like(x).index_put_((rows,), v, accumulate=True)
        return put + grid + added + masked + into


def _writes_inputs(rows: int = 4096):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(8, 256, generator=g),
        torch.randint(0, 3, (rows,), generator=g),  # (3 of 8 rows, ~1,365 updates each)
        torch.randint(0, 256, (16,), generator=g) % 4,  # (repeated columns too)
        torch.randn(rows, 256, generator=g),
    )


def _assert_close(result: np.ndarray, expected: np.ndarray) -> None:
    """Within 1e-5 of the largest value (sums of ~1,365 values of ~1: float32's rounding, in
    another order, ~1e-6 of it; a lost update, the size of a value)."""
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def _run_in_ort(proto, inputs) -> list[np.ndarray]:
    session = ortbridge.InferenceSession(proto.SerializeToString(), _options())
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    return [session.run(None, feeds)[0] for _ in range(RUNS)]


def test_exported_accumulating_writes_equal_eager_on_several_threads():
    """The dynamo exporter (the default) writes them as nodes that run in PyTorch: eager's values
    at every run, no ScatterND with a reduction in the file."""
    model, inputs = _Writes(), _writes_inputs()
    proto = ortbridge.export(model, inputs, dynamic_shapes=({}, {0: "rows"}, {}, {0: "rows"}))
    assert not kernels.unsafe_nodes(proto)
    expected = model(*inputs).numpy()
    for result in _run_in_ort(proto, inputs):
        _assert_close(result, expected)
    other = _writes_inputs(rows=300)  # (another number of rows: the dynamic dim)
    for result in _run_in_ort(proto, other):
        _assert_close(result, model(*other).numpy())


class _Put(torch.nn.Module):
    def forward(self, x, rows, v):
        return x.index_put((rows,), v, accumulate=True)


class _Add(torch.nn.Module):
    def forward(self, x, rows, v):
        return x.index_add(0, rows, v)


class _MaskAdd(torch.nn.Module):
    def forward(self, x, rows, v):
        return x.index_put((x > 0,), torch.tensor(1.0), accumulate=True)


@pytest.mark.parametrize("model", [_Put(), _Add(), _MaskAdd()], ids=lambda m: type(m).__name__)
def test_torchscript_exporter_refuses_accumulating_writes(model):
    """torch's TorchScript exporter writes index_put(accumulate=True) as a ScatterND without a
    reduction plus an Add (one value per repeated index kept, on one thread too), its boolean-mask
    form as a fill, and index_add likewise: ortbridge refuses them there, saying what to do."""
    x, rows, _, v = _writes_inputs()
    with pytest.raises(ortbridge.ExportError, match="TorchScript exporter .* dynamo=True"):
        ortbridge.export(model, (x, rows, v), dynamo=False)
    # (only while exporting: torch's own exporter is as it was afterwards)
    torch.onnx.export(_Put(), (x, rows, v), io.BytesIO(), dynamo=False)


def test_training_a_forward_with_accumulating_writes_equals_eager():
    """index_add and index_put(accumulate=True) in a forward, trained: their own nodes forward,
    and the gradients of their values (a gather) and of their destination."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(8, 256))
            self.linear = torch.nn.Linear(256, 256)

        def forward(self, rows, v):
            h = self.linear(v) / 64  # (sums of ~1,365 rows: values of ~1, float32 rounding well below 1e-5)
            return self.table.index_add(0, rows, h).index_put((rows,), h * 2, accumulate=True).tanh()

    torch.manual_seed(0)
    _, rows, _, v = _writes_inputs()

    def batch(step):
        return (rows, v.clone().requires_grad_()), {}

    def loss(out, step):
        return (out * torch.linspace(-1, 1, 256)).mean()

    for wrap in WRAPPERS.values():
        torch._dynamo.reset()
        train_side_by_side(Model(), batch, loss, steps=RUNS, wrap=wrap)


def test_an_unsafe_node_from_an_unforeseen_source_runs_in_pytorch(monkeypatch, caplog):
    """Should torch's exporter write a node of an unsafe kernel for an FX node that fallback.py
    does not route to PyTorch beforehand (here: its list emptied), the export finds it in the
    ONNX graph, runs that FX node in PyTorch, exports again, and says so."""
    monkeypatch.setattr(fallback, "_ACCUMULATING_WRITES", set())
    model, (x, rows, _, v) = _Put(), _writes_inputs()
    with caplog.at_level(logging.WARNING, logger="ortbridge"):
        proto = ortbridge.export(model, (x, rows, v))
    assert "wrote ScatterND, which ONNX Runtime computes otherwise than PyTorch" in caplog.text
    assert not kernels.unsafe_nodes(proto)
    for result in _run_in_ort(proto, (x, rows, v)):
        _assert_close(result, model(x, rows, v).numpy())


class _TopK(torch.nn.Module):
    """topk and sort of values with ties (rounded), their indices used and their values trained."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.linear(x)
        ties = h + (h.round() - h).detach()  # (rounded values, with h's gradient)
        values, indices = ties.topk(8, dim=-1)
        ordered, order = ties.sort(dim=-1, descending=True)
        return values * indices + ordered[..., :8] * order[..., :8]


def test_training_with_topk_of_equal_values_equals_eager():
    """The indices of equal values are eager's (so are the gradients they route); the graphs run
    topk and sort in PyTorch."""
    torch.manual_seed(0)
    x = torch.randn(512, 64) * 3

    def batch(step):
        return (x + step,), {}

    for name, wrap in WRAPPERS.items():
        torch._dynamo.reset()
        wrapped = train_side_by_side(_TopK(), batch, lambda out, step: out.float().mean(), steps=RUNS, wrap=wrap)
        if name == "OrtModule":
            assert not any(kernels.unsafe_nodes(s.model, eager_exact=True) for s in _sessions(wrapped))


def test_exported_topk_stays_onnx():
    """A model file keeps ONNX's TopK (ties by index, as ONNX defines it), which runs without PyTorch."""
    model, x = _TopK().eval(), torch.randn(16, 64)
    proto = ortbridge.export(model, (x,))
    assert "TopK" in {n.op_type for n in proto.graph.node}
    assert not kernels.unsafe_nodes(proto)


class _EmptyInner(torch.nn.Module):
    """Products over an empty inner dimension (a LoRA of rank 0): zeros, which ONNX Runtime 1.19's
    MatMul leaves unwritten."""

    def __init__(self):
        super().__init__()
        self.down = torch.nn.Parameter(torch.randn(256, 0))
        self.up = torch.nn.Parameter(torch.randn(0, 256))

    def forward(self, x):
        return x + (x @ self.down) @ self.up


def test_products_over_an_empty_inner_dimension_are_zeros():
    """Eager's zeros on every run and path: in ONNX Runtime from 1.20, in PyTorch on 1.19 (the
    MatMul on the deny list there, which no graph keeps)."""
    torch.manual_seed(0)
    x = torch.randn(512, 256)
    for name, wrap in WRAPPERS.items():
        torch._dynamo.reset()
        wrapped = train_side_by_side(
            _EmptyInner(), lambda step: ((x + step,), {}), lambda out, step: out.square().mean(), steps=RUNS, wrap=wrap
        )
        if name == "OrtModule":
            assert not any(kernels.unsafe_nodes(s.model, eager_exact=True) for s in _sessions(wrapped))
    proto = ortbridge.export(_EmptyInner(), (x,))
    assert not kernels.unsafe_nodes(proto)
    for _ in range(RUNS):
        _assert_close(_run_in_ort(proto, (x,))[0], x.numpy())
