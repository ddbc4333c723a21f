"""Writes docs/fallback.md: for each layer of the per-layer test table
(tests/python/test_layers.py), the operators its OrtModule graphs run through the fallback
(PythonOp nodes named `namespace::op.overload`), found by capturing forward and backward.

    python3 scripts/fallback_table.py            # rewrites docs/fallback.md
"""

from __future__ import annotations

import copy
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

import test_layers  # noqa: E402

import ortbridge  # noqa: E402


def fallback_ops(wrapped, kind: int) -> list[str]:
    sessions = [c.sessions[kind] for cs in wrapped._captures.values() for c in cs if len(c.sessions) > kind]
    return sorted(
        {
            a.s.decode()
            for s in sessions
            if s.model is not None
            for n in s.model.graph.node
            if n.domain == "ortbridge"
            for a in n.attribute
            if a.name == "func_name" and b"::" in a.s
        }
    )


def main() -> int:
    rows = []
    for param in test_layers.TABLE + test_layers.CANNOT_CAPTURE:
        make_module, make_inputs, _ = param.values
        torch.manual_seed(0)
        wrapped = ortbridge.OrtModule(copy.deepcopy(make_module()))
        try:
            test_layers._loss(wrapped(*make_inputs())).backward()
            forward, backward = fallback_ops(wrapped, 0), fallback_ops(wrapped, 1)
            rows.append(f"| {param.id} | {', '.join(forward) or '-'} | {', '.join(backward) or '-'} |")
        except Exception as e:  # the layer does not train: say why
            reason = f"{type(e).__name__}: {str(e).splitlines()[0]}".replace(ROOT + os.sep, "")[:200]
            reason = reason.replace("|", "/")
            rows.append(f"| {param.id} | does not train: {reason} | |")
        print(rows[-1], flush=True)
    ops = sorted({op for row in rows for op in row.replace(",", " ").split() if "::" in op})
    with open(os.path.join(ROOT, "docs", "fallback.md"), "w") as f:
        f.write(
            "# Operators run by PyTorch inside ONNX Runtime graphs (the fallback)\n\n"
            "Written by `python3 scripts/fallback_table.py` (torch " + torch.__version__ + "): each layer of the\n"
            "per-layer test table (`tests/python/test_layers.py`) captured by `ortbridge.OrtModule`,\n"
            "forward and backward, and the operators its graphs run as fallback nodes. Every other\n"
            "operator is written by torch's ONNX exporter (directly or decomposed) and run by ONNX Runtime.\n\n"
            f"Operators seen: {', '.join(f'`{op}`' for op in ops)}.\n\n"
            "| layer | forward graph | backward graph |\n|---|---|---|\n" + "\n".join(rows) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
