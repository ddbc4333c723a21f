"""bfloat16 models and CPU autocast (bfloat16, float16) trained under ortbridge.OrtModule against
eager PyTorch in the same dtypes: an MLP, a CNN with batch norm, nn.TransformerEncoderLayer and a
tiny Hugging Face BERT. ONNX Runtime's CPU provider has few bfloat16 kernels (no Gemm, MatMul,
Add, Conv...): each node it has none for runs in PyTorch as a fallback node, found all at once.
Norms of a low-precision input run in float32 as torch's kernels compute them (ONNX's take one
type for input and weights; torch's meta functions give their statistics other types than its
CPU kernels)."""

from __future__ import annotations

import contextlib
import copy
import os

import onnxruntime
import pytest
import torch
from conftest import BINDS_BFLOAT16, needs_bfloat16_binding

import ortbridge
from ortbridge._tracing import fallback, kernels

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub
nn = torch.nn
F = torch.nn.functional

# Relative to a tensor's norm: a few units in the last place of the dtype (bfloat16 keeps 8
# significant bits, float16 11), as two orders of summation and rounding give. Where eager
# PyTorch in the dtype is itself further from float64 than that (a gradient through batch norm
# cancels most of its terms: eager's in bfloat16 was 16% off float64's, OrtModule's 8%), the
# tolerance is twice eager's own error: OrtModule as close to float64 as eager, or closer.
TOLERANCE = {torch.bfloat16: 4e-2, torch.float16: 1e-2}
MODES = {"bf16_model": torch.bfloat16, "autocast_bf16": torch.bfloat16, "autocast_fp16": torch.float16}


def _mlp():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    return (
        model,
        lambda g: ((torch.randn(8, 16, generator=g),), {}),
        lambda out, g: F.cross_entropy(out, torch.randint(0, 4, (8,), generator=g)),
    )


def _cnn():
    # (no conv bias before batch norm: its gradient is zero but for rounding, in any order)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    return (
        model,
        lambda g: ((torch.randn(4, 3, 8, 8, generator=g),), {}),
        lambda out, g: F.cross_entropy(out, torch.randint(0, 4, (4,), generator=g)),
    )


def _transformer():
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return (
        model,
        lambda g: ((torch.randn(2, 5, 16, generator=g),), {}),
        lambda out, g: (out.float() * torch.randn(out.shape, generator=g)).sum(),
    )


def _bert():
    transformers = pytest.importorskip("transformers")
    from tiny_bert import tiny_bert_config

    # (one layer of width 16: the bf16 and fp16 cases run on every torch release)
    config = tiny_bert_config(num_labels=3, hidden_size=16, num_hidden_layers=1, intermediate_size=24)

    def batch(g):
        mask = torch.ones(3, 7, dtype=torch.int64)
        mask[1, 5:] = 0
        return (), dict(
            input_ids=torch.randint(1, 50, (3, 7), generator=g),
            attention_mask=mask,
            labels=torch.randint(0, 3, (3,), generator=g),
        )

    return transformers.BertForSequenceClassification(config), batch, lambda out, g: out.loss


MODELS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer, "bert": _bert}


def _tensors(out) -> list:
    return [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _assert_close(actual, expected, reference, what: str, tolerance: float, floor: float = 0.0, eager_error=None):
    """Same dtype and shape; the difference's norm within `tolerance` of the expected (eager) tensor's
    norm, or of `floor` (for a gradient that is zero but for rounding: attention's key bias), or
    twice eager's distance from the float64 `reference` (`eager_error`, relative to the reference's
    norm, where given: eager's largest over a run)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype}{list(actual.shape)}, eager {expected.dtype}{list(expected.shape)}"
    )
    a, e, r = (t.detach().double() for t in (actual, expected, reference))
    error, scale = (a - e).norm().item(), max(e.norm().item(), floor)
    eager_error = (e - r).norm().item() if eager_error is None else eager_error * r.norm().item()
    assert error <= max(tolerance * scale, 2 * eager_error), (
        f"{what}: error {error:.3g} is {error / scale:.3g} of {scale:.3g} (eager's from float64: {eager_error:.3g})"
    )


def _distance(expected, reference) -> float:
    """The norm of expected - reference, relative to the reference's."""
    e, r = expected.detach().double(), reference.detach().double()
    return (e - r).norm().item() / max(r.norm().item(), 1e-30)


def train_side_by_side(name: str, mode: str, steps: int = 2, train: bool = True) -> ortbridge.OrtModule:
    """`name`'s model trained `steps` SGD steps in `mode` eagerly, under OrtModule, and eagerly in
    float64 (the reference), compared after each (outputs, loss, parameter gradients) and at the
    end (parameters, buffers; gradients against eager's largest distance from float64 over the
    steps). Each step starts the OrtModule and the reference from eager's
    parameters: in low precision two trajectories part by rounding alone (the CNN's batch norm
    gradients, 10-20% from float64's in eager itself, differed by 15% after two steps from
    equal code), so each step's gradients are compared at one point."""
    torch.manual_seed(0)
    model, batch, loss_fn = MODELS[name]()
    model.train(train)
    reference = copy.deepcopy(model).double()
    dtype = MODES[mode]
    if dtype is torch.bfloat16 and not BINDS_BFLOAT16:
        pytest.skip(f"onnxruntime {onnxruntime.__version__} binds no bfloat16 buffer")
    if mode == "bf16_model":
        model.to(dtype)
    tolerance = TOLERANCE[dtype]
    wrapped = ortbridge.OrtModule(copy.deepcopy(model))
    models = (reference, model, wrapped)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    gradients: dict[str, list] = {}  # parameter name -> (step, OrtModule's, eager's, float64's gradient, floor)
    for step in range(steps):
        with torch.no_grad():
            for p, q, r in zip(model.parameters(), wrapped.parameters(), reference.parameters()):
                q.copy_(p)
                r.copy_(p)
        results = []
        for m in models:
            args, kwargs = batch(torch.Generator().manual_seed(step))
            if m is reference or mode == "bf16_model":
                args = tuple(a.to(torch.float64 if m is reference else dtype) for a in args)
            # (OrtModule captured and called in one autocast state)
            with (
                torch.autocast("cpu", dtype)
                if m is not reference and mode != "bf16_model"
                else contextlib.nullcontext()
            ):
                out = m(*args, **kwargs)
                loss = loss_fn(out, torch.Generator().manual_seed(100 + step))
            loss.backward()
            results.append((_tensors(out), loss))
        assert ortbridge.context_pool_size() == 0
        (outs_r, loss_r), (outs_e, loss_e), (outs_w, loss_w) = results
        assert len(outs_w) == len(outs_e)
        for k, tensors in enumerate(zip(outs_w, outs_e, outs_r)):
            _assert_close(*tensors, f"step {step}: output {k}", tolerance)
        _assert_close(loss_w, loss_e, loss_r, f"step {step}: loss", tolerance)
        floor = 1e-2 * max(p.grad.double().norm().item() for p in model.parameters() if p.grad is not None)
        for (p_name, p), q, r in zip(model.named_parameters(), wrapped.parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}: {p_name}.grad"
            if p.grad is not None:
                gradients.setdefault(p_name, []).append((step, q.grad.clone(), p.grad.clone(), r.grad.clone(), floor))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    # Gradients: eager's own distance from float64 in low precision is noise that varies from step to
    # step (the CNN's batch norm gradients: 1% to 17% in bfloat16, from one step to the next, with
    # OrtModule as often closer than eager as not over seeds); so the bound is eager's largest over the run.
    for p_name, steps_of in gradients.items():
        eager_error = max(_distance(e, r) for _, _, e, r, _ in steps_of)
        for step, q, p, r, floor in steps_of:
            _assert_close(q, p, r, f"step {step}: {p_name}.grad", tolerance, floor, eager_error)
    for (p_name, p), q, r in zip(model.named_parameters(), wrapped.parameters(), reference.parameters()):
        _assert_close(q, p, r, f"{p_name} after training", tolerance)
    for (b_name, b), c, r in zip(model.named_buffers(), wrapped.buffers(), reference.buffers()):
        if b.is_floating_point():
            _assert_close(c, b, r, f"buffer {b_name} after training", tolerance)
    return wrapped


def _fallback_operators(wrapped: ortbridge.OrtModule) -> set:
    """The operators the captured graphs run in PyTorch (fallback nodes)."""
    return {
        next(a.s.decode() for a in node.attribute if a.name == "func_name")
        for captures in wrapped._captures.values()
        for capture in captures
        for session in capture.sessions
        for node in session.model.graph.node
        if node.op_type == "PythonOp"
    }


def _onnx_operators(wrapped: ortbridge.OrtModule) -> set:
    return {
        node.op_type
        for captures in wrapped._captures.values()
        for capture in captures
        for session in capture.sessions
        for node in session.model.graph.node
        if node.domain == ""
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
def test_trains_like_eager(name, mode):
    train_side_by_side(name, mode)


def test_bf16_operators_without_kernels_run_in_pytorch_the_others_in_onnx_runtime():
    wrapped = train_side_by_side("mlp", "bf16_model", steps=1)
    # (ONNX Runtime's CPU provider has no bfloat16 Gemm, Gelu, MatMul; it has LayerNormalization)
    assert {"aten::addmm.default", "aten::gelu.default", "aten::mm.default"} <= _fallback_operators(wrapped)
    assert "LayerNormalization" in _onnx_operators(wrapped)


def test_autocast_layer_norm_runs_in_onnx_runtime_in_float32():
    # (CPU autocast leaves layer norm to torch's kernel of a bfloat16 input and float32 weights)
    wrapped = train_side_by_side("mlp", "autocast_bf16", steps=1)
    assert "LayerNormalization" in _onnx_operators(wrapped)
    assert "aten::native_layer_norm.default" not in _fallback_operators(wrapped)


@pytest.mark.parametrize("mode", MODES)
def test_eval_mode_batch_norm(mode):
    """Batch norm from running statistics (a retraced graph: its saved statistics are empty)."""
    train_side_by_side("cnn", mode, steps=1, train=False)
    model = _cnn()[0].eval()
    dtype = MODES[mode]
    x = torch.randn(2, 3, 8, 8)
    if mode == "bf16_model":
        model, x = model.to(dtype), x.to(dtype)
    wrapped = ortbridge.OrtModule(copy.deepcopy(model))
    with torch.no_grad(), torch.autocast("cpu", dtype) if mode != "bf16_model" else contextlib.nullcontext():
        expected = model(x)
        _assert_close(wrapped(x), expected, expected, "inference output", TOLERANCE[dtype])


def test_nodes_without_a_kernel_are_found_at_once():
    """kernels.without_kernel: every node of the graph ONNX Runtime has no kernel for, as the FX
    node it translates (the float16 nodes the CPU provider runs in float32 are not)."""
    from onnx import TensorProto, helper

    def node(op, inputs, name):
        return helper.make_node(op, inputs, [name], name=f"node_{name}")

    def graph(elem):
        value = helper.make_tensor_value_info
        return helper.make_model(
            helper.make_graph(
                [node("MatMul", ["x", "w"], "mm"), node("Add", ["mm", "x"], "add"), node("Transpose", ["add"], "t")],
                "g",
                [value("x", elem, [2, 2]), value("w", elem, [2, 2])],
                [value("t", elem, [2, 2])],
                value_info=[value("mm", elem, [2, 2]), value("add", elem, [2, 2])],
            ),
            opset_imports=[helper.make_opsetid("", 17)],
            ir_version=10,  # (onnxruntime 1.19 reads up to 10)
        )

    providers = ["CPUExecutionProvider"]
    assert kernels.without_kernel(graph(TensorProto.BFLOAT16), providers) == {"mm", "add"}
    assert kernels.without_kernel(graph(TensorProto.FLOAT16), providers) == set()
    assert kernels.without_kernel(graph(TensorProto.FLOAT), providers) == set()


def test_a_refused_node_onnx_runtimes_optimizer_fused_names_its_fx_node_and_optimizer():
    error = (
        "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for Gemm(13) node with "
        "name 'node_addmm/GemmTransposeFusion/'"
    )
    assert fallback.node_without_kernel(error) == "addmm"
    assert fallback.optimizer_without_kernel(error) == "GemmTransposeFusion"


def test_a_promoted_output_keeps_its_dtype():
    """A bfloat16 sum, computed in float32 by torch's exporter (its type promotion), and returned:
    the graph's output is bfloat16 (torch.onnx.export's is float32)."""

    class Sum(nn.Module):
        def forward(self, x):
            return x.sum(0)

    program = torch.export.export(Sum(), (torch.randn(3, 4, dtype=torch.bfloat16),))
    model = fallback.to_onnx(fallback.exportable(program))
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [16]  # (TensorProto.BFLOAT16)


class _ScaleByWeight(torch.autograd.Function):
    """x * w, its gradients computed in the type of x * w (float32 beside a bfloat16 x)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class _CastToFloat32(torch.autograd.Function):
    """AMP's recipe for a Function that must compute in float32: custom_fwd with cast_inputs
    (under autocast its inputs cast, its forward run with autocast off), custom_bwd."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w, x.sum()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g, g_sum):
        x, w = ctx.saved_tensors
        return g @ w.T + g_sum, x.T @ g


class _UnderAutocast(torch.autograd.Function):
    """custom_fwd without cast_inputs: forward runs under the caller's autocast (its matmul of a
    bfloat16 x and a float32 w autocast), backward under the same state (custom_bwd)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.T, x.T @ g


def _first(out):
    return out[0] + out[1] if isinstance(out, tuple) else out


class _FunctionAfterLinear(nn.Module):
    def __init__(self, function, w_shape: tuple):
        super().__init__()
        self.function = function
        self.linear = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(w_shape) / 4)

    def forward(self, x):
        return _first(self.function.apply(self.linear(x), self.w))  # (a bfloat16 x, a float32 w)


@pytest.mark.parametrize(
    "function, w_shape",
    [(_CastToFloat32, (16, 16)), (_UnderAutocast, (16, 16)), (_ScaleByWeight, (16,))],
    ids=["custom_fwd-cast_inputs", "custom_fwd", "gradient-of-another-dtype"],
)
@pytest.mark.parametrize("wrapper", ["OrtModule", "compile"])
@needs_bfloat16_binding
def test_functions_under_autocast_run_as_eager_runs_them(function, w_shape, wrapper):
    """A Function run as a node sees the autocast its call was captured under (AMP's custom_fwd
    recipes; eager's autocast of the matmuls inside; OrtModule and the compile backend), and a
    gradient it returns in another dtype
    than its input's is cast to the input's, as autograd casts it (_ScaleByWeight: float32
    gradients for a bfloat16 input). Outputs, dtypes and gradients equal eager's."""
    torch.manual_seed(0)
    eager = _FunctionAfterLinear(function, w_shape)
    torch._dynamo.reset()
    wrap = ortbridge.OrtModule if wrapper == "OrtModule" else lambda m: torch.compile(m, backend="ortbridge")
    wrapped = wrap(copy.deepcopy(eager))
    x = torch.randn(8, 16)
    for step in range(2):
        with torch.autocast("cpu", torch.bfloat16):
            expected, out = eager(x + step), wrapped(x + step)
        assert out.dtype == expected.dtype
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        expected.float().square().sum().backward()
        out.float().square().sum().backward()
        for (name, p), q in zip(eager.named_parameters(), wrapped.parameters()):
            assert q.grad.dtype == p.grad.dtype, name
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)


class _PlainMatmul(torch.autograd.Function):
    """No AMP decorators: eager runs its backward under the autocast of the code calling
    backward() (its matmuls of a bfloat16 g and a float32 w autocast there, else fail)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g.float() @ w.T, x.T.float() @ g.float()


@pytest.mark.parametrize("backward_in_autocast", [True, False], ids=["backward-in-autocast", "backward-after"])
@pytest.mark.parametrize("stages", [1, 2], ids=["one-backward-run", "backward-in-stages"])
@needs_bfloat16_binding
def test_a_functions_backward_runs_under_the_autocast_of_backwards_caller_as_eager(backward_in_autocast, stages):
    """A forward under bfloat16 autocast, then backward() inside the autocast block (as many scripts
    write it) or after it: the Function's backward sees the caller's autocast as in eager (its
    matmuls in bfloat16, or in float32), where AOTAutograd's runtime would run it with autocast off.
    Gradients equal eager's, in both cases and with the backward graph in stages."""
    torch.manual_seed(0)
    eager = _FunctionAfterLinear(_PlainMatmul, (16, 16))
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager), backward_stages=stages)
    x = torch.randn(8, 16)
    for step in range(2):
        for model in (eager, wrapped):
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(x + step).float().square().sum()
                if backward_in_autocast:
                    loss.backward()
            if not backward_in_autocast:
                loss.backward()
        for (name, p), q in zip(eager.named_parameters(), wrapped.parameters()):
            assert q.grad.dtype == p.grad.dtype, name
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=f"step {step}: {name}")
