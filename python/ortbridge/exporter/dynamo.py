"""The torch.export-based path: torch.export.export(strict=False), then torch.onnx.export.

torch.export traces through a Function's forward and drops its backward. While it runs, each
exported Function's `apply` emits `torch.onnx.ops.symbolic_multi_out("ortbridge::PythonOp")`
instead, an opaque node with the call's attributes and (symbolic) output shapes, so forward is
never traced: numpy, `.item()` and data-dependent branches inside it do not matter.
"""

from __future__ import annotations

import torch

from .. import registry
from . import dims
from .calls import DOMAIN, Arguments, Call, ExportError, apply_replaced, bind


def _hint(dim) -> int:
    """The example size behind a traced dim (no guard is added)."""
    return dim if isinstance(dim, int) else dim.node.hint


class _Emitter:
    def __init__(self, calls: list[Call]):
        self.calls = {}
        for call in calls:
            self.calls.setdefault((call.func, call.key), call)

    def __call__(self, func, original, args, kwargs):
        args = bind(func, args, kwargs)
        arguments = Arguments(registry.registered_name(func), args)
        traced = [list(t.shape) for t in arguments.tensors]
        call = self.calls.get((func, arguments.key([[_hint(d) for d in s] for s in traced])))
        if call is None:
            raise ExportError(f"{arguments.attrs['func_name']} was called during export with arguments it was not "
                              "called with in the eager run of the example inputs; the model must call its "
                              "Functions the same way on every run with these inputs.")
        outputs = torch.onnx.ops.symbolic_multi_out(
            f"{DOMAIN}::PythonOp", arguments.tensors, call.attrs,
            dtypes=[torch.int64, *call.output_dtypes], shapes=[[], *call.output_shapes_for(traced)], version=1)
        outputs = list(outputs[1:])  # output 0 is the context id
        for j, i in call.in_place.items():  # as in eager, the updated input is the output, and later reads see it
            outputs[j] = arguments.tensors[i].copy_(outputs[j])
        return tuple(outputs) if call.returns_tuple else outputs[0]


def export(model, args: tuple, kwargs: dict, dynamic_shapes, calls: list[Call], opset_version):
    # Capture with torch.export ourselves, non-strict only: torch.onnx.export would retry a failed
    # capture in strict mode, where dynamo inlines Function.apply without calling ours.
    # Like torch.onnx.export: a dynamic dim may have an example size of 0 or 1.
    with apply_replaced({call.func for call in calls}, _Emitter(calls)), \
            torch.fx.experimental._config.patch(backed_size_oblivious=True):
        program = torch.export.export(model, args, kwargs=kwargs, strict=False,
                                      dynamic_shapes=dims.for_torch_export(dynamic_shapes))
    proto = torch.onnx.export(program, args, kwargs=kwargs, dynamo=True, opset_version=opset_version,
                              verbose=False).model_proto
    dims.rename(proto, dims.names(model, args, kwargs, dynamic_shapes))
    return proto
