"""Per-call cost of an ortbridge PythonOp (and PythonOpGrad) against eager Function.apply.

What is measured
----------------
An ONNX graph chains K PythonOp nodes (K = 1, 16, 64) over a 16-element float32 tensor. Each
node calls the same registered identity-like torch.autograd.Function (forward: x.clone(),
backward: return g), so the work per node is negligible and the time is the bridge itself:
ORT kernel dispatch, GIL acquisition, DLPack in and out, Function.apply, and the copy of the
result into ORT's output buffer. The reference is the same chain of Function.apply calls in
eager PyTorch, timed in the same process and run.

Four graph modes (and a module benchmark, --modes ortmodule, below):
  inference  training_mode=0, output 0 (the context id, which nothing reads) unnamed, as
             ortbridge.export writes an inference node; eager runs the chain under torch.no_grad().
  forward    training_mode=0 and safe_run_mode=0: the node calls the Function's forward
             directly, without Function.apply (ORT's opt-in fast path for inference). Eager as
             for inference.
  training   one ORT graph: the K PythonOps (training_mode=1, input_requires_grads=[1]) then
             the K PythonOpGrads in reverse order, the gradient of the last output fed as a
             graph input. Eager: y = chain(x) with x.requires_grad, then y.backward(g).
             A "call" is forward plus backward, so per op it counts one PythonOp and one
             PythonOpGrad.
  custom_op  a torch.library.custom_op (ortbridge_bench::clone, x.clone()) instead of the
             Function: the graph is ortbridge.export of a module calling it K times, each call a
             fallback node (func_name ortbridge_bench::clone.default); eager calls the operator K
             times under torch.no_grad(). CPU only.

How to read it
--------------
The table gives the median time of one whole call (session.run, or the eager chain) for each
K: ORT us/call, eager us/call, and ratio = ORT / eager. The K=1 row is dominated by fixed costs
(session.run with numpy feeds and fetches; for eager, backward-engine start-up in training).
The per-op line is the slope (t(K=64) - t(K=1)) / 63: the marginal cost of one more node in
the graph versus one more Function.apply in eager code, which is what a model with many
custom Functions pays. Each timing is the median over --repeats repeats of N iterations, N
chosen so that a repeat lasts about --target seconds; ORT and eager repeats are interleaved.

ORT runs with intra_op_num_threads=1 and inter_op_num_threads=1, sequential execution; torch
uses torch.get_num_threads() (irrelevant for 16 elements). Before timing, every configuration
checks that ORT's outputs equal eager's; at the end ortbridge.context_pool_size() must be 0.

With the inference mode, a line splits an inference op: what it cannot do without, each part
timed in the same run (ORT's dispatch of a native node, from a chain of K Neg nodes; a DLPack round
trip in and out; the Function called as the kernel calls it: apply without torch's Python wrapper,
under no_grad), and their sum against one eager Function.apply timed with them. (The parts are
single calls repeated, the table's figures slopes of chains, timed at another moment: compare each
with its own column.)

--device cuda
-------------
The same graphs with every node on ORT's CUDA execution provider (device 0): the Function gets
CUDA tensors viewing ORT's device buffers and runs on ORT's compute stream, the kernel copies its
result into ORT's buffer on that stream. ORT is driven through IOBinding on torch CUDA tensors
(inputs and outputs bound in place, nothing crosses to the host but PythonOpGrad's 8-byte context
id). session.run ends by synchronizing ORT's stream (ORT's default), so each eager call ends with
torch.cuda.current_stream().synchronize(): both sides time work that has finished. Each timed
loop is bracketed by torch.cuda.synchronize(). Without a GPU and onnxruntime-gpu's
CUDAExecutionProvider, --device cuda exits with status 2 and says what is missing.

--modes ortmodule
-----------------
The same Function, called by a module instead of a hand-built graph: forward is a chain of K
Clone.apply calls on a 16-element float32 input that requires grad, so backward runs through
all K calls. K = 1 and 64 by default (--ortmodule-ks). `--function saves` calls SavesInput
instead, which saves its input for backward as an activation does (forward x * 2, backward
reads x back, g * 2): OrtModule then binds each saved input as an output of the forward graph
and lends its buffer to the Function (no copy). Three variants of the module, their repeats
interleaved:
  eager      the plain module.
  OrtModule  ortbridge.OrtModule(module) with its default options (one ONNX Runtime thread
             for these small graphs, which sleeps between runs): the K calls are K PythonOp nodes
             in the forward graph and K PythonOpGrad nodes in the backward graph, and a step
             also pays OrtModule.forward, the Step's autograd.Function (training/step.py) and
             the IOBinding of each session run.
  compile    torch.compile(module, backend="ortbridge"): dynamo inlines the traceable Function,
             so ONNX Runtime runs K clone operators and no Function is called. Its per-call
             column is the cost of one inlined clone, not of a Function call (--no-compile
             leaves it out).
Two step kinds: train (x.grad = None; y = module(x); y.sum().backward()) and eval (the module
in eval mode, y = module(x) under torch.no_grad(): the inference graph, no autograd context).
Before timing, each wrapped variant's output (and in train the input's gradient) must equal
eager's, and no context may be live after the step; otherwise the script exits with status 1.
The first table gives the median time of one step per variant and K, and the ratio to eager.
Then per Function call = (t(K=64) - t(K=1)) / 63 for each variant with OrtModule / eager, and
the fixed cost of a step over eager, t(K=1) - t_eager(K=1), each next to its goal: per call at
most 1.25 x eager's Function.apply (stretch 1.1 x), fixed cost at most 100 us. CPU only.
"""

from __future__ import annotations

import argparse
import gc
import sys

import numpy as np
import torch
from common import (
    Clone,
    SavesInput,
    cuda_versions,
    medians,
    model_session,
    python_op,
    python_op_grad,
    require_device,
    session,
    versions,
)
from onnx import helper

import ortbridge
from ortbridge._kernel import runner

NUMEL = 16
KS = (1, 16, 64)
GRAPH_MODES = ("inference", "forward", "training", "custom_op")
MODES = (*GRAPH_MODES, "ortmodule")
ORTMODULE_KS = (1, 64)
PER_CALL_GOAL, PER_CALL_STRETCH, FIXED_GOAL_US = 1.25, 1.1, 100.0


def build_session(k: int, training: bool, safe: bool = True, device: str = "cpu"):
    nodes, prev = [], "x"
    for i in range(k):
        out = "y" if i == k - 1 else f"y{i}"
        context = f"ctx{i}" if training else ""  # (unread: unnamed, as ortbridge.export writes it)
        nodes.append(python_op(Clone, prev, out, context, f"fw{i}", training, safe))
        prev = out
    inputs, outputs = [("x", [NUMEL])], [("y", None)]
    if training:
        grad = "g"
        for i in reversed(range(k)):
            out = "gx" if i == 0 else f"g{i}"
            nodes.append(python_op_grad(Clone, f"ctx{i}", grad, out, f"bw{i}"))
            grad = out
        inputs.append(("g", [NUMEL]))
        outputs.append(("gx", None))
    return session(nodes, inputs, outputs, device=device)


@torch.library.custom_op("ortbridge_bench::clone", mutates_args=())
def _custom_clone(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


_custom_clone.register_fake(lambda x: torch.empty_like(x))
ortbridge.allow_operators("ortbridge_bench")


class _CustomOpChain(torch.nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, x):
        for _ in range(self.k):
            x = torch.ops.ortbridge_bench.clone(x)
        return x


def make_custom_op_calls(k: int):
    """(ort_call, eager_call, check) for the custom_op mode."""
    x_np = np.arange(NUMEL, dtype=np.float32)
    x = torch.from_numpy(x_np.copy())
    proto = ortbridge.export(_CustomOpChain(k), (x,))
    ops = [n for n in proto.graph.node if n.domain == "ortbridge"]
    assert len(ops) == k == len(proto.graph.node), (
        f"{len(proto.graph.node)} nodes, {len(ops)} ortbridge nodes for K={k}"
    )
    sess = model_session(proto.SerializeToString())
    feeds, op, no_grad = {sess.get_inputs()[0].name: x_np}, torch.ops.ortbridge_bench.clone, torch.no_grad

    def ort_call():
        return sess.run(None, feeds)

    def eager_call():
        with no_grad():
            y = x
            for _ in range(k):
                y = op(y)
        return y

    def check():
        (y_ort,) = ort_call()
        assert np.array_equal(y_ort, eager_call().numpy()) and np.array_equal(y_ort, x_np), "custom_op output differs"
        assert ortbridge.context_pool_size() == 0

    return ort_call, eager_call, check


def make_calls(mode: str, k: int):
    """(ort_call, eager_call, check) for one configuration."""
    if mode == "custom_op":
        return make_custom_op_calls(k)
    training = mode == "training"
    sess = build_session(k, training, safe=mode != "forward")
    x_np = np.arange(NUMEL, dtype=np.float32)
    g_np = np.linspace(-1, 1, NUMEL, dtype=np.float32)
    apply = Clone.apply

    if training:
        feeds = {"x": x_np, "g": g_np}
        fetches = ["y", "gx"]
        x = torch.from_numpy(x_np.copy()).requires_grad_()
        g = torch.from_numpy(g_np.copy())

        def ort_call():
            return sess.run(fetches, feeds)

        def eager_call():
            x.grad = None
            y = x
            for _ in range(k):
                y = apply(y)
            y.backward(g)
            return y, x.grad

        def check():
            y_ort, gx_ort = ort_call()
            y_eager, gx_eager = eager_call()
            assert np.array_equal(y_ort, y_eager.detach().numpy()), "training forward output differs"
            assert np.array_equal(gx_ort, gx_eager.numpy()), "training gradient differs"
            assert np.array_equal(gx_ort, g_np)
            assert ortbridge.context_pool_size() == 0, f"{ortbridge.context_pool_size()} contexts left live"
    else:
        feeds = {"x": x_np}
        fetches = ["y"]
        x = torch.from_numpy(x_np.copy())
        no_grad = torch.no_grad

        def ort_call():
            return sess.run(fetches, feeds)

        def eager_call():
            with no_grad():
                y = x
                for _ in range(k):
                    y = apply(y)
            return y

        def check():
            (y_ort,) = ort_call()
            y_eager = eager_call()
            assert np.array_equal(y_ort, y_eager.numpy()), "inference output differs"
            assert np.array_equal(y_ort, x_np)
            assert ortbridge.context_pool_size() == 0

    return ort_call, eager_call, check


def make_cuda_calls(mode: str, k: int):
    """(ort_call, eager_call, check) for one configuration on the GPU: ORT through IOBinding on
    torch CUDA tensors, eager on the same device; each call ends with its work finished."""
    training = mode == "training"
    sess = build_session(k, training, safe=mode != "forward", device="cuda")
    x = torch.arange(NUMEL, dtype=torch.float32, device="cuda")
    g = torch.linspace(-1, 1, NUMEL, device="cuda")
    y, gx = torch.empty_like(x), torch.empty_like(x)
    io = sess.io_binding()
    bound = [("x", x, False), ("y", y, True)] + ([("g", g, False), ("gx", gx, True)] if training else [])
    for name, t, output in bound:
        (io.bind_output if output else io.bind_input)(name, "cuda", 0, np.float32, [NUMEL], t.data_ptr())
    run = sess.run_with_iobinding
    apply = Clone.apply
    stream = torch.cuda.current_stream()

    def ort_call():
        run(io)  # returns once ORT's stream is done

    if training:
        xe = x.clone().requires_grad_()

        def eager_call():
            xe.grad = None
            ye = xe
            for _ in range(k):
                ye = apply(ye)
            ye.backward(g)
            stream.synchronize()
            return ye, xe.grad
    else:
        no_grad = torch.no_grad

        def eager_call():
            with no_grad():
                ye = x
                for _ in range(k):
                    ye = apply(ye)
            stream.synchronize()
            return ye

    def check():
        torch.cuda.synchronize()  # ORT's stream does not wait for torch's: the bound inputs are ready
        y.fill_(float("nan"))
        gx.fill_(float("nan"))
        torch.cuda.synchronize()
        ort_call()
        result = eager_call()
        y_eager, gx_eager = result if training else (result, None)
        assert torch.equal(y, y_eager.detach()), "CUDA output differs from eager"
        assert torch.equal(y, x), "CUDA output differs from the input"
        if training:
            assert torch.equal(gx, gx_eager) and torch.equal(gx, g), "CUDA gradient differs from eager"
        assert ortbridge.context_pool_size() == 0, f"{ortbridge.context_pool_size()} contexts left live"

    return ort_call, eager_call, check


def print_inference_parts(repeats: int, target: float, warmup: int) -> None:
    """What an inference op cannot do without, each part timed here: ORT's dispatch of a native
    node (the slope of a chain of Neg nodes), a DLPack round trip in and out, and the Function
    called as the kernel calls it (apply without torch's Python wrapper, grad mode off); against
    one eager Function.apply under no_grad."""
    x_np = np.arange(NUMEL, dtype=np.float32)
    x = torch.from_numpy(x_np)
    feeds = {"x": x_np}

    def neg_chain(k: int):
        names = ["x"] + [f"n{i}" for i in range(k - 1)] + ["y"]
        sess = session(
            [helper.make_node("Neg", [a], [b]) for a, b in zip(names, names[1:])], [("x", [NUMEL])], [("y", None)]
        )
        return lambda: sess.run(["y"], feeds)

    lo, hi = KS[0], KS[-1]
    direct = runner.direct_apply(Clone)
    apply, from_dlpack, to_dlpack = Clone.apply, runner._from_dlpack, runner._to_dlpack
    with torch.no_grad():
        t_lo, t_hi, t_dlpack, t_direct, t_apply = medians(
            [
                neg_chain(lo),
                neg_chain(hi),
                lambda: to_dlpack(from_dlpack(to_dlpack(x))),
                lambda: direct(x),
                lambda: apply(x),
            ],
            repeats,
            target,
            warmup,
        )
    dispatch = (t_hi - t_lo) / (hi - lo)
    floor = dispatch + t_dlpack + t_direct
    print(
        f"an inference op's parts: ORT's dispatch of a native node {dispatch * 1e6:.2f} us (Neg chain), DLPack "
        f"in and out {t_dlpack * 1e6:.2f}, the Function as the kernel calls it {t_direct * 1e6:.2f}; sum "
        f"{floor * 1e6:.2f} us = {floor / t_apply:.2f} x one eager Function.apply ({t_apply * 1e6:.2f} us)"
    )


FUNCTIONS = {"clone": Clone, "saves": SavesInput}  # --function


class Chain(torch.nn.Module):
    """K calls of a Function (Clone: forward clones K times, backward passes the gradient back
    through all K)."""

    def __init__(self, k: int, func: type = Clone):
        super().__init__()
        self.k = k
        self.func = func

    def forward(self, x):
        for _ in range(self.k):
            x = self.func.apply(x)
        return x


def module_step(model, x: torch.Tensor, train: bool):
    """One step of `model` on x: (y, x.grad) after forward and backward, or y under no_grad."""
    if train:

        def step():
            x.grad = None
            y = model(x)
            y.sum().backward()
            return y, x.grad
    else:
        no_grad = torch.no_grad

        def step():
            with no_grad():
                return model(x), None

    return step


def make_module_steps(train: bool, k: int, compiled: bool, func: type = Clone):
    """({variant: step}, check) for the module benchmark: eager, OrtModule and (with `compiled`)
    torch.compile(backend="ortbridge"), each with an input of its own. check() runs eager's
    step once and each wrapped one twice (the first call captures its graphs), and gives an error
    message, or None."""
    module = Chain(k, func).train(train)
    wrapped = {"eager": module, "OrtModule": ortbridge.OrtModule(module)}
    if compiled:
        torch._dynamo.reset()  # (one code object, Chain.forward, for every K and mode)
        wrapped["compile"] = torch.compile(module, backend="ortbridge")
    x = torch.arange(NUMEL, dtype=torch.float32)
    steps = {name: module_step(m, x.clone().requires_grad_(train), train) for name, m in wrapped.items()}
    kind = "train" if train else "eval"

    def check():
        y_eager, gx_eager = steps["eager"]()
        for name, step in steps.items():
            if name == "eager":
                continue
            for _ in range(2):  # the first call captures; the second runs the captured graphs
                y, gx = step()
            if not torch.equal(y.detach(), y_eager.detach()):
                return f"{kind} K={k}: {name} output {y.tolist()} differs from eager's {y_eager.tolist()}"
            if train and (gx is None or not torch.equal(gx, gx_eager)):
                return (
                    f"{kind} K={k}: {name} input gradient {None if gx is None else gx.tolist()} differs from "
                    f"eager's {gx_eager.tolist()}"
                )
            del y, gx
            gc.collect()
            if ortbridge.context_pool_size() != 0:
                return f"{kind} K={k}: {ortbridge.context_pool_size()} contexts live after a {name} step"
        return None

    return steps, check


def run_ortmodule(ks: tuple, repeats: int, target: float, warmup: int, compiled: bool, func: type = Clone) -> int:
    """The module benchmark (--modes ortmodule): prints its tables; 1 when a check fails."""
    variants = ["eager", "OrtModule"] + (["compile"] if compiled else [])
    print(
        f"ortmodule: a module calling {func.__name__}.apply K times; step = train (forward, y.sum().backward()) "
        "or eval (no_grad forward)"
    )
    print(
        "OrtModule with its default options (ORT intra-op threads: one, as every tensor is small)"
        + ('; compile = torch.compile(backend="ortbridge"), which inlines the Function' if compiled else "")
    )
    header = f"{'step':<6} {'K':>3} {'eager us/step':>14} {'OrtModule us/step':>18} {'ratio':>7}"
    if compiled:
        header += f" {'compile us/step':>16} {'ratio':>7}"
    print(header)
    results: dict[tuple[str, int], dict[str, float]] = {}
    for kind in ("train", "eval"):
        for k in ks:
            steps, check = make_module_steps(kind == "train", k, compiled, func)
            error = check()
            if error is not None:
                print(f"ERROR: {error}", file=sys.stderr)
                return 1
            times = dict(zip(variants, medians([steps[v] for v in variants], repeats, target, warmup)))
            results[(kind, k)] = times
            e = times["eager"]
            line = f"{kind:<6} {k:>3} {e * 1e6:>14.1f} {times['OrtModule'] * 1e6:>18.1f} {times['OrtModule'] / e:>7.2f}"
            if compiled:
                line += f" {times['compile'] * 1e6:>16.1f} {times['compile'] / e:>7.2f}"
            print(line, flush=True)
            del steps, check
    lo, hi = ks[0], ks[-1]
    print()
    print(
        f"per Function call = (t(K={hi}) - t(K={lo})) / {hi - lo}; goal: OrtModule / eager <= {PER_CALL_GOAL:g} "
        f"(stretch {PER_CALL_STRETCH:g})" + ("; compile: per inlined clone, not a Function call" if compiled else "")
    )
    header = (
        f"{'step':<6} {'eager us/call':>14} {'OrtModule us/call':>18} {'ratio':>7} "
        f"{f'goal <={PER_CALL_GOAL:g}':>11} {f'stretch <={PER_CALL_STRETCH:g}':>12}"
    )
    if compiled:
        header += f" {'compile us/clone':>17} {'ratio':>7}"
    print(header)
    for kind in ("train", "eval"):
        slope = {v: (results[(kind, hi)][v] - results[(kind, lo)][v]) / (hi - lo) for v in variants}
        ratio = slope["OrtModule"] / slope["eager"]
        line = (
            f"{kind:<6} {slope['eager'] * 1e6:>14.2f} {slope['OrtModule'] * 1e6:>18.2f} {ratio:>7.2f} "
            f"{_verdict(ratio <= PER_CALL_GOAL):>11} {_verdict(ratio <= PER_CALL_STRETCH):>12}"
        )
        if compiled:
            line += f" {slope['compile'] * 1e6:>17.2f} {slope['compile'] / slope['eager']:>7.2f}"
        print(line)
    print()
    print(
        f"fixed cost of a step over eager at K={lo} = t(K={lo}) - t_eager(K={lo}); goal: OrtModule <= "
        f"{FIXED_GOAL_US:g} us"
    )
    header = f"{'step':<6} {'eager us/step':>14} {'OrtModule us':>13} {f'goal <={FIXED_GOAL_US:g} us':>14}"
    if compiled:
        header += f" {'compile us':>11}"
    print(header)
    for kind in ("train", "eval"):
        times = results[(kind, lo)]
        fixed = (times["OrtModule"] - times["eager"]) * 1e6
        line = f"{kind:<6} {times['eager'] * 1e6:>14.1f} {fixed:>13.1f} {_verdict(fixed <= FIXED_GOAL_US):>14}"
        if compiled:
            line += f" {(times['compile'] - times['eager']) * 1e6:>11.1f}"
        print(line)
    return 0


def _verdict(met: bool) -> str:
    return "met" if met else "missed"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per measurement (median reported)")
    p.add_argument("--target", type=float, default=0.25, help="seconds per repeat (sets N)")
    p.add_argument("--quick", action="store_true", help="smoke run: 3 repeats of ~0.03 s")
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated subset of inference,forward,training,custom_op,ortmodule (default: all of "
        "them; with --device cuda, the first three)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default) or cuda: the nodes on ORT's CUDA execution provider, eager on the GPU",
    )
    p.add_argument(
        "--ortmodule-ks",
        default=",".join(map(str, ORTMODULE_KS)),
        help="comma-separated chain lengths K of the ortmodule mode (per call: from the smallest and the largest)",
    )
    p.add_argument(
        "--function",
        choices=FUNCTIONS,
        default="clone",
        help="the ortmodule mode's Function: clone (default) or saves (saves its input for backward)",
    )
    p.add_argument(
        "--no-compile",
        action="store_true",
        help='ortmodule mode without the torch.compile(backend="ortbridge") variant',
    )
    args = p.parse_args(argv)
    repeats, target, warmup = args.repeats, args.target, 20
    if args.quick:
        repeats, target, warmup = min(repeats, 3), 0.03, 3
    if args.modes is None:
        modes = list(GRAPH_MODES) + ["ortmodule"] if args.device == "cpu" else ["inference", "forward", "training"]
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}")
    if {"ortmodule", "custom_op"} & set(modes) and args.device != "cpu":
        p.error("the ortmodule and custom_op modes run on the CPU only")
    try:
        ortmodule_ks = tuple(sorted({int(k) for k in args.ortmodule_ks.split(",") if k.strip()}))
    except ValueError:
        p.error(f"--ortmodule-ks {args.ortmodule_ks!r}: expected comma-separated integers")
    if len(ortmodule_ks) < 2 or ortmodule_ks[0] < 1:
        p.error("--ortmodule-ks needs two or more distinct chain lengths, each at least 1")
    graph_modes = [m for m in modes if m in GRAPH_MODES]
    require_device(args.device, "overhead.py")
    on_cuda = args.device == "cuda"
    calls, sync = (make_cuda_calls, torch.cuda.synchronize) if on_cuda else (make_calls, None)

    print(versions())
    if on_cuda:
        print(cuda_versions())
        print(
            "device cuda: ORT's CUDA execution provider through IOBinding; each call (ORT run, eager chain) "
            "ends with its stream synchronized"
        )
    print(
        f"torch threads {torch.get_num_threads()}  "
        + ("ORT intra/inter threads 1/1  " if graph_modes else "")
        + f"tensor {NUMEL} x float32  repeats {repeats}  ~{target:g} s/repeat  (times: median, microseconds)"
    )
    if graph_modes:
        print()
        print(f"{'mode':<10} {'K':>3} {'ORT us/call':>12} {'eager us/call':>14} {'ratio':>7}")
        results: dict[tuple[str, int], tuple[float, float]] = {}
        for mode in graph_modes:
            for k in KS:
                ort_call, eager_call, check = calls(mode, k)
                check()
                t_ort, t_eager = medians([ort_call, eager_call], repeats, target, warmup, sync)
                results[(mode, k)] = (t_ort, t_eager)
                print(
                    f"{mode:<10} {k:>3} {t_ort * 1e6:>12.1f} {t_eager * 1e6:>14.1f} {t_ort / t_eager:>7.2f}", flush=True
                )
                del ort_call, eager_call, check
        print()
        lo, hi = KS[0], KS[-1]
        print(f"per op = (t(K={hi}) - t(K={lo})) / {hi - lo}")
        print(f"{'mode':<10} {'ORT us/op':>10} {'eager us/op':>12} {'ratio':>7}")
        for mode in graph_modes:
            (o1, e1), (o2, e2) = results[(mode, lo)], results[(mode, hi)]
            po, pe = (o2 - o1) / (hi - lo), (e2 - e1) / (hi - lo)
            print(f"{mode:<10} {po * 1e6:>10.2f} {pe * 1e6:>12.2f} {po / pe:>7.2f}")
        if "inference" in graph_modes and not on_cuda:
            print_inference_parts(repeats, target, warmup)
    if "ortmodule" in modes:
        print()
        if run_ortmodule(ortmodule_ks, repeats, target, warmup, not args.no_compile, FUNCTIONS[args.function]):
            return 1
    gc.collect()
    live = ortbridge.context_pool_size()
    print()
    print(f"ortbridge.context_pool_size() at exit: {live}")
    if live != 0:
        print("ERROR: autograd contexts leaked", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
