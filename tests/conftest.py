"""A test that starts process groups is marked `distributed` (the fast tier is `-m "not distributed"`);
one that is not marked and tries is failed (tests/test_suite_tiers.py)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings

# Property tests draw counts sized for every commit (tests/depth.py); this profile draws ten times as
# many: `pytest --hypothesis-profile=thorough`.
settings.register_profile("thorough", max_examples=1000)


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
