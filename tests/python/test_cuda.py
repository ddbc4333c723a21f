"""CUDA: the kernels on ONNX Runtime's CUDA execution provider (hand-built graphs), OrtModule and
torch.compile on CUDA tensors, and the CUDA extension Function of examples/cuda_function.py.

Every GPU test is skipped, saying what is missing, without a CUDA GPU or without onnxruntime's
CUDAExecutionProvider (scripts/gpu_check.sh runs this file on a GPU machine). The checks at the top
(the CPU provider with the CUDA kernels in the library, what a CPU-only onnxruntime does when asked
for the CUDA provider, the example and the benchmarks' --device cuda without a GPU) run everywhere.

On the GPU the comparisons with eager PyTorch are tight: ORT's CUDA provider runs with
use_tf32=0 (EXACT) and eager torch with TF32 off (the full_float32 fixture), both in full float32;
a Function's own kernels are the same in both. The one test of ORT's default options (TF32 on)
allows for TF32's rounding.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import T, model, python_op, python_op_grad, session, value
from onnx import TensorProto as TP
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, RuntimeException
from side_by_side import assert_close, train_side_by_side
from test_training_graph import MulSum, cross_session_models, eager_mulsum, mulsum_model

import ortbridge

ORT_ERRORS = (Fail, RuntimeException)
ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cuda_function.py"
BENCHMARKS = ROOT / "benchmarks"

NO_GPU = "no CUDA GPU (torch.cuda.is_available() is False)"
NO_CUDA_EP = "onnxruntime has no CUDAExecutionProvider (install ortbridge[gpu])"
HAS_GPU = torch.cuda.is_available()
HAS_CUDA_EP = "CUDAExecutionProvider" in ort.get_available_providers()
MISSING = "; ".join(reason for reason, ok in ((NO_GPU, HAS_GPU), (NO_CUDA_EP, HAS_CUDA_EP)) if not ok)
cuda = pytest.mark.skipif(bool(MISSING), reason=MISSING)

# Full float32 in ORT's CUDA provider: its default (use_tf32=1) runs float32 MatMul, Gemm and Conv
# in TF32, which eager torch's matmuls do not.
EXACT = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]


def _load_example():
    """examples/cuda_function.py as the module `cuda_function` (importing it builds nothing)."""
    spec = importlib.util.spec_from_file_location("cuda_function", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = _load_example()


# --- helpers ----------------------------------------------------------------------------------


def cuda_session(model_bytes: bytes, device: int = 0, **provider_options) -> ortbridge.InferenceSession:
    """A session whose every node runs on the CUDA provider of `device`: with
    session.disable_cpu_ep_fallback, a node the CUDA provider does not take fails session creation
    instead of falling back to the CPU."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    providers = [("CUDAExecutionProvider", {"device_id": str(device), **provider_options}), "CPUExecutionProvider"]
    sess = ortbridge.InferenceSession(model_bytes, options, providers=providers)
    assert sess.get_providers()[0] == "CUDAExecutionProvider", sess.get_providers()
    return sess


def _observe(t: torch.Tensor) -> dict:
    """What a Function sees of its tensor and of torch's CUDA state (no synchronization)."""
    seen = {"device": t.device, "data_ptr": t.data_ptr()}
    if t.is_cuda:
        stream = torch.cuda.current_stream()
        seen.update(
            current_device=torch.cuda.current_device(),
            stream=stream.cuda_stream,
            stream_device=stream.device,
            default_stream=torch.cuda.default_stream(t.device).cuda_stream,
        )
    return seen


def _assert_on_ort_stream(seen: dict, device: int = 0):
    assert seen["device"] == torch.device("cuda", device), seen
    assert seen["current_device"] == device and seen["stream_device"] == torch.device("cuda", device), seen
    assert seen["stream"] != 0 and seen["stream"] != seen["default_stream"], (
        f"the Function ran on torch's default stream, not on ORT's compute stream: {seen}"
    )


def _bind(io, name: str, t: torch.Tensor, output: bool = False):
    """Binds a contiguous torch CUDA tensor's memory as an input or output of `io`."""
    assert t.is_cuda and t.is_contiguous()
    bind = io.bind_output if output else io.bind_input
    bind(name, "cuda", t.device.index, _NUMPY[t.dtype], list(t.shape), t.data_ptr())


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64}


def _sleep_cycles(milliseconds: float) -> int:
    """torch.cuda._sleep cycles that last about `milliseconds` on this GPU (measured twice: the
    first run lets the clocks rise)."""
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        per_ms = 10_000_000 / start.elapsed_time(end)
    return int(milliseconds * per_ms)


@pytest.fixture
def full_float32():
    """Eager torch in full float32: cuDNN convolutions default to TF32 on Ampere and newer."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def sessions_made(monkeypatch):
    """The providers of every ortbridge.InferenceSession made during the test (OrtModule's too)."""
    made = []
    original = ortbridge.InferenceSession.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self.get_providers())

    monkeypatch.setattr(ortbridge.InferenceSession, "__init__", init)
    return made


@pytest.fixture
def mulsum_seen():
    """What test_training_graph's MulSum sees (_observe) in forward and backward during the test."""
    seen = []

    def observe(t):
        seen.append(_observe(t))

    MulSum.observers.append(observe)
    yield seen
    MulSum.observers.remove(observe)


@pytest.fixture(scope="module")
def extension():
    """The example's compiled CUDA extension (built once; cached by torch across runs)."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        pytest.skip("no CUDA toolkit for torch.utils.cpp_extension (nvcc not found; set CUDA_HOME)")
    return example.build_extension()


# --- Functions --------------------------------------------------------------------------------


@ortbridge.register
class Probe(torch.autograd.Function):
    """y = 2x + 1; records what forward and backward see."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        Probe.seen.append(_observe(x))
        return x * 2 + 1

    @staticmethod
    def backward(ctx, g):
        Probe.seen.append(_observe(g))
        return g * 2


@ortbridge.register
class TwoOutputs(torch.autograd.Function):
    """(2x, 3x); backward records the gradients it gets."""

    grads: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, ga, gb):
        TwoOutputs.grads.append((_observe(gb), ga.clone(), gb.clone()))
        return ga * 2 + gb * 3


@ortbridge.register
class FirstGradOnly(torch.autograd.Function):
    """x * w, whose backward gives no gradient for w (None)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w, None


@ortbridge.register
class WrongDevice(torch.autograd.Function):
    """2x, whose forward or backward (as `mode` says) returns a CPU tensor."""

    mode = None

    @staticmethod
    def forward(ctx, x):
        y = x * 2
        return y.cpu() if WrongDevice.mode == "forward" else y

    @staticmethod
    def backward(ctx, g):
        gx = g * 2
        return gx.cpu() if WrongDevice.mode == "backward" else gx


@ortbridge.register
class Sleeper(torch.autograd.Function):
    """x + 1 after a GPU spin of `cycles` on torch's current stream; events mark start and end."""

    cycles = 0
    events: list = []

    @staticmethod
    def forward(ctx, x):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(Sleeper.cycles)
        y = x + 1
        end.record()
        Sleeper.events.append((start, end, torch.cuda.current_stream().cuda_stream))
        return y


class ScaledGelu(torch.autograd.Function):
    """x * sigmoid(1.702 x) in torch operators (OrtModule registers it: all_functions=True)."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        ScaledGelu.seen.append(_observe(x))
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, g):
        ScaledGelu.seen.append(_observe(g))
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return g * (s + 1.702 * x * s * (1 - s))


class Gelu(torch.autograd.Function):
    """ScaledGelu without the records: dynamo traces it (torch.compile inlines it into the graph)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return g * (s + 1.702 * x * s * (1 - s))


class Mlp(torch.nn.Module):
    def __init__(self, act=ScaledGelu):
        super().__init__()
        self.fc1, self.fc2, self.act = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8), act

    def forward(self, x):
        return self.fc2(self.act.apply(self.fc1(x)))


class HardSwishMe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.nn.functional.relu6(x + 3) / 6

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.where(x < -3, 0.0, torch.where(x > 3, 1.0, x / 3 + 0.5))


class Act(torch.nn.Module):
    def forward(self, x):
        return HardSwishMe.apply(x)


def _cnn() -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        Act(),
        nn.Conv2d(8, 16, 3, stride=2, groups=2),
        nn.BatchNorm2d(16),
        Act(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def _inputs(*shape):
    """batch(step) -> ((x,), {}) for train_side_by_side: a seeded input on the GPU that needs a
    gradient."""

    def make(step: int):
        g = torch.Generator().manual_seed(100 + step)
        return (torch.randn(*shape, generator=g).cuda().requires_grad_(),), {}

    return make


def _targets(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(200 + step)


def _mse_loss(out, step):
    """Mean squared error against seeded regression targets of the output's shape."""
    return torch.nn.functional.mse_loss(out, torch.randn(out.shape, generator=_targets(step)).to(out.device))


def _ce_loss(out, step):
    """Cross entropy against seeded class indices, one a row (out.shape[-1] classes)."""
    labels = torch.randint(out.shape[-1], (out.shape[0],), generator=_targets(step))
    return torch.nn.functional.cross_entropy(out, labels.to(out.device))


def _probe_graph(training: bool = False) -> bytes:
    fw = python_op(Probe, [T("x", requires_grad=training)], [(TP.FLOAT, 1)], out_names=["y"], training=training)
    if not training:
        return model([fw], [value("x", shape=[None])], [value("y")])
    bw = python_op_grad(Probe, "d", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    return model([fw, bw], [value("x", shape=[None]), value("g", shape=[None])], [value("y"), value("gx")])


# --- without a GPU too ------------------------------------------------------------------------


def test_cpu_provider_runs_with_the_cuda_kernels_in_the_library():
    # The library registers PythonOp/PythonOpGrad for the CPU and the CUDA provider in one domain;
    # a CPU session takes the CPU kernels and the Function sees CPU tensors.
    Probe.seen.clear()
    sess = session(_probe_graph(training=True))
    x, g = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    y, gx = sess.run(None, {"x": x, "g": g})
    np.testing.assert_array_equal(y, x * 2 + 1)
    np.testing.assert_array_equal(gx, g * 2)
    assert [s["device"] for s in Probe.seen] == [torch.device("cpu")] * 2


@pytest.mark.skipif(
    HAS_CUDA_EP, reason="this onnxruntime has the CUDAExecutionProvider: there is no CPU-only fallback to see"
)
@pytest.mark.parametrize("providers", [["CUDAExecutionProvider", "CPUExecutionProvider"], ["CUDAExecutionProvider"]])
def test_cuda_provider_asked_of_a_cpu_onnxruntime_falls_back_to_the_cpu(providers):
    # What onnxruntime (the CPU package) does: its Python wrapper warns about a provider it does not
    # have (UserWarning "Specified provider 'CUDAExecutionProvider' is not in available provider
    # names...") and drops it; the session is made on the CPU provider (ORT always adds it), no
    # error, and the node runs there on CPU tensors.
    Probe.seen.clear()
    with pytest.warns(UserWarning, match="Specified provider 'CUDAExecutionProvider' is not in available provider"):
        sess = ortbridge.InferenceSession(_probe_graph(), providers=providers)
    assert sess.get_providers() == ["CPUExecutionProvider"]
    x = np.arange(5, dtype=np.float32)
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_array_equal(y, x * 2 + 1)
    assert [s["device"] for s in Probe.seen] == [torch.device("cpu")]


def test_example_script_runs(tmp_path):
    # Without a GPU it says what is missing and exits 0; with one it checks itself against eager.
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    if MISSING:
        assert "nothing run" in proc.stdout and MISSING.split("; ")[0] in proc.stdout, output
    else:
        assert "OK: ONNX Runtime on the CUDA execution provider matches eager PyTorch" in proc.stdout, output


@pytest.mark.parametrize(
    "script, args",
    [("overhead.py", ["--quick", "--modes", "inference,training"]), ("zero_copy.py", ["--quick", "--max-size", "1M"])],
)
def test_benchmarks_device_cuda(script, args):
    # Without a GPU: exit status 2 and the reason; with one: a short run (its own checks pass).
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--device", "cuda", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if MISSING:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert MISSING.split("; ")[0] in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "ratio" in proc.stdout or "/tc" in proc.stdout


# --- (a) the Function on the CUDA provider: device, stream, zero copy -------------------------


@cuda
@pytest.mark.parametrize("device", sorted({0, torch.cuda.device_count() - 1}) if HAS_GPU else [0])
def test_function_gets_cuda_tensors_on_ort_stream(device):
    Probe.seen.clear()
    sess = cuda_session(_probe_graph(), device)
    x = np.linspace(-1, 1, 7, dtype=np.float32)
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, x * 2 + 1, rtol=1e-6)
    (seen,) = Probe.seen
    _assert_on_ort_stream(seen, device)
    # The kernel gives torch its stream back after the call.
    assert torch.cuda.current_stream(device) == torch.cuda.default_stream(device)


@cuda
def test_bound_device_tensors_reach_the_function_without_a_copy():
    Probe.seen.clear()
    sess = cuda_session(_probe_graph())
    x = torch.linspace(-1, 1, 1000, device="cuda")
    y = torch.empty_like(x)
    io = sess.io_binding()
    _bind(io, "x", x)
    _bind(io, "y", y, output=True)
    torch.cuda.synchronize()  # ORT's stream does not wait for torch's: x must be ready
    sess.run_with_iobinding(io)  # returns once ORT's stream is done (ORT's default)
    assert Probe.seen[0]["data_ptr"] == x.data_ptr(), "the Function got a copy of the bound input"
    _assert_on_ort_stream(Probe.seen[0])
    torch.testing.assert_close(y, x * 2 + 1)


# --- (b) training graphs: PythonOp then PythonOpGrad ------------------------------------------

# MulSum, its graphs and its eager run are test_training_graph's (the mulsum_seen fixture watches it).


@cuda
def test_training_graph_forward_and_backward_match_eager(mulsum_seen):
    sess = cuda_session(mulsum_model())
    rng = np.random.default_rng(1)
    for n in (5, 1, 300):  # one session, several sizes
        x, w, gy = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
        gs = np.asarray(rng.standard_normal(), np.float32)
        mulsum_seen.clear()
        got = sess.run(None, {"x": x, "w": w, "gy": gy, "gs": gs})
        assert ortbridge.context_pool_size() == 0
        assert len(mulsum_seen) == 2  # forward and backward, both on ORT's stream
        for seen in mulsum_seen:
            _assert_on_ort_stream(seen)
        for g, e, what in zip(got, eager_mulsum(x, w, gy, gs, device="cuda"), ("y", "s", "gx", "gw")):
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6, err_msg=what)


@cuda
def test_context_id_crosses_sessions_through_the_host():
    # The forward session hands out the context id (PythonOp writes it in device memory; fetched,
    # it is copied to the host); the backward session takes it as a host input (PythonOpGrad
    # declares its input 0 on the CPU).
    forward, backward = (cuda_session(m) for m in cross_session_models())
    x, w = np.ones(3, np.float32), np.arange(3, dtype=np.float32)
    ctx1, *_ = forward.run(None, {"x": x, "w": w})
    ctx2, *_ = forward.run(None, {"x": x, "w": w})
    assert ortbridge.context_pool_size() == 2 and ctx1 != ctx2
    gx, gw = backward.run(None, {"ctx": ctx2, "gy": np.ones(3, np.float32), "gs": np.asarray(0, np.float32)})
    np.testing.assert_allclose(gw, x * 0.3, rtol=1e-6)
    np.testing.assert_allclose(gx, w * 0.3, rtol=1e-6)
    assert ortbridge.context_pool_size() == 1
    assert ortbridge.release_context(int(ctx1)) is True

    # The same through IOBinding, as OrtModule runs it: tensors bound on the device, the context id
    # output bound on the host.
    xt, wt = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
    yt, st = torch.empty_like(xt), torch.empty((), device="cuda")
    io = forward.io_binding()
    _bind(io, "x", xt)
    _bind(io, "w", wt)
    io.bind_output("ctx", "cpu")
    _bind(io, "y", yt, output=True)
    _bind(io, "s", st, output=True)
    torch.cuda.synchronize()
    forward.run_with_iobinding(io)
    ctx = io.get_outputs()[0].numpy()
    assert ortbridge.context_pool_size() == 1
    gy, gs = torch.ones(3, device="cuda"), torch.zeros((), device="cuda")
    gxt, gwt = torch.empty_like(xt), torch.empty_like(wt)
    io2 = backward.io_binding()
    io2.bind_cpu_input("ctx", ctx)
    _bind(io2, "gy", gy)
    _bind(io2, "gs", gs)
    _bind(io2, "gx", gxt, output=True)
    _bind(io2, "gw", gwt, output=True)
    torch.cuda.synchronize()
    backward.run_with_iobinding(io2)
    assert ortbridge.context_pool_size() == 0
    torch.testing.assert_close(gwt, xt * 0.3)
    torch.testing.assert_close(yt, xt * wt * 0.3)


# --- (c) zero gradients made on the device ----------------------------------------------------


@cuda
def test_absent_gradient_is_materialized_as_zeros_on_the_device():
    TwoOutputs.grads.clear()
    fw = python_op(TwoOutputs, [T("x", requires_grad=True)], [(TP.FLOAT, 1)] * 2, out_names=["a", "b"], training=True)
    bw = python_op_grad(TwoOutputs, "d", [("ga", TP.FLOAT, 1), (None, TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    sess = cuda_session(
        model([fw, bw], [value("x", shape=[None]), value("ga", shape=[None])], [value("b"), value("gx")])
    )
    x, ga = np.arange(6, dtype=np.float32), np.linspace(-1, 1, 6, dtype=np.float32)
    b, gx = sess.run(None, {"x": x, "ga": ga})
    np.testing.assert_allclose(b, x * 3)
    np.testing.assert_allclose(gx, ga * 2, rtol=1e-6)
    ((seen, ga_seen, gb_seen),) = TwoOutputs.grads
    _assert_on_ort_stream(seen)
    assert gb_seen.shape == (6,) and gb_seen.dtype == torch.float32
    assert torch.count_nonzero(gb_seen).item() == 0
    np.testing.assert_allclose(ga_seen.cpu().numpy(), ga)


@cuda
def test_none_gradient_is_written_as_zeros_on_the_device():
    fw = python_op(
        FirstGradOnly,
        [T("x", requires_grad=True), T("w", requires_grad=True)],
        [(TP.FLOAT, 1)],
        out_names=["y"],
        training=True,
    )
    bw = python_op_grad(FirstGradOnly, "dd", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1), ("gw", TP.FLOAT, 1)])
    sess = cuda_session(
        model([fw, bw], [value(n, shape=[None]) for n in ("x", "w", "g")], [value("y"), value("gx"), value("gw")])
    )
    x, w, g = (np.arange(5, dtype=np.float32) + k for k in (1, 2, 3))
    # gw bound to device memory full of NaN: the kernel must write its zeros there.
    gw = torch.full((5,), float("nan"), device="cuda")
    io = sess.io_binding()
    for name, a in (("x", x), ("w", w), ("g", g)):
        io.bind_cpu_input(name, a)
    io.bind_output("y", "cuda")
    io.bind_output("gx", "cuda")
    _bind(io, "gw", gw, output=True)
    torch.cuda.synchronize()
    sess.run_with_iobinding(io)
    y, gx, _ = io.copy_outputs_to_cpu()
    np.testing.assert_allclose(y, x * w, rtol=1e-6)
    np.testing.assert_allclose(gx, g * w, rtol=1e-6)
    assert torch.equal(gw, torch.zeros_like(gw)), gw


# --- (d) errors -------------------------------------------------------------------------------


def _wrong_device_session():
    fw = python_op(WrongDevice, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], training=True)
    bw = python_op_grad(WrongDevice, "d", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    return cuda_session(model([fw, bw], [value("x", shape=[3]), value("g", shape=[3])], [value("y"), value("gx")]))


def _run_wrong_device(sess):
    return sess.run(None, {"x": np.arange(3, dtype=np.float32), "g": np.ones(3, np.float32)})


@cuda
@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_function_returning_a_cpu_tensor_is_an_error_naming_the_devices(mode):
    sess = _wrong_device_session()
    try:
        WrongDevice.mode = None
        y, gx = _run_wrong_device(sess)
        np.testing.assert_array_equal(gx, np.full(3, 2, np.float32))
        WrongDevice.mode = mode
        with pytest.raises(ORT_ERRORS) as info:
            _run_wrong_device(sess)
        message = str(info.value)
        kind = "PythonOp node 'fw'" if mode == "forward" else "PythonOpGrad node 'bw'"
        assert f"ortbridge {kind} (function 'test_cuda.WrongDevice')" in message, message
        assert re.search(r"(output|value) 0 is on cpu\b.*\bcuda:0", message), message
        assert ortbridge.context_pool_size() == 0
        WrongDevice.mode = None  # the session still runs
        y, gx = _run_wrong_device(sess)
        np.testing.assert_array_equal(y, np.arange(3, dtype=np.float32) * 2)
        np.testing.assert_array_equal(gx, np.full(3, 2, np.float32))
    finally:
        WrongDevice.mode = None


# --- (e) the example's CUDA extension Function ------------------------------------------------


@cuda
def test_example_kernels_against_torch_operators(extension):
    x = torch.randn(257, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: example.ScaledGeluCuda.apply(t, 1.702), (x,))
    x32 = torch.randn(10_000, device="cuda", requires_grad=True)
    y = example.ScaledGeluCuda.apply(x32, 1.702)
    torch.testing.assert_close(y, example.reference(x32, 1.702))
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x32, g)
    (gr,) = torch.autograd.grad(example.reference(x32, 1.702), x32, g)
    torch.testing.assert_close(gx, gr)


@cuda
def test_example_model_exported_runs_on_the_cuda_provider(extension, tmp_path, full_float32):
    torch.manual_seed(0)
    net = example.Model().cuda().eval()
    path = str(tmp_path / "cuda_function.onnx")
    ortbridge.export(net, (torch.randn(4, 16, device="cuda"),), path, dynamic_shapes=({0: "batch"},))
    # (on the CPU provider the Function would get CPU tensors, which its kernel refuses)
    sess = ortbridge.InferenceSession(path, providers=EXACT)
    assert sess.get_providers()[0] == "CUDAExecutionProvider"
    name, out_name = sess.get_inputs()[0].name, sess.get_outputs()[0].name
    for batch in (7, 1, 33):
        x = torch.randn(batch, 16, device="cuda")
        with torch.no_grad():
            eager = net(x)
        (got,) = sess.run(None, {name: x.cpu().numpy()})
        torch.testing.assert_close(torch.from_numpy(got).cuda(), eager, rtol=1e-5, atol=1e-6)
        out = torch.empty_like(eager)
        io = sess.io_binding()
        _bind(io, name, x)
        _bind(io, out_name, out, output=True)
        torch.cuda.synchronize()
        sess.run_with_iobinding(io)
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)


@cuda
def test_example_model_trains_with_ortmodule_like_eager(extension, full_float32, sessions_made):
    torch.manual_seed(0)
    train_side_by_side(
        example.Model().cuda(),
        _inputs(64, 16),
        _mse_loss,
        wrap=lambda m: ortbridge.OrtModule(m, providers=EXACT),
        optimizer="adamw",
        lr=0.01,
    )
    assert sessions_made and all(p[0] == "CUDAExecutionProvider" for p in sessions_made), sessions_made


# --- (f) a CNN; (g) torch.compile; default options --------------------------------------------


@cuda
def test_cnn_trains_with_ortmodule_like_eager(full_float32, sessions_made):
    torch.manual_seed(0)
    # rtol 1e-3 / atol 1e-4: batch norm over 4 x 8 x 8 positions, cuDNN's and ORT's convolution
    # algorithms sum in other orders.
    train_side_by_side(
        _cnn().cuda(),
        _inputs(4, 3, 16, 16),
        _ce_loss,
        wrap=lambda m: ortbridge.OrtModule(m, providers=EXACT),
        lr=0.05,
        rtol=1e-3,
        atol=1e-4,
    )
    assert sessions_made and all(p[0] == "CUDAExecutionProvider" for p in sessions_made), sessions_made


@cuda
def test_cnn_trains_with_its_backward_in_stages_like_eager(full_float32, sessions_made):
    """The backward graph in stages (training/stages.py): a session per stage on ORT's stream, each
    stage's gradients released to autograd's CUDA thread before the next runs."""
    torch.manual_seed(0)
    wrapped = train_side_by_side(
        _cnn().cuda(),
        _inputs(4, 3, 16, 16),
        _ce_loss,
        lr=0.05,
        rtol=1e-3,
        atol=1e-4,
        wrap=lambda m: ortbridge.OrtModule(m, providers=EXACT, backward_stages=3),
    )
    (capture,) = [c for captures in wrapped._captures.values() for c in captures]
    assert capture.sessions[1].count > 1, "the backward graph ran in one piece"
    assert sessions_made and all(p[0] == "CUDAExecutionProvider" for p in sessions_made), sessions_made


@cuda
def test_torch_compile_backend_on_cuda(full_float32, sessions_made):
    torch._dynamo.reset()
    torch.manual_seed(0)
    try:
        compiled = train_side_by_side(
            Mlp(Gelu).cuda(),
            _inputs(64, 16),
            _mse_loss,
            wrap=lambda m: torch.compile(m, backend="ortbridge", options={"providers": EXACT}),
            lr=0.05,
        )
        assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    finally:
        torch._dynamo.reset()
    assert sessions_made and all(p[0] == "CUDAExecutionProvider" for p in sessions_made), sessions_made


@cuda
def test_ortmodule_runs_cuda_tensors_on_the_cuda_provider_by_default(sessions_made):
    # No providers given: CUDA tensors take the CUDA provider, with ORT's default options (TF32
    # matmuls on Ampere and newer, hence the tolerance), and the Function runs on ORT's stream.
    torch.manual_seed(0)
    eager = Mlp().cuda()
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    x = torch.randn(64, 16, device="cuda")
    wrapped(x).sum().backward()  # the capture (its eager record run is on torch's stream)
    assert sessions_made and all(p[0] == "CUDAExecutionProvider" for p in sessions_made), sessions_made
    for m in (eager, wrapped):
        m.zero_grad()
    ScaledGelu.seen.clear()
    out = wrapped(x)
    out.sum().backward()
    assert len(ScaledGelu.seen) == 2
    for seen in ScaledGelu.seen:
        _assert_on_ort_stream(seen)
    expected = eager(x)
    expected.sum().backward()
    assert_close(out, expected, "output", rtol=1e-2, atol=1e-3)
    for (name, p), q in zip(eager.named_parameters(), wrapped.parameters()):
        assert_close(q.grad, p.grad, f"{name}.grad", rtol=1e-2, atol=1e-3)
    assert ortbridge.context_pool_size() == 0


@cuda
def test_ortmodule_waits_for_torch_stream_before_reading_its_inputs(full_float32):
    # The input is written on torch's stream behind a long GPU spin: if ORT's stream did not wait
    # for torch's, ORT would read the NaNs that were there before.
    torch.manual_seed(0)
    eager = Mlp().cuda()
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager), providers=EXACT)
    x = torch.randn(64, 16, device="cuda")
    with torch.no_grad():
        wrapped(x)  # the capture (an inference graph)
        cycles = _sleep_cycles(100)
        late = torch.full_like(x, float("nan"))
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        late.copy_(x)  # on torch's stream, after the spin
        out = wrapped(late)
        total = out.sum()  # on torch's stream: must come after ORT's work on the output
        expected = eager(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total, expected.sum(), rtol=1e-5, atol=1e-5)


# --- (h) no synchronization inside a run ------------------------------------------------------


@cuda
@pytest.mark.parametrize("stream", ["ort", "user"])
def test_run_without_synchronize_returns_while_the_function_kernels_run(stream):
    # stream "ort": ORT's own compute stream; "user": a torch stream given as the provider's
    # user_compute_stream (as OrtModule runs its graphs), which the Function must then run on.
    k = 3
    nodes, prev = [], "x"
    for i in range(k):
        out = "y" if i == k - 1 else f"y{i}"
        nodes.append(python_op(Sleeper, [T(prev)], [(TP.FLOAT, 1)], out_names=[out], ctx_name=f"ctx{i}", name=f"fw{i}"))
        prev = out
    user_stream = torch.cuda.Stream() if stream == "user" else None
    options = {"user_compute_stream": str(user_stream.cuda_stream)} if user_stream is not None else {}
    sess = cuda_session(model(nodes, [value("x", shape=[None])], [value("y")]), **options)
    x = torch.zeros(1 << 16, device="cuda")
    y = torch.full_like(x, float("nan"))
    io = sess.io_binding()
    _bind(io, "x", x)
    _bind(io, "y", y, output=True)
    no_sync = ort.RunOptions()
    no_sync.add_run_config_entry("disable_synchronize_execution_providers", "1")
    torch.cuda.synchronize()
    try:
        Sleeper.cycles = 0
        for _ in range(3):  # warm-up: ORT's arena and stream, torch's allocator on that stream
            sess.run_with_iobinding(io)
        sess.run_with_iobinding(io, no_sync)
        torch.cuda.synchronize()
        Sleeper.cycles = _sleep_cycles(150 / k)  # ~150 ms of GPU work in all

        # ORT's default: run returns once its stream is done.
        Sleeper.events.clear()
        sess.run_with_iobinding(io)
        assert Sleeper.events[-1][1].query(), "run (synchronizing, ORT's default) returned before its stream was done"

        # disable_synchronize_execution_providers=1: run returns as soon as the work is queued; the
        # kernel itself synchronized nothing.
        Sleeper.events.clear()
        y.fill_(float("nan"))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sess.run_with_iobinding(io, no_sync)
        host_ms = (time.perf_counter() - t0) * 1e3
        pending = not Sleeper.events[-1][1].query()
        torch.cuda.synchronize()
        gpu_ms = Sleeper.events[0][0].elapsed_time(Sleeper.events[-1][1])
        assert len(Sleeper.events) == k
        streams = {e[2] for e in Sleeper.events}
        assert len(streams) == 1 and 0 not in streams, streams
        if user_stream is not None:
            assert streams == {user_stream.cuda_stream}, "the Function did not run on the user_compute_stream"
        assert pending, (
            f"run returned after the Functions' kernels had finished (host {host_ms:.1f} ms, "
            f"GPU {gpu_ms:.1f} ms): something synchronized inside the run"
        )
        assert host_ms < gpu_ms / 2, f"run took {host_ms:.1f} ms of the GPU's {gpu_ms:.1f} ms"
        torch.testing.assert_close(y, x + k)
    finally:
        Sleeper.cycles = 0
        Sleeper.events.clear()
        torch.cuda.synchronize()
