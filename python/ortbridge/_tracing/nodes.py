"""A Function call as a PythonOp node: the attributes of its arguments, node naming, and the
quiet call of torch's ONNX exporter."""

from __future__ import annotations

import contextlib
import functools
import logging
import struct
import types
import warnings

import onnx
import torch

from .. import registry
from .._compat.torch_private import ONNX_REGISTRATION_LOGGER
from .._format import dtypes, literals
from .functions import ExportError

DOMAIN = "ortbridge"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


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

    def __init__(self, name: str, args: tuple, tensor_type: type = torch.Tensor, pin: bool = True):
        self.tensors = []  # the node's inputs (torch._C.Value in a TorchScript graph)
        self.objects = []  # (position, type name) of constants held by reference
        self.object_kinds = []  # (position, what identifies the object across runs)
        convention = []
        scalars = {"bool": ([], []), "int": ([], []), "float": ([], []), "pointer": ([], [])}
        tuples = {"bool": ([], [], []), "int": ([], [], []), "float": ([], [], [])}
        json_values, literal_positions = [], []
        for position, arg in enumerate(args):
            if isinstance(arg, tensor_type):
                convention.append("d")
                self.tensors.append(arg)
                continue
            convention.append("c")
            if _contains(arg, _SYMBOLIC):
                raise ExportError(
                    f"argument {position} of {name}.apply depends on a dynamic dim, but a constant argument is fixed "
                    "in the graph. Compute it inside forward from the tensors, or pass it as a tensor."
                )
            if _scalar_kind(arg):
                values, positions = scalars[_scalar_kind(arg)]
                values.append(arg)
                positions.append(position)
            elif _tuple_kind(arg):
                values, positions, begins = tuples[_tuple_kind(arg)]
                begins.append(len(values))
                values.extend(arg)
                positions.append(position)
            elif literals.encodable(arg):
                json_values.append(arg)
                literal_positions.append(position)
            elif _contains(arg, torch.Tensor):
                raise ExportError(
                    f"argument {position} of {name}.apply is a {type(arg).__name__} that holds tensors; a node "
                    "input must be a tensor itself. Pass each tensor as its own argument to apply."
                )
            else:
                held = _held_tensor(arg)
                if held:
                    raise ExportError(
                        f"argument {position} of {name}.apply is a {type(arg).__name__} that holds {held}, a tensor "
                        "of this run: the graph would keep that one tensor for every later run. Pass the tensor "
                        "to apply as an argument of its own."
                    )
                values, positions = scalars["pointer"]
                values.append(registry.pin_object(arg) if pin else 0)
                positions.append(position)
                self.objects.append((position, type(arg).__name__))
                self.object_kinds.append((position, _kind(arg)))
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
        if json_values:
            attrs["input_literals"] = literals.encode(json_values)
            attrs["input_literal_positions"] = literal_positions
        self.constants = attrs  # what the constant arguments make of the node

    @property
    def attrs(self) -> dict:
        """The node's attributes: the constants', then the tensor inputs' types and ranks."""
        if not self.tensors:  # (torch's exporter cannot write an empty list as an attribute)
            return dict(self.constants)
        return dict(
            self.constants,
            input_tensor_types=[dtypes.onnx_type(t.dtype) for t in self.tensors],
            input_tensor_ranks=[t.dim() for t in self.tensors],
        )

    def constants_key(self) -> tuple:
        """The constants (objects by what they are, not their identity: a callable made anew on
        each call matches)."""
        frozen = tuple(
            (k, tuple(v) if isinstance(v, list) else v)
            for k, v in self.constants.items()
            if k != "input_pointer_scalars"
        )
        return frozen, tuple(self.object_kinds)

    def key(self, shapes: list) -> tuple:
        """Identifies the call by its constants and input types and shapes."""
        return (*self.constants_key(), tuple(t.dtype for t in self.tensors), tuple(tuple(s) for s in shapes))


def _held_tensor(obj, depth: int = 0) -> str | None:
    """Describes a tensor (not a parameter) that a callable argument keeps from this run: in a
    closure, default arguments or a functools.partial; None if it keeps none."""
    if isinstance(obj, torch.Tensor):
        return None if isinstance(obj, torch.nn.Parameter) else f"a {tuple(obj.shape)} tensor"
    if depth > 2:
        return None
    if isinstance(obj, (list, tuple)):
        parts = obj
    elif isinstance(obj, dict):
        parts = list(obj.values())
    elif isinstance(obj, functools.partial):
        parts = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, types.FunctionType):
        parts = (
            [_cell_value(c) for c in obj.__closure__ or ()]
            + list(obj.__defaults__ or ())
            + list((obj.__kwdefaults__ or {}).values())
        )
    else:
        return None
    return next((h for h in (_held_tensor(p, depth + 1) for p in parts) if h), None)


def _kind(obj, depth: int = 0):
    """What identifies an object argument from one run to the next: a function by its code and
    what its closure and defaults hold, a bound method by its function and object, a partial by
    its parts, plain values by value; any other object (a module, say) by identity."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if depth > 3:
        return type(obj), id(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj), tuple(_kind(v, depth + 1) for v in obj)
    if isinstance(obj, dict):
        return dict, tuple((k, _kind(v, depth + 1)) for k, v in obj.items())
    if isinstance(obj, types.FunctionType):
        return (
            types.FunctionType,
            obj.__code__,
            tuple(_kind(_cell_value(c), depth + 1) for c in obj.__closure__ or ()),
            _kind(obj.__defaults__, depth + 1),
            _kind(obj.__kwdefaults__, depth + 1),
        )
    if isinstance(obj, types.MethodType):
        return types.MethodType, obj.__func__, id(obj.__self__)
    if isinstance(obj, functools.partial):
        return functools.partial, _kind((obj.func, obj.args, obj.keywords), depth + 1)
    return type(obj), id(obj)


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # (a variable not yet assigned)
        return None


def emit_python_op(inputs: list, attrs: dict, dtypes: list, shapes: list) -> list:
    """In a torch.export trace: a PythonOp node with these attributes, whose outputs after the
    context id have `dtypes` and `shapes`; returns its outputs, the context id first."""
    return list(
        torch.onnx.ops.symbolic_multi_out(
            f"{DOMAIN}::PythonOp", list(inputs), attrs, dtypes=[torch.int64, *dtypes], shapes=[[], *shapes], version=1
        )
    )


def func_name(node: onnx.NodeProto) -> str:
    """The func_name of an ortbridge node: a Function's registered name, or `namespace::op.overload`
    for an operator node (the fallback); "" where it has none."""
    return next((a.s.decode() for a in node.attribute if a.name == "func_name"), "")


def name_nodes(graph: onnx.GraphProto) -> None:
    """Give each ortbridge node a readable, unique name: PythonOp_<Function>_<k>, or for an
    operator node PythonOp_<op>_<k> (aten::convolution_backward.default: convolution_backward)."""
    for k, node in enumerate(n for n in graph.node if n.domain == DOMAIN):
        func = func_name(node)
        short = func.split("::", 1)[1].split(".", 1)[0] if "::" in func else func.rsplit(".", 1)[-1]
        node.name = f"{node.op_type}_{short}_{k}"


def rename_values(graph: onnx.GraphProto, input_names=None, output_names=None) -> None:
    """The graph's first inputs and outputs renamed, in order. An output that is also an input, or
    another output, keeps its value and gets a named copy (Identity)."""
    inputs, outputs = list(input_names or ()), list(output_names or ())
    for what, names, values in (("input", inputs, graph.input), ("output", outputs, graph.output)):
        if len(names) > len(values):
            raise ValueError(f"{len(names)} {what}_names for a graph of {len(values)} {what}s")
    if len(set(inputs + outputs)) < len(inputs + outputs) or not all(
        isinstance(n, str) and n for n in inputs + outputs
    ):
        raise ValueError(f"input_names and output_names must be distinct non-empty strings: {inputs + outputs}")
    taken = {v for node in graph.node for v in (*node.input, *node.output)} | {i.name for i in graph.initializer}
    taken |= {v.name for v in (*graph.input, *graph.output)}
    renamed = {value.name: name for value, name in zip(graph.input, inputs) if value.name != name}
    if clash := (set(renamed.values()) | set(outputs)) & (taken - set(renamed) - {o.name for o in graph.output}):
        raise ValueError(f"names already used in the graph: {sorted(clash)}")
    for value in graph.input:
        value.name = renamed.get(value.name, value.name)
    _renamed_reads(graph, renamed)
    made_by = {v: node for node in graph.node for v in node.output}
    seen = set()
    for value, name in zip(graph.output, outputs):
        old = renamed.get(value.name, value.name)
        if old == name:
            continue
        if old in made_by and old not in seen and old not in {o.name for o in graph.output[len(outputs) :]}:
            node = made_by[old]
            node.output[list(node.output).index(old)] = name
            _renamed_reads(graph, {old: name})
            renamed[old] = name
        else:
            graph.node.append(onnx.helper.make_node("Identity", [old], [name], name=f"{name}_copy"))
        seen.add(old)
        value.name = name
    for info in graph.value_info:
        info.name = renamed.get(info.name, info.name)


def _renamed_reads(graph: onnx.GraphProto, renamed: dict) -> None:
    """Each read of a renamed value, in the graph's nodes and their subgraphs, by its new name."""
    if not renamed:
        return
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
        for a in node.attribute:
            for sub in [a.g] if a.HasField("g") else list(a.graphs):
                _renamed_reads(sub, renamed)


def unname_unread_context_ids(graph: onnx.GraphProto) -> None:
    """An inference PythonOp (a Function in an eval graph or an inference export, an operator run
    by PyTorch) whose context id (0) nothing reads leaves output 0 unnamed, so its kernel allocates
    and writes no tensor for it at each call."""
    read = set(names_read(graph)) | {o.name for o in graph.output}
    for node in graph.node:
        if (
            node.domain == DOMAIN
            and node.op_type == "PythonOp"
            and node.output[0] not in read
            and not any(a.name == "training_mode" and a.i for a in node.attribute)
        ):
            node.output[0] = ""


def names_read(graph: onnx.GraphProto):
    """The value names that the graph's nodes read, their subgraphs' included."""
    for node in graph.node:
        yield from node.input
        for a in node.attribute:
            for subgraph in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                yield from names_read(subgraph)


@contextlib.contextmanager
def quiet_exporter():
    """torch's exporter logs warnings about optional packages that do not concern the user."""
    logger = logging.getLogger(ONNX_REGISTRATION_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            # training=True asks for train mode; torch's advice to call eval() does not apply.
            warnings.filterwarnings("ignore", "Exporting a model while it is in training mode", UserWarning)
            yield
    finally:
        logger.setLevel(level)
