"""The pytest plugin of remapdsl.testing (entry point `pytest11`): fixtures `remapdsl_checkpoint` and
`remapdsl_ranks`, marker `remapdsl_distributed` (tests that start processes), and hypothesis profile
`remapdsl-ci` (derandomized, no deadline, the failing example printed)."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Mapping
from pathlib import Path

import pytest

PROFILE = "remapdsl-ci"
MARKER = "remapdsl_distributed"

# Registered on import, so hypothesis' own plugin finds it when it reads --hypothesis-profile; the kit works
# without hypothesis (only the strategies need it).
with contextlib.suppress(ImportError):
    from hypothesis import settings as _settings

    _settings.register_profile(PROFILE, derandomize=True, deadline=None, print_blob=True)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: a test that runs real gloo processes (remapdsl.testing)")


@pytest.fixture
def remapdsl_checkpoint(tmp_path):
    """`make(source, *, layers=None, experts=None, seed=0) -> Path`: a tiny real checkpoint under
    tmp_path, from a snapshot, checkpoint folder or Inventory (random values in its layout), or a
    transformers config dict with `model_type` (or a config.json path holding one)."""
    from remapdsl.testing.data import write_checkpoint, write_pretrained

    made = itertools.count(1)

    def make(source, *, layers: int | None = None, experts: int | None = None, seed: int = 0) -> Path:
        folder = tmp_path / f"checkpoint{next(made)}"
        if isinstance(source, (str, Path)) and Path(source).name == "config.json":
            source = json.loads(Path(source).read_text())
        if isinstance(source, Mapping):
            return write_pretrained(source, folder, seed)
        return write_checkpoint(source, folder, seed=seed, layers=layers, experts=experts)

    return make


@pytest.fixture
def remapdsl_ranks():
    """`run_ranks`: `fn(rank, world, *args)` on `world` real gloo CPU processes."""
    from remapdsl.testing.ranks import run_ranks

    return run_ranks
