"""Every private onnxruntime API that ortbridge uses, in one place (no other module of the package
reaches one itself: tests/python/test_private_apis.py). Its public classes, behind these, are
the same in every release from 1.19."""

from __future__ import annotations

import contextlib
import os
import re
import threading

import onnx
import onnxruntime as ort

# (major, minor) of the installed onnxruntime: where releases differ (1.19 and 1.20: bfloat16
# binding, MatMul of an empty inner dimension)
RELEASE = tuple(int(part) for part in re.findall(r"\d+", ort.__version__)[:2])

try:  # onnxruntime-training's gradient builder and TrainingAgent (training/ort_gradient.py)
    from onnxruntime.capi import _pybind_state as training_c
except ImportError:  # pragma: no cover (every onnxruntime has the module)
    training_c = None


def c_session(session: ort.InferenceSession):
    """The C++ session behind an InferenceSession, which an IOBinding of ortbridge's own and
    onnxruntime-training's TrainingAgent take."""
    return session._sess


def c_device(device_type: str, index: int):
    """The C++ OrtDevice that IOBinding's bind calls take."""
    return ort.OrtDevice.make(device_type, index)._get_c_device()


@contextlib.contextmanager
def every_session_prepared(prepare):
    """Every onnxruntime.InferenceSession created meanwhile, by any module (ORT's tools bind the
    class under names of their own), has its SessionOptions (or None) replaced by prepare(them)
    first: where its constructor hands them to the C++ session."""
    cls = ort.InferenceSession
    create = cls._create_inference_session

    def prepared(self, *args, **kwargs):
        self._sess_options = prepare(self._sess_options)
        return create(self, *args, **kwargs)

    cls._create_inference_session = prepared
    try:
        yield
    finally:
        cls._create_inference_session = create


@contextlib.contextmanager
def library_registered_once(path: str, register):
    """Meanwhile SessionOptions.register_custom_ops_library(path) (the .ort converter registers the
    library it is given) is register(options), which registers it where it is not yet: ORT refuses
    a second registration of the same library at session creation."""
    cls = ort.SessionOptions
    original = cls.register_custom_ops_library
    inside = threading.local()

    def once(self, library):
        if getattr(inside, "registering", False) or not os.path.samefile(library, path):
            return original(self, library)
        inside.registering = True
        try:
            register(self)
        finally:
            inside.registering = False

    cls.register_custom_ops_library = once
    try:
        yield
    finally:
        cls.register_custom_ops_library = original


@contextlib.contextmanager
def symbolic_shape_handlers(handle, op_types: tuple):
    """ORT's symbolic shape inference (onnxruntime.tools.symbolic_shape_infer), meanwhile, infers the
    nodes of `op_types` with handle(Inferred(inference, node), its own handler or None)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    init = SymbolicShapeInference.__init__

    def with_handlers(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for op_type in op_types:
            own = self.dispatcher_.get(op_type)
            self.dispatcher_[op_type] = lambda node, own=own: handle(Inferred(self, node), own)

    SymbolicShapeInference.__init__ = with_handlers
    try:
        yield
    finally:
        SymbolicShapeInference.__init__ = init


class Inferred:
    """One node in ORT's symbolic shape inference: its inputs' shapes, and its outputs' types to set."""

    def __init__(self, inference, node):
        self.inference, self.node = inference, node

    def input_shape(self, index: int) -> list:
        return self.inference._get_shape(self.node, index)

    def new_shape(self, rank: int, output: int) -> list:
        """A shape of new symbolic dims."""
        from onnxruntime.tools.symbolic_shape_infer import get_shape_from_sympy_shape

        return get_shape_from_sympy_shape(self.inference._new_symbolic_shape(rank, self.node, output))

    def set_output(self, output: int, elem_type: int, shape: list) -> None:
        name = self.node.output[output]
        value = onnx.helper.make_tensor_value_info(name, elem_type, shape)
        if name in self.inference.known_vi_:
            self.inference.known_vi_[name].CopyFrom(value)
        else:
            self.inference.known_vi_[name] = value
