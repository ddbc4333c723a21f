"""Where the time of a training step goes under OrtModule, against eager PyTorch.

The model, batch and step are one of train_step.py's: by default its CNN (mobilenet-like,
HardSwishMe activation as a PythonOp / PythonOpGrad pair, BatchNorm in training mode,
cross-entropy, AdamW) at that benchmark's larger size, 16 x 3 x 64 x 64; `--model block` its
transformer block (BiasGelu as the pair, mean-squared loss), by default at 16 x 64 x 128; `--model
vit` train_step.py's --timm vit_tiny (SwishMe as the pair; batch 8 of 32 x 32 images); `--size`
gives the model's sizes (CNN: batch,side; Block: batch,seq,width; vit: batch). Three copies:
eager, OrtModule, and OrtModule with ONNX Runtime's profiler on (SessionOptions.enable_profiling;
session options of its own, so no thread trial: its threads sleep, or with --spinning spin while
a run lasts, torch on one thread inside it, as the trial's spinning session). Printed, per step:

1. Phase wall times (forward + loss, backward, optimizer step + zero_grad), median over
   --steps steps after --warmup, the three copies taking their steps in turn; the difference
   between the two OrtModule rows is the cost of ORT's profiler.
2. ONNX Runtime's profile of the forward and backward sessions over those same steps (means):
   kernel time per op type, PythonOp / PythonOpGrad nodes split by func_name (read from the
   node's attribute in the session's graph: fallback nodes are all named PythonOp_default_<k>),
   with its share of the session's kernel time; the session run (model_run event) against the
   sum of its kernels (the executor's own cost), and the phase's mean wall time against the
   session run (outside the session: input/output binding, output allocation, the Step's
   autograd.Function, the autograd engine, the loss).
3. torch.profiler over --torch-steps steps of eager and of the ORT-profiled OrtModule: each
   PythonOp / PythonOpGrad kind's ORT kernel time in those steps, what torch spends inside it
   (the aten op of a fallback node, Function.apply's record for a Function's forward; children
   included) and what eager torch spends in the same op or Function (its forward, and its
   autograd node, <Function>Backward). Node time minus the torch time inside is the bridge.
4. Both torch.profiler tables, top --top rows by self CPU time (totals over --torch-steps).

ORT writes its profile files into a temporary directory, removed at the end. From benchmarks/:
python3 profile_train_step.py [--model cnn|block|vit] [--size 16,64] [--threads N] [--spinning].
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import onnxruntime as ort
import torch
from common import versions
from train_step import block_case, cnn_case, timm_cases

import ortbridge
from ortbridge.training.threads import default_session_options

PHASES = ("forward", "backward", "optimizer", "step")


def profiling_options(prefix: str, spinning: bool) -> ort.SessionOptions:
    """OrtModule's default options (torch's thread count, threads that sleep between runs or
    with `spinning` spin while one lasts), with the profiler on."""
    options = default_session_options(spinning=spinning)
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    return options


def phased_trainer(model, x, y, loss_fn):
    """train_step.py's step, returning the wall time (s) of each phase and the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> dict:
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0, "loss": loss.item()}

    return step


def run_steps(steps: dict, warmup: int, count: int) -> dict:
    """Each named step's phase times (ms): {name: {phase: (median, mean)}}. The steps take turns,
    so that drift on the machine touches them all alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict = {name: [] for name in steps}
    for _ in range(count):
        for name, step in steps.items():
            times[name].append(step())
    return {
        name: {k: (statistics.median(t[k] for t in ts) * 1e3, statistics.mean(t[k] for t in ts) * 1e3) for k in PHASES}
        for name, ts in times.items()
    }


def node_labels(graph_session) -> dict:
    """Node name -> label: the op type, with func_name for PythonOp / PythonOpGrad."""
    labels = {}
    for node in graph_session.model.graph.node:
        func = next((a.s.decode() for a in node.attribute if a.name == "func_name"), None)
        labels[node.name] = f"{node.op_type} {func}" if func else node.op_type
    return labels


def read_events(graph_session) -> list:
    with open(graph_session.session.end_profiling()) as f:  # (read before the next session's: same name)
        return json.load(f)


def summarize(events: list, labels: dict, runs: slice) -> dict:
    """Per-run means (ms) over the model_run events `runs` (in time order): kernel time by label,
    calls per run by label, all kernels, the whole run."""
    model_runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"), key=lambda e: e["ts"]
    )[runs]
    spans = [(r["ts"], r["ts"] + r["dur"]) for r in model_runs]
    n = len(spans)
    by_label: dict = collections.defaultdict(float)
    calls: dict = collections.defaultdict(int)
    for e in events:
        if (
            e.get("cat") == "Node"
            and e["name"].endswith("_kernel_time")
            and any(start <= e["ts"] <= end for start, end in spans)
        ):
            node = e["name"][: -len("_kernel_time")]
            label = labels.get(node, e.get("args", {}).get("op_name", node))
            by_label[label] += e["dur"] / 1e3 / n
            calls[label] += 1
    return {
        "by_label": dict(by_label),
        "calls": {k: v // n for k, v in calls.items()},
        "kernels": sum(by_label.values()),
        "run": sum(r["dur"] for r in model_runs) / 1e3 / n,
    }


def torch_profile(step, steps: int):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof.key_averages()


# Fallback nodes that run their operator through another (_kernel/lookup.py's _INTO_OUTPUTS, writing into
# ONNX Runtime's buffers), and what eager runs for it: (record inside the node, record in eager).
SAME_KERNEL = {
    "aten::_native_batch_norm_legit_functional.default": ("aten::_native_batch_norm_legit", "aten::native_batch_norm")
}


def total_ms(averages, key: str) -> float | None:
    """An event's CPU time (ms, children included) summed over the profile."""
    return next((a.cpu_time_total / 1e3 for a in averages if a.key == key), None)


def fmt(ms: float | None, width: int) -> str:
    return f"{'-':>{width}}" if ms is None else f"{ms:{width}.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("cnn", "block", "vit"), default="cnn")
    parser.add_argument(
        "--size", help="the model's sizes: CNN batch,side (16,64); Block batch,seq,width (16,64,128); vit batch (8)"
    )
    parser.add_argument("--threads", type=int, help="torch's (and so ONNX Runtime's) thread count")
    parser.add_argument(
        "--spinning",
        action="store_true",
        help="the profiled copy's threads spin during its runs, torch on one thread inside them",
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--torch-steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(versions())
    if args.model == "vit":  # (timm is imported only for it)
        case, default = next(make for name, make, _ in timm_cases() if name == "vit_tiny"), "8"
    else:
        case, default = (cnn_case, "16,64") if args.model == "cnn" else (block_case, "16,64,128")
    torch.manual_seed(0)
    model, x, y, loss_fn, size = case(*map(int, (args.size or default).split(",")))
    print(
        f"torch threads {torch.get_num_threads()}; {args.model} {size}; "
        f"{args.steps} steps after {args.warmup} warm-up steps\n"
    )
    folder = tempfile.mkdtemp(prefix="ortbridge_profile_")
    try:
        profiled_module = ortbridge.OrtModule(
            copy.deepcopy(model), session_options=profiling_options(os.path.join(folder, args.model), args.spinning)
        )
        steps = {
            "eager": phased_trainer(copy.deepcopy(model), x, y, loss_fn),
            "OrtModule": phased_trainer(ortbridge.OrtModule(copy.deepcopy(model)), x, y, loss_fn),
            "OrtModule, ORT profiler": phased_trainer(profiled_module, x, y, loss_fn),
        }
        first = {name: step()["loss"] for name, step in steps.items()}  # captures the graphs
        sessions = [c for cs in profiled_module._captures.values() for c in cs][0].sessions
        for s in sessions:  # (as the trial's spinning session: torch on one thread inside its runs)
            s.spinning = args.spinning
        if any(abs(loss - first["eager"]) > 1e-4 * abs(first["eager"]) for loss in first.values()):
            print(f"losses differ at the first step: {first}")
            return 1

        phases = run_steps(steps, args.warmup, args.steps)
        eager_avg = torch_profile(steps["eager"], args.torch_steps)
        ort_avg = torch_profile(steps["OrtModule, ORT profiler"], args.torch_steps)
        profiles = {}  # kind -> (the phase steps' summary, the torch-profiled steps' summary)
        for kind, s in zip(("forward", "backward"), sessions):
            if s.session is not None:
                events, labels, t = read_events(s), node_labels(s), args.torch_steps
                profiles[kind] = (
                    summarize(events, labels, slice(-t - args.steps, -t)),
                    summarize(events, labels, slice(-t, None)),
                )

        print("1. Phase wall times, median ms per step")
        print(f"{'':>24} {'forward':>8} {'backward':>9} {'optimizer':>10} {'step':>8}")
        for name, p in phases.items():
            print(f"{name:>24} " + " ".join(f"{p[k][0]:{w}.2f}" for k, w in zip(PHASES, (8, 9, 10, 8))))

        print("\n2. ONNX Runtime's profile, mean ms per step")
        for kind, (prof, _) in profiles.items():
            wall = phases["OrtModule, ORT profiler"][kind][1]
            print(
                f"{kind}: session run {prof['run']:.2f}, its kernels {prof['kernels']:.2f}, executor outside "
                f"kernels {prof['run'] - prof['kernels']:.2f}; {kind} phase wall {wall:.2f}, outside the "
                f"session {wall - prof['run']:.2f}"
            )
            print(f"  {'op':<48} {'calls':>5} {'ms':>8} {'share':>6}")
            for label, ms in sorted(prof["by_label"].items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"  {label:<48} {prof['calls'][label]:5d} {ms:8.3f} {ms / prof['kernels']:6.1%}")

        t = args.torch_steps
        print(f"\n3. PythonOp / PythonOpGrad nodes against eager torch, ms per step over {t} steps")
        print(f"  {'node':<46} {'calls':>5} {'ORT node':>9} {'torch inside':>13} {'eager torch':>12}")
        for _, prof in profiles.values():
            for label, ms in sorted(prof["by_label"].items(), key=lambda kv: -kv[1]):
                op_type, _, func = label.partition(" ")
                if not func:
                    continue
                if func.startswith("aten::"):  # a fallback node: the aten op in both (or what runs it)
                    inside, eager = SAME_KERNEL.get(func, (func.rsplit(".", 1)[0],) * 2)
                else:  # a Function: Function.apply's record in both, its autograd node in eager's backward
                    name = func.rsplit(".", 1)[-1]
                    inside, eager = (name, name) if op_type == "PythonOp" else (None, f"{name}Backward")
                inside_ms = total_ms(ort_avg, inside) if inside else None
                eager_ms = total_ms(eager_avg, eager)
                print(
                    f"  {label:<46} {prof['calls'][label]:5d} {ms:9.3f} "
                    f"{fmt(inside_ms and inside_ms / t, 13)} {fmt(eager_ms and eager_ms / t, 12)}"
                )

        for name, averages in (("eager", eager_avg), ("OrtModule (ORT profiler on)", ort_avg)):
            print(f"\n4. torch.profiler, {name}, totals over {t} steps")
            print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=45))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
