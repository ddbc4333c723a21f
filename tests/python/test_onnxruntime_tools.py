"""ONNX Runtime's own Python tools on exported files, inside ortbridge.onnxruntime_tools(): symbolic
shape inference, quant_pre_process, quantize_dynamic, quantize_static (whose calibrator makes its
own sessions) and the .ort converter; each on a model with a Function and one with a custom op."""

import pathlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_dynamic, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process
from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

import ortbridge

nn = torch.nn
ortbridge.allow_operators("ort_tools")


@torch.library.custom_op("ort_tools::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor) -> torch.Tensor:
    return x.tanh() * 3


@soft_clip.register_fake
def _(x):
    return torch.empty_like(x)


class Softsign(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x / (1 + x.abs())

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


class WithShape(Softsign):
    """A Function that states its output shapes (ORT's infer_shape signature)."""

    @staticmethod
    def infer_shape(node, input_shapes, input_dtypes):
        return [input_shapes[0]], [input_dtypes[0]]


for cls in (Softsign, WithShape):
    ortbridge.register(cls)

KERNELS = {
    "function": Softsign.apply,
    "function_with_shapes": WithShape.apply,
    "custom_op": torch.ops.ort_tools.soft_clip,
}


class Model(nn.Module):
    def __init__(self, kernel):
        super().__init__()
        torch.manual_seed(0)
        self.kernel = kernel
        self.first, self.last = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.last(self.kernel(self.first(x)))


@pytest.fixture(params=list(KERNELS))
def exported(request, tmp_path):
    model = Model(KERNELS[request.param]).eval()
    path = tmp_path / "model.onnx"
    ortbridge.export(
        model, (torch.randn(2, 8),), path, dynamic_shapes=({0: "batch"},), input_names=["x"], output_names=["y"]
    )
    return model, path, request.param


def _run(path, x: torch.Tensor) -> np.ndarray:
    session = ortbridge.InferenceSession(str(path))
    return session.run(None, {"x": x.numpy()})[0]


def test_symbolic_shape_inference(exported):
    model, path, kind = exported
    with ortbridge.onnxruntime_tools():
        inferred = SymbolicShapeInference.infer_shapes(onnx.load(path), auto_merge=True)
    node = next(n for n in inferred.graph.node if n.domain == "ortbridge")
    values = {v.name: v.type.tensor_type for v in inferred.graph.value_info}
    out = values[node.output[1]]
    assert out.elem_type == onnx.TensorProto.FLOAT and len(out.shape.dim) == 2
    if kind == "function_with_shapes":  # (its infer_shape: the input's dims, batch symbol included)
        assert [d.dim_param or d.dim_value for d in out.shape.dim] == ["batch", 16]
    y = {o.name: o.type.tensor_type for o in inferred.graph.output}["y"]
    assert y.elem_type == onnx.TensorProto.FLOAT and y.shape.dim[1].dim_value == 4


def test_quantization(exported, tmp_path):
    model, path, kind = exported
    x = torch.randn(16, 8)
    expected = model(x).detach().numpy()

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": x[i : i + 4].numpy()} for i in range(0, 16, 4)])

        def get_next(self):
            return next(self.batches, None)

    # (uint8 weights: on a CPU without VNNI (AVX2 only) ONNX Runtime's uint8 x int8 MatMulInteger
    # saturates 16-bit partial sums, 0.2 off here with or without ortbridge; uint8 x uint8 does not)
    with ortbridge.onnxruntime_tools():
        quant_pre_process(str(path), str(tmp_path / "pre.onnx"))
        quantize_dynamic(tmp_path / "pre.onnx", tmp_path / "dynamic.onnx", weight_type=QuantType.QUInt8)
        quantize_static(
            tmp_path / "pre.onnx",
            tmp_path / "static.onnx",
            Batches(),
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QUInt8,
        )
    for name in ("pre", "dynamic", "static"):
        got = _run(tmp_path / f"{name}.onnx", x)
        # (8-bit weights and activations: within a few hundredths of the float model's outputs)
        np.testing.assert_allclose(got, expected, atol=1e-5 if name == "pre" else 0.1, err_msg=name)
    static = onnx.load(tmp_path / "static.onnx")
    assert {"QuantizeLinear", "PythonOp"} <= {n.op_type for n in static.graph.node}


def test_ort_format_converter(exported):
    from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    model, path, kind = exported
    with ortbridge.onnxruntime_tools():
        convert_onnx_models_to_ort(
            path,
            optimization_styles=[OptimizationStyle.Fixed],
            custom_op_library_path=pathlib.Path(ortbridge.library_path()),
        )
    (converted,) = path.parent.glob("*.ort")
    x = torch.randn(5, 8)
    np.testing.assert_allclose(_run(converted, x), model(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_tools_are_as_they_were_after_it(exported):
    """Outside the context, ORT's classes are its own: a plain session does not get the kernels."""
    model, path, kind = exported
    create = ort.InferenceSession._create_inference_session
    with ortbridge.onnxruntime_tools():
        ort.InferenceSession(str(path))
    assert ort.InferenceSession._create_inference_session is create
    with pytest.raises(Exception, match="PythonOp"):
        ort.InferenceSession(str(path))
    with pytest.raises(ImportError):  # (ORT's own PythonOp handler, of its training build)
        SymbolicShapeInference.infer_shapes(onnx.load(path), auto_merge=True)
