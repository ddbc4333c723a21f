"""Exits the interpreter while a daemon thread is inside a Function run by an ortbridge kernel,
N times, and says who aborted, if anything did.

At exit CPython ends a daemon thread that asks for the GIL with pthread_exit, a forced unwind
through every C++ frame on that thread's stack. A frame that catches it without rethrowing aborts
the process ("FATAL: exception not rethrown"). ortbridge's frames rethrow it; ONNX Runtime's own
run() catches it (so plain ORT aborts too when a daemon thread is inside run() at exit: the
`plain` case). Each exit runs under gdb, when present, to name the library that aborted.

    python scripts/daemon_exit.py [--exits 100] [--case ortbridge|plain]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile


def child(case: str) -> None:
    import threading
    import time

    import numpy as np
    import torch
    from onnx import TensorProto, helper

    import ortbridge

    started = threading.Event()

    @ortbridge.register(name="exit.Sleepy")
    class Sleepy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            started.set()
            while True:  # gives the GIL up every few ms: at exit, taking it back ends the thread
                time.sleep(0.001)

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    if case == "ortbridge":
        nodes = [
            helper.make_node(
                "PythonOp",
                ["x"],
                ["", "y"],
                domain="ortbridge",
                func_name="exit.Sleepy",
                input_convention="d",
                input_tensor_types=[1],
                output_tensor_types=[1],
                output_tensor_ranks=[2],
            )
        ]
    else:  # ONNX Runtime's own ops only: a long loop of matrix products
        body = helper.make_graph(
            [helper.make_node("MatMul", ["v", "v"], ["w"]), helper.make_node("Identity", ["c"], ["c_out"])],
            "body",
            [
                helper.make_tensor_value_info("i", TensorProto.INT64, []),
                helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                helper.make_tensor_value_info("v", TensorProto.FLOAT, None),
            ],
            [
                helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
                helper.make_tensor_value_info("w", TensorProto.FLOAT, None),
            ],
        )
        nodes = [
            helper.make_node("Constant", [], ["n"], value=helper.make_tensor("n", TensorProto.INT64, [], [10**9])),
            helper.make_node("Constant", [], ["t"], value=helper.make_tensor("t", TensorProto.BOOL, [], [1])),
            helper.make_node("Loop", ["n", "t", "x"], ["y"], body=body),
        ]
    graph = helper.make_graph(nodes, "exit", [x], [y])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortbridge", 1)], ir_version=8
    )
    sess = ortbridge.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"x": np.full((256, 256), 1e-3, np.float32)}
    threading.Thread(target=sess.run, args=(None, feed), daemon=True).start()
    if case == "ortbridge":
        started.wait()
    else:
        time.sleep(0.5)
    print("exiting", flush=True)


def classify(result: subprocess.CompletedProcess) -> str:
    """clean, or who aborted: the library of the frame that refused the unwind."""
    text = result.stdout + result.stderr
    if "exiting" not in text:
        return "did not reach exit: " + text[-500:]
    if "FATAL" not in text and "SIGABRT" not in text and result.returncode == 0:
        return "clean"
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "unwind_cleanup" in line or "std::terminate" in line or "__cxa_call_terminate" in line:
            for frame in lines[i + 1 : i + 4]:
                for lib in ("ortbridge", "_C.cpython", "onnxruntime", "libpython", "libstdc++"):
                    if lib in frame:
                        return "aborted in " + ("ortbridge" if lib in ("ortbridge", "_C.cpython") else lib)
            return "aborted in an unnamed frame"
    return "aborted (no backtrace)" if result.returncode else "clean"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exits", type=int, default=100)
    parser.add_argument("--case", choices=["ortbridge", "plain"], default="ortbridge")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.case)
        return 0
    command = [sys.executable, os.path.abspath(__file__), "--child", "--case", args.case]
    if shutil.which("gdb"):
        command = ["gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 12", "--args", *command]
    outcomes = collections.Counter()
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.exits):
            result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)
            outcomes[classify(result)] += 1
    print(
        f"{args.exits} exits with a daemon thread inside "
        f"{'a Function (ortbridge kernel)' if args.case == 'ortbridge' else 'run() of ORT-only ops'}:"
    )
    for outcome, count in outcomes.most_common():
        print(f"  {count:4d}  {outcome}")
    return 1 if outcomes["aborted in ortbridge"] else 0


if __name__ == "__main__":
    sys.exit(main())
