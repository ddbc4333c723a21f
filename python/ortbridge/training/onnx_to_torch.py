"""An ONNX graph as a torch module: each node runs as the torch operators it stands for, so that
OrtModule can capture the graph (forward and backward, from torch's autograd) and run both in
ONNX Runtime. This is how an ONNX model without PyTorch source trains on stock onnxruntime,
which has no gradient builder.

The graph's float initializers to train become Parameters, under their ONNX names (as
`OnnxGraphModule.parameter_names` maps them); the others are constants. Values computed only from
constants and shapes (Reshape's target shape, say) are computed on the host while the module is
traced, as the ONNX graph's shape logic is: so a capture specializes them, as it does shapes.
An `ortbridge::PythonOp` node calls its registered Function's apply.
"""

from __future__ import annotations

import math

import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

from .._compat.torch_private import bound_apply, disable_current_modes
from .._format import dtypes
from .._kernel import runner
from .._kernel.lookup import lookup
from .._tracing.nodes import DOMAIN


class ConversionError(NotImplementedError):
    """An ONNX graph this converter cannot run as torch operators; the message names the node."""


def _ints(t) -> list:
    """The integers of an attribute or of a host tensor input (shape, axes)."""
    if isinstance(t, (list, tuple)):
        return [int(v) for v in t]
    with disable_current_modes():  # (the value is real: read it, not the trace's view of it)
        return [int(v) for v in t.reshape(-1).tolist()]


def _scalar(t):
    with disable_current_modes():
        return t.reshape(-1)[0].item()


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _dtype(onnx_type: int) -> torch.dtype:
    return dtypes.FROM_ONNX[onnx_type]


def _pads(pads: list, rank: int) -> list:
    """ONNX pads (begin of each spatial dim, then end of each) as F.pad's (last dim first)."""
    begins, ends = pads[:rank], pads[rank:]
    return [p for d in reversed(range(rank)) for p in (begins[d], ends[d])]


def _gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    y = (a.t() if transA else a) @ (b.t() if transB else b)
    y = y * alpha if alpha != 1.0 else y
    return y if c is None else y + (c * beta if beta != 1.0 else c)


def _conv(x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    rank = x.dim() - 2
    if auto_pad not in ("NOTSET", "VALID"):
        raise NotImplementedError(f"auto_pad={auto_pad}")
    pads = pads or [0] * (2 * rank)
    conv = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
    symmetric = pads[:rank] == pads[rank:]
    if not symmetric:
        x = F.pad(x, _pads(pads, rank))
    return conv(
        x, w, b, stride=strides or 1, padding=pads[:rank] if symmetric else 0, dilation=dilations or 1, groups=group
    )


def _pool(kind: str):
    def pool(
        x,
        *,
        auto_pad="NOTSET",
        ceil_mode=0,
        dilations=None,
        kernel_shape,
        pads=None,
        strides=None,
        count_include_pad=0,
        storage_order=0,
    ):
        rank = x.dim() - 2
        if auto_pad not in ("NOTSET", "VALID"):
            raise NotImplementedError(f"auto_pad={auto_pad}")
        pads = pads or [0] * (2 * rank)
        symmetric = pads[:rank] == pads[rank:]
        padding = pads[:rank] if symmetric else 0
        if not symmetric:
            x = F.pad(x, _pads(pads, rank), value=-math.inf if kind == "max" else 0.0)
        if kind == "max":
            op = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[rank - 1]
            return op(x, kernel_shape, strides or kernel_shape, padding, dilations or 1, bool(ceil_mode))
        op = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[rank - 1]
        return op(x, kernel_shape, strides or kernel_shape, padding, bool(ceil_mode), bool(count_include_pad))

    return pool


def _reduce(op):
    def reduce(x, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        if axes is None or len(axes) == 0:
            if noop_with_empty_axes:
                return x
            axes = list(range(x.dim()))
        return op(x, [_axis(a, x.dim()) for a in _ints(axes)], bool(keepdims))

    return reduce


def _reshape(x, shape, *, allowzero=0):
    shape = _ints(shape)
    if not allowzero:
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x.reshape(shape)


def _slice(x, starts, ends, axes=None, steps=None):
    starts, ends = _ints(starts), _ints(ends)
    axes = _ints(axes) if axes is not None else list(range(len(starts)))
    steps = _ints(steps) if steps is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    for start, end, axis, step in zip(starts, ends, axes, steps):
        if step < 0:
            raise NotImplementedError("Slice with a negative step")
        size = x.shape[_axis(axis, x.dim())]
        index[_axis(axis, x.dim())] = slice(max(min(start, size), -size), max(min(end, size), -size - 1), step)
    return x[tuple(index)]


def _split(x, split=None, *, axis=0, num_outputs=None):
    axis = _axis(axis, x.dim())
    if split is not None:
        return torch.split(x, _ints(split), axis)
    size = -(-x.shape[axis] // num_outputs)
    return torch.split(x, size, axis)


def _squeeze(x, axes=None):
    if axes is None:
        return x.squeeze()
    return x.squeeze(tuple(_axis(a, x.dim()) for a in _ints(axes)))


def _unsqueeze(x, axes):
    rank = x.dim() + len(_ints(axes))
    for a in sorted(_axis(a, rank) for a in _ints(axes)):
        x = x.unsqueeze(a)
    return x


def _gather(x, indices, *, axis=0):
    axis = _axis(axis, x.dim())
    indices = torch.where(indices < 0, indices + x.shape[axis], indices)
    return x.index_select(axis, indices.reshape(-1)).reshape(*x.shape[:axis], *indices.shape, *x.shape[axis + 1 :])


def _layer_norm(x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    axis = _axis(axis, x.dim())
    return F.layer_norm(x, x.shape[axis:], scale, bias, epsilon)


def _batch_norm(x, scale, bias, mean, var, *, epsilon=1e-5, momentum=0.9, training_mode=0):
    if training_mode:
        raise NotImplementedError("BatchNormalization with training_mode=1")
    return F.batch_norm(x, mean, var, scale, bias, False, 0.0, epsilon)


def _cast(x, *, to, saturate=1):
    return x.to(_dtype(to))


def _constant_of_shape(shape, *, value=None):
    v = torch.zeros(1) if value is None else value
    return torch.full(_ints(shape), _scalar(v), dtype=v.dtype)


def _expand(x, shape):
    shape = _ints(shape)
    rank = max(x.dim(), len(shape))
    shape = [1] * (rank - len(shape)) + shape
    own = [1] * (rank - x.dim()) + list(x.shape)
    return x.reshape(own).expand([max(a, b) if b != 1 or a == 1 else a for a, b in zip(own, shape)])


def _softmax(kind):
    def softmax(x, *, axis=-1):
        return (torch.softmax if kind == "softmax" else torch.log_softmax)(x, _axis(axis, x.dim()))

    return softmax


def _flatten(x, *, axis=1):
    axis = _axis(axis, x.dim())
    return x.reshape(math.prod(x.shape[:axis]), -1)


def _transpose(x, *, perm=None):
    return x.permute(perm if perm is not None else list(reversed(range(x.dim()))))


def _concat(*xs, axis):
    return torch.cat(xs, _axis(axis, xs[0].dim()))


def _clip(x, low=None, high=None):
    return torch.clamp(x, low, high)


def _gelu(x, *, approximate="none"):
    return F.gelu(x, approximate=approximate)


def _range(start, limit, delta):
    return torch.arange(_scalar(start), _scalar(limit), _scalar(delta), dtype=start.dtype)


def _tile(x, repeats):
    return x.repeat(_ints(repeats))


def _where(condition, x, y):
    return torch.where(condition, x, y)


def _dropout(x, ratio=None, training_mode=None, *, seed=0):
    return x  # (inference form; a graph trained here runs its dropout nodes as identity)


def _div(a, b):
    if not a.is_floating_point() and not b.is_floating_point():
        return torch.div(a, b, rounding_mode="trunc")
    return a / b


def _mod(a, b, *, fmod=0):
    return torch.fmod(a, b) if fmod else torch.remainder(a, b)


def _trilu(x, k=None, *, upper=1):
    k = int(_scalar(k)) if k is not None else 0
    return torch.triu(x, k) if upper else torch.tril(x, k)


def _argmax(op):
    def arg(x, *, axis=0, keepdims=1, select_last_index=0):
        return op(x, _axis(axis, x.dim()), bool(keepdims))

    return arg


# ONNX operator (default domain) -> a torch function of the node's inputs, with its attributes as
# keyword arguments.
OPERATORS = {
    "Abs": torch.abs,
    "Acos": torch.acos,
    "Add": torch.add,
    "And": torch.logical_and,
    "ArgMax": _argmax(torch.argmax),
    "ArgMin": _argmax(torch.argmin),
    "Asin": torch.asin,
    "Atan": torch.atan,
    "AveragePool": _pool("avg"),
    "BatchNormalization": _batch_norm,
    "Cast": _cast,
    "Ceil": torch.ceil,
    "Clip": _clip,
    "Concat": _concat,
    "ConstantOfShape": _constant_of_shape,
    "Conv": _conv,
    "Cos": torch.cos,
    "Div": _div,
    "Dropout": _dropout,
    "Elu": lambda x, *, alpha=1.0: F.elu(x, alpha),
    "Equal": torch.eq,
    "Erf": torch.erf,
    "Exp": torch.exp,
    "Expand": _expand,
    "Flatten": _flatten,
    "Floor": torch.floor,
    "Gather": _gather,
    "Gelu": _gelu,
    "Gemm": _gemm,
    "GlobalAveragePool": lambda x: x.mean(tuple(range(2, x.dim())), keepdim=True),
    "GlobalMaxPool": lambda x: x.amax(tuple(range(2, x.dim())), keepdim=True),
    "Greater": torch.gt,
    "GreaterOrEqual": torch.ge,
    "HardSigmoid": lambda x, *, alpha=0.2, beta=0.5: torch.clamp(alpha * x + beta, 0, 1),
    "HardSwish": F.hardswish,
    "Identity": lambda x: x,
    "LayerNormalization": _layer_norm,
    "LeakyRelu": lambda x, *, alpha=0.01: F.leaky_relu(x, alpha),
    "Less": torch.lt,
    "LessOrEqual": torch.le,
    "Log": torch.log,
    "LogSoftmax": _softmax("log_softmax"),
    "MatMul": torch.matmul,
    "Max": torch.maximum,
    "MaxPool": _pool("max"),
    "Min": torch.minimum,
    "Mod": _mod,
    "Mul": torch.mul,
    "Neg": torch.neg,
    "Not": torch.logical_not,
    "Or": torch.logical_or,
    "Pow": torch.pow,
    "PRelu": lambda x, slope: torch.where(x >= 0, x, x * slope),
    "Range": _range,
    "Reciprocal": torch.reciprocal,
    "ReduceMax": _reduce(lambda x, d, k: x.amax(d, k)),
    "ReduceMean": _reduce(lambda x, d, k: x.mean(d, k)),
    "ReduceMin": _reduce(lambda x, d, k: x.amin(d, k)),
    "ReduceProd": _reduce(lambda x, d, k: _reduce_prod(x, d, k)),
    "ReduceSum": _reduce(lambda x, d, k: x.sum(d, k)),
    "ReduceSumSquare": _reduce(lambda x, d, k: (x * x).sum(d, k)),
    "Relu": torch.relu,
    "Reshape": _reshape,
    "Selu": lambda x, *, alpha=1.67326, gamma=1.0507: gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1)),
    "Shape": None,
    "Sigmoid": torch.sigmoid,
    "Sign": torch.sign,
    "Sin": torch.sin,
    "Slice": _slice,
    "Softmax": _softmax("softmax"),
    "Softplus": F.softplus,
    "Softsign": F.softsign,
    "Split": _split,
    "Sqrt": torch.sqrt,
    "Squeeze": _squeeze,
    "Sub": torch.sub,
    "Tan": torch.tan,
    "Tanh": torch.tanh,
    "Tile": _tile,
    "Transpose": _transpose,
    "Trilu": _trilu,
    "Unsqueeze": _unsqueeze,
    "Where": _where,
    "Xor": torch.logical_xor,
}
del OPERATORS["Shape"]  # (handled by the module: it reads the input's shape on the host)

# Inputs that the ONNX operator reads as values on the host (shapes, axes, indices of a split),
# by operator: their node must be computable from constants and shapes.
_HOST_INPUTS = {
    "Reshape": {1},
    "Slice": {1, 2, 3, 4},
    "Split": {1},
    "Squeeze": {1},
    "Unsqueeze": {1},
    "Expand": {1},
    "ConstantOfShape": {0},
    "Tile": {1},
    "ReduceMax": {1},
    "ReduceMean": {1},
    "ReduceMin": {1},
    "ReduceProd": {1},
    "ReduceSum": {1},
    "ReduceSumSquare": {1},
    "Range": {0, 1, 2},
    "Trilu": {1},
}

# Control flow: its gradient would be the body's, per iteration.
_SUBGRAPH_OPERATORS = {"If", "Loop", "Scan", "SequenceMap"}


def _reduce_prod(x, dims, keepdim):
    for d in sorted(dims, reverse=True):
        x = x.prod(d, keepdim)
    return x


def _attribute(a: onnx.AttributeProto):
    if a.type == onnx.AttributeProto.TENSOR:
        return torch.from_numpy(numpy_helper.to_array(a.t).copy())
    value = onnx.helper.get_attribute_value(a)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode() for v in value]
    return list(value) if isinstance(value, (list, tuple)) else value


def _constant(node: onnx.NodeProto) -> torch.Tensor:
    a = node.attribute[0]
    if a.name == "value":
        return torch.from_numpy(numpy_helper.to_array(a.t).copy())
    kinds = {
        "value_float": torch.float32,
        "value_int": torch.int64,
        "value_floats": torch.float32,
        "value_ints": torch.int64,
    }
    if a.name not in kinds:
        raise NotImplementedError(f"Constant with attribute {a.name}")
    return torch.tensor(onnx.helper.get_attribute_value(a), dtype=kinds[a.name])


def _node_label(node: onnx.NodeProto, index: int) -> str:
    op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
    return f"node {index} ('{node.name}', {op})" if node.name else f"node {index} ({op})"


def float_initializers(model: onnx.ModelProto) -> list[str]:
    """The names of the model's floating-point initializers: the weights trained by default."""
    floating = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    return [i.name for i in model.graph.initializer if i.data_type in floating]


class OnnxGraphModule(torch.nn.Module):
    """Runs `model`'s graph with torch operators. Its arguments are `input_names` (default: the
    graph inputs that no initializer fills), then the initializers named in `weights_as_inputs`;
    its results the values named in `output_names` (default: the graph outputs).
    `weights_to_train` (default: every floating-point initializer not taken as an input) are
    Parameters, registered under safe attribute names (`parameter_names` maps each to its ONNX
    name); other initializers are constants. `check_nodes=False` leaves out the check that every
    node has a torch form (for a graph only named, not run, here)."""

    def __init__(
        self,
        model: onnx.ModelProto,
        weights_to_train: list[str] | None = None,
        *,
        input_names: list[str] | None = None,
        output_names: list[str] | None = None,
        weights_as_inputs: list[str] = (),
        check_nodes: bool = True,
    ):
        super().__init__()
        graph = model.graph
        initializers = {i.name: i for i in graph.initializer}
        as_inputs = list(weights_as_inputs)
        trained = (
            [n for n in float_initializers(model) if n not in as_inputs]
            if weights_to_train is None
            else list(weights_to_train)
        )
        unknown = [n for n in trained + as_inputs if n not in initializers]
        if unknown:
            raise ValueError(f"weights to train that name no initializer of the model: {unknown}")
        self.parameter_names: dict[str, str] = {}  # attribute name -> ONNX initializer name
        for k, name in enumerate(trained):
            attribute = f"w{k}"
            value = torch.from_numpy(numpy_helper.to_array(initializers[name]).copy())
            self.register_parameter(attribute, torch.nn.Parameter(value))
            self.parameter_names[attribute] = name
        self.constants: dict[str, torch.Tensor] = {  # ONNX name -> value (host tensors)
            name: torch.from_numpy(numpy_helper.to_array(init).copy())
            for name, init in initializers.items()
            if name not in trained and name not in as_inputs
        }
        graph_inputs = [i.name for i in graph.input if i.name not in initializers]
        inputs = graph_inputs if input_names is None else list(input_names)
        if set(inputs) != set(graph_inputs) or len(inputs) != len(graph_inputs):
            raise ValueError(
                f"input_names {inputs} must name each graph input that no initializer fills, once: {graph_inputs}"
            )
        self.input_names = inputs + as_inputs
        produced = {o for node in graph.node for o in node.output} | set(initializers) | set(graph_inputs)
        self.output_names = [o.name for o in graph.output] if output_names is None else list(output_names)
        missing = [o for o in self.output_names if o not in produced]
        if missing:
            raise ValueError(f"output_names {missing} name no value of the graph")
        self.nodes = list(graph.node)
        for index, node in enumerate(self.nodes if check_nodes else ()):
            self._check(node, index)

    def _check(self, node: onnx.NodeProto, index: int) -> None:
        label = _node_label(node, index)
        if node.op_type in _SUBGRAPH_OPERATORS or any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
        ):
            raise ConversionError(
                f"{label} holds a subgraph, which training an ONNX graph does not support "
                "(its gradient would need the subgraph's, per iteration)"
            )
        if node.domain == DOMAIN and node.op_type == "PythonOp":
            return
        if node.domain not in ("", "ai.onnx") or (
            node.op_type not in OPERATORS and node.op_type not in ("Shape", "Constant", "Size")
        ):
            raise ConversionError(
                f"{label} has no torch form here, so no gradient: training supports the "
                f"operators {sorted(OPERATORS)} and ortbridge::PythonOp"
            )

    def forward(self, *inputs):
        if len(inputs) != len(self.input_names):
            raise TypeError(f"the graph takes {len(self.input_names)} inputs ({self.input_names}), got {len(inputs)}")
        values: dict = dict(self.constants)
        host = set(self.constants)  # values known on the host while tracing: constants, shapes
        for attribute, name in self.parameter_names.items():
            values[name] = getattr(self, attribute)
        values.update(zip(self.input_names, inputs))
        for index, node in enumerate(self.nodes):
            try:
                self._run(node, values, host)
            except Exception as e:
                e.add_note(f"(ortbridge: in ONNX {_node_label(node, index)}, run as torch operators)")
                raise
        outputs = tuple(values[name] for name in self.output_names)
        return outputs[0] if len(outputs) == 1 else outputs

    def _run(self, node: onnx.NodeProto, values: dict, host: set) -> None:
        args = [values[name] if name else None for name in node.input]
        while args and args[-1] is None:
            args.pop()
        on_host = all(name in host for name in node.input if name)
        if node.domain == DOMAIN:
            results = _python_op(node, args)
            on_host = False
        elif node.op_type == "Constant":
            results, on_host = (_constant(node),), True
        elif node.op_type in ("Shape", "Size"):
            shape = list(args[0].shape)
            start, end = 0, len(shape)
            for a in node.attribute:
                start, end = (a.i, end) if a.name == "start" else (start, a.i) if a.name == "end" else (start, end)
            with disable_current_modes():  # a host value: the traced graph specializes it, as it does shapes
                results = (
                    torch.tensor(shape[start:end] if node.op_type == "Shape" else math.prod(shape), dtype=torch.int64),
                )
            on_host = True
        else:
            op = OPERATORS[node.op_type]
            attributes = {a.name: _attribute(a) for a in node.attribute}
            for i in _HOST_INPUTS.get(node.op_type, ()):
                if i < len(node.input) and node.input[i] and node.input[i] not in host:
                    raise ConversionError(
                        f"input {i} of this {node.op_type} ('{node.input[i]}') is computed from "
                        "tensor values; it must come from constants and shapes"
                    )
            if on_host:
                with disable_current_modes():
                    results = op(*args, **attributes)
            else:
                results = op(*args, **attributes)
            results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
        for name, value in zip(node.output, results):
            if name:
                values[name] = value
                if on_host:
                    host.add(name)

    def onnx_weights(self) -> dict[str, torch.nn.Parameter]:
        """The trained weights by ONNX initializer name."""
        return {name: getattr(self, attribute) for attribute, name in self.parameter_names.items()}


def _python_op(node: onnx.NodeProto, tensors: list) -> tuple:
    """An ortbridge::PythonOp node as its Function's apply: the arguments and constants the kernel
    would pass (the kernel library parses the attributes)."""
    kinds = {
        onnx.AttributeProto.INT: {},
        onnx.AttributeProto.STRING: {},
        onnx.AttributeProto.INTS: {},
        onnx.AttributeProto.FLOATS: {},
    }
    for a in node.attribute:
        if a.type in kinds:
            value = onnx.helper.get_attribute_value(a)
            kinds[a.type][a.name] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    try:
        layout = runner.parse_forward(*kinds.values(), len(node.input), len(node.output))
    except ValueError as e:
        raise ConversionError(str(e)) from e
    func = lookup(layout.func_name)
    args = runner.arguments(layout)
    for position, tensor in zip(layout.tensor_positions, tensors):
        args[position] = tensor
    outputs = bound_apply(func)(*args)
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    return (None, *outputs)  # output 0, the context id, has no value here
