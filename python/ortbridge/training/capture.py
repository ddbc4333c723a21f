"""Capture: a module's forward and backward graphs for one input signature, each run by ONNX
Runtime, glued into torch autograd by AOTAutograd.

1. One eager run records every top-level Function call (the exporter's Recorder): arguments,
   output dtypes and shapes, which outputs are differentiable.
2. AOTAutograd traces the module with fake tensors; each recorded Function's apply becomes
   ortbridge::python_op, whose autograd formula is ortbridge::python_op_grad. The partitioner
   splits the joint graph: python_op in the forward graph, python_op_grad in the backward graph,
   the context id a saved tensor between them.
3. Each graph becomes a GraphSession. AOTAutograd's runtime wrapper runs the forward session,
   saves what backward needs, and runs the backward session when torch's autograd asks.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch._functorch.aot_autograd import aot_module_simplified

from ..exporter.calls import CallTable, Recorder, apply_replaced
from . import ops
from .graph import GraphSession


class _Tensor:
    """Marks where a tensor goes in a flattened argument list."""


_TENSOR = _Tensor()


class _Flat(torch.nn.Module):
    """`module(*args, **kwargs)` as a function of the tensors among the arguments, giving the
    tensors among the results (what AOTAutograd traces). The non-tensor leaves of arguments and
    results are constants of the capture."""

    def __init__(self, module: torch.nn.Module, spec, leaves: list):
        super().__init__()
        self.module = module
        self.spec = spec
        self.leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        self.result_spec = None
        self.result_leaves = None

    def forward(self, *tensors):
        given = iter(tensors)
        args, kwargs = pytree.tree_unflatten([next(given) if x is _TENSOR else x for x in self.leaves], self.spec)
        leaves, self.result_spec = pytree.tree_flatten(self.module(*args, **kwargs))
        self.result_leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def result(self, tensors) -> object:
        given = iter(tensors)
        return pytree.tree_unflatten([next(given) if x is _TENSOR else x for x in self.result_leaves],
                                     self.result_spec)


def _python_op_apply(table: CallTable):
    def apply(func, original, args, kwargs):
        arguments, call = table.match(func, args, kwargs)
        return ops.python_op_call(call, arguments)

    return apply


def _compiler(training: bool):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs) -> GraphSession:
        return GraphSession(gm, training)

    return compile_graph


class Capture:
    """The module captured for one signature of (args, kwargs): call it with their tensors."""

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict, all_functions: bool):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        self.flat = _Flat(module, spec, leaves)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        recorder = Recorder(all_functions, training=True)
        recorder.run(module, args, kwargs)
        table = CallTable(recorder.calls)
        with apply_replaced(table.functions, _python_op_apply(table)):
            self.compiled = aot_module_simplified(self.flat, tensors, fw_compiler=_compiler(True),
                                                  bw_compiler=_compiler(False),
                                                  inference_compiler=_compiler(False))

    def __call__(self, tensors: list) -> object:
        return self.flat.result(self.compiled(*tensors))
