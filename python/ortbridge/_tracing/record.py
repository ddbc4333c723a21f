"""The eager run that records a model's Function calls, each with what its node needs: argument
layout, output types, ranks and shapes; and the lookup of a traced call in that record."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import onnx
import torch
from torch.utils.checkpoint import CheckpointFunction

from .. import registry
from .._compat import torch_private
from .._compat.torch_private import (
    CUSTOM_OP_AUTOGRAD_MODULE,
    DYNAMO_FUNCTION_MODULE,
    pytree,
    saved_tensors_hooks_enabled,
)
from .._format import dtypes
from .functions import ExportError, bind
from .interception import intercepted
from .nodes import DOMAIN, Arguments


class Call:
    """One recorded top-level call of an exported Function."""

    def __init__(
        self,
        func: type,
        arguments: Arguments,
        args: tuple,
        result,
        training: bool,
        updated: list,
        saved: list = (),
        writes: dict | None = None,
    ):
        """`arguments` were taken before forward ran (forward may change a list or dict it got);
        `saved`: the tensor inputs forward saved for backward (or a view of); `writes`: {argument
        position: its content after forward} of each list or dict argument forward changed."""
        self.func = func
        self.writes = writes or {}
        self.saved_inputs = [i for i in saved if i not in updated]  # (an input updated in place is the output)
        name = arguments.constants["func_name"]
        self.constants = arguments.constants
        self.objects = arguments.objects
        self.input_shapes = [tuple(t.shape) for t in arguments.tensors]
        self.key = arguments.key(self.input_shapes)
        self.inputs_requiring_grad = tuple(t.requires_grad for t in arguments.tensors)
        self.returns_tuple = isinstance(result, tuple)
        outputs = result if self.returns_tuple else (result,)
        for i, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor):
                raise ExportError(
                    f"{name}.forward output {i} is {type(o).__name__}; a PythonOp output must be a "
                    "tensor. Return tensors only (keep other values on ctx or outside the Function)."
                )
        self.output_dtypes = [o.dtype for o in outputs]
        self.differentiable = [o.requires_grad for o in outputs]  # (False for every output without autograd)
        self.output_shapes = [tuple(o.shape) for o in outputs]
        self.attrs = dict(
            arguments.attrs,
            output_tensor_types=[dtypes.onnx_type(d) for d in self.output_dtypes],
            output_tensor_ranks=[len(s) for s in self.output_shapes],
            training_mode=int(training),
        )
        if training:
            self.attrs["input_requires_grads"] = [int(isinstance(a, torch.Tensor) and a.requires_grad) for a in args]
        # An output that is a tensor input forward updated (ctx.mark_dirty) is that input in place.
        tensors = arguments.tensors
        reuse = [next((i for i in updated if o is tensors[i]), -1) for o in outputs]
        self.in_place = {j: i for j, i in enumerate(reuse) if i >= 0}  # output -> tensor input
        not_returned = sorted(set(updated) - set(self.in_place.values()))
        if not_returned:
            raise ExportError(
                f"{name}.forward updated its tensor input {not_returned[0]} in place without "
                "returning it; in a graph no other node would see the change. Return that input (with "
                "ctx.mark_dirty), or update a copy."
            )
        if self.in_place:
            self.attrs["tensor_reuse_map"] = [-1, *reuse]

    def node_attrs(self, index: int) -> dict:
        """The attributes of the node for the traced call number `index`: each call is a node of its
        own, which no optimizer may merge with another of the same inputs (`call_index` differs)."""
        return dict(self.attrs, call_index=index)

    @property
    def name(self) -> str:
        return self.attrs["func_name"]

    def replay_writes(self, args: tuple) -> None:
        """Makes a traced call's list and dict arguments what forward left them in the eager run
        (a traced call does not run forward; its caller may read what forward wrote there)."""
        for i, content in self.writes.items():
            if isinstance(content, dict):
                args[i].clear()
                args[i].update(content)
            else:
                args[i][:] = content

    def returned(self, tensors: list, outputs) -> object:
        """What apply returns in a traced graph given the node's outputs: as in eager, an input
        updated in place is that output, and later reads of it see the update."""
        outputs = list(outputs)
        for j, i in self.in_place.items():
            outputs[j] = tensors[i].copy_(outputs[j])
        return tuple(outputs) if self.returns_tuple else outputs[0]

    def output_shapes_for(self, traced_inputs: list) -> list:
        """Output shapes for the graph, from the traced input dims (an int where static; a
        symbol where dynamic: a SymInt, or None in TorchScript). The Function's own
        `infer_shape(node, tensor_input_shapes, tensor_input_dtypes) -> (shapes, dtypes)` (ORT's
        signature) decides when it has one and no dim is None; otherwise an output dim whose size
        in the eager run equals a dynamic input dim's example size takes that dim's symbol."""
        infer = getattr(self.func, "infer_shape", None)
        if infer is not None and not any(d is None for dims in traced_inputs for d in dims):
            node = onnx.helper.make_node("PythonOp", [], [], domain=DOMAIN, **self.attrs)
            shapes, _ = infer(node, [list(s) for s in traced_inputs], self.attrs.get("input_tensor_types", []))
            shapes = [list(s) for s in shapes]
            if [len(s) for s in shapes] != [len(s) for s in self.output_shapes]:
                raise ExportError(
                    f"{self.name}.infer_shape returned shapes of ranks {[len(s) for s in shapes]}, "
                    f"but forward returned ranks {[len(s) for s in self.output_shapes]}"
                )
            return shapes
        symbols = {}
        for eager, traced in zip(self.input_shapes, traced_inputs):
            for size, dim in zip(eager, traced):
                if not isinstance(dim, int):
                    symbols.setdefault(size, dim)
        return [[symbols[size] if size in symbols else size for size in shape] for shape in self.output_shapes]


def size_hint(dim) -> int:
    """The example size behind a traced dim (no guard is added)."""
    return dim if isinstance(dim, int) else dim.node.hint


class CallTable:
    """The recorded calls, looked up by each traced call: same Function, constants (objects by
    what they are: _tracing.nodes._kind), input dtypes and example sizes; then, among those, the one
    whose tensor inputs needed a gradient where the traced call's do (which outputs are
    differentiable depends on it: f(x, 1.0) on a parameter's path and on a constant tensor)."""

    def __init__(self, calls: list[Call]):
        self.calls: dict = {}  # (func, key) -> {inputs_requiring_grad: call}
        for call in calls:
            self.calls.setdefault((call.func, call.key), {}).setdefault(call.inputs_requiring_grad, call)
        self._matched = set()

    @property
    def functions(self) -> set:
        return {func for func, _ in self.calls}

    def match(self, func: type, args: tuple, kwargs: dict) -> tuple[Arguments, Call]:
        """The traced call's arguments and the recorded call it is."""
        args = bind(func, args, kwargs)
        arguments = Arguments(registry.registered_name(func), args, pin=False)
        traced = [[size_hint(d) for d in t.shape] for t in arguments.tensors]
        key = (func, arguments.key(traced))
        recorded = self.calls.get(key)
        if recorded is None:
            raise ExportError(
                f"{arguments.constants['func_name']} was called during tracing with arguments it was "
                f"not called with in the eager run of the example inputs: {self._difference(key)}. The "
                "model must call its Functions the same way on every run with these inputs."
            )
        self._matched.add(key)
        requiring_grad = tuple(t.requires_grad for t in arguments.tensors)
        call = recorded.get(requiring_grad) or next(iter(recorded.values()))
        call.replay_writes(args)
        return arguments, call

    def _difference(self, key) -> str:
        func, (constants, objects, dtypes, shapes) = key
        recorded = [k for f, k in self.calls if f is func]
        if not recorded:
            return "the eager run made no call of it"
        eager_constants, eager_objects, eager_dtypes, eager_shapes = recorded[0]
        for (name, value), (eager_name, eager_value) in zip(constants, eager_constants):
            if (name, value) != (eager_name, eager_value):
                return f"attribute {name} is {value!r} here, {eager_value!r} in the eager run"
        if objects != eager_objects:
            position, kind = (
                next(a for a, b in zip(objects, eager_objects) if a != b)
                if len(objects) == len(eager_objects)
                else ("?", None)
            )
            what = f", a {kind[0].__name__}," if isinstance(kind, tuple) and isinstance(kind[0], type) else ""
            return (
                f"argument {position}{what} is another object than in the eager run (a function with other code or "
                "closure values, a method of another object, or another object: one the forward makes anew at each "
                "call, as a cache it fills, cannot be a node's constant; turn it off, as with use_cache=False)"
            )
        if dtypes != eager_dtypes:
            return f"tensor input dtypes are {list(dtypes)} here, {list(eager_dtypes)} in the eager run"
        if shapes != eager_shapes:
            return f"tensor input shapes are {list(shapes)} here, {list(eager_shapes)} in the eager run"
        return f"constants {dict(constants)} here, {dict(eager_constants)} in the eager run"

    def require_all_reached(self, tracer: str) -> None:
        """Refuses a trace that reached no call of some recorded Function (apply was not
        intercepted, or the trace took another path): it would have been inlined silently."""
        missed = sorted(
            {
                call.name
                for key, recorded in self.calls.items()
                if key not in self._matched
                for call in recorded.values()
            }
        )
        if missed:
            raise ExportError(
                f"the eager run called {', '.join(missed)}, but {tracer} never reached its apply, so it "
                "cannot be a PythonOp. Call the Function through its apply (Fn.apply, a stored Fn.apply, "
                "functools.partial of it), the same way on every run with these inputs."
            )


# Functions that torch makes, which are not the model's: those of a graph from dynamo, which inlined
# the Function already, and a custom operator's autograd (register_autograd), which the trace keeps
# as that operator and its registered backward.
_NOT_THE_MODELS = (DYNAMO_FUNCTION_MODULE, CUSTOM_OP_AUTOGRAD_MODULE)


def checkpointed_segment(args: tuple, kwargs: dict):
    """What torch.utils.checkpoint's reentrant Function (use_reentrant=True; transformers' default
    gradient checkpointing) computes, as a graph can hold it: CheckpointFunction.apply(function,
    preserve_rng_state, *args) runs function(*args) and, in backward, again under the same random
    state, so its gradients are the segment's own derivative's. Eager's gives none where no tensor
    argument requires grad: then under no_grad too. (The Function itself cannot be traced:
    AOTAutograd derives with torch.autograd.grad, which it refuses.)"""
    assert not kwargs, "CheckpointFunction.apply takes positional arguments"
    function, _, *inputs = args
    needs_grad = any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
    with contextlib.nullcontext() if needs_grad else torch.no_grad():
        return function(*inputs)


class Recorder:
    """Runs the model once eagerly and records each top-level call of an exported Function:
    registered ones, or every Function with `all_functions` (those are registered here, under
    their qualified names). Calls made inside an exported Function's forward stay inside it."""

    def __init__(self, all_functions: bool, training: bool, compiling: bool = True):
        """`compiling`: the run sees torch.compiler.is_compiling() and is_exporting() true, as the
        trace that follows does (torch.export's, AOTAutograd's in a capture), so that library
        code takes one branch in both."""
        self.all_functions = all_functions
        self.training = training
        self.compiling = compiling
        self.calls: list[Call] = []
        self.traced_through: set[str] = set()  # Functions seen but not exported
        self.registered: list[type] = []  # by this recorder (all_functions)
        # Entered around each recorded Function's forward (a capture watches the model's attributes).
        self.around_calls: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self._depth = 0

    def selected_name(self, func: type) -> str | None:
        if func.__module__ in _NOT_THE_MODELS:
            return None
        name = registry.registered_name(func)
        if name is None and self.all_functions:
            registry.register(func)
            self.registered.append(func)
            name = registry.registered_name(func)
        return name

    def unregister_new(self) -> None:
        """Unregisters the Functions this recorder registered: a failed export or capture leaves
        none behind."""
        for func in self.registered:
            registry.unregister(func)

    def run(self, model, args: tuple, kwargs: dict) -> None:
        """One forward that leaves no trace: buffers (BatchNorm statistics in train mode), tensor
        arguments it updates in place (a dynamo graph's buffers are arguments) and the random
        number generator are as they were, so the export sees the model as it was."""
        grad = torch.enable_grad() if self.training else torch.no_grad()
        arguments = [
            x
            for x in pytree.tree_leaves((args, kwargs))
            if isinstance(x, torch.Tensor) and not x.requires_grad and not x.is_inference()
        ]
        states = {id(t): (t, t.detach().clone()) for t in (*model.buffers(), *arguments)}
        # (the CUDA devices' generators too, where the model runs there)
        cuda = sorted(
            {
                t.device.index or 0
                for t in (*model.parameters(), *model.buffers(), *arguments)
                if t.device.type == "cuda"
            }
        )
        try:  # (outside the caller's saved-tensor hooks, as torch.utils.checkpoint's: this run's are not theirs)
            # (compiling state after intercepted: that holds a lock, and the state is the process's)
            with (
                torch.random.fork_rng(devices=cuda),
                grad,
                intercepted(None, self._apply),
                torch_private.compiling_state_context() if self.compiling else contextlib.nullcontext(),
                _saved_tensor_hooks(_detached),
            ):
                model(*args, **kwargs)
        finally:  # (also when a call cannot be recorded)
            with torch.no_grad():
                for tensor, saved in states.values():
                    # (compared by value: batch norm's kernel updates running statistics without a version count)
                    if not torch.equal(tensor, saved):
                        tensor.copy_(saved)

    def _apply(self, func, original, args, kwargs):
        if func is CheckpointFunction and self._depth == 0:
            return checkpointed_segment(args, kwargs)
        name = self.selected_name(func) if self._depth == 0 else None
        if name is None:
            if self._depth == 0 and func.__module__ not in _NOT_THE_MODELS:
                self.traced_through.add(registry.qualified_name(func))
            return original(*args, **kwargs)
        args = bind(func, args, kwargs)
        arguments = Arguments(name, args)  # before forward runs, which may change a list or dict it got
        tensors = arguments.tensors
        versions = [_version(t) for t in tensors]
        containers = {i: _contents(a) for i, a in enumerate(args) if type(a) in (list, dict)}
        saved = set()  # storage addresses of what forward kept for backward
        self._depth += 1
        try:
            with _saved_storages(saved) if self.training else contextlib.nullcontext(), self.around_calls():
                result = original(*args)
        finally:
            self._depth -= 1
        updated = [i for i, (t, v) in enumerate(zip(tensors, versions)) if _version(t) != v]
        for o in result if isinstance(result, tuple) else (result,):  # (kept as ctx.x = x)
            if getattr(o, "grad_fn", None) is not None:
                saved.update(_storage_address(v) for v in vars(o.grad_fn).values() if isinstance(v, torch.Tensor))
                break
        saved.discard(None)
        saved_inputs = [i for i, t in enumerate(tensors) if _storage_address(t) in saved]
        writes = {i: _copy(args[i]) for i, before in containers.items() if not _same(_contents(args[i]), before)}
        for i, content in writes.items():
            if any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(content)):
                raise ExportError(
                    f"{name}.forward put a tensor into its argument {i} (a {type(content).__name__}); "
                    "a graph cannot give it to the caller. Return it as an output instead."
                )
        self.calls.append(Call(func, arguments, args, result, self.training, updated, saved_inputs, writes))
        return result


def _contents(container) -> list:
    """A list's or dict's (key, value) entries."""
    return list(container.items() if isinstance(container, dict) else enumerate(container))


def _same(contents: list, before: list) -> bool:
    """Whether no entry was written: the same keys, each with the same object (by identity)."""
    return len(contents) == len(before) and all(k == b and v is w for (k, v), (b, w) in zip(contents, before))


def _copy(container):
    return dict(container) if isinstance(container, dict) else list(container)


def _saved_storages(addresses: set):
    """Saved-tensor hooks that note the storage address of each tensor saved for backward."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        addresses.add(_storage_address(t))
        return _detached(t)

    return _saved_tensor_hooks(pack)


def _saved_tensor_hooks(pack):
    """Saved-tensor hooks packing with `pack` (none where saved-tensor hooks are disabled)."""
    if not saved_tensors_hooks_enabled():
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # (not t: a saved output would hold its own autograd node, a cycle)


def _storage_address(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: sparse, nested)
        return None


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place update count; inference tensors keep none (and are never updated
    in place outside inference mode)."""
    return 0 if t.is_inference() else t._version
