"""One AOTAutograd graph rewritten for torch's ONNX exporter, and its export: python_op /
python_op_grad nodes emit ortbridge PythonOp / PythonOpGrad nodes, sizes given as inputs are read
from the tensors, and the outputs are what ONNX Runtime computes (the rest have sources of their
own: inputs, sizes, constants, context ids). Pure FX and ONNX: no session here (session.py)."""

from __future__ import annotations

import functools
import logging
import math
import operator

import onnx
import sympy
import torch

from .._compat.torch_private import FloorDiv, PythonPrinter, unset_fake_temporarily
from .._copying import NotCopyable
from .._tracing import fallback
from .._tracing.nodes import DOMAIN, emit_python_op, name_nodes, quiet_exporter, unname_unread_context_ids
from .._tracing.record import size_hint
from . import ops

log = logging.getLogger("ortbridge")
_PYTHON_OP = torch.ops.ortbridge.python_op.default
_PYTHON_OP_GRAD = torch.ops.ortbridge.python_op_grad.default
# Views ONNX Runtime makes without a copy (Reshape, Unsqueeze: their output shares the buffer).
_SAME_BUFFER_VIEWS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.unsqueeze.default,
}


def _forward_node(inputs: list, index: int, training: bool, shapes: list) -> list:
    traced = ops.traced_call(index)
    return emit_python_op(inputs, traced.forward_attrs(training), traced.call.output_dtypes, shapes)


def _backward_node(context, grads: list, index: int, shapes: list) -> list:
    traced = ops.traced_call(index)
    return list(
        torch.onnx.ops.symbolic_multi_out(
            f"{DOMAIN}::PythonOpGrad",
            [context, *(g for g in grads if g is not None)],
            traced.backward_attrs([g is not None for g in grads]),
            dtypes=[traced.input_dtypes[i] for i in traced.wanted_gradients()],
            shapes=shapes,
            version=1,
        )
    )


_ARITHMETIC = {sympy.Add: operator.add, sympy.Mul: operator.mul, FloorDiv: operator.floordiv}


class _Sizes:
    """The graph's sizes: an int, or (with dynamic shapes) a symbol read from a dim of a tensor
    input; in the graph for torch's exporter (sym_size nodes), and at run time from the inputs'
    shapes (output shapes, sizes the graph outputs)."""

    def __init__(self, graph: torch.fx.Graph, placeholders: list):
        self.graph = graph
        self.placeholders = placeholders
        self.sources = {}  # symbol -> (placeholder index, dim)
        for k, p in enumerate(placeholders):
            if isinstance(p.meta["val"], torch.Tensor):
                for d, size in enumerate(p.meta["val"].shape):
                    if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                        self.sources.setdefault(size.node.expr, (k, d))
        self._nodes = {}
        self._body = next(n for n in graph.nodes if n.op != "placeholder")  # new nodes go before it, in order

    def in_graph(self, size):
        """`size` for a node's arguments: an int, or a node computing it from the inputs' dims."""
        return self._expr_in_graph(size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size))

    def _expr_in_graph(self, expr):
        if expr.is_number:
            return int(expr)
        if expr not in self._nodes:
            if expr in self.sources:
                k, d = self.sources[expr]
                target, args = torch.ops.aten.sym_size.int, (self.placeholders[k], d)
            elif type(expr) in _ARITHMETIC:
                target, args = _ARITHMETIC[type(expr)], tuple(self._expr_in_graph(a) for a in expr.args)
            else:
                raise NotImplementedError(
                    f"size {expr} is not computed from the dims of graph inputs; capture "
                    "with static shapes (dynamic=False)"
                )
            with self.graph.inserting_before(self._body):
                if len(args) > 2:  # n-ary sums and products, two at a time
                    args = (
                        functools.reduce(lambda a, b: self.graph.call_function(target, (a, b)), args[:-1]),
                        args[-1],
                    )
                self._nodes[expr] = self.graph.call_function(target, args)
        return self._nodes[expr]

    def shapes_in_graph(self, tensors) -> list:
        return [[self.in_graph(d) for d in t.shape] for t in tensors]

    def at_run_time(self, sizes: list):
        """A function of the graph's inputs giving `sizes` (nested lists of ints and SymInts) as
        ints; None where every size is static."""
        exprs = [[d.node.expr if isinstance(d, torch.SymInt) else d for d in shape] for shape in sizes]
        symbols = sorted(
            {sym for shape in exprs for d in shape if not isinstance(d, int) for sym in d.free_symbols}, key=str
        )
        if not symbols:
            return None
        missing = [s for s in symbols if s not in self.sources]
        if missing:
            raise NotImplementedError(f"sizes {missing} are not dims of graph inputs")
        printer = PythonPrinter()
        body = ", ".join("(" + "".join(f"int({printer.doprint(d)})," for d in shape) + ")" for shape in exprs)
        reads = ", ".join(f"args[{self.sources[s][0]}].shape[{self.sources[s][1]}]" for s in symbols)
        compute = eval(f"lambda {', '.join(map(str, symbols))}: [{body}]", {"math": math})
        return eval(f"lambda args: compute({reads})", {"compute": compute})


def _spread_gradient_outputs(graph: onnx.GraphProto) -> None:
    """PythonOpGrad has one output per forward tensor input, empty where no gradient is wanted;
    the exporter wrote only the wanted ones."""
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type == "PythonOpGrad":
            wanted = next(a.ints for a in node.attribute if a.name == "output_tensor_requires_grads")
            produced = iter(list(node.output))
            del node.output[:]
            node.output.extend(next(produced) if w else "" for w in wanted)


def device_of(values: list) -> torch.device:
    """The one device of a graph's tensor inputs and outputs (nodes), context ids aside: they
    live on the host."""
    devices = {
        v.meta["val"].device
        for v in values
        if isinstance(v.meta.get("val"), torch.Tensor)
        and not is_context_id(v)
        and not _is_context_input(v)
        and not _is_context_vector_input(v)
    }
    if len(devices) > 1:
        raise NotImplementedError(
            f"the graph's tensors are on {' and '.join(sorted(map(str, devices)))}; "
            "ortbridge runs a graph on one device: move the module and its arguments there"
        )
    device = devices.pop() if devices else torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"the graph's tensors are on {device}; ortbridge runs graphs on the CPU and on CUDA devices"
        )
    return device


def is_context_id(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and node.args[1] == 0
        and node.args[0].target is _PYTHON_OP
    )


def _is_context_vector(node: torch.fx.Node) -> bool:
    """Whether a forward graph's output is the saved context ids as one vector (partition.py)."""
    return node.target is torch.ops.aten.stack.default and all(is_context_id(n) for n in node.args[0])


def _is_context_input(node: torch.fx.Node) -> bool:
    """Whether a backward graph's input is a context id (a PythonOpGrad takes it as its context)."""
    return any(u.target is _PYTHON_OP_GRAD and u.args[0] is node for u in node.users)


def _is_context_vector_input(node: torch.fx.Node) -> bool:
    """Whether a backward graph's input is the vector of context ids: read only by selects of
    one id each, which PythonOpGrads take as their contexts."""
    return bool(node.users) and all(
        u.target is torch.ops.aten.select.int and u.args[1] == 0 and _is_context_input(u) for u in node.users
    )


class OnnxGraph(NotCopyable):
    """An AOTAutograd graph rewritten for torch's ONNX exporter (pure FX, no ONNX Runtime):
    python_op / python_op_grad nodes emit PythonOp / PythonOpGrad, sizes given as inputs are
    read from the tensors, and the outputs are what ONNX Runtime computes (`computed`). Every
    output of the original graph has a source: ("none",), ("input", k), ("constant", tensor),
    ("size", j), ("onnx", j), ("ids", 0): the saved context ids, in one tensor that owns them,
    or ("id", j): its element j (where AOTAutograd's own partition saved each id alone).

    Context ids travel in the runs' own buffers (see _Binding): a forward graph's first
    `saved_contexts` context-id outputs are the saved ones, in order; a backward graph's context
    ids are its last inputs, one 0-d id each, from the arguments `context_args` in order."""

    def __init__(self, gm: torch.fx.GraphModule, training: bool):
        # (rewrites AOTAutograd's graph in place: the new GraphModule shares it)
        self.module = gm = torch.fx.GraphModule(gm, gm.graph)
        graph = gm.graph
        self.largest_tensor = max(
            (
                math.prod(size_hint(d) for d in v.shape)
                for n in graph.nodes
                if isinstance(v := n.meta.get("val"), torch.Tensor)
            ),
            default=0,
        )
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        sizes = _Sizes(graph, placeholders)
        output = graph.output_node()
        # (first, so that they are the first context ids of the run)
        saved_contexts = [
            i
            for r in output.args[0]
            if r is not None
            for i in (r.args[0] if _is_context_vector(r) else [r] if is_context_id(r) else [])
        ]
        self.saved_contexts = len(saved_contexts)
        computed: list[torch.fx.Node] = list(saved_contexts)
        size_outputs = []
        self.sources = []
        for r in output.args[0]:
            if r is None:
                self.sources.append(("none",))
            elif _is_context_vector(r):
                self.sources.append(("ids", 0))
            elif is_context_id(r):
                self.sources.append(("id", saved_contexts.index(r)))
            elif r.op == "placeholder" and isinstance(r.meta["val"], torch.Tensor):
                self.sources.append(("input", placeholders.index(r)))
            elif r.op == "get_attr":  # a constant of the graph
                self.sources.append(("constant", getattr(gm, r.target)))
            elif not isinstance(r.meta["val"], torch.Tensor):  # a size, for backward
                self.sources.append(("size", len(size_outputs)))
                size_outputs.append(r.meta["val"])
            else:
                if r not in computed:
                    computed.append(r)
                self.sources.append(("onnx", computed.index(r)))
        # Every context id leaves the graph in a tensor that owns it: one backward does not need
        # (its Function's outputs were not differentiable here) is released after the run.
        # Each computed tensor a Function saves for backward leaves it too, into a buffer the run
        # lends the Function (runner.lending): saved without a copy, and alive while saved.
        self.lent: list[int] = []  # indices in `computed` of those tensors
        for node in list(graph.nodes):
            if training and node.target is _PYTHON_OP:
                ids = [u for u in node.users if is_context_id(u)]
                if not ids:
                    with graph.inserting_after(node):
                        ids = [graph.call_function(operator.getitem, (node, 0))]
                        ids[0].meta["val"] = node.meta["val"][0]
                if ids[0] not in computed:
                    computed.append(ids[0])
                for i in ops.traced_call(node.args[1]).call.saved_inputs:
                    saved = node.args[0][i]
                    while saved.target in _SAME_BUFFER_VIEWS:  # (a graph output would be a copy)
                        saved = saved.args[0]
                    if saved.op == "call_function" and saved not in computed:
                        self.lent.append(len(computed))
                        computed.append(saved)
        self.device = device_of(placeholders + computed)
        self.context_args = [
            k
            for k, p in enumerate(placeholders)  # (before python_op_grad is rewritten)
            if _is_context_input(p) or _is_context_vector_input(p)
        ]
        self.outputs = [(n.meta["val"].dtype, is_context_id(n)) for n in computed]  # (dtype, is a context id)
        self.output_bytes = [
            math.prod(size_hint(d) for d in n.meta["val"].shape) * n.meta["val"].dtype.itemsize for n in computed
        ]  # (at the capture's sizes)
        output_shapes = [tuple(n.meta["val"].shape) for n in computed]  # (tuples: compared with torch.Size)
        self.output_shapes = sizes.at_run_time(output_shapes) or (lambda args, shapes=output_shapes: shapes)
        self.size_outputs = sizes.at_run_time([size_outputs]) if size_outputs else None
        for node in list(graph.nodes):
            if node.target is _PYTHON_OP:
                node.target = _forward_node
                node.args = (*node.args, training, sizes.shapes_in_graph(node.meta["val"][1:]))
            elif node.target is _PYTHON_OP_GRAD:
                node.target = _backward_node
                node.args = (*node.args, sizes.shapes_in_graph(node.meta["val"]))
        # Sizes given as inputs are read from the tensors instead: ONNX inputs are tensors.
        self.tensor_inputs = [
            k
            for k, p in enumerate(placeholders)
            if isinstance(p.meta["val"], torch.Tensor) and k not in self.context_args
        ]
        for p in placeholders:
            if not isinstance(p.meta["val"], torch.Tensor):
                p.replace_all_uses_with(sizes.in_graph(p.meta["val"]))
                graph.erase_node(p)
        body = next(n for n in graph.nodes if n.op != "placeholder")
        for k in self.context_args:  # (to the end of the inputs, one 0-d input per id)
            p = placeholders[k]
            if p.meta["val"].dim() == 0:  # (one id)
                body.prepend(p)
                continue
            ids = []
            for j in range(p.meta["val"].shape[0]):
                with graph.inserting_before(body):
                    ids.append(graph.placeholder(f"{p.name}_{j}"))
                ids[-1].meta = dict(next(iter(p.users)).meta)  # (each a 0-d int64)
            for select in list(p.users):
                select.replace_all_uses_with(ids[select.args[2]])
                graph.erase_node(select)
            graph.erase_node(p)
        self.input_values = [p.meta["val"] for p in graph.nodes if p.op == "placeholder"]
        output.args = (tuple(computed),)
        graph.eliminate_dead_code()
        gm.recompile()

    def to_onnx(self, in_pytorch: set = frozenset(), optimize: bool = True) -> onnx.ModelProto:
        """The graph as ONNX; nodes named in `in_pytorch` (of the decomposed graph) run in PyTorch.
        (Not `optimize`d: fallback.to_onnx.)"""
        model = export_graph(self.module, self.input_values, in_pytorch, optimize)
        _spread_gradient_outputs(model.graph)
        unname_unread_context_ids(model.graph)
        name_nodes(model.graph)  # (errors name the node: PythonOp_<Function>_<k>)
        return model


def export_graph(gm: torch.fx.GraphModule, inputs: list, in_pytorch: set, optimize: bool = True) -> onnx.ModelProto:
    """The graph as ONNX, its inputs' symbolic dims dynamic."""
    # (with the traced strides: the graph may view an input in ways only its own layout allows;
    # on its device, where the graph makes its own tensors)
    example = tuple(
        torch.empty_strided(
            [size_hint(d) for d in t.shape], [size_hint(s) for s in t.stride()], dtype=t.dtype, device=t.device
        ).zero_()
        for t in inputs
    )
    dynamic = tuple(
        {d: torch.export.Dim.AUTO for d, size in enumerate(t.shape) if not isinstance(size, int)} for t in inputs
    )
    fallback.fold_error_checks(gm.graph, inputs_checked=True)
    gm.recompile()
    # (under dynamo, the fake mode of its trace is still current)
    with quiet_exporter(), unset_fake_temporarily():
        dynamic = dynamic if any(dynamic) else None
        program = torch.export.export(gm, example, dynamic_shapes=dynamic, strict=False)
        return fallback.onnx_of(program, in_pytorch, eager_exact=True, optimize=optimize)
