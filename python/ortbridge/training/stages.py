"""A backward graph run in stages, each an ONNX Runtime session of its own, so that gradients reach
autograd (DDP's all-reduce hooks, post-accumulate-grad hooks) as each stage computes them, not when
the whole graph has run.

The graph's gradient outputs, in the order the graph computes them, are cut into stages of about
equal bytes; every other node runs in the earliest stage whose outputs need it (the last one where
none does). The step (step.py) runs stage 0 in its backward; each later stage runs in the backward
of a _Stage node that the forward put between the step and the tensors whose gradients that stage
gives. Torch's autograd engine runs what is ready in order, AccumulateGrad nodes first: a stage's
gradients are accumulated, and their hooks run, before the next stage starts.
"""

from __future__ import annotations

import math
import operator

import torch

from .._copying import NotCopyable
from .._tracing.record import size_hint
from .model_state import FunctionsAutocast
from .session import GraphSession

# Gradients per stage when the step counts its stages itself (Step.stages_for): a stage's run costs
# one ORT run more and keeps ORT from fusing across its ends; a stage of a few MiB of gradients
# has work enough to hide that behind.
STAGE_BYTES = 4 << 20
MAX_STAGES = 8


def stages_for(gm: torch.fx.GraphModule) -> int:
    """How many stages a backward graph runs in by default: one, unless torch.distributed runs
    more than one process (whose all-reduce can overlap the later stages), then one per
    STAGE_BYTES of gradients, at most MAX_STAGES."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() < 2:
        return 1
    total = sum(_bytes(r) for r in gm.graph.output_node().args[0] if isinstance(r, torch.fx.Node))
    return max(1, min(MAX_STAGES, math.ceil(total / STAGE_BYTES)))


def _bytes(node: torch.fx.Node) -> int:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    return math.prod(size_hint(d) for d in value.shape) * value.dtype.itemsize


def _assign(graph: torch.fx.Graph, results: list, count: int) -> dict:
    """The stage of each node that is neither a placeholder nor the output: the gradients cut by
    bytes in the order the graph computes them, every other node in the earliest stage that
    reads it, then stages that give no gradient merged into the next that does."""
    position = {n: k for k, n in enumerate(graph.nodes)}
    computed = sorted(
        {r for r in results if isinstance(r, torch.fx.Node) and r.op != "placeholder"}, key=position.__getitem__
    )
    total = sum(map(_bytes, computed)) or 1
    group, before = {}, 0
    for r in computed:
        group[r] = min(count - 1, count * before // total)
        before += _bytes(r)
    stage = {}
    for node in reversed(graph.nodes):
        if node.op not in ("placeholder", "output"):
            wanted = [stage[u] for u in node.users if u.op != "output"]
            stage[node] = min([*wanted, group[node]] if node in group else wanted, default=count - 1)
    for node in graph.nodes:  # (an element of a node's several outputs: where that node runs)
        if node.target is operator.getitem and node.args[0] in stage:
            stage[node] = stage[node.args[0]]
    giving = sorted({stage[r] for r in computed})
    if not giving:
        return {n: 0 for n in stage}
    # (a monotone map: a node's stage is still no later than its users')
    merged = {s: next((g for g in giving if g >= s), giving[-1]) for s in range(count)}
    return {n: giving.index(merged[s]) for n, s in stage.items()}


class StagedBackward(NotCopyable):
    """A backward graph's stages: called with the graph's inputs (the boxed convention) it runs them
    all and gives the graph's outputs, as a GraphSession would; a Step runs them one at a time
    (run). Values are kept by key while a later stage or an output needs them: the graph's inputs
    by their index, then each stage's outputs."""

    _boxed_call = True

    @staticmethod
    def of(
        gm: torch.fx.GraphModule,
        count: int,
        session_options=None,
        providers=None,
        save_as: str | None = None,
        autocast: FunctionsAutocast | None = None,
    ) -> StagedBackward | None:
        """The graph in up to `count` stages; None where it has fewer than two (one gradient)."""
        stage = _assign(gm.graph, list(gm.graph.output_node().args[0]), count)
        if max(stage.values(), default=0) == 0:
            return None
        return StagedBackward(gm, stage, session_options, providers, save_as, autocast)

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        stage: dict,
        session_options,
        providers,
        save_as: str | None,
        autocast: FunctionsAutocast | None = None,
    ):
        graph = gm.graph
        results = list(graph.output_node().args[0])
        self.count = max(stage.values()) + 1
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        key = {p: k for k, p in enumerate(placeholders)}
        nodes = [[] for _ in range(self.count)]
        for node in graph.nodes:
            if node in stage:
                nodes[stage[node]].append(node)
        # Where each output comes from, and which stage gives it (stage 0: an input passed through).
        result_stage = {r: stage.get(r, 0) for r in results if isinstance(r, torch.fx.Node)}
        self.sessions: list[GraphSession] = []
        self.reads: list[list[int]] = []  # per stage: the keys of its inputs
        self.writes: list[list[int]] = []  # per stage: the keys of its outputs
        last_use: dict[int, int] = {}
        for k, stage_nodes in enumerate(nodes):
            stage_graph, env = torch.fx.Graph(), {}
            ours = set(stage_nodes)
            # (get_attr: a constant, which each stage that reads it has)
            reads = list(
                dict.fromkeys(s for n in stage_nodes for s in n.all_input_nodes if s not in ours and s.op != "get_attr")
            )
            for source in reads:
                env[source] = stage_graph.placeholder(source.name)
                env[source].meta = dict(source.meta)
            for node in stage_nodes:
                for source in node.all_input_nodes:
                    if source not in env:
                        env[source] = stage_graph.node_copy(source)
                env[node] = stage_graph.node_copy(node, env.__getitem__)
            gives = [
                n
                for n in stage_nodes
                if any(u.op == "output" for u in n.users)
                or (n.op != "get_attr" and any(stage[u] > k for u in n.users if u.op != "output"))
            ]
            stage_graph.output(tuple(env[n] for n in gives))
            for node in gives:
                key[node] = len(key)
            self.reads.append([key[n] for n in reads])
            self.writes.append([key[n] for n in gives])
            for n in reads:
                last_use[key[n]] = k
            self.sessions.append(
                GraphSession(
                    torch.fx.GraphModule(gm, stage_graph),
                    False,
                    session_options,
                    providers,
                    save_as and save_as.replace(".onnx", f"_{k}.onnx"),
                    autocast,
                )
            )
        self.results = [key[r] if isinstance(r, torch.fx.Node) else None for r in results]
        self.gradients = [
            [i for i, r in enumerate(results) if isinstance(r, torch.fx.Node) and result_stage[r] == k]
            for k in range(self.count)
        ]  # per stage: the outputs it gives
        for k, given in enumerate(self.gradients):
            for i in given:
                last_use[self.results[i]] = max(last_use.get(self.results[i], 0), k)
        self.dropped = [[j for j, last in last_use.items() if last == k] for k in range(self.count)]
        self.runs_contexts = any(s.runs_contexts for s in self.sessions)

    def computes(self, i: int) -> bool:
        return self.results[i] is not None

    def run(self, k: int, values: dict, run_stage=None) -> list:
        """Runs stage k on `values` (key -> value, updated: its outputs in, what no later stage reads
        out); gives the outputs it gives, in the order of self.gradients[k]. (`run_stage`: what runs
        a stage's session, given it and its inputs; by default it is called.)"""
        inputs = [values[j] for j in self.reads[k]]
        session = self.sessions[k]
        outputs = session(inputs) if run_stage is None else run_stage(session, inputs)
        values.update(zip(self.writes[k], outputs))
        given = [values[self.results[i]] for i in self.gradients[k]]
        for j in self.dropped[k]:
            values.pop(j, None)
        return given

    def __call__(self, args: list) -> list:
        values = dict(enumerate(args))
        args.clear()
        outputs = [None] * len(self.results)
        for k in range(self.count):
            for i, gradient in zip(self.gradients[k], self.run(k, values)):
                outputs[i] = gradient
        return outputs
