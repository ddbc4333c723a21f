"""Function.apply calls as PythonOp nodes: the eager run that records them, and the attributes
of each call (argument layout, output types and ranks, output shapes for the exporters)."""

from __future__ import annotations

import contextlib
import inspect
import struct
import threading

import onnx
import torch

from .. import _dtypes, _literals, registry
from .._runner import uses_setup_context

DOMAIN = "ortbridge"
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


class ExportError(TypeError):
    """A model or argument ortbridge.export cannot turn into ONNX; the message says what to do."""


def bind(func: type, args: tuple, kwargs: dict) -> tuple:
    """apply's arguments as the positional ones torch passes on: for Functions with setup_context
    torch binds keyword and defaulted arguments; other Functions take positional ones only."""
    if uses_setup_context(func):
        bound = inspect.signature(func.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.args)
    if kwargs:
        raise ExportError(f"{func.__qualname__}.apply got keyword arguments {sorted(kwargs)}; torch passes keyword "
                          "arguments only to Functions that define setup_context. Pass them by position.")
    return tuple(args)


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _scalar_kind(value) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if _INT64_MIN <= value <= _INT64_MAX else None
    if isinstance(value, float):
        return "float"
    return None


def _tuple_kind(value) -> str | None:
    """The kind of a non-empty tuple of one scalar kind (ORT's typed tuple attributes)."""
    if not isinstance(value, tuple) or not value:
        return None
    kinds = {_scalar_kind(v) for v in value}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _contains(value, types) -> bool:
    if isinstance(value, types):
        return True
    if isinstance(value, (list, tuple)):
        return any(_contains(v, types) for v in value)
    if isinstance(value, dict):
        return any(_contains(v, types) for v in value.values())
    return False


class Arguments:
    """The argument layout of one call as PythonOp attributes.

    Tensors are node inputs ('d'). Constants ('c'): bool/int/float scalars and one-kind tuples in
    ORT's typed attributes (float64 bits beside the float32 values); other plain values (None,
    str, lists, mixed or nested tuples, dicts, dtypes, devices) in `input_literals`; any other
    object by reference through ortbridge.pin_object, valid only in this process.
    """

    def __init__(self, name: str, args: tuple, tensor_type: type = torch.Tensor):
        self.tensors = []  # the node's inputs (torch._C.Value in a TorchScript graph)
        self.objects = []  # (position, type name) of constants held by reference
        convention = []
        scalars = {"bool": ([], []), "int": ([], []), "float": ([], []), "pointer": ([], [])}
        tuples = {"bool": ([], [], []), "int": ([], [], []), "float": ([], [], [])}
        literals, literal_positions = [], []
        for position, arg in enumerate(args):
            if isinstance(arg, tensor_type):
                convention.append("d")
                self.tensors.append(arg)
                continue
            convention.append("c")
            if _contains(arg, _SYMBOLIC):
                raise ExportError(
                    f"argument {position} of {name}.apply depends on a dynamic dim, but a constant argument is fixed "
                    "in the graph. Compute it inside forward from the tensors, or pass it as a tensor.")
            if _scalar_kind(arg):
                values, positions = scalars[_scalar_kind(arg)]
                values.append(arg)
                positions.append(position)
            elif _tuple_kind(arg):
                values, positions, begins = tuples[_tuple_kind(arg)]
                begins.append(len(values))
                values.extend(arg)
                positions.append(position)
            elif _literals.encodable(arg):
                literals.append(arg)
                literal_positions.append(position)
            elif _contains(arg, torch.Tensor):
                raise ExportError(
                    f"argument {position} of {name}.apply is a {type(arg).__name__} that holds tensors; a node "
                    "input must be a tensor itself. Pass each tensor as its own argument to apply.")
            else:
                values, positions = scalars["pointer"]
                values.append(registry.pin_object(arg))
                positions.append(position)
                self.objects.append((position, type(arg).__name__))
        attrs = {"func_name": name, "input_convention": "".join(convention)}
        for kind, (values, positions) in scalars.items():
            if values:
                attrs[f"input_{kind}_scalars"] = [float(v) if kind == "float" else int(v) for v in values]
                attrs[f"input_{kind}_scalar_positions"] = positions
        if scalars["float"][0]:
            attrs["input_float_scalars_f64"] = [_f64_bits(v) for v in scalars["float"][0]]
        for kind, (values, positions, begins) in tuples.items():
            if values:
                attrs[f"input_{kind}_tuples"] = [float(v) if kind == "float" else int(v) for v in values]
                attrs[f"input_{kind}_tuple_positions"] = positions
                attrs[f"input_{kind}_tuple_begins"] = begins
        if tuples["float"][0]:
            attrs["input_float_tuples_f64"] = [_f64_bits(v) for v in tuples["float"][0]]
        if literals:
            attrs["input_literals"] = _literals.encode(literals)
            attrs["input_literal_positions"] = literal_positions
        self.constants = attrs  # what the constant arguments make of the node

    @property
    def attrs(self) -> dict:
        """The node's attributes: the constants', then the tensor inputs' types and ranks."""
        if not self.tensors:  # (torch's exporter cannot write an empty list as an attribute)
            return dict(self.constants)
        return dict(self.constants, input_tensor_types=[_dtypes.onnx_type(t.dtype) for t in self.tensors],
                    input_tensor_ranks=[t.dim() for t in self.tensors])

    def key(self, shapes: list) -> tuple:
        """Identifies the call by its constants and input types and shapes."""
        frozen = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in self.constants.items())
        return frozen, tuple(t.dtype for t in self.tensors), tuple(tuple(s) for s in shapes)


class Call:
    """One recorded top-level call of an exported Function."""

    def __init__(self, func: type, name: str, args: tuple, result, training: bool, updated: list):
        self.func = func
        arguments = Arguments(name, args)
        self.constants = arguments.constants
        self.objects = arguments.objects
        self.input_shapes = [tuple(t.shape) for t in arguments.tensors]
        self.key = arguments.key(self.input_shapes)
        self.returns_tuple = isinstance(result, tuple)
        outputs = result if self.returns_tuple else (result,)
        for i, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor):
                raise ExportError(f"{name}.forward output {i} is {type(o).__name__}; a PythonOp output must be a "
                                  "tensor. Return tensors only (keep other values on ctx or outside the Function).")
        self.output_dtypes = [o.dtype for o in outputs]
        self.differentiable = [o.requires_grad for o in outputs]  # (False for every output without autograd)
        self.output_shapes = [tuple(o.shape) for o in outputs]
        self.attrs = dict(arguments.attrs, output_tensor_types=[_dtypes.onnx_type(d) for d in self.output_dtypes],
                          output_tensor_ranks=[len(s) for s in self.output_shapes], training_mode=int(training))
        if training:
            self.attrs["input_requires_grads"] = [int(isinstance(a, torch.Tensor) and a.requires_grad) for a in args]
        # An output that is a tensor input forward updated (ctx.mark_dirty) is that input in place.
        tensors = arguments.tensors
        reuse = [next((i for i in updated if o is tensors[i]), -1) for o in outputs]
        self.in_place = {j: i for j, i in enumerate(reuse) if i >= 0}  # output -> tensor input
        not_returned = sorted(set(updated) - set(self.in_place.values()))
        if not_returned:
            raise ExportError(f"{name}.forward updated its tensor input {not_returned[0]} in place without "
                              "returning it; in a graph no other node would see the change. Return that input (with "
                              "ctx.mark_dirty), or update a copy.")
        if self.in_place:
            self.attrs["tensor_reuse_map"] = [-1, *reuse]

    @property
    def name(self) -> str:
        return self.attrs["func_name"]

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
                raise ExportError(f"{self.name}.infer_shape returned shapes of ranks {[len(s) for s in shapes]}, "
                                  f"but forward returned ranks {[len(s) for s in self.output_shapes]}")
            return shapes
        symbols = {}
        for eager, traced in zip(self.input_shapes, traced_inputs):
            for size, dim in zip(eager, traced):
                if not isinstance(dim, int):
                    symbols.setdefault(size, dim)
        return [[symbols[size] if size in symbols else size for size in shape] for shape in self.output_shapes]


def _hint(dim) -> int:
    """The example size behind a traced dim (no guard is added)."""
    return dim if isinstance(dim, int) else dim.node.hint


class CallTable:
    """The recorded calls, looked up by each traced call: same Function, constants, input dtypes
    and example sizes."""

    def __init__(self, calls: list[Call]):
        self.calls = {}
        for call in calls:
            self.calls.setdefault((call.func, call.key), call)

    @property
    def functions(self) -> set:
        return {func for func, _ in self.calls}

    def match(self, func: type, args: tuple, kwargs: dict) -> tuple[Arguments, Call]:
        """The traced call's arguments and the recorded call it is."""
        arguments = Arguments(registry.registered_name(func), bind(func, args, kwargs))
        traced = [[_hint(d) for d in t.shape] for t in arguments.tensors]
        call = self.calls.get((func, arguments.key(traced)))
        if call is None:
            raise ExportError(f"{arguments.attrs['func_name']} was called during tracing with arguments it was not "
                              "called with in the eager run of the example inputs; the model must call its "
                              "Functions the same way on every run with these inputs.")
        return arguments, call


class Recorder:
    """Runs the model once eagerly and records each top-level call of an exported Function:
    registered ones, or every Function with `all_functions` (those are registered here, under
    their qualified names). Calls made inside an exported Function's forward stay inside it."""

    def __init__(self, all_functions: bool, training: bool):
        self.all_functions = all_functions
        self.training = training
        self.calls: list[Call] = []
        self.traced_through: set[str] = set()  # Functions seen but not exported
        self._depth = 0

    def selected_name(self, func: type) -> str | None:
        name = registry.registered_name(func)
        if name is None and self.all_functions:
            registry.register(func)
            name = registry.registered_name(func)
        return name

    def run(self, model, args: tuple, kwargs: dict) -> None:
        """One forward that leaves no trace: buffers (BatchNorm statistics in train mode) and the
        random number generator are as they were, so the export sees the model as it was."""
        grad = torch.enable_grad() if self.training else torch.no_grad()
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        with torch.random.fork_rng(devices=[]), grad, apply_replaced([torch.autograd.Function], self._apply):
            model(*args, **kwargs)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)

    def _apply(self, func, original, args, kwargs):
        name = self.selected_name(func) if self._depth == 0 else None
        if name is None:
            if self._depth == 0:
                self.traced_through.add(registry.qualified_name(func))
            return original(*args, **kwargs)
        args = bind(func, args, kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        versions = [_version(t) for t in tensors]
        self._depth += 1
        try:
            result = original(*args)
        finally:
            self._depth -= 1
        updated = [i for i, (t, v) in enumerate(zip(tensors, versions)) if _version(t) != v]
        self.calls.append(Call(func, name, args, result, self.training, updated))
        return result


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place update count; inference tensors keep none (and are never updated
    in place outside inference mode)."""
    return 0 if t.is_inference() else t._version


_MISSING = object()


@contextlib.contextmanager
def class_attributes_set(changes: list):
    """Set (class, name, value) attributes for the duration; then restore or remove them. One
    thread at a time (exports and captures on other threads wait), so that each restores what
    was there before it, never another thread's change."""
    with _CLASS_ATTRIBUTES_LOCK:
        saved = [(cls, name, cls.__dict__.get(name, _MISSING)) for cls, name, _ in changes]
        for cls, name, value in changes:
            setattr(cls, name, value)
        try:
            yield
        finally:
            for cls, name, old in reversed(saved):
                if old is _MISSING:
                    delattr(cls, name)
                else:
                    setattr(cls, name, old)


_CLASS_ATTRIBUTES_LOCK = threading.RLock()  # (reentrant: a Function's forward may export or capture)


@contextlib.contextmanager
def apply_replaced(classes, hook):
    """Route `cls.apply(*args, **kwargs)` of each class, and of subclasses that inherit its apply,
    to `hook(cls, original_apply_bound_to_cls, args, kwargs)`: on this thread only; other threads
    keep calling the original."""
    thread = threading.get_ident()
    with _CLASS_ATTRIBUTES_LOCK:  # the originals are read under the lock too
        changes = []
        for owner in classes:
            own = owner.__dict__.get("apply")

            def apply(cls, *args, _owner=owner, _own=own, **kwargs):
                original = _own.__get__(None, cls) if _own is not None else super(_owner, cls).apply
                if threading.get_ident() != thread:
                    return original(*args, **kwargs)
                return hook(cls, original, args, kwargs)

            changes.append((owner, "apply", classmethod(apply)))
        with class_attributes_set(changes):
            yield
