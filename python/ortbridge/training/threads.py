"""How ONNX Runtime's threads and torch's share the cores: a graph's session options, and the
trial of sleeping against spinning pool threads on a CPU graph's first runs."""

from __future__ import annotations

import contextlib
import statistics
import threading

import onnxruntime as ort
import torch

from .._copying import NotCopyable

# A graph whose largest tensor has fewer elements runs on one thread: waking a sleeping thread of
# ORT's pool for each small operator (tens of us) costs more than splitting the operator saves
# (benchmarks/train_step.py --ort-threads 1: the small block's step went from 1.52x eager to 1.00x).
SMALL_GRAPH_ELEMENTS = 1 << 16


def default_session_options(largest_tensor: int | None = None, spinning: bool = False) -> ort.SessionOptions:
    """As many threads as torch uses (one for a graph whose largest tensor has fewer than
    SMALL_GRAPH_ELEMENTS elements), which sleep between runs: torch runs in between (the
    Functions, the optimizer, the rest of the step), and ORT's default spinning threads would
    take its cores. `spinning`: they spin while a run lasts instead (see SpinningTrial)."""
    options = ort.SessionOptions()
    small = largest_tensor is not None and largest_tensor < SMALL_GRAPH_ELEMENTS
    options.intra_op_num_threads = 1 if small else torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


class SpinningTrial(NotCopyable):
    """ORT's pool threads either sleep between runs, waking for each parallel operator (tens of
    us each), or spin while a run lasts, with torch on one thread inside it (torch's work in
    Functions and fallback nodes would otherwise share its cores with them: steps several times
    slower). Which is faster depends on the graph: spinning made vit_tiny's step 1.52 -> 1.32x
    eager's and a mobilenetv3's 1.26 -> 1.11x, but the larger CNN's, whose convolutions'
    backward runs in torch, 1.34 -> 2.17x. So a CPU graph with several threads has a second,
    spinning session at first; its runs alternate between the two (the first of each not
    counted) until each has RUNS timed runs, then the faster by median stays (sleeping unless
    spinning is 5% faster) and the other session is dropped."""

    RUNS = 5

    def __init__(self, session):
        self.session = session  # the spinning one
        self.bindings: list = []  # (session.py's bindings of it)
        self.times: dict[bool, list] = {False: [], True: []}
        self.started = 0

    def next_spinning(self) -> bool:
        self.started += 1
        return self.started % 2 == 0

    def record(self, spinning: bool, seconds: float) -> bool:
        """Counts a run; True once the trial is decided."""
        self.times[spinning].append(seconds)
        return all(len(t) > self.RUNS for t in self.times.values())

    def spinning_wins(self) -> bool:
        sleeping, spinning = (statistics.median(self.times[k][1:]) for k in (False, True))
        return spinning < 0.95 * sleeping


_threads = threading.local()  # depth: runs open on this thread that keep torch on one thread


@contextlib.contextmanager
def one_torch_thread():
    """Torch on one thread on this thread while a spinning session's run lasts. The setting is
    OpenMP's, per thread; the outermost run restores it."""
    depth = getattr(_threads, "depth", 0)
    if depth == 0:
        _threads.previous = torch.get_num_threads()
        torch.set_num_threads(1)
    _threads.depth = depth + 1
    try:
        yield
    finally:
        _threads.depth = depth
        if depth == 0:
            torch.set_num_threads(_threads.previous)
