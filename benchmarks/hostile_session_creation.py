"""Session creation of hostile model files of up to 1 MB: seconds and resident memory over the
baseline, each in a fresh process (the goal: at most 1 s and 100 MB, refused or not).

    python benchmarks/hostile_session_creation.py
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import onnx, psutil, torch
from onnx import TensorProto as TP, helper
import ortbridge

@ortbridge.register(name="bench.Id")
class Id(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *constants):
        return x.clone()

def node(inputs, outputs, name, **attrs):
    base = dict(func_name="bench.Id", input_convention="d", input_tensor_types=[1], output_tensor_types=[1],
                output_tensor_ranks=[1])
    base.update(attrs)
    return helper.make_node("PythonOp", inputs, outputs, domain="ortbridge", name=name, **base)

def graph(nodes, last):
    g = helper.make_graph(nodes, "h", [helper.make_tensor_value_info("x0", TP.FLOAT, [3])],
                          [helper.make_tensor_value_info(last, TP.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortbridge", 1)],
                             ir_version=8).SerializeToString()

case = sys.argv[1]
if case == "many_nodes":  # a chain of PythonOps as long as 1 MB allows
    n = 5800
    m = graph([node([f"x{i}"], [f"c{i}", f"x{i+1}"], f"n{i}") for i in range(n)], f"x{n}")
elif case == "long_tuple":  # one int tuple of 120k values
    m = graph([node(["x0"], ["c", "x1"], "n", input_convention="dc", input_int_tuples=list(range(120_000)),
                    input_int_tuple_positions=[1], input_int_tuple_begins=[0])], "x1")
elif case == "many_literals":  # a JSON list of 1 MB
    text = json.dumps([list(range(20))] * 12_000)
    m = graph([node(["x0"], ["c", "x1"], "n", input_convention="dc", input_literals=json.dumps([json.loads(text)]),
                    input_literal_positions=[1])], "x1")
elif case == "deep_literal":  # nesting 500k deep
    m = graph([node(["x0"], ["c", "x1"], "n", input_convention="dc", input_literals="[" * 500_000 + "]" * 500_000,
                    input_literal_positions=[1])], "x1")
elif case == "huge_rank":
    m = graph([node(["x0"], ["c", "x1"], "n", output_tensor_ranks=[10_000_000])], "x1")
elif case == "many_ranks":  # 1 MB of outputs, each of the largest allowed rank
    n = 4000
    m = graph([node(["x0"], ["c"] + [f"y{i}" for i in range(n)], "n", output_tensor_types=[1] * n,
                    output_tensor_ranks=[64] * n)], "y0")
elif case == "nodes_of_max_dims":  # as many nodes as 1 MB holds, each with the most output dimensions allowed
    n = 4500
    m = graph([node(["x0"], [f"c{i}"] + [f"y{i}_{k}" for k in range(4)], f"n{i}", output_tensor_types=[1] * 4,
                    output_tensor_ranks=[64] * 4) for i in range(n)], "y0_0")
elif case == "plain_ort_dims":  # no ortbridge node: ORT's own cost of 1 MB of declared dimensions
    g = helper.make_graph([helper.make_node("Identity", ["x0"], ["x1"])], "h",
                          [helper.make_tensor_value_info("x0", TP.FLOAT, [3])],
                          [helper.make_tensor_value_info("x1", TP.FLOAT, None)],
                          value_info=[helper.make_tensor_value_info(f"v{i}", TP.FLOAT, [f"d{i}_{k}" for k in range(64)])
                                      for i in range(1500)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
elif case == "long_name":
    m = graph([node(["x0"], ["c", "x1"], "n", func_name="f" * 1_000_000)], "x1")
assert len(m) <= 1_100_000, len(m)
proc = psutil.Process()
rss = proc.memory_info().rss
start = time.perf_counter()
try:
    ortbridge.InferenceSession(m, providers=["CPUExecutionProvider"])
    outcome = "created"
except Exception as e:
    outcome = "refused: " + str(e).split("initialization: ")[-1].split("] : ")[-1].split("\n")[0][:100]
seconds = time.perf_counter() - start
print(json.dumps(dict(case=case, bytes=len(m), seconds=seconds,
                      mb=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss) / 2**20, outcome=outcome)))
"""

CASES = [
    "many_nodes",
    "long_tuple",
    "many_literals",
    "deep_literal",
    "huge_rank",
    "many_ranks",
    "nodes_of_max_dims",
    "long_name",
    "plain_ort_dims",
]


def main() -> int:
    print(f"{'case':18s} {'bytes':>9s} {'s':>6s} {'MB':>6s}  outcome")
    worst = 0.0
    for case in CASES:
        out = subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True, text=True, timeout=600)
        if out.returncode:
            print(f"{case:18s} child failed: {out.stderr[-300:]}")
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        worst = max(worst, r["seconds"])
        print(f"{case:18s} {r['bytes']:9d} {r['seconds']:6.2f} {r['mb']:6.1f}  {r['outcome']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
