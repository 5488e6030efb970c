"""The pytest plugin of remapdsl.testing (entry point `pytest11`: loaded by every pytest run in an
environment where remapdsl is installed).

- fixture `remapdsl_checkpoint`: a factory of tiny real checkpoints under the test's tmp_path, from
  a snapshot, a checkpoint folder or Inventory (random values in its layout, optionally scaled
  down), or from a transformers config (`{"model_type": "llama", ...}`: `from_config`, random
  values, `save_pretrained`);
- fixture `remapdsl_ranks`: `run_ranks`, a function on N real gloo processes;
- marker `remapdsl_distributed`, for tests that start processes (`-m "not remapdsl_distributed"`);
- hypothesis profile `remapdsl-ci` (derandomized, no deadline, the failing example printed):
  `pytest --hypothesis-profile=remapdsl-ci`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

PROFILE = "remapdsl-ci"
MARKER = "remapdsl_distributed"

try:  # registered on import, so hypothesis' own plugin finds it when it reads --hypothesis-profile
    from hypothesis import settings as _settings

    _settings.register_profile(PROFILE, derandomize=True, deadline=None, print_blob=True)
except ImportError:  # the kit works without hypothesis; only the strategies need it
    pass


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: a test that runs real gloo processes (remapdsl.testing)")


@pytest.fixture
def remapdsl_checkpoint(tmp_path):
    """`make(source, *, layers=None, experts=None, seed=0) -> Path`: a tiny real checkpoint folder
    under tmp_path. `source`: a snapshot file, checkpoint folder or Inventory (random values in its
    layout; `layers`/`experts` keep the first N), or a transformers config dict with `model_type`
    (or a config.json path holding one)."""
    from remapdsl.testing.data import write_checkpoint, write_pretrained

    made = 0

    def make(source, *, layers: int | None = None, experts: int | None = None, seed: int = 0) -> Path:
        nonlocal made
        made += 1
        folder = tmp_path / f"checkpoint{made}"
        if isinstance(source, (str, Path)) and Path(source).name == "config.json":
            source = json.loads(Path(source).read_text())
        if isinstance(source, Mapping):
            return write_pretrained(source, folder, seed)
        return write_checkpoint(source, folder, seed=seed, layers=layers, experts=experts)

    return make


@pytest.fixture
def remapdsl_ranks():
    """`run(fn, world=2, *args, timeout=120.0)`: `fn(rank, world, *args)` on `world` real gloo CPU
    processes (fn must be a module-level function); returns each rank's value, raises one
    AssertionError naming every failing rank."""
    from remapdsl.testing.ranks import run_ranks

    return run_ranks
