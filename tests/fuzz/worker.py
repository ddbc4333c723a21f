"""Runs fuzz cases [start, start+count) of one seed in this process; started by campaign.py.

    python -m tests.fuzz.worker --seed S --start A --count N --progress FILE --results FILE

Before each case it writes the case index to the progress file, so that when this process dies
the parent knows which case killed it. One JSON line per case goes to the results file:

  outcome       ok | refused (at session creation) | run_failed | generator_error (a fuzzer bug)
  create_s      seconds session creation took; rss_mb its memory growth (peak or resident)
  names_node    whether the error names a node the mutations touched (None: no such node)
  names_attr    whether it names the attribute (or one checked against it); None unless every
                mutation targets exactly one attribute
  leaked        autograd contexts left in the pool after both runs
  imports       modules the case made Python import (a model must never import anything)
  anomalies     other oddities: outputs that differ between the two runs, feeds written into
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import re
import resource
import sys
import time
import traceback

if __package__ in (None, ""):  # run by path: import the package this file belongs to
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import tests.fuzz  # noqa: F401

    __package__ = "tests.fuzz"

import numpy as np

MESSAGE_CHARS = 800  # what the results keep of an error message (the checks see all of it)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def names_attribute(message: str, accepted) -> bool:
    # Whole words only: input_float_scalars must not match inside input_float_scalars_f64.
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(a)}(?![A-Za-z0-9_])", message) for a in accepted)


def names_node(message: str, nodes) -> bool:
    return any(n and n in message for n in nodes)


def _message(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception as inner:  # (a message that cannot even be rendered is a finding too)
        text = f"<unprintable {type(e).__name__}: {inner!r}>"
    return f"{type(e).__name__}: {text}"


def _same(a, b) -> bool:
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        return True  # (sequences and maps: not produced by these graphs)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "fc":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


class Runner:
    def __init__(self, arena: bool):
        import onnxruntime as ort
        import torch

        import ortbridge

        from . import functions  # noqa: F401  (registers the fuzz.* Functions)

        torch.set_num_threads(1)
        # Which build runs (the sanitized one under scripts/with_sanitizers.sh), for the stderr log.
        print(f"fuzz worker: ortbridge._C from {ortbridge._C.__file__}", file=sys.stderr, flush=True)
        self.ort, self.ortbridge = ort, ortbridge
        self.arena = arena

    def options(self):
        opts = self.ort.SessionOptions()
        # Without ORT's arena every tensor is its own heap block, so that an out-of-bounds write
        # reaches the allocator's (or AddressSanitizer's) checks instead of a neighbour in the arena.
        opts.enable_cpu_mem_arena = self.arena
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        opts.log_severity_level = 4  # malformed models make ORT log warnings by the thousand
        return opts

    def run_case(self, model: bytes, feeds: dict, desc: dict) -> dict:
        ortbridge = self.ortbridge
        result = {
            "index": desc["index"],
            "base": desc["base"],
            "kinds": desc["kinds"],
            "mutations": [f"{m['kind']} {m['attribute'] or '-'} {m['detail']}"[:100] for m in desc["mutations"]],
            "outcome": "ok",
            "create_s": 0.0,
            "run_s": 0.0,
            "rss_mb": 0.0,
            "message": None,
            "names_node": None,
            "names_attr": None,
            "leaked": 0,
            "imports": [],
            "anomalies": [],
        }
        pool_before = ortbridge.context_pool_size()
        modules_before = set(sys.modules)
        rss0, peak0 = rss_bytes(), peak_bytes()
        t0 = time.perf_counter()
        session, error = None, None
        try:
            session = ortbridge.InferenceSession(model, self.options(), providers=["CPUExecutionProvider"])
        except Exception as e:
            error = e
        result["create_s"] = round(time.perf_counter() - t0, 4)
        growth = max(rss_bytes() - rss0, peak_bytes() - peak0)
        result["rss_mb"] = round(growth / 2**20, 1)
        if error is not None:
            result["outcome"] = "refused"
        else:
            t1 = time.perf_counter()
            error = self._run_twice(session, feeds, desc, result)
            result["run_s"] = round(time.perf_counter() - t1, 4)
            if error is not None:
                result["outcome"] = "run_failed"
        result["leaked"] = ortbridge.context_pool_size() - pool_before
        del session
        gc.collect(0)  # (a full collection costs ~0.2 s with torch loaded; sessions die by refcount)
        result["leaked_after_close"] = ortbridge.context_pool_size() - pool_before
        result["imports"] = sorted(set(sys.modules) - modules_before)[:20]
        if error is not None:
            message = _message(error)
            result["message"] = message[:MESSAGE_CHARS]
            if desc["nodes"]:
                result["names_node"] = names_node(message, desc["nodes"])
            if desc["accepted"] is not None:
                result["names_attr"] = names_attribute(message, desc["accepted"])
        return result

    def _run_twice(self, session, feeds, desc, result):
        """Runs the feeds twice; returns the first error (both runs are tried: a failed run must
        leave the session usable)."""
        first_error, outputs = None, []
        names = [o.name for o in session.get_outputs()]
        owned = set(desc["context_outputs"])
        for _ in range(2):
            copies = {k: v.copy() for k, v in feeds.items()}
            try:
                values = session.run(None, copies)
            except Exception as e:
                first_error = first_error or e
                continue
            for name, v in zip(names, values):
                if name in owned and isinstance(v, np.ndarray) and v.dtype == np.int64 and v.size == 1:
                    self.ortbridge.release_context(int(v.reshape(())))  # the caller's context
            outputs.append([v for name, v in zip(names, values) if name not in owned])
            if any(not _same(copies[k], feeds[k]) for k in feeds):
                result["anomalies"].append("feed_modified")
        if len(outputs) == 2 and not all(_same(a, b) for a, b in zip(*outputs)):
            result["anomalies"].append("outputs_differ")
        return first_error


def _write_progress(path: str, text: str) -> None:
    # Replaced whole, so that the parent never reads it half written.
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--start", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--results", required=True)
    p.add_argument("--arena", action="store_true", help="keep ORT's CPU memory arena (off by default)")
    args = p.parse_args(argv)
    faulthandler.enable()  # a crash prints the Python stack into stderr, which the parent keeps

    from .graphs import BASES, make_base, make_case

    runner = Runner(args.arena)
    # Warm-up on the intact bases, so that lazy imports of torch and ortbridge happen here and
    # not inside the first cases (where they would read as imports made by the model).
    for name in BASES:
        for seed in range(3):
            runner.run_case(*make_base(name, seed))
    _write_progress(args.progress, "ready\n")
    with open(args.results, "a") as results:
        for index in range(args.start, args.start + args.count):
            _write_progress(args.progress, f"{index}\n")
            try:
                model, feeds, desc = make_case(args.seed, index)
            except Exception as e:  # a bug of the fuzzer, not of ortbridge: recorded, not a crash
                record = {
                    "index": index,
                    "outcome": "generator_error",
                    "kinds": [],
                    "base": None,
                    "message": "".join(traceback.format_exception(e))[-MESSAGE_CHARS:],
                }
            else:
                record = runner.run_case(model, feeds, desc)
            results.write(json.dumps(record) + "\n")
            results.flush()
    _write_progress(args.progress, "done\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
