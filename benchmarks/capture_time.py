"""Where the one-time cost goes: exporting a model with many Function calls with ortbridge.export,
and OrtModule's capture of train_step.py's CNN at its first training step.

What is measured
----------------
1. Export: a stack of --calls layers (default 50; 10 with --quick), each a Linear(16, 16) without
   bias, then a registered custom Function (bias + GeLU, hand-written backward), on a 5 x 16
   input, exported with ortbridge.export (dynamo path) for inference and with training=True
   (nodes that keep their autograd context, each context id a graph output), then an
   ortbridge.InferenceSession made from the model. Total = export + session creation.
2. Capture: ortbridge.OrtModule of train_step.py's CNN (train mode, HardSwishMe as PythonOp /
   PythonOpGrad, BatchNorm with batch statistics), one AdamW training step. Total = the first
   step (which captures the forward and backward graphs) minus a steady step (median of the
   next --steady steps).
Each repeat starts afresh: a new model (the same seed), a new OrtModule, torch._dynamo.reset().
Before the repeats one run of each case, not in the medians, pays what a process pays once
(imports, torch's ONNX translation table); its total is printed as "first in process". With
--quick there is no such run: the one repeat is the process's first (cold).

Phases are timed by wrapping library functions from here (restored afterwards; no library code
changes), each phase's time exclusive of the phases nested in it:
  record               core/record.py Recorder.run: one eager run recording each Function call
  AOTAutograd          capture.py's aot_module_simplified (which makes the backward graph too, at
                       the capture), less the compilers it calls (the rest of the rows below):
                       fake-tensor trace of the joint graph, functionalization, decompositions,
                       partition
  torch.export         torch.export.export of the model (export) or of each AOTAutograd graph
  fallback             core/fallback.py exportable: run_decompositions as torch's ONNX exporter
                       would decompose, the check for operators without a translation and, where
                       there are some, the program traced again with each one a fallback node
  ONNX translation     core/fallback.py to_onnx: torch's ONNX translation of that program and its
                       optimizer (with one copy of torch's translation table, no decomposition)
  post-processing      ortbridge's edits of the ONNX graph: node names, dim names, context-id
                       outputs (export); gradient outputs, node names (capture)
  FX rewrite           training/onnx_graph.py OnnxGraph: AOTAutograd's graph rewritten for the export
  session glue         the rest of GraphSession.__init__: serialization, input/output bindings
  session creation     ortbridge.InferenceSession (onnxruntime's graph load, optimization,
                       kernel creation; the custom-op library registration)
  other                the total less the phases above (ortbridge's glue between them; for the
                       capture also what the first step runs more than a steady step does)
Capture rows are per graph ("fw" forward, "bw" backward). The table gives each phase's median
over --repeats repeats in seconds and its share of the median total; "other" is the median
total less the phases' medians, so the rows add up to the total (shares to 100%). On a busy
machine it can come out negative: medians of phases from different repeats need not add up to
the median total, and the steady step subtracted from a capture varies. Results are checked:
the exported models' ORT outputs must match eager's (torch.allclose) and OrtModule's first-step
loss must equal eager's; otherwise the script exits with status 1.

From benchmarks/: python3 capture_time.py [--quick] [--repeats N] [--calls N] [--threads N].
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time

import onnxruntime as ort
import torch
from common import versions
from train_step import BiasGelu, cnn_case, trainer

import ortbridge
import ortbridge.exporter
import ortbridge.exporter.dims
from ortbridge._tracing import fallback, record


class Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, x):
        return BiasGelu.apply(self.linear(x), self.bias)


def stack(calls: int, width: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(*(Layer(width) for _ in range(calls)))


_MISSING = object()


class PhaseTimer:
    """Accumulates perf_counter time per phase name while its wrappers are installed. Time spent
    in a nested phase counts for that phase alone (subtracted from the enclosing one). A phase
    named with "{graph}" takes the label of the graph being compiled (set by a `label` wrapper)."""

    def __init__(self):
        self.times: dict = collections.defaultdict(float)
        self.graph = ""
        self._stack: list = []  # [phase key, time in nested phases]
        self._patches: list = []

    def wrap(self, owner, attr: str, phase: str, absorbed_by: tuple = (), label=None) -> None:
        """Time owner.attr as `phase`, unless called inside one of the phases `absorbed_by`
        (then it is that phase's time). `label(args, kwargs)`: the graph label while it runs."""
        original = getattr(owner, attr)
        self._patches.append((owner, attr, vars(owner).get(attr, _MISSING)))

        def timed(*args, **kwargs):
            if any(key in absorbed_by for key, _ in self._stack):
                return original(*args, **kwargs)
            graph = self.graph
            if label is not None:
                self.graph = label(args, kwargs)
            frame = [phase, 0.0]
            self._stack.append(frame)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self._stack.pop()
                self.times[phase.format(graph=self.graph)] += elapsed - frame[1]
                if self._stack:
                    self._stack[-1][1] += elapsed
                self.graph = graph

        setattr(owner, attr, timed)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for owner, attr, saved in reversed(self._patches):
            if saved is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, saved)
        self._patches.clear()


EXPORT_PHASES = ["record", "torch.export", "fallback", "ONNX translation", "post-processing", "session creation"]


def export_timer() -> PhaseTimer:
    timer = PhaseTimer()
    timer.wrap(record.Recorder, "run", "record")
    timer.wrap(torch.export, "export", "torch.export", absorbed_by=("fallback",))
    timer.wrap(fallback, "exportable", "fallback")
    timer.wrap(fallback, "to_onnx", "ONNX translation")
    for owner, attr in (
        (ortbridge.exporter, "name_nodes"),
        (ortbridge.exporter, "_expose_contexts"),
        (ortbridge.exporter.dims, "rename"),
    ):
        timer.wrap(owner, attr, "post-processing")
    timer.wrap(ortbridge.runtime.InferenceSession, "__init__", "session creation")
    return timer


def export_once(calls: int, training: bool) -> tuple[float, dict, str | None]:
    """(total seconds, seconds per phase, what is wrong or None) of one export + session."""
    torch.manual_seed(0)
    model = stack(calls).train(training)
    x = torch.randn(5, 16)
    with torch.no_grad():
        expected = model(x)
    torch._dynamo.reset()
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    with export_timer() as timer:
        started = time.perf_counter()
        proto = ortbridge.export(model, (x,), training=training, all_functions=True)
        session = ortbridge.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        total = time.perf_counter() - started
    y, *contexts = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    for context in contexts:
        ortbridge.release_context(int(context))
    nodes = sum(n.op_type == "PythonOp" for n in proto.graph.node)
    if nodes != calls:
        return total, timer.times, f"{nodes} PythonOp nodes in the exported model, {calls} Function calls"
    if len(contexts) != (calls if training else 0):
        return total, timer.times, f"{len(contexts)} context-id outputs"
    if not torch.allclose(torch.from_numpy(y), expected, rtol=1e-4, atol=1e-6):
        return (
            total,
            timer.times,
            (
                f"ONNX Runtime's output differs from eager's "
                f"(max |diff| {(torch.from_numpy(y) - expected).abs().max().item():.3g})"
            ),
        )
    return total, timer.times, None


def capture_timer() -> PhaseTimer:
    from ortbridge.training import capture, onnx_graph, session

    timer = PhaseTimer()
    timer.wrap(record.Recorder, "run", "record")
    timer.wrap(capture, "aot_module_simplified", "AOTAutograd")  # (the backward graph is made inside it)
    timer.wrap(
        session.GraphSession,
        "__init__",
        "{graph} session glue",
        label=lambda args, kwargs: "fw" if (args[2] if len(args) > 2 else kwargs["training"]) else "bw",
    )
    timer.wrap(onnx_graph.OnnxGraph, "__init__", "{graph} FX rewrite")
    timer.wrap(torch.export, "export", "{graph} torch.export", absorbed_by=("{graph} fallback",))
    timer.wrap(fallback, "exportable", "{graph} fallback")
    timer.wrap(fallback, "to_onnx", "{graph} ONNX translation")
    timer.wrap(onnx_graph, "_spread_gradient_outputs", "{graph} post-processing")
    timer.wrap(onnx_graph, "name_nodes", "{graph} post-processing")
    timer.wrap(ortbridge.runtime.InferenceSession, "__init__", "{graph} session creation")
    return timer


CAPTURE_PHASES = ["record", "AOTAutograd"] + [
    f"{g} {p}"
    for g in ("fw", "bw")
    for p in (
        "FX rewrite",
        "torch.export",
        "fallback",
        "ONNX translation",
        "post-processing",
        "session glue",
        "session creation",
    )
]


def capture_once(shape: tuple, steady: int, eager_loss: torch.Tensor) -> tuple[float, dict, str | None]:
    """(first step less a steady step, seconds per phase, what is wrong or None) of one capture."""
    torch.manual_seed(0)
    model, x, y, loss_fn, _ = cnn_case(*shape)
    torch._dynamo.reset()
    step = trainer(ortbridge.OrtModule(model), x, y, loss_fn)
    with capture_timer() as timer:
        started = time.perf_counter()
        loss = step()
        first = time.perf_counter() - started
    times = []
    for _ in range(steady):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    total = first - statistics.median(times)
    if not torch.allclose(loss, eager_loss, rtol=1e-4, atol=1e-6):
        return total, timer.times, f"OrtModule's first-step loss {loss.item()} differs from eager's {eager_loss.item()}"
    return total, timer.times, None


def report(title: str, phases: list, runs: list, cold: float | None) -> None:
    totals = [total for total, _ in runs]
    total = statistics.median(totals)
    rows = [(p, statistics.median(times.get(p, 0.0) for _, times in runs)) for p in phases]
    unknown = sorted({p for _, times in runs for p in times} - set(phases))
    assert not unknown, f"phases without a row: {unknown}"
    rows.append(("other", total - sum(s for _, s in rows)))
    first = "the first in the process, cold" if cold is None else f"first in process {cold:.3f} s"
    print(f"\n{title}: median of {len(runs)} ({first})")
    print(f"  {'phase':<28} {'s':>8} {'share':>7}")
    for name, seconds in rows:
        print(f"  {name:<28} {seconds:8.3f} {seconds / total:7.1%}")
    print(f"  {'total':<28} {total:8.3f} {1:7.1%}")
    name, seconds = max(rows, key=lambda r: r[1])
    print(f"  largest phase: {name} ({seconds / total:.1%})")


def repeated(once, warmups: int, repeats: int, what: str):
    """(the timed runs' (total, phase times), the last warm-up's total) of `once`, or None (said
    why) when a run's result was wrong."""
    runs, cold = [], None
    for k in range(warmups + repeats):
        total, times, wrong = once()
        if wrong:
            print(f"{what}: {wrong}")
            return None
        if k < warmups:
            cold = total
        else:
            runs.append((total, times))
    return runs, cold


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, help="Function calls of the exported model (default 50; 10 with --quick)")
    parser.add_argument(
        "--steady", type=int, default=5, help="steady steps after the capture (their median is subtracted)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one repeat, 10 Function calls, the small CNN, no warm-up run (a smoke test)",
    )
    parser.add_argument("--threads", type=int, help="torch's (and so ONNX Runtime's) thread count")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 1 if args.quick else args.repeats
    calls = args.calls or (10 if args.quick else 50)
    shape = (8, 32) if args.quick else (16, 64)
    print(versions())
    print(f"torch threads {torch.get_num_threads()}; median of {repeats} repeats")

    warmups = 0 if args.quick else 1  # the process's first run of a case, not in the median
    for training in (False, True):
        timed = repeated(
            lambda: export_once(calls, training),
            warmups,
            repeats,
            f"export of {calls} Function calls (training={training})",
        )
        if timed is None:
            return 1
        report(
            f"ortbridge.export of {calls} Function calls, {'training' if training else 'inference'}, "
            "+ InferenceSession",
            EXPORT_PHASES,
            *timed,
        )

    torch.manual_seed(0)
    model, x, y, loss_fn, size = cnn_case(*shape)
    eager_loss = trainer(copy.deepcopy(model), x, y, loss_fn)()
    timed = repeated(lambda: capture_once(shape, args.steady, eager_loss), warmups, repeats, f"CNN {size}")
    if timed is None:
        return 1
    report(f"OrtModule capture of the CNN, {size}, first step less a steady step", CAPTURE_PHASES, *timed)
    if ortbridge.context_pool_size() != 0:
        print(f"{ortbridge.context_pool_size()} autograd contexts left alive")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
