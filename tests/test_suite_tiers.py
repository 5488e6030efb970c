"""The `distributed` marker is the line between the fast tier (`-m "not distributed"`) and the rest:
a test outside it that starts a process group or a process, in its fixtures or its body, fails
(tests/conftest.py); a test inside it may."""

from __future__ import annotations

import multiprocessing

import pytest
import torch.distributed as dist


def _start_a_group(store) -> BaseException | None:
    """What starting a one-rank gloo group raised (None: it started, and is left again)."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    except BaseException as exc:  # noqa: BLE001 - the guard's error is a BaseException
        return exc
    dist.destroy_process_group()
    return None


def _refused(exc: BaseException | None) -> bool:
    return type(exc).__name__ == "ProcessGroupOutsideTier" and "not marked `distributed`" in str(exc)


@pytest.fixture
def group_started_in_setup(tmp_path):
    return _start_a_group(tmp_path / "store")


def test_an_unmarked_test_cannot_start_a_process_group(tmp_path):
    assert _refused(_start_a_group(tmp_path / "store"))
    assert not dist.is_initialized()


def test_an_unmarked_tests_fixture_cannot_start_a_process_group(group_started_in_setup):
    assert _refused(group_started_in_setup)


def test_an_unmarked_test_cannot_spawn_ranks():
    process = multiprocessing.get_context("spawn").Process(target=print)
    with pytest.raises(BaseException) as info:
        process.start()
    assert _refused(info.value) and process.pid is None


@pytest.mark.distributed
def test_a_distributed_test_may_start_a_process_group(tmp_path):
    assert _start_a_group(tmp_path / "store") is None
