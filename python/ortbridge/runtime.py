"""ONNX Runtime sessions with the ortbridge kernels registered."""

from __future__ import annotations

import functools
import re

import numpy as np

try:
    import onnxruntime as ort
except ModuleNotFoundError as e:  # it comes from an extra: one of two packages that install it
    raise ModuleNotFoundError(
        "ortbridge needs ONNX Runtime: pip install 'ortbridge[cpu]' (onnxruntime) or "
        "'ortbridge[gpu]' (onnxruntime-gpu, with the CUDA execution provider)",
        name="onnxruntime",
    ) from e

from . import _C
from ._copying import NotCopyable
from ._kernel import runner

_REGISTERED_KEY = "ortbridge.kernels_registered"
_REFUSED_NODE = re.compile(r"ortbridge \w+ node '[^']*' \(function '[^']*'\)")
# Session config entries ("1"), set before the kernels are registered. CPU_KERNELS_ONLY: the
# session gets no CUDA kernels, so ORT runs every node on the CPU, with copies around it, for
# Functions that need host tensors (numpy, CPU-only libraries). CPU_KERNELS_VIA_TORCH: the CPU
# kernels take the CUDA kernels' code path (torch writes the outputs, inside a stream scope),
# which lets the tests run that path on machines without a GPU.
CPU_KERNELS_ONLY = "ortbridge.cpu_kernels_only"
CPU_KERNELS_VIA_TORCH = "ortbridge.cpu_kernels_via_torch"


def library_path() -> str:
    """Path of the custom-op library, for SessionOptions.register_custom_ops_library."""
    return _C.__file__


def session_options(options: ort.SessionOptions | None = None, *, cuda_kernels: bool = True) -> ort.SessionOptions:
    """`options` (or new SessionOptions) with the ortbridge kernels registered, once. With
    `cuda_kernels=False` the nodes run on the CPU even in a session on the CUDA provider (ORT
    copies their tensors to the host and back), for Functions that need host tensors."""
    options = options if options is not None else ort.SessionOptions()
    registered = _config_entry(options, _REGISTERED_KEY) == "1"
    if not cuda_kernels and _config_entry(options, CPU_KERNELS_ONLY) != "1":
        if registered:
            raise ValueError(
                "these SessionOptions have the ortbridge kernels registered with the CUDA ones: "
                "ask for cuda_kernels=False on new SessionOptions"
            )
        options.add_session_config_entry(CPU_KERNELS_ONLY, "1")
    if not registered:
        options.register_custom_ops_library(library_path())
        options.add_session_config_entry(_REGISTERED_KEY, "1")
    return options


def _config_entry(options: ort.SessionOptions, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # ORT raises for a key it does not hold
        return None


def _scoped(run, outputs_of):
    """Wraps a run method in a run scope (see in_run_scope)."""

    @functools.wraps(run)
    def scoped(self, *args, **kwargs):
        return in_run_scope(lambda: run(self, *args, **kwargs), lambda result: outputs_of(result, args, kwargs))

    return scoped


def run_in_scope(run) -> tuple[object, list[int]]:
    """run() in a run scope (csrc/run_scope.h): (its result, the ids of the autograd contexts it left
    live that no context-id tensor holds, which the caller keeps or releases); a failed run
    releases the contexts it created."""
    _C._begin_run()
    try:
        result = run()
    except BaseException:
        _C._end_run(failed=True)
        raise
    return result, _C._end_run(failed=False)


def in_run_scope(run, outputs_of):
    """run() in a run scope: a failed run releases the autograd contexts it created; a run that
    succeeds releases those whose id none of outputs_of(its result) holds (nothing could ever
    take them)."""
    result, unheld = run_in_scope(run)
    if unheld:
        returned = _returned(unheld, outputs_of(result))
        for context_id in unheld:
            if context_id not in returned:
                _C.release_context(context_id)
    return result


def _returned(ids: list, outputs) -> set:
    """Those of `ids` among a run's int64 outputs (numpy arrays or OrtValues)."""
    wanted = np.array(ids, dtype=np.int64)
    found = set()
    for value in outputs:
        if isinstance(value, ort.OrtValue):
            if not value.is_tensor() or value.data_type() != "tensor(int64)":
                continue
            if value.device_name() != "cpu" and value.shape() != []:
                continue  # (a context id on a device, 0-d, is copied to the host to be read)
            value = value.numpy()
        if isinstance(value, np.ndarray) and value.dtype == np.int64:
            found.update(wanted[np.isin(wanted, value)].tolist())
    return found


def _binding_outputs(result, args, kwargs):
    binding = args[0] if args else kwargs["iobinding"]
    return binding.get_outputs()


class InferenceSession(NotCopyable, ort.InferenceSession):
    """onnxruntime.InferenceSession that can run ortbridge PythonOp/PythonOpGrad nodes."""

    def __init__(
        self,
        path_or_bytes,
        sess_options: ort.SessionOptions | None = None,
        providers=None,
        provider_options=None,
        **kwargs,
    ):
        runner.take_refusal()
        try:
            super().__init__(path_or_bytes, session_options(sess_options), providers, provider_options, **kwargs)
        except Exception as e:  # (a node naming no Function: the error its kernel refused it with)
            refused = runner.take_refusal()
            if refused is None:
                raise
            where = _REFUSED_NODE.search(str(e))  # (the kernel's own prefix: which node)
            raise type(refused)(f"{where.group(0)}: {refused}" if where else str(refused)) from e

    run = _scoped(ort.InferenceSession.run, lambda result, args, kwargs: result)
    run_with_ort_values = _scoped(ort.InferenceSession.run_with_ort_values, lambda result, args, kwargs: result)
    run_with_iobinding = _scoped(ort.InferenceSession.run_with_iobinding, _binding_outputs)


def context_pool_size() -> int:
    """Live autograd contexts: training-mode forwards whose backward has not run yet."""
    return _C.context_pool_size()


def release_context(context_id: int) -> bool:
    """Drop a context whose backward will never run. Returns whether it was live."""
    return _C.release_context(int(context_id))
