"""What the benchmarks share: the Functions they run, session set-up (CPU, or CUDA for
`--device cuda`), and the timer (median over repeats of N back-to-back calls, N calibrated per
function; on CUDA the device is synchronized before and after each repeat)."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

import ortbridge

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("ortbridge", 1)]


@ortbridge.register(name="ortbridge_bench.Clone")
class Clone(torch.autograd.Function):
    """Identity-like: a fresh tensor out, the gradient passed through."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


@ortbridge.register(name="ortbridge_bench.SavesInput")
class SavesInput(torch.autograd.Function):
    """Shaped like an activation (timm's HardSwishMe, SwishMe): saves its input for backward,
    which reads it back."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2


@ortbridge.register(name="ortbridge_bench.View")
class View(torch.autograd.Function):
    """Returns a view of its input: no work at all in torch."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _rank1_float_node(op_type: str, inputs: list, outputs: list, func: type, name: str, **attributes):
    """A node of `func` whose tensor input and output are rank-1 float32."""
    return helper.make_node(
        op_type,
        inputs,
        outputs,
        domain="ortbridge",
        name=name,
        func_name=func._ortbridge_name,
        input_tensor_types=[TensorProto.FLOAT],
        input_tensor_ranks=[1],
        output_tensor_types=[TensorProto.FLOAT],
        output_tensor_ranks=[1],
        **attributes,
    )


def python_op(func: type, x: str, y: str, ctx: str, name: str, training: bool = False, safe: bool = True):
    """A PythonOp node calling func.apply(x) on a rank-1 float32 tensor (func.forward, with no
    autograd, when not `safe`)."""
    return _rank1_float_node(
        "PythonOp",
        [x],
        [ctx, y],
        func,
        name,
        input_convention="d",
        input_requires_grads=[int(training)],
        training_mode=int(training),
        safe_run_mode=int(safe),
    )


def python_op_grad(func: type, ctx: str, g: str, gx: str, name: str):
    return _rank1_float_node(
        "PythonOpGrad", [ctx, g], [gx], func, name, output_convention="d", output_tensor_requires_grads=[1]
    )


def session(nodes: list, inputs: list, outputs: list, threads: int = 1, device: str = "cpu") -> ort.InferenceSession:
    """A sequential session with `threads` intra-op threads; inputs/outputs: (name, shape). With
    device "cuda" every node runs on the CUDA execution provider of device 0 (session creation
    fails rather than placing one on the CPU)."""
    graph = helper.make_graph(
        nodes,
        "bench",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
    )
    return model_session(
        helper.make_model(graph, opset_imports=OPSETS, ir_version=8).SerializeToString(), threads, device
    )


def model_session(model: bytes, threads: int = 1, device: str = "cpu") -> ort.InferenceSession:
    """A session of `model` as session() makes one."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if device == "cpu":
        return ortbridge.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    sess = ortbridge.InferenceSession(
        model, so, providers=[("CUDAExecutionProvider", {"device_id": "0"}), "CPUExecutionProvider"]
    )
    if sess.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(
            f"ONNX Runtime did not start its CUDA execution provider (providers: {sess.get_providers()})"
        )
    return sess


def cuda_missing() -> str | None:
    """What this machine lacks for `--device cuda`, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install ortbridge[gpu])"
    return None


def require_device(device: str, script: str) -> None:
    """Exits with status 2 and the reason when `device` is cuda and this machine cannot run it."""
    reason = cuda_missing() if device == "cuda" else None
    if reason is not None:
        print(f"{script}: --device cuda cannot run here: {reason}", file=sys.stderr)
        sys.exit(2)


def cuda_versions() -> str:
    """The GPU and the CUDA versions (for --device cuda)."""
    props = torch.cuda.get_device_properties(0)
    return (
        f"GPU {props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})  "
        f"torch CUDA {torch.version.cuda}  onnxruntime {ort.get_device()} build"
    )


def versions() -> str:
    return (
        f"python {platform.python_version()}  torch {torch.__version__}  onnxruntime {ort.__version__}  "
        f"onnx {onnx.__version__}  numpy {np.__version__}  cpus {os.cpu_count()}"
    )


def loop_time(fn, n: int, sync=None) -> float:
    """Seconds per call over n back-to-back calls (`sync`, when given, runs before the clock starts
    and before it stops: all work of the calls is inside the time, none of earlier work)."""
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if sync is not None:
        sync()
    return (time.perf_counter() - t0) / n


def calibrate(fn, target: float, sync=None) -> int:
    """Iterations so that one repeat takes about `target` seconds."""
    n = 1
    while True:
        elapsed = loop_time(fn, n, sync) * n
        if elapsed >= min(0.03, target / 4):
            break
        n *= 2
    return max(1, int(round(target * n / elapsed)))


def medians(fns: list, repeats: int, target: float, warmup: int, sync=None) -> list[float]:
    """Median seconds per call of each function; the functions' repeats are interleaved, so that
    drift on the machine touches them all alike. The garbage collector is off while timing.
    `sync` (torch.cuda.synchronize for CUDA work) brackets every timed loop."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    ns = [calibrate(fn, target, sync) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for fn, n, acc in zip(fns, ns, times):
                acc.append(loop_time(fn, n, sync))
    finally:
        gc.enable()
    return [statistics.median(t) for t in times]
