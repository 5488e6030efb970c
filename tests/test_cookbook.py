"""docs/cookbook.md stays true: each `python` block runs as printed (in a fresh process, offline, on
the tiny checkpoint it builds itself) and prints what the page says; a rule file a block writes is
the `remap` block the page shows; every shipped family has a section, and the index links to them.
(The `remap` blocks that name a shipped file are held to it by tests/test_families.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from doc_blocks import ran, run_block

import remapdsl

REPO = Path(__file__).resolve().parents[1]
PAGE = (REPO / "docs" / "cookbook.md").read_text()
# Covered by other pages: torchtitan.md has the torchtitan layouts; identity keeps every name.
ELSEWHERE = {"identity", "torchtitan_llama3", "torchtitan_qwen3", "torchtitan_deepseek_v3"}


def python_blocks() -> list[tuple[str, str]]:
    """Each ```python block and the ```text block that follows it after an "It prints:" line."""
    found = re.findall(r"```python\n(.*?)```\n(?:\nIt prints:\n\n```text\n(.*?)```)?", PAGE, re.DOTALL)
    assert found, "the cookbook has no python block"
    return found


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation but `-` and `_` gone, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("number", [
    pytest.param(n, marks=pytest.mark.distributed) if "init_process_group" in code else n  # starts gloo ranks
    for n, (code, _) in enumerate(python_blocks())])
def test_each_python_block_runs_as_printed(tmp_path, number):
    pytest.importorskip("transformers")
    code, printed = python_blocks()[number]
    run = run_block(code, tmp_path, f"cookbook_{number}")
    assert ran(run, printed), run.stderr[-4000:]
    assert printed, "a python block must be followed by what it prints"
    assert run.stdout == printed


def test_a_rule_file_a_block_writes_is_the_remap_block_shown():
    """`RULES = \"\"\"...\"\"\"` in a python block is, character for character, a `remap` block of the page."""
    shown = re.findall(r"```remap\n(.*?)```", PAGE, re.DOTALL)
    written = [
        r for code, _ in python_blocks() for r in re.findall(r'RULES = """\\\n(.*?)"""', code, re.DOTALL)
    ]
    assert written
    for rules in written:
        assert rules in shown


def test_every_shipped_family_has_a_section():
    headings = re.findall(r"^## (.*)$", PAGE, re.MULTILINE)
    named = {name for h in headings for name in re.findall(r"`(\w+)`", h)}
    shipped = {entry.name for entry in remapdsl.shipped_rules()}
    assert sorted(shipped - ELSEWHERE - named) == []
    assert sorted(named - shipped) == []


def test_the_index_links_to_the_sections():
    anchors = {anchor(h) for h in re.findall(r"^#{2,3} (.*)$", PAGE, re.MULTILINE)}
    links = re.findall(r"\]\(#([\w\-]+)\)", PAGE)
    assert len(links) >= 16
    assert sorted(set(links) - anchors) == []
