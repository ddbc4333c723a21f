"""NotCopyable: objects that copy.copy, copy.deepcopy and pickle refuse, all three through
__reduce_ex__, before any part of the object is copied."""

from __future__ import annotations


class NotCopyable:
    """An object bound to this process: an ONNX Runtime session or binding, or a traced graph.

    Copying one must fail before it starts. A deepcopy that fails halfway has already copied what
    came before the failing part: a traced graph's fake tensors hold (in their fake mode) torch's
    StorageWeakRefs, whose copies free the same weak reference again at __del__, which corrupts
    the heap; pybind11 objects (ONNX Runtime's sessions) abort the process in pickle protocols
    0 and 1."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"{type(self).__module__}.{type(self).__qualname__} cannot be copied or pickled: it holds "
            "ONNX Runtime state or a traced graph of this process (make a new one instead)"
        )
