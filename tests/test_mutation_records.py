"""The mutation-testing records name tests that exist: every test mutation/killed.txt says kills a
mutant, and every file and deselected test of mutation/core-tests.txt (the core run's selection),
so that moving or renaming a test cannot leave them pointing at nothing. Read with `ast`, no import."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if "__mutmut_orig" in (ROOT / "remapdsl" / "indexmap.py").read_text(encoding="utf-8"):
    pytest.skip("mutation/run's copy, where mutmut rewrote the modules: the records are not copied there",
                allow_module_level=True)
NODE = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")


@functools.cache
def _tests(path: Path) -> set[str]:
    """The names of the test functions at the top of a test file."""
    return {n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def _missing(text: str) -> list[str]:
    missing = []
    for match in NODE.finditer(text):
        path, name = ROOT / match.group(1), match.group(2)
        if not path.is_file() or (name and name not in _tests(path)):
            missing.append(match.group(0))
    return missing


def test_every_test_killed_txt_names_exists():
    text = (ROOT / "mutation" / "killed.txt").read_text()
    assert len(NODE.findall(text)) > 100
    assert _missing(text) == []


def test_every_file_and_test_the_core_selection_names_exists():
    text = (ROOT / "mutation" / "core-tests.txt").read_text()
    assert "--deselect=" in text and len(NODE.findall(text)) > 20
    assert _missing(text) == []
