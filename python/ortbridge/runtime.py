"""ONNX Runtime sessions with the ortbridge kernels registered."""

from __future__ import annotations

import functools

import onnxruntime as ort

from . import _C

_REGISTERED_KEY = "ortbridge.kernels_registered"


def library_path() -> str:
    """Path of the custom-op library, for SessionOptions.register_custom_ops_library."""
    return _C.__file__


def session_options(options: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """`options` (or new SessionOptions) with the ortbridge kernels registered, once."""
    options = options if options is not None else ort.SessionOptions()
    try:
        registered = options.get_session_config_entry(_REGISTERED_KEY) == "1"
    except RuntimeError:  # ORT raises for a key it does not hold
        registered = False
    if not registered:
        options.register_custom_ops_library(library_path())
        options.add_session_config_entry(_REGISTERED_KEY, "1")
    return options


def _releasing_on_failure(run):
    """Wraps a run method so that a failed run releases the autograd contexts it created."""

    @functools.wraps(run)
    def scoped(self, *args, **kwargs):
        _C._begin_run()
        try:
            result = run(self, *args, **kwargs)
        except BaseException:
            _C._end_run(failed=True)
            raise
        _C._end_run(failed=False)
        return result

    return scoped


class InferenceSession(ort.InferenceSession):
    """onnxruntime.InferenceSession that can run ortbridge PythonOp/PythonOpGrad nodes."""

    def __init__(self, path_or_bytes, sess_options: ort.SessionOptions | None = None, providers=None,
                 provider_options=None, **kwargs):
        super().__init__(path_or_bytes, session_options(sess_options), providers, provider_options, **kwargs)

    run = _releasing_on_failure(ort.InferenceSession.run)
    run_with_ort_values = _releasing_on_failure(ort.InferenceSession.run_with_ort_values)
    run_with_iobinding = _releasing_on_failure(ort.InferenceSession.run_with_iobinding)


def context_pool_size() -> int:
    """Live autograd contexts: training-mode forwards whose backward has not run yet."""
    return _C.context_pool_size()


def release_context(context_id: int) -> bool:
    """Drop a context whose backward will never run. Returns whether it was live."""
    return _C.release_context(int(context_id))
