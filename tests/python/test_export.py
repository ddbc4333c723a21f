"""ortbridge.export: each call of an exported Function becomes one PythonOp node, from either
torch exporter, and the model runs in ONNX Runtime with outputs matching eager PyTorch."""

import io
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
import user_model
from conftest import python_op_grad
from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

import ortbridge
from ortbridge._compat import torch_private

EXPORTERS = [pytest.param(True, id="dynamo"), pytest.param(False, id="torchscript")]


def nodes(proto, op_type="PythonOp"):
    return [n for n in proto.graph.node if n.domain == "ortbridge" and n.op_type == op_type]


def attributes(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def run(proto, *inputs):
    sess = ortbridge.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: x.numpy() for i, x in zip(sess.get_inputs(), inputs)})


def eager(model, *inputs):
    with torch.no_grad():
        out = model(*inputs)
    return [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]


def assert_same(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


# -- the main path ------------------------------------------------------------------------------


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_model_matches_eager_and_keeps_everything_else_onnx(dynamo, tmp_path):
    net, x = user_model.example()
    path = tmp_path / "net.onnx"
    proto = ortbridge.export(net, (x,), path, dynamo=dynamo)
    saved = onnx.load(path)
    ops = [(n.domain or "ai.onnx", n.op_type) for n in saved.graph.node]
    assert [op for op in ops if op[0] == "ortbridge"] == [("ortbridge", "PythonOp")] * 3
    assert {d for d, _ in ops} <= {"ai.onnx", "ortbridge"}  # Linear, Mul, ... stay ordinary ONNX
    assert [n.name for n in nodes(saved)] == ["PythonOp_BiasGelu_0", "PythonOp_BiasGelu_1", "PythonOp_NumpyTopK_2"]
    # An inference node's context id (0) that nothing reads is unnamed: the kernel writes no tensor for it.
    assert [n.output[0] for n in nodes(saved)] == [""] * 3
    assert_same(run(saved, x), eager(net, x))
    assert proto == saved
    buffer = io.BytesIO()  # a binary file works as well as a path, as in torch.onnx.export
    ortbridge.export(net, (x,), buffer, dynamo=dynamo)
    assert onnx.load_from_string(buffer.getvalue()) == saved


def test_both_exporters_write_the_same_nodes():
    for model, inputs in [user_model.example(), (EveryConstant(), (torch.randn(2, 3), torch.arange(4)))]:

        def written(proto):  # attributes as bytes: NaN constants compare equal
            return [
                ({a.name: a.SerializeToString() for a in n.attribute}, len(n.input), len(n.output))
                for n in nodes(proto)
            ]

        by_dynamo = written(ortbridge.export(model, inputs))
        assert by_dynamo and by_dynamo == written(ortbridge.export(model, inputs, dynamo=False))
    gelu, topk = (attributes(n) for n in nodes(ortbridge.export(*user_model.example()))[::2])
    assert gelu["input_convention"] == b"cddc" and gelu["input_float_scalars"] == pytest.approx([0.1])
    assert gelu["input_literals"] == b'["none"]'  # the keyword argument, bound to its position
    assert topk["output_tensor_types"] == [onnx.TensorProto.FLOAT, onnx.TensorProto.INT64]
    assert topk["output_tensor_ranks"] == [2, 2] and topk["training_mode"] == 0


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_saved_model_runs_in_a_process_that_only_imports_the_users_module(dynamo, tmp_path):
    net, x = user_model.example(batch=5)
    path = tmp_path / "net.onnx"
    ortbridge.export(net, (x,), path, dynamo=dynamo, dynamic_shapes=({0: "batch"},))
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "expected.npy", eager(net, x)[0])
    script = (
        "import numpy as np, ortbridge, user_model\n"
        f"sess = ortbridge.InferenceSession({str(path)!r})\n"
        f"x = np.load({str(tmp_path / 'x.npy')!r})\n"
        "(values, _), = [sess.run(None, {sess.get_inputs()[0].name: x})]\n"
        f"np.testing.assert_allclose(values, np.load({str(tmp_path / 'expected.npy')!r}), rtol=1e-6, atol=1e-6)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# -- arguments ----------------------------------------------------------------------------------


@ortbridge.register
class Probe(torch.autograd.Function):
    """Records the type and value of every non-tensor argument it is called with."""

    seen = []

    @staticmethod
    def forward(ctx, *args):
        Probe.seen.append(_describe([a for a in args if not isinstance(a, torch.Tensor)]))
        # sum() starts from the int 0: a trace of this body breaks torch's TorchScript passes,
        # so that path must not trace forward.
        return sum(a.to(torch.float32).sum() for a in args if isinstance(a, torch.Tensor)).reshape(1)

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


def _describe(value):
    """Type and value, recursively: 1 and 1.0 and True and (1,) and [1] all differ."""
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_describe(v) for v in value]
    if isinstance(value, dict):
        return "dict", {k: _describe(v) for k, v in value.items()}
    return type(value).__name__, repr(value)


CONSTANTS = [
    None,
    True,
    7,
    -3,
    0.1,
    1e300,
    float("nan"),
    float("-inf"),
    2**70,
    "gelu",
    "",
    "ünïcode",
    (1, 2, 3),
    (0.5, 1.0 / 3.0),
    (True, False),
    (1, "a", None),
    ((1, 2), (3, 4)),
    (),
    [],
    [1, 2],
    [0.25],
    {"k": (1, 2), "s": "v"},
    torch.float16,
    torch.bfloat16,
    torch.device("cpu"),
]


class EveryConstant(torch.nn.Module):
    def forward(self, x, y):
        return Probe.apply(*CONSTANTS[:3], x, *CONSTANTS[3:], y)  # tensors not first, not adjacent


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_every_constant_kind_reaches_forward_as_in_eager(dynamo):
    x, y = torch.randn(2, 3), torch.arange(4)
    Probe.seen.clear()
    proto = ortbridge.export(EveryConstant(), (x, y), dynamo=dynamo)
    eager_seen = Probe.seen[0]
    expected = eager(EveryConstant(), x, y)
    Probe.seen.clear()
    assert_same(run(proto, x, y), expected)
    assert Probe.seen == [eager_seen]
    attrs = attributes(nodes(proto)[0])
    assert attrs["input_convention"].decode() == "ccc" + "d" + "c" * (len(CONSTANTS) - 3) + "d"
    assert "input_pointer_scalars" not in attrs  # all plain values: the model file is self-contained


DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]
UNSIGNED_WIDE = [torch.uint16, torch.uint32, torch.uint64]  # TorchScript's type table lacks them


@pytest.mark.parametrize(
    "dtype, dynamo",
    [(d, True) for d in DTYPES + UNSIGNED_WIDE] + [(d, False) for d in DTYPES],
    ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else ("dynamo" if v else "torchscript"),
)
def test_tensor_dtypes(dtype, dynamo):
    @ortbridge.register
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone(), torch.cat([x, x])

        @staticmethod
        def backward(ctx, a, b):
            raise NotImplementedError

    class M(torch.nn.Module):
        def forward(self, x):
            a, b = Twice.apply((x * 3).round().abs().to(dtype))  # some zeros: False as bool
            return a.to(torch.float32), b.to(torch.float32)

    try:
        x = torch.randn(3, 2)
        proto = ortbridge.export(M(), (x,), dynamo=dynamo)
        assert attributes(nodes(proto)[0])["input_tensor_types"] == [ortbridge._format.dtypes.onnx_type(dtype)]
        assert_same(run(proto, x), eager(M(), x))
    finally:
        ortbridge.unregister(Twice)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_model_keyword_arguments(dynamo):
    class M(torch.nn.Module):
        def forward(self, x, shift):
            return user_model.BiasGelu.apply(2.0, x, shift)  # approximate takes its default

    x, shift = torch.randn(3, 4), torch.randn(4)
    proto = ortbridge.export(M(), (x,), kwargs={"shift": shift}, dynamo=dynamo)
    assert attributes(nodes(proto)[0])["input_literals"] == b'["tanh"]'
    with torch.no_grad():
        expected = M()(x, shift=shift).numpy()
    np.testing.assert_allclose(run(proto, x, shift)[0], expected, rtol=1e-6, atol=1e-6)


class Handle:
    """An object no literal can hold."""

    def __init__(self, scale):
        self.scale = scale


@ortbridge.register
class ByReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle):
        return x * handle.scale

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


class WithHandle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.handle = Handle(4.0)

    def forward(self, x):
        return ByReference.apply(x, self.handle)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_objects_pass_by_reference_in_process_and_saving_needs_opt_in(dynamo, tmp_path):
    model, x = WithHandle(), torch.randn(3)
    proto = ortbridge.export(model, (x,), dynamo=dynamo)  # not saved: runs in this process
    assert attributes(nodes(proto)[0])["input_pointer_scalars"] == [ortbridge.pin_object(model.handle)]
    assert_same(run(proto, x), eager(model, x))
    path = tmp_path / "m.onnx"
    with pytest.raises(
        ortbridge.ExportError,
        match=r"argument 1 of test_export.ByReference.apply is a Handle object"
        r".*allow_object_references=True",
    ):
        ortbridge.export(model, (x,), path, dynamo=dynamo)
    assert not path.exists()
    ortbridge.export(model, (x,), path, dynamo=dynamo, allow_object_references=True)
    assert_same(run(onnx.load(path), x), eager(model, x))


@ortbridge.register
class Filled(torch.autograd.Function):
    """No tensor argument at all."""

    @staticmethod
    def forward(ctx, n, value):
        return torch.full((n,), value)

    @staticmethod
    def backward(ctx, g):
        return None, None


Filled_forward = Filled.__dict__["forward"]


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_function_without_tensor_arguments(dynamo):
    class M(torch.nn.Module):
        def forward(self, x):
            return x + Filled.apply(3, 0.5)

    x = torch.randn(3)
    proto = ortbridge.export(M(), (x,), dynamo=dynamo)
    (node,) = nodes(proto)  # a node of its own, not a constant folded from forward's result
    assert list(node.input) == [] and attributes(node)["input_convention"] == b"cc"
    assert_same(run(proto, x), eager(M(), x))


# -- outputs and shapes -------------------------------------------------------------------------


@ortbridge.register
class PassThrough(torch.autograd.Function):
    """Returns an input as it is, a new tensor, and an int64 buffer passed through."""

    @staticmethod
    def forward(ctx, x, counter):
        ctx.mark_non_differentiable(counter)
        return x, x * 2, counter

    @staticmethod
    def backward(ctx, a, b, c):
        raise NotImplementedError


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_outputs_passed_through_and_not_differentiable(dynamo):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("counter", torch.tensor([3, 4], dtype=torch.int64))

        def forward(self, x):
            a, b, c = PassThrough.apply(x + 1, self.counter)
            return a, b, c

    x = torch.randn(2, 3)
    proto = ortbridge.export(M(), (x,), dynamo=dynamo)
    attrs = attributes(nodes(proto)[0])
    assert attrs["output_tensor_types"] == [onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT, onnx.TensorProto.INT64]
    assert attrs["output_tensor_ranks"] == [2, 2, 1]
    assert_same(run(proto, x), eager(M(), x))


@ortbridge.register
class ScalarOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        return (x * s).sum(), s > 0

    @staticmethod
    def backward(ctx, a, b):
        raise NotImplementedError


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_zero_dimensional_tensors_in_and_out(dynamo):
    class M(torch.nn.Module):
        def forward(self, x):
            total, positive = ScalarOut.apply(x, x.mean())
            return total + 1, positive

    x = torch.randn(3)
    proto = ortbridge.export(M(), (x,), dynamo=dynamo)
    attrs = attributes(nodes(proto)[0])
    assert attrs["input_tensor_ranks"] == [1, 0] and attrs["output_tensor_ranks"] == [0, 0]
    assert_same(run(proto, x), eager(M(), x))


@ortbridge.register
class ReluInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.relu_()

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


class InPlaceOnIntermediate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x):
        return ReluInPlace.apply(self.linear(x))  # nothing else reads the Linear's output


class InPlaceOnInput(torch.nn.Module):
    def forward(self, x):
        return ReluInPlace.apply(x) * 2


class InPlaceOnShared(torch.nn.Module):
    def forward(self, x):
        h = x * 2
        return ReluInPlace.apply(h) + h  # eager: h is updated, so this is 2 * relu(h)


@pytest.mark.parametrize("module", [InPlaceOnIntermediate, InPlaceOnInput, InPlaceOnShared])
@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_in_place_update_with_mark_dirty(dynamo, module):
    model, x = module(), torch.randn(4, 3)
    proto = ortbridge.export(model, (x.clone(),), dynamo=dynamo)
    assert attributes(nodes(proto)[0])["tensor_reuse_map"] == [-1, 0]
    before = ortbridge._C.skipped_output_copies()
    feed = x.clone()
    assert_same(run(proto, feed), eager(model, x.clone()))
    assert torch.equal(feed, x)  # ORT's graph input is never written
    if module is InPlaceOnIntermediate:  # ORT gave the output the input's buffer: no copy at all
        assert ortbridge._C.skipped_output_copies() == before + 1


@ortbridge.register
class Stack2(torch.autograd.Function):
    """Output rows = 2 x input rows: no input dim has that size, so only infer_shape can say it."""

    @staticmethod
    def forward(ctx, x):
        return torch.cat([x, -x])

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError

    @staticmethod
    def infer_shape(node, tensor_input_shapes, tensor_input_dtypes):
        ((rows, cols),) = tensor_input_shapes
        return [[2 * rows, cols]], tensor_input_dtypes


def dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_symbolic_dims_survive_and_infer_shape_gives_exact_shapes(dynamo):
    class M(torch.nn.Module):
        def forward(self, x):
            values, _ = user_model.NumpyTopK.apply(x, 2)
            return values + 1, Stack2.apply(x)

    batch = torch.export.Dim("batch")
    proto = ortbridge.export(M(), (torch.randn(5, 4),), dynamic_shapes=({0: batch},), dynamo=dynamo)
    assert dims(proto.graph.input[0]) == ["batch", 4]
    if dynamo:  # TorchScript names the graph's output dims itself
        assert dims(proto.graph.output[0]) == ["batch", 2]  # matched to the input dim of the same size
        assert dims(proto.graph.output[1]) == ["2*batch", 4]  # from infer_shape
    for n in (1, 3, 8):
        x = torch.randn(n, 4)
        assert_same(run(proto, x), eager(M(), x))


@pytest.mark.parametrize("example_batch", [5, 1])
@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_dynamic_batch_exported_once_runs_at_several_sizes(dynamo, example_batch):
    net, x = user_model.example(batch=example_batch)
    proto = ortbridge.export(net, (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch")}}, dynamo=dynamo)
    assert dims(proto.graph.input[0]) == ["batch", 6]
    for n in (1, 2, 7, 33):
        x = torch.randn(n, 6)
        assert_same(run(proto, x), eager(net, x))


# -- hard cases ---------------------------------------------------------------------------------


class Twin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + 1

    @staticmethod
    def backward(ctx, g):
        return g


def _local_twin():
    class Twin(torch.autograd.Function):  # same class name, another scope
        @staticmethod
        def forward(ctx, x):
            return x * 10

        @staticmethod
        def backward(ctx, g):
            return g * 10

    return Twin


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_two_functions_with_the_same_class_name(dynamo):
    local = ortbridge.register(_local_twin())
    ortbridge.register(Twin)

    class M(torch.nn.Module):
        def forward(self, x):
            return local.apply(Twin.apply(x))

    try:
        x = torch.randn(3)
        proto = ortbridge.export(M(), (x,), dynamo=dynamo)
        names = [attributes(n)["func_name"].decode() for n in nodes(proto)]
        assert names == ["test_export.Twin", "test_export._local_twin.<locals>.Twin"]
        assert_same(run(proto, x), eager(M(), x))
    finally:
        ortbridge.unregister(local), ortbridge.unregister(Twin)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_unregistered_functions_are_traced_through_unless_all_functions(dynamo):
    class M(torch.nn.Module):
        def forward(self, x):
            return Twin.apply(x) * 2

    x = torch.randn(3)
    proto = ortbridge.export(M(), (x,), dynamo=dynamo)
    assert nodes(proto) == []  # torch traced Twin's forward into ordinary ONNX
    assert_same(run(proto, x), eager(M(), x))
    try:
        proto = ortbridge.export(M(), (x,), dynamo=dynamo, all_functions=True)
        assert [attributes(n)["func_name"] for n in nodes(proto)] == [b"test_export.Twin"]
        assert "test_export.Twin" in ortbridge.registered_names()  # so that this process can run it
        assert_same(run(proto, x), eager(M(), x))
    finally:
        ortbridge.unregister(Twin)


@ortbridge.register
class Outer(torch.autograd.Function):
    """Calls another registered Function inside forward: only the outer call becomes a node."""

    @staticmethod
    def forward(ctx, x):
        return Stack2.apply(x) + 1

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_function_calling_a_function_is_one_node(dynamo):
    class M(torch.nn.Module):
        def forward(self, x):
            return Outer.apply(x)

    x = torch.randn(2, 3)
    proto = ortbridge.export(M(), (x,), dynamo=dynamo)
    assert [attributes(n)["func_name"] for n in nodes(proto)] == [b"test_export.Outer"]
    assert_same(run(proto, x), eager(M(), x))


def test_export_leaves_functions_and_model_as_they_were():
    net, x = user_model.example()
    net.train()
    ortbridge.export(net, (x,))
    ortbridge.export(net, (x,), dynamo=False)
    assert net.training
    for cls in (user_model.BiasGelu, user_model.NumpyTopK, torch.autograd.Function):
        assert "symbolic" not in cls.__dict__
    assert "apply" not in user_model.BiasGelu.__dict__
    assert not torch_private.apply_routed()


# -- training export ----------------------------------------------------------------------------


def test_training_export_leaves_buffers_and_random_state_as_they_were():
    """ortbridge's eager run must not move BatchNorm statistics or the RNG (torch.export runs on
    fake tensors, so after the export the model is exactly as before)."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(3)
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x):
            return Twin.apply(self.drop(self.norm(x)))

    torch.manual_seed(0)
    model, x = M(), torch.randn(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    ortbridge.register(Twin)
    try:
        ortbridge.export(model, (x,), training=True)
    finally:
        ortbridge.unregister(Twin)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.random.get_rng_state())


@ortbridge.register
class WrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        return x * scale

    @staticmethod
    def backward(ctx, g):
        return g  # forward takes two arguments: needs (g, None)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_training_export_keeps_contexts_as_graph_outputs(dynamo):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return WrongBackward.apply(x * self.w, 2.0)

    model, x = M(), torch.randn(3)
    proto = ortbridge.export(model, (x,), training=True, dynamo=dynamo)
    assert model.training
    (node,) = nodes(proto)
    attrs = attributes(node)
    assert attrs["training_mode"] == 1 and attrs["input_requires_grads"] == [1, 0]
    assert proto.graph.output[-1].name == node.output[0]
    y, ctx = run(proto, x)
    np.testing.assert_allclose(y, (x * 2).numpy(), rtol=1e-6)
    assert ortbridge.context_pool_size() == 1
    ortbridge.release_context(int(ctx))

    # Its backward, run by PythonOpGrad in the same graph, returns too few values: the error says what to do.
    proto.graph.node.append(
        python_op_grad(
            WrongBackward,
            "dc",
            [("gy", onnx.TensorProto.FLOAT, 1)],
            [("gx", onnx.TensorProto.FLOAT, 1)],
            ctx_name=node.output[0],
        )
    )
    proto.graph.input.append(onnx.helper.make_tensor_value_info("gy", onnx.TensorProto.FLOAT, [3]))
    proto.graph.output.append(onnx.helper.make_tensor_value_info("gx", onnx.TensorProto.FLOAT, None))
    sess = ortbridge.InferenceSession(proto.SerializeToString())
    feeds = {sess.get_inputs()[0].name: x.numpy(), "gy": np.ones(3, np.float32)}
    with pytest.raises(
        RuntimeException,
        match=r"backward returned 1 values, but forward takes 2 arguments: return one "
        r"gradient \(or None\) per forward argument",
    ):
        sess.run(None, feeds)


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_tensor_inside_a_constant_is_refused_with_what_to_do(dynamo):
    class M(torch.nn.Module):
        def forward(self, x):
            return Probe.apply(x, [x, 1])

    with pytest.raises(
        ortbridge.ExportError,
        match=r"argument 1 of test_export.Probe.apply is a list that holds "
        r"tensors.*Pass each tensor as its own argument",
    ):
        ortbridge.export(M(), (torch.randn(2),), dynamo=dynamo)


def test_model_calling_differently_during_export_gets_our_error_not_torchs_fallback():
    class M(torch.nn.Module):
        calls = 0

        def forward(self, x):
            M.calls += 1  # the eager run and the export trace pass different constants
            return Filled.apply(2, float(M.calls)) + x

    with pytest.raises(ortbridge.ExportError, match="called during tracing with arguments it was not called with"):
        ortbridge.export(M(), (torch.randn(2),))
    M.calls = 0
    with pytest.raises(ortbridge.ExportError, match="the TorchScript trace called test_export.Filled where"):
        ortbridge.export(M(), (torch.randn(2),), dynamo=False)
    # A failed export leaves every Function as it was.
    assert "apply" not in Filled.__dict__ and "symbolic" not in Filled.__dict__
    assert Filled.__dict__["forward"] is Filled_forward
    assert not torch_private.apply_routed()


def test_constant_from_a_dynamic_dim_is_refused_with_what_to_do():
    class M(torch.nn.Module):
        def forward(self, x):
            return Probe.apply(x, x.shape[0])

    x = torch.randn(4, 2)
    assert nodes(ortbridge.export(M(), (x,)))  # a static shape: the size is a constant
    with pytest.raises(
        ortbridge.ExportError,
        match=r"argument 1 of test_export.Probe.apply depends on a dynamic dim"
        r".*Compute it inside forward",
    ):
        ortbridge.export(M(), (x,), dynamic_shapes=({0: "batch"},))


@ortbridge.register
class UpdatesWithoutReturning(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.add_(1)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


def test_in_place_update_not_returned_is_refused_with_what_to_do():
    class M(torch.nn.Module):
        def forward(self, x):
            return UpdatesWithoutReturning.apply(x * 1)

    with pytest.raises(
        ortbridge.ExportError,
        match=r"updated its tensor input 0 in place without returning it.*"
        r"Return that input \(with ctx.mark_dirty\)",
    ):
        ortbridge.export(M(), (torch.randn(2),))


@ortbridge.register
class ReturnsInt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + 1, 3

    @staticmethod
    def backward(ctx, g, h):
        raise NotImplementedError


def test_non_tensor_output_is_refused_with_what_to_do():
    class M(torch.nn.Module):
        def forward(self, x):
            return ReturnsInt.apply(x)[0]

    with pytest.raises(ortbridge.ExportError, match=r"ReturnsInt.forward output 1 is int.*Return tensors only"):
        ortbridge.export(M(), (torch.randn(2),))


class UntraceableUnregistered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x[: int(x.sum().item() > 0) + 1].clone()  # output shape depends on the data

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


def test_untraceable_unregistered_function_error_says_register_it():
    class M(torch.nn.Module):
        def forward(self, x):
            return UntraceableUnregistered.apply(x)

    with pytest.raises(Exception) as info:
        ortbridge.export(M(), (torch.randn(2),))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "test_export.UntraceableUnregistered" in notes and "ortbridge.register" in notes


def test_unregistered_function_in_a_saved_model_is_refused_with_what_to_do(tmp_path):
    net, x = user_model.example()
    proto = ortbridge.export(net, (x,))
    ortbridge.unregister(user_model.NumpyTopK)
    try:
        with pytest.raises(
            ortbridge.UnknownFunctionError,
            match=r"calls Function 'user_model.NumpyTopK', and no Function "
            r"is registered.*ortbridge.register\(YourFunction, "
            r"name='user_model.NumpyTopK'\)",
        ):
            run(proto, x)
    finally:
        ortbridge.register(user_model.NumpyTopK)
