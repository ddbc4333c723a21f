"""The TorchScript path: torch.onnx.export(dynamo=False), deprecated in torch but still there.

The tracer records each Function call as a prim::PythonOp. While exporting, each exported
Function has a `symbolic` that writes the same ortbridge::PythonOp node as the dynamo path, from
the call recorded in the eager run (the tracer makes the same calls, in the same order).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import warnings

import onnx
import torch

from .. import registry
from .._compat.torch_private import (
    TensorType,
    Value,
    get_tracing_state,
    onnx_opsets,
    set_tracing_state,
    torchscript_constant,
)
from .._tracing import kernels
from .._tracing.functions import ExportError
from .._tracing.interception import class_attributes_set
from .._tracing.nodes import DOMAIN, Arguments
from .._tracing.record import Call
from . import dims


def _onnx_attribute_kwargs(attrs: dict) -> dict:
    """g.op's spelling of attribute types: name_s (string), name_i (int[s]), name_f (floats)."""
    out = {}
    for key, value in attrs.items():
        if isinstance(value, str):
            out[f"{key}_s"] = value
        elif isinstance(value, list) and value and isinstance(value[0], float):
            out[f"{key}_f"] = value
        else:
            out[f"{key}_i"] = value
    return out


class _Symbolics:
    """The `symbolic` of every exported Function: each call takes the next recorded call."""

    def __init__(self, calls: list[Call]):
        self.calls = calls
        self.done = 0

    def for_function(self, func: type):
        return staticmethod(lambda g, *args: self.emit(g, func, args))

    def emit(self, g, func, args):
        call = self.calls[self.done] if self.done < len(self.calls) else None
        arguments = Arguments(registry.registered_name(func), args, tensor_type=Value, pin=False)
        if call is None or call.func is not func or arguments.constants_key() != call.key[:2]:
            raise ExportError(
                f"the TorchScript trace called {arguments.constants['func_name']} where the eager run "
                "of the example inputs did not, or with other constants; the model must call its "
                "Functions the same way on every run with these inputs."
            )
        outputs = g.op(
            f"{DOMAIN}::PythonOp",
            *arguments.tensors,
            outputs=1 + len(call.output_dtypes),
            **_onnx_attribute_kwargs(call.node_attrs(self.done)),
        )
        self.done += 1
        outputs[0].setType(TensorType.create_from_tensor(torch.zeros((), dtype=torch.int64)))
        traced = [v.type().varyingSizes() for v in arguments.tensors]  # None: a dim dynamic_axes made dynamic
        for value, dtype, shape in zip(outputs[1:], call.output_dtypes, call.output_shapes_for(traced)):
            value.setType(TensorType.create_from_tensor(torch.empty(0, dtype=dtype)).with_sizes(shape))
        return tuple(outputs[1:]) if len(outputs) > 2 else outputs[1]


def _untraced(forward):
    """forward with the tracer off: the tracer would record its body into the prim::PythonOp
    node, which the symbolic discards anyway, and some bodies break torch's graph passes. Each
    output leaves through one traced op (torch's apply must find a trace of each output)."""

    @functools.wraps(forward)  # keeps its signature, which torch's apply binds arguments to
    def run(*args, **kwargs):
        versions = {id(a): a._version for a in args if isinstance(a, torch.Tensor)}
        state = get_tracing_state()
        set_tracing_state(None)
        try:
            result = forward(*args, **kwargs)
        finally:
            set_tracing_state(state)

        def traced(o):
            if not isinstance(o, torch.Tensor) or versions.get(id(o)) == o._version:
                return o  # not a tensor, or an input passed through: traced already
            if id(o) in versions:  # an input updated in place (mark_dirty) stays that input
                return o.copy_(o.detach())
            return o.clone()

        return tuple(map(traced, result)) if isinstance(result, tuple) else traced(result)

    return staticmethod(run)


def _opaque_functions(symbolics: _Symbolics):
    changes = []
    for func in {call.func for call in symbolics.calls}:
        changes += [(func, "symbolic", symbolics.for_function(func)), (func, "forward", _untraced(func.forward))]
    return class_attributes_set(changes)


def _refuse_accumulating_write(what: str):
    raise ExportError(
        f"{what}: torch's TorchScript exporter writes an index write that adds up the values written "
        "to one place as one that keeps only one of them where an index repeats (and a boolean mask's "
        "as a fill). Export with dynamo=True (the default), which runs it in PyTorch inside the graph."
    )


def _index_put(g, self, indices, values, accumulate=False):
    from torch.onnx import symbolic_opset11  # (torch's own, for the writes it writes right)

    if torchscript_constant(accumulate, "b") is not False:
        _refuse_accumulating_write("index_put with accumulate=True (index_put_, Tensor.put_)")
    return symbolic_opset11.index_put(g, self, indices, values, accumulate)


def _index_add(g, *args):
    _refuse_accumulating_write("index_add")


@contextlib.contextmanager
def _accumulating_writes_refused(opset_version: int):
    """While exporting at `opset_version`: index writes that accumulate refused (_refuse_accumulating_write)."""
    symbolics = {"aten::index_add": _index_add}
    if opset_version >= 11:  # (before, torch's exporter has no index_put: it refuses it)
        symbolics["aten::index_put"] = _index_put
    for name, symbolic in symbolics.items():
        torch.onnx.register_custom_op_symbolic(name, symbolic, opset_version)
    try:
        yield
    finally:
        for name in symbolics:
            torch.onnx.unregister_custom_op_symbolic(name, opset_version)


def _dynamic_axes(model, args: tuple, kwargs: dict, dynamic_shapes):
    """torch.export-style dynamic_shapes as the TorchScript exporter's input_names and dynamic_axes."""
    if dynamic_shapes is None:
        return None, None
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    if not all(isinstance(v, torch.Tensor) for v in bound.values()):
        raise ExportError(
            "dynamic_shapes with dynamo=False needs a model whose forward takes tensors only; "
            "use the default dynamo=True exporter."
        )
    return list(bound), dims.names(model, args, kwargs, dynamic_shapes)


def export(model, args: tuple, kwargs: dict, dynamic_shapes, calls: list[Call], opset_version, training: bool):
    input_names, dynamic_axes = _dynamic_axes(model, args, kwargs, dynamic_shapes)
    symbolics = _Symbolics(calls)
    buffer = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    opset_version = onnx_opsets(opset_version)[0]  # (as torch's exporter picks it)
    with _opaque_functions(symbolics), _accumulating_writes_refused(opset_version), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # of this path, which the user chose
        torch.onnx.export(
            model,
            args,
            buffer,
            kwargs=kwargs,
            dynamo=False,
            opset_version=opset_version,
            input_names=input_names,
            dynamic_axes=dynamic_axes,
            custom_opsets={DOMAIN: 1},
            training=mode,
            do_constant_folding=not training,
        )
    if symbolics.done != len(calls):
        raise ExportError(
            f"the TorchScript trace made {symbolics.done} of the {len(calls)} Function calls of the "
            "eager run; the model must call its Functions the same way on every run."
        )
    model = onnx.load_from_string(buffer.getvalue())
    for node, reason in kernels.unsafe_nodes(model):
        raise ExportError(
            f"torch's TorchScript exporter wrote node {node.name!r} ({node.op_type}), which ONNX Runtime "
            f"computes wrongly ({reason}). Export with dynamo=True (the default), which runs it in PyTorch."
        )
    return model
