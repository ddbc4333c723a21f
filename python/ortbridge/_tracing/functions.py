"""Facts about a torch.autograd.Function that the exporter, training and the runner rely on."""

from __future__ import annotations

import inspect

from .._compat.torch_private import uses_setup_context


class ExportError(TypeError):
    """A model or argument ortbridge cannot turn into ONNX; the message says what to do."""


def bind(func: type, args: tuple, kwargs: dict) -> tuple:
    """apply's arguments as the positional ones torch passes on: for Functions with setup_context
    torch binds keyword and defaulted arguments; other Functions take positional ones only."""
    if uses_setup_context(func):
        bound = inspect.signature(func.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.args)
    if kwargs:
        raise ExportError(
            f"{func.__qualname__}.apply got keyword arguments {sorted(kwargs)}; torch passes keyword "
            "arguments only to Functions that define setup_context. Pass them by position."
        )
    return tuple(args)
