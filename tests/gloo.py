"""Shared by the tests that run real gloo process groups.

Ranks are started one way: `remapdsl.testing.run_ranks(fn, world, *args)`, which spawns `world`
processes in one gloo group, runs the module-level `fn(rank, world, *args)` on each and hands back
what each returned (an AssertionError naming every rank that failed). The helpers here run inside
such a rank: `record_cases` (what each case raised), `each_backend` (the same checks under each
default group of BACKENDS). Only a test that proves a rank hangs or dies starts its processes
itself, with `run_with_bound` (its ranks join their group with `join_group`)."""

from __future__ import annotations

import pytest

# What a worker catches and reports for one check: any error, and pytest's own outcomes
# (`pytest.fail`, a `pytest.raises` that saw nothing raised, `pytest.skip`), which derive from
# BaseException and would otherwise end the worker as a crash without the check's message.
CHECK_FAILURES = (Exception, pytest.fail.Exception, pytest.skip.Exception)

# The default groups a distributed test runs under: plain gloo, and `cuda:gloo`, a group with
# NCCL's device contract (a backend for CUDA tensors only, as `init_process_group("nccl")` gives):
# every collective remapdsl makes on CPU tensors must go over a CPU-capable group of its own.
BACKENDS = ("gloo", "cuda:gloo")


def join_group(rank: int, world: int, rendezvous: str, backend: str = "gloo", seconds: float = 60) -> None:
    """Join a `world`-rank default group through a file rendezvous (no TCP port to race for)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=seconds))


def shut_down() -> None:
    """Leave the group together: a rank tearing down gloo while its peer is still in a collective
    can abort the peer's process. No garbage is collected first: remapdsl's calls leave nothing
    of theirs with gloo's threads (tests/test_clean_exit.py runs a user's script without this
    helper), and collecting here would hide it if they did."""
    import torch.distributed as dist

    from remapdsl.runtime.bounds import control_group

    try:
        dist.barrier(group=control_group())  # a CPU-capable group: the default may have none
    finally:
        dist.destroy_process_group()


def distributed_like(expected: dict, mesh, plan) -> tuple[dict, dict]:
    """For each full tensor of `expected`: a zeroed DTensor placed as `plan` places it on `mesh`
    (remapdsl.sharding.placements types, turned into torch's), and the local shard torch's own
    `distribute_tensor` gives this rank of the full tensor (split locally, `src_data_rank=None`: no
    collective, so a default group without a CPU backend serves too): the targets and what they
    must hold."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from remapdsl.sharding import layout_for

    device_mesh = init_device_mesh("cpu", tuple(mesh.sizes), mesh_dim_names=tuple(mesh.names))

    def torch_placement(p):
        if type(p).__name__ == "Shard":
            return Shard(p.dim)
        if type(p).__name__ == "StridedShard":
            return _StridedShard(p.dim, split_factor=p.split_factor)
        return Replicate()

    targets, wanted = {}, {}
    for key, full in expected.items():
        placements = [torch_placement(p) for p in layout_for(key, full.shape, plan, mesh)]
        targets[key] = distribute_tensor(torch.zeros_like(full), device_mesh, placements, src_data_rank=None)
        wanted[key] = distribute_tensor(full, device_mesh, placements, src_data_rank=None).to_local()
    return targets, wanted


def record_cases(rank: int, world: int, out: str, cases) -> dict:
    """On a `run_ranks` rank: run each of `cases(rank, folder)` (name -> call, `folder` this rank's
    own, under `out`) in turn and return what each raised (`record`)."""
    from pathlib import Path

    folder = Path(out) / f"rank{rank}"
    folder.mkdir()
    return {name: record(call) for name, call in cases(rank, folder).items()}


def each_backend(rank: int, world: int, folder: str, run, backends=BACKENDS) -> list[str]:
    """On a `run_ranks` rank (whose default group has the backend `backends[0]`): `run(backend)`
    under each default group of `backends` in turn, each a group of its own (met through a file in
    `folder`); the failures each run returns, or the traceback of what it raised, prefixed by the
    backend. A failure does not stop the ranks: the next backend's group is joined all the same.
    The last group is left for run_ranks to leave."""
    import traceback

    failures: list[str] = []
    for number, backend in enumerate(backends):
        if number:
            shut_down()
            join_group(rank, world, f"{folder}/rendezvous-{world}-{backend.replace(':', '-')}", backend)
        try:
            failures.extend(f"[{backend}] {f}" for f in run(backend) or ())
        except CHECK_FAILURES:  # reported by the parent, pytest's outcomes included
            failures.append(f"[{backend}] {traceback.format_exc()}")
    return failures


def record(call) -> dict | None:
    """What `call()` raised, as `record_cases` returns it: None, a RemapError's class, codes, text and
    failing ranks, or for anything else (a failed check included) its traceback as `escaped`."""
    import traceback

    import remapdsl

    try:
        call()
    except remapdsl.RemapError as exc:
        return {"type": type(exc).__name__, "codes": [d.code for d in exc.diagnostics],
                "text": str(exc), "failed_ranks": list(getattr(exc, "failed_ranks", ()))}
    except CHECK_FAILURES:  # a non-RemapError escaping, or a check failing, is itself a failure
        return {"type": "escaped", "text": traceback.format_exc()}
    return None


def run_with_bound(target, world: int, args: tuple, bound: float) -> list[int]:
    """Start `target(rank, *args)` in `world` spawned processes and wait up to `bound` seconds for
    all of them; kill any still running then and return their ranks (those that hung)."""
    import time

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    procs = [context.Process(target=target, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + bound
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    return alive


def layout_spec(held) -> tuple:
    """A drawn memory layout (`remapdsl.testing.strategies.Held`) as plain data for `run_ranks`: spawned
    ranks are handed tensors in shared memory, which every rank would then write into; each rank makes
    its own (`held_from`)."""
    return (tuple(held.base.shape), tuple(held.tensor.shape), held.tensor.stride(), held.tensor.storage_offset(),
            str(held.base.dtype).removeprefix("torch."), held.how)


def held_from(spec: tuple):
    """The layout of `layout_spec`, in memory of this process's own, every element NaN."""
    import torch

    from remapdsl.testing.strategies import Held

    base_shape, shape, stride, offset, dtype, how = spec
    base = torch.full(base_shape, float("nan"), dtype=getattr(torch, dtype))
    return Held(base.as_strided(shape, stride, offset), base, how)
