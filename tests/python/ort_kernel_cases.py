"""The cases of the ONNX Runtime kernel audit (test_ort_kernel_audit.py): for each kind of ONNX
node the package's graphs contain, inputs that stress its kernel (repeated indices, large
reductions, empty and broadcast shapes, sizes that ONNX Runtime splits among its threads) and
PyTorch's result on them. conftest.py checks that every kind of node a test session's graphs
contain has a case here. Imported by the tests as a top-level module (as they import conftest)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import onnx
import torch
import torch.nn.functional as F
from onnx import helper

from ortbridge._compat.torch_private import onnx_opsets
from ortbridge._format import dtypes

# The attributes that choose what a kernel computes, beyond its operator (ScatterND's reduction,
# Pad's mode): one kind of node per value, each audited.
KIND_ATTRIBUTES = ("reduction", "mode")


def kind(node: onnx.NodeProto) -> str:
    """What the audit covers of a node: its operator, and the KIND_ATTRIBUTES it sets."""
    chosen = [
        f"{a.name}={helper.get_attribute_value(a).decode()}"
        for a in node.attribute
        if a.name in KIND_ATTRIBUTES and a.type == onnx.AttributeProto.STRING
    ]
    return f"{node.op_type}({', '.join(chosen)})" if chosen else node.op_type


@dataclasses.dataclass(frozen=True)
class Case:
    """One node of `op_type` with `attributes` on the tensors `inputs()` makes (None: an optional
    input left out; a tuple of tensors: a variadic input), whose outputs must equal
    `expected(*inputs)` (a tensor or a tuple): floating-point ones within `tolerance` of the
    largest magnitude, others exactly."""

    op_type: str
    stress: str
    inputs: Callable[[], tuple]
    expected: Callable
    attributes: dict = dataclasses.field(default_factory=dict)
    tolerance: float = 1e-5

    def __str__(self) -> str:
        return f"{self.op_type}-{self.stress}"

    def node(self, inputs: list[str], outputs: list[str]) -> onnx.NodeProto:
        return helper.make_node(self.op_type, inputs, outputs, name=str(self), **self.attributes)

    def model(self, tensors: list, expected: list) -> onnx.ModelProto:
        """The node alone as a model of `tensors` (the flattened inputs) and `expected`'s types."""
        names, graph_inputs = [], []
        for t in tensors:
            if t is None:
                names.append("")
                continue
            names.append(f"input_{len(graph_inputs)}")
            graph_inputs.append(helper.make_tensor_value_info(names[-1], dtypes.onnx_type(t.dtype), list(t.shape)))
        outputs = [
            helper.make_tensor_value_info(f"output_{k}", dtypes.onnx_type(e.dtype), None)
            for k, e in enumerate(expected)
        ]
        graph = helper.make_graph([self.node(names, [o.name for o in outputs])], "audit", graph_inputs, outputs)
        # (the opset the package's graphs have; IR version 9, which every supported ONNX Runtime reads)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)


OPSET = onnx_opsets(None)[0]
CASES: list[Case] = []


def _seeded(make: Callable[[torch.Generator], tuple]) -> Callable[[], tuple]:
    def inputs():
        return make(torch.Generator().manual_seed(0))

    return inputs


def case(op_type: str, stress: str, make, expected, tolerance: float = 1e-5, **attributes) -> None:
    """Adds a case; `make(generator)` gives its inputs."""
    CASES.append(Case(op_type, stress, _seeded(make), expected, attributes, tolerance))


def randn(g, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def randint(g, high: int, *shape, low: int = 0) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=g)


def ints(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


LARGE = (512, 1024)  # (about half a million elements: large enough that ONNX Runtime splits the work)


# --- elementwise ---------------------------------------------------------------------------------

UNARY = {
    "Abs": torch.abs,
    "Ceil": torch.ceil,
    "Cos": torch.cos,
    "Erf": torch.erf,
    "Exp": torch.exp,
    "Floor": torch.floor,
    "Identity": lambda x: x,
    "Neg": torch.neg,
    "Reciprocal": torch.reciprocal,
    "Relu": torch.relu,
    "Round": torch.round,  # (half to even, both)
    "Sigmoid": torch.sigmoid,
    "Sign": torch.sign,
    "Sin": torch.sin,
    "Softplus": F.softplus,
    "Tanh": torch.tanh,
}
for _op, _f in UNARY.items():
    case(_op, "large", lambda g: (randn(g, *LARGE) * 3,), _f)
    case(_op, "empty", lambda g: (randn(g, 0, 7),), _f)
# Of positive inputs only, or with their own domain.
for _op, _f in {"Sqrt": torch.sqrt, "Log": torch.log}.items():
    case(_op, "large", lambda g: (randn(g, *LARGE).abs() + 0.01,), _f)
    case(_op, "empty", lambda g: (randn(g, 0, 7).abs(),), _f)
case("Not", "large", lambda g: (randn(g, *LARGE) > 0,), torch.logical_not)
case("IsNaN", "large", lambda g: (torch.where(randn(g, *LARGE) > 1, math.nan, 1.0),), torch.isnan)
case("IsInf", "large", lambda g: (torch.where(randn(g, *LARGE) > 1, -math.inf, 1.0),), torch.isinf)
case("Gelu", "large", lambda g: (randn(g, *LARGE) * 3,), F.gelu)
case("Gelu", "tanh", lambda g: (randn(g, *LARGE) * 3,), lambda x: F.gelu(x, approximate="tanh"), approximate="tanh")
case("Elu", "large", lambda g: (randn(g, *LARGE) * 3,), lambda x: F.elu(x, 0.5), alpha=0.5)
case("LeakyRelu", "large", lambda g: (randn(g, *LARGE) * 3,), lambda x: F.leaky_relu(x, 0.1), alpha=0.1)
case("HardSigmoid", "large", lambda g: (randn(g, *LARGE) * 5,), F.hardsigmoid, alpha=1 / 6, beta=0.5)
case("HardSwish", "large", lambda g: (randn(g, *LARGE) * 5,), F.hardswish)
case(
    "Clip",
    "large",
    lambda g: (randn(g, *LARGE) * 3, torch.tensor(-1.0), torch.tensor(2.0)),
    torch.clamp,
)
case("Clip", "min only", lambda g: (randn(g, *LARGE) * 3, torch.tensor(-1.0)), lambda x, lo: x.clamp(min=lo))
for _to, _dtype in (
    (onnx.TensorProto.FLOAT16, torch.float16),
    (onnx.TensorProto.INT64, torch.int64),
    (onnx.TensorProto.BOOL, torch.bool),
):
    case("Cast", f"to {_dtype}", lambda g: (randn(g, *LARGE) * 100,), lambda x, d=_dtype: x.to(d), to=_to)
case(
    "CastLike",
    "to float16",
    lambda g: (randn(g, *LARGE) * 100, torch.zeros(1, dtype=torch.float16)),
    lambda x, t: x.half(),
)
case("Dropout", "inference", lambda g: (randn(g, *LARGE),), lambda x: x)  # (not training: the identity)
case(
    "Cast", "to float", lambda g: (randint(g, 1000, *LARGE, low=-1000),), lambda x: x.float(), to=onnx.TensorProto.FLOAT
)

# Two inputs (three for Where), broadcast against each other, large and empty.
BINARY = {
    "Add": torch.add,
    "Sub": torch.sub,
    "Mul": torch.mul,
    "Max": torch.maximum,
    "Min": torch.minimum,
    "Equal": torch.eq,
    "Greater": torch.gt,
    "GreaterOrEqual": torch.ge,
    "Less": torch.lt,
    "LessOrEqual": torch.le,
}
for _op, _f in BINARY.items():
    case(_op, "broadcast", lambda g: (randn(g, 256, 1, 64), randn(g, 1, 128, 64)), _f)
    case(_op, "scalar", lambda g: (randn(g, *LARGE), randn(g)), _f)
    case(_op, "empty", lambda g: (randn(g, 0, 5), randn(g, 1, 5)), _f)
case("Div", "broadcast", lambda g: (randn(g, 256, 1, 64), randn(g, 1, 128, 64).abs() + 0.5), torch.div)
case(
    "Div",
    "integers",
    lambda g: (randint(g, 100, *LARGE, low=-100), randint(g, 9, 1024, low=1)),
    lambda a, b: torch.div(a, b, rounding_mode="trunc"),
)
case("Pow", "broadcast", lambda g: (randn(g, 256, 1, 64).abs(), randn(g, 1, 128, 64)), torch.pow, tolerance=1e-4)
case("Mod", "integers", lambda g: (randint(g, 100, *LARGE, low=-100), randint(g, 9, 1024, low=1)), torch.remainder)
case("Mod", "floats", lambda g: (randn(g, *LARGE) * 10, randn(g, 1024).abs() + 1), torch.fmod, fmod=1)
for _op, _f in {"And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor}.items():
    case(_op, "broadcast", lambda g: (randn(g, 256, 1, 64) > 0, randn(g, 1, 128, 64) > 0), _f)
case("Where", "broadcast", lambda g: (randn(g, 256, 1, 64) > 0, randn(g, 1, 128, 64), randn(g, 64)), torch.where)
case("Where", "empty", lambda g: (randn(g, 0, 5) > 0, randn(g, 0, 5), randn(g)), torch.where)
case(
    "Sum",
    "three",
    lambda g: ((randn(g, 256, 1, 64), randn(g, 1, 128, 64), randn(g, 64)),),
    lambda xs: xs[0] + xs[1] + xs[2],
)
case(
    "PRelu", "broadcast", lambda g: (randn(g, 64, 32, 256), randn(g, 32, 1)), lambda x, s: torch.where(x >= 0, x, x * s)
)


# --- reductions ----------------------------------------------------------------------------------


def _in_float64(f):
    """f computed in float64 on float inputs, its result back in their type: the exact reference
    for a large reduction."""

    def exact(x, *rest):
        return f(x.double(), *rest).to(x.dtype) if x.is_floating_point() else f(x, *rest)

    return exact


REDUCTIONS = {
    "ReduceSum": lambda x, d, k: x.sum(d, keepdim=k),
    "ReduceMean": lambda x, d, k: x.mean(d, keepdim=k),
    "ReduceMax": lambda x, d, k: x.amax(d, keepdim=k),
    "ReduceMin": lambda x, d, k: x.amin(d, keepdim=k),
    "ReduceL2": lambda x, d, k: x.square().sum(d, keepdim=k).sqrt(),
    "ReduceSumSquare": lambda x, d, k: x.square().sum(d, keepdim=k),
    "ReduceLogSumExp": lambda x, d, k: x.logsumexp(d, keepdim=k),
}
for _op, _f in REDUCTIONS.items():
    _f = _in_float64(_f)
    case(_op, "all", lambda g: (randn(g, 1024, 1024), ints(0, 1)), lambda x, a, f=_f: f(x, (0, 1), False), keepdims=0)
    case(_op, "inner", lambda g: (randn(g, 64, 64, 256), ints(-1)), lambda x, a, f=_f: f(x, (-1,), True))
    case(_op, "outer", lambda g: (randn(g, 4096, 256), ints(0)), lambda x, a, f=_f: f(x, (0,), True))
    case(_op, "middle", lambda g: (randn(g, 64, 512, 32), ints(1)), lambda x, a, f=_f: f(x, (1,), False), keepdims=0)
case("ReduceSum", "empty", lambda g: (randn(g, 0, 5), ints(0)), lambda x, a: x.sum(0, keepdim=True))
case("ReduceSum", "integers", lambda g: (randint(g, 100, 4096, 256), ints(0)), lambda x, a: x.sum(0, keepdim=True))
case(
    "ReduceProd",
    "inner",
    lambda g: (1 + randn(g, 64, 64, 256) / 100, ints(-1)),
    _in_float64(lambda x, a: x.prod(-1, keepdim=True)),
)
for _op, _f in {"ArgMax": torch.argmax, "ArgMin": torch.argmin}.items():
    # (ties: repeated values, of which both take the first)
    case(_op, "ties", lambda g: (randint(g, 5, 1024, 512).float(),), lambda x, f=_f: f(x, 1, keepdim=True), axis=1)
    case(_op, "outer", lambda g: (randn(g, 4096, 256),), lambda x, f=_f: f(x, 0), axis=0, keepdims=0)
case(
    "CumSum",
    "long",
    lambda g: (randn(g, 64, 4096), torch.tensor(1)),
    _in_float64(lambda x, a: x.cumsum(1)),
    tolerance=1e-4,
)


# --- normalization, softmax, matrix products -----------------------------------------------------

for _op, _f in {"Softmax": torch.softmax, "LogSoftmax": torch.log_softmax}.items():
    case(_op, "rows", lambda g: (randn(g, 4096, 512) * 5,), lambda x, f=_f: f(x, -1), axis=-1)
    case(_op, "columns", lambda g: (randn(g, 512, 4096) * 5,), lambda x, f=_f: f(x, 0), axis=0)
    case(
        _op,
        "masked rows",
        lambda g: (randn(g, 512, 512).masked_fill(randn(g, 512, 512) > 1, -math.inf),),
        lambda x, f=_f: f(x, -1),
        axis=-1,
    )
case(
    "LayerNormalization",
    "large",
    lambda g: (randn(g, 64, 128, 256) * 4 + 2, randn(g, 256), randn(g, 256)),
    lambda x, w, b: F.layer_norm(x, (256,), w, b, 1e-5),
    tolerance=1e-4,
    axis=-1,
    epsilon=1e-5,
)
case(
    "InstanceNormalization",
    "large",
    lambda g: (randn(g, 16, 64, 32, 32) * 4 + 2, randn(g, 64), randn(g, 64)),
    lambda x, w, b: F.instance_norm(x, weight=w, bias=b, eps=1e-5),
    tolerance=1e-4,
    epsilon=1e-5,
)
case(
    "BatchNormalization",
    "inference",
    lambda g: (randn(g, 32, 64, 32, 32), randn(g, 64), randn(g, 64), randn(g, 64), randn(g, 64).abs() + 0.5),
    lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b, False, 0.1, 1e-5),
    tolerance=1e-4,
    epsilon=1e-5,
)
case("MatMul", "long inner dim", lambda g: (randn(g, 256, 8192), randn(g, 8192, 256)), torch.matmul, tolerance=1e-4)
case(
    "MatMul",
    "batched broadcast",
    lambda g: (randn(g, 16, 1, 128, 64), randn(g, 8, 64, 128)),
    torch.matmul,
    tolerance=1e-4,
)
case("MatMul", "empty inner dim", lambda g: (randn(g, 64, 0), randn(g, 0, 32)), torch.matmul)
case("MatMul", "vector", lambda g: (randn(g, 4096), randn(g, 4096, 512)), torch.matmul, tolerance=1e-4)
case(
    "Gemm",
    "transposed",
    lambda g: (randn(g, 512, 1024), randn(g, 256, 1024), randn(g, 256)),
    lambda a, b, c: 0.5 * a @ b.T + 2.0 * c,
    tolerance=1e-4,
    transB=1,
    alpha=0.5,
    beta=2.0,
)
case(
    "Einsum",
    "batched",
    lambda g: ((randn(g, 32, 64, 128), randn(g, 32, 128, 64)),),
    lambda xs: torch.einsum("bij,bjk->bik", *xs),
    tolerance=1e-4,
    equation="bij,bjk->bik",
)


# --- convolutions, pooling, resizing --------------------------------------------------------------

case(
    "Conv",
    "strided, grouped",
    lambda g: (randn(g, 8, 32, 64, 64), randn(g, 64, 8, 3, 3), randn(g, 64)),
    lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, groups=4),
    tolerance=1e-4,
    strides=[2, 2],
    pads=[1, 1, 1, 1],
    group=4,
)
case(
    "Conv",
    "depthwise",
    lambda g: (randn(g, 8, 64, 32, 32), randn(g, 64, 1, 5, 5)),
    lambda x, w: F.conv2d(x, w, padding=2, groups=64),
    tolerance=1e-4,
    pads=[2, 2, 2, 2],
    group=64,
)
case(
    "ConvTranspose",
    "strided",
    lambda g: (randn(g, 8, 32, 32, 32), randn(g, 32, 16, 4, 4), randn(g, 16)),
    lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1),
    tolerance=1e-4,
    strides=[2, 2],
    pads=[1, 1, 1, 1],
)
case(
    "MaxPool",
    "overlapping",
    lambda g: (randn(g, 16, 32, 64, 64),),
    lambda x: F.max_pool2d(x, 3, 2, 1),
    kernel_shape=[3, 3],
    strides=[2, 2],
    pads=[1, 1, 1, 1],
)
case(
    "AveragePool",
    "padded",
    lambda g: (randn(g, 16, 32, 64, 64),),
    lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
    kernel_shape=[3, 3],
    strides=[2, 2],
    pads=[1, 1, 1, 1],
    count_include_pad=0,
)
case(
    "GlobalAveragePool",
    "large",
    lambda g: (randn(g, 32, 256, 32, 32),),
    _in_float64(lambda x: x.mean((2, 3), keepdim=True)),
)
case("GlobalMaxPool", "large", lambda g: (randn(g, 32, 256, 32, 32),), lambda x: x.amax((2, 3), keepdim=True))


# --- shapes and data movement --------------------------------------------------------------------

case("Reshape", "large", lambda g: (randn(g, *LARGE), ints(-1, 256, 8)), lambda x, s: x.reshape(-1, 256, 8))
case("Reshape", "empty", lambda g: (randn(g, 0, 8), ints(0, 2, 4)), lambda x, s: x.reshape(0, 2, 4))
case("Transpose", "large", lambda g: (randn(g, 64, 128, 64),), lambda x: x.permute(2, 0, 1), perm=[2, 0, 1])
case("Transpose", "empty", lambda g: (randn(g, 0, 5, 3),), lambda x: x.permute(1, 2, 0), perm=[1, 2, 0])
case("Unsqueeze", "large", lambda g: (randn(g, *LARGE), ints(0, -1)), lambda x, a: x[None, ..., None])
case("Squeeze", "large", lambda g: (randn(g, 1, *LARGE, 1), ints(0, -1)), lambda x, a: x.squeeze(0).squeeze(-1))
case("Flatten", "large", lambda g: (randn(g, 64, 128, 64),), lambda x: x.reshape(64, -1), axis=1)
case("Expand", "large", lambda g: (randn(g, 1, 1024), ints(512, 1, 1024)), lambda x, s: x.expand(512, 1, 1024))
case("Expand", "empty", lambda g: (randn(g, 1, 5), ints(0, 5)), lambda x, s: x.expand(0, 5))
case("Tile", "large", lambda g: (randn(g, 64, 256), ints(8, 4)), lambda x, r: x.tile(8, 4))
case(
    "Concat",
    "large",
    lambda g: ((randn(g, 512, 300), randn(g, 512, 0), randn(g, 512, 700)),),
    lambda xs: torch.cat(xs, 1),
    axis=1,
)
case(
    "Split",
    "uneven",
    lambda g: (randn(g, 512, 1024), ints(100, 0, 924)),
    lambda x, s: tuple(torch.split(x, [100, 0, 924], 1)),
    axis=1,
)
case(
    "Slice",
    "strided",
    lambda g: (randn(g, 512, 1024), ints(1, -1), ints(500, -1000), ints(0, 1), ints(3, -2)),
    lambda x, *_: x[1:500:3].flip(1)[:, 0:999:2],  # (dim 1: 1023, 1021, ..., 25)
)
case("Slice", "empty", lambda g: (randn(g, 512, 64), ints(10), ints(10), ints(0)), lambda x, *_: x[10:10])
case(
    "Pad",
    "constant",
    lambda g: (randn(g, 64, 32, 64), ints(0, 1, 3, 0, 2, 0), torch.tensor(1.5)),
    lambda x, p, v: F.pad(x, (3, 0, 1, 2), value=1.5),
    mode="constant",
)
case(
    "Pad",
    "negative",
    lambda g: (randn(g, 64, 32, 64), ints(0, -1, 3, 0, -2, 0)),
    lambda x, p: F.pad(x, (3, 0, -1, -2)),
    mode="constant",
)
case(
    "Pad",
    "reflect",
    lambda g: (randn(g, 16, 32, 64, 64), ints(0, 0, 2, 2, 0, 0, 2, 2)),
    lambda x, p: F.pad(x, (2, 2, 2, 2), mode="reflect"),
    mode="reflect",
)
case(
    "Pad",
    "edge",
    lambda g: (randn(g, 16, 32, 64, 64), ints(0, 0, 1, 3, 0, 0, 3, 1)),
    lambda x, p: F.pad(x, (3, 1, 1, 3), mode="replicate"),
    mode="edge",
)
case(
    "DepthToSpace",
    "CRD",
    lambda g: (randn(g, 16, 64, 32, 32),),
    lambda x: F.pixel_shuffle(x, 4),
    blocksize=4,
    mode="CRD",
)
case(
    "Col2Im",
    "overlapping",
    lambda g: (randn(g, 8, 16 * 9, 32 * 32), ints(64, 64), ints(3, 3)),
    lambda x, size, block: F.fold(x, (64, 64), 3, padding=1, stride=2),
    tolerance=1e-4,
    pads=[1, 1, 1, 1],
    strides=[2, 2],
)
case("Trilu", "lower", lambda g: (randn(g, 16, 512, 512), torch.tensor(-3)), lambda x, k: x.tril(-3), upper=0)
case("Trilu", "upper", lambda g: (randn(g, 16, 512, 512), torch.tensor(2)), lambda x, k: x.triu(2), upper=1)
case(
    "Range",
    "long",
    lambda g: (torch.tensor(-5), torch.tensor(200000), torch.tensor(3)),
    lambda a, b, s: torch.arange(-5, 200000, 3),
)
case(
    "Range",
    "empty",
    lambda g: (torch.tensor(5), torch.tensor(5), torch.tensor(1)),
    lambda a, b, s: torch.arange(5, 5, 1),
)
case(
    "Constant",
    "large",
    lambda g: (),
    lambda: torch.arange(1 << 18).float(),
    value=helper.make_tensor("value", onnx.TensorProto.FLOAT, [1 << 18], list(range(1 << 18))),
)
case(
    "ConstantOfShape",
    "large",
    lambda g: (ints(512, 1024),),
    lambda s: torch.full((512, 1024), 2.5),
    value=helper.make_tensor("value", onnx.TensorProto.FLOAT, [1], [2.5]),
)
case("ConstantOfShape", "empty", lambda g: (ints(0, 4),), lambda s: torch.zeros(0, 4))
case("Shape", "slice", lambda g: (randn(g, 3, 0, 5, 7),), lambda x: ints(0, 5), start=1, end=3)
case("Size", "large", lambda g: (randn(g, *LARGE),), lambda x: torch.tensor(x.numel()))
case("NonZero", "large", lambda g: (randn(g, 512, 256) > 0,), lambda x: x.nonzero().T)
case(
    "TopK",
    "ties",
    lambda g: (randint(g, 50, 256, 1024).float(), ints(10)),
    lambda x, k: tuple(torch.topk(x, 10, -1)),
    axis=-1,
)
case(
    "OneHot",
    "large",
    lambda g: (randint(g, 1000, 4096), ints(1000), torch.tensor([0.0, 1.0])),
    lambda i, d, v: F.one_hot(i, 1000).float(),
    axis=-1,
)


# --- index reads and writes ----------------------------------------------------------------------
# Repeated indices in each (reads: any order; writes: without a reduction the last of a repeated
# index is undefined in ONNX and in PyTorch both, so unique there), negative ones where allowed.

case(
    "Gather", "repeated", lambda g: (randn(g, 99, 256), randint(g, 99, 12, 91, low=-99)), lambda x, i: x[i % 99], axis=0
)
case("Gather", "scalar index", lambda g: (randn(g, 64, 512, 64), torch.tensor(-3)), lambda x, i: x[:, -3], axis=1)
case(
    "GatherElements",
    "repeated",
    lambda g: (randn(g, 512, 256), randint(g, 512, 1024, 256)),
    lambda x, i: x.gather(0, i),
    axis=0,
)
case(
    "GatherND", "repeated", lambda g: (randn(g, 99, 64, 32), randint(g, 64, 1092, 2)), lambda x, i: x[i[:, 0], i[:, 1]]
)
case(
    "GatherND",
    "batched",
    lambda g: (randn(g, 12, 99, 64), randint(g, 99, 12, 91, 1)),
    lambda x, i: x[torch.arange(12)[:, None], i[..., 0]],
    batch_dims=1,
)


def _scatter_nd(data, indices, updates, reduce):
    """ScatterND of a reduction in PyTorch: index_put (accumulate) or scatter_reduce."""
    rows = indices[..., 0].reshape(-1)
    values = updates.reshape(rows.shape[0], -1)
    out = data.reshape(data.shape[0], -1).clone()
    if reduce == "none":
        out[rows] = values
    else:
        index = rows[:, None].expand_as(values)
        out = out.scatter_reduce(0, index, values, _SCATTER_REDUCE[reduce])
    return out.reshape(data.shape)


_SCATTER_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}  # (ONNX's reductions in scatter_reduce)
for _reduce in (None, "none", *_SCATTER_REDUCE):  # (None: the attribute left out, "none" by default)
    _unique = _reduce in (None, "none")
    _label = f"{'unique' if _unique else 'repeated'} {{}}, reduction {_reduce or 'left out'}"

    def _make(g, unique=_unique):
        rows = (
            torch.randperm(64, generator=g)[:48] if unique else randint(g, 3, 4096)
        )  # (4,096 updates of 3 rows: the race shows in 10 sessions of 10)
        return randn(g, 64, 256), rows[:, None], 1 + randn(g, rows.shape[0], 256) / 100

    case(
        "ScatterND",
        _label.format("rows"),
        _make,
        lambda d, i, u, r=_reduce or "none": _scatter_nd(d, i, u, r),
        tolerance=1e-4,
        **({} if _reduce is None else {"reduction": _reduce}),
    )
    case(
        "ScatterElements",
        _label.format("places"),
        lambda g, unique=_unique: (
            randn(g, 64, 256),
            torch.stack([torch.randperm(64, generator=g) for _ in range(256)], 1)[:48]
            if unique
            else randint(g, 3, 4096, 256),
            1 + randn(g, 48 if unique else 4096, 256) / 100,
        ),
        lambda d, i, u, r=_reduce or "none": (
            d.scatter(0, i, u) if r == "none" else d.scatter_reduce(0, i, u, _SCATTER_REDUCE[r])
        ),
        tolerance=1e-4,
        axis=0,
        **({} if _reduce is None else {"reduction": _reduce}),
    )


@functools.cache
def audited_kinds() -> frozenset[str]:
    """The kinds of node the cases cover."""
    return frozenset(kind(c.node([], [])) for c in CASES)
