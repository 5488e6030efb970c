"""`remapdsl.ingest`: (checkpoint key, tensor) pairs fed into a runtime state dict through the rules: each
pair, as it arrives, runs the load plan's reads of it (an in-memory layout), so no stream is held whole."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from ..checkpoint.memory import MemoryReader, in_memory
from ..compile.compiler import drop_test
from ..gcpause import frozen_heap
from ..errors import Diagnostic, RemapError, did_you_mean
from ..sharding.holdings import check_fillable, hold
from ..sharding.plans import make_load_plan
from ..runtime import bounds, dist
from .export import check_unquantized
from .prepare import HeldTogether, check_kind, check_mesh, named_together
from ..runtime.read import run_load_plan
from .save import prepared_checkpoint
from ..runtime.staging import Rings, staging_within


class IngestReport(BaseModel):
    """What an ingest did on this rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    pairs: int  # pairs seen
    used: int  # pairs this rank read from
    bytes_read: int
    seconds: float


def ingest(prepared, state_dict, pairs, *, rules=None, like=None, config: Mapping[str, Any] | None = None,
           layout=None, mesh=None, timeout=None, staging_bytes: int | None = None, local=None) -> IngestReport:
    """`remapdsl.ingest` (`prepared` None: `like`'s layout, or the derived one, prepared for this call)."""
    check_kind(pairs, "pairs")
    staging = staging_within(staging_bytes)
    with bounds.bounded(timeout), frozen_heap(), Rings(staging) as rings:  # one ring per reader thread, over all pairs
        tensors = named_together(state_dict, local)
        if prepared is None:
            prepared = prepared_checkpoint(rules, like, config, tensors, layout, Path("<ingest>"),
                                           mesh=mesh)[0]
        start = time.perf_counter()
        ready = prepared.current()
        inventory, compiled, layout = ready.inventory, ready.compiled, ready.placing(layout)
        rank = dist.rank()

        def plan():
            check_mesh(mesh)
            check_unquantized(compiled, "an ingest takes the checkpoint tensors' own values, and decoding streamed "
                              "quantized parts is not supported", "ingest with the rule file of the unquantized layout")
            holding = hold(compiled, tensors, layout, mesh, rank, whole=not dist.active())
            check_fillable(compiled, holding.local)
            held = holding.held()
            memory = prepared.kept("memory", None, lambda: in_memory(inventory))
            plan = prepared.kept("ingest", (held, rank), lambda: make_load_plan(compiled, memory, held, rank))
            return memory, plan, holding

        memory, load_plan, holding = dist.together(plan, joint=HeldTogether(compiled, lambda r: r[2], mesh).joint(),
                                                   phase="planning the ingest")
        reads, fills = defaultdict(list), []  # fills: pads, no pair needed
        for item in load_plan.items:
            (fills if item.ckpt_key is None else reads[item.ckpt_key]).append(item)
        problems: list[Diagnostic] = []
        seen: set[str] = set()
        count = used = 0
        # pairs the rules drop are skipped unchecked: `like`'s are listed, others (a derived layout) tested
        drops, drop = frozenset(compiled.dropped), drop_test(ready.rules, ready.config)
        dropped = lambda key: key in drops if key in memory.tensors else drop(key)
        if fills:
            run_load_plan(load_plan.model_copy(update={"items": tuple(fills), "decodes": ()}), memory, holding.local,
                          rings=rings)
        for pair in (pairs.items() if isinstance(pairs, Mapping) else pairs):
            count += 1
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                problems.append(Diagnostic(code="E546", message=f"item {count} of the pairs is {pair!r:.60}, not a "
                                           "(checkpoint key, tensor) pair", hint="give a dict, or an iterable of pairs"))
                continue
            key, tensor = pair
            problem = _check_pair(key, tensor, memory, seen, dropped)
            if problem is not None:
                problems.append(problem)
                continue
            seen.add(key)
            items = reads.get(key)
            if not items:
                continue
            used += 1
            source = tensor.detach().contiguous().cpu()  # each a no-op where it already is
            # one thread: the bytes are in memory, so reader threads would overlap no I/O
            run_load_plan(load_plan.model_copy(update={"items": tuple(items), "decodes": ()}), memory, holding.local,
                          threads=1, reader=MemoryReader(memory, {key: source}), rings=rings)
        missing = sorted(set(reads) - seen)
        if missing:
            problems.append(Diagnostic(code="E547", message=f"{len(missing)} checkpoint tensor(s) this rank needs "
                                       f"never came, starting with `{missing[0]}`",
                                       hint="the pairs must hold every tensor the rules read for this rank's part"))

        def report():
            if problems:
                raise RemapError(problems[:8])
            return IngestReport(rank=rank, pairs=count, used=used, bytes_read=load_plan.bytes_read,
                                seconds=time.perf_counter() - start)

        return dist.together(report, phase="finishing the ingest")


def _check_pair(key, tensor, memory, seen: set[str], dropped: Callable[[str], bool]) -> Diagnostic | None:
    """What is wrong with one pair, or None: a key no rule reads (nor drops), a second copy, another shape or
    dtype."""
    if isinstance(key, str) and dropped(key):
        return None
    info = memory.tensors.get(key)
    if info is None:
        return Diagnostic(code="E545", message=f"pair `{key}`: the rules read no checkpoint tensor of that name",
                          hint=did_you_mean(str(key), memory.tensors) or "drop it in the rules, or leave it out")
    if key in seen:
        return Diagnostic(code="E548", message=f"pair `{key}` came twice", hint="send each tensor once")
    layout = f"the checkpoint layout has it {list(info.shape)} {info.dtype}"
    hint = "send the checkpoint's own tensors (cast them back first)"
    if not isinstance(tensor, torch.Tensor):
        return Diagnostic(code="E546", message=f"pair `{key}` is a {type(tensor).__name__}, not a tensor; {layout}",
                          hint=hint)
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tuple(tensor.shape) != tuple(info.shape) or dtype != info.dtype:
        return Diagnostic(code="E546", message=f"pair `{key}` is {list(tensor.shape)} {dtype}, but {layout}", hint=hint)
    return None
