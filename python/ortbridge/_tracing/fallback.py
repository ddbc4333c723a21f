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
import operator
import re

import onnx
import torch
from torch.export.graph_signature import TensorArgument
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

from .. import operators
from .._compat.torch_private import (
    OpOverload,
    detect_fake_mode,
    fx_config,
    onnx_decompositions,
    onnx_exporter,
    onnx_opsets,
    onnx_registry,
    pytree,
    remove_assertion_nodes,
    remove_effect_tokens,
    rename_node,
)
from .._format import dtypes
from .._kernel.lookup import DIM_ORDERS, flatten_outputs, operator_function
from . import kernels
from .functions import ExportError
from .nodes import DOMAIN, Arguments, emit_python_op, func_name
from .record import size_hint

log = logging.getLogger("ortbridge")


aten = torch.ops.aten
# Operators run by PyTorch even though torch's exporter could write them: those it writes
# wrongly (_embedding_bag: the max indices that mode="max" saves for backward), and those with a
# decomposition that ONNX Runtime runs slower than PyTorch runs the operator, chosen per operator
# by benchmarks/fallback_ops.py (both ways, in training steps, in one run).
# (Attention on the CPU too: torch's fused kernel, where ONNX has Softmax between two MatMuls and
# their transposes; its outputs saved for backward are the kernel's own.)
# (And those whose decomposition is an accumulating index write, below, which PyTorch's own kernel
# computes as eager does: embedding's backward, index_add.)
PYTORCH_PREFERRED: set = {
    aten._embedding_bag.default,
    aten.embedding_dense_backward.default,
    aten.index_add.default,
    aten._native_batch_norm_legit_functional.default,
    aten.native_batch_norm_backward.default,
    aten.native_layer_norm_backward.default,
    aten.native_group_norm_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


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


# Index writes that add up the values written to one place (index_put(accumulate=True), which many
# decompositions end in): torch's exporter writes them as ScatterND with reduction "add", which ONNX
# Runtime computes wrongly for repeated indices (kernels.UNSAFE_KERNELS), so PyTorch runs them.
_ACCUMULATING_WRITES = {aten.index_put.default, aten._unsafe_index_put.default}


def _accumulating_write(node: torch.fx.Node) -> bool:
    """Whether `node` is an index write that accumulates (_ACCUMULATING_WRITES)."""
    if node.target not in _ACCUMULATING_WRITES:
        return False
    return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))


def _random(op) -> bool:
    """Whether `op` draws from a random generator (dropout, rand, bernoulli, normal, ...)."""
    return isinstance(op, OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


# Operators whose ONNX form orders equal values otherwise than PyTorch's (kernels.UNSAFE_KERNELS:
# TopK, which ONNX defines with ties by index): a graph that must give eager's results runs them in PyTorch.
_ORDER_OF_TIES = {aten.topk.default, aten.sort.default, aten.sort.stable}


def _in_pytorch(op, eager_exact: bool) -> bool:
    """Whether `op` runs in PyTorch although torch's exporter could write it (or decompose it)."""
    return op in PYTORCH_PREFERRED or (eager_exact and (_random(op) or op in _ORDER_OF_TIES))


# torch's functionalized calls of an operator that writes into its arguments (a custom op with
# mutates_args): (op, **keywords), run as a node of that operator (see ortbridge.operators).
_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


def _operator(node: torch.fx.Node) -> OpOverload | None:
    """The operator a node calls (that of a functionalized call), or None."""
    if node.op != "call_function":
        return None
    if node.target in _FUNCTIONALIZED:
        return node.args[0]
    return node.target if isinstance(node.target, OpOverload) else None


def _needs_fallback(
    node: torch.fx.Node, translated: frozenset, in_pytorch=frozenset(), eager_exact: bool = False
) -> bool:
    op = _operator(node)
    return op is not None and (
        node.target in _FUNCTIONALIZED
        or op not in translated
        or _in_pytorch(op, eager_exact)
        or _accumulating_write(node)
        or node.name in in_pytorch
    )


_CHECK = torch.ops.aten._linalg_check_errors.default
# A check that raises is no dead code: traces keep it on every release (torch 2.13 and later keep it
# behind an effect token), for fold_error_checks to find.
torch.fx.node.has_side_effect(_CHECK)


def fold_error_checks(graph: torch.fx.Graph, inputs_checked: bool = False) -> None:
    """Each linalg error check of `graph` (`_linalg_check_errors` of the info output of, say,
    linalg_inv_ex: the decomposition of linalg.inv) made that operator's own (check_errors=True), so
    that its node raises eager's error for a singular matrix instead of giving inf; the effect
    tokens that ordered the checks removed. `inputs_checked`: the graph's inputs are outputs of a
    graph that checked them (a backward graph's copies of the forward graph's checks)."""
    with_effects = torch.ops.higher_order.with_effects
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _CHECK:
            token, info = None, node.args[0]
        elif node.target is with_effects and node.args[1] is _CHECK:
            token, info = node.args[0], node.args[2]
        else:
            continue
        made_by = info.args[0] if info.op == "call_function" and info.target is operator.getitem else None
        if isinstance(getattr(made_by, "target", None), OpOverload) and "check_errors" in {
            a.name for a in made_by.target._schema.arguments
        }:
            made_by.kwargs = {**made_by.kwargs, "check_errors": True}
        elif not (inputs_checked and info.op == "placeholder"):
            raise ExportError(
                f"{node.args[-1] if token is None else node.args[3]}: an error check of a value that no "
                "operator with a check_errors argument made, which a graph cannot keep"
            )
        for user in list(node.users):  # (the token after the check: the one before it)
            user.replace_all_uses_with(token)
            graph.erase_node(user)
        graph.erase_node(node)
    make, sink = torch.ops.prims._make_token.default, torch.ops.prims._sink_tokens.default
    for node in graph.find_nodes(op="call_function", target=sink):
        if all(getattr(t, "target", None) is make for t in node.args[0]):
            graph.erase_node(node)
    for node in graph.find_nodes(op="call_function", target=make):
        if not node.users:
            graph.erase_node(node)


# ONNX Runtime's refusal of a graph that names the node torch's exporter wrote for FX node X
# (`node_X`, or `node_X__k` for the k-th ONNX node of its translation), or a node ONNX Runtime's
# optimizer made of it (`node_X/<optimizer>/`).
_REFUSED_NODE = re.compile(r"(?:node with name|in node \(|node:) ?'?node_([A-Za-z0-9_]+?)(?:__\d+)?(?:/[^']*)?[')]")


def node_without_kernel(error: str) -> str | None:
    """The FX node (of the decomposed graph) whose ONNX node ONNX Runtime refused, or None."""
    match = _REFUSED_NODE.search(error)
    return match.group(1) if match else None


# ONNX Runtime's refusal of a node its own optimizer made (`<node>/<optimizer>/`: a fusion into an
# operator without a kernel for this type, as FusedMatMul of float64 before 1.20).
_REFUSED_FUSION = re.compile(r"(?:node:|node with name )'[^']*/([A-Za-z0-9_]+)/'")


def optimizer_without_kernel(error: str) -> str | None:
    """The ONNX Runtime optimizer that made the node ONNX Runtime refused, or None."""
    match = _REFUSED_FUSION.search(error)
    return match.group(1) if match else None


def exportable(
    program: torch.export.ExportedProgram,
    in_pytorch=frozenset(),
    opset_version: int | None = None,
    eager_exact: bool = False,
) -> torch.export.ExportedProgram:
    """`program` decomposed as torch's ONNX exporter would decompose it for `opset_version`, each
    call of an operator it cannot write a fallback node; to_onnx translates it. `in_pytorch`:
    names of nodes of the decomposed program to run as fallback nodes too. `eager_exact` (a
    training graph): also, undecomposed, the operators whose ONNX forms give other results than
    eager's where ONNX leaves them open: random operators, so that they draw from torch's generator
    as eager does (ONNX's Dropout, RandomUniform, ... draw from ONNX Runtime's own, which
    torch.manual_seed does not seed), and topk and sort (the order of equal values); a model file
    keeps them in ONNX, which runs without PyTorch."""
    translated, table = _decompositions(onnx_opsets(opset_version)[1])
    # (as torch's exporter decomposes: a dynamic dim may have an example size of 0 or 1)
    with fx_config.patch(backed_size_oblivious=True):
        # Decomposed as torch's exporter would decompose it (less the operators PyTorch runs).
        decomposed = program.run_decompositions({op: f for op, f in table.items() if not _in_pytorch(op, eager_exact)})
        remove_assertion_nodes(decomposed.graph_module)  # (torch's exporter drops them too)
        if decomposed.graph.find_nodes(op="call_function", target=torch.ops.higher_order.with_effects):
            decomposed = remove_effect_tokens(decomposed)  # (2.13 and later: linalg's error checks)
        fold_error_checks(decomposed.graph)
        fallbacks = [n for n in decomposed.graph.nodes if _needs_fallback(n, translated, in_pytorch, eager_exact)]
        if not fallbacks:
            return decomposed
        for node in fallbacks:
            if node.target is aten._unsafe_index_put.default:  # (as index_put, whose indices are checked)
                node.target = aten.index_put.default
            op = _operator(node)
            try:  # (what a model file could not name, the exporter does not write either)
                operator_function(operators.name_of(op))
            except LookupError as e:
                if operators.allowed(op.namespace):
                    raise ExportError(
                        f"operator {operators.name_of(op)} has no ONNX translation and cannot "
                        f"run as a fallback node: {e}"
                    ) from None
            if not operators.allowed(op.namespace):
                raise ExportError(
                    f"operator {operators.name_of(op)} has no ONNX translation, and its "
                    f"namespace is not allowed to run as a fallback node; call ortbridge.allow_operators("
                    f"'{op.namespace}') to let it run in PyTorch inside the graph."
                )
        log.info(
            "operators run by PyTorch inside the graph: %s",
            ", ".join(sorted({operators.name_of(_operator(n)) for n in fallbacks})),
        )
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
        before = {n.name: n.target for n in decomposed.graph.nodes}
        retraced = decomposed.run_decompositions({})
        _names_kept(retraced, before)
        return retraced


def _names_kept(program: torch.export.ExportedProgram, before: dict) -> None:
    """A trace names its nodes afresh (the next call of an operator takes the name of the one
    made a fallback call): each node that traces a node of the graph `before` ({name: target})
    takes that node's name back, the others are named after the node they come from (as
    _emit_in_place names them), so that the nodes ONNX Runtime reports are those `in_pytorch` names."""
    graph = program.graph
    sources = {
        n: origin[-1].name
        for n in graph.nodes
        if n.op == "call_function" and (origin := n.meta.get("from_node")) and origin[-1].name in before
    }
    kept = {n for n, source in sources.items() if before[source] is n.target}
    if all(sources[n] == n.name for n in kept):
        return
    names = {n: n.name for n in sources}
    for n in sources:  # (out of the way first)
        rename_node(n, f"{sources[n]}_{names[n]}_")
    for n in sources:
        rename_node(n, sources[n] if n in kept else f"{sources[n]}_{names[n]}")
    _outputs_named(program)
    program.graph_module.recompile()


def _outputs_named(program: torch.export.ExportedProgram) -> None:
    """The signature's outputs named after the values the graph returns."""
    for spec, value in zip(program.graph_signature.output_specs, program.graph.output_node().args[0]):
        if isinstance(spec.arg, TensorArgument):
            spec.arg = TensorArgument(name=value.name)


def _static_with_elements(graph: torch.fx.Graph) -> bool:
    """Whether the graph's values are all tensors of static shapes with elements: its fallback
    calls can be traced alone. (A symbolic size needs the whole trace; so does a tensor without
    elements, as ONNX's Reshape of an aten reshape, which a trace makes a view, reads a 0 in
    the shape as the input's dim.)"""
    for node in graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) or (
                isinstance(value, torch.Tensor) and not all(isinstance(d, int) and d > 0 for d in value.shape)
            ):
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
    with detect_fake_mode([*values, *flatten_outputs(node.meta["val"])]):
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


def onnx_of(
    program: torch.export.ExportedProgram,
    in_pytorch=frozenset(),
    opset_version: int | None = None,
    eager_exact: bool = False,
    optimize: bool = True,
) -> onnx.ModelProto:
    """`program` as ONNX: exportable, then to_onnx (see both for the arguments), without a node of
    a kernel on the deny list (kernels.UNSAFE_KERNELS: for a graph that is not `eager_exact`, of
    those that compute wrongly what ONNX defines). exportable runs in PyTorch the operators known
    to be written so; should the translation write such a node for another, the FX node it
    translates runs in PyTorch too, and the program is exported again."""
    in_pytorch = set(in_pytorch)
    while True:
        model = to_onnx(exportable(program, in_pytorch, opset_version, eager_exact), opset_version, optimize)
        unsafe = kernels.unsafe_nodes(model, eager_exact)
        if not unsafe:
            if eager_exact:
                in_program_order(model.graph)
            return model
        sources = {kernels.fx_node_of(node) for node, _ in unsafe}
        if None in sources or sources <= in_pytorch:
            node, reason = unsafe[0]
            raise ExportError(
                f"torch's ONNX exporter wrote node {node.name!r} ({node.op_type}), which ONNX Runtime "
                f"computes otherwise than PyTorch ({reason}), and ortbridge could not run what it "
                "translates in PyTorch"
            )
        log.warning(
            "torch's ONNX exporter wrote %s, which ONNX Runtime computes otherwise than PyTorch (%s): "
            "the FX nodes %s run in PyTorch",
            ", ".join(sorted({node.op_type for node, _ in unsafe})),
            unsafe[0][1],
            ", ".join(sorted(sources - in_pytorch)),
        )
        in_pytorch |= sources


def in_program_order(graph: onnx.GraphProto) -> None:
    """Each node with a side effect (a Function's call, whose code may hold state or draw random
    numbers; an operator that draws them) after the one before it in the graph, the program's
    order: ONNX Runtime runs independent nodes in an order of its own, and draws from one
    generator give eager's values only in eager's order. The earlier node's first output becomes
    an ordering input of the later one (attribute ordering_inputs: its last inputs, never read)."""
    before = None
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != "PythonOp" or not _has_side_effects(node):
            continue
        if before is not None:
            node.input.append(before)
            node.attribute.append(onnx.helper.make_attribute("ordering_inputs", 1))
        before = next((o for o in node.output[1:] if o), node.output[0] or before)


def _has_side_effects(node: onnx.NodeProto) -> bool:
    name = func_name(node)
    return "::" not in name or _random(operators.resolve(name))


def to_onnx(
    program: torch.export.ExportedProgram, opset_version: int | None = None, optimize: bool = True
) -> onnx.ModelProto:
    """`program` as exportable returns it, as ONNX: what torch.onnx.export(program, dynamo=True,
    opset_version=opset_version) writes (optimized, unless not `optimize`: then each node is of the
    translation of the FX node it names, where the optimizer's rewrites merge nodes of several),
    with ortbridge's one copy of torch's ONNX translations and without decomposing the program again."""
    opset_version, registry_opset = onnx_opsets(opset_version)
    exporter = onnx_exporter()
    if exporter.export is None:  # (the public export, which builds its own translations)
        return torch.onnx.export(
            program, (), dynamo=True, opset_version=opset_version, verbose=False, optimize=optimize
        ).model_proto
    registry = onnx_registry(registry_opset)
    if exporter.translate is None:  # (torch's export, which decomposes again)
        return exporter.export(
            program, registry=registry, opset_version=opset_version, verbose=False, optimize=optimize
        ).model_proto
    # torch's export of an ExportedProgram after its decomposition (_core.export).
    with fx_config.patch(backed_size_oblivious=True):
        exporter.insert_type_promotion_nodes(program.graph_module)
        exporter.remove_assertion_nodes(program.graph_module)
    # (an output the promotion casts back, as a bfloat16 sum computed in float32, is the cast's
    # value now; the exporter names the outputs after the signature)
    _outputs_named(program)
    onnx_program = exporter.translate(program, registry=registry)
    onnx_program.model = exporter.convert_version(onnx_program.model, opset_version)
    if optimize:
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


def _emitter(target):
    """What a fallback node's FX target becomes: a function that emits the node (an operator's, or
    that of a functionalized call of one: `target` (op, **keywords))."""

    def emit(*args, **kwargs):
        op = args[0] if target in _FUNCTIONALIZED else target
        name = operators.name_of(op)
        with disable_proxy_modes_tracing():  # the operator's outputs in this trace, not recorded
            result = target(*args, **kwargs)
        if target in _FUNCTIONALIZED:
            args = args[1:]
        else:
            result = _masked(op, result, args, kwargs)
        outputs = flatten_outputs(result)
        if _random(op):
            orders = tuple(
                (k, order)
                for k, a in enumerate(args)
                if isinstance(a, torch.Tensor) and (order := _dim_order(a)) is not None
            )
            kwargs = {**kwargs, DIM_ORDERS: orders} if orders else kwargs
        layout, keywords, values = _layout(args, kwargs)
        arguments = Arguments(name, (layout, keywords, *values), pin=False)
        if arguments.objects:
            raise ExportError(f"operator {name} has an argument ONNX cannot hold: {arguments.objects}")
        attrs = dict(
            arguments.attrs,
            output_tensor_types=[dtypes.onnx_type(t.dtype) for t in outputs],
            output_tensor_ranks=[t.dim() for t in outputs],
            training_mode=0,
            safe_run_mode=0,
            call_index=next(_call_numbers),
        )
        nodes = emit_python_op(arguments.tensors, attrs, [t.dtype for t in outputs], [list(t.shape) for t in outputs])
        return _refilled(result, iter(nodes[1:]))

    label = operators.name_of(target) if isinstance(target, OpOverload) else target.name()
    emit.__name__ = emit.__qualname__ = f"ortbridge_fallback_{label.replace('::', '_').replace('.', '_')}"
    return emit


def _dim_order(t: torch.Tensor) -> tuple | None:
    """The order of t's dims in memory, outermost first, where it is not their logical order (a
    transposed view, as attention's output): a random operator fills a new tensor laid out like
    its input (empty_like) in memory order, and ONNX Runtime's tensors are laid out logically."""
    sizes, strides = [size_hint(d) for d in t.shape], [size_hint(s) for s in t.stride()]
    order = sorted(range(t.dim()), key=lambda d: -strides[d])
    moved = [d for d in order if sizes[d] != 1]  # (where a dim of size 1 is does not matter)
    return tuple(order) if moved != sorted(moved) else None


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
