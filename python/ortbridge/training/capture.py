"""Capture: a module's forward and backward graphs for one input signature, each run by ONNX
Runtime, glued into torch autograd by AOTAutograd.

1. One eager run records every top-level Function call (the exporter's Recorder): arguments,
   output dtypes and shapes, which outputs are differentiable.
2. AOTAutograd traces the module with fake tensors; each recorded Function's apply becomes
   ortbridge::python_op, whose autograd formula is ortbridge::python_op_grad. The partitioner
   splits the joint graph: python_op in the forward graph, python_op_grad in the backward graph,
   the context id a saved tensor between them.
3. Each graph becomes a GraphSession. A Step (step.py) runs the forward session, saves what
   backward needs, and runs the backward session when torch's autograd asks; where the step needs
   more of AOTAutograd's runtime than that (outputs that alias inputs, say), its wrappers do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
import traceback

import torch
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    StatelessSymbolicContext,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import CheckpointFunction

from .._compat.torch_private import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    TracingContext,
    aot_module_simplified,
    capture_config,
    compiling_state_context,
    forget_real_tensors,
    pytree,
    tracing,
)
from .._copying import NotCopyable
from .._tracing.interception import intercepted
from .._tracing.record import CallTable, Recorder, checkpointed_segment
from . import ops
from .fx_passes import DECOMPOSITIONS, tiled_pads_as_cat
from .model_state import (
    CaptureError,
    FunctionsAutocast,
    attributes,
    autocast_state,
    changed_attributes,
    refuse_caches,
    refuse_changes,
    refuse_mistraced,
)
from .partition import partition
from .session import GraphSession
from .stages import StagedBackward, stages_for
from .step import Step

log = logging.getLogger("ortbridge")


def flatten(tree) -> tuple[list, object]:
    """pytree.tree_flatten, where a dataclass that pytree does not know is a node of its fields
    (not a leaf: its tensors would be the trace's, or constants of the graph). (transformers
    registers its ModelOutputs itself, but not those it first imports while torch compiles.)"""
    leaves, spec = pytree.tree_flatten(tree)
    unknown = {
        type(x)
        for x in leaves
        if dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES
    }
    if not unknown:
        return leaves, spec
    for cls in unknown:
        names = tuple(f.name for f in dataclasses.fields(cls))
        try:
            pytree.register_pytree_node(
                cls,
                lambda x, names=names: ([getattr(x, n) for n in names], names),
                functools.partial(_dataclass_of, cls),
            )
        except ValueError:
            if cls not in pytree.SUPPORTED_NODES:
                raise
            # (another thread registered it meanwhile)
    return flatten(tree)


def _dataclass_of(cls: type, values, names: tuple) -> object:
    """The dataclass made as its caller makes it (through __init__: a ModelOutput is also a dict
    its __post_init__ fills), its other fields then set as they were."""
    fields = dict(zip(names, values))
    obj = cls(**{f.name: fields.pop(f.name) for f in dataclasses.fields(cls) if f.init})
    for name, value in fields.items():
        object.__setattr__(obj, name, value)  # (frozen ones too)
    return obj


class _Tensor:
    """Marks where a tensor goes in a flattened argument list."""


_TENSOR = _Tensor()


def _template(leaves: list) -> list:
    """The leaves with each tensor replaced by the _TENSOR mark."""
    return [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]


def _filled(template: list, tensors) -> list:
    """The template with its marks replaced by `tensors`, in order."""
    given = iter(tensors)
    return [next(given) if x is _TENSOR else x for x in template]


def _channels_last(t: torch.Tensor) -> torch.memory_format | None:
    """channels_last (or its 3-D form) where `t`, a trace's output, is laid out so and not also
    contiguous; else None. (None for symbolic sizes: asking would add guards.)"""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    if t.dim() not in formats or not all(type(s) is int for s in (*t.shape, *t.stride())):
        return None
    f = formats[t.dim()]
    return f if t.is_contiguous(memory_format=f) and not t.is_contiguous() else None


class _Flat(torch.nn.Module):
    """`module(*args, **kwargs)` as a function of the tensors among the arguments, giving the
    tensors among the results (what AOTAutograd traces). The non-tensor leaves of arguments and
    results are constants of the capture."""

    def __init__(self, module: torch.nn.Module, spec, leaves: list):
        super().__init__()
        self.module = module
        self.spec = spec
        self.leaves = _template(leaves)
        self.result_spec = None
        self.result_leaves = None
        self.one_tensor = False
        self.layouts: list = []  # each output tensor's memory format, where eager's is channels_last

    def forward(self, *tensors):
        args, kwargs = pytree.tree_unflatten(_filled(self.leaves, tensors), self.spec)
        leaves, self.result_spec = flatten(self.module(*args, **kwargs))
        self.result_leaves = _template(leaves)
        self.one_tensor = self.result_spec.is_leaf() and self.result_leaves == [_TENSOR]
        outputs = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        layouts = [_channels_last(x) for x in outputs]
        self.layouts = layouts if any(layouts) else []
        return outputs

    def result(self, tensors) -> object:
        if self.layouts:  # (ONNX Runtime's outputs are contiguous: laid out as eager's)
            tensors = [t if f is None else t.contiguous(memory_format=f) for t, f in zip(tensors, self.layouts)]
        if self.one_tensor:  # (the module returned one tensor: no pytree walk)
            return tensors[0]
        return pytree.tree_unflatten(_filled(self.result_leaves, tensors), self.result_spec)


def _python_op_apply(table: CallTable):
    def apply(func, original, args, kwargs):
        if func is CheckpointFunction:  # (as the record run ran it)
            return checkpointed_segment(args, kwargs)
        arguments, call = table.match(func, args, kwargs)
        return ops.python_op_call(call, arguments)

    return apply


def _fakes(tensors: list, dynamic: bool) -> tuple[list, FakeTensorMode, ShapeEnv | None]:
    """The capture's inputs as fake tensors in a fake mode of its own, in which a real tensor the
    module holds (a plain tensor attribute) becomes a constant of the graph. With `dynamic`, every
    dim is a symbol of its own (sizes 0 and 1 stay static, as torch specializes them)."""
    shape_env = ShapeEnv(duck_shape=False) if dynamic else None  # equal example sizes are not assumed equal later
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    if not dynamic:
        return [mode.from_tensor(t) for t in tensors], mode, None
    return (
        [
            mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim()))
            for t in tensors
        ],
        mode,
        shape_env,
    )


def _members(module: torch.nn.Module) -> dict:
    """Parameters, then buffers, by name, as aot_module_simplified lists them (shared ones under each name)."""
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def _member_names(module: torch.nn.Module, params: list, runtime) -> list | None:
    """The names of a capture's parameters and buffers, in its order; None where the order is not
    aot_module_simplified's known one, or its runtime (`runtime`, when it runs the graphs) reads
    another list than `params`."""
    named = _members(module)
    if len(named) != len(params) or any(a is not b for a, b in zip(named.values(), params)):
        return None
    if runtime is not None and not any(_contents(cell) is params for cell in runtime.__closure__ or ()):
        return None
    return list(named)


def _contents(cell) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # (empty)
        return None


_DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
_LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


def _data_dependent_error(error: Exception) -> CaptureError:
    """What a data-dependent failure of the trace means for the user: the operator and the line
    of their code that asked for a tensor's value."""
    user = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_LIBRARIES)]
    where = f" at {user[-1].filename}:{user[-1].lineno} ({user[-1].line})" if user else ""
    func = getattr(error, "func", None)
    what = f"operator {func}" if func is not None else "a condition on tensor values"
    return CaptureError(
        f"the capture traces the module with tensors whose values are unknown, and {what}{where} needs a "
        f"value (first line of torch's error: {str(error).strip().splitlines()[0]}). Take that value from "
        "outside the model, pass it as a non-tensor argument, or move the code into a torch.autograd.Function, "
        "which runs in PyTorch."
    )


class Capture(NotCopyable):
    """The module captured for one signature of (args, kwargs): call it with their tensors.
    With `dynamic`, tensor sizes are symbols: the capture serves every call its guards accept
    (the relations between sizes that the trace relied on)."""

    def __init__(
        self,
        module: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        all_functions: bool,
        dynamic: bool,
        options: dict | None = None,
        name: str = "graph",
    ):
        self.options = options or {}
        self.name = name
        self.autocast = autocast_state()  # (the call's, which its Functions run under: GraphSession)
        self._backward_autocast: FunctionsAutocast | None = None  # (where the backward graph has that of its caller)
        leaves, spec = flatten((args, kwargs))
        self.flat = _Flat(module, spec, leaves)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        recorder = Recorder(all_functions, training=torch.is_grad_enabled())
        try:
            refuse_caches(args, kwargs)
            refuse_mistraced(module)
            before = attributes(module)
            recorder.around_calls = functools.partial(self._watched, module)
            self.written: set = set()  # attributes the Functions' forwards wrote (in PyTorch at every call)
            recorder.run(module, args, kwargs)
            refuse_changes(before, module, added=True, written=self.written)
            # What the record run added (lazy initialization), which the trace must leave as it is. (Not
            # the others: torch's RNNs rebind their flat weights to the trace's tensors, and again to
            # the parameters at their next eager call.)
            added = {k: v for k, v in attributes(module).items() if k not in before}
            table = CallTable(recorder.calls)
            self.sessions: list[GraphSession] = []  # forward or inference graph, then backward graph
            self._guards = None
            fakes, mode, shape_env = _fakes(tensors, dynamic)
            # Library code asks torch.compiler.is_compiling() for its trace-friendly branch: as under torch.export.
            # (The tracing context receives the forward graph's metadata; the backward graph is made
            # with the forward graph, not at the first backward, so that a Step can run both. No saved
            # tensor is a donated buffer, which AOTAutograd's runtime would refuse retain_graph for:
            # ONNX Runtime reuses none.)
            context = TracingContext(mode)
            on_cpu = all(t.device.type == "cpu" for t in (*tensors, *module.parameters(), *module.buffers()))
            fused = on_cpu and torch.backends.cuda.flash_sdp_enabled()  # (unless the caller's sdpa_kernel excludes it)
            attention = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if fused else [SDPBackend.MATH]
            with (
                intercepted({*table.functions, CheckpointFunction}, _python_op_apply(table)),
                sdpa_kernel(attention),
                compiling_state_context(),
                tracing(context),
                capture_config(),
            ):
                try:
                    self.compiled = aot_module_simplified(
                        self.flat,
                        fakes,
                        fw_compiler=self._compiler("forward"),
                        bw_compiler=self._compiler("backward"),
                        inference_compiler=self._compiler("inference"),
                        decompositions=DECOMPOSITIONS,
                        partition_fn=partition,
                    )
                except _DATA_DEPENDENT as e:
                    raise _data_dependent_error(e) from e
                finally:
                    forget_real_tensors(mode)
            table.require_all_reached("AOTAutograd's trace of the module")
            refuse_changes(added, module, added=True)
            if context.fw_metadata is not None:
                context.fw_metadata.bw_donated_idxs = []  # (None reads as "some" at run time)
            self.params = context.params_flat
            self.step = context.fw_metadata and Step.of(context.fw_metadata, self.sessions, [*self.params, *tensors])
            self._member_names = _member_names(self.flat, self.params, self.compiled if self.step is None else None)
            if dynamic:
                code = shape_env.produce_guards_expression(fakes, ignore_static=False)
                self._guards = code and (compile(code, "<ortbridge guards>", "eval"), shape_env)
        except BaseException:
            recorder.unregister_new()  # (a failed capture leaves no Function registered)
            raise

    @contextlib.contextmanager
    def _watched(self, module: torch.nn.Module):
        """Around a recorded Function's forward: the module attributes it writes go to `written`."""
        before = attributes(module)
        yield
        self.written.update(changed_attributes(before, attributes(module)))

    def rebind(self) -> bool:
        """Reads the module's parameters and buffers again by name, for its next runs (other tensors,
        as functional_call gives: their dtypes, devices and sizes are checked where a session binds
        them). False where it cannot: capture again."""
        if self._member_names is None:
            return False
        named = _members(self.flat)
        if not all(name in named for name in self._member_names):
            return False
        self.params[:] = [named[name] for name in self._member_names]  # (in place: AOTAutograd's runtime reads it)
        return True

    def accepts(self, tensors: list) -> bool:
        """Whether the capture serves these tensors (always, for a static one: its key matched)."""
        if not self._guards:
            return True
        code, shape_env = self._guards
        return shape_env.evaluate_guards_expression(code, tensors)

    def _compiler(self, kind: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs) -> GraphSession:
            folder = self.options.get("save_graphs")
            save_as = os.path.join(folder, f"{self.name}_{kind}.onnx") if folder else None
            if folder:
                os.makedirs(folder, exist_ok=True)
            started = time.perf_counter()
            tiled_pads_as_cat(gm)
            with tracing(None):  # (the export traces in a context of its own)
                self.sessions.append(self._session(gm, kind, save_as))
            log.info(
                "%s: %s graph in ONNX Runtime after %.2f s%s",
                self.name,
                kind,
                time.perf_counter() - started,
                f", saved to {save_as}" if save_as else "",
            )
            return self.sessions[-1]

        return compile_graph

    def _session(self, gm: torch.fx.GraphModule, kind: str, save_as: str | None) -> GraphSession | StagedBackward:
        options, providers = self.options.get("session_options"), self.options.get("providers")
        stages = self.options.get("backward_stages")
        # (a backward graph's: its caller's, recorded at each call; a forward graph's: the call's)
        autocast = (
            (FunctionsAutocast() if kind == "backward" else FunctionsAutocast(self.autocast)) if self.autocast else None
        )
        session = None
        if kind == "backward" and (stages or stages_for(gm)) > 1:
            try:
                staged = StagedBackward.of(gm, stages or stages_for(gm), options, providers, save_as, autocast)
            except Exception as e:  # (the graph in one piece stays right: staging only releases gradients sooner)
                (log.warning if stages else log.info)(
                    "%s: the backward graph runs in one piece, not in stages (%s: %s)",
                    self.name,
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                )
                staged = None
            if staged is not None:
                log.info("%s: the backward graph runs in %d stages", self.name, staged.count)
                session = staged
        session = session or GraphSession(gm, kind == "forward", options, providers, save_as, autocast)
        if kind == "backward":  # (recorded at each call only where the backward graph's Functions read it)
            parts = session.sessions if isinstance(session, StagedBackward) else [session]
            self._backward_autocast = autocast if any(s.autocast is not None for s in parts) else None
        return session

    def __call__(self, tensors: list) -> object:
        if self.step is not None:
            return self.flat.result(self.step([*self.params, *tensors]))
        outputs = self.compiled(*tensors)
        if self._backward_autocast is not None:
            self._backward_autocast.record_from(outputs)
        return self.flat.result(outputs)
