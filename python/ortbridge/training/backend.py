"""torch.compile(model, backend="ortbridge"): dynamo captures the graphs, each runs as an
OrtModule would (forward and backward graphs in ONNX Runtime, captured per input signature).

Dynamo handles autograd.Functions itself before any backend sees the graph: one it can trace is
inlined (its operators run in ONNX Runtime), one it cannot (numpy, .item(), C++ extensions that
are not torch ops) splits the graph and runs in eager PyTorch between two ONNX Runtime graphs.
For a PythonOp/PythonOpGrad pair per Function, use ortbridge.OrtModule.
"""

from __future__ import annotations

import torch

from .module import OrtModule


def ortbridge(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None) -> OrtModule:
    """The dynamo backend (registered as "ortbridge" through the package's entry point).
    `torch.compile(model, backend="ortbridge", options={...})` takes OrtModule's keyword
    arguments: session_options, providers, save_graphs, all_functions, dynamic, backward_stages (another key is
    OrtModule's TypeError)."""
    return OrtModule(gm, **(options or {}))
