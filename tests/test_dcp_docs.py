"""docs/dcp.md stays true: its ```python blocks run, in order and in one namespace, on every rank of
a 2-rank gloo group from the repository root; a block followed by a ```text block must print
exactly that text on each rank."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from remapdsl.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "dcp.md"


def blocks() -> list[tuple[str, str | None]]:
    """Each ```python block of the document, with the ```text block right after it, if any."""
    found = re.findall(r"```python\n(.*?)```\n(?:\n```text\n(.*?)```)?", DOC.read_text(), re.DOTALL)
    return [(code, shown or None) for code, shown in found]


def _run_blocks(rank: int, world: int, root: str, examples: list) -> list[str]:
    import warnings

    os.chdir(root)
    warnings.simplefilter("ignore")  # DCP's notices about the process group
    namespace: dict = {"__name__": "__dcp_doc__"}
    printed = []
    for number, (code, _) in enumerate(examples):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"docs/dcp.md python block {number}", "exec"), namespace)  # noqa: S102 - the doc, run as printed
        printed.append(out.getvalue())
    return printed


@pytest.mark.distributed
def test_the_examples_run_on_two_ranks_and_print_what_is_shown():
    examples = blocks()
    assert len(examples) >= 3
    for printed in run_ranks(_run_blocks, 2, str(ROOT), examples):
        for (_, shown), out in zip(examples, printed):
            if shown is not None:
                assert out == shown


def test_the_document_keeps_the_sections_others_fill():
    text = DOC.read_text()
    assert "\n## torchtitan\n" in text and "\n## Consolidating a DCP-sharded checkpoint\n" in text
