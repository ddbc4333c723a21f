"""Deterministic, structure-aware generation of malformed PythonOp / PythonOpGrad graphs.

`make_case(seed, index)` builds one of a set of valid base graphs (the shapes ORTModule and
ortbridge.export write: inference nodes, training forward/backward pairs, several outputs, every
kind of constant, in-place nodes, operator nodes), then applies 1-3 mutations to it. Every 50th
case is a base left intact: those must run, which keeps the bases honest.

Graphs are kept as plain node records until the end, so that a mutation can give an attribute
any type or value, and names any bytes: protobuf refuses non-UTF-8 text in string fields, so such
names are written as same-length ASCII markers and patched into the serialized model.
"""

from __future__ import annotations

import json
import random
import re
import struct
from dataclasses import dataclass, field

import numpy as np
from onnx import AttributeProto, helper, numpy_helper

DOMAIN = "ortbridge"
INT, INTS, FLOAT, FLOATS, STRING, STRINGS, TENSOR = "INT", "INTS", "FLOAT", "FLOATS", "STRING", "STRINGS", "TENSOR"
KINDS = (INT, INTS, FLOAT, FLOATS, STRING, STRINGS, TENSOR)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
BASE_EVERY = 50  # case indices divisible by this are unmutated bases
# The names tests/fuzz/functions.py registers (kept here so that generating needs no torch).
FUNCTION_NAMES = [
    f"fuzz.{n}"
    for n in (
        "Identity",
        "Pass",
        "Scale",
        "Saving",
        "TwoOut",
        "Add",
        "View",
        "NoGrad",
        "InPlace",
        "Shrink",
        "Grow",
        "Make",
    )
]

# ONNX element type -> numpy dtype, for the types with a numpy counterpart (graph inputs).
NUMPY = {
    1: np.float32,
    2: np.uint8,
    3: np.int8,
    4: np.uint16,
    5: np.int16,
    6: np.int32,
    7: np.int64,
    9: np.bool_,
    10: np.float16,
    11: np.float64,
    12: np.uint32,
    13: np.uint64,
    14: np.complex64,
    15: np.complex128,
}
_SIZE = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}  # bytes per element
FLOATING = (1, 10, 11)  # types whose tensors may require a gradient
ARITH = (1, 11, 10, 7, 6, 5, 3, 2)  # types torch's arithmetic covers on the CPU
ANY = ARITH + (9, 4, 12, 13)  # types that at least cross and copy (ORT gives custom ops no complex)
SUPPORTED = tuple(range(1, 8)) + tuple(range(9, 17))
BAD_TYPES = (0, 8, 17, -1, 2**40, 100, 2**31, INT64_MIN)

# Attributes checked against each other: an error naming a partner points at the same mistake.
_GROUPS = [
    ("input_int_scalars", "input_int_scalar_positions"),
    ("input_bool_scalars", "input_bool_scalar_positions"),
    ("input_pointer_scalars", "input_pointer_scalar_positions"),
    ("input_float_scalars", "input_float_scalar_positions", "input_float_scalars_f64"),
    ("input_int_tuples", "input_int_tuple_positions", "input_int_tuple_begins"),
    ("input_bool_tuples", "input_bool_tuple_positions", "input_bool_tuple_begins"),
    ("input_float_tuples", "input_float_tuple_positions", "input_float_tuple_begins", "input_float_tuples_f64"),
    ("input_literals", "input_literal_positions"),
    ("training_mode", "safe_run_mode"),
    ("input_tensor_types", "input_tensor_ranks", "input_tensor_present"),
    ("output_tensor_types", "output_tensor_ranks", "output_tensor_requires_grads"),
    # a producer's output type against its consumer's input type: either side may report it
    ("input_tensor_types", "output_tensor_types"),
    ("input_tensor_ranks", "output_tensor_ranks"),
    # two constants claiming one position: either claim may be the one refused
    tuple(
        f"input_{k}_{s}_positions"
        for k, s in (
            ("bool", "scalar"),
            ("int", "scalar"),
            ("float", "scalar"),
            ("pointer", "scalar"),
            ("bool", "tuple"),
            ("int", "tuple"),
            ("float", "tuple"),
        )
    )
    + ("input_literal_positions",),
]
PARTNERS: dict[str, set] = {}
for _group in _GROUPS:
    for _name in _group:
        PARTNERS.setdefault(_name, set()).update(_group)
# A convention decides which positions are constants and how many tensors there are.
_CONVENTION_PARTNERS = {"input_tensor_types", "input_requires_grads", "input_tensor_ranks"} | {
    n for g in _GROUPS[:8] for n in g if n.endswith("positions")
}
PARTNERS["input_convention"] = {"input_convention"} | _CONVENTION_PARTNERS
PARTNERS["output_convention"] = {
    "output_convention",
    "output_tensor_types",
    "output_tensor_ranks",
    "output_tensor_requires_grads",
}


def related_attributes(name: str) -> set:
    """`name` and the attributes an error about it may name instead."""
    return PARTNERS.get(name, set()) | {name}


# ---------------------------------------------------------------------------------------------
# Graph records


@dataclass
class Node:
    op: str
    name: str
    inputs: list
    outputs: list
    attrs: dict = field(default_factory=dict)  # name -> (kind, value), in order
    domain: str = DOMAIN
    meta: dict = field(default_factory=dict)  # role, func, training, literal entries, peer


@dataclass
class Graph:
    base: str
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)  # [name, elem_type, shape]
    outputs: list = field(default_factory=list)  # [name, elem_type, shape or None]
    value_info: list = field(default_factory=list)  # [name, elem_type, shape or None]
    initializers: dict = field(default_factory=dict)  # name -> numpy array
    feeds: dict = field(default_factory=dict)
    opsets: dict = field(default_factory=lambda: {"": 17, DOMAIN: 1})
    raw: dict = field(default_factory=dict)  # ASCII marker -> the bytes it stands for

    def ortbridge_nodes(self, op=None):
        return [
            n
            for n in self.nodes
            if n.domain == DOMAIN and n.op in ("PythonOp", "PythonOpGrad") and (op is None or n.op == op)
        ]

    def consumers(self, value):
        return [n for n in self.nodes if value in n.inputs]

    def producer(self, value):
        return next((n for n in self.nodes if value in n.outputs), None)

    def rename_value(self, old, new):
        for n in self.nodes:
            n.inputs = [new if v == old else v for v in n.inputs]
            n.outputs = [new if v == old else v for v in n.outputs]
        for lst in (self.outputs, self.value_info, self.inputs):
            for entry in lst:
                if entry[0] == old:
                    entry[0] = new
        if old in self.feeds:
            self.feeds[new] = self.feeds.pop(old)

    def drop_unused_inputs(self):
        used = {v for n in self.nodes for v in n.inputs} | {o[0] for o in self.outputs}
        self.inputs = [i for i in self.inputs if i[0] in used]
        self.feeds = {k: v for k, v in self.feeds.items() if k in used}


@dataclass
class T:
    """A tensor argument: value name, element type, rank, whether it requires a gradient."""

    name: str
    elem_type: int
    rank: int
    requires_grad: bool = False


@dataclass
class Lit:
    """A constant written into input_literals."""

    value: object


@dataclass
class Dtype:
    name: str


@dataclass
class Device:
    name: str


def _lit_json(v):
    if isinstance(v, tuple):
        return {"tuple": [_lit_json(x) for x in v]}
    if isinstance(v, list):
        return [_lit_json(x) for x in v]
    if isinstance(v, dict):
        return {"dict": [[k, _lit_json(x)] for k, x in v.items()]}
    if isinstance(v, Dtype):
        return {"dtype": v.name}
    if isinstance(v, Device):
        return {"device": v.name}
    return v


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _array(nprng, elem_type, shape):
    dtype = NUMPY[elem_type]
    if elem_type == 9:
        return nprng.integers(0, 2, size=shape).astype(np.bool_)
    if elem_type in (1, 10, 11):
        return nprng.standard_normal(size=shape).astype(dtype)
    if elem_type in (14, 15):
        return (nprng.standard_normal(size=shape) + 1j * nprng.standard_normal(size=shape)).astype(dtype)
    return nprng.integers(0, 6, size=shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Base graphs


class _Builder:
    def __init__(self, base, rng, nprng):
        self.g = Graph(base)
        self.rng, self.nprng = rng, nprng
        self.count = 0

    def fresh(self, stem):
        self.count += 1
        return f"{stem}{self.count}"

    def node_name(self, role, what):
        # "node<k>_...": no name is a prefix of another, so a substring test finds exactly it.
        self.count += 1
        return f"node{self.count}_{role}_{what}"

    def shape(self, rank, min_first=1):
        return [self.rng.randint(min_first, 3) if i == 0 else self.rng.randint(1, 3) for i in range(rank)]

    def input(self, elem_type, shape, stem="x"):
        name = self.fresh(stem)
        self.g.inputs.append([name, elem_type, list(shape)])
        self.g.feeds[name] = _array(self.nprng, elem_type, shape)
        return name

    def output(self, name, elem_type, shape):
        """A graph output declared with its exact shape, its rank only, or no shape at all."""
        how = self.rng.random()
        declared = list(shape) if how < 0.4 else [None] * len(shape) if how < 0.8 else None
        self.g.outputs.append([name, elem_type, declared])

    def fw(self, func, args, outs, training=False, **extra):
        """A PythonOp calling `func` on `args` (T or constants); outs: (elem_type, rank) each."""
        conv, tensors, requires, literals = "", [], [], []
        attrs: dict = {}

        def add(key, kind, v):
            attrs.setdefault(key, (kind, []))[1].append(v)

        for position, a in enumerate(args):
            if isinstance(a, T):
                conv += "d"
                tensors.append(a)
                requires.append(int(a.requires_grad))
                continue
            conv += "c"
            requires.append(0)
            if isinstance(a, Lit):
                literals.append((position, json.dumps(_lit_json(a.value))))
            elif isinstance(a, bool):
                add("input_bool_scalars", INTS, int(a)), add("input_bool_scalar_positions", INTS, position)
            elif isinstance(a, int):
                add("input_int_scalars", INTS, a), add("input_int_scalar_positions", INTS, position)
            elif isinstance(a, float):
                add("input_float_scalars", FLOATS, a), add("input_float_scalar_positions", INTS, position)
                add("input_float_scalars_f64", INTS, _f64_bits(a))
            elif isinstance(a, tuple):
                kind = "bool" if isinstance(a[0], bool) else "int" if isinstance(a[0], int) else "float"
                begins = attrs.setdefault(f"input_{kind}_tuple_begins", (INTS, []))[1]
                begins.append(len(attrs.get(f"input_{kind}_tuples", (None, []))[1]))
                for v in a:
                    add(f"input_{kind}_tuples", FLOATS if kind == "float" else INTS, v if kind == "float" else int(v))
                    if kind == "float":
                        add("input_float_tuples_f64", INTS, _f64_bits(v))
                add(f"input_{kind}_tuple_positions", INTS, position)
            else:
                raise TypeError(a)
        if literals:
            attrs["input_literals"] = (STRING, "[" + ",".join(t for _, t in literals) + "]")
            attrs["input_literal_positions"] = (INTS, [p for p, _ in literals])
        head = {"func_name": (STRING, func)}
        if self.rng.random() < 0.3:
            head["call_index"] = (INT, self.rng.randint(0, 5))
        head["input_convention"] = (STRING, conv)
        if tensors or self.rng.random() < 0.5:
            head["input_tensor_types"] = (INTS, [t.elem_type for t in tensors])
        if self.rng.random() < 0.8:
            head["input_tensor_ranks"] = (INTS, [t.rank for t in tensors])
        if training or self.rng.random() < 0.5:
            head["input_requires_grads"] = (INTS, requires)
        attrs = head | attrs
        attrs["output_tensor_types"] = (INTS, [o[0] for o in outs])
        attrs["output_tensor_ranks"] = (INTS, [o[1] for o in outs])
        if training or self.rng.random() < 0.5:
            attrs["training_mode"] = (INT, int(training))
        for k, v in extra.items():
            attrs[k] = v
        what = func.split(".")[-1].replace("::", "_")
        name = self.node_name("fw", what)
        ctx = self.fresh("ctx")
        out_names = [self.fresh("y") for _ in outs]
        node = Node(
            "PythonOp",
            name,
            [t.name for t in tensors],
            [ctx, *out_names],
            attrs,
            meta=dict(
                role="fw",
                func=func,
                training=training,
                conv=conv,
                tensors=tensors,
                outs=list(outs),
                literal_entries=[t for _, t in literals],
            ),
        )
        self.g.nodes.append(node)
        return node

    def bw(self, fw_node, grads, outs, ctx=None):
        """A PythonOpGrad for fw_node. grads: (value name or None, type, rank) per forward output;
        outs: (wanted, type, rank) per forward tensor input. Returns the gradient output names."""
        func = fw_node.meta["func"]
        attrs = {
            "func_name": (STRING, func),
            "output_convention": (STRING, fw_node.meta["conv"]),
            "input_tensor_types": (INTS, [g[1] for g in grads]),
            "input_tensor_ranks": (INTS, [g[2] for g in grads]),
        }
        present = [int(g[0] is not None) for g in grads]
        if not all(present) or self.rng.random() < 0.5:
            attrs["input_tensor_present"] = (INTS, present)
        attrs["output_tensor_types"] = (INTS, [o[1] for o in outs])
        attrs["output_tensor_ranks"] = (INTS, [o[2] for o in outs])
        attrs["output_tensor_requires_grads"] = (INTS, [int(o[0]) for o in outs])
        if self.rng.random() < 0.2:
            attrs["safe_run_mode"] = (INT, 1)
        names = [self.fresh("gx") if o[0] else "" for o in outs]
        node = Node(
            "PythonOpGrad",
            self.node_name("bw", func.split(".")[-1]),
            [ctx or fw_node.outputs[0]] + [g[0] for g in grads if g[0] is not None],
            names,
            attrs,
            meta=dict(role="bw", func=func, peer=fw_node),
        )
        fw_node.meta["peer"] = node
        self.g.nodes.append(node)
        return names

    def onnx(self, op, inputs, outputs=1, **attrs):
        outs = [self.fresh("v") for _ in range(outputs)]
        self.g.nodes.append(
            Node(
                op,
                self.node_name("onnx", op),
                inputs,
                outs,
                {k: (INT, v) for k, v in attrs.items()},
                domain="",
                meta=dict(role="onnx"),
            )
        )
        return outs


def _out_shape(func, shape):
    return {
        "View": [int(np.prod(shape))],
        "Shrink": [shape[0] - 1] + shape[1:] if shape else [],
        "Grow": [shape[0] * 2] + shape[1:] if shape else [],
    }.get(func, shape)


def _tensor_of(b, types, rank=None, min_first=1, stem="x", requires_grad=False):
    t = b.rng.choice(types)
    r = b.rng.randint(1 if min_first > 1 else 0, 3) if rank is None else rank
    shape = b.shape(r, min_first)
    return T(b.input(t, shape, stem), t, r, requires_grad), shape


def base_infer_one(b):
    func = b.rng.choice(["Identity", "Pass", "View", "NoGrad", "Shrink", "Grow"])
    x, shape = _tensor_of(
        b,
        ANY if func in ("Identity", "Pass", "View", "NoGrad") else ARITH,
        min_first=2 if func in ("Shrink", "Grow") else 1,
    )
    out_shape = _out_shape(func, shape)
    extra = {"safe_run_mode": (INT, 0)} if b.rng.random() < 0.3 else {}
    n = b.fw(f"fuzz.{func}", [x], [(x.elem_type, len(out_shape))], **extra)
    b.output(n.outputs[1], x.elem_type, out_shape)


def _random_constant(b):
    r = b.rng
    return r.choice(
        [
            lambda: r.choice([True, False]),
            lambda: r.choice([0, 1, -7, 2**62, INT64_MIN, r.randint(-1000, 1000)]),
            lambda: r.choice([0.5, -1.25, float("nan"), float("inf"), -0.0, 1e300, 0.1]),
            lambda: tuple(r.randint(-5, 5) for _ in range(r.randint(1, 4))),
            lambda: tuple(r.choice([0.5, 2.0, float("-inf")]) for _ in range(r.randint(1, 3))),
            lambda: tuple(r.choice([True, False]) for _ in range(r.randint(1, 3))),
            lambda: Lit(None),
            lambda: Lit(r.choice(["text", "", "\u00e9\u4e2d", 'a"b\\c'])),
            lambda: Lit([1, [2, 3], "x"]),
            lambda: Lit({"k": 1, "nested": (1, 2.5, None)}),
            lambda: Lit(Dtype(r.choice(["float16", "int64", "bool", "bfloat16"]))),
            lambda: Lit(Device("cpu")),
            lambda: Lit(10**30),
            lambda: Lit(()),
            lambda: Lit((True, (1, "two"), [3.5])),
            lambda: Lit(float("nan")),
        ]
    )()


def base_infer_constants(b):
    args = [_random_constant(b) for _ in range(b.rng.randint(1, 6))]
    tensors = [_tensor_of(b, ANY)[0] for _ in range(b.rng.randint(1, 2))]
    for t in tensors:
        args.insert(b.rng.randint(0, len(args)), t)
    first = next(a for a in args if isinstance(a, T))  # what Pass returns
    n = b.fw("fuzz.Pass", args, [(first.elem_type, first.rank)])
    b.output(n.outputs[1], first.elem_type, list(b.g.feeds[first.name].shape))


def base_infer_two_out(b):
    x, shape = _tensor_of(b, ARITH)
    n = b.fw("fuzz.TwoOut", [x], [(x.elem_type, x.rank)] * 2)
    for y in n.outputs[1:]:
        b.output(y, x.elem_type, shape)
    if b.rng.random() < 0.5:
        b.g.value_info.append([n.outputs[0], 7, []])


def base_infer_chain(b):
    x, shape = _tensor_of(b, (1, 11, 6, 7))
    (t,) = b.onnx("Add", [x.name, x.name])
    n1 = b.fw("fuzz.Identity", [T(t, x.elem_type, x.rank)], [(x.elem_type, x.rank)])
    u = n1.outputs[1]
    if b.rng.random() < 0.5:
        b.g.value_info.append([u, x.elem_type, list(shape)])
    n2 = b.fw("fuzz.TwoOut", [T(u, x.elem_type, x.rank)], [(x.elem_type, x.rank)] * 2)
    n3 = b.fw(
        "fuzz.Add",
        [T(n2.outputs[1], x.elem_type, x.rank), T(n2.outputs[2], x.elem_type, x.rank)],
        [(x.elem_type, x.rank)],
    )
    b.output(n3.outputs[1], x.elem_type, shape)


def base_infer_inplace(b):
    x, shape = _tensor_of(b, ARITH)
    src = x.name
    if b.rng.random() < 0.7:  # an intermediate, whose buffer ORT may hand to the output
        (src,) = b.onnx("Add", [x.name, x.name])
    n = b.fw("fuzz.InPlace", [T(src, x.elem_type, x.rank)], [(x.elem_type, x.rank)], tensor_reuse_map=(INTS, [-1, 0]))
    b.output(n.outputs[1], x.elem_type, shape)


def base_infer_operator(b):
    kind = b.rng.choice(["add", "neg", "cat"])
    x, shape = _tensor_of(b, (1, 11, 7), rank=b.rng.randint(1, 3) if kind == "cat" else None)
    off = {"safe_run_mode": (INT, 0), "training_mode": (INT, 0)}
    if kind == "add":
        y = T(b.input(x.elem_type, shape), x.elem_type, x.rank)
        n = b.fw("aten::add.Tensor", [Lit((-1, -1, -1)), Lit(("alpha",)), x, y, 2], [(x.elem_type, x.rank)], **off)
        out_shape = shape
    elif kind == "neg":
        n = b.fw("aten::neg.default", [Lit((-1,)), Lit(()), x], [(x.elem_type, x.rank)], **off)
        out_shape = shape
    else:
        y = T(b.input(x.elem_type, shape), x.elem_type, x.rank)
        n = b.fw("aten::cat.default", [Lit((2,)), Lit(()), x, y], [(x.elem_type, x.rank)], **off)
        out_shape = [shape[0] * 2] + shape[1:]
    b.output(n.outputs[1], x.elem_type, out_shape)


def base_no_inputs(b):
    count = b.rng.randint(1, 4)
    n = b.fw("fuzz.Make", [count, b.rng.choice([1.5, -2.0, 0.0])], [(1, 1)])
    b.output(n.outputs[1], 1, [count])


def _train(b, func, types=FLOATING, constants=()):
    x, shape = _tensor_of(b, types, min_first=2 if func in ("Shrink", "Grow") else 1, requires_grad=True)
    out_shape = _out_shape(func, shape)
    n = b.fw(f"fuzz.{func}", [x, *constants], [(x.elem_type, len(out_shape))], training=True)
    g = b.input(x.elem_type, out_shape, "g")
    (gx,) = b.bw(n, [(g, x.elem_type, len(out_shape))], [(True, x.elem_type, x.rank)])
    b.output(n.outputs[1], x.elem_type, out_shape)
    b.output(gx, x.elem_type, shape)
    return n


def base_train_pair(b):
    func = b.rng.choice(["Identity", "Saving", "Scale", "Pass", "View", "Shrink", "Grow"])
    constants = {"Scale": [b.rng.choice([2.0, -0.5])], "Pass": [_random_constant(b)]}.get(func, [])
    _train(b, func, constants=constants)


def base_train_two_out(b):
    x, shape = _tensor_of(b, FLOATING, requires_grad=True)
    n = b.fw("fuzz.TwoOut", [x], [(x.elem_type, x.rank)] * 2, training=True)
    present = b.rng.choice([(1, 1), (1, 0), (0, 1)])
    grads = [(b.input(x.elem_type, shape, "g") if p else None, x.elem_type, x.rank) for p in present]
    (gx,) = b.bw(n, grads, [(True, x.elem_type, x.rank)])
    for y in n.outputs[1:]:
        b.output(y, x.elem_type, shape)
    b.output(gx, x.elem_type, shape)


def base_train_noctx(b):
    """Training calls that keep no autograd context: the backward writes zeros."""
    if b.rng.random() < 0.5:
        x, shape = _tensor_of(b, ANY)  # nothing requires a gradient
        func = b.rng.choice(["Identity", "Pass"])
    else:
        x, shape = _tensor_of(b, FLOATING, requires_grad=True)
        func = "NoGrad"  # marks its output non-differentiable
    n = b.fw(f"fuzz.{func}", [x], [(x.elem_type, x.rank)], training=True)
    g = b.input(x.elem_type, shape, "g")
    (gx,) = b.bw(n, [(g, x.elem_type, x.rank)], [(True, x.elem_type, x.rank)])
    b.output(n.outputs[1], x.elem_type, shape)
    b.output(gx, x.elem_type, shape)


def base_train_two_pairs(b):
    """Two training pairs of different element types, for context ids sent to the other pair."""
    for types in ((1,), (11, 10)):
        if b.rng.random() < 0.3:
            x, shape = _tensor_of(b, types + (7, 2))
            func = "Identity"
        else:
            x, shape = _tensor_of(b, types, requires_grad=True)
            func = b.rng.choice(["Identity", "Saving", "NoGrad"])
        n = b.fw(f"fuzz.{func}", [x], [(x.elem_type, x.rank)], training=True)
        g = b.input(x.elem_type, shape, "g")
        (gx,) = b.bw(n, [(g, x.elem_type, x.rank)], [(True, x.elem_type, x.rank)])
        b.output(n.outputs[1], x.elem_type, shape)
        b.output(gx, x.elem_type, shape)


def base_train_ctx_output(b):
    """The context id is a graph output: the caller runs (or releases) the backward later."""
    x, shape = _tensor_of(b, FLOATING, requires_grad=True)
    n = b.fw("fuzz.Saving", [x], [(x.elem_type, x.rank)], training=True)
    b.g.outputs.append([n.outputs[0], 7, []])
    b.output(n.outputs[1], x.elem_type, shape)


def base_train_multi_input(b):
    x, shape = _tensor_of(b, FLOATING, requires_grad=True)
    wants_y = b.rng.random() < 0.5
    y = T(b.input(x.elem_type, shape), x.elem_type, x.rank, wants_y)
    n = b.fw("fuzz.Add", [x, y], [(x.elem_type, x.rank)], training=True)
    g = b.input(x.elem_type, shape, "g")
    grads = b.bw(n, [(g, x.elem_type, x.rank)], [(True, x.elem_type, x.rank), (wants_y, x.elem_type, x.rank)])
    b.output(n.outputs[1], x.elem_type, shape)
    for gx in grads:
        if gx:
            b.output(gx, x.elem_type, shape)


def base_train_inplace(b):
    x, shape = _tensor_of(b, FLOATING, requires_grad=True)
    (t,) = b.onnx("Add", [x.name, x.name])
    n = b.fw(
        "fuzz.InPlace",
        [T(t, x.elem_type, x.rank, True)],
        [(x.elem_type, x.rank)],
        training=True,
        tensor_reuse_map=(INTS, [-1, 0]),
    )
    g = b.input(x.elem_type, shape, "g")
    (gx,) = b.bw(n, [(g, x.elem_type, x.rank)], [(True, x.elem_type, x.rank)])
    b.output(n.outputs[1], x.elem_type, shape)
    b.output(gx, x.elem_type, shape)


def base_train_chain(b):
    x, shape = _tensor_of(b, FLOATING, requires_grad=True)
    n1 = b.fw("fuzz.Identity", [x], [(x.elem_type, x.rank)], training=True)
    n2 = b.fw("fuzz.Scale", [T(n1.outputs[1], x.elem_type, x.rank, True), 3.0], [(x.elem_type, x.rank)], training=True)
    g = b.input(x.elem_type, shape, "g")
    (g1,) = b.bw(n2, [(g, x.elem_type, x.rank)], [(True, x.elem_type, x.rank)])
    (gx,) = b.bw(n1, [(g1, x.elem_type, x.rank)], [(True, x.elem_type, x.rank)])
    b.output(n2.outputs[1], x.elem_type, shape)
    b.output(gx, x.elem_type, shape)


BASES = {
    f.__name__.removeprefix("base_"): f
    for f in (
        base_infer_one,
        base_infer_constants,
        base_infer_two_out,
        base_infer_chain,
        base_infer_inplace,
        base_infer_operator,
        base_no_inputs,
        base_train_pair,
        base_train_two_out,
        base_train_noctx,
        base_train_two_pairs,
        base_train_ctx_output,
        base_train_multi_input,
        base_train_inplace,
        base_train_chain,
    )
}


# ---------------------------------------------------------------------------------------------
# Mutations. Each takes (graph, rng) and returns a record {kind, node, attribute, detail}, or None
# when it does not apply to this graph (another is drawn then). `node` is the Node object here;
# make_case turns it into its final name.


def _raw_name(g, prefix, raw: bytes):
    """A name holding arbitrary bytes after an ASCII prefix: a same-length ASCII marker now, patched
    into the serialized model."""
    tag = f"~{len(g.raw):05d}"
    g.raw[prefix + tag] = prefix.encode() + (raw * len(tag))[: len(tag)]
    return prefix + tag


def _list(node, name):
    """An INTS or FLOATS attribute's values; [] when absent or (after attr_type) of another kind."""
    kind, value = node.attrs.get(name, (None, None))
    return list(value) if kind in (INTS, FLOATS) else []


def _feed_context(node, value):
    """Makes `value` the node's input 0 (its context id), even where a mutation dropped inputs."""
    if node.inputs:
        node.inputs[0] = value
    else:
        node.inputs.append(value)


def _choose(rng, items):
    return rng.choice(items) if items else None


def _pick_attr(rng, node, kinds=None, names=None):
    choices = [
        k for k, (kind, _) in node.attrs.items() if (kinds is None or kind in kinds) and (names is None or k in names)
    ]
    return rng.choice(choices) if choices else None


def _record(kind, node, attribute=None, detail="", also=()):
    """`also`: nodes an error may rightly name instead (the other end of a broken edge)."""
    return {"kind": kind, "node": node, "attribute": attribute, "detail": str(detail)[:120], "also": list(also)}


def _attribute_value(node, name, i):
    """The graph value entry i of a type or rank attribute describes (None where there is none)."""
    if name.startswith("output_tensor_"):
        j = i + 1 if node.op == "PythonOp" else i
        return node.outputs[j] if j < len(node.outputs) and node.outputs[j] else None
    if node.op == "PythonOp" or "input_tensor_present" not in node.attrs:
        j = i if node.op == "PythonOp" else i + 1
        return node.inputs[j] if j < len(node.inputs) and node.inputs[j] else None
    return None


def _follow(g, node, name, i, elem_type=None, rank=None):
    """Makes the graph agree with a changed type or rank: the declared graph output or value_info,
    or the graph input and its feed. Without this a mismatch is caught where the value is declared
    and the kernels never see the attribute (a zero gradient of the wrong size, say)."""
    value = _attribute_value(node, name, i)
    if value is None or (rank is not None and not 0 <= rank <= 6):
        return False
    changed = False
    for entry in g.outputs + g.value_info:
        if entry[0] == value:
            if elem_type is not None:
                entry[1] = elem_type
            if rank is not None:
                entry[2] = [None] * rank
            changed = True
    if value in g.feeds and (elem_type is None or elem_type in NUMPY):
        feed = g.feeds[value]
        if elem_type is not None:
            if np.iscomplexobj(feed) and elem_type not in (14, 15):
                feed = feed.real
            feed = feed.astype(NUMPY[elem_type])
        if rank is not None:
            feed = feed.reshape(([feed.size] + [1] * (rank - 1)) if rank else ()) if rank or feed.size == 1 else feed
        g.feeds[value] = feed
        for entry in g.inputs:
            if entry[0] == value:
                entry[1] = elem_type or entry[1]
                entry[2] = list(feed.shape)
        changed = True
    return changed


def _convert(rng, value, kind):
    """`value` recast as an attribute of another kind."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    seq = value if isinstance(value, list) else [value]
    nums = [v if isinstance(v, int) or np.isfinite(v) else 0 for v in seq if isinstance(v, (int, float))] or [1]
    nums = [min(max(int(v), INT64_MIN), INT64_MAX) if isinstance(v, int) else v for v in nums]
    if kind == INT:
        return int(nums[0]) if not isinstance(value, (str, bytes)) else len(value)
    if kind == INTS:
        return [int(v) for v in nums] if not isinstance(value, (str, bytes)) else list(range(len(value) % 5))
    if kind == FLOAT:
        return float(nums[0])
    if kind == FLOATS:
        return [float(v) for v in nums]
    if kind == STRING:
        return value if isinstance(value, (str, bytes)) else json.dumps(value)
    if kind == STRINGS:
        return [value if isinstance(value, (str, bytes)) else str(value)] * rng.randint(0, 2)
    if isinstance(value, (str, bytes)):
        return np.zeros(1, np.int64)
    return np.asarray(nums, dtype=np.float64 if any(isinstance(v, float) for v in nums) else np.int64)


def m_attr_type(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    name = _pick_attr(rng, node)
    if name is None:
        return None
    kind, value = node.attrs[name]
    new = rng.choice([k for k in KINDS if k != kind])
    node.attrs[name] = (new, _convert(rng, value, new))
    return _record("attr_type", node, name, f"{kind} -> {new}")


def m_attr_missing(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    name = _pick_attr(rng, node)
    if name is None:
        return None
    del node.attrs[name]
    return _record("attr_missing", node, name)


def m_attr_length(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    name = _pick_attr(rng, node, (INTS, FLOATS))
    if name is None:
        return None
    kind, value = node.attrs[name]
    value = list(value)
    how = rng.choice(["append", "drop", "clear", "double"])
    if how == "append":
        value.append(rng.choice(value) if value else (0.0 if kind == FLOATS else 0))
    elif how == "drop" and value:
        value.pop(rng.randrange(len(value)))
    elif how == "clear":
        value = []
    else:
        value = value * 2
    node.attrs[name] = (kind, value)
    return _record("attr_length", node, name, how)


_INT_POOL = [-1, 2, 3, 7, 0, 1, INT64_MIN, INT64_MAX, 2**31, 2**32 + 1, -(2**31)]


def m_attr_value(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    name = _pick_attr(rng, node, (INT, INTS, FLOATS))
    if name is None:
        return None
    kind, value = node.attrs[name]
    if kind == INT:
        value = rng.choice(_INT_POOL)
    elif not value:
        return None
    elif kind == INTS:
        value = list(value)
        value[rng.randrange(len(value))] = rng.choice(_INT_POOL)
    else:
        value = list(value)
        value[rng.randrange(len(value))] = rng.choice([float("nan"), float("inf"), -0.0, 3.4e38, -1e-45])
    node.attrs[name] = (kind, value)
    return _record("attr_value", node, name, value)


def m_elem_type(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    name = _pick_attr(rng, node, (INTS,), ("input_tensor_types", "output_tensor_types"))
    if name is None or not node.attrs[name][1]:
        return None
    value = list(node.attrs[name][1])
    i = rng.randrange(len(value))
    # Half the time another supported type: the mismatch is then one of meaning, not of format.
    value[i] = rng.choice(BAD_TYPES) if rng.random() < 0.5 else rng.choice([t for t in SUPPORTED if t != value[i]])
    node.attrs[name] = (INTS, value)
    follow = value[i] in SUPPORTED and rng.random() < 0.6 and _follow(g, node, name, i, elem_type=value[i])
    return _record("elem_type", node, name, f"entry {i} = {value[i]}" + (" (graph follows)" if follow else ""))


def m_rank(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    name = _pick_attr(rng, node, (INTS,), ("input_tensor_ranks", "output_tensor_ranks"))
    if name is None or not node.attrs[name][1]:
        return None
    value = list(node.attrs[name][1])
    i = rng.randrange(len(value))
    # Ranks that cost time or memory to honour are rare: each can take seconds while unfixed.
    pool = [-2, -1, 0, value[i] + 1, max(value[i] - 1, 0), 64, 65, 1000, 2**31, INT64_MAX, INT64_MIN]
    value[i] = rng.choice([10**7, 2**62]) if rng.random() < 0.08 else rng.choice(pool)
    node.attrs[name] = (INTS, value)
    follow = rng.random() < 0.5 and _follow(g, node, name, i, rank=value[i])
    return _record("rank", node, name, f"entry {i} = {value[i]}" + (" (graph follows)" if follow else ""))


_POSITION_ATTRS = (
    [f"input_{k}_{s}_positions" for k in ("bool", "int", "float", "pointer") for s in ("scalar",)]
    + [f"input_{k}_tuple_positions" for k in ("bool", "int", "float")]
    + ["input_literal_positions"]
)


def m_position(g, rng):
    nodes = [n for n in g.ortbridge_nodes("PythonOp") if any(a in n.attrs for a in _POSITION_ATTRS)]
    if not nodes:
        return None
    node = rng.choice(nodes)
    name = _pick_attr(rng, node, (INTS,), _POSITION_ATTRS)
    if name is None or not node.attrs[name][1]:
        return None
    value = list(node.attrs[name][1])
    conv = node.meta.get("conv", "d" * len(node.inputs))
    tensor_pos = [i for i, c in enumerate(conv) if c == "d"]
    taken = [p for a in _POSITION_ATTRS if a in node.attrs and node.attrs[a][0] == INTS for p in node.attrs[a][1]]
    i = rng.randrange(len(value))
    value[i] = rng.choice([-1, len(conv), len(conv) + 7, 2**40, INT64_MIN, *tensor_pos, *taken])
    node.attrs[name] = (INTS, value)
    return _record("position", node, name, f"entry {i} = {value[i]}")


def m_convention(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    name = "input_convention" if node.op == "PythonOp" else "output_convention"
    if name not in node.attrs or node.attrs[name][0] != STRING:
        return None
    conv = node.attrs[name][1]
    conv = conv if isinstance(conv, str) else conv.decode("latin-1")
    how = rng.choice(["flip", "append_c", "append_d", "delete", "foreign", "empty", "nul", "bytes", "long"])
    i = rng.randrange(len(conv)) if conv else 0
    if how == "flip" and conv:
        new = conv[:i] + ("c" if conv[i] == "d" else "d") + conv[i + 1 :]
    elif how in ("append_c", "append_d"):
        new = conv + how[-1]
    elif how == "delete" and conv:
        new = conv[:i] + conv[i + 1 :]
    elif how == "foreign":
        new = conv[:i] + rng.choice(["x", "D", "C", " ", "\u00e9"]) + conv[i + 1 :]
    elif how == "nul":
        new = conv + "\x00" + conv
    elif how == "bytes":
        new = conv.encode() + b"\xff\xfe"
    elif how == "long":
        new = "c" * 100000
    else:
        new = ""
    node.attrs[name] = (STRING, new)
    return _record("convention", node, name, how)


def m_tuple(g, rng):
    nodes = [
        n
        for n in g.ortbridge_nodes("PythonOp")
        if any(f"input_{k}_tuple_begins" in n.attrs for k in ("int", "float", "bool"))
    ]
    if not nodes:
        return None
    node = rng.choice(nodes)
    kind = rng.choice([k for k in ("int", "float", "bool") if f"input_{k}_tuple_begins" in node.attrs])
    name = f"input_{kind}_tuple_begins"
    begins = _list(node, name)
    if not begins:
        return None
    total = len(_list(node, f"input_{kind}_tuples"))
    i = rng.randrange(len(begins))
    begins[i] = rng.choice([-1, 1, total + 1, 2**62, INT64_MIN, total])
    if rng.random() < 0.3:
        begins = begins[::-1]
    node.attrs[name] = (INTS, begins)
    return _record("tuple_begins", node, name, begins)


_LITERAL_ENTRIES = [
    '{"dtype":"_dynamo"}',
    '{"dtype":"_inductor"}',
    '{"dtype":"onnx"}',
    '{"dtype":"export"}',
    '{"dtype":"_export"}',
    '{"dtype":"compiler"}',
    '{"dtype":"_functorch"}',
    '{"dtype":"distributed"}',
    '{"dtype":"Tensor"}',
    '{"dtype":"__class__"}',
    '{"dtype":"qint8"}',
    '{"dtype":5}',
    '{"dtype":"float16"}',
    '{"dtype":null}',
    '{"device":"cuda:99999999999"}',
    '{"device":"cuda"}',
    '{"device":"meta"}',
    '{"device":"cpu:-1"}',
    '{"device":"xla:0"}',
    '{"device":"privateuseone"}',
    '{"device":"mps"}',
    '{"device":""}',
    '{"device":7}',
    '{"device":"cpu:99999999999999999999"}',
    '{"call":"os.system"}',
    '{"__reduce__":"x"}',
    '{"tuple":[1],"dict":[]}',
    '{"dict":[[1,2]]}',
    '{"dict":[["a"]]}',
    '{"tuple":"ab"}',
    '{"tuple":{"tuple":[]}}',
    "{}",
    "9" * 5000,
    "1e400",
    "-1e400",
    "NaN",
    "-Infinity",
    '"\\ud800"',
    '"a\\u0000b"',
    '"' + "s" * 1000000 + '"',
    "[" * 50000 + "]" * 50000,
    '{"tuple":' * 2000 + "[]" + "}" * 2000,
    "[" + ",".join(["[]"] * 100000) + "]",
]
_LITERAL_TEXTS = [
    "",
    "[",
    "]",
    "null",
    "{}",
    "[1,]",
    "[1]\x00[2]",
    b'["\xff\xfe"]',
    b"[\xc3\x28]",
    "[1, 2]",
    "[" * 100000 + "]" * 100000,
    "[" * 1000000,
    '[{"dtype":"_dynamo"}, 1]',
]


def m_literals(g, rng):
    nodes = [
        n
        for n in g.ortbridge_nodes("PythonOp")
        if n.meta.get("literal_entries") and n.attrs.get("input_literals", (None,))[0] == STRING
    ]
    if nodes and rng.random() < 0.7:
        node = rng.choice(nodes)
        entries = list(node.meta["literal_entries"])
        if rng.random() < 0.75:
            i = rng.randrange(len(entries))
            entries[i] = rng.choice(_LITERAL_ENTRIES)
            text = "[" + ",".join(entries) + "]"
            detail = f"entry {i} = {entries[i][:60]}"
        else:
            text = rng.choice(_LITERAL_TEXTS)
            detail = f"text {text[:60]!r}"
        node.attrs["input_literals"] = (STRING, text)
        return _record("literals", node, "input_literals", detail)
    # Otherwise a new literal argument (Pass takes any number of arguments).
    node = _choose(rng, g.ortbridge_nodes("PythonOp"))
    if node is None:
        return None
    conv = node.attrs.get("input_convention", (None, None))[1]
    if "input_literals" in node.attrs or not isinstance(conv, str):
        return None
    conv = node.attrs["input_convention"][1]
    entry = rng.choice(_LITERAL_ENTRIES)
    node.attrs["input_convention"] = (STRING, conv + "c")
    node.attrs["input_literals"] = (STRING, "[" + entry + "]")
    node.attrs["input_literal_positions"] = (INTS, [len(conv)])
    _add_argument(node)
    # (convention and positions stay consistent: only the literal itself is in question)
    return _record("literals_added", node, "input_literals", entry[:60])


def _add_argument(node):
    """input_requires_grads (if given) for a constant argument appended to the convention."""
    if "input_requires_grads" in node.attrs and node.attrs["input_requires_grads"][0] == INTS:
        node.attrs["input_requires_grads"] = (INTS, node.attrs["input_requires_grads"][1] + [0])


_FUNC_NAMES = [
    "",
    "fuzz.NoSuchFunction",
    "fuzz.Identity\x00evil",
    b"fuzz.\xff\xfeIdentity",
    "x" * 100000,
    "fuzz.identity",
    "aten::empty.memory_format",
    "aten::add.__dict__",
    "os::system.default",
    "aten::",
    "::.",
    "aten::add",
    "aten::no_such_op.default",
    "aten::add_.Tensor",
    "aten::from_file.default",
    "aten::as_strided.default",
    "prims::empty_strided.default",
    "builtins::eval.default",
    "torch.autograd.Function",
    "aten::mul.Tensor",
    "aten::_reshape_alias.default",
    "aten::set_.source_Tensor",
    "aten::resize_.default",
    "aten::add.out",
    "aten::__class__.default",
    "aten::name.default",
    " fuzz.Identity",
    "fuzz.Identity\n",
]


def m_func_name(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    if rng.random() < 0.3:  # another registered Function: right format, wrong meaning
        name = rng.choice(FUNCTION_NAMES)
    else:
        name = rng.choice(_FUNC_NAMES)
    node.attrs["func_name"] = (STRING, name)
    return _record("func_name", node, "func_name", repr(name[:40]))


def m_reuse_map(g, rng):
    node = _choose(rng, g.ortbridge_nodes("PythonOp"))
    if node is None:
        return None
    n_in, n_out = len(node.inputs), len(node.outputs)
    how = rng.choice(["valid", "valid", "out_of_range", "length", "entry0", "same_input"])
    if how == "valid":
        value = [-1] + [rng.randint(-1, n_in - 1) for _ in range(n_out - 1)]
    elif how == "out_of_range":
        value = [-1] + [rng.choice([-2, n_in, n_in + 3, 2**40, INT64_MIN]) for _ in range(n_out - 1)]
    elif how == "length":
        value = [-1] * rng.choice([0, 1, n_out + 1, n_out + 5])
    elif how == "entry0":
        value = [0] + [-1] * (n_out - 1)
    else:
        value = [-1] + [0] * (n_out - 1) + ([0] if rng.random() < 0.5 else [])
    node.attrs["tensor_reuse_map"] = (INTS, value)
    return _record("reuse_map", node, "tensor_reuse_map", f"{how} {value}")


def m_reuse_size(g, rng):
    """A node declared in place whose output has another size than its input."""
    nodes = [n for n in g.ortbridge_nodes("PythonOp") if len(n.inputs) >= 1 and len(n.outputs) >= 2]
    if not nodes:
        return None
    node = rng.choice(nodes)
    node.attrs["func_name"] = (STRING, rng.choice(["fuzz.Grow", "fuzz.Shrink", "fuzz.View", "fuzz.Make"]))
    node.attrs["tensor_reuse_map"] = (INTS, [-1] + [0] * (len(node.outputs) - 1))
    return _record("reuse_size", node, None, node.attrs["func_name"][1])


def m_requires_grads(g, rng):
    node = _choose(rng, g.ortbridge_nodes("PythonOp"))
    if node is None:
        return None
    attr = node.attrs.get("input_requires_grads")
    if attr is None or attr[0] != INTS or not attr[1]:
        conv = node.meta.get("conv", "d" * len(node.inputs))
        value = [rng.choice([0, 1]) for _ in conv]
    else:
        value = list(attr[1])
        i = rng.randrange(len(value))
        value[i] = rng.choice([1 - value[i], 2, -1])
    node.attrs["input_requires_grads"] = (INTS, value)
    return _record("requires_grads", node, "input_requires_grads", value)


def m_flags(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    name = rng.choice(["training_mode", "safe_run_mode", "call_index"] if node.op == "PythonOp" else ["safe_run_mode"])
    # training_mode=1 on an inference node: its context id is consumed by nothing.
    value = rng.choice([1, 1, 0, 2, -1, 2**40, INT64_MIN])
    node.attrs[name] = (INT, value)
    return _record("flags", node, name, value)


def m_grad_present(g, rng):
    nodes = g.ortbridge_nodes("PythonOpGrad")
    if not nodes:
        return None
    node = rng.choice(nodes)
    slots = len(_list(node, "input_tensor_types")) or 1
    value = [rng.choice([0, 1, 1, 2]) for _ in range(slots + rng.choice([0, 0, 1, -1]))]
    node.attrs["input_tensor_present"] = (INTS, value)
    return _record("grad_present", node, "input_tensor_present", value)


def m_grad_requires(g, rng):
    nodes = g.ortbridge_nodes("PythonOpGrad")
    if not nodes:
        return None
    node = rng.choice(nodes)
    attr = node.attrs.get("output_tensor_requires_grads")
    if attr is None or attr[0] != INTS or not attr[1]:
        return None
    value = list(attr[1])
    i = rng.randrange(len(value))
    value[i] = rng.choice([1 - value[i], 2])
    node.attrs["output_tensor_requires_grads"] = (INTS, value)
    return _record("grad_requires", node, "output_tensor_requires_grads", value)


def m_grad_type(g, rng):
    """A gradient declared with another supported element type than its forward tensor (the case
    where a backward without context writes zeros of the forward's size)."""
    nodes = g.ortbridge_nodes("PythonOpGrad")
    if not nodes:
        return None
    node = rng.choice(nodes)
    name = rng.choice(["output_tensor_types", "input_tensor_types"])
    attr = node.attrs.get(name)
    if attr is None or attr[0] != INTS or not attr[1]:
        return None
    value = list(attr[1])
    i = rng.randrange(len(value))
    # Mostly a narrower type: a buffer sized for it is too small for the forward tensor's zeros.
    narrower = [t for t in (2, 3, 9, 10, 5, 1) if _SIZE[t] < _SIZE.get(value[i], 8)]
    others = [t for t in (2, 3, 9, 10, 11, 7, 1, 5) if t != value[i]]
    value[i] = rng.choice(narrower if narrower and rng.random() < 0.7 else others)
    node.attrs[name] = (INTS, value)
    follow = rng.random() < 0.8 and _follow(g, node, name, i, elem_type=value[i])
    return _record("grad_type", node, name, f"entry {i} = {value[i]}" + (" (graph follows)" if follow else ""))


def m_pointer(g, rng):
    node = _choose(rng, g.ortbridge_nodes("PythonOp"))
    if node is None:
        return None
    conv = node.attrs.get("input_convention", (None, None))
    if not isinstance(conv[1], str) or "input_pointer_scalars" in node.attrs:
        return None
    node.attrs["input_convention"] = (STRING, conv[1] + "c")
    key = rng.choice([0, 1, -1, 0x7FFF12345678, INT64_MAX, rng.randint(1, 2**47)])
    node.attrs["input_pointer_scalars"] = (INTS, [key])
    node.attrs["input_pointer_scalar_positions"] = (INTS, [len(conv[1])])
    _add_argument(node)
    return _record("pointer", node, "input_pointer_scalars", key)


def m_float_bits(g, rng):
    nodes = [n for n in g.ortbridge_nodes("PythonOp") if "input_float_scalars_f64" in n.attrs]
    if not nodes:
        return None
    node = rng.choice(nodes)
    kind, value = node.attrs["input_float_scalars_f64"]
    if kind != INTS or not value:
        return None
    value = list(value)
    value[rng.randrange(len(value))] = rng.choice([-1, 0x7FF0000000000001, INT64_MIN, 0x7FF8DEADBEEF0000, 1])
    node.attrs["input_float_scalars_f64"] = (INTS, value)
    return _record("float_bits", node, "input_float_scalars_f64", value)


def m_bool_value(g, rng):
    nodes = [
        n
        for n in g.ortbridge_nodes("PythonOp")
        if any(a in n.attrs for a in ("input_bool_scalars", "input_bool_tuples"))
    ]
    if not nodes:
        return None
    node = rng.choice(nodes)
    name = rng.choice([a for a in ("input_bool_scalars", "input_bool_tuples") if a in node.attrs])
    kind, value = node.attrs[name]
    if kind != INTS or not value:
        return None
    value = list(value)
    value[rng.randrange(len(value))] = rng.choice([2, -1, 255])
    node.attrs[name] = (INTS, value)
    return _record("bool_value", node, name, value)


def m_string_bytes(g, rng):
    """NUL or invalid UTF-8 inside a string attribute."""
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    name = _pick_attr(rng, node, (STRING,))
    if name is None:
        return None
    value = node.attrs[name][1]
    value = value.encode() if isinstance(value, str) else value
    cut = rng.randint(0, len(value))
    value = value[:cut] + rng.choice([b"\x00", b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00\xff"]) + value[cut:]
    node.attrs[name] = (STRING, value)
    return _record("string_bytes", node, name, value[:60])


# --- graph-level mutations (attribute None)


def _all_values(g):
    return [v for n in g.nodes for v in n.outputs if v] + [i[0] for i in g.inputs] + list(g.initializers)


def m_empty_output_name(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    if not node.outputs:
        return None
    i = rng.randrange(len(node.outputs))
    old = node.outputs[i]
    consumers = g.consumers(old) if old else []
    if rng.random() < 0.5:  # everywhere: consumers then see a missing optional input
        g.rename_value(old, "")
        g.outputs = [o for o in g.outputs if o[0] != ""]
    else:
        node.outputs[i] = ""
    return _record("empty_output_name", node, None, f"output {i}", also=consumers)


def m_duplicate_name(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    how = rng.choice(["node", "output_is_input", "output_clash", "same_outputs"])
    others = [n for n in g.nodes if n is not node]
    if how == "node" and others:
        node.name = rng.choice(others).name
        return _record("duplicate_node_name", node, None, node.name)
    values = _all_values(g)
    if how == "output_is_input" and node.inputs and node.outputs:
        node.outputs[rng.randrange(len(node.outputs))] = rng.choice(node.inputs)
    elif how == "same_outputs" and len(node.outputs) >= 2:
        node.outputs[1] = node.outputs[0]
    elif node.outputs and values:
        node.outputs[rng.randrange(len(node.outputs))] = rng.choice(values)
    else:
        return None
    return _record("duplicate_value_name", node, None, how)


def m_bad_node_name(g, rng):
    node = rng.choice(g.nodes)
    how = rng.choice(["empty", "nul", "bytes", "long", "quotes", "percent"])
    if how == "empty":
        node.name = ""
    elif how == "nul":
        node.name = node.name + "\x00tail"
    elif how == "bytes":
        node.name = _raw_name(g, node.name, rng.choice([b"\xff\xfe", b"\xc3\x28\xa0", b"\xed\xa0\x80", b"\x80"]))
    elif how == "long":
        node.name = node.name + "L" * 100000
    elif how == "quotes":
        node.name = node.name + "'\"\n\t{}"
    else:
        node.name = node.name + "%s%n%d"
    return _record("bad_node_name", node, None, how)


def m_bad_value_name(g, rng):
    graph_outputs = {o[0] for o in g.outputs}
    inputs = {i[0] for i in g.inputs}
    candidates = [(n, v) for n in g.nodes for v in n.outputs if v and v not in inputs]
    if not candidates:
        return None
    node, old = rng.choice(candidates)
    how = rng.choice(["nul", "bytes", "long", "unicode"])
    if how == "bytes" and old not in graph_outputs:  # (a graph output name must decode in Python)
        new = _raw_name(g, old, rng.choice([b"\xff\xfe", b"\xc3\x28", b"\x80\x80"]))
    elif how == "long":
        new = old + "V" * 100000
    elif how == "unicode":
        new = old + "\u00e9\U0001f600"
    else:
        new = old + "\x00x"
    g.rename_value(old, new)
    return _record("bad_value_name", node, None, how)


def m_ctx_unconsumed(g, rng):
    """A training forward whose context id nothing consumes (its backward removed or fed elsewhere)."""
    nodes = g.ortbridge_nodes("PythonOpGrad")
    if not nodes:
        return None
    bw = rng.choice(nodes)
    fw = bw.meta.get("peer")
    if rng.random() < 0.6:
        doomed = [bw]  # and the backward nodes downstream of it (a chain's earlier backward)
        while True:
            outs = {v for n in doomed for v in n.outputs if v}
            more = [n for n in g.nodes if n not in doomed and any(i in outs for i in n.inputs)]
            if not more:
                break
            doomed += more
        g.nodes = [n for n in g.nodes if n not in doomed]
        g.outputs = [o for o in g.outputs if o[0] not in outs]
        g.drop_unused_inputs()
        return _record("ctx_unconsumed", fw if fw is not None else bw, None, "backward removed")
    name = "forged_ctx_input"
    g.inputs.append([name, 7, []])
    g.feeds[name] = np.asarray(0, np.int64)
    _feed_context(bw, name)
    return _record("ctx_unconsumed", fw if fw is not None else bw, None, "backward fed another id", also=[bw])


def m_ctx_forged(g, rng):
    nodes = g.ortbridge_nodes("PythonOpGrad")
    if not nodes:
        return None
    bw = rng.choice(nodes)
    value = rng.choice([0, -1, 1, 2, 3, 7, INT64_MAX, INT64_MIN, rng.randint(1, 10**6)])
    form = rng.choice(["scalar", "scalar", "shape1", "shape2", "float", "int32", "feed"])
    array = {
        "scalar": np.asarray(value, np.int64),
        "shape1": np.asarray([value], np.int64),
        "shape2": np.asarray([value, value], np.int64),
        "float": np.asarray(float(value), np.float32),
        "int32": np.asarray(value % 2**31, np.int32),
        "feed": np.asarray(value, np.int64),
    }[form]
    name = f"forged_ctx_{len(g.initializers)}"
    if form == "feed":
        g.inputs.append([name, 7, []])
        g.feeds[name] = array
    else:
        g.initializers[name] = array
    _feed_context(bw, name)
    return _record("ctx_forged", bw, None, f"{form} {value}")


def m_ctx_rewire(g, rng):
    """A backward fed the context id of another forward, or an id computed from one."""
    nodes = g.ortbridge_nodes("PythonOpGrad")
    forwards = g.ortbridge_nodes("PythonOp")
    if not nodes or not forwards:
        return None
    bw = rng.choice(nodes)
    source = rng.choice(forwards)
    if not source.outputs:
        return None
    how = rng.choice(["other", "arith", "arith", "output"])
    if how == "other" or not source.outputs[0]:
        _feed_context(bw, source.outputs[0])
        detail = f"ctx of {source.name[:40]}"
    elif how == "arith":
        k = rng.choice([-1, 1, 2, -2])
        g.initializers[f"ctx_step_{k}_{len(g.initializers)}"] = np.asarray(k, np.int64)
        (v,) = _onnx_node(g, "Add", [source.outputs[0], list(g.initializers)[-1]])
        _feed_context(bw, v)
        detail = f"ctx of {source.name[:40]} {k:+d}"
    else:
        outs = [o for o in source.outputs[1:] if o]
        if not outs:
            return None
        _feed_context(bw, rng.choice(outs))
        detail = "a Function output"
    return _record("ctx_rewire", bw, None, detail)


def _onnx_node(g, op, inputs):
    k = len(g.nodes) + 100
    out = f"v_extra{k}"
    g.nodes.append(Node(op, f"node{k}_onnx_{op}", inputs, [out], domain="", meta=dict(role="onnx")))
    return [out]


def m_ctx_twice(g, rng):
    nodes = g.ortbridge_nodes("PythonOpGrad")
    if not nodes:
        return None
    bw = rng.choice(nodes)
    twin = Node(
        bw.op,
        bw.name + "_twin",
        list(bw.inputs),
        [o + "_twin" if o else "" for o in bw.outputs],
        dict(bw.attrs),
        meta=dict(bw.meta),
    )
    g.nodes.append(twin)
    for o, twin_o in zip(bw.outputs, twin.outputs):
        declared = next((x for x in g.outputs if x[0] == o), None)
        if twin_o and declared:
            g.outputs.append([twin_o, declared[1], declared[2]])
    return _record("ctx_twice", twin, None, also=[bw])  # (whichever of the two runs second fails)


def m_declared_mismatch(g, rng):
    """value_info or a graph output declaring another type or rank than the node's attributes."""
    produced = [(n, v) for n in g.ortbridge_nodes() for v in n.outputs if v]
    if not produced:
        return None
    node, v = rng.choice(produced)
    entry = next((o for o in g.outputs + g.value_info if o[0] == v), None)
    if entry is None:
        entry = [v, 1, None]
        g.value_info.append(entry)
    if rng.random() < 0.5:
        entry[1] = rng.choice([t for t in SUPPORTED if t != entry[1]])
        detail = f"type {entry[1]}"
    else:
        rank = len(entry[2]) if entry[2] is not None else 1
        entry[2] = [None] * rng.choice([rank + 1, max(rank - 1, 0), 7])
        detail = f"rank {len(entry[2])}"
    return _record("declared_mismatch", node, None, detail)


def m_inputs(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    how = rng.choice(["missing", "empty", "drop", "extra"])
    if how in ("missing", "empty") and node.inputs:
        node.inputs[rng.randrange(len(node.inputs))] = "no_such_value" if how == "missing" else ""
    elif how == "drop" and node.inputs:
        node.inputs.pop()
    elif how == "extra" and g.inputs:
        node.inputs.append(rng.choice(g.inputs)[0])
    else:
        return None
    return _record("inputs", node, None, how)


def m_outputs(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    if rng.random() < 0.5 or len(node.outputs) < 2 or len(g.outputs) < 2:
        node.outputs.append(f"extra_out_{len(node.outputs)}")
        detail = "extra"
    else:
        dropped = node.outputs.pop()
        g.outputs = [o for o in g.outputs if o[0] != dropped] or g.outputs
        detail = "dropped"
    return _record("outputs", node, None, detail)


def m_opset(g, rng):
    node = _choose(rng, g.ortbridge_nodes())
    if node is None:
        return None
    how = rng.choice(["version", "version", "no_import", "domain", "op_type"])
    if how == "version":
        g.opsets[DOMAIN] = rng.choice([0, 2, 1000, -1, 2**40])
        detail = g.opsets[DOMAIN]
    elif how == "no_import":
        g.opsets.pop(DOMAIN, None)
        detail = "no opset import"
    elif how == "domain":
        node.domain = rng.choice(["com.microsoft", "ortbridge.x", "", "ORTBRIDGE"])
        detail = node.domain
    else:
        node.op = rng.choice(["PythonOpGrad" if node.op == "PythonOp" else "PythonOp", "pythonop", "PythonOp\x00"])
        detail = node.op
    return _record("opset", node, None, detail)


def m_fold(g, rng):
    """All inputs of a node made initializers (constant folding may run it at session creation)."""
    nodes = [n for n in g.ortbridge_nodes() if any(i in g.feeds for i in n.inputs)]
    if not nodes:
        return None
    node = rng.choice(nodes)
    for name in list(node.inputs):
        if name in g.feeds:
            g.initializers[name] = g.feeds.pop(name)
            g.inputs = [i for i in g.inputs if i[0] != name]
    return _record("fold", node, None)


MUTATIONS = {
    f.__name__.removeprefix("m_"): f
    for f in (
        m_attr_type,
        m_attr_missing,
        m_attr_length,
        m_attr_value,
        m_elem_type,
        m_rank,
        m_position,
        m_convention,
        m_tuple,
        m_literals,
        m_func_name,
        m_reuse_map,
        m_reuse_size,
        m_requires_grads,
        m_flags,
        m_grad_present,
        m_grad_requires,
        m_grad_type,
        m_pointer,
        m_float_bits,
        m_bool_value,
        m_string_bytes,
        m_empty_output_name,
        m_duplicate_name,
        m_bad_node_name,
        m_bad_value_name,
        m_ctx_unconsumed,
        m_ctx_forged,
        m_ctx_rewire,
        m_ctx_twice,
        m_declared_mismatch,
        m_inputs,
        m_outputs,
        m_opset,
        m_fold,
    )
}
# Mutations that target the crash classes found so far are drawn more often.
WEIGHTS = {name: 1.0 for name in MUTATIONS} | {
    "attr_type": 2,
    "attr_value": 2,
    "elem_type": 2,
    "rank": 1.5,
    "literals": 2,
    "ctx_forged": 1.5,
    "ctx_rewire": 1.5,
    "grad_type": 3,
    "reuse_map": 1.5,
    "string_bytes": 1.5,
    # (these apply to few graphs, and are redrawn elsewhere)
    "position": 4,
    "tuple": 6,
    "bool_value": 6,
    "float_bits": 4,
}


# ---------------------------------------------------------------------------------------------
# Serialization


def _int64(v):
    return min(max(int(v), INT64_MIN), INT64_MAX)  # (a mutation may step past the ends)


def _attribute(name, kind, value):
    a = AttributeProto()
    a.name = name
    if kind == INT:
        a.type, a.i = AttributeProto.INT, _int64(value)
    elif kind == INTS:
        a.type = AttributeProto.INTS
        a.ints.extend(_int64(v) for v in value)
    elif kind == FLOAT:
        a.type, a.f = AttributeProto.FLOAT, value
    elif kind == FLOATS:
        a.type = AttributeProto.FLOATS
        a.floats.extend(value)
    elif kind == STRING:
        a.type, a.s = AttributeProto.STRING, value if isinstance(value, bytes) else value.encode()
    elif kind == STRINGS:
        a.type = AttributeProto.STRINGS
        a.strings.extend(v if isinstance(v, bytes) else v.encode() for v in value)
    else:
        a.type = AttributeProto.TENSOR
        a.t.CopyFrom(numpy_helper.from_array(np.asarray(value)))
    return a


def _value_info(entry):
    name, elem_type, shape = entry
    return helper.make_tensor_value_info(name, elem_type, shape)


def serialize(g: Graph) -> bytes:
    nodes = []
    for n in g.nodes:
        proto = helper.make_node(n.op, n.inputs, n.outputs, name=n.name, domain=n.domain)
        proto.attribute.extend(_attribute(k, kind, v) for k, (kind, v) in n.attrs.items())
        nodes.append(proto)
    graph = helper.make_graph(
        nodes,
        "fuzz",
        [_value_info(i) for i in g.inputs],
        [_value_info(o) for o in g.outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in g.initializers.items()],
        value_info=[_value_info(v) for v in g.value_info],
    )
    # IR version 8, as the project's tests use (older ONNX Runtime releases load it too).
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in g.opsets.items()], ir_version=8
    )
    data = model.SerializeToString()
    for marker in sorted(g.raw, key=len, reverse=True):  # (a marker may extend an older one)
        data = data.replace(marker.encode(), g.raw[marker])
    return data


def _name_match(g, name):
    """What an error message must contain to name a node called `name`: its leading plain
    characters (a message may escape or shorten the rest: control characters, invalid UTF-8, a
    name 100000 characters long). The base names are prefix-free, so this still picks one node."""
    if name == "":
        return "node ''"
    plain = re.match(r"[A-Za-z0-9_.]*", name.split("~")[0] if name in g.raw else name).group()
    return plain[:48] or name


def make_case(seed: int, index: int):
    """(model bytes, feeds, description) of case `index` of campaign `seed`; deterministic."""
    rng = random.Random(f"ortbridge-fuzz:{seed}:{index}")
    return _case(seed, index, rng.choice(list(BASES)), rng, mutate=index % BASE_EVERY != 0)


def make_base(name: str, seed: int):
    """An intact base graph (a valid model), as make_case returns it."""
    return _case(seed, -1, name, random.Random(f"ortbridge-fuzz-base:{name}:{seed}"), mutate=False)


def _case(seed, index, base_name, rng, mutate):
    nprng = np.random.default_rng([abs(seed), abs(index), len(base_name)])
    b = _Builder(base_name, rng, nprng)
    BASES[base_name](b)
    g = b.g
    records = []
    if mutate:
        names, weights = list(MUTATIONS), [WEIGHTS[n] for n in MUTATIONS]
        wanted = rng.choice([1, 1, 1, 2, 2, 3])
        for _ in range(50):  # draws that do not apply to this graph are redrawn
            if len(records) == wanted or not g.ortbridge_nodes():
                break
            kind = rng.choices(names, weights)[0]
            record = MUTATIONS[kind](g, rng)
            if record is not None:
                records.append(record)
    mutations, nodes = [], set()
    for r in records:
        node = r["node"]
        mutations.append(
            {
                "kind": r["kind"],
                "node": _display(g, node.name),
                "match": _name_match(g, node.name),
                "attribute": r["attribute"],
                "detail": r["detail"],
            }
        )
        touched = [node] + r["also"]
        if r["attribute"] is None or r["attribute"] in _TYPE_ATTRIBUTES:
            # A mistake between two nodes (a type, a value, an edge) may be reported at either.
            touched += _neighbours(g, node)
        for n in touched:
            nodes.add(_name_match(g, n.name))
            if n.name == "":
                nodes.add("node ()")  # (how ONNX Runtime's own errors show a node without a name)
    attrs = [m["attribute"] for m in mutations]
    forwards = [n for n in g.nodes if n.domain == DOMAIN and n.op == "PythonOp" and n.outputs]
    description = {
        "seed": seed,
        "index": index,
        "base": base_name,
        "mutations": mutations,
        "kinds": sorted({m["kind"] for m in mutations}),
        # every node a mutation touched, as an error message would show it
        "nodes": sorted(nodes),
        # the attributes, when every mutation targets exactly one attribute; else None
        "attributes": sorted(set(attrs)) if attrs and all(attrs) else None,
        "accepted": sorted({a for x in attrs if x for a in related_attributes(x)}) if attrs and all(attrs) else None,
        # graph outputs that are context ids: the caller owns those contexts (and releases them)
        "context_outputs": sorted({o[0] for o in g.outputs if any(o[0] == n.outputs[0] for n in forwards)}),
    }
    return serialize(g), g.feeds, description


_TYPE_ATTRIBUTES = {"input_tensor_types", "input_tensor_ranks", "output_tensor_types", "output_tensor_ranks"}


def _neighbours(g, node):
    ins = {v for v in node.inputs if v}
    outs = {v for v in node.outputs if v}
    return [n for n in g.nodes if n is not node and (ins & set(n.outputs) or outs & set(n.inputs))]


def _display(g, name):
    raw = g.raw.get(name)
    text = raw.decode("utf-8", "backslashreplace") if raw is not None else name
    return text if len(text) <= 80 else text[:60] + f"...({len(text)} chars)"
