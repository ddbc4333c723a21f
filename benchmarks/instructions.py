"""Instructions per Function call, counted by valgrind's callgrind: overhead.py's measures without
the noise of a shared machine.

What is measured
----------------
The configurations of overhead.py, each in a child process under `valgrind --tool=callgrind`
with instrumentation off until it has warmed up (so imports and captures are not counted): then
N calls are counted (Ir, instructions executed in user space). Per op = (Ir(K=64) - Ir(K=1)) / 63
/ N, for ORT and for eager, and their ratio; and Ir(K=1) / N, a whole call at K=1 (for train and
eval, a module step: its fixed cost plus one Function call):
  inference   the hand-built chain of K PythonOps (training_mode=0) against K Function.apply
              calls under no_grad;
  training    K PythonOps then K PythonOpGrads in one graph, against forward and backward of
              K Function.apply calls;
  train/eval  a module calling Clone.apply K times, OrtModule against eager (overhead.py
              --modes ortmodule).
  train-saves the train step with SavesInput in place of Clone, a Function that saves its input
              for backward as activations do (overhead.py --modes ortmodule --function saves).
Instructions are not time: ORT's path runs more code in more libraries than eager (fewer
instructions per cycle), so time ratios come out above these; but they move by at most ~5% between
runs (eager's count too), where this machine's timings move by 10-50%, so a change's effect
shows here first.

`--by-library` adds, per configuration, where those instructions run: each library's own
instructions (callees in other libraries not included), per op and at K=1, ORT against eager,
the libraries grouped as CPython (the interpreter and its extension modules), torch (C++), torch's
Python binding (libtorch_python), ONNX Runtime, ortbridge (_C), the C/C++ runtime (libc,
libstdc++, the dynamic loader) and the rest.

Needs valgrind (exits with status 2 and says so without it).
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile

KS = (1, 64)
CONFIGS = {  # name: (ORT variant, eager variant)
    "inference": ("ort", "eager"),
    "training": ("ort", "eager"),
    "train": ("OrtModule", "eager"),
    "eval": ("OrtModule", "eager"),
    "train-saves": ("OrtModule", "eager"),
}


def child(config: str, variant: str, k: int, calls: int) -> None:
    """Runs in the child process under callgrind: warm up, then count `calls` calls."""
    import overhead
    import torch

    if config in ("inference", "training"):
        ort_call, eager_call, check = overhead.make_calls(config, k)
        check()
        call = ort_call if variant == "ort" else eager_call
        grad = torch.no_grad() if (config == "inference" and variant == "eager") else torch.enable_grad()
    else:
        func = overhead.SavesInput if config == "train-saves" else overhead.Clone
        steps, check = overhead.make_module_steps(config != "eval", k, compiled=False, func=func)
        error = check()
        if error:
            sys.exit(error)
        call, grad = steps[variant], torch.enable_grad()
    control = ["callgrind_control", "--instr=on", str(os.getpid())]
    gc.collect()
    gc.disable()  # (a collection inside the counted calls adds millions of instructions to one row)
    with grad:
        for _ in range(20):
            call()
        subprocess.run(control, check=True, stdout=subprocess.DEVNULL)
        for _ in range(3):
            call()
        subprocess.run(["callgrind_control", "--zero", str(os.getpid())], check=True, stdout=subprocess.DEVNULL)
        for _ in range(calls):
            call()
        subprocess.run(["callgrind_control", "--dump", str(os.getpid())], check=True, stdout=subprocess.DEVNULL)


# Library groups, by the file name of the object the instructions ran in (first match).
GROUPS = (
    ("CPython", re.compile(r"libpython|/python3[.\d]*$|lib-dynload/")),
    ("torch (C++)", re.compile(r"libtorch_cpu|libc10|libtorch\.so|libgomp|libiomp")),
    ("torch's Python binding", re.compile(r"libtorch_python")),
    ("ONNX Runtime", re.compile(r"onnxruntime")),
    ("ortbridge", re.compile(r"ortbridge/_C")),
    ("C/C++ runtime", re.compile(r"/libc\.so|libstdc\+\+|ld-linux|libm\.so|libgcc_s")),
)
OTHER = "other"


def _group(path: str) -> str:
    return next((name for name, pattern in GROUPS if pattern.search(path)), OTHER)


def _read_dump(dump) -> tuple[dict, collections.Counter]:
    """A callgrind dump's `summary:` and `totals:` counts, and its instructions by library group:
    each function's own cost lines, under the object its `ob=` names (a call's cost line, after
    `calls=`, is the callee's, left out)."""
    header, names, costs, group, after_call = {}, {}, collections.Counter(), OTHER, False

    def named(ref: str) -> str:  # ("(id) path" defines an id, "(id)" refers to it)
        match = re.match(r"\((\d+)\)(?: (.*))?", ref)
        if not match:
            return ref
        if match.group(2):
            names[match.group(1)] = match.group(2)
        return names[match.group(1)]

    for line in dump:
        if line.startswith("ob="):
            group = _group(named(line[3:].strip()))
        elif line.startswith("cob="):
            named(line[4:].strip())
        elif line.startswith("calls="):
            after_call = True
        elif line.startswith(("summary:", "totals:")):
            header[line.split(":")[0]] = int(line.split()[1])
        elif line[:1].isdigit() or line[:1] in "+-*":
            parts = line.split()
            if not after_call and len(parts) > 1:
                costs[group] += int(parts[1])
            after_call = False
    return header, costs


def count(config: str, variant: str, k: int, calls: int) -> tuple[int, collections.Counter]:
    """Instructions of `calls` calls of one configuration: callgrind's summary, and by library
    group (these sum to the dump's totals, which exceed the summary by a few tenths of a %)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--child",
                config,
                variant,
                str(k),
                str(calls),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        dumps = [f for f in os.listdir(tmp) if f.startswith("callgrind.out.")]  # (the --dump's, not the exit's)
        with open(os.path.join(tmp, dumps[0])) as f:
            header, by_group = _read_dump(f)
        if "totals" in header and sum(by_group.values()) != header["totals"]:
            raise RuntimeError(f"callgrind dump: libraries sum to {sum(by_group.values())}, totals {header['totals']}")
        return header.get("summary", header.get("totals")), by_group


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20, help="counted calls per configuration")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from " + ", ".join(CONFIGS))
    p.add_argument("--quick", action="store_true", help="inference only, 2 calls (a smoke run)")
    p.add_argument("--by-library", action="store_true", help="where the instructions run, per configuration")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        config, variant, k, calls = args.child
        child(config, variant, int(k), int(calls))
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions.py needs valgrind (callgrind and callgrind_control): not found", file=sys.stderr)
        return 2
    configs = ["inference"] if args.quick else [c.strip() for c in args.configs.split(",") if c.strip()]
    calls = 2 if args.quick else args.calls
    print(
        f"instructions (Ir) per call, callgrind, {calls} counted calls per configuration; "
        "per op = (Ir(K=64) - Ir(K=1)) / 63"
    )
    print(
        f"{'config':11s} {'ORT Ir/op':>10s} {'eager Ir/op':>12s} {'ratio':>6s} "
        f"{'ORT Ir/call K=1':>16s} {'eager Ir/call K=1':>18s}"
    )
    breakdowns = []
    for config in configs:
        per_op, at_one, op_groups, one_groups = [], [], [], []  # per variant
        for variant in CONFIGS[config]:
            ir, groups = zip(*(count(config, variant, k, calls) for k in KS))
            per_op.append((ir[1] - ir[0]) / (KS[1] - KS[0]) / calls)
            at_one.append(ir[0] / calls)  # (a whole step at K=1: for train/eval, the step's fixed cost and one call)
            op_groups.append(
                {g: (groups[1][g] - groups[0][g]) / (KS[1] - KS[0]) / calls for g in groups[1] | groups[0]}
            )
            one_groups.append({g: n / calls for g, n in groups[0].items()})
        print(
            f"{config:11s} {per_op[0]:10.0f} {per_op[1]:12.0f} {per_op[0] / per_op[1]:6.2f} "
            f"{at_one[0]:16.0f} {at_one[1]:18.0f}"
        )
        breakdowns.append((config, op_groups, one_groups))
    if args.by_library:
        print("\nby library (instructions a library ran itself; per op, and a whole call at K=1)")
        print(
            f"{'config':11s} {'library':24s} {'ORT Ir/op':>10s} {'eager Ir/op':>12s} "
            f"{'ORT Ir/call K=1':>16s} {'eager Ir/call K=1':>18s} {'K=1 over eager':>15s}"
        )
        for config, per_op, at_one in breakdowns:
            for group in [name for name, _ in GROUPS] + [OTHER]:
                op, one = [g.get(group, 0) for g in per_op], [g.get(group, 0) for g in at_one]
                print(
                    f"{config:11s} {group:24s} {op[0]:10.0f} {op[1]:12.0f} {one[0]:16.0f} {one[1]:18.0f} "
                    f"{one[0] - one[1]:15.0f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
