"""The operator fallback: an operator torch's ONNX exporter cannot write (it has no translation
and no decomposition into operators that have one) becomes a PythonOp node that runs the operator
in PyTorch on ONNX Runtime's buffers (see ortbridge.operators), instead of failing the export.

Applied to an ExportedProgram before its translation (to_onnx): the program is decomposed as
torch's exporter would decompose it; if some operator is left without a translation, the
decomposed program is traced again with each such call emitting its node. to_onnx then
translates it as torch.onnx.export(dynamo=True) would, without decomposing it a second time.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re

import onnx
import torch
from torch.export.graph_signature import TensorArgument
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

from .. import _dtypes, operators
from .._torch_private import (OpOverload, detect_fake_mode, fx_config, onnx_decompositions, onnx_exporter,
                              onnx_opsets, onnx_registry, pytree, remove_assertion_nodes)
from .functions import ExportError
from .nodes import Arguments, emit_python_op

log = logging.getLogger("ortbridge")


aten = torch.ops.aten
# Operators run by PyTorch even though torch's exporter could write them: those it writes
# wrongly (_embedding_bag: the max indices that mode="max" saves for backward), and those with a
# decomposition that ONNX Runtime runs slower than PyTorch runs the operator, chosen per operator
# by benchmarks/fallback_ops.py (both ways, in training steps, in one run).
# (Attention on the CPU too: torch's fused kernel, where ONNX has Softmax between two MatMuls and
# their transposes; its outputs saved for backward are the kernel's own.)
PYTORCH_PREFERRED: set = {aten._embedding_bag.default, aten._native_batch_norm_legit_functional.default,
                          aten.native_batch_norm_backward.default,
                          aten.native_layer_norm_backward.default, aten.native_group_norm_backward.default,
                          aten._scaled_dot_product_flash_attention_for_cpu.default,
                          aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


def _safe_softmax(x: torch.Tensor, dim: int, dtype=None) -> torch.Tensor:
    """torch's decomposition of _safe_softmax (attention's softmax: 0 for a row of -inf, where
    softmax gives NaN), with the rows of -inf found by two reductions instead of an Equal and a
    Cast of the whole tensor and a ReduceMin: the same values, in ~60% of the time in ORT.
    max == -inf alone would also take a row of -inf and NaN (ORT's ReduceMax passes over a NaN
    that is not a row's first element); the sum of such a row is NaN, of a row of -inf -inf."""
    out = torch.softmax(x, dim=dim, dtype=dtype)
    of_minus_inf = (x.amax(dim, keepdim=True) == float("-inf")) & ~x.sum(dim, keepdim=True).isnan()
    return torch.where(of_minus_inf, 0.0, out)


@functools.cache
def _decompositions(registry_opset: int) -> tuple[frozenset, dict]:
    """(the operators torch's exporter translates, the decompositions it applies to the others).
    (The translations: ortbridge's one copy, built once, as it registers none of its own: PythonOp
    nodes are torch.onnx.ops.symbolic_multi_out calls, which torchlib translates.)"""
    translated, table = onnx_decompositions(onnx_registry(registry_opset))
    if aten._safe_softmax.default in table:
        table[aten._safe_softmax.default] = _safe_softmax
    return translated, table


def _needs_fallback(node: torch.fx.Node, translated: frozenset, in_pytorch=frozenset()) -> bool:
    return (node.op == "call_function" and isinstance(node.target, OpOverload)
            and (node.target not in translated or node.target in PYTORCH_PREFERRED or node.name in in_pytorch))


# ONNX Runtime's refusal of a graph that names the node torch's exporter wrote for FX node X
# (`node_X`, or `node_X__k` for the k-th ONNX node of its translation).
_REFUSED_NODE = re.compile(r"(?:node with name|in node \() ?'?node_([A-Za-z0-9_]+?)(?:__\d+)?[')]")


def node_without_kernel(error: str) -> str | None:
    """The FX node (of the decomposed graph) whose ONNX node ONNX Runtime refused, or None."""
    match = _REFUSED_NODE.search(error)
    return match.group(1) if match else None


# ONNX Runtime's refusal of a node its own optimizer made (`<node>/<optimizer>/`: a fusion into an
# operator without a kernel for this type, as FusedMatMul of float64 before 1.20).
_REFUSED_FUSION = re.compile(r"node:'[^']*/([A-Za-z0-9_]+)/'")


def optimizer_without_kernel(error: str) -> str | None:
    """The ONNX Runtime optimizer that made the node ONNX Runtime refused, or None."""
    match = _REFUSED_FUSION.search(error)
    return match.group(1) if match else None


def exportable(program: torch.export.ExportedProgram, in_pytorch=frozenset(),
               opset_version: int | None = None) -> torch.export.ExportedProgram:
    """`program` decomposed as torch's ONNX exporter would decompose it for `opset_version`, each
    call of an operator it cannot write a fallback node; to_onnx translates it. `in_pytorch`:
    names of nodes of the decomposed program to run as fallback nodes too."""
    translated, table = _decompositions(onnx_opsets(opset_version)[1])
    # (as torch's exporter decomposes: a dynamic dim may have an example size of 0 or 1)
    with fx_config.patch(backed_size_oblivious=True):
        # Decomposed as torch's exporter would decompose it (less the operators PyTorch runs faster).
        decomposed = program.run_decompositions({op: f for op, f in table.items() if op not in PYTORCH_PREFERRED})
        remove_assertion_nodes(decomposed.graph_module)  # (torch's exporter drops them too)
        fallbacks = [n for n in decomposed.graph.nodes if _needs_fallback(n, translated, in_pytorch)]
        if not fallbacks:
            return decomposed
        for node in fallbacks:
            try:  # (what a model file could not name, the exporter does not write either)
                operators.function(operators.name_of(node.target))
            except LookupError as e:
                if operators.allowed(node.target.namespace):
                    raise ExportError(f"operator {operators.name_of(node.target)} has no ONNX translation and cannot "
                                      f"run as a fallback node: {e}") from None
            if not operators.allowed(node.target.namespace):
                raise ExportError(f"operator {operators.name_of(node.target)} has no ONNX translation, and its "
                                  f"namespace is not allowed to run as a fallback node; call ortbridge.allow_operators("
                                  f"'{node.target.namespace}') to let it run in PyTorch inside the graph.")
        log.info("operators run by PyTorch inside the graph: %s",
                 ", ".join(sorted({operators.name_of(n.target) for n in fallbacks})))
        for node in fallbacks:
            node.target = _emitter(node.target)
        # A fallback node's outputs are dense, an operator's may not be (flash attention's): a
        # view of one becomes a reshape (in ONNX both are Reshape).
        for node in decomposed.graph.nodes:
            if node.target is aten.view.default:
                node.target = aten.reshape.default
        if _static_with_elements(decomposed.graph):
            # Each fallback call traced alone and put in its place: tracing the whole program
            # again took about a third of a capture.
            for node in fallbacks:
                _emit_in_place(decomposed.graph, node)
            # (the signature names each output by the node that gives it, in order)
            for spec, value in zip(decomposed.graph_signature.output_specs, decomposed.graph.output_node().args[0]):
                if isinstance(spec.arg, TensorArgument):
                    spec.arg = TensorArgument(name=value.name)
            decomposed.graph_module.recompile()
            return decomposed
        decomposed.graph_module.recompile()
        # Traced again, each fallback call emitting its node; the empty table decomposes nothing
        # (all is decomposed already), so the result is what torch's exporter translates.
        return decomposed.run_decompositions({})


def _static_with_elements(graph: torch.fx.Graph) -> bool:
    """Whether the graph's values are all tensors of static shapes with elements: its fallback
    calls can be traced alone. (A symbolic size needs the whole trace; so does a tensor without
    elements, as ONNX's Reshape of an aten reshape, which a trace makes a view, reads a 0 in
    the shape as the input's dim.)"""
    for node in graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) or (
                    isinstance(value, torch.Tensor) and not all(isinstance(d, int) and d > 0 for d in value.shape)):
                return False
    return True


def _emit_in_place(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """`node` (its target an emitter) replaced in `graph` by the nodes its emitter writes, traced
    on the fake values of its inputs."""
    inputs = node.all_input_nodes

    def call(*tensors):
        by_input = dict(zip(inputs, tensors))
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), by_input.__getitem__)
        return node.target(*args, **kwargs)

    values = [a.meta["val"] for a in inputs]
    with detect_fake_mode([*values, *operators.flatten_outputs(node.meta["val"])]):
        traced = make_fx(call)(*values)
    for emitted in (n for n in traced.graph.nodes if n.op == "call_function"):
        # Named after the node they replace: the graph's namespace does not know the names
        # torch.export gave, and the ONNX values are named by the nodes.
        emitted.name = f"{node.name}_{emitted.name}"
        if "nn_module_stack" in node.meta:  # (where the exporter finds a node's module)
            emitted.meta["nn_module_stack"] = node.meta["nn_module_stack"]
    with graph.inserting_before(node):
        result = graph.graph_copy(traced.graph, dict(zip(traced.graph.find_nodes(op="placeholder"), inputs)))
    if isinstance(result, torch.fx.Node):
        node.replace_all_uses_with(result)
    else:  # (several outputs: its users take them by getitem)
        for user in list(node.users):
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)


def to_onnx(program: torch.export.ExportedProgram, opset_version: int | None = None) -> onnx.ModelProto:
    """`program` as exportable returns it, as ONNX: what torch.onnx.export(program, dynamo=True,
    opset_version=opset_version) writes (optimized), with ortbridge's one copy of torch's ONNX
    translations and without decomposing the program again."""
    opset_version, registry_opset = onnx_opsets(opset_version)
    exporter = onnx_exporter()
    if exporter.export is None:  # (the public export, which builds its own translations)
        return torch.onnx.export(program, (), dynamo=True, opset_version=opset_version, verbose=False).model_proto
    registry = onnx_registry(registry_opset)
    if exporter.translate is None:  # (torch's export, which decomposes again)
        return exporter.export(program, registry=registry, opset_version=opset_version, verbose=False).model_proto
    # torch's export of an ExportedProgram after its decomposition (_core.export).
    with fx_config.patch(backed_size_oblivious=True):
        exporter.insert_type_promotion_nodes(program.graph_module)
        exporter.remove_assertion_nodes(program.graph_module)
    onnx_program = exporter.translate(program, registry=registry)
    onnx_program.model = exporter.convert_version(onnx_program.model, opset_version)
    onnx_program.optimize()
    return onnx_program.model_proto


def _layout(args: tuple, kwargs: dict) -> tuple[tuple, tuple, list]:
    """The operator's arguments as PythonOp arguments: (layout, keyword names, values...)."""
    layout, values = [], []
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            layout.append(len(value))
            values.extend(value)
        else:  # (int and bool lists as tuples: ORT's typed attributes, which forward cannot change)
            layout.append(-1)
            values.append(tuple(value) if isinstance(value, list) else value)
    return tuple(layout), tuple(kwargs), values


_call_numbers = itertools.count()  # numbers every fallback call: no optimizer may merge two of them


def _emitter(op: OpOverload):
    name = operators.name_of(op)

    def emit(*args, **kwargs):
        with disable_proxy_modes_tracing():  # the operator's outputs in this trace, not recorded
            result = _masked(op, op(*args, **kwargs), args, kwargs)
        outputs = operators.flatten_outputs(result)
        layout, keywords, values = _layout(args, kwargs)
        arguments = Arguments(name, (layout, keywords, *values), pin=False)
        if arguments.objects:
            raise ExportError(f"operator {name} has an argument ONNX cannot hold: {arguments.objects}")
        attrs = dict(arguments.attrs, output_tensor_types=[_dtypes.onnx_type(t.dtype) for t in outputs],
                     output_tensor_ranks=[t.dim() for t in outputs], training_mode=0, safe_run_mode=0,
                     call_index=next(_call_numbers))
        nodes = emit_python_op(arguments.tensors, attrs, [t.dtype for t in outputs], [list(t.shape) for t in outputs])
        return _refilled(result, iter(nodes[1:]))

    emit.__name__ = emit.__qualname__ = f"ortbridge_fallback_{name.replace('::', '_').replace('.', '_')}"
    return emit


def _masked(op: OpOverload, result, args: tuple, kwargs: dict):
    """`result` with None for each output an `output_mask` argument leaves out, which the
    operator returns as None when it runs (native_batch_norm_backward's meta function, which the
    trace runs, gives a tensor there): the node's outputs are those it returns."""
    names = [a.name for a in op._schema.arguments]
    if "output_mask" not in names:
        return result
    position = names.index("output_mask")
    mask = args[position] if position < len(args) else kwargs.get("output_mask")
    if mask is None:
        return result
    return type(result)(None if i < len(mask) and not mask[i] else r for i, r in enumerate(result))


def _refilled(result, outputs):
    """`result` with each tensor replaced by the next node output."""
    if isinstance(result, torch.Tensor):
        return next(outputs)
    if isinstance(result, (tuple, list)):
        return type(result)(_refilled(r, outputs) for r in result)
    return result
