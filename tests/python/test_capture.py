"""What a capture must get right on models as users write them: operators torch's ONNX exporter
cannot write (the fallback), every way a Function's apply is reached, one node per call, library
code that asks whether it is traced, module state, arguments, and the options of OrtModule and
the torch.compile backend."""

from __future__ import annotations

import copy
import functools
import gc
import logging
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from test_training import _all_captures, train_like_eager
from torch.utils.checkpoint import CheckpointFunction, checkpoint

import ortbridge
from ortbridge import registry
from ortbridge._compat import torch_private
from ortbridge._kernel.lookup import lookup
from ortbridge._tracing.interception import intercepted

F = torch.nn.functional


def _ortbridge_nodes(model: onnx.ModelProto) -> list[str]:
    """func_name of each ortbridge node, in graph order."""
    return [
        next(a.s.decode() for a in n.attribute if a.name == "func_name")
        for n in model.graph.node
        if n.domain == "ortbridge"
    ]


def _graph_nodes(wrapped, kind: int) -> list[str]:
    """func_names in the forward (0) or backward (1) graph of the wrapped module's one capture."""
    (capture,) = _all_captures(wrapped)
    return _ortbridge_nodes(capture.sessions[kind].model)


def _images(step: int) -> tuple:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(2, 3, 10, 10, generator=g),)


class Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / 2**0.5))
        return grad * (cdf + x * torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5)


class Noise(torch.autograd.Function):
    """Adds uniform noise: two calls on the same input draw different numbers."""

    @staticmethod
    def forward(ctx, x):
        return x + torch.rand_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


# --- operators torch's ONNX exporter cannot write -----------------------------------------------


def test_convolution_and_pooling_train_with_their_backward_run_by_pytorch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AvgPool2d(2),
        torch.nn.Conv2d(4, 4, 3, groups=2),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 2),
    )
    wrapped = train_like_eager(model, _images)
    backward = _graph_nodes(wrapped, 1)
    assert "aten::convolution_backward.default" in backward
    assert "aten::avg_pool2d_backward.default" in backward
    assert all(name.startswith("aten::") for name in backward)


@pytest.mark.parametrize("dynamic", [False, True])
def test_fallback_nodes_are_traced_alone_where_shapes_are_static(dynamic, monkeypatch):
    # Tracing the whole program again for its fallback nodes took about a third of a capture:
    # with static shapes each fallback node is traced alone and put in its place (batch norm's:
    # several outputs, some of them graph outputs, the running statistics; the backward's with
    # an output mask), with symbolic sizes the program is traced again.
    traces = []
    decompose = torch.export.ExportedProgram.run_decompositions
    monkeypatch.setattr(
        torch.export.ExportedProgram,
        "run_decompositions",
        lambda self, *args, **kwargs: traces.append(args) or decompose(self, *args, **kwargs),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Hardswish(),
        torch.nn.Conv2d(4, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(144, 2),
    )
    wrapped = train_like_eager(model, _images, wrap=functools.partial(ortbridge.OrtModule, dynamic=dynamic))
    assert "aten::native_batch_norm_backward.default" in _graph_nodes(wrapped, 1)
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(wrapped.module.get_buffer(name), buffer, msg=name)
    assert len(traces) == (4 if dynamic else 2)  # (the decomposition of each graph, and with symbolic sizes its trace)


def test_torch_compile_trains_a_cnn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.Hardswish(), torch.nn.Flatten(), torch.nn.Linear(256, 2)
    )
    train_like_eager(model, _images, wrap=lambda m: torch.compile(m, backend="ortbridge"))


@torch.library.custom_op("ortbridge_test::triple", mutates_args=())
def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@triple.register_fake
def _(x):
    return torch.empty_like(x)


class Tripling(torch.nn.Module):
    def forward(self, x):
        return triple(x).sum(1)


def test_export_runs_an_operator_without_onnx_translation_in_pytorch():
    x = torch.randn(5, 4)
    with pytest.raises(
        ortbridge.ExportError, match=r"ortbridge_test::triple.default .*allow_operators\('ortbridge_test'\)"
    ):
        ortbridge.export(Tripling(), (x,))
    ortbridge.allow_operators("ortbridge_test")
    model = ortbridge.export(Tripling(), (x,), dynamic_shapes={"x": {0: "batch"}})
    assert _ortbridge_nodes(model) == ["ortbridge_test::triple.default"]
    session = ortbridge.InferenceSession(model.SerializeToString())
    for batch in (5, 2):
        x = torch.randn(batch, 4)
        (y,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        np.testing.assert_allclose(y, (x * 3).sum(1).numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    "name",
    [
        "os::system.default",
        "aten::from_file.default",
        "aten::__class__.default",
        "aten::name.default",
        "aten::add.__dict__",
        "aten::add",
        "aten::no_such_op.default",
        "not_allowed::triple.default",
        "aten::_reshape_alias.default",
        "aten::add_.Tensor",
        "aten::add.out",
        "aten::empty.memory_format",
        "aten::as_strided.default",
    ],
)
def test_operator_names_resolve_only_to_allowed_registered_operators(name):
    with pytest.raises(LookupError):
        lookup(name)


def test_a_node_onnx_runtimes_optimizer_made_without_a_kernel_names_the_optimizer():
    # (ONNX Runtime 1.19 fuses a float64 MatMul of a transpose into FusedMatMul, which it has no
    # float64 kernel for: the session is made again with that optimizer off.)
    from ortbridge._tracing import fallback

    error = (
        "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Failed to find kernel for com.microsoft.FusedMatMul(1) "
        "(node:'node_mm_2/MatmulTransposeFusion/' ep:'CPUExecutionProvider')."
    )
    assert fallback.optimizer_without_kernel(error) == "MatmulTransposeFusion"
    assert fallback.optimizer_without_kernel("Failed to find kernel for Relu(14) (node:'node_relu' ep:'CPU')") is None


def test_operator_node_runs_the_operator():
    forward = lookup("aten::add.Tensor").forward
    (out,) = forward(None, (-1, -1, -1), ("alpha",), torch.ones(2), torch.ones(2), 2)
    assert out.tolist() == [3.0, 3.0]


# --- every way a Function's apply is reached ----------------------------------------------------

_aliased = Gelu.apply


def _closure():
    apply = Gelu.apply
    return lambda h: apply(h)


class HalfGelu(Gelu):
    """Overrides apply, calling torch's through super()."""

    @classmethod
    def apply(cls, x):
        return super().apply(x) * 0.5


class EveryWay(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bound = Gelu.apply  # the idiom of ORT's own tests
        self.partial = functools.partial(Gelu.apply)
        self.closure = _closure()

    def forward(self, x):
        h = self.lin(x)
        return (
            Gelu.apply(h)
            + self.bound(h * 2)
            + self.partial(h * 3)
            + self.closure(h * 4)
            + _aliased(h * 5)
            + HalfGelu.apply(h * 6)
        )


def _every_way_counted(names: list) -> tuple:
    return names.count(registry.qualified_name(Gelu)), names.count(registry.qualified_name(HalfGelu))


def test_every_way_of_reaching_apply_is_a_python_op_in_training():
    torch.manual_seed(0)
    wrapped = train_like_eager(EveryWay())
    assert _every_way_counted(_graph_nodes(wrapped, 0)) == (5, 1)
    assert _every_way_counted(_graph_nodes(wrapped, 1)) == (5, 1)
    assert not torch_private.apply_routed()


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_every_way_of_reaching_apply_is_a_python_op_in_export(dynamo):
    model = EveryWay().eval()
    x = torch.randn(3, 4)
    proto = ortbridge.export(model, (x,), dynamo=dynamo, all_functions=True)
    assert _every_way_counted(_ortbridge_nodes(proto)) == (5, 1)
    assert not torch_private.apply_routed()
    session = ortbridge.InferenceSession(proto.SerializeToString())
    (y,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(y, model(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_apply_stored_before_ortbridge_was_imported_is_a_python_op():
    # (a subprocess: here ortbridge is imported already)
    code = """
import torch
class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2
    @staticmethod
    def backward(ctx, g):
        return g * 2
double = Double.apply
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
    def forward(self, x):
        return double(self.lin(x))
import ortbridge
model = Model()
x = torch.randn(2, 3)
wrapped = ortbridge.OrtModule(model)
(wrapped(x).sum() * 1).backward()
assert torch.allclose(wrapped(x), model(x))
(capture,) = [c for cs in wrapped._captures.values() for c in cs]
names = [n.op_type for n in capture.sessions[0].model.graph.node if n.domain == "ortbridge"]
print(names)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "['PythonOp']"


def test_apply_is_routed_only_during_a_capture_and_calls_cost_the_same_outside():
    calls = []

    def hook(cls, original, args, kwargs):
        calls.append(cls)
        return original(*args, **kwargs)

    x = torch.randn(3, requires_grad=True)
    stored = Gelu.apply
    assert not torch_private.apply_routed()
    with intercepted({Gelu}, hook):
        assert torch_private.apply_routed()
        stored(x), HalfGelu.apply(x), Noise.apply(x)
    assert not torch_private.apply_routed()
    stored(x)
    assert calls == [Gelu]  # (HalfGelu and Noise are not asked for)


@pytest.mark.skipif(not torch_private.APPLY_IN_C, reason="torch < 2.14: Function.apply is a Python function here")
@pytest.mark.parametrize(
    "descriptor, match",
    [
        (str.__dict__["join"], "is a method_descriptor, not a classmethod descriptor"),
        (dict.__dict__["fromkeys"], "calling convention flags 0x"),
    ],
)
def test_a_c_apply_of_another_shape_is_refused_naming_what_changed(descriptor, match):
    from ortbridge import _C

    with pytest.raises(RuntimeError, match=match):
        _C._route_apply(descriptor, lambda cls, args, kwargs: None)
    with pytest.raises(RuntimeError, match=match):
        _C._unrouted_apply(descriptor)


def test_a_torch_older_than_the_oldest_supported_is_refused_at_import():
    code = "import torch; torch.__version__ = '2.8.0'; import ortbridge"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ImportError: ortbridge needs torch 2.9 or later; this is torch 2.8.0" in proc.stderr


# --- every call its own node --------------------------------------------------------------------


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return Gelu.apply(h) * Gelu.apply(h)


def test_same_function_twice_on_the_same_inputs_trains():
    torch.manual_seed(0)
    wrapped = train_like_eager(Twice())
    assert _graph_nodes(wrapped, 0).count(registry.qualified_name(Gelu)) == 2
    assert _graph_nodes(wrapped, 1).count(registry.qualified_name(Gelu)) == 2


class OnAConstantToo(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("constant", torch.randn(5, 4))

    def forward(self, x):
        # (the same call twice, once on a tensor that needs no gradient: its output is not differentiable)
        return Gelu.apply(self.constant) + Gelu.apply(self.lin(x))


def test_same_function_on_a_constant_and_on_the_parameters_path_trains():
    # The two calls match the same recorded call but for which inputs need a gradient; the
    # constant's record (outputs not differentiable) was taken for both, and the parameters got no
    # gradient. (train_like_eager compares every gradient with eager's.)
    torch.manual_seed(0)
    wrapped = train_like_eager(OnAConstantToo())
    assert _graph_nodes(wrapped, 0).count(registry.qualified_name(Gelu)) == 2


def test_first_call_inside_a_non_reentrant_checkpoint_trains():
    # The capture happens inside checkpoint's saved-tensor hooks: what its recording run saved
    # was counted as the step's, and the recomputation found fewer tensors.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = Twice()
    wrapped = ortbridge.OrtModule(copy.deepcopy(model))
    x = torch.randn(5, 4, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    checkpoint(model, x, use_reentrant=False).sum().backward()
    checkpoint(wrapped, y, use_reentrant=False).sum().backward()
    torch.testing.assert_close(y.grad, x.grad)
    for p, q in zip(model.parameters(), wrapped.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    assert ortbridge.context_pool_size() == 0


class TwoDraws(torch.nn.Module):
    def forward(self, x):
        return Noise.apply(x), Noise.apply(x)


def test_a_function_drawing_random_numbers_twice_draws_twice():
    x = torch.zeros(64, requires_grad=True)
    a, b = ortbridge.OrtModule(TwoDraws())(x)
    assert not torch.equal(a, b)
    (a + b).sum().backward()
    assert x.grad.tolist() == [2.0] * 64
    proto = ortbridge.export(TwoDraws(), (x.detach(),), all_functions=True)
    session = ortbridge.InferenceSession(proto.SerializeToString())
    a, b = session.run(None, {session.get_inputs()[0].name: np.zeros(64, np.float32)})
    assert not np.array_equal(a, b)


# --- library code sees a trace ------------------------------------------------------------------


class AsksIfCompiling(torch.nn.Module):
    def forward(self, x):
        return x * 2 if torch.compiler.is_compiling() and torch.compiler.is_exporting() else x * 3


def test_capture_runs_as_torch_export_does():
    x = torch.ones(3, requires_grad=True)
    assert ortbridge.OrtModule(AsksIfCompiling())(x).tolist() == [2.0] * 3
    assert not torch.compiler.is_compiling()


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # the line the error names
            return x * 2
        return x


def test_data_dependent_failure_names_the_users_line():
    with pytest.raises(RuntimeError, match=r"test_capture.py:\d+ \(if x.sum\(\) > 0:.*\).*non-tensor argument"):
        ortbridge.OrtModule(DataDependent())(torch.ones(3, requires_grad=True))


# --- module state -------------------------------------------------------------------------------


class PlainTensorAttribute(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.full((4,), 0.5)  # neither a parameter nor a buffer

    def forward(self, x):
        return self.lin(x) * self.scale


def test_plain_tensor_attribute_is_a_constant_of_the_graph():
    torch.manual_seed(0)
    train_like_eager(PlainTensorAttribute())


class AddBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x + self.bias


def test_backward_with_nothing_to_compute_has_no_session():
    torch.manual_seed(0)
    wrapped = train_like_eager(AddBias(), lambda step: (torch.full((4,), float(step), requires_grad=True),))
    (capture,) = _all_captures(wrapped)
    assert capture.sessions[1].session is None


def test_parameters_and_modules_have_the_wrapped_modules_names():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    wrapped = ortbridge.OrtModule(model)
    for method in ("named_parameters", "named_buffers"):
        assert [n for n, _ in getattr(wrapped, method)()] == [n for n, _ in getattr(model, method)()], method
    assert list(wrapped.parameters()) == list(model.parameters())
    assert list(wrapped.buffers()) == list(model.buffers())
    # (the OrtModule itself first, under the wrapped module's name: where torch's fully_shard finds its state)
    assert list(wrapped.named_modules()) == [("", wrapped), *model.named_modules()]
    assert list(wrapped.modules()) == [wrapped, *model.modules()]
    assert list(wrapped.state_dict()) == list(model.state_dict())


# --- arguments ----------------------------------------------------------------------------------


class Recomputes(CheckpointFunction):
    """A Function of the model's that takes a function (torch's reentrant checkpoint, as the
    model's own: torch's runs as the segment it checkpoints)."""


class Checkpointed(torch.nn.Module):
    def __init__(self, apply=Recomputes.apply):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        self.apply_checkpoint = apply

    def forward(self, x):
        h = self.apply_checkpoint(self.block.forward, True, self.lin(x))  # a bound method made on each call
        return self.apply_checkpoint(lambda t: self.block(t) * 2, True, h)  # a lambda made on each call


def test_a_function_given_a_bound_method_and_a_lambda():
    torch.manual_seed(0)
    wrapped = train_like_eager(Checkpointed())
    assert _graph_nodes(wrapped, 0) == ["test_capture.Recomputes"] * 2


def test_torchs_reentrant_checkpoint_runs_as_its_segment():
    torch.manual_seed(0)
    wrapped = train_like_eager(Checkpointed(lambda f, preserve, x: checkpoint(f, x, use_reentrant=True)))
    assert _graph_nodes(wrapped, 0) == []


class HoldsTensor(torch.nn.Module):
    def forward(self, x):
        offset = x.detach() * 2  # a tensor of this run, which a graph constant cannot stay
        return Recomputes.apply(lambda t: t + offset, True, x)


def test_a_callable_holding_a_tensor_of_the_run_is_refused_naming_the_argument():
    with pytest.raises(
        ortbridge.ExportError,
        match=r"argument 0 of .*Recomputes.apply is a function that holds a \(3,\) tensor",
    ):
        ortbridge.OrtModule(HoldsTensor())(torch.ones(3, requires_grad=True))


class PopsOption(torch.autograd.Function):
    """Forward changes the dict it is given, as some library code does."""

    @staticmethod
    def forward(ctx, x, options):
        return x * options.pop("scale")

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


class PassesOptions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return PopsOption.apply(self.lin(x), {"scale": 2.0})


def test_an_argument_forward_changes_is_recorded_as_it_was_given():
    torch.manual_seed(0)
    train_like_eager(PassesOptions())


class TrailingNones(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None, None  # torch accepts extra trailing Nones


def test_backward_may_return_extra_trailing_nones():
    torch.manual_seed(0)
    train_like_eager(torch.nn.Sequential(torch.nn.Linear(4, 4), _Calls(TrailingNones, 3.0)))


class _Calls(torch.nn.Module):
    def __init__(self, func, *constants):
        super().__init__()
        self.func, self.constants = func, constants

    def forward(self, x):
        return self.func.apply(x, *self.constants)


# --- the forward/backward split ---------------------------------------------------------------


def test_saved_views_of_weights_are_made_in_the_backward_graph():
    # torch saves t(weight) of a Linear for backward as a free view; as a forward graph output it
    # would be a Transpose made at every run (and a reshaped activation a copy). The split saves
    # the weight and the activation, and the backward graph makes the views.
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), _Calls(Gelu), torch.nn.Linear(12, 5))
    wrapped = train_like_eager(model, functools.partial(_inputs_3d, shape=(2, 3, 6)))
    (capture,) = _all_captures(wrapped)
    forward, backward = (s.model.graph for s in capture.sessions)
    made_by = {o: n.op_type for n in forward.node for o in n.output}
    outputs = [
        made_by.get(o.name, "input") for o in forward.output if o.type.tensor_type.elem_type != onnx.TensorProto.INT64
    ]  # (not the context ids)
    saved = outputs[1:]  # (outputs[0] is the module's result, its reshape back to 3-d the user's)
    assert saved and "Transpose" not in saved and "Reshape" not in saved, outputs
    shapes = [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in backward.input]
    assert [12, 6] in shapes and [5, 12] in shapes and [6, 12] not in shapes and [12, 5] not in shapes, shapes


class _Attention(torch.nn.Module):
    def __init__(self, width: int = 8, heads: int = 2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.out(_Calls(Gelu)(F.scaled_dot_product_attention(q, k, v)).transpose(1, 2).reshape(b, n, c))


def test_saved_aliases_of_attention_probabilities_are_not_copied():
    # Attention's math form saves its probabilities for backward as a detach (and an expand) of
    # the softmax: as forward graph outputs they were Identity copies; the softmax itself is saved
    # instead. (The math form is what runs off the CPU; on it, torch's fused kernel: below.)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class MathAttention(_Attention):
        def forward(self, x):
            with sdpa_kernel(SDPBackend.MATH):
                return super().forward(x)

    wrapped = train_like_eager(MathAttention(), functools.partial(_inputs_3d, shape=(2, 5, 8)))
    forward = _all_captures(wrapped)[0].sessions[0].model.graph
    made_by = {o: n.op_type for n in forward.node for o in n.output}
    outputs = [made_by.get(o.name, "input") for o in forward.output]
    assert "Identity" not in outputs and "Expand" not in outputs, outputs


class _MaskedAttention(_Attention):
    def forward(self, x, mask):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.out(
            _Calls(Gelu)(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).transpose(1, 2).reshape(b, n, c)
        )


def _masked_inputs(step: int) -> tuple:
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[1, :, :, 3:] = False  # (padding)
    return (*_inputs_3d(step, (2, 5, 8)), mask)


def test_attention_on_the_cpu_runs_torchs_fused_kernel_each_way():
    # ONNX has attention as two MatMuls around a Softmax, with the safe softmax's reductions: on
    # the CPU torch's fused kernel (eager's) runs instead, a fallback node in each graph, its
    # strided output read through a Reshape (a view in torch, refused on a dense tensor).
    wrapped = train_like_eager(_MaskedAttention(), _masked_inputs)
    forward, backward = (_ortbridge_nodes(s.model) for s in _all_captures(wrapped)[0].sessions)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu.default" in forward
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward.default" in backward
    graph = _all_captures(wrapped)[0].sessions[0].model.graph
    assert "Softmax" not in {n.op_type for n in graph.node}
    # A caller asking for the math kernel gets it.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    wrapped = ortbridge.OrtModule(_MaskedAttention())
    with sdpa_kernel(SDPBackend.MATH):
        wrapped(*_masked_inputs(0))
    assert "Softmax" in {n.op_type for n in _all_captures(wrapped)[0].sessions[0].model.graph.node}


class _SafeSoftmax(torch.nn.Module):
    def forward(self, x):
        return torch.ops.aten._safe_softmax.default(x, -1) * 2


def test_attentions_safe_softmax_keeps_its_values_with_two_reductions():
    # _safe_softmax gives 0 for a row of -inf and NaN for a row with a NaN, wherever it is (ORT's
    # ReduceMax passes over a NaN that is not a row's first element).
    inf, nan = float("inf"), float("nan")
    x = torch.randn(7, 5)
    x[0], x[2], x[3] = -inf, -inf, -inf
    x[1, 2], x[2, 3], x[3, 0], x[4, 1], x[5, 4] = nan, nan, nan, -inf, inf
    wrapped = ortbridge.OrtModule(_SafeSoftmax()).eval()
    with torch.no_grad():
        got = wrapped(x)
    expected = _SafeSoftmax()(x)
    assert got[0].eq(0).all() and got[1:4].isnan().all() and got[6].isfinite().all()
    torch.testing.assert_close(got, expected, equal_nan=True)
    ops = [n.op_type for n in _all_captures(wrapped)[0].sessions[0].model.graph.node]
    assert "ReduceMax" in ops and "ReduceMin" not in ops, ops


class SavesItsOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


def test_the_recording_run_keeps_nothing_alive():
    # The recording run notes what each Function saves, and runs under saved-tensor hooks of its
    # own (not the caller's): a hook keeping a saved output itself made a cycle (output -> its
    # autograd node -> the saved output) that kept each capture's recorded forward alive, in a
    # Function and out of one (sigmoid saves its output). (A forward run's buffers for the next,
    # which its binding keeps, aside.)
    def alive() -> int:  # (tensors of the model's activations: rows of 11)
        gc.collect()
        kept = {id(t) for c in _all_captures(wrapped) for s in c.sessions for b in s._bindings for t in b.kept.values()}
        return sum(
            1
            for o in gc.get_objects()
            if type(o) is torch.Tensor and o.dim() == 2 and o.shape[1] == 11 and id(o) not in kept
        )

    wrapped = ortbridge.OrtModule(
        torch.nn.Sequential(torch.nn.Linear(5, 11), torch.nn.Sigmoid(), _Calls(SavesItsOutput), torch.nn.Sigmoid())
    )
    before = alive()
    for rows in (2, 3, 4):  # (a capture each)
        wrapped(torch.randn(rows, 5)).sum().backward()
    assert len(_all_captures(wrapped)) == 3 and alive() == before


def test_gradients_of_a_tensors_slices_are_one_concat():
    # q, k, v = qkv[0], qkv[1], qkv[2] (MultiheadAttention's self-attention): the gradient of
    # each select is a zero pad of qkv's shape, and the three are added. Slots that tile the dim
    # are one concat instead.
    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return _Calls(Gelu)(self.attn(x, x, x, need_weights=False)[0])

    wrapped = train_like_eager(SelfAttention(), functools.partial(_inputs_3d, shape=(2, 5, 8)))
    backward = _all_captures(wrapped)[0].sessions[1].model.graph
    ops = [n.op_type for n in backward.node]
    assert "Pad" not in ops and "Concat" in ops, ops


class SavesItsInput(torch.autograd.Function):
    """x * sigmoid(x), keeping x for backward (saved, or as an attribute), noting where x's data
    was in forward and where what it kept is in backward."""

    addresses: list = []

    @staticmethod
    def forward(ctx, x, as_attribute: bool):
        if as_attribute:
            ctx.x = x
        else:
            ctx.save_for_backward(x)
        ctx.forward_address = x.data_ptr()
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.x if hasattr(ctx, "x") else ctx.saved_tensors[0]
        SavesItsInput.addresses.append((ctx.forward_address, x.data_ptr()))
        s = torch.sigmoid(x)
        return grad * s * (1 + x * (1 - s)), None


class _ThreeSavingCalls(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        # (kept: a Linear's output on 3-d input, a reshape of the graph's Gemm; a computed
        # tensor; the graph's input)
        kept = self.second(SavesItsInput.apply(self.first(x), True)) + SavesItsInput.apply(x * 2, False)[..., :3]
        return kept + SavesItsInput.apply(x, False).sum()


def test_a_function_keeps_its_computed_input_without_a_copy():
    # A Function's input views one of ORT's buffers, which ORT reuses after the call: what it
    # keeps for backward was a copy. An input the graph computes is now a graph output bound to a
    # tensor of torch's for the run, kept by what the Function keeps: no copy, and alive while kept.
    from ortbridge._kernel import runner

    model = _ThreeSavingCalls()
    wrapped = ortbridge.OrtModule(copy.deepcopy(model))
    for step in range(3):
        SavesItsInput.addresses.clear()
        xs = [
            [
                torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(10 * step + k)).requires_grad_()
                for k in range(2)
            ]
            for _ in (model, wrapped)
        ]
        # Two forwards before either backward, torch's allocator busy in between: each kept input
        # must still hold its own values.
        losses = [[m(x).square().sum() for x in inputs] for m, inputs in zip((model, wrapped), xs)]
        churn = [torch.full((2, 3, 16), 7.0) for _ in range(8)]
        for pair in losses:
            sum(pair).backward()
        torch.testing.assert_close(losses[1], losses[0])
        for x, y in zip(*xs):
            torch.testing.assert_close(y.grad, x.grad)
        for p, q in zip(model.parameters(), wrapped.parameters()):
            torch.testing.assert_close(q.grad, p.grad)
            p.grad = q.grad = None
        assert ortbridge.context_pool_size() == 0 and not runner._lent_buffers, churn[0][0, 0]
        kept_at_forward_address = [forward == backward for forward, backward in SavesItsInput.addresses[6:]]
        # (what is kept of the computed tensors: no copy; the graph input saved: a copy, as the
        # caller may still change it)
        assert sorted(kept_at_forward_address) == [False, False, True, True, True, True], SavesItsInput.addresses
    (forward, _) = _all_captures(wrapped)[0].sessions
    assert len(forward.graph.lent) == 2


def test_a_run_writes_what_only_the_step_holds_into_the_last_steps_buffers():
    # The forward graph's outputs that never leave the step (buffers lent to Functions, tensors
    # saved for backward) go into the last run's buffers where nothing holds those any more: no
    # allocation and no bind. A buffer anything still holds keeps its values, and the run takes a
    # new one.
    wrapped = train_like_eager(_ThreeSavingCalls(), functools.partial(_inputs_3d, shape=(2, 3, 6)))
    (forward, _) = _all_captures(wrapped)[0].sessions
    (binding,) = forward._bindings
    assert set(forward.graph.lent) < set(forward.recycled) == set(binding.kept)  # (and the saved Linear output)

    def step(k: int) -> dict:
        wrapped(_inputs_3d(k, (2, 3, 6))[0]).square().sum().backward()
        assert ortbridge.context_pool_size() == 0
        return {j: t.data_ptr() for j, t in binding.kept.items()}

    holders = [
        ("a Python reference", lambda t: t, lambda held: held),
        ("a view", lambda t: t.view(-1)[:2], lambda held: held),
        ("another tensor on its memory", lambda t: t.detach(), lambda held: held),
        # (a product's backward keeps the tensor itself: a reference only C++ holds)
        ("autograd", lambda t: (t * torch.ones((), requires_grad=True)).grad_fn, lambda held: held._saved_self),
    ]
    j = min(binding.kept)
    for k, (kind, hold, read) in enumerate(holders):
        step(10 + 2 * k)
        addresses = step(11 + 2 * k)
        assert step(11 + 2 * k) == addresses, "a buffer nothing holds was not written again"
        with torch.enable_grad():
            held = hold(binding.kept[j])
        expected = read(held).clone()
        moved = step(12 + 2 * k)
        assert torch.equal(read(held), expected), f"{kind}: a held buffer was written"
        assert [i for i in addresses if moved[i] != addresses[i]] == [j], kind
        del held


def test_outputs_larger_than_the_recycling_bound_get_new_buffers(monkeypatch):
    # (the bound keeps large buffers from staying between steps, where eager frees them)
    from ortbridge.training import session

    monkeypatch.setattr(session, "RECYCLED_BYTES", 2 * 3 * 16 * 4 - 1)  # (under the Linear's output)
    wrapped = train_like_eager(_ThreeSavingCalls(), functools.partial(_inputs_3d, shape=(2, 3, 6)))
    (forward, _) = _all_captures(wrapped)[0].sessions
    # (of the two lent buffers and the saved Linear output, the lent x * 2 alone)
    assert [forward.graph.output_bytes[j] for j in forward.recycled] == [2 * 3 * 6 * 4]


@pytest.mark.parametrize("one_vector", [True, False])
def test_a_steps_context_ids_are_saved_as_one_tensor_that_owns_their_contexts(one_vector, monkeypatch):
    # AOTAutograd's runtime handles each saved tensor in Python (about a microsecond each way):
    # the context ids of a step's Function calls are saved as one vector. (AOTAutograd's own
    # partition saves one 0-d id per call: each is a view of the run's vector.)
    from torch._functorch.partitioners import default_partition

    from ortbridge.training import capture

    if not one_vector:
        monkeypatch.setattr(capture, "partition", default_partition)
    wrapped = train_like_eager(_ThreeSavingCalls(), functools.partial(_inputs_3d, shape=(2, 3, 6)))
    (forward, backward) = _all_captures(wrapped)[0].sessions
    sources = [s for s in forward.graph.sources if s[0] in ("ids", "id")]
    assert forward.graph.saved_contexts == 3 and len(backward.context_inputs) == 3
    assert sources == ([("ids", 0)] if one_vector else [("id", j) for j in range(3)])
    assert len(backward.graph.context_args) == (1 if one_vector else 3)
    # The vector owns the contexts: a backward takes its own three, the forwards whose backward
    # never runs release theirs when torch frees the vector.
    x = _inputs_3d(0, (2, 3, 6))[0]
    losses = [wrapped(x).sum() for _ in range(3)]
    assert ortbridge.context_pool_size() == 9
    losses[1].backward()
    assert ortbridge.context_pool_size() == 6
    del losses
    assert ortbridge.context_pool_size() == 0


def test_the_context_ids_tensor_is_made_from_a_contiguous_int64_vector_only():
    # (the run hands _C a numpy view of the buffer ORT wrote the ids into; anything else is refused)
    from ortbridge import _C

    ids = np.arange(3, dtype=np.int64)  # (no live context has these ids: freeing the tensor releases none)
    assert torch.from_dlpack(_C.context_ids_capsule(ids[1:])).tolist() == [1, 2]
    for bad in (np.arange(3, dtype=np.int32), np.arange(3, dtype=np.float64), ids.reshape(1, 3), ids[::2]):
        with pytest.raises(TypeError, match="1-d contiguous buffer of int64"):
            _C.context_ids_capsule(bad)
    with pytest.raises(TypeError):
        _C.context_ids_capsule([1, 2])
    assert ortbridge.context_pool_size() == 0


class _NormedTied(torch.nn.Module):
    """Batch norm (running statistics the step updates in place), a weight used twice, and
    outputs that need no gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        y = Gelu.apply(self.norm(self.b(self.a(x))))
        return {"y": y, "largest": y.argmax(-1), "scale": 2}


def test_a_training_step_runs_its_graphs_without_aotautograds_runtime(monkeypatch):
    # AOTAutograd's runtime wrappers cost about a third of a small step; a step that needs only
    # its graphs and copies into buffers runs them in one autograd.Function of its own.
    from ortbridge.training import capture

    traced = capture.aot_module_simplified

    def without_runtime(*args, **kwargs):
        traced(*args, **kwargs)
        return lambda *tensors: pytest.fail("AOTAutograd's runtime ran")

    monkeypatch.setattr(capture, "aot_module_simplified", without_runtime)
    torch.manual_seed(0)
    model = _NormedTied()
    wrapped = train_like_eager(model)
    (captured,) = _all_captures(wrapped)
    assert captured.step is not None
    for name, buffer in model.norm.named_buffers():
        torch.testing.assert_close(getattr(wrapped.module.norm, name), buffer, msg=name)


class _ReturnsItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return Gelu.apply(self.lin(x)), x.view(-1)


def test_a_step_that_returns_a_view_of_its_input_keeps_aotautograds_runtime():
    torch.manual_seed(0)
    wrapped = train_like_eager(_ReturnsItsInput())
    (captured,) = _all_captures(wrapped)
    assert captured.step is None
    out, view = wrapped(torch.ones(2, 4))
    assert view._base is not None


def test_retain_graph_runs_a_steps_backward_again_unless_it_calls_functions():
    # A step's Functions' contexts are released by its backward: a second one is refused, clearly;
    # a step without Function calls runs its backward graph as often as asked, as eager does.
    torch.manual_seed(0)
    wrapped = ortbridge.OrtModule(_NormedTied())
    x = torch.randn(5, 4, requires_grad=True)
    loss = wrapped(x)["y"].sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through a captured step"):
        loss.backward()
    assert _all_captures(wrapped)[0].step is not None
    del loss
    gc.collect()  # (the error's traceback holds the graph)
    assert ortbridge.context_pool_size() == 0

    eager = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    grads = []
    for m in (eager, wrapped):
        x.grad = None
        loss = m(x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append(x.grad)
    assert _all_captures(wrapped)[0].step is not None
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(wrapped.module[0].weight.grad, eager[0].weight.grad)


def test_a_graph_autograd_still_holds_keeps_its_saved_tensors_through_later_steps():
    # retain_graph keeps the first step's saved tensors in autograd: the steps in between write
    # theirs into new buffers, and the first backward's second run reads its own.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4), torch.nn.Tanh())
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    xs = [torch.randn(5, 4, requires_grad=True) for _ in range(3)]
    grads = []
    for m in (eager, wrapped):
        first = m(xs[0]).sum()
        first.backward(retain_graph=True)
        for x in xs[1:]:
            m(x).sum().backward()
        xs[0].grad = None
        first.backward()
        grads.append(xs[0].grad)
        xs[0].grad = None
    assert _all_captures(wrapped)[0].sessions[0].recycled
    torch.testing.assert_close(grads[1], grads[0])


def test_create_graph_gives_first_order_gradients_and_refuses_a_second_order():
    torch.manual_seed(0)
    model = _NormedTied()
    wrapped = ortbridge.OrtModule(copy.deepcopy(model))
    x = torch.randn(5, 4, requires_grad=True)
    (expected,) = torch.autograd.grad(model(x)["y"].sum(), x)
    (grad,) = torch.autograd.grad(wrapped(x)["y"].sum(), x, create_graph=True)
    torch.testing.assert_close(grad, expected)
    assert _all_captures(wrapped)[0].step is not None and grad.requires_grad
    with pytest.raises(RuntimeError, match="double backward through a captured step"):
        grad.sum().backward()
    del grad
    gc.collect()
    assert ortbridge.context_pool_size() == 0


class _UsesADetachedInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, target):
        return (Gelu.apply(self.lin(x)) - target.detach()).pow(2).mean()


def test_an_input_whose_gradient_the_step_never_computes_is_detached():
    # The input has a history that was backpropagated already; the step's backward must not walk
    # into it (AOTAutograd detaches such inputs too).
    torch.manual_seed(0)
    wrapped = ortbridge.OrtModule(_UsesADetachedInput())
    base = torch.randn(5, 4, requires_grad=True)
    target = base.exp()
    target.sum().backward()  # (frees target's history)
    wrapped(torch.randn(5, 4), target).backward()
    assert _all_captures(wrapped)[0].step is not None
    assert ortbridge.context_pool_size() == 0


def test_a_tensor_subclass_argument_keeps_aotautograds_runtime():
    from torch.testing._internal.subclasses import WrapperSubclass

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    wrapped = ortbridge.OrtModule(copy.deepcopy(model))
    x = WrapperSubclass(torch.randn(3, 4)).requires_grad_()
    y = wrapped(x)
    y.sum().backward()
    assert _all_captures(wrapped)[0].step is None and type(y) is WrapperSubclass


def _inputs_3d(step: int, shape) -> tuple:
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randn(*shape, generator=g, requires_grad=True),)


# --- options ------------------------------------------------------------------------------------


def test_options_session_options_providers_save_graphs_and_logging(tmp_path, caplog):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    wrapped = ortbridge.OrtModule(
        torch.nn.Sequential(torch.nn.Linear(4, 4), _Calls(Gelu)),
        session_options=options,
        providers=["CPUExecutionProvider"],
        save_graphs=tmp_path / "graphs",
    )
    with caplog.at_level(logging.INFO, logger="ortbridge"):
        wrapped(torch.randn(2, 4)).sum().backward()
    saved = sorted(os.listdir(tmp_path / "graphs"))
    assert [name.rsplit("_", 1)[1] for name in saved] == ["backward.onnx", "forward.onnx"]
    assert _ortbridge_nodes(onnx.load(tmp_path / "graphs" / saved[1])) == [registry.qualified_name(Gelu)]
    for session in _all_captures(wrapped)[0].sessions:
        assert session.session.get_session_options().intra_op_num_threads == 1
        assert session.session.get_providers() == ["CPUExecutionProvider"]
    assert any("captured Sequential_" in r.getMessage() for r in caplog.records)


def test_default_threads_one_for_small_graphs():
    # ORT's pool threads sleep between runs; waking one per small operator costs more than it
    # saves, so a graph whose tensors are all small runs on one thread, a larger one on torch's.
    from ortbridge.training.threads import SMALL_GRAPH_ELEMENTS

    for width, threads in ((8, 1), (256, torch.get_num_threads())):
        wrapped = ortbridge.OrtModule(torch.nn.Sequential(torch.nn.Linear(width, width), _Calls(Gelu)))
        x = torch.randn(width, width)
        wrapped(x).sum().backward()
        assert (x.numel() >= SMALL_GRAPH_ELEMENTS) == (width == 256)
        for session in _all_captures(wrapped)[0].sessions:
            assert session.session.get_session_options().intra_op_num_threads == threads


def test_threads_of_larger_graphs_sleep_or_spin_as_their_first_runs_measure(monkeypatch):
    # A CPU graph on several threads runs in a sleeping and a spinning session by turns, keeps the
    # faster and drops the other; while a spinning session runs, torch works on one thread.
    from ortbridge.training import threads as graph_module

    threads_seen = []
    gelu_forward = Gelu.forward
    monkeypatch.setattr(
        Gelu,
        "forward",
        staticmethod(lambda ctx, x: threads_seen.append(torch.get_num_threads()) or gelu_forward(ctx, x)),
    )
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), _Calls(Gelu))  # (the weight makes the graph large)
    wrapped = ortbridge.OrtModule(copy.deepcopy(model))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # (as on a machine with two cores or more)
    try:
        for run in range(2 * (graph_module.SpinningTrial.RUNS + 1)):
            x = torch.randn(32, 256)
            for m in (model, wrapped):
                m(x).sum().backward()
            for p, q in zip(model.parameters(), wrapped.parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
                p.grad = q.grad = None
            assert torch.get_num_threads() == 2
            sessions = _all_captures(wrapped)[0].sessions
            assert all((s._trial is None) == (run == 2 * graph_module.SpinningTrial.RUNS + 1) for s in sessions)
    finally:
        torch.set_num_threads(previous)
    # Gelu's forwards: eager's, the capture's recording run, then the graph's runs (sleeping,
    # spinning, and so on) after each of eager's.
    assert threads_seen[2::2][:2] == [2, 1] and set(threads_seen[:2] + threads_seen[3::2]) == {2}, threads_seen
    for s in sessions:
        spins = s.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
        assert spins == ("1" if s.spinning else "0")


def test_unread_context_ids_of_inference_nodes_are_left_unnamed():
    # An inference PythonOp's context id (0) that nothing reads costs its kernel an allocation:
    # the eval graph leaves it unnamed. A training PythonOp's id is named (backward takes it).
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Calls(Gelu))
    wrapped = ortbridge.OrtModule(model)
    x = torch.randn(3, 4)
    wrapped(x).sum().backward()
    wrapped.eval()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), model(x))
    context_ids = {}  # training_mode -> output 0 of each PythonOp
    for capture in _all_captures(wrapped):
        for node in (n for s in capture.sessions if s.model for n in s.model.graph.node if n.op_type == "PythonOp"):
            training = any(a.name == "training_mode" and a.i for a in node.attribute)
            context_ids.setdefault(training, []).append(node.output[0])
    assert context_ids[False] == [""] and len(context_ids[True]) == 1 and context_ids[True][0]


def test_backend_options(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    compiled = torch.compile(model, backend="ortbridge", options={"save_graphs": str(tmp_path)})
    compiled(torch.randn(2, 4)).sum().backward()
    assert sorted(n.rsplit("_", 1)[1] for n in os.listdir(tmp_path)) == ["backward.onnx", "forward.onnx"]
    with pytest.raises(Exception, match="unexpected keyword argument 'colour'"):
        torch.compile(torch.nn.Linear(2, 2), backend="ortbridge", options={"colour": 1})(torch.randn(1, 2))


def test_graph_rewrite_for_onnx_needs_no_onnx_runtime():
    """OnnxGraph is the pure FX half of a GraphSession: what ONNX Runtime would compute, and where
    every other output comes from."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from ortbridge.training.onnx_graph import OnnxGraph

    graphs = {}

    def keep(kind):
        def compile_graph(gm, example_inputs):
            graphs[kind] = OnnxGraph(gm, training=kind == "forward")
            return gm

        return compile_graph

    class AddBiasTuple(AddBias):
        def forward(self, x):
            return (super().forward(x),)

    compiled = aot_module_simplified(
        AddBiasTuple(), [torch.randn(4, requires_grad=True)], fw_compiler=keep("forward"), bw_compiler=keep("backward")
    )
    compiled(torch.randn(4, requires_grad=True))[0].sum().backward()
    assert [dtype for dtype, _ in graphs["forward"].outputs] == [torch.float32]  # x + bias
    assert graphs["backward"].outputs == []  # the bias gradient is the incoming gradient itself
    assert [source[0] for source in graphs["backward"].sources] == ["input", "input"]
