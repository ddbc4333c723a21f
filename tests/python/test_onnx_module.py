"""Training an ONNX model from PyTorch (ortbridge.OnnxModule, OrtGradientForwardBackward) against
the torch module it was exported from: loss, every weight gradient and the weights after several
optimizer steps; ONNX Runtime runs forward and backward."""

from __future__ import annotations

import copy
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper

import ortbridge
from ortbridge.training.onnx_to_torch import ConversionError

nn = torch.nn


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x)


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3),
            nn.Tanh(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.features(x))


class Block(nn.Module):
    """A pre-norm transformer block: LayerNorm, multi-head attention, GELU MLP, residuals."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


@ortbridge.register
class ScaledTanh(torch.autograd.Function):
    """tanh(x) * scale with a hand-written backward: a custom Function inside the ONNX graph."""

    @staticmethod
    def forward(ctx, x, scale):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y * scale

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * ctx.scale * (1 - y * y), None


class WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 10), nn.Linear(10, 3)

    def forward(self, x):
        return self.b(ScaledTanh.apply(self.a(x), 1.5))


def export(model: nn.Module, example: torch.Tensor, dynamic: bool = False) -> bytes:
    f = io.BytesIO()
    dims = ({0: torch.export.Dim("batch", min=2)},) if dynamic else None
    ortbridge.export(model, (example,), f, dynamic_shapes=dims)
    return f.getvalue()


def weight_map(original: nn.Module, model: bytes) -> dict:
    """ONNX initializer name -> (torch parameter name, transposed) for each of the model's float
    initializers that is a torch parameter: torch's exporter folds a transpose of a weight into the
    initializer (named val_<k> then), so weights are matched by value; the other float
    initializers are constants of the graph (attention's scale)."""
    params = dict(original.named_parameters())
    found = {}
    for init in onnx.load_from_string(model).graph.initializer:
        if init.data_type != TP.FLOAT:
            continue
        w = torch.from_numpy(onnx.numpy_helper.to_array(init).copy())
        matches = [
            (p_name, t)
            for p_name, p in params.items()
            for t in ((False, True) if p.dim() == 2 else (False,))
            if (p.t() if t else p).shape == w.shape and torch.equal((p.t() if t else p).detach(), w)
        ]
        assert len(matches) <= 1, f"ONNX weight {init.name} matches torch parameters {matches}"
        if matches:
            found[init.name] = matches[0]
    assert sorted(p for p, _ in found.values()) == sorted(params), "every torch parameter is an ONNX weight"
    return found


def train_against_torch(
    original: nn.Module,
    module: ortbridge.OnnxModule,
    mapping: dict,
    batches,
    steps: int = 3,
    rtol: float = 1e-4,
    atol: float = 1e-5,
):
    """Trains the torch original and the OnnxModule side by side with SGD (AdamW would turn the
    rounding noise of attention's key-bias gradient, zero in exact arithmetic, into steps); after every step
    loss and every weight gradient agree (`mapping`: weight_map's), and no context is left; then
    the weights."""
    params = dict(original.named_parameters())
    assert sorted(n for n, _ in module.named_parameters()) == sorted(mapping)

    def torch_side(name, value_of):
        p_name, transposed = mapping[name]
        v = value_of(params[p_name])
        return v.t() if transposed else v

    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (original, module)]
    for step in range(steps):
        x, target = batches(step)
        losses = []
        for m in (original, module):
            loss = nn.functional.mse_loss(m(x), target)
            loss.backward()
            losses.append(loss)
        assert ortbridge.context_pool_size() == 0
        torch.testing.assert_close(losses[1], losses[0], rtol=rtol, atol=atol)
        for name, p in module.named_parameters():
            torch.testing.assert_close(
                p.grad,
                torch_side(name, lambda q: q.grad),
                rtol=rtol,
                atol=atol,
                msg=lambda m, name=name: f"step {step}: {name}.grad: {m}",
            )
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for name, p in module.named_parameters():
        torch.testing.assert_close(
            p, torch_side(name, lambda q: q), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


def batches(shape, outputs):
    def make(step):
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(*shape, generator=g), torch.randn(shape[0], *outputs, generator=g)

    return make


@pytest.mark.parametrize(
    "name, model, shape, outputs",
    [
        ("mlp", Mlp, (4, 8), (4,)),
        ("cnn", Cnn, (2, 3, 12, 12), (5,)),
        ("block", Block, (2, 5, 16), (5, 16)),
        ("function", WithFunction, (4, 6), (3,)),
    ],
)
def test_exported_model_trains_like_its_torch_original(name, model, shape, outputs):
    torch.manual_seed(0)
    original = model()
    with torch.no_grad():  # no two weights alike (the exporter would tie them: LayerNorm's start as ones)
        for p in original.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = export(copy.deepcopy(original).eval(), torch.randn(*shape))
    mapping = weight_map(original, model)
    trained = None if name != "block" else list(mapping)  # (the default: every float initializer)
    module = ortbridge.OnnxModule(model, weights_to_train=trained)
    train_against_torch(original, module, mapping, batches(shape, outputs))
    if name == "function":  # the Function ran as a PythonOp pair in the graphs ORT ran
        assert {"PythonOp", "PythonOpGrad"} <= graph_ops(module.forward_backward)


def graph_ops(fb: ortbridge.OrtGradientForwardBackward) -> set:
    """The operators of the training graphs ONNX Runtime ran."""
    if fb.gradient_builder == "onnxruntime-training":
        return {n.op_type for n in fb._engine.gradient_model.graph.node}
    return {
        n.op_type
        for captures in fb._engine.runner._captures.values()
        for capture in captures
        for session in capture.sessions
        for n in session.model.graph.node
    }


def test_auto_takes_the_gradient_builder_this_onnxruntime_has():
    fb = ortbridge.OrtGradientForwardBackward(export(Mlp(), torch.randn(2, 8)))
    training_build = hasattr(ort.capi._pybind_state, "OrtModuleGraphBuilder")
    assert fb.gradient_builder == ("onnxruntime-training" if training_build else "torch")
    if not training_build:
        with pytest.raises(RuntimeError, match="needs onnxruntime-training installed"):
            ortbridge.OrtGradientForwardBackward(
                export(Mlp(), torch.randn(2, 8)), gradient_builder="onnxruntime-training"
            )


def test_dynamic_batch_inputs_needing_gradients_and_eval_without_contexts():
    torch.manual_seed(1)
    original = Mlp()
    module = ortbridge.OnnxModule(export(copy.deepcopy(original), torch.randn(3, 8), dynamic=True))
    for batch in (3, 7):
        x = torch.randn(batch, 8, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        module(x).sum().backward()
        original(xe).sum().backward()
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        y = module(torch.randn(5, 8))
        assert ortbridge.context_pool_size() == 0 and not y.requires_grad


def _graph_two_in_two_out() -> bytes:
    """y = relu(a @ w) + b; n = argmax(y) (int64, no gradient)."""
    w = onnx.numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 10 - 0.5, "w")
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["m"]),
        helper.make_node("Relu", ["m"], ["r"]),
        helper.make_node("Add", ["r", "b"], ["y"]),
        helper.make_node("ArgMax", ["y"], ["n"], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", TP.FLOAT, [None, 3]), helper.make_tensor_value_info("b", TP.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TP.FLOAT, [None, 4]), helper.make_tensor_value_info("n", TP.INT64, [None])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def test_several_inputs_and_outputs_one_without_gradient():
    module = ortbridge.OnnxModule(_graph_two_in_two_out())
    assert module.input_names == ["a", "b"] and module.output_names == ["y", "n"]
    assert [n for n, _ in module.named_parameters()] == ["w"] and list(module.state_dict()) == ["w"]
    a, b = torch.randn(5, 3, requires_grad=True), torch.randn(4, requires_grad=True)
    y, n = module(a, b)
    assert n.dtype == torch.int64 and not n.requires_grad
    y.sum().backward()
    w = module.state_dict()["w"].clone().requires_grad_()
    ae, be = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ye = torch.relu(ae @ w) + be
    ye.sum().backward()
    torch.testing.assert_close(y, ye)
    torch.testing.assert_close(n, ye.argmax(1))
    for got, want in ((a.grad, ae.grad), (b.grad, be.grad), (dict(module.named_parameters())["w"].grad, w.grad)):
        torch.testing.assert_close(got, want)


def test_frozen_weights_and_trained_weights_saved_back_to_onnx(tmp_path):
    torch.manual_seed(2)
    model = export(Mlp(), torch.randn(4, 8))
    module = ortbridge.OnnxModule(model, weights_to_train=["net.2.weight", "net.2.bias"])
    assert sorted(n for n, _ in module.named_parameters()) == ["net.2.bias", "net.2.weight"]
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for _ in range(2):
        module(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    saved = module.to_onnx(tmp_path / "trained.onnx")
    (expected,) = ort.InferenceSession(saved.SerializeToString()).run(None, {module.input_names[0]: x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(module(x).numpy(), expected, rtol=1e-5, atol=1e-6)
    frozen = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(tmp_path / "trained.onnx").graph.initializer}
    original = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load_from_string(model).graph.initializer}
    np.testing.assert_array_equal(frozen["net.0.weight"], original["net.0.weight"])
    assert not np.array_equal(frozen["net.2.weight"], original["net.2.weight"])
    state = module.state_dict()
    fresh = ortbridge.OnnxModule(model, weights_to_train=["net.2.weight", "net.2.bias"])
    fresh.load_state_dict(state)
    torch.testing.assert_close(dict(fresh.named_parameters())["net.2.weight"], state["net.2.weight"])


def test_ort_gradient_forward_backward_matches_torch_autograd():
    torch.manual_seed(3)
    original = Mlp()
    fb = ortbridge.OrtGradientForwardBackward(export(copy.deepcopy(original), torch.randn(4, 8)))
    assert fb.weights_to_train == [n for n, _ in original.named_parameters()]
    weights = fb.weights()
    x = torch.randn(4, 8)
    instance = fb.new_instance()
    (y,) = instance.forward([x, *weights], training=True)
    grads = instance.backward([torch.ones_like(y)])
    xe = x.clone().requires_grad_()
    original(xe).sum().backward()
    torch.testing.assert_close(grads[0], xe.grad)
    for g, (name, p) in zip(grads[1:], original.named_parameters()):
        torch.testing.assert_close(g, p.grad, msg=lambda m, name=name: f"{name}: {m}")
    with pytest.raises(RuntimeError, match="backward needs a forward with training=True"):
        instance.backward([torch.ones_like(y)])
    (y_eval,) = fb.new_instance().forward([x, *weights])
    torch.testing.assert_close(y_eval, y)
    assert ortbridge.context_pool_size() == 0

    # .apply: a torch.autograd.Function, in a graph of torch's
    ws = [w.clone().requires_grad_() for w in weights]
    xa = x.clone().requires_grad_()
    (fb.apply(xa, *ws) * 2).sum().backward()
    torch.testing.assert_close(xa.grad, xe.grad * 2)
    torch.testing.assert_close(ws[0].grad, original.net[0].weight.grad * 2)


def _one_node_model(node: onnx.NodeProto, **graph_extra) -> bytes:
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)],
        **graph_extra,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("other", 1)], ir_version=8
    ).SerializeToString()


def test_an_operator_without_a_gradient_is_named():
    with pytest.raises(ConversionError, match=r"node 0 \('odd', other::Frobnicate\) has no torch form here"):
        ortbridge.OnnxModule(
            _one_node_model(helper.make_node("Frobnicate", ["x"], ["y"], domain="other", name="odd")),
            gradient_builder="torch",
        )
    with pytest.raises(ConversionError, match=r"node 0 \(Det\) has no torch form"):
        ortbridge.OnnxModule(_one_node_model(helper.make_node("Det", ["x"], ["y"])), gradient_builder="torch")


@pytest.mark.skipif(
    not hasattr(ort.capi._pybind_state, "OrtModuleGraphBuilder"),
    reason="needs onnxruntime-training (scripts/test.sh runs this file with it)",
)
def test_onnxruntime_training_names_an_operator_it_cannot_build():
    with pytest.raises(RuntimeError, match=r"gradient builder refused the graph: .*other:Frobnicate"):
        ortbridge.OnnxModule(_one_node_model(helper.make_node("Frobnicate", ["x"], ["y"], domain="other")))


def test_subgraphs_are_refused_with_the_reason():
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])], "b", [], [helper.make_tensor_value_info("z", TP.FLOAT, [2])]
    )
    node = helper.make_node("If", ["c"], ["y"], name="choice", then_branch=branch, else_branch=branch)
    c = onnx.numpy_helper.from_array(np.array(True), "c")
    with pytest.raises(ConversionError, match=r"node 0 \('choice', If\) holds a subgraph"):
        ortbridge.OnnxModule(_one_node_model(node, initializer=[c]), gradient_builder="torch")


def test_a_value_ort_computes_from_tensors_cannot_be_a_shape():
    nodes = [helper.make_node("Cast", ["x"], ["s"], to=TP.INT64), helper.make_node("Reshape", ["x", "s"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)],
    )
    module = ortbridge.OnnxModule(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), gradient_builder="torch"
    )
    with pytest.raises(Exception, match="input 1 of this Reshape .* must come from constants and shapes"):
        module(torch.tensor([2.0, 1.0], requires_grad=True))
