"""OrtModule under torch's distributed engines, 2 processes with the gloo backend, each case against
the eager model under the same engine on the same data: DistributedDataParallel (no_sync gradient
accumulation, find_unused_parameters, static_graph, batch norm buffers broadcast, uneven inputs
with join, backward graphs in stages: given, and by default) and FSDP2's fully_shard of each block
(with a MixedPrecisionPolicy, with activation checkpointing inside the blocks, in stages); both
with torch.compile(backend="ortbridge") of the distributed model instead of OrtModule blocks.
Losses, every gradient, every parameter and buffer after the steps are compared. One more case
checks that nothing the sharded blocks save for backward holds a gathered parameter. Run by test_distributed.py (`python distributed_train.py [case ...]`,
or under torchrun); prints one line per case and rank: `case <name> rank <r>: max difference <d>`."""

import copy
import logging
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import training_functions as tf
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import ortbridge
from ortbridge.training import stages

nn = torch.nn
WORLD = 2
STEPS = 3


class Block(nn.Module):
    """Linear, a Function (BiasGelu), Linear, residual; optionally batch norm, an unused branch,
    or its body under activation checkpointing."""

    def __init__(self, batch_norm=False, unused=False, checkpointed=False):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.bias = nn.Parameter(torch.randn(16) * 0.1)
        self.norm = nn.BatchNorm1d(16) if batch_norm else None
        self.unused = nn.Linear(8, 8) if unused else None
        self.checkpointed = checkpointed

    def body(self, x):
        h = self.a(x)
        if self.norm is not None:
            h = self.norm(h)
        return x + self.b(tf.BiasGelu.apply(h, self.bias))

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False) if self.checkpointed else self.body(x)


class Net(nn.Module):
    def __init__(self, wrap=lambda block: block, **options):
        super().__init__()
        self.blocks = nn.ModuleList([wrap(Block(**options)) for _ in range(2)])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _full(t):
    """A tensor's whole value (a DTensor's, gathered)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _data(rank: int, step: int, rows: int = 8):
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _difference(eager: nn.Module, wrapped: nn.Module, what: str) -> float:
    """The largest difference between the two models' `what` (grad, param, buffer), all of them
    (the same names: OrtModule gives the wrapped module's)."""
    if what == "buffer":
        pairs = zip(eager.buffers(), wrapped.buffers())
    else:
        pairs = (
            (p.grad, q.grad) if what == "grad" else (p, q) for p, q in zip(eager.parameters(), wrapped.parameters())
        )
    worst = 0.0
    for a, b in pairs:
        if (a is None) != (b is None):
            return float("inf")
        if a is not None:
            worst = max(worst, (_full(a).float() - _full(b).float()).abs().max().item())
    return worst


def _train(models: list, rank: int, accumulate: int = 1, rows=lambda rank: 8) -> float:
    """STEPS optimizer steps of each model on this rank's data; the largest difference of losses,
    gradients, parameters and buffers between models[0] (eager) and models[1]."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    worst = 0.0
    for step in range(STEPS):
        losses = []
        for m in models:
            for micro in range(accumulate):  # (no_sync on all but the last micro-batch)
                syncing = micro == accumulate - 1 or not isinstance(m, DDP)
                with m.no_sync() if not syncing else _nothing():
                    loss = m(_data(rank, 10 * step + micro, rows(rank))).square().mean()
                    loss.backward()
            losses.append(loss.detach())
        worst = max(worst, (losses[0] - losses[1]).abs().item(), _difference(*models, "grad"))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    assert ortbridge.context_pool_size() == 0, "contexts left after backward"
    wrapped = [m for m in models[1].modules() if isinstance(m, ortbridge.OrtModule)]
    assert all(m._captures for m in wrapped), "an OrtModule was never called"
    assert wrapped or CAPTURES.count, "torch.compile's graphs never reached the ortbridge backend"
    return max(worst, _difference(*models, "param"), _difference(*models, "buffer"))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _pair(make, wrap_eager, wrap_ours):
    torch.manual_seed(0)  # the same initial model in every process and in both
    model = make()
    return wrap_eager(copy.deepcopy(model)), wrap_ours(model)


def _ddp(**options):
    def case(rank):
        make = lambda: Net(**{k: v for k, v in options.items() if k in ("batch_norm", "unused")})  # noqa: E731
        ddp = {k: v for k, v in options.items() if k in ("find_unused_parameters", "static_graph", "bucket_cap_mb")}
        wrap = lambda m: ortbridge.OrtModule(m, backward_stages=options.get("backward_stages"))  # noqa: E731
        ours = (
            (lambda m: torch.compile(DDP(m, **ddp), backend="ortbridge"))
            if options.get("compiled")
            else (lambda m: DDP(wrap(m), **ddp))
        )
        models = _pair(make, lambda m: DDP(m, **ddp), ours)
        difference = _train(list(models), rank, accumulate=options.get("accumulate", 1))
        _check_stages(models[1], options.get("stages", 1))
        return difference

    return case


def _check_stages(model: nn.Module, expected: int) -> None:
    """That each OrtModule's backward graph ran in `expected` stages (at least, for more than 1)."""
    for m in model.modules():
        if isinstance(m, ortbridge.OrtModule):
            for captures in m._captures.values():
                for capture in captures:
                    count = getattr(capture.sessions[1], "count", 1)
                    assert count >= expected if expected > 1 else count == 1, f"{count} stages, not {expected}"


def _ddp_stages_by_default(rank):
    """Under torch.distributed an OrtModule's backward graph runs in stages of STAGE_BYTES of
    gradients by default (here a few hundred bytes, for this small model)."""
    stages.STAGE_BYTES, before = 256, stages.STAGE_BYTES
    try:
        return _ddp(bucket_cap_mb=0.001, stages=2)(rank)
    finally:
        stages.STAGE_BYTES = before


def _ddp_join(rank):
    """Uneven inputs: rank 1 has one batch fewer; join shadows its missing all-reduce."""
    models = _pair(Net, DDP, lambda m: DDP(ortbridge.OrtModule(m)))
    worst = 0.0
    for m in models:
        with m.join():
            for step in range(STEPS - rank):
                m(_data(rank, step)).square().mean().backward()
    return max(worst, _difference(*models, "grad"))


def _fsdp(mixed_precision=False, compiled=False, backward_stages=None, **options):
    def shard(model):
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mixed_precision
            else MixedPrecisionPolicy()
        )
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)

    def case(rank):
        ours = _blocks_compiled if compiled else (lambda m: shard(_blocks_wrapped(m, backward_stages)))
        models = _pair(lambda: Net(**options), shard, ours)
        difference = _train(list(models), rank)
        _check_stages(models[1], backward_stages or 1)
        return difference

    return case


def _fsdp_keeps_no_gathered_parameter(rank):
    """After the forward of sharded OrtModule blocks, nothing saved for backward holds a gathered
    parameter's values: FSDP has freed the gathered parameters then (their storage resized to
    nothing, references and all), and a session that kept one, or a copy of one (a transposed
    weight, say), would show here. The case's difference: how many saved tensors do."""
    model = _sharded(_blocks_wrapped(Net()))
    for _ in range(2):  # (the second: a run of the captured graphs)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(_data(rank, 0)).square().mean()
        # (the blocks': the root's are not freed after forward, as its backward starts at once)
        full = [_full(p.detach()) for p in model.blocks.parameters()]
        kept = [
            t
            for t in saved
            if t.untyped_storage().nbytes()
            and any(
                t.numel() == p.numel()
                and (
                    torch.equal(t.reshape(p.shape), p) or (p.dim() == 2 and torch.equal(t.reshape(p.t().shape), p.t()))
                )
                for p in full
            )
        ]
        loss.backward()
    return float(len(kept))


def _sharded(model: Net) -> Net:
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _fsdp_inside_refused(rank):
    """An OrtModule around a sharded model: refused, with what to do."""
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    wrapped = ortbridge.OrtModule(fully_shard(model))
    try:
        wrapped(_data(rank, 0))
    except ortbridge.CaptureError as e:
        assert "wrap each block in an OrtModule first" in str(e), e
        return 0.0
    raise AssertionError("an OrtModule around a sharded model was not refused")


def _blocks_compiled(model: Net) -> Net:
    """Each block sharded, then compiled in place (nn.Module.compile: dynamo sees the block's forward,
    FSDP's hooks run around it)."""
    for block in model.blocks:
        fully_shard(block)
        block.compile(backend="ortbridge")
    return fully_shard(model)


def _blocks_wrapped(model: Net, backward_stages: int | None = None) -> Net:
    """The usual pattern: each block an OrtModule, then sharded."""
    model.blocks = nn.ModuleList(
        [ortbridge.OrtModule(block, backward_stages=backward_stages) for block in model.blocks]
    )
    return model


CASES = {
    "ddp": _ddp(),
    "ddp_no_sync": _ddp(accumulate=2),
    "ddp_find_unused_parameters": _ddp(unused=True, find_unused_parameters=True),
    "ddp_static_graph": _ddp(static_graph=True),
    "ddp_batch_norm_buffers": _ddp(batch_norm=True),
    "ddp_join_uneven_inputs": _ddp_join,
    "ddp_backward_stages": _ddp(backward_stages=3, bucket_cap_mb=0.001, stages=2),
    "ddp_backward_stages_by_default": _ddp_stages_by_default,
    "fsdp": _fsdp(),
    "fsdp_mixed_precision": _fsdp(mixed_precision=True),
    "fsdp_checkpointed_blocks": _fsdp(checkpointed=True),
    "fsdp_backward_stages": _fsdp(backward_stages=2),
    "fsdp_inside_ortmodule_refused": _fsdp_inside_refused,
    "fsdp_keeps_no_gathered_parameter": _fsdp_keeps_no_gathered_parameter,
    "ddp_compiled": _ddp(compiled=True),
    "fsdp_compiled": _fsdp(compiled=True),
}


class _Captures(logging.Handler):
    """Counts the captures ortbridge logs (torch.compile's graphs, which no module holds)."""

    count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("captured ")


CAPTURES = _Captures()


def worker(rank: int, port: int | None, cases: list) -> None:
    logger = logging.getLogger("ortbridge")
    logger.addHandler(CAPTURES)
    logger.setLevel(logging.INFO)
    if port is None:  # (under torchrun: its environment says where)
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {}
    for name in cases:
        CAPTURES.count = 0
        torch._dynamo.reset()  # (each case compiles afresh: a graph cached by an earlier case logs no capture)
        try:
            results[name] = f"max difference {CASES[name](rank):.3g}"
        except Exception as e:  # (reported per case: the other cases still run)
            results[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:  # one process prints, so that the lines do not interleave
        for r, per_case in enumerate(gathered):
            for name, line in per_case.items():
                print(f"case {name} rank {r}: {line}")
    dist.destroy_process_group()
    # Leave without interpreter finalization: gloo's worker thread may still be destroying the
    # all-gather's work, whose tensors it then decrefs, taking the GIL of a finalizing interpreter:
    # pthread_exit through a noexcept destructor in torch's ProcessGroupGloo::runLoop, std::terminate
    # (gdb backtrace, about 1 run in 4 on a loaded machine).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    chosen = sys.argv[1:] or list(CASES)
    if "LOCAL_RANK" in os.environ:  # torchrun --nproc-per-node 2 distributed_train.py
        worker(int(os.environ["RANK"]), None, chosen)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(worker, args=(free_port, chosen), nprocs=WORLD)
    sys.exit(0)
