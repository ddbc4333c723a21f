"""Every example in the README and the docs runs: each page's ```python blocks in order, in one
namespace (a page's later blocks use what its earlier ones made), in a folder of their own. A block
that cannot run here is marked `<!-- not run: <what it needs> -->` on the line before it."""

from __future__ import annotations

import pathlib
import re

import pytest

import ortbridge

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^(?:<!-- not run: (?P<why>[^\n]*?) -->\n)?```python\n(?P<code>.*?)^```", re.S | re.M)


def _blocks(page: pathlib.Path) -> list:
    text = page.read_text()
    return [(text.count("\n", 0, m.start("code")) + 1, m["code"], m["why"]) for m in BLOCK.finditer(text)]


@pytest.mark.parametrize("page", [p for p in PAGES if any(why is None for *_, why in _blocks(p))], ids=lambda p: p.name)
def test_the_examples_of_a_page_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page.stem.lower()}"}  # (the Functions it registers are named after it)
    before = set(ortbridge.registered_names())
    try:
        for line, code, why in _blocks(page):
            if why is None:
                # (line numbers of the page in tracebacks)
                exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
    finally:
        for name in set(ortbridge.registered_names()) - before:
            ortbridge.unregister(name)


def test_each_example_not_run_says_what_it_needs():
    for page in PAGES:
        for line, _, why in _blocks(page):
            assert why is None or why.strip(), f"{page.name}:{line}: `not run` without a reason"
