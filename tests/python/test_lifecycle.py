"""Process-level behaviour: a clean interpreter exit with live sessions and contexts, and many
calls without growth (ORTModule's eval path leaked a context per call and crashed at exit)."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np, torch, ortbridge
    from onnx import TensorProto as TP
    from conftest import T, model, python_op, session, value

    @ortbridge.register
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2
        @staticmethod
        def backward(ctx, g):
            return g * 2

    def make(training):
        node = python_op(Double, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], training=training)
        return session(model([node], [value("x", shape=[4])], [value("ctx", TP.INT64), value("y")]))

    x = np.ones(4, np.float32)
    infer = make(False)
    for _ in range({calls}):
        infer.run(None, {{"x": x}})
    assert ortbridge.context_pool_size() == 0
    train = make(True)
    for _ in range(3):
        train.run(None, {{"x": x}})  # forward only: three contexts stay live until exit
    assert ortbridge.context_pool_size() == 3
    print("done", flush=True)
""")


def test_exit_with_live_sessions_and_contexts_is_clean(tmp_path):
    import os

    script = tmp_path / "exit.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(__file__), calls=20000))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
    assert "Fatal" not in proc.stderr and "Segmentation" not in proc.stderr


def test_training_steps_keep_memory_flat():
    import gc

    import numpy as np
    import psutil
    import torch
    from conftest import T, model, python_op, python_op_grad, session, value
    from onnx import TensorProto as TP

    import ortbridge

    @ortbridge.register(name="test_lifecycle.SavesEverything")
    class SavesEverything(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            ctx.also = x  # a borrowed input kept as an attribute: copied, then freed with ctx
            y = x * w
            return y, y.sum()

        @staticmethod
        def backward(ctx, gy, gs):
            x, w = ctx.saved_tensors
            return gy * w + gs, gy * x + gs

    fw = python_op(
        SavesEverything,
        [T("x", requires_grad=True), T("w", requires_grad=True)],
        [(TP.FLOAT, 1), (TP.FLOAT, 0)],
        out_names=["y", "s"],
        training=True,
    )
    bw = python_op_grad(
        SavesEverything, "dd", [("gy", TP.FLOAT, 1), (None, TP.FLOAT, 0)], [("gx", TP.FLOAT, 1), ("gw", TP.FLOAT, 1)]
    )
    sess = session(
        model([fw, bw], [value(n, shape=[None]) for n in ("x", "w", "gy")], [value("y"), value("gx"), value("gw")])
    )
    x = np.ones(1 << 16, np.float32)  # 256 KiB: a leak of one tensor per step would be 500 MB
    feed = {"x": x, "w": x, "gy": x}
    process = psutil.Process()
    for step in range(2200):
        sess.run(None, feed)
        if step == 200:
            gc.collect()
            rss, objects = process.memory_info().rss, len(gc.get_objects())
    gc.collect()
    assert ortbridge.context_pool_size() == 0
    assert len(gc.get_objects()) - objects < 100
    assert process.memory_info().rss - rss < 64 << 20


@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb to tell which library aborted")
def test_exit_with_a_daemon_thread_inside_a_function_is_not_aborted_by_ortbridge():
    # CPython ends the daemon thread with a forced unwind; ortbridge's frames pass it on. (ONNX
    # Runtime's run() then refuses it and aborts on its own: scripts/daemon_exit.py --case plain.)
    script = Path(__file__).parents[2] / "scripts" / "daemon_exit.py"
    out = subprocess.run([sys.executable, str(script), "--exits", "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "aborted in ortbridge" not in out.stdout, out.stdout + out.stderr
