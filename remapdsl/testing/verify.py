"""`remapdsl verify` as a function: rules and a checkpoint (or its snapshot) -> a Verification, one Check
per property and mesh, each proven on real data by the kit's assertions (docs/testing.md#remapdsl-verify)."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

import remapdsl
from remapdsl.checkpoint.snapshot import SnapshotInventory, config_of
from remapdsl.errors import Diagnostic, RemapError
from remapdsl.sharding import read_layout
from remapdsl.testing.assertions import assert_matches_reference, assert_round_trip
from remapdsl.testing.data import write_checkpoint
from remapdsl.testing.ranks import as_mesh, shard_everything, sharded_load_and_save

DEFAULT_MESHES = ("tp=2",)  # one real 2-rank mesh when none is given
REFERENCES = ("transformers",)

Property = Literal["compile", "sharded load", "sharded save", "round trip", "transformers"]


class Check(BaseModel):
    """One property on one mesh (or none): whether it holds, the bytes a sharded load read and owned
    (over all ranks), its seconds, and what failed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    property: Property
    mesh: str | None = None
    status: Literal["pass", "fail", "skipped"]
    bytes_read: int | None = None
    bytes_owned: int | None = None
    seconds: float = 0.0
    detail: str = ""


class Verification(BaseModel):
    """What `verify` proved: the checks in the order they ran; `ok` when every one passed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rules: str
    checkpoint: str
    synthesized: bool  # the checkpoint was a snapshot: random values in its layout were checked
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.status == "pass" for c in self.checks)

    def as_json(self) -> dict:
        return {"ok": self.ok, **self.model_dump()}


def verify(rules: str | os.PathLike, checkpoint: str | os.PathLike, meshes: Sequence[str] = DEFAULT_MESHES,
           layout: str | os.PathLike | None = None, against: str | None = None, *, seed: int = 0,
           timeout: float = 120.0) -> Verification:
    """Prove the properties of a rule file on a checkpoint folder or snapshot (random values in its layout
    from `seed`): it compiles strictly; on each of `meshes`, the sharded load and save on gloo ranks under
    `layout` (None: `shard_everything`); the round trip; with `against="transformers"`, the reference load.
    A user error raises RemapError before any property runs; `timeout`: seconds per mesh's ranks."""
    if against is not None and against not in REFERENCES:
        raise ValueError(f"against must be None or one of {REFERENCES}, not {against!r}")
    rule_set = remapdsl.load_rules(rules)
    inventory = remapdsl.open_checkpoint(checkpoint)
    parsed = [(text, as_mesh(text)) for text in meshes]
    plan = read_layout(layout).resolved(config_of(inventory)) if layout is not None else None
    if against == "transformers":
        _require_transformers()
    synthesized = isinstance(inventory, SnapshotInventory)
    with tempfile.TemporaryDirectory(prefix="remapdsl-verify-") as tmp:
        folder = write_checkpoint(inventory, Path(tmp) / "synthesized", seed=seed) if synthesized else checkpoint
        checks = tuple(_checks(rule_set, rules, folder, parsed, plan, against, timeout))
    return Verification(rules=os.fspath(rules), checkpoint=os.fspath(checkpoint), synthesized=synthesized,
                        checks=checks)


def _checks(rule_set, rules, folder, meshes, plan, against, timeout: float) -> Iterator[Check]:
    """The checks in the order they run, on the checkpoint with data in `folder`."""
    started = time.perf_counter()
    try:
        compiled = remapdsl.compile_rules(rule_set, folder)
    except RemapError as exc:
        yield Check(property="compile", status="fail", seconds=time.perf_counter() - started,
                    detail=exc.render())
        skipped = [(p, text) for text, _ in meshes for p in ("sharded load", "sharded save")]
        skipped += [("round trip", None)] + ([("transformers", None)] if against else [])
        for p, m in skipped:
            yield Check(property=p, mesh=m, status="skipped", detail="the rules do not compile")
        return
    yield Check(property="compile", status="pass", seconds=time.perf_counter() - started,
                detail=f"{len(compiled.runtime_tensors)} runtime tensors from {len(compiled.ckpt_tensors)} "
                "checkpoint tensors, every one used or dropped")
    data = remapdsl.open_checkpoint(folder)
    layouts = [(text, mesh, plan or shard_everything(compiled, mesh)) for text, mesh in meshes]
    for _, mesh, mesh_layout in layouts:  # a layout that does not fit a mesh is the user's error: raise now
        for rank in range(mesh.size):
            remapdsl.plan_rank(compiled, data, mesh_layout, mesh, rank)
    for text, mesh, mesh_layout in layouts:
        yield from _sharded(rules, folder, mesh_layout, text, mesh, compiled.logical, timeout)
    yield _timed("round trip", lambda: assert_round_trip(rules, folder),
                 f"{len(data.files)} file{'s' if len(data.files) != 1 else ''}"
                 f"{' and the index' if data.index_file else ''} written back byte for byte")
    if against == "transformers":
        yield _timed("transformers", lambda: assert_matches_reference(rules, folder, "transformers"),
                     "every runtime tensor equals from_pretrained's, bit for bit")


def _sharded(rules, folder, layout, text: str, mesh, logical: bool, timeout: float) -> tuple[Check, Check]:
    """The `sharded load` and `sharded save` rows of one mesh, from one group of ranks. The save's
    seconds are the slowest rank's save; the load's, the rest of the group's time."""
    started = time.perf_counter()
    try:
        ranks, problems = sharded_load_and_save(rules, folder, layout, mesh, timeout=timeout)
    except (AssertionError, RemapError) as exc:
        return (Check(property="sharded load", mesh=text, status="fail", seconds=time.perf_counter() - started,
                      detail=_message(exc)),
                Check(property="sharded save", mesh=text, status="skipped", detail="the sharded load failed"))
    note = ("dequantized tensors read covering scale tiles, so bytes read are not compared" if logical
            else "each rank read exactly the bytes it owns")
    seconds = max(r["save_seconds"] for r in ranks)
    load = Check(property="sharded load", mesh=text, status="pass", seconds=time.perf_counter() - started - seconds,
                 bytes_read=sum(r["bytes_read"] for r in ranks), bytes_owned=sum(r["bytes_owned"] for r in ranks),
                 detail=f"{mesh.size} gloo ranks: every shard equals the whole load; {note}")
    detail = ("the sharded save of the sharded load differs from the checkpoint:\n  " + "\n  ".join(problems)
              if problems else f"{mesh.size} gloo ranks each wrote the bytes it owns ("
              + ", ".join(f"{r['bytes_written'] / 1e3:.1f} kB" for r in ranks)
              + "), none gathered: the checkpoint back byte for byte")
    return load, Check(property="sharded save", mesh=text, status="fail" if problems else "pass", seconds=seconds,
                       detail=detail)


def _timed(name: Property, run, passed: str) -> Check:
    started = time.perf_counter()
    try:
        run()
    except (AssertionError, RemapError) as exc:  # a RemapError here (E501 on save, ...) is the property failing
        return Check(property=name, status="fail", seconds=time.perf_counter() - started, detail=_message(exc))
    return Check(property=name, status="pass", seconds=time.perf_counter() - started, detail=passed)


def _message(exc: BaseException) -> str:
    return exc.render() if isinstance(exc, RemapError) else str(exc)


def _require_transformers() -> None:
    try:
        import transformers
    except ImportError:
        raise RemapError(Diagnostic(
            code="E530", message="`--against transformers` needs transformers, which is not installed",
            hint="pip install 'remapdsl[test]' (or transformers itself)")) from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
