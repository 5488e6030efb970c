"""`remapdsl.load`: fill a state dict in place from a checkpoint through a rule file, every rank its own
bytes."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from ..sharding.holdings import check_fillable, hold
from ..sharding.plans import make_load_plan
from ..gcpause import frozen_heap
from ..runtime import bounds, dist
from .prepare import HeldTogether, check_kind, check_mesh, tensors_of
from ..runtime.read import run_load_plan
from ..runtime.staging import Rings, staging_within


class LoadReport(BaseModel):
    """What a load did: the runtime tensors it filled, from which checkpoint tensors, bytes read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loaded: tuple[str, ...]
    ckpt_keys: tuple[str, ...]
    bytes_read: int
    seconds: float
    bytes_owned: int = 0  # checkpoint bytes behind the elements this rank holds
    scale_bytes_read: int = 0  # of bytes_read, bytes of quantization scales (covering tiles)
    rank: int = 0
    rules: str = ""  # the top-level rule file compiled (the one `auto` chose, a shipped name's file)


def load(prepared, state_dict, *, layout=None, mesh=None, read_replicated_once: bool = False, timeout=None,
         staging_bytes: int | None = None, local=None) -> LoadReport:
    """Fill existing tensors in place from a prepared checkpoint; the arguments are `remapdsl.load`'s."""
    check_kind(read_replicated_once, "read_replicated_once")
    staging = staging_within(staging_bytes)
    with bounds.bounded(timeout), frozen_heap():
        ready = prepared.current()
        inventory, compiled, layout = ready.inventory, ready.compiled, ready.placing(layout)
        rank = dist.rank()

        def read():
            start = time.perf_counter()
            check_mesh(mesh)
            tensors = tensors_of(state_dict, local)
            holding = hold(compiled, tensors, layout, mesh, rank, whole=not dist.active())
            check_fillable(compiled, holding.local)
            held = holding.held()
            shared = holding.everywhere() if read_replicated_once and dist.active() else []
            if rank != 0:  # rank 0 reads what every rank holds whole, and broadcasts it
                for key in shared:
                    del held[key]
            plan = prepared.kept("load", (held, rank), lambda: make_load_plan(compiled, inventory, held, rank))
            with Rings(staging) as rings:
                run_load_plan(plan, inventory, holding.local, rings=rings)
            loaded = tuple(d.runtime_key for d in compiled.runtime_tensors if d.runtime_key in holding.placed)
            report = LoadReport(loaded=loaded,
                                ckpt_keys=tuple(sorted({i.ckpt_key for i in plan.items if i.ckpt_key}
                                                       | {p.ckpt_key for i in plan.decodes for p in i.parts})),
                                bytes_read=plan.bytes_read, bytes_owned=plan.bytes_owned,
                                scale_bytes_read=plan.scale_bytes_read, rank=rank, rules=prepared.rules_path,
                                seconds=time.perf_counter() - start)
            return report, [holding.local[k] for k in shared], holding, shared

        together = HeldTogether(compiled, lambda r: r[2], mesh, read_once=lambda r: r[3])
        report, shared, _, _ = dist.together(read, joint=together.joint(), phase="reading")
        dist.broadcast_from_first(shared)  # after every rank's reads succeeded, so none waits in vain
        return report
