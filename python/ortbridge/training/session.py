"""One AOTAutograd graph (forward, backward or inference) as an ONNX Runtime session that takes
and gives torch tensors: the graph exported (onnx_graph.py), its session, and its runs through
ORT's IOBinding on torch's tensors (inputs bound where their address changes, outputs written
into tensors of torch's, some into the last run's). Graph outputs that are graph inputs (tensors
saved for backward, mostly) skip ONNX Runtime; context ids are written into tensors that release
their context when torch frees them.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time

import onnx
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as ort_capi
import torch

from .. import runtime
from .._compat.ort_private import c_session
from .._compat.torch_private import is_any_autocast_enabled, storage_users, tensor_use_count
from .._copying import NotCopyable
from .._format import dtypes
from .._kernel.runner import context_ids_tensor, lending
from .._tracing import fallback, kernels
from .._tracing.nodes import DOMAIN, func_name
from .devices import cuda_stream, execution_providers, ort_device, placeholder_address
from .model_state import FunctionsAutocast, autocast_on
from .onnx_graph import OnnxGraph
from .threads import SpinningTrial, default_session_options, one_torch_thread

log = logging.getLogger("ortbridge")

# The largest output a graph's run writes into the last run's buffer (GraphSession.recycle).
RECYCLED_BYTES = 1 << 18


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
        autocast: FunctionsAutocast | None = None,
    ):
        self.graph = graph = OnnxGraph(gm, training)
        self.model = self.session = None
        self.autocast = None  # (set below, for a graph that calls Functions)
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
                    providers=execution_providers(providers, graph.device),
                    disabled_optimizers=self._disabled_optimizers,
                )
                break
            except (ort_capi.NotImplemented, ort_capi.InvalidGraph) as e:
                # (asked of the graph before the exporter's optimizer, which merges the nodes of
                # several FX nodes into one, named after one of them)
                unoptimized = graph.to_onnx(in_pytorch, optimize=False)
                refused = kernels.without_kernel(unoptimized, execution_providers(providers, graph.device)) - in_pytorch
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
        # Functions run as nodes under the autocast eager would run them under (FunctionsAutocast).
        if autocast is not None and _calls_functions(self.model):
            self.autocast = autocast
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
        on_device = ort_device(graph.device)
        self.input_bindings = [
            (name, k, ort_device(value.device), dtypes.numpy_type(value.dtype), value)
            for name, k, value in zip(input_names, graph.tensor_inputs, graph.input_values)
        ]
        self.output_bindings = [
            (name, on_device, dtypes.numpy_type(dtype))
            for name, (dtype, is_context) in zip(output_names, graph.outputs)
            if not is_context
        ]
        self.context_inputs = input_names[len(graph.tensor_inputs) :]
        self.context_outputs = [name for name, (_, is_context) in zip(output_names, graph.outputs) if is_context]
        self.stream = cuda_stream(graph.device) if graph.device.type == "cuda" else None
        self.recycle(graph.lent)
        self._bindings: list[_Binding] = []  # not in use
        self.spinning = False  # whether self.session's threads spin during a run (torch on one thread in it)
        self._trial = None
        if session_options is None and graph.device.type == "cpu" and options.intra_op_num_threads > 1:
            self._trial = SpinningTrial(
                runtime.InferenceSession(
                    self.model.SerializeToString(),
                    default_session_options(graph.largest_tensor, spinning=True),
                    providers=execution_providers(providers, graph.device),
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
                return self(args)
        if self.autocast is not None and self.autocast.state and not is_any_autocast_enabled():
            with autocast_on(self.autocast.state):
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
            with one_torch_thread():
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
            where = (t.data_ptr() or placeholder_address(t), t.shape)
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
        for (name, on_device, numpy_type), t in zip(self.output_bindings, (t for t in outputs if t is not None)):
            where = (t.data_ptr() or placeholder_address(t), t.shape)
            if bound[j] != where:
                bind_output(name, on_device, numpy_type, where[1], where[0])
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


def _calls_functions(model: onnx.ModelProto) -> bool:
    """Whether a node of `model` calls an autograd.Function (not an operator: a fallback node)."""
    return any(node.domain == DOMAIN and "::" not in func_name(node) for node in kernels.nodes_of(model))


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
    """ORT's run of `binding` in a run scope (runtime.run_in_scope; the run's outputs hold no
    context id: the contexts it leaves live that no tensor holds are released), `lent` lent to its
    Functions while it runs; the saved context ids in a tensor that owns them, made before the
    scope ends, or None."""

    def run():
        c_session(session).run_with_iobinding(binding.ort, binding.run_options)
        return None if binding.saved_ids is None else context_ids_tensor(binding.saved_ids)

    with lending(lent):
        contexts, unheld = runtime.run_in_scope(run)
    for context_id in unheld:
        runtime.release_context(context_id)
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
        # The saved ones (the first), as a numpy view that runner.context_ids_tensor reads.
        self.saved_ids = self.ids_out.numpy()[:saved_contexts] if saved_contexts else None
        cpu, int64 = ort_device(torch.device("cpu")), dtypes.numpy_type(torch.int64)
        for j, name in enumerate(context_inputs):
            self.ort.bind_input(name, cpu, int64, [], self.ids_in.data_ptr() + 8 * j)
        for j, name in enumerate(context_outputs):
            self.ort.bind_output(name, cpu, int64, [], self.ids_out.data_ptr() + 8 * j)
