"""torch model -> ONNX model whose registered autograd.Functions are ortbridge::PythonOp nodes.

This first exporter covers inference graphs of Functions whose arguments are tensors and
bool/int/float scalars (and flat tuples of them). It uses torch's current exporter
(torch.onnx.export(dynamo=True)): during export each registered Function's `apply` emits an
opaque PythonOp node instead of being traced through. Output dtypes and shapes come from one
eager run of the model on the example inputs.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import warnings

import onnx
import torch

from . import _dtypes, registry

DOMAIN = "ortbridge"


def export(model: torch.nn.Module, args, path=None, *, kwargs: dict | None = None,
           opset_version: int | None = None) -> onnx.ModelProto:
    """Export `model(*args, **kwargs)` to ONNX; save it to `path` if given, and return it."""
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = kwargs or {}
    functions = list(dict.fromkeys(registry.lookup(name) for name in registry.registered_names()))
    calls = _CallLog()
    was_training = model.training
    model.eval()  # an inference graph: training_mode=0, no autograd contexts
    try:
        with torch.no_grad(), _apply_replaced(functions, calls.record):
            model(*args, **kwargs)
        with _apply_replaced(functions, calls.emit), _quiet_exporter():
            program = torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, opset_version=opset_version,
                                        verbose=False)
    finally:
        model.train(was_training)
    proto = program.model_proto
    _name_nodes(proto.graph)
    if path is not None:
        onnx.save(proto, str(path))
    return proto


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


class _Call:
    """One Function.apply call: the argument layout as PythonOp attributes."""

    def __init__(self, func: type, args: tuple):
        self.func = func
        self.name = registry.registered_name(func)
        self.tensors = []
        convention = []
        scalars = {"bool": ([], []), "int": ([], []), "float": ([], [])}
        tuples = {"bool": ([], [], []), "int": ([], [], []), "float": ([], [], [])}
        key = []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                convention.append("d")
                self.tensors.append(arg)
                key.append((arg.dtype, tuple(arg.shape)))
                continue
            convention.append("c")
            kind = _scalar_kind(arg)
            if kind is not None:
                values, positions = scalars[kind]
                values.append(arg)
                positions.append(position)
            elif isinstance(arg, tuple) and arg and len({_scalar_kind(v) for v in arg}) == 1 \
                    and _scalar_kind(arg[0]) is not None:
                values, positions, begins = tuples[_scalar_kind(arg[0])]
                begins.append(len(values))
                values.extend(arg)
                positions.append(position)
            else:
                raise TypeError(
                    f"argument {position} of {self.name}.apply is {type(arg).__name__}; this exporter "
                    "supports tensors, bool/int/float scalars and non-empty tuples of one of those")
            key.append((type(arg), arg))
        self.key = (func, tuple(key))
        attrs = {"func_name": self.name, "input_convention": "".join(convention), "training_mode": 0,
                 "input_tensor_types": [_dtypes.onnx_type(t.dtype) for t in self.tensors],
                 "input_tensor_ranks": [t.dim() for t in self.tensors]}
        for kind, (values, positions) in scalars.items():
            if values:
                attrs[f"input_{kind}_scalars"] = [float(v) if kind == "float" else int(v) for v in values]
                attrs[f"input_{kind}_scalar_positions"] = positions
        if scalars["float"][0]:
            attrs["input_float_scalars_f64"] = [_f64_bits(v) for v in scalars["float"][0]]
        for kind, (values, positions, begins) in tuples.items():
            if values:
                attrs[f"input_{kind}_tuples"] = [float(v) if kind == "float" else int(v) for v in values]
                attrs[f"input_{kind}_tuple_positions"] = positions
                attrs[f"input_{kind}_tuple_begins"] = begins
        if tuples["float"][0]:
            attrs["input_float_tuples_f64"] = [_f64_bits(v) for v in tuples["float"][0]]
        self.attrs = attrs


def _scalar_kind(value) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return None


class _CallLog:
    """Output metadata of each distinct call, recorded eagerly, replayed while exporting."""

    def __init__(self):
        self.outputs = {}

    def record(self, func, apply, args):
        call = _Call(func, args)  # refuse unsupported arguments before running anything
        result = apply(*args)
        outputs = result if isinstance(result, tuple) else (result,)
        for i, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"{registry.registered_name(func)}.forward output {i} is {type(o).__name__}; "
                                "every output must be a tensor")
        self.outputs[call.key] = (isinstance(result, tuple),
                                               [(o.dtype, tuple(o.shape)) for o in outputs])
        return result

    def emit(self, func, apply, args):
        call = _Call(func, args)
        try:
            is_tuple, outputs = self.outputs[call.key]
        except KeyError:
            raise RuntimeError(f"{call.name} was called during export with arguments it was not called with "
                               "in the eager run of the example inputs") from None
        attrs = dict(call.attrs, output_tensor_types=[_dtypes.onnx_type(d) for d, _ in outputs],
                     output_tensor_ranks=[len(s) for _, s in outputs])
        results = torch.onnx.ops.symbolic_multi_out(
            f"{DOMAIN}::PythonOp", call.tensors, attrs,
            dtypes=[torch.int64] + [d for d, _ in outputs],
            shapes=[[]] + [list(s) for _, s in outputs], version=1)
        results = tuple(results[1:])  # output 0 is the context id
        return results if is_tuple else results[0]


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Give each PythonOp node a readable, unique name: PythonOp_<Function>_<k>."""
    for k, node in enumerate(n for n in graph.node if n.domain == DOMAIN):
        func = next(a.s.decode() for a in node.attribute if a.name == "func_name")
        node.name = f"{node.op_type}_{func.rsplit('.', 1)[-1]}_{k}"


@contextlib.contextmanager
def _quiet_exporter():
    """torch's exporter logs warnings about optional packages that do not concern the user."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _apply_replaced(functions: list, hook):
    """Route `cls.apply(*args)` of each Function to `hook(cls, original_apply, args)`."""
    saved = []
    for cls in functions:
        saved.append((cls, cls.__dict__.get("apply")))
        original = cls.apply

        def apply(c, *args, _original=original, **kwargs):
            if kwargs:
                raise TypeError(f"{registry.registered_name(c)}.apply got keyword arguments; this exporter "
                                "takes positional arguments only")
            return hook(c, _original, args)

        cls.apply = classmethod(apply)
    try:
        yield
    finally:
        for cls, own in reversed(saved):
            if own is None:
                del cls.apply
            else:
                cls.apply = own
