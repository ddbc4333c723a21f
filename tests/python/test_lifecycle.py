"""Process-level behaviour: a clean interpreter exit with live sessions and contexts, and many
calls without growth (ORTModule's eval path leaked a context per call and crashed at exit)."""

import subprocess
import sys
import textwrap

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
