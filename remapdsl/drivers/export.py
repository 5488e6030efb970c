"""`remapdsl.export`: a sharded runtime state dict streamed in the checkpoint layout, no files (weight sync).
Each checkpoint tensor is assembled on one rank that writes part of it, the others sending their pieces
in rounds of at most half of `bucket_bytes` per owner; with `regions`, each rank yields its boxes."""

from __future__ import annotations

import pickle
import struct
import threading
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from math import prod
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import Diagnostic, RemapError
from ..gcpause import frozen_heap
from ..sharding.holdings import hold, owned
from ..sharding.plans import make_write_plan
from ..runtime import bounds, dist
from ..runtime.pieces import torch_dtype
from .convert import batches
from .prepare import HeldTogether, check_kinds, check_mesh, named_together
from .save import prepared_checkpoint, writers_paused
from ..runtime.write import run_write_plan


def export(prepared, state_dict, *, rules=None, like=None, config: Mapping[str, Any] | None = None, gather=(),
           bucket_bytes: int = 256 << 20, layout=None, mesh=None, allow_lossy: bool = False, regions: bool = False,
           by_round: bool = False, timeout=None, local=None) -> Iterator:
    """`remapdsl.export` (`prepared` None: prepared for this call) or `Prepared.export`: (checkpoint key,
    tensor) pairs, or with `regions` (key, offsets, tensor), or with `by_round` one list of pairs a round."""
    bounds.seconds(timeout)  # a bad timeout or flag is refused at the call, before the first item is asked for
    check_kinds(gather=gather, allow_lossy=allow_lossy, regions=regions, by_round=by_round)
    return bounds.bounded_iter(_export(prepared, rules, like, config, state_dict, gather, bucket_bytes, layout, mesh,
                                       allow_lossy, regions, by_round, local), timeout)


def _export(prepared, rules, like, config, state_dict, gather, bucket_bytes: int, layout, mesh, allow_lossy: bool,
            regions: bool, by_round: bool, local) -> Iterator:
    gather = (gather,) if isinstance(gather, str) else tuple(gather)
    if regions and (gather or by_round):
        name, why = ("gather", "takes no gather") if gather else ("by_round", "has no rounds to group by")
        raise RemapError(Diagnostic(code="E542", message=f"regions=True yields the boxes each rank holds and "
                                    f"moves nothing, so it {why} (got {name}={gather or by_round!r})",
                                    hint=f"drop `{name}`, or drop `regions` to assemble whole tensors"))
    with frozen_heap():  # until the first item: the consumer's own code runs between items
        tensors = named_together(state_dict, local)
        # the layout streamed: `like`'s, or the derived one (headers needed by no file here)
        prepared = prepared or prepared_checkpoint(rules, like, config, tensors, layout, Path("<export>"),
                                                   mesh=mesh)[0]
        ready = prepared.current()
        out, compiled, layout = ready.inventory, ready.compiled, ready.placing(layout)
        rank, world = dist.rank(), dist.world_size()

        def place():
            _check_bucket(bucket_bytes)
            check_mesh(mesh, alone=None if regions else "whole tensors are assembled from every rank's part, and one "
                       "process holds only rank 0's: run every rank of the mesh, or export `regions=True` (rank 0's "
                       "boxes)")
            check_unquantized(compiled, "an export streams the runtime tensors' own values, and re-encoding them "
                              "in the stored format is not supported", "export with the rule file of the "
                              "unquantized layout (`deepseek_v3`, not `deepseek_v3_fp8`); the engine quantizes what "
                              "it loads")
            chosen = prepared.kept("writers", (allow_lossy, False, "omit"), lambda: writers_paused(
                compiled, allow_lossy=allow_lossy, dropped="omit"))
            return chosen, hold(compiled, tensors, layout, mesh, rank, whole=not dist.active())

        together = HeldTogether(compiled, lambda placed: placed[1], mesh)
        chosen, holding = dist.together(place, joint=together.joint(), phase="placing the tensors")

        def plan():
            # the replica that writes a replicated tensor chosen by its key, so no one group assembles them all
            boxes = owned(holding, rank, spread_over=world, holders=together.holders)
            return prepared.kept("export", (allow_lossy, boxes, rank), lambda: _export_plan(
                chosen, out, boxes, rank, compiled.logical_by_key(), _coordinates(tensors, layout, mesh, rank)))

        plan, mine = dist.together(plan, phase="planning the export")
        empty = prepared.kept("empty", None, lambda: _empty(out, compiled))
        if not regions:
            everyone = dist.gather_all(mine, "sharing what each rank exports")
            schedule = dist.together(lambda: prepared.kept(
                "schedule", (everyone, bucket_bytes, gather),
                lambda: _schedule(everyone, out, bucket_bytes, gather, empty)), phase="scheduling the export")
    yield from _regions(plan, out, holding.local, bucket_bytes, empty if rank == 0 else []) if regions else \
        _rounds(plan, schedule, out, holding.local, rank, world, by_round)


def _export_plan(chosen, out, boxes, rank: int, logical, coordinates: Callable[[str], tuple]) -> tuple:
    """This rank's write plan into memory, and for each checkpoint tensor it writes part of, its coordinates on
    the mesh of the runtime tensor that makes it (what the ranks exchange to schedule)."""
    plan = make_write_plan(chosen, out, boxes, rank, logical)
    producer = {w.block.source_key: w.runtime_key for w in chosen}
    return plan, {key: coordinates(producer[key]) for key in dict.fromkeys(item.ckpt_key for item in plan.items)}


def _coordinates(tensors, layout, mesh, rank: int) -> Callable[[str], tuple]:
    """Runtime key -> this rank's ((mesh dim name, coordinate), ...) on the mesh the tensor lives on: a
    DTensor's own, `mesh` under a layout plan, none for a plain whole tensor (one tuple per mesh)."""
    seen: dict[int, tuple] = {}

    def coordinates(runtime_key: str) -> tuple:
        device_mesh = getattr(tensors.get(runtime_key), "device_mesh", None)
        on = device_mesh if device_mesh is not None else mesh if layout is not None else None
        if on is None:
            return ()
        if id(on) not in seen:
            if device_mesh is not None:
                names = device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(device_mesh.ndim))
                seen[id(on)] = tuple(zip(names, device_mesh.get_coordinate()))
            else:
                seen[id(on)] = tuple(zip(on.names, on.coordinate(rank)))
        return seen[id(on)]
    return coordinates


def _empty(out, compiled) -> list[str]:
    """The checkpoint tensors without bytes (no writer holds any): rank 0 yields them."""
    dropped = set(compiled.dropped)
    return [k for k, t in out.tensors.items() if not t.nbytes and k not in dropped]


class _Schedule(NamedTuple):
    """Who assembles each checkpoint tensor (its owner) and in which round, the same on every rank."""

    owner: dict[str, int]
    round_of: dict[str, int]
    rounds: int


def _schedule(everyone: list[dict], out, bucket_bytes: int, gather: tuple, empty: list[str]) -> _Schedule:
    writers: dict[str, list[int]] = defaultdict(list)
    for r, keys in enumerate(everyone):
        for key in keys:
            writers[key].append(r)
    _check_gather(writers, everyone, gather)
    load = [0] * len(everyone)
    owner: dict[str, int] = dict.fromkeys(empty, 0)  # no bytes, so no writer: rank 0 yields them
    for key in sorted(writers):
        o = owner[key] = min(writers[key], key=lambda r: (load[r], r))
        load[o] += out.tensors[key].nbytes
    # half a bucket assembled a round: with the pieces it sends and receives meanwhile (each about
    # the same again, spread over the group), a rank holds about one bucket beyond its shards
    capacity = max(1, bucket_bytes // 2)
    round_of: dict[str, int] = {}
    filled: dict[int, tuple[int, int]] = {}  # owner -> (its current round, bytes in it)
    for key in sorted(owner):
        o, n = owner[key], out.tensors[key].nbytes
        at, size = filled.get(o, (0, 0))
        if size and size + n > capacity:
            at, size = at + 1, 0
        filled[o] = (at, size + n)
        round_of[key] = at
    return _Schedule(owner, round_of, 1 + max((at for at, _ in filled.values()), default=-1))


def _check_gather(writers: dict[str, list[int]], everyone: list[dict], gather: tuple) -> None:
    """E542 for a `gather` dim no mesh has; E541 for a checkpoint tensor whose writers differ on a mesh dim
    `gather` does not name (each writer's coordinates on the mesh its runtime tensor lives on: a DTensor's
    own, or `mesh` under a layout plan)."""
    names = {name for keys in everyone for coordinates in keys.values() for name, _ in coordinates}
    unknown = [g for g in gather if g not in names]
    if unknown:
        raise RemapError(Diagnostic(code="E542", message=f"gather={gather!r}: the mesh has no dim "
                                    f"`{unknown[0]}`", hint="the state dict's meshes have dims "
                                    + (", ".join(f"`{n}`" for n in sorted(names)) or "none (plain tensors)")))
    for ckpt_key in sorted(k for k, ranks in writers.items() if len(ranks) > 1):
        ranks = writers[ckpt_key]
        coords = [dict(everyone[r][ckpt_key]) for r in ranks]
        split = sorted({d for c in coords for d, v in c.items() if v != coords[0].get(d)}) \
            if all(coords) else ["(the whole job)"]
        outside = [d for d in split if d not in gather]
        if outside:
            shown = ", ".join(map(str, ranks[:6])) + (f" and {len(ranks) - 6} more" if len(ranks) > 6 else "")
            raise RemapError(Diagnostic(code="E541", message=f"checkpoint tensor `{ckpt_key}` is split over the mesh "
                                        f"dim(s) {', '.join(f'`{d}`' for d in outside)} (ranks {shown} hold "
                                        "its pieces), which `gather` does not name", hint="assemble it over them: "
                                        f"gather={tuple(dict.fromkeys((*gather, *outside)))!r}"))


def _rounds(plan, schedule: _Schedule, out, local, rank: int, world: int, by_round: bool) -> Iterator:
    """The pairs this rank assembles, each as soon as its round is done; with `by_round`, one list of them
    a round instead (empty where it assembles none), the same number of lists on every rank."""
    items: dict[int, list] = defaultdict(list)
    for item in plan.items:
        items[schedule.round_of[item.ckpt_key]].append(item)
    mine, tensor_at = defaultdict(list), _tensor_at(out)
    for key, o in schedule.owner.items():
        if o == rank:
            mine[schedule.round_of[key]].append(key)
    for t in range(schedule.rounds):
        assembling = {key: torch.empty(out.tensors[key].nbytes, dtype=torch.uint8) for key in mine[t]}
        collector = _Collector(out, tensor_at, schedule.owner, assembling, rank, world)
        if items[t]:
            run_write_plan(plan.model_copy(update={"items": tuple(items[t]), "encodes": ()}), collector,
                           local)
        if world > 1:
            collector.exchange(f"exporting round {t + 1} of {schedule.rounds}")
        items[t] = []
        pairs = []
        for key in mine[t]:
            info = out.tensors[key]
            if collector.filled[key] != info.nbytes:  # every byte has one writer: a bug in remapdsl if not
                raise RuntimeError(f"remapdsl bug: {collector.filled[key]} of the {info.nbytes} bytes of `{key}` "
                                   f"reached rank {rank}; please report it with the layout")
            tensor = assembling.pop(key).view(torch_dtype(info.dtype)).view(info.shape)
            if by_round:
                pairs.append((key, tensor))
            else:
                yield key, tensor
            del tensor  # the consumer's to keep or drop
        if by_round:
            yield pairs
            del pairs


def _tensor_at(out) -> Callable[[str, int], str]:
    """(file, offset) -> the checkpoint tensor whose bytes hold it: each file's tensors by offset, indexed once
    an export (zero-size tensors before a tensor at the same offset)."""
    by_file: dict[str, list] = defaultdict(list)
    for key, t in out.tensors.items():
        by_file[t.file].append((t.byte_offset, t.nbytes, key))
    files = {file: ([offset for offset, _, _ in sorted(entries)], [key for _, _, key in sorted(entries)])
             for file, entries in by_file.items()}

    def tensor_at(file: str, offset: int) -> str:
        starts, keys = files[file]
        return keys[bisect_right(starts, offset) - 1]

    return tensor_at


class _Collector:
    """`run_write_plan`'s writer: pieces of tensors this rank assembles go into their buffers, the others
    into the payload for their owner."""

    def __init__(self, out, tensor_at: Callable[[str, int], str], owner: dict[str, int], assembling: dict[str, torch.Tensor],
                 rank: int, world: int):
        self.out, self.tensor_at, self.owner, self.assembling, self.rank = out, tensor_at, owner, assembling, rank
        self.filled = dict.fromkeys(assembling, 0)
        self.outgoing: list[list] = [[] for _ in range(world)]
        self.lock = threading.Lock()

    def write_runs(self, file: str, runs, data: memoryview) -> None:
        key = self.tensor_at(file, runs.first)
        relative = runs._replace(first=runs.first - self.out.tensors[key].byte_offset)
        o = self.owner[key]
        if o == self.rank:
            self._scatter(key, relative, data)
        else:
            with self.lock:  # the bytes stay where they are (a shard, or the plan's staging) until sent
                self.outgoing[o].append((key, relative, data))

    def _scatter(self, key: str, runs, data) -> None:
        _copy_runs(self.assembling[key], runs, data)
        with self.lock:
            self.filled[key] += runs.total

    def payload(self) -> tuple[torch.Tensor, list[int]]:
        """What this rank sends each rank this round, in one buffer: per rank, the length of the
        description, the description (key and runs of each piece), the pieces' bytes."""
        metas = [pickle.dumps([(k, r, len(d)) for k, r, d in pieces], protocol=pickle.HIGHEST_PROTOCOL)
                 if pieces else b"" for pieces in self.outgoing]
        sizes = [(8 + len(m) + sum(len(d) for _, _, d in pieces)) if pieces else 0
                 for m, pieces in zip(metas, self.outgoing)]
        send = torch.empty(sum(sizes), dtype=torch.uint8)
        flat, at = send.numpy(), 0
        for meta, pieces in zip(metas, self.outgoing):
            for chunk in (struct.pack("<Q", len(meta)), meta, *(d for _, _, d in pieces)) if pieces else ():
                flat[at:at + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
                at += len(chunk)
        self.outgoing = [[] for _ in self.outgoing]
        return send, sizes

    def exchange(self, phase: str) -> None:
        """Send the pieces to their owners and scatter what the others sent into this rank's tensors; both
        buffers are freed on return, before the round's tensors are yielded (the consumer may hold them)."""
        received = dist.exchange(*self.payload(), phase)
        for r, payload in enumerate(received):
            if r != self.rank and payload.numel():
                self.unpack(payload)

    def unpack(self, payload: torch.Tensor) -> None:
        data = memoryview(payload.numpy())
        (n,) = struct.unpack("<Q", data[:8])
        at = 8 + n
        for key, runs, size in pickle.loads(data[8:at]):
            self._scatter(key, runs, data[at:at + size])
            at += size


def _regions(plan, out, local, bucket_bytes: int, empty: list[str]) -> Iterator[tuple]:
    """(key, offsets, tensor): each box of a checkpoint tensor this rank writes, a bucket at a time, in plan
    order; a tensor whose pieces are strided (no boxes) but which this rank writes whole is yielded whole."""
    for key in empty:
        info = out.tensors[key]
        yield key, (0,) * len(info.shape), torch.empty(info.shape, dtype=torch_dtype(info.dtype))
    tensor_at = _tensor_at(out)
    written: dict[str, int] = defaultdict(int)
    strided: set[str] = set()
    for item in plan.items:
        written[item.ckpt_key] += item.runs.total
        info = out.tensors[item.ckpt_key]
        try:
            _box(item.runs._replace(first=item.runs.first - info.byte_offset), info, item.ckpt_key)
        except RemapError:
            strided.add(item.ckpt_key)
    # the pieces of these are gathered into the whole tensor; any other strided one is E549 at its piece
    whole = {key for key in strided if written[key] == out.tensors[key].nbytes}
    assembling: dict[str, torch.Tensor] = {}  # a tensor of `whole` -> its bytes, until the last came
    filled: dict[str, int] = defaultdict(int)
    for batch in batches(list(plan.items), lambda item: item.runs.total, bucket_bytes):
        writer = _RegionWriter(out, tensor_at, whole, assembling, filled)
        run_write_plan(plan.model_copy(update={"items": tuple(batch), "encodes": ()}), writer, local, threads=1)
        yield from writer.regions


class _RegionWriter:
    """The writer of `_regions`: each piece's bytes become a tensor of its box (checkpoint order), or,
    for a tensor in `whole`, go into its buffer in `assembling` until every byte came."""

    def __init__(self, out, tensor_at: Callable[[str, int], str], whole: set[str], assembling: dict, filled: dict):
        self.out, self.tensor_at, self.regions = out, tensor_at, []
        self.whole, self.assembling, self.filled = whole, assembling, filled

    def write_runs(self, file: str, runs, data: memoryview) -> None:
        key = self.tensor_at(file, runs.first)
        info = self.out.tensors[key]
        runs = runs._replace(first=runs.first - info.byte_offset)
        if key in self.whole:
            if key not in self.assembling:
                self.assembling[key] = torch.empty(info.nbytes, dtype=torch.uint8)
            _copy_runs(self.assembling[key], runs, data)
            self.filled[key] += runs.total
            if self.filled[key] == info.nbytes:
                tensor = self.assembling.pop(key).view(torch_dtype(info.dtype)).view(info.shape)
                self.regions.append((key, (0,) * len(info.shape), tensor))
            return
        offsets, sizes = _box(runs, info, key)
        values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype(info.dtype)).view(sizes)
        self.regions.append((key, offsets, values))


def _copy_runs(buffer: torch.Tensor, runs, data) -> None:
    """`data` copied into the bytes of `buffer` that `runs` (from its first byte) cover."""
    shape = tuple(runs.counts) + (runs.length,)
    target = np.lib.stride_tricks.as_strided(buffer.numpy()[runs.first:], shape, tuple(runs.strides) + (1,))
    np.copyto(target, np.frombuffer(data, dtype=np.uint8).reshape(shape))


def _box(runs, info, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of a checkpoint tensor (row-major, `info`) that byte `runs` (from the tensor's first
    byte) cover, in order; E549 where they are no box (a strided piece: rows of a rope order)."""
    shape = tuple(info.shape)
    if not shape:
        return (), ()
    itemsize = info.nbytes // prod(shape)
    elements = [prod(shape[d + 1:]) for d in range(len(shape))]  # row-major element strides
    first, inner = runs.first // itemsize, runs.length // itemsize
    offsets = [(first // e) % n for e, n in zip(elements, shape)]
    j = next(d for d in range(len(shape)) if elements[d] <= inner and inner % elements[d] == 0)
    sizes = [1] * len(shape)
    sizes[j] = inner // elements[j]
    sizes[j + 1:] = shape[j + 1:]
    for count, stride in zip(runs.counts, runs.strides):  # each repeat: outer dims, the innermost first
        d = next((d for d in range(j) if elements[d] * itemsize == stride and sizes[d] == 1), None)
        while count > 1 and d is not None and d >= 0 and sizes[d] == 1:
            if count <= shape[d] - offsets[d]:
                sizes[d], count = count, 1
            elif offsets[d] == 0 and count % shape[d] == 0:  # whole rows of this dim, repeated outside it
                sizes[d], count, d = shape[d], count // shape[d], d - 1
            else:
                break
        if count > 1:
            break  # a repeat no dim takes: the sizes fall short of the piece's bytes
    # a box: every repeat taken by a dim, so the sizes hold all the piece's bytes, and within the tensor (a run
    # starting inside a row ends past it)
    if not (all(o + n <= m for o, n, m in zip(offsets, sizes, shape)) and prod(sizes) * itemsize == runs.total):
        raise RemapError(Diagnostic(code="E549", message=f"checkpoint tensor `{key}`: a piece this rank holds is "
                                    "no box of it (its rows are strided, as a rope order or an interleave "
                                    "leaves them)", hint="assemble whole tensors instead (regions=False, with "
                                    "the mesh dims it is split over in `gather`)"))
    return tuple(offsets), tuple(sizes)


def check_unquantized(compiled, why: str, hint: str) -> None:
    """E543: an export or an ingest moves checkpoint tensors' own values, never stored quantized parts."""
    if compiled.logical:
        raise RemapError(Diagnostic(code="E543", message=f"the rules dequantize `{compiled.logical[0].logical_key}`: "
                                    + why, hint=hint))


def _check_bucket(bucket_bytes) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise RemapError(Diagnostic(code="E544", message=f"bucket_bytes={bucket_bytes!r}: the most bytes a rank "
                                    "assembles at once is a whole number of bytes, 1 or more",
                                    hint="e.g. bucket_bytes=256 << 20 (256 MiB)"))
