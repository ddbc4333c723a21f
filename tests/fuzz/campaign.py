"""A fuzz campaign: cases [start, start+cases) of one seed, run in child processes (worker.py).

    python -m tests.fuzz.campaign --seed S --cases N --batch B --out DIR [--timeout T] [--jobs J]

Each batch runs in a child whose stderr goes to DIR/logs/. When a child dies (a signal, a nonzero
exit, one case running longer than --timeout seconds, memory beyond --max-rss-mb, or 'Sanitizer'
in its stderr), the case it was running (from its progress file) is saved as
DIR/<class>-<seed>-<index>.onnx with a .json holding its description, the sanitizer or fatal-error
report and the child's stderr tail, and the batch goes on from the next case in a new child.
Cases that leak contexts, import modules, or take over a second to create a session are saved
the same way (a few per mutation kinds). Cases are deterministic: `--start I --cases 1` replays one.

At the end it prints a summary (also DIR/summary.json; every case's result is in
DIR/results.jsonl) and exits 1 if any case crashed, hung, ran out of memory, leaked autograd
contexts or imported a module, or a child failed at exit.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_S = 180  # importing torch in a child, with the warm-up (slower under a sanitizer)
SLOW_CREATE_S = 1.0  # a session creation slower than this is a finding
SAVE_PER_CLASS = 5  # saved examples per (finding, mutation kinds), so that long runs stay small
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Child:
    start: int
    end: int
    proc: subprocess.Popen
    progress: str
    results: str
    stderr: str
    started: float = field(default_factory=time.monotonic)
    current: str = ""  # the progress file's last content
    since: float = field(default_factory=time.monotonic)
    killed: str | None = None  # why the parent killed it: hang / memory


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _tail(path: str, chars: int = 6000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


_REPORT_MARKERS = (
    "ERROR: AddressSanitizer",
    "ERROR: LeakSanitizer",
    "runtime error:",
    "terminate called",
    "Fatal Python error",
)


def crash_report(path: str):
    """(signature, excerpt) of the first sanitizer or fatal-error report in a child's stderr: the
    signature is the kind of error and the first ortbridge frames, to tell crash classes apart."""
    text = _tail(path, 4_000_000)
    for marker in _REPORT_MARKERS:
        i = text.find(marker)
        if i < 0:
            continue
        lines = text[text.rfind("\n", 0, i) + 1 :].splitlines()[:60]
        kind = re.sub(r"^==\d+==| (on|at) (unknown )?address.*| trying to allocate.*", "", lines[0]).strip()
        frames = []
        for line in lines:  # "#5 0x7f.. in FUNCTION(ARGS) /path/file.cc:89" in the ortbridge sources
            m = re.match(r"\s*#\d+ 0x[0-9a-f]+ in (.*) (\S+?):(\d+)(:\d+)?$", line)
            if m and ("ortbridge" in m.group(1) or "csrc" in m.group(2)):
                frames.append(f"{m.group(1).split('(')[0]} {os.path.basename(m.group(2))}:{m.group(3)}")
        if not frames:  # faulthandler: the innermost Python frame
            frames = [line.strip() for line in lines if line.strip().startswith("File ")][:1]
        return (kind[:120] + (" | " + " < ".join(frames[:2]) if frames else ""))[:300], "\n".join(lines)
    return None, None


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


class Campaign:
    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.results_path = os.path.join(self.out, "results.jsonl")
        open(self.results_path, "w").close()
        self.records: list[dict] = []
        self.findings: list[dict] = []  # crashes, hangs, memory, exit-time sanitizer reports
        self.saved = collections.Counter()
        self.children = 0

    # --- children

    def spawn(self, start: int, end: int) -> Child:
        self.children += 1
        tag = f"{start}-{self.children}"
        progress = os.path.join(self.logs, f"progress-{tag}.txt")
        results = os.path.join(self.logs, f"results-{tag}.jsonl")
        stderr = os.path.join(self.logs, f"stderr-{tag}.txt")
        for path in (progress, results):
            open(path, "w").close()
        cmd = [
            sys.executable,
            "-m",
            "tests.fuzz.worker",
            "--seed",
            str(self.args.seed),
            "--start",
            str(start),
            "--count",
            str(end - start),
            "--progress",
            progress,
            "--results",
            results,
        ]
        if self.args.arena:
            cmd.append("--arena")
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else ROOT
        with open(stderr, "wb") as err:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True
            )
        return Child(start, end, proc, progress, results, stderr)

    def watch(self, child: Child) -> None:
        """Kills a child whose case runs too long or whose memory grows too large."""
        now = time.monotonic()
        current = _read(child.progress)
        if current != child.current:
            child.current, child.since = current, now
        if current.isdigit():
            if now - child.since > self.args.timeout:
                self.kill(child, "hang")
        elif current != "done" and now - child.started > STARTUP_S:  # stuck importing or warming up
            self.kill(child, "hang")
        if child.killed is None and _rss_mb(child.proc.pid) > self.args.max_rss_mb:
            self.kill(child, "memory")

    def kill(self, child: Child, why: str) -> None:
        child.killed = why
        try:
            # SIGABRT first: faulthandler prints where the child is stuck, into its stderr.
            os.killpg(child.proc.pid, signal.SIGABRT)
            try:
                child.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
        except ProcessLookupError:
            pass

    def finish(self, child: Child):
        """Collects a child that ended; returns the range still to run, or None."""
        for line in _read(child.results).splitlines():
            self.add_record(json.loads(line))
        os.remove(child.results)  # (merged into DIR/results.jsonl)
        rc = child.proc.returncode
        stderr_tail = _tail(child.stderr)
        sanitizer = "Sanitizer" in _tail(child.stderr, 200000)
        state = _read(child.progress)
        if state == "done" and rc == 0 and not sanitizer and not child.killed:
            return None
        if not state.isdigit():
            if state == "done":  # all cases ran, then the process failed (at exit, or a sanitizer report)
                self.findings.append(
                    {"class": "exit", "range": [child.start, child.end], "returncode": rc, "stderr_tail": stderr_tail}
                )
                return None
            why = f"exit {rc}" + (f", killed: {child.killed}" if child.killed else "")
            sys.exit(f"fuzz worker failed before its first case ({why}); its stderr:\n{stderr_tail}")
        index = int(state)
        kind = child.killed or "crash"
        record = {
            "index": index,
            "outcome": kind,
            "returncode": rc,
            "signal": signal.Signals(-rc).name if rc is not None and rc < 0 and -rc in signal.valid_signals() else None,
            "sanitizer": sanitizer,
        }
        record["signature"], report = crash_report(child.stderr)
        if child.killed:  # (the report is then faulthandler's, from the campaign's SIGABRT)
            frame = (record["signature"] or "").split(" | ")[-1]
            record["signature"] = f"killed by the campaign: {child.killed} | {frame}"
        self.save(kind, index, record, stderr_tail, report)
        self.findings.append(record)
        self.add_record(record)
        return (index + 1, child.end) if index + 1 < child.end else None

    # --- results

    def add_record(self, record: dict) -> None:
        if "kinds" not in record:  # a case that killed its child: describe it from the generator
            from .graphs import make_case

            desc = make_case(self.args.seed, record["index"])[2]
            record.update(
                base=desc["base"],
                kinds=desc["kinds"],
                mutations=[f"{m['kind']} {m['attribute'] or '-'} {m['detail']}"[:100] for m in desc["mutations"]],
            )
        self.records.append(record)
        with open(self.results_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for finding, hit in (
            ("leak", record.get("leaked", 0) > 0),
            ("import", bool(record.get("imports"))),
            ("slow", record.get("create_s", 0) > SLOW_CREATE_S),
            ("anomaly", bool(record.get("anomalies"))),
        ):
            if hit:
                self.save(finding, record["index"], record)

    def save(
        self, kind: str, index: int, record: dict, stderr_tail: str | None = None, report: str | None = None
    ) -> None:
        from .graphs import make_case

        model, _, description = make_case(self.args.seed, index)
        key = (kind, tuple(description["kinds"]))
        self.saved[key] += 1
        if self.saved[key] > SAVE_PER_CLASS and kind not in ("crash", "hang", "memory"):
            return
        stem = os.path.join(self.out, f"{kind}-{self.args.seed}-{index}")
        with open(stem + ".onnx", "wb") as f:
            f.write(model)
        info = {"class": kind, "result": record, "description": description}
        if report:
            info["report"] = report
        if stderr_tail is not None:
            info["stderr_tail"] = stderr_tail
        with open(stem + ".json", "w") as f:
            json.dump(info, f, indent=1)
        record["saved"] = os.path.relpath(stem + ".onnx")

    # --- the run

    def run(self) -> dict:
        a = self.args
        pending = [(s, min(s + a.batch, a.start + a.cases)) for s in range(a.start, a.start + a.cases, a.batch)]
        running: list[Child] = []
        t0 = time.monotonic()
        while pending or running:
            while pending and len(running) < a.jobs:
                running.append(self.spawn(*pending.pop(0)))
            time.sleep(0.1)
            for child in list(running):
                if child.proc.poll() is None:
                    self.watch(child)
                    continue
                running.remove(child)
                rest = self.finish(child)
                if rest is not None:
                    pending.insert(0, rest)
                if not a.quiet:
                    print(
                        f"[fuzz] {len(self.records)}/{a.cases} cases, {len(self.findings)} crashes/hangs, "
                        f"{time.monotonic() - t0:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
        summary = summarize(self.records, self.findings, a.seed)
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        return summary


def _shape_of(message: str) -> str:
    """A message with its numbers, quoted names and tracebacks blurred, to group alike ones."""
    text = message.split("Traceback")[0]
    text = re.sub(r"'[^']*'", "'_'", text)
    text = re.sub(r"\([^()]*\)", "(_)", text)
    return re.sub(r"-?\d+", "N", text)[:160]


def from_ortbridge(message: str) -> bool:
    """Whether an error comes from ortbridge's kernels (or from ONNX Runtime's own graph checks)."""
    return re.search(r"ortbridge PythonOp(Grad)? ", message or "") is not None


def summarize(records: list[dict], findings: list[dict], seed: int) -> dict:
    count = collections.Counter(r["outcome"] for r in records)
    refused = [r for r in records if r["outcome"] == "refused"]
    with_node = [r for r in refused if r.get("names_node") is not None]
    with_attr = [r for r in refused if r.get("names_attr") is not None]
    run_failed = [r for r in records if r["outcome"] == "run_failed" and r.get("names_node") is not None]
    leaks = [r for r in records if r.get("leaked", 0) > 0]
    imports = [r for r in records if r.get("imports")]
    bases_failed = [r for r in records if r.get("kinds") == [] and r["outcome"] not in ("ok", "generator_error")]
    created = [r for r in records if "create_s" in r]
    slowest = max(created, key=lambda r: r["create_s"], default=None)
    biggest = max(created, key=lambda r: r["rss_mb"], default=None)

    def pct(part, whole):
        return round(100.0 * len(part) / len(whole), 2) if whole else 100.0

    classes = collections.defaultdict(list)
    for r in records:
        for cls, hit in (
            ("crash", r["outcome"] == "crash"),
            ("hang", r["outcome"] == "hang"),
            ("memory", r["outcome"] == "memory"),
            ("leak", r.get("leaked", 0) > 0),
            ("import", bool(r.get("imports"))),
            ("slow", r.get("create_s", 0) > SLOW_CREATE_S),
            ("anomaly", bool(r.get("anomalies"))),
        ):
            if hit:  # a crash is told apart by where it happened, the rest by what was mutated
                key = r.get("signature") if cls in ("crash", "hang", "memory") and r.get("signature") else None
                classes[(cls, key or ",".join(r.get("kinds", [])) or "-")].append(r)

    def unnamed(rs, key):
        groups = collections.OrderedDict()
        for r in rs:
            if r.get(key) is False:
                groups.setdefault(_shape_of(r["message"] or ""), r)
        return [
            {"index": r["index"], "kinds": r.get("kinds"), "message": (r["message"] or "")[:600]}
            for r in list(groups.values())[:25]
        ]

    return {
        "seed": seed,
        "cases": len(records),
        "ok": count["ok"],
        "refusals": count["refused"],
        "run_failures": count["run_failed"],
        "crashes": count["crash"],
        "hangs": count["hang"],
        "memory": count["memory"],
        "leaks": len(leaks),
        "imports": len(imports),
        "exit_failures": sum(1 for f in findings if f.get("class") == "exit"),
        "bases_failed": len(bases_failed),
        "generator_errors": count["generator_error"],
        "refusals_naming_node_pct": pct([r for r in with_node if r["names_node"]], with_node),
        "single_attribute_refusals_naming_attribute_pct": pct([r for r in with_attr if r["names_attr"]], with_attr),
        "run_failures_naming_node_pct": pct([r for r in run_failed if r["names_node"]], run_failed),
        # the same two figures over the refusals ortbridge wrote (the rest are ONNX Runtime's)
        "ortbridge_refusals_naming_node_pct": pct(
            [r for r in with_node if r["names_node"] and from_ortbridge(r["message"])],
            [r for r in with_node if from_ortbridge(r["message"])],
        ),
        "ortbridge_single_attribute_refusals_naming_attribute_pct": pct(
            [r for r in with_attr if r["names_attr"] and from_ortbridge(r["message"])],
            [r for r in with_attr if from_ortbridge(r["message"])],
        ),
        "refusals_by_onnxruntime": sum(1 for r in refused if not from_ortbridge(r["message"])),
        "slowest_create_s": slowest and slowest["create_s"],
        "slowest_create_index": slowest and slowest["index"],
        "largest_rss_mb": biggest and biggest["rss_mb"],
        "largest_rss_index": biggest and biggest["index"],
        "slow_creates": sum(1 for r in created if r["create_s"] > SLOW_CREATE_S),
        "classes": [
            {
                "class": cls,
                "kinds": ",".join(rs[0].get("kinds", [])),
                "signature": rs[0].get("signature"),
                "cases": len(rs),
                "example": rs[0]["index"],
                "saved": next((r["saved"] for r in rs if r.get("saved")), None),
                "mutations": rs[0].get("mutations"),
                "signal": rs[0].get("signal"),
                "message": (rs[0].get("message") or "")[:300] or None,
                "imports": rs[0].get("imports") or None,
            }
            for (cls, _), rs in sorted(classes.items(), key=lambda kv: (kv[0][0], -len(kv[1])))
        ],
        "refusals_not_naming_node": unnamed(with_node, "names_node"),
        "refusals_not_naming_attribute": unnamed(with_attr, "names_attr"),
        "run_failures_not_naming_node": unnamed(run_failed, "names_node"),
        "bases_failed_examples": [
            {"index": r["index"], "message": (r.get("message") or "")[:300]} for r in bases_failed[:5]
        ],
    }


def print_summary(s: dict, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"fuzz seed {s['seed']}: {s['cases']} cases in {s.get('wall_s', '?')} s")
    p(f"  ok {s['ok']}, refused at creation {s['refusals']}, failed at run {s['run_failures']}")
    p(
        f"  crashes {s['crashes']}, hangs {s['hangs']}, out of memory {s['memory']}, leaks {s['leaks']}, "
        f"imports {s['imports']}, failures at exit {s['exit_failures']}, intact bases failing {s['bases_failed']}, "
        f"generator errors {s['generator_errors']}"
    )
    p(f"  refusals naming the node: {s['refusals_naming_node_pct']}%")
    p(f"  single-attribute refusals naming the attribute: {s['single_attribute_refusals_naming_attribute_pct']}%")
    p(f"  run failures naming the node: {s['run_failures_naming_node_pct']}%")
    p(
        f"  of the refusals ortbridge wrote: {s['ortbridge_refusals_naming_node_pct']}% name the node, "
        f"{s['ortbridge_single_attribute_refusals_naming_attribute_pct']}% of single-attribute ones the attribute "
        f"({s['refusals_by_onnxruntime']} refusals came from ONNX Runtime's own checks)"
    )
    p(
        f"  slowest session creation: {s['slowest_create_s']} s (case {s['slowest_create_index']}), "
        f"{s['slow_creates']} over {SLOW_CREATE_S} s"
    )
    p(f"  largest RSS growth: {s['largest_rss_mb']} MB (case {s['largest_rss_index']})")
    if s["classes"]:
        p("  findings (class, mutation kinds, cases, example):")
        for c in s["classes"]:
            p(f"    {c['class']:8} {c['kinds']:40} {c['cases']:5}  {c['saved'] or c['example']}")
            p(f"             {'; '.join(c['mutations'] or [])[:200]}{'  ' + c['signal'] if c['signal'] else ''}")
            if c["signature"]:
                p(f"             {c['signature'][:200]}")
    for key, title in (
        ("refusals_not_naming_node", "refusals not naming the node"),
        ("refusals_not_naming_attribute", "refusals not naming the attribute"),
        ("run_failures_not_naming_node", "run failures not naming the node"),
    ):
        if s[key]:
            p(f"  {title} (distinct, up to 25):")
            for r in s[key]:
                p(f"    [{r['index']} {','.join(r['kinds'] or [])}] {r['message'][:300]!r}")


def failed(s: dict) -> bool:
    return any(s[k] for k in ("crashes", "hangs", "memory", "leaks", "imports", "exit_failures"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--cases", type=int, required=True)
    p.add_argument("--start", type=int, default=0, help="first case index")
    p.add_argument("--batch", type=int, default=500, help="cases per child process")
    p.add_argument("--out", required=True, help="folder for results and saved cases")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds one case may run before it counts as a hang")
    p.add_argument("--max-rss-mb", type=float, default=4096.0, help="child memory that counts as running out")
    p.add_argument("--jobs", type=int, default=1, help="children run at once")
    p.add_argument("--arena", action="store_true", help="keep ORT's CPU memory arena in the children")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.cases < 1 or args.batch < 1 or args.jobs < 1:
        p.error("--cases, --batch and --jobs must be positive")
    summary = Campaign(args).run()
    print_summary(summary)
    return 1 if failed(summary) else 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run by path
        sys.path.insert(0, ROOT)
        import tests.fuzz  # noqa: F401

        __package__ = "tests.fuzz"
    sys.exit(main())
