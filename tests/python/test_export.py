"""ortbridge.export: registered Functions become PythonOp nodes; the model runs in ORT with
outputs matching eager PyTorch."""

import numpy as np
import onnx
import pytest
import torch

import ortbridge


@ortbridge.register
class Gelu(torch.autograd.Function):
    seen_alpha = []

    @staticmethod
    def forward(ctx, x, alpha):
        Gelu.seen_alpha.append(alpha)
        ctx.save_for_backward(x)
        return x * torch.sigmoid(alpha * x)

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


@ortbridge.register
class Mixed(torch.autograd.Function):
    """A constant first, a tensor in the middle, then bool, int, tuple; two outputs of two dtypes."""

    @staticmethod
    def forward(ctx, scale, x, flip, shift, window):
        y = (-x if flip else x) * scale + shift
        return y, torch.tensor(window, dtype=torch.int64).sum().expand(x.shape[0])

    @staticmethod
    def backward(ctx, gy, gw):
        raise NotImplementedError


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 4)

    def forward(self, x):
        h = Gelu.apply(self.linear(x), 1.702)
        y, w = Mixed.apply(0.1, h, True, 3, (1, 2, 3))
        return Gelu.apply(y, 0.5) * w.unsqueeze(1).to(y.dtype)


def run(proto, *inputs):
    sess = ortbridge.InferenceSession(proto.SerializeToString())
    return sess.run(None, {i.name: x.numpy() for i, x in zip(sess.get_inputs(), inputs)})


def test_export_matches_eager(tmp_path):
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(3, 5)
    path = tmp_path / "net.onnx"
    proto = ortbridge.export(net, (x,), path)
    assert path.exists()
    nodes = [n for n in proto.graph.node if n.domain == "ortbridge"]
    assert [n.op_type for n in nodes] == ["PythonOp"] * 3
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[1].attribute}
    assert attrs["func_name"] == b"test_export.Mixed"
    assert attrs["input_convention"] == b"cdccc"
    assert attrs["training_mode"] == 0
    (got,) = run(onnx.load(path), x)
    with torch.no_grad():
        expected = net(x).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_float_constants_keep_float64_precision():
    class M(torch.nn.Module):
        def forward(self, x):
            return Gelu.apply(x, 0.1)

    proto = ortbridge.export(M(), (torch.ones(2),))
    Gelu.seen_alpha.clear()
    run(proto, torch.ones(2))
    assert Gelu.seen_alpha == [0.1]  # ORT's FLOATS attribute alone would give 0.10000000149011612


def test_unsupported_argument_is_named():
    class M(torch.nn.Module):
        def forward(self, x):
            return Gelu.apply(x, "fast")

    with pytest.raises(TypeError, match=r"argument 1 of test_export.Gelu.apply is str"):
        ortbridge.export(M(), (torch.ones(2),))


def test_export_leaves_functions_as_they_were():
    ortbridge.register(Gelu, name="test_export.GeluAlias")  # one class under two names
    try:
        class M(torch.nn.Module):
            def forward(self, x):
                return Gelu.apply(x, 1.0)

        ortbridge.export(M(), (torch.ones(2),))
        assert "apply" not in Gelu.__dict__  # the inherited Function.apply again
        assert Gelu.apply(torch.ones(2), 1.0).shape == (2,)
    finally:
        ortbridge.unregister("test_export.GeluAlias")
        ortbridge.register(Gelu)
