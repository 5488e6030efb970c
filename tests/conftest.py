"""The suite keeps its caches (the parser's, the load cache) in a folder of its own, made for the
session and removed after it: a test never reads what the user's processes kept, nor leaves
anything in ~/.cache. Ranks and commands the tests start inherit it.

A test that starts process groups is marked `distributed` (the fast tier is `-m "not distributed"`);
one that is not marked and tries is failed (tests/test_suite_tiers.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest
from hypothesis import settings

_FOLDER: list[str] = []

# Property tests draw counts sized for every commit (tests/depth.py); this profile draws ten times as
# many: `pytest --hypothesis-profile=thorough`.
settings.register_profile("thorough", max_examples=1000)


def pytest_configure(config) -> None:
    folder = tempfile.mkdtemp(prefix="remapdsl-test-cache-")
    _FOLDER.append(folder)
    os.environ["XDG_CACHE_HOME"] = folder


def pytest_unconfigure(config) -> None:
    while _FOLDER:
        shutil.rmtree(_FOLDER.pop(), ignore_errors=True)


# -- the `distributed` tier ------------------------------------------------------------------------
# A test that starts real process groups (gloo ranks, spawned processes) is marked `distributed`,
# so that `-m "not distributed"` is the fast tier. Any other test that tries is failed at the call:
# an unmarked test cannot slip process groups into the fast tier.


class ProcessGroupOutsideTier(BaseException):
    """Raised in a test not marked `distributed` that starts a process group or a process (a
    BaseException: no `except Exception` on the way, the library's included, turns it into an error
    the test expects)."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise ProcessGroupOutsideTier(f"{what} in a test not marked `distributed`: mark it "
                                      "`@pytest.mark.distributed` (or the module `pytestmark`)")

    return refuse


# The one test that starts ranks in a file this change leaves to its owners (tests/test_load_cache.py,
# whose disk cache is being removed): marked here by its node id, as its module would mark it.
_MARKED_HERE = ("tests/test_load_cache.py::test_two_ranks_read_back_what_they_kept",)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if item.nodeid in _MARKED_HERE:
            item.add_marker(pytest.mark.distributed)


@contextlib.contextmanager
def _guarded(item):
    """While `item` runs (setup, call, teardown) outside the `distributed` marker: no process group
    in this process and no process started through multiprocessing (spawned ranks)."""
    if item.get_closest_marker("distributed") is not None:
        yield
        return
    import multiprocessing.process

    import torch.distributed as dist

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "init_process_group", _refuse("torch.distributed.init_process_group"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("starting a process"))
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with _guarded(item):
        return (yield)
