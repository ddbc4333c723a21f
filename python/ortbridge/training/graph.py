"""One AOTAutograd graph (forward, backward or inference) as an ONNX Runtime session that takes
and gives torch tensors.

The graph is exported with torch's ONNX exporter after each python_op / python_op_grad node is
rewritten to emit an ortbridge PythonOp / PythonOpGrad node. Graph outputs that are graph inputs
(tensors saved for backward, mostly) skip ONNX Runtime; context ids are written into tensors
that release their context when torch frees them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
import statistics
import sys
import threading
import time

import onnx
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as ort_capi
import sympy
import torch

from .. import _C, _dtypes, runtime
from .._copying import NotCopyable
from .._ort_private import c_device, c_session
from .._runner import _from_dlpack, _lent_buffers
from .._torch_private import FloorDiv, PythonPrinter, storage_users, tensor_use_count, unset_fake_temporarily
from ..core import fallback, kernels
from ..core.nodes import DOMAIN, emit_python_op, name_nodes, quiet_exporter, unname_unread_context_ids
from ..core.record import size_hint
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


# A graph whose largest tensor has fewer elements runs on one thread: waking a sleeping thread of
# ORT's pool for each small operator (tens of us) costs more than splitting the operator saves
# (benchmarks/train_step.py --ort-threads 1: the small block's step went from 1.52x eager to 1.00x).
SMALL_GRAPH_ELEMENTS = 1 << 16


# The largest output a graph's run writes into the last run's buffer (GraphSession.recycle).
RECYCLED_BYTES = 1 << 18


def default_session_options(largest_tensor: int | None = None, spinning: bool = False) -> ort.SessionOptions:
    """As many threads as torch uses (one for a graph whose largest tensor has fewer than
    SMALL_GRAPH_ELEMENTS elements), which sleep between runs: torch runs in between (the
    Functions, the optimizer, the rest of the step), and ORT's default spinning threads would
    take its cores. `spinning`: they spin while a run lasts instead (see _SpinningTrial)."""
    options = ort.SessionOptions()
    small = largest_tensor is not None and largest_tensor < SMALL_GRAPH_ELEMENTS
    options.intra_op_num_threads = 1 if small else torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


class _SpinningTrial(NotCopyable):
    """ORT's pool threads either sleep between runs, waking for each parallel operator (tens of
    us each), or spin while a run lasts, with torch on one thread inside it (torch's work in
    Functions and fallback nodes would otherwise share its cores with them: steps several times
    slower). Which is faster depends on the graph: spinning made vit_tiny's step 1.52 -> 1.32x
    eager's and a mobilenetv3's 1.26 -> 1.11x, but the larger CNN's, whose convolutions'
    backward runs in torch, 1.34 -> 2.17x. So a CPU graph with several threads has a second,
    spinning session at first; its runs alternate between the two (the first of each not
    counted) until each has RUNS timed runs, then the faster by median stays (sleeping unless
    spinning is 5% faster) and the other session is dropped."""

    RUNS = 5

    def __init__(self, session):
        self.session = session  # the spinning one
        self.bindings: list[_Binding] = []
        self.times: dict[bool, list] = {False: [], True: []}
        self.started = 0

    def next_spinning(self) -> bool:
        self.started += 1
        return self.started % 2 == 0

    def record(self, spinning: bool, seconds: float) -> bool:
        """Counts a run; True once the trial is decided."""
        self.times[spinning].append(seconds)
        return all(len(t) > self.RUNS for t in self.times.values())

    def spinning_wins(self) -> bool:
        sleeping, spinning = (statistics.median(self.times[k][1:]) for k in (False, True))
        return spinning < 0.95 * sleeping


_threads = threading.local()  # depth: runs open on this thread that keep torch on one thread


@contextlib.contextmanager
def _one_torch_thread():
    """Torch on one thread on this thread while a spinning session's run lasts. The setting is
    OpenMP's, per thread; the outermost run restores it."""
    depth = getattr(_threads, "depth", 0)
    if depth == 0:
        _threads.previous = torch.get_num_threads()
        torch.set_num_threads(1)
    _threads.depth = depth + 1
    try:
        yield
    finally:
        _threads.depth = depth
        if depth == 0:
            torch.set_num_threads(_threads.previous)


def _device_of(values: list) -> torch.device:
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


_streams: dict = {}  # CUDA device -> the stream ONNX Runtime runs every graph on there


def _cuda_stream(device: torch.device):
    """A torch stream of ortbridge's own on `device` (ORT refuses the default one), made ORT's
    compute stream: the Functions' kernels, ORT's and the copies are all ordered on it."""
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def _providers(providers, device: torch.device) -> list:
    """The execution providers of a graph on `device`: the CUDA provider of that device on
    ortbridge's stream (the user's options kept), then the CPU."""
    if device.type == "cpu":
        return providers or ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError(
            f"the module's tensors are on {device}, but this onnxruntime has no "
            "CUDAExecutionProvider: install onnxruntime-gpu (pip install 'ortbridge[gpu]')"
        )
    ours = {
        "device_id": str(device.index or 0),
        "has_user_compute_stream": "1",
        "user_compute_stream": str(_cuda_stream(device).cuda_stream),
    }
    given = [(p, {}) if isinstance(p, str) else tuple(p) for p in providers or ["CPUExecutionProvider"]]
    cuda = [(name, {**options, **ours}) for name, options in given if name == "CUDAExecutionProvider"]
    return (cuda or [("CUDAExecutionProvider", ours)]) + [p for p in given if p[0] != "CUDAExecutionProvider"]


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
        # lends the Function (_runner._lent_buffers): saved without a copy, and alive while saved.
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
        self.device = _device_of(placeholders + computed)
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
        model = _export(self.module, self.input_values, in_pytorch, optimize)
        _spread_gradient_outputs(model.graph)
        unname_unread_context_ids(model.graph)
        name_nodes(model.graph)  # (errors name the node: PythonOp_<Function>_<k>)
        return model


class GraphSession(NotCopyable):
    """Runs an AOTAutograd graph in ONNX Runtime: called with a list of tensors (and ints, for
    symbolic sizes; AOTAutograd's boxed calling convention), returns the graph's outputs. A
    graph with nothing to compute (its outputs are inputs, sizes or constants) has no session."""

    _boxed_call = True

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        training: bool,
        session_options: ort.SessionOptions | None = None,
        providers=None,
        save_as: str | None = None,
    ):
        self.graph = graph = OnnxGraph(gm, training)
        self.model = self.session = None
        self.recycled: list[int] = []  # outputs written into the last run's buffers (see recycle)
        if not graph.outputs:
            return
        # A node ONNX Runtime has no kernel for (an operator on a type its kernels do not take: Relu
        # of int64, ArgMax of bool, most of bfloat16 on the CPU) runs in PyTorch instead, and the
        # graph is exported again: once refused, every such node of the graph at once (kernels.py).
        # A node ONNX Runtime's optimizer made without a kernel for its type: that optimizer is off.
        in_pytorch: set[str] = set()
        self._disabled_optimizers: set[str] = set()
        options = session_options or default_session_options(graph.largest_tensor)
        while True:
            self.model = graph.to_onnx(in_pytorch)
            try:
                self.session = runtime.InferenceSession(
                    self.model.SerializeToString(),
                    options,
                    providers=_providers(providers, graph.device),
                    disabled_optimizers=self._disabled_optimizers,
                )
                break
            except (ort_capi.NotImplemented, ort_capi.InvalidGraph) as e:
                # (asked of the graph before the exporter's optimizer, which merges the nodes of
                # several FX nodes into one, named after one of them)
                unoptimized = graph.to_onnx(in_pytorch, optimize=False)
                refused = kernels.without_kernel(unoptimized, _providers(providers, graph.device)) - in_pytorch
                if refused:
                    log.info(
                        "ONNX Runtime has no kernel for %s (it refused the graph: %s): they run in PyTorch",
                        ", ".join(sorted(refused)),
                        str(e).splitlines()[0],
                    )
                    in_pytorch |= refused
                    continue
                optimizer = fallback.optimizer_without_kernel(str(e))
                if optimizer is not None and optimizer not in self._disabled_optimizers:
                    log.info(
                        "ONNX Runtime's %s made a node it has no kernel for (%s): that optimizer is off",
                        optimizer,
                        str(e).splitlines()[0],
                    )
                    self._disabled_optimizers.add(optimizer)
                    continue
                node = fallback.node_without_kernel(str(e))
                if node is None or node in in_pytorch:
                    raise
                log.info("ONNX Runtime cannot run %s (%s): it runs in PyTorch", node, str(e).splitlines()[0])
                in_pytorch.add(node)
            finally:
                if save_as:
                    onnx.save(self.model, save_as)
        if graph.device.type == "cuda" and "CUDAExecutionProvider" not in self.session.get_providers():
            raise RuntimeError(
                f"ONNX Runtime could not start its CUDA execution provider for {graph.device} (its "
                "log says why: often CUDA or cuDNN libraries it did not find; "
                "onnxruntime.preload_dlls() loads torch's)"
            )
        input_names = [i.name for i in self.session.get_inputs()]
        output_names = [o.name for o in self.session.get_outputs()]
        if len(input_names) != len(graph.input_values) or len(output_names) != len(graph.outputs):
            raise RuntimeError(
                f"the exported graph has {len(input_names)} inputs and {len(output_names)} "
                f"outputs, the captured one {len(graph.input_values)} and {len(graph.outputs)}"
            )
        # What each run binds: (ONNX name, argument index, ORT device, numpy type) per input, (name,
        # ORT device, numpy type) per output, through the C binding (the Python wrapper costs ~10 us
        # per tensor). Context ids are bound once per binding instead (see _Binding).
        on_device = _ort_device(graph.device)
        self.input_bindings = [
            (name, k, _ort_device(value.device), _dtypes.numpy_type(value.dtype), value)
            for name, k, value in zip(input_names, graph.tensor_inputs, graph.input_values)
        ]
        self.output_bindings = [
            (name, on_device, _dtypes.numpy_type(dtype))
            for name, (dtype, is_context) in zip(output_names, graph.outputs)
            if not is_context
        ]
        self.context_inputs = input_names[len(graph.tensor_inputs) :]
        self.context_outputs = [name for name, (_, is_context) in zip(output_names, graph.outputs) if is_context]
        self.stream = _cuda_stream(graph.device) if graph.device.type == "cuda" else None
        self.recycle(graph.lent)
        self._bindings: list[_Binding] = []  # not in use
        self.spinning = False  # whether self.session's threads spin during a run (torch on one thread in it)
        self._trial = None
        if session_options is None and graph.device.type == "cpu" and options.intra_op_num_threads > 1:
            self._trial = _SpinningTrial(
                runtime.InferenceSession(
                    self.model.SerializeToString(),
                    default_session_options(graph.largest_tensor, spinning=True),
                    providers=_providers(providers, graph.device),
                    disabled_optimizers=self._disabled_optimizers,
                )
            )

    @property
    def runs_contexts(self) -> bool:
        """Whether its runs take Functions' contexts (a backward graph's PythonOpGrads)."""
        return bool(self.graph.context_args)

    def computes(self, i: int) -> bool:
        """Whether output i is a value (not None: no gradient)."""
        return self.graph.sources[i][0] != "none"

    def recycle(self, computed: list) -> None:
        """Recycle these computed outputs, which never leave the caller's hands (lent buffers,
        tensors saved for backward): a run writes each into the last run's buffer where nothing
        holds that any more (_unshared), not into a new one it allocates and binds (~3-10 us a
        tensor). Only up to RECYCLED_BYTES each: above, the work on a tensor dwarfs that, and the
        buffer would stay between steps, where eager frees it. Not on CUDA, where torch's
        caching allocator already reuses memory, ordered by stream."""
        if self.graph.device.type == "cpu":
            small = (j for j in computed if self.graph.output_bytes[j] <= RECYCLED_BYTES)
            self.recycled = sorted({*self.recycled, *small})

    def __call__(self, args: list) -> list:
        if torch.is_inference_mode_enabled():  # Functions see normal tensors, as in an ORT session of their own
            with torch.inference_mode(False):
                return self._run(args)
        return self._run(args)

    def _run(self, args: list) -> list:
        graph = self.graph
        inputs = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]  # (alive until the run ends)
        args.clear()  # the boxed convention: the callee may free its inputs early
        outputs, contexts = self._run_session(inputs) if self.session is not None else ([], None)
        size_outputs = graph.size_outputs(inputs)[0] if graph.size_outputs else ()
        by_kind = {"input": inputs, "size": size_outputs, "onnx": outputs, "ids": (contexts,), "id": contexts}
        return [None if s[0] == "none" else s[1] if s[0] == "constant" else by_kind[s[0]][s[1]] for s in graph.sources]

    def _run_session(self, inputs: list) -> tuple:
        trial = self._trial
        if trial is None:
            return self._run_with(self.session, self._bindings, self.spinning, inputs)
        spinning = trial.next_spinning()
        started = time.perf_counter()
        outputs = (
            self._run_with(trial.session, trial.bindings, True, inputs)
            if spinning
            else self._run_with(self.session, self._bindings, False, inputs)
        )
        if trial.record(spinning, time.perf_counter() - started) and self._trial is trial:
            self._trial = None
            if trial.spinning_wins():
                self.session, self._bindings, self.spinning = trial.session, trial.bindings, True
            log.info(
                "graph of %d nodes: ORT's threads %s during its runs (median of %d runs: %.0f us spinning, "
                "%.0f sleeping)",
                len(self.model.graph.node),
                "spin" if self.spinning else "sleep",
                trial.RUNS,
                *(1e6 * statistics.median(trial.times[k][1:]) for k in (True, False)),
            )
        return outputs

    def _run_with(self, session, bindings: list, spinning: bool, inputs: list) -> tuple:
        # ORT's own IOBinding binding, reused: its Python wrapper asks the session for its
        # providers on every run. One per concurrent run (another thread, a nested call).
        binding = (
            bindings.pop()
            if bindings
            else _Binding(
                session,
                self.context_inputs,
                self.context_outputs,
                self.graph.saved_contexts,
                len(self.input_bindings) + len(self.output_bindings),
            )
        )
        try:
            if not spinning:
                return self._run_bound(session, binding, inputs)
            with _one_torch_thread():
                return self._run_bound(session, binding, inputs)
        finally:
            bindings.append(binding)

    def _run_bound(self, session, binding: _Binding, inputs: list) -> tuple:
        """(the graph's computed outputs, None for each context id; the saved context ids' tensor or None)"""
        # A tensor is bound again only where its address or shape differs from the binding's (a
        # bind of the same pointer and shape binds the same thing): parameters keep their
        # buffers between steps.
        bind_input, bind_output, bound = binding.ort.bind_input, binding.ort.bind_output, binding.bound
        for j, (name, k, device, numpy_type, value) in enumerate(self.input_bindings):
            t = inputs[k]
            where = (t.data_ptr() or _placeholder_address(t), t.shape)
            if bound[j] != where:
                # (a tensor of another dtype, device or size is in another buffer: checked here only)
                if t.dtype != value.dtype or t.device != value.device or not _fits(t.shape, value.shape):
                    raise GraphInputChanged(name, t, value)
                bind_input(name, device, numpy_type, where[1], where[0])
                bound[j] = where
        graph = self.graph
        if len(graph.context_args) == 1:  # (the step's vector of ids, or one id: a copy costs a third of a cat)
            binding.ids_in.copy_(inputs[graph.context_args[0]])
        elif graph.context_args:
            torch.cat([inputs[k].view(-1) for k in graph.context_args], out=binding.ids_in)
        device, kept = graph.device, binding.kept
        outputs = [
            None
            if is_context
            else kept[j].detach()
            if j in kept and kept[j].shape == shape and _unshared(kept, j)
            else torch.empty(shape, dtype=dtype, device=device)
            for j, ((dtype, is_context), shape) in enumerate(zip(graph.outputs, graph.output_shapes(inputs)))
        ]
        for j in self.recycled:
            kept[j] = outputs[j]
        j = len(self.input_bindings)
        for (name, ort_device, numpy_type), t in zip(self.output_bindings, (t for t in outputs if t is not None)):
            where = (t.data_ptr() or _placeholder_address(t), t.shape)
            if bound[j] != where:
                bind_output(name, ort_device, numpy_type, where[1], where[0])
                bound[j] = where
            j += 1
        lent = [outputs[j] for j in graph.lent if outputs[j].data_ptr()]
        if self.stream is None:
            return outputs, _run_in_scope(session, binding, lent)
        # ORT's stream starts after torch's work on the inputs and outputs; ORT's run ends once its
        # stream is done (context ids read on the host), and torch's later work waits for it too.
        # (ORT makes its device current on this thread: the caller's is put back.)
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            self.stream.wait_stream(current)
            contexts = _run_in_scope(session, binding, lent)
            current.wait_stream(self.stream)
        return outputs, contexts


class GraphInputChanged(RuntimeError):
    """A graph's input is another dtype, device or size than it was captured for: a parameter or
    buffer changed in place (model.double(), .to(device), .data = ...)."""

    def __init__(self, name: str, given: torch.Tensor, captured: torch.Tensor):
        super().__init__(
            f"graph input {name} is {given.dtype} {list(given.shape)} on {given.device}; the graph was "
            f"captured for {captured.dtype} {list(captured.shape)} on {captured.device}"
        )


def _fits(shape, captured) -> bool:
    """Whether a shape has the captured one's static sizes (a symbolic size takes any)."""
    return len(shape) == len(captured) and all(not isinstance(c, int) or s == c for s, c in zip(shape, captured))


def _references(kept: dict, j: int) -> int:
    t = kept[j]
    return sys.getrefcount(t)


_ONLY_KEPT = _references({0: torch.empty(0)}, 0)  # (a tensor's references that a dict alone holds, seen there)


def _unshared(kept: dict, j: int) -> bool:
    """Whether nothing but `kept` holds its tensor j or that tensor's memory: no other Python
    reference, no C++ one (a tensor autograd saved; torch 2.13 counts those on the Python object
    too), no other tensor on its storage (a view, a detach)."""
    return _references(kept, j) == _ONLY_KEPT and tensor_use_count(kept[j]) == 1 and storage_users(kept[j]) == 1


def _run_in_scope(session, binding: _Binding, lent: list) -> torch.Tensor | None:
    """ORT's run of `binding` in a run scope (runtime.in_run_scope, for a run whose outputs hold
    no context id: the contexts it leaves live that no tensor holds are released), `lent` in
    _lent_buffers while it runs; the saved context ids in a tensor that owns them, made before
    the scope ends, or None."""
    for t in lent:
        _lent_buffers[t.data_ptr()] = t
    _C._begin_run()
    try:
        c_session(session).run_with_iobinding(binding.ort, binding.run_options)
        contexts = None if binding.saved_ids is None else _from_dlpack(_C.context_ids_capsule(binding.saved_ids))
    except BaseException:
        _C._end_run(failed=True)
        raise
    finally:
        for t in lent:
            del _lent_buffers[t.data_ptr()]
    for context_id in _C._end_run(failed=False):
        _C.release_context(context_id)
    return contexts


class _Binding(NotCopyable):
    """ORT's IOBinding of a session, with its context ids bound once to buffers of their own (a
    bind costs about as much as a Function call): ORT writes a forward graph's ids into `ids_out`;
    a backward graph's are copied into `ids_in` before each run. One per concurrent run."""

    def __init__(self, session, context_inputs: list, context_outputs: list, saved_contexts: int, tensors: int):
        self.ort = ort_capi.SessionIOBinding(c_session(session))
        self.run_options = ort.RunOptions()  # (ORT makes one for each run given None: ~1 us)
        self.bound: list = [None] * tensors  # (address, shape) of each input, then output, bound now
        self.kept: dict[int, torch.Tensor] = {}  # output index -> the last run's tensor (recycled outputs)
        self.ids_in = torch.zeros(len(context_inputs), dtype=torch.int64)
        self.ids_out = torch.zeros(len(context_outputs), dtype=torch.int64)
        # The saved ones (the first), as a numpy view that _C.context_ids_capsule reads.
        self.saved_ids = self.ids_out.numpy()[:saved_contexts] if saved_contexts else None
        cpu, int64 = _ort_device(torch.device("cpu")), _dtypes.numpy_type(torch.int64)
        for j, name in enumerate(context_inputs):
            self.ort.bind_input(name, cpu, int64, [], self.ids_in.data_ptr() + 8 * j)
        for j, name in enumerate(context_outputs):
            self.ort.bind_output(name, cpu, int64, [], self.ids_out.data_ptr() + 8 * j)


def _ort_device(device: torch.device):
    return c_device(device.type, device.index or 0)


_PLACEHOLDERS: dict = {}  # device -> a small tensor there


def _placeholder_address(t: torch.Tensor) -> int:
    """An address on t's device for a tensor without elements (whose own is 0, which ORT refuses
    to bind)."""
    assert t.numel() == 0, "a tensor with elements at address 0"
    if t.device not in _PLACEHOLDERS:
        _PLACEHOLDERS[t.device] = torch.empty(16, dtype=torch.uint8, device=t.device)
    return _PLACEHOLDERS[t.device].data_ptr()


def _export(gm: torch.fx.GraphModule, inputs: list, in_pytorch: set, optimize: bool = True) -> onnx.ModelProto:
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
        return fallback.to_onnx(
            fallback.exportable(program, in_pytorch=in_pytorch, random_in_pytorch=True), optimize=optimize
        )
