"""pytest plugin for mutmut's stats step (PYTEST_PLUGINS=mutation_hits, set by mutation/run): before
mutmut records which package functions a test reached, add those its spawned processes reached
(written by sitecustomize.py), so code that runs only in gloo ranks is checked with the tests that
start them instead of counting as reached by no test."""

import json
import os
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    folder = os.environ.get("MUTATION_HITS")
    if os.environ.get("MUTANT_UNDER_TEST") != "stats" or not folder:
        return
    from mutmut.state import state

    for path in Path(folder).glob("*.json"):
        state()._stats.update(json.loads(path.read_text()))
        path.unlink()
