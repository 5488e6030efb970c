"""The rule files in rules/ check clean and are in canonical form."""

from pathlib import Path

import pytest

from remapdsl import load_rules
from remapdsl.language import format_rules, parse_file

RULES = sorted((Path(__file__).resolve().parent.parent / "rules").glob("*.remap"))


def test_the_required_models_are_shipped():
    names = {p.stem for p in RULES}
    assert {"llama", "qwen3_moe", "mixtral"} <= names


@pytest.mark.parametrize("path", RULES, ids=lambda p: p.name)
def test_shipped_rules_check_clean(path):
    rules = load_rules(path)
    assert rules.statements


@pytest.mark.parametrize("path", RULES, ids=lambda p: p.name)
def test_shipped_rules_are_formatted(path):
    parsed = parse_file(path)
    assert format_rules(parsed) == parsed.source
