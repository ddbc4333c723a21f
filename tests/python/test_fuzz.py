"""A fixed-seed run of the graph fuzzer (tests/fuzz): 2000 malformed PythonOp/PythonOpGrad models,
in child processes, each refused with an error naming the node (and the attribute), or run; none
may crash, hang, leak an autograd context or import a module. (Session creation times are in the
campaign's summary, not asserted here: speed goals live in benchmarks.)

scripts/fuzz.sh runs the same campaign at length with a random seed."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 20251201
CASES = 2000


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz")
    cmd = [
        sys.executable,
        "-m",
        "tests.fuzz.campaign",
        "--seed",
        str(SEED),
        "--cases",
        str(CASES),
        "--batch",
        "500",
        "--jobs",
        "2",
        "--timeout",
        "10",
        "--max-rss-mb",
        "3000",
        "--out",
        str(out),
        "--quiet",
    ]
    # (a crash or hang costs its batch a restart; the limit is for a campaign gone wrong altogether)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    path = out / "summary.json"
    assert path.exists(), f"the campaign did not finish (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    with open(path) as f:
        s = json.load(f)
    s["report"] = done.stdout  # the printed summary: classes with a saved example each
    return s


def _examples(s, *classes):
    return "\n".join(
        f"  {c['class']} [{c['kinds']}] x{c['cases']}: {c['saved'] or c['example']} "
        f"({'; '.join(c['mutations'] or [])[:160]})"
        for c in s["classes"]
        if c["class"] in classes
    )


def test_no_case_crashes_hangs_or_runs_out_of_memory(summary):
    bad = {k: summary[k] for k in ("crashes", "hangs", "memory", "exit_failures") if summary[k]}
    assert not bad, f"{bad}\n{_examples(summary, 'crash', 'hang', 'memory')}\n\n{summary['report']}"


def test_no_case_leaks_contexts_or_imports_modules(summary):
    bad = {k: summary[k] for k in ("leaks", "imports") if summary[k]}
    assert not bad, f"{bad}\n{_examples(summary, 'leak', 'import')}"


def test_intact_bases_run(summary):
    # (and the generator itself did not fail: a case it could not build tests nothing)
    assert summary["bases_failed"] == 0 and summary["generator_errors"] == 0, summary["bases_failed_examples"]


# (ONNX Runtime's own graph checks run before any ortbridge code: a dangling input, a duplicate name
# or an unknown opset version is refused in ORT's words, which name no node. The summary counts those
# apart; what ortbridge writes must name the node, and for a one-attribute mistake the attribute.)


def test_every_refusal_ortbridge_writes_names_the_node(summary):
    missing = [r for r in summary["refusals_not_naming_node"] if "ortbridge PythonOp" in r["message"]]
    assert summary["ortbridge_refusals_naming_node_pct"] == 100.0, "\n".join(
        [
            f"{summary['ortbridge_refusals_naming_node_pct']}% of ortbridge's refusals name the node "
            f"({summary['refusals_naming_node_pct']}% of all; {summary['refusals_by_onnxruntime']} came from "
            "ONNX Runtime's own checks); distinct ones that do not:"
        ]
        + [f"  [{r['index']} {','.join(r['kinds'])}] {r['message'][:300]!r}" for r in missing]
    )


def test_single_attribute_refusals_name_the_attribute(summary):
    missing = summary["refusals_not_naming_attribute"]
    assert summary["ortbridge_single_attribute_refusals_naming_attribute_pct"] >= 99.0, "\n".join(
        [
            f"{summary['ortbridge_single_attribute_refusals_naming_attribute_pct']}% of ortbridge's name the "
            f"attribute ({summary['single_attribute_refusals_naming_attribute_pct']}% of all); distinct ones that "
            "do not:"
        ]
        + [f"  [{r['index']} {','.join(r['kinds'])}] {r['message'][:300]!r}" for r in missing]
    )
