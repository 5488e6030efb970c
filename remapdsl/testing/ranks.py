"""Real multi-rank runs on the CPU: a function on N gloo processes, spawned (forking torch's threads is not
safe) and meeting through a file rendezvous (no TCP port to race for); and the sharded properties."""

from __future__ import annotations

import datetime
import glob
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import remapdsl
from remapdsl.checkpoint.snapshot import config_of, require_data
from remapdsl.sharding import LayoutPlan, Mesh, Replicate, Shard, layout_for, local_shard, parse_mesh, read_layout
from remapdsl.testing.assertions import round_trip_differences
from remapdsl.testing.compare import fail_on, tensor_difference


def run_ranks(fn: Callable[..., Any], world: int = 2, *args: Any, timeout: float = 120.0,
              backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo processes in one process group; returns each rank's
    value, in rank order. One AssertionError names every rank that raised (its message or traceback),
    died, or ran past `timeout` seconds. `backend`: the default group's; `"cuda:gloo"` has no CPU
    backend, as an NCCL job's group, so what a GPU job does to CPU tensors is tried on the CPU."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="remapdsl-ranks-") as folder:
        context = mp.start_processes(_entry, args=(world, folder, fn, args, timeout, backend), nprocs=world, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout + 30
        died = None
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{world} ranks still running after {timeout:.0f} s: stopped")
        except mp.ProcessExitedException as exc:
            died = f"rank {exc.error_index} died (exit code {exc.exit_code})"
        except mp.ProcessRaisedException as exc:  # a failure outside `fn` (joining the group)
            died = f"a rank failed: {exc}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
        results, failures = [], [died] if died else []
        for rank in range(world):
            path = Path(folder, f"rank{rank}.pickle")
            ok, value = pickle.loads(path.read_bytes()) if path.exists() else (False, "no result")
            results.append(value if ok else None)
            if not ok:
                failures.append(f"rank {rank}: {value}")
    if failures:
        raise AssertionError("\n".join(failures))
    return results


def _entry(rank: int, world: int, folder: str, fn, args, timeout: float, backend: str) -> None:
    import torch
    import torch.distributed as dist

    from remapdsl.runtime.bounds import control_group

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    outcome: tuple[bool, Any]
    try:
        outcome = (True, fn(rank, world, *args))
    except AssertionError as exc:
        outcome = (False, str(exc))
    except BaseException:  # noqa: BLE001 - pytest's outcomes too: reported by the parent, with the traceback
        outcome = (False, traceback.format_exc())
    try:
        data = pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - an unpicklable return value (pickled whole first: no torn file)
        data = pickle.dumps((False, f"returned an unpicklable {type(outcome[1]).__name__}"))
    Path(folder, f"rank{rank}.pickle").write_bytes(data)
    try:
        dist.barrier(group=control_group())  # leave together: a rank tearing gloo down while a peer is in a collective can abort it
    finally:
        dist.destroy_process_group()


def as_mesh(mesh: Mesh | Mapping[str, int] | str) -> Mesh:
    """A Mesh from a Mesh, `{"tp": 2}` or `"dp=2,tp=2"`."""
    if isinstance(mesh, Mesh):
        return mesh
    return parse_mesh(mesh) if isinstance(mesh, str) else Mesh.of(dict(mesh))


def shard_everything(compiled, mesh: Mesh) -> LayoutPlan:
    """A layout cutting every runtime tensor on every mesh dim (mesh dim i cuts tensor dim i mod ndim)."""
    plan = {}
    for t in compiled.runtime_tensors:
        ndim = len(t.shape)
        plan[glob.escape(t.runtime_key)] = [Shard(dim=i % ndim) if ndim else Replicate() for i in range(len(mesh.sizes))]
    return LayoutPlan.from_mapping(plan, mesh_dim=mesh.names[0])


def assert_sharded_equals_whole(rules, checkpoint, layout: LayoutPlan | Mapping | str | None = None,
                                mesh: Mesh | Mapping[str, int] | str = "tp=2", *,
                                config: Mapping[str, Any] | None = None, timeout: float = 120.0) -> list[dict]:
    """Assert, on one gloo process per rank of `mesh`, that every rank's sharded load equals the whole load
    sliced and (without `dequantize`) reads exactly the bytes it owns; returns per rank `{"bytes_read": ...,
    "bytes_owned": ...}`. `layout`: a `LayoutPlan`, a tp_plan-style mapping, a layout file, or None (every
    tensor cut on every mesh dim); `mesh`: a `Mesh`, `{"tp": 2}` or `"dp=2,tp=2"`; `timeout`: seconds."""
    mesh, layout = _prepared(rules, checkpoint, layout, mesh, config, "a sharded load")
    return run_ranks(_sharded_rank, mesh.size, rules, os.fspath(checkpoint), layout, mesh, config, None,
                     timeout=timeout)


def assert_sharded_round_trip(rules, checkpoint, layout: LayoutPlan | Mapping | str | None = None,
                              mesh: Mesh | Mapping[str, int] | str = "tp=2", *,
                              config: Mapping[str, Any] | None = None, timeout: float = 120.0) -> list[dict]:
    """Assert, as `assert_sharded_equals_whole` (whose checks run too), that the ranks saving their shards
    back (each writing the bytes it owns) give the checkpoint back byte for byte, with the same index; per
    rank, its result gains `bytes_written` and `save_seconds`."""
    mesh, layout = _prepared(rules, checkpoint, layout, mesh, config, "a sharded round trip")
    ranks, found = sharded_load_and_save(rules, checkpoint, layout, mesh, config=config, timeout=timeout)
    fail_on(found, f"the sharded save of the sharded load differs from {os.fspath(checkpoint)}")
    return ranks


def sharded_load_and_save(rules, checkpoint, layout: LayoutPlan, mesh: Mesh, *,
                          config: Mapping[str, Any] | None = None,
                          timeout: float = 120.0) -> tuple[list[dict], list[str]]:
    """The ranks of `mesh` load their shards, checked as `assert_sharded_equals_whole` does (a failure
    raises), then save them to a temporary folder: each rank's result, and the save's error or differences."""
    with tempfile.TemporaryDirectory(prefix="remapdsl-sharded-round-trip-") as tmp:
        out = os.path.join(tmp, "copy")
        ranks = run_ranks(_sharded_rank, mesh.size, rules, os.fspath(checkpoint), layout, mesh, config, out,
                          timeout=timeout)
        failed = [r["save_error"] for r in ranks if "save_error" in r]
        if failed:
            return ranks, [f"the sharded save failed: {failed[0]}"]
        return ranks, round_trip_differences(remapdsl.open_checkpoint(checkpoint), Path(out))


def _prepared(rules, checkpoint, layout, mesh, config, what: str) -> tuple[Mesh, LayoutPlan]:
    """The mesh and layout plan an assertion was given (None: `shard_everything`), checked here rather
    than on every rank."""
    require_data(checkpoint, what)
    mesh = as_mesh(mesh)
    compiled = remapdsl.compile_rules(rules, checkpoint, config)
    if layout is None:
        layout = shard_everything(compiled, mesh)
    elif isinstance(layout, Mapping):
        layout = LayoutPlan.from_mapping(dict(layout), mesh_dim=mesh.names[0])
    elif not isinstance(layout, LayoutPlan):
        layout = read_layout(layout)
    return mesh, layout.resolved(config_of(checkpoint) if config is None else config)


def _sharded_rank(rank: int, world: int, rules, checkpoint, layout, mesh, config, save_to) -> dict:
    import torch

    nan_dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    compiled = remapdsl.compile_rules(rules, checkpoint, config)
    whole = compiled.empty_state_dict()
    remapdsl.load(whole, checkpoint, rules, config=config)
    local, shards = {}, {}
    for key, full in whole.items():
        shard = local_shard(full.shape, mesh.sizes, layout_for(key, full.shape, layout, mesh), mesh.coordinate(rank),
                            runtime_key=key)
        # NaN where a float can hold it (random checkpoints hold no NaN): a region left unread shows
        local[key] = (torch.full(shard.shape, float("nan"), dtype=full.dtype) if full.dtype in nan_dtypes
                      else torch.zeros(shard.shape, dtype=full.dtype))
        shards[key] = shard
    report = remapdsl.load(local, checkpoint, rules, layout=layout, mesh=mesh, config=config)
    found = []
    for key, shard in shards.items():
        if shard.zeros and bool(local[key].count_nonzero()):  # a FirstOnly placement's other coordinates
            found.append(f"`{key}`: this rank holds zeros in its layout, but the load left other values")
        for box, at in zip(shard.boxes, shard.local_offsets):
            want = whole[key][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            got = local[key][tuple(slice(o, o + s) for o, s in zip(at, box.sizes))]
            why = tensor_difference(got, want, ("shard", "whole load"))
            if why:
                where = ", ".join(f"{o}:{o + s}" for o, s in zip(box.offsets, box.sizes))
                found.append(f"`{key}`[{where}]: {why} (indices within the box)")
    if not compiled.logical and report.bytes_read != report.bytes_owned:
        found.append(f"read {report.bytes_read} B for {report.bytes_owned} B owned")
    coordinate = ", ".join(f"{n}={c}" for n, c in zip(mesh.names, mesh.coordinate(rank)))
    fail_on(found[:10], f"({coordinate}) shards differ from the whole load")
    out = {"bytes_read": report.bytes_read, "bytes_owned": report.bytes_owned}
    if save_to is not None:
        started = time.perf_counter()
        try:
            out["bytes_written"] = remapdsl.save(local, save_to, rules, like=checkpoint, layout=layout, mesh=mesh,
                                                 config=config).bytes_written
        except remapdsl.RemapError as exc:  # the same error on every rank: the save's property, not the load's
            out["save_error"] = exc.render()
        out["save_seconds"] = time.perf_counter() - started
    return out
