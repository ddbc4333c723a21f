"""Peak memory of a training step: OrtModule and torch.compile(backend="ortbridge") against eager
PyTorch, for the models of train_step.py (a transformer block and a mobilenet-like CNN, each
with a custom autograd.Function; see that file). Goal: the step's peak at most 1.2x eager's.

What is measured
----------------
One step = forward, loss, backward, AdamW step, zero_grad (train_step.py's trainer). Resident
memory (RSS) is a per-process quantity and the kernel's high-water mark (VmHWM) only grows, so
every (model, size, variant) runs in a fresh child process of this script. The child imports
torch, onnxruntime and ortbridge, builds the case with torch.manual_seed(0) (every child has
the same weights and batch), wraps the model, takes the first step (the wrapped variants capture
their graphs then: torch.export and ONNX export can use far more memory than a step, which is
not the step's), then --warmup steps (12 by default: past the runs in which each OrtModule
graph with several threads tries a sleeping and a spinning session, then drops one). Then the
steady state: gc.collect() and glibc's malloc_trim(0) (so that heap pages freed by the capture
and not returned to the kernel do not count as "already resident" and hide the step's own need;
--no-trim skips it), RSS read
("warm"), the high-water mark reset (writing 5 to /proc/self/clear_refs; where the kernel
refuses, a thread samples RSS every millisecond instead: the table says which), --steps steps,
the high-water mark read ("peak"). Variants:
  eager            plain PyTorch
  OrtModule        ortbridge.OrtModule with its default session options
  OrtModule-noarena  the same with ORT's CPU memory arena off (enable_cpu_mem_arena = False, the
                   other options ortbridge's defaults): the graphs' intermediate tensors are
                   malloc'ed and freed per run instead of kept in the arena's chunks
  compile          torch.compile(model, backend="ortbridge")
  compile-noarena  the same, arena off (options={"session_options": ...}); only when --variants
                   names it
ORT's arena is ordinary process memory, so it is inside each RSS figure; its own contribution is
the difference between a variant and its -noarena twin (what the arena holds beyond what malloc
would hand out at the same moment). Every wrapped variant must give eager's first-step loss
(torch.allclose, rtol 1e-4), or the script exits with status 1.

How to read it
--------------
The two lines after the versions' and settings': the fixed costs, from a child that only imports and does, one after the other:
RSS with torch + onnxruntime + ortbridge imported (what the per-variant figures below are
relative to), + a first torch.optim optimizer (creating one imports torch._dynamo and sympy:
every training process pays it), + import ortbridge.training (what OrtModule and the backend
import on top: AOTAutograd, torch.export, the ONNX exporter), + import train_step.py. The
children take the models from train_step.py, so whatever it imports at module level is in every
row, eager's included (when it imports ortbridge.training, eager's row pays that line too).
Per case, the reference sizes: "state" = parameters + gradients + AdamW's two moments (4x the
parameters), "batch" = input and target. Per variant, in MiB:
  warm    RSS after the warm-up steps, before the measured ones (imports included): what the
          process holds between steps (model, optimizer state, captured graphs, ORT sessions,
          and the modules and caches that the first steps loaded)
  peak    the high-water mark during --steps steps
  step    peak - warm: what a step needs on top of what is held between steps (activations
          saved for backward, gradients, ORT's working memory)
  grow    RSS after the last measured step - RSS after the first: a leak shows as a grow that
          scales with --steps; otherwise it is noise of glibc's heap (+-20 MiB at the large
          sizes, eager's too); glibc keeps the heap a step grew, so "step" stays resident
  xpeak   peak / eager's peak          (the goal: <= 1.2; "> 1.2x" flags a row above it)
  xstep   step / eager's step          (without what is held between steps; noisy when eager's
                                        step is a few MiB)
  +anon   warm's anonymous RSS (heap, tensors, ORT's arena, Python objects) - the imports'
  +file   warm's file-backed RSS - the imports': pages of the libraries' code and data that the
          steps (and the capture) touched; shared with other processes, evictable
  kept    RSS - the imports' once the model, optimizer and captures are deleted (gc, malloc_trim,
          torch._dynamo.reset for compile): the process-level part of warm (modules imported on
          the way, the exporter's and torch's caches, library code touched), which a second
          model in the same process would not pay again; warm - kept is roughly what the model
          itself holds between steps
  mods    modules imported after the imports (by train_step, the optimizer, the capture)
  saved   bytes of the distinct tensors saved for backward in one (warm-up) step, parameters'
          storage excluded: a saved_tensors_hooks pack hook, and for the Functions run as
          PythonOp (which install their own hook, copying what views ORT's buffers) a wrapper
          around that hook; eager's and a wrapped variant's differ where the captured graph
          saves other tensors (decomposed operators) or a tensor twice
  graphs  bytes of the captured ONNX models held in Python (ModelProto.ByteSize(), of every
          ortbridge GraphSession alive; ORT holds its own copy of their initializers)
torch keeps no CPU allocator statistics, so there is no torch-side column. Figures move by a few
MiB between runs (glibc's heap, page granularity): compare the large sizes, and step/xstep, for
the bridge's cost per step, warm and kept for its fixed cost. Each child takes 10-60 s (imports,
capture); --models, --size and --variants select rows.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import threading

MiB = 2**20
VARIANTS = ["eager", "OrtModule", "OrtModule-noarena", "compile", "compile-noarena"]
DEFAULT_VARIANTS = VARIANTS[:4]
CASES = {"Block": [(8, 16, 64), (16, 64, 128)], "CNN": [(8, 32), (16, 64)]}


def _status(field: str) -> int:
    """A field of /proc/self/status, in bytes (VmRSS: resident now; VmHWM: its high-water mark)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def rss() -> int:
    return _status("VmRSS")


def split() -> tuple[int, int]:
    """Resident (anonymous, file-backed) bytes: heap, tensors, ORT's arena; mapped library code and data."""
    return _status("RssAnon"), _status("RssFile") + _status("RssShmem")


def reset_peak() -> bool:
    """Resets the kernel's high-water mark of RSS to the current RSS; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status("VmHWM") <= rss() + 64 * 1024


class Sampler:
    """The largest RSS seen, sampled every millisecond on a thread (where clear_refs fails)."""

    def __init__(self):
        self.peak, self.done = rss(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        with open("/proc/self/statm") as f:
            page = os.sysconf("SC_PAGE_SIZE")
            while not self.done.wait(0.001):
                f.seek(0)
                self.peak = max(self.peak, int(f.read().split()[1]) * page)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, rss())


def trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def saved_bytes(step, params) -> int:
    """Bytes of the distinct storages saved for backward during one step, parameters' excluded:
    those torch saves (eager's, the captured graph's saved activations) and those the Functions
    save inside a PythonOp, whose own pack hook (it copies what views ORT's buffers) is wrapped
    here for the step (ortbridge._kernel.runner's, restored afterwards)."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict = {}

    def record(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            if s.data_ptr() not in skip and s.data_ptr() != 0:
                seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    runner = sys.modules.get("ortbridge._kernel.runner")  # (imported once a PythonOp runs; never in eager)
    push = runner and runner._push_saved_hooks
    if runner:
        runner._push_saved_hooks = lambda pack, unpack: push(lambda t: record(pack(t)), unpack)
    try:
        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
            step()
    finally:
        if runner:
            runner._push_saved_hooks = push
    return sum(seen.values())


def graph_bytes() -> int:
    graph = sys.modules.get("ortbridge.training.session")
    if graph is None:
        return 0
    # (type(), not isinstance: some of torch's objects warn when their __class__ is read)
    return sum(o.model.ByteSize() for o in gc.get_objects() if type(o) is graph.GraphSession and o.model is not None)


def child(
    model_name: str, shape: tuple, variant: str, steps: int, warmup: int, threads: int | None, no_trim: bool
) -> dict:
    """One variant of one case in this (fresh) process: the figures, in bytes."""
    import onnxruntime  # noqa: F401
    import torch

    import ortbridge

    if threads:
        torch.set_num_threads(threads)
    imports, imports_split, modules = rss(), split(), len(sys.modules)
    if variant == "imports":  # the fixed costs, one after the other
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # (imports torch._dynamo, sympy)
        optimizer = rss()
        import ortbridge.training.capture  # noqa: F401  (AOTAutograd, torch.export, the ONNX exporter)

        training = rss()
        import train_step  # noqa: F401

        return {
            "imports": imports,
            "imports_anon": imports_split[0],
            "optimizer": optimizer - imports,
            "training": training - optimizer,
            "train_step": rss() - training,
        }
    from train_step import block_case, cnn_case, trainer

    torch.manual_seed(0)
    model, x, y, loss_fn, _ = (block_case if model_name == "Block" else cnn_case)(*shape)
    options = None
    if variant.endswith("-noarena"):
        from ortbridge.training.threads import default_session_options

        options = default_session_options()  # after set_num_threads: its thread count is torch's
        options.enable_cpu_mem_arena = False
    if variant.startswith("OrtModule"):
        model = ortbridge.OrtModule(model, session_options=options)
    elif variant.startswith("compile"):
        model = torch.compile(model, backend="ortbridge", options={"session_options": options} if options else None)
    step = trainer(model, x, y, loss_fn)
    loss = step().item()  # captures the graphs
    saved = saved_bytes(step, model.parameters())
    for _ in range(warmup - 1):
        step()
    if not no_trim:
        trim()
    warm, warm_split = rss(), split()
    sampler = None if reset_peak() else Sampler()
    step()
    first = rss()
    for _ in range(steps - 1):
        step()
    peak = _status("VmHWM") if sampler is None else sampler.stop()
    end = rss()
    if ortbridge.context_pool_size() != 0:
        raise RuntimeError(f"{ortbridge.context_pool_size()} autograd contexts alive after the steps")
    state = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    graphs = graph_bytes()
    # What stays once the model, its optimizer and its captures are gone: the modules the
    # capture imported and the libraries' caches, a cost of the process rather than of the model.
    del model, step
    if variant.startswith("compile"):
        torch._dynamo.reset()
    trim()
    return {
        "loss": loss,
        "imports": imports,
        "warm": warm,
        "peak": peak,
        "grow": end - first,
        "saved": saved,
        "graphs": graphs,
        "state": state,
        "batch": x.nbytes + y.nbytes,
        "hwm": "sampled" if sampler else "VmHWM",
        "kept": rss() - imports,
        "modules": len(sys.modules) - modules,
        "anon": warm_split[0] - imports_split[0],
        "file": warm_split[1] - imports_split[1],
    }


def run_child(script: str, name: str, shape: tuple, variant: str, args) -> dict:
    cmd = [
        sys.executable,
        script,
        "--child",
        name,
        ",".join(map(str, shape)),
        variant,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.no_trim:
        cmd.append("--no-trim")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=os.path.dirname(script) or ".")
    if out.returncode != 0:
        raise RuntimeError(f"{name} {shape} {variant}: child exited with {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small size of each model only (as --size small)")
    parser.add_argument("--size", choices=["small", "large", "all"], default="all")
    parser.add_argument("--steps", type=int, default=5, help="measured steps (at least 2)")
    parser.add_argument("--warmup", type=int, default=12, help="steps after the first (capture) step, before measuring")
    parser.add_argument("--threads", type=int, help="torch's (and so ONNX Runtime's) thread count")
    parser.add_argument("--models", default=",".join(CASES), help="comma-separated, from " + ", ".join(CASES))
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma-separated, eager first, from " + ", ".join(VARIANTS),
    )
    parser.add_argument("--no-trim", action="store_true", help="no malloc_trim before the measured steps")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per child process")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, shape, variant = args.child
        print(
            json.dumps(
                child(
                    name,
                    tuple(int(s) for s in shape.split(",") if s),
                    variant,
                    args.steps,
                    max(1, args.warmup),
                    args.threads,
                    args.no_trim,
                )
            )
        )
        return 0

    import torch
    from common import versions

    variants = args.variants.split(",")
    if variants[0] != "eager" or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants: eager first, then any of {', '.join(VARIANTS[1:])}")
    script = os.path.abspath(__file__)
    size = "small" if args.quick else args.size
    if any(m not in CASES for m in args.models.split(",")) or args.steps < 2:
        parser.error(f"--models: from {', '.join(CASES)}; --steps: at least 2")
    cases = [
        (name, shape)
        for name in args.models.split(",")
        for shape in CASES[name][{"small": slice(1), "large": slice(1, None), "all": slice(None)}[size]]
    ]
    print(versions())
    print(
        f"torch threads {args.threads or torch.get_num_threads()}; one process per row; first step + "
        f"{args.warmup} warm-up steps, then {args.steps} measured; "
        f"{'no malloc_trim' if args.no_trim else 'malloc_trim before measuring'}"
    )
    fixed = run_child(script, "-", (), "imports", args)
    rows = [(name, shape, [run_child(script, name, shape, v, args) for v in variants]) for name, shape in cases]
    print(
        f"imports only (torch + onnxruntime + ortbridge): RSS {fixed['imports'] / MiB:.0f} MiB "
        f"({fixed['imports_anon'] / MiB:.0f} anonymous); then, in MiB:"
    )
    print(
        f"  + a first torch.optim optimizer (imports torch._dynamo) {fixed['optimizer'] / MiB:.0f}, + import "
        f"ortbridge.training {fixed['training'] / MiB:.0f}, + import train_step {fixed['train_step'] / MiB:.0f}"
    )
    status = 0
    for name, shape, results in rows:
        eager = results[0]
        print(
            f"\n{name} {' x '.join(map(str, shape))}: state {eager['state'] / MiB:.2f} MiB, "
            f"batch {eager['batch'] / MiB:.2f} MiB, peak by {eager['hwm']}; MiB except the ratios and mods"
        )
        print(
            f"{'variant':>17} {'warm':>6} {'peak':>6} {'step':>5} {'grow':>5} {'xpeak':>5} {'xstep':>5} "
            f"{'+anon':>6} {'+file':>5} {'kept':>5} {'mods':>4} {'saved':>5} {'graphs':>6}"
        )
        for variant, r in zip(variants, results):
            step, eager_step = r["peak"] - r["warm"], eager["peak"] - eager["warm"]
            xstep = f"{step / eager_step:5.2f}" if eager_step > MiB / 4 else f"{'-':>5}"
            flag = "  > 1.2x" if r["peak"] > 1.2 * eager["peak"] else ""
            print(
                f"{variant:>17} {r['warm'] / MiB:6.0f} {r['peak'] / MiB:6.0f} {step / MiB:5.1f} "
                f"{r['grow'] / MiB:5.1f} {r['peak'] / eager['peak']:5.2f} {xstep} "
                f"{r['anon'] / MiB:6.1f} {r['file'] / MiB:5.1f} {r['kept'] / MiB:5.0f} {r['modules']:4d} "
                f"{r['saved'] / MiB:5.2f} {r['graphs'] / MiB:6.2f}{flag}"
            )
            if not torch.allclose(torch.tensor(r["loss"]), torch.tensor(eager["loss"]), rtol=1e-4, atol=1e-6):
                print(f"{name} {shape}: {variant} loss {r['loss']} differs from eager's {eager['loss']}")
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
