"""Weight-sync benchmark (issue #39): a trainer's FSDP x EP shards of a Qwen3-MoE streamed into vLLM's
tensor-parallel per-rank layout on the same 4 gloo ranks, against `remapdsl.export` alone.

The trainer side is export_bench.py's (imported, not copied): a 1.02 GB bf16 Qwen3-MoE state dict in
transformers' layout as DTensors on `ep=2 x dp_shard=2`, experts `[Shard(0), Shard(1)]`, the rest
`[Replicate(), Shard(0)]`, random values made block by block so each rank makes only its shards. The
engine side is colocated, as RL frameworks run it (verl, OpenRLHF, slime: trainer and inference engine
on the same ranks): the same 4 processes are two vLLM replicas of tp=2, mesh `dp=2,tp=2`, each rank
holding vLLM 0.32's parameters (rules `vllm_qwen3_moe`: fused qkv_proj, stacked w13/w2 experts) cut as
the shipped layout plan `vllm_tp` cuts them: plain local tensors of `local_shard(...).shape`, made
and touched (NaN) before the timing, as an engine's weights already are.

Three phases, each in a fresh 4-rank job (`remapdsl.testing.ranks.run_ranks`), interleaved (export,
sync, ingest, ingest, sync, export, ...), `--runs` of each, every job holding both sides' shards:
  export  `remapdsl.export(trainer, "qwen3_moe", config=cfg, gather=("dp_shard",), bucket_bytes=B)`
          on every rank, each pair dropped as it comes (only its key kept): the export alone.
  sync    the same export with `by_round=True` (one list of pairs a round, the same number of rounds on
          every rank) and half the bucket (the other half is the transport's), then per round the
          transport: one `all_gather_object` of each rank's (key, shape, dtype) list, then for each rank
          in turn one `dist.broadcast` of its round's tensors packed into one flat buffer (at most half a
          bucket: what a rank assembles in a round is within the export's bucket; a round of one
          tensor is sent as it is, not copied), the
          buffer's tensors fed one by one to `remapdsl.ingest(engine, pairs, "vllm_qwen3_moe",
          like=<the HF checkpoint folder>, config=cfg, layout=plan, mesh="dp=2,tp=2")` on every rank,
          which keeps the parts of its shards and skips the rest. A round's buffer is freed before the
          next round is exported (its storage resized to 0, as FSDP frees unsharded parameters: ingest
          reads each pair before it asks for the next). So a rank holds its shards, its own round's
          tensors and one buffer: about one bucket beyond its shards.
  ingest  a reference: the same `ingest` fed every checkpoint tensor from the rank's own memory (the
          file read and copied before the timing), no export and no transport.
Afterwards (not timed) each sync and ingest rank checks its engine tensors bit for bit against a
`remapdsl.load` of the same model into the same vLLM shards from a Hugging Face checkpoint folder
written once by the parent with `safetensors` from export_bench.py's torch-op conversion
(bench/out/weight_sync_*; `--rebuild` writes it again); the export's keys, over the ranks, must be
every checkpoint key exactly once.

Reported per rank: wall time of the phase (each rank timing its own phase after a barrier; medians
over the jobs), the sync's split into the export's rounds, the transport (waiting for the other ranks
included) and the rest (ingest's plan, reads and checks); the peak RSS growth during the phase (VmHWM
reset to the current RSS right before it, /proc/self/clear_refs, as export_bench.py), when the rank
already holds its own shards (trainer + engine, made before the phase; their RSS is shown beside
their bytes): the memory the phase takes beyond them, against one bucket. Goals: sync / export alone
<= 1.2 (medians of the slowest rank); no rank above its own shards plus one bucket.

    python bench/weight_sync_bench.py [--runs 3] [--modes export,sync,ingest] [--layers 9] [--experts 32]
        [--bucket-mb 64] [--no-verify] [--rebuild]

(20-35 s a job on 2 shared cores, about 4 min with the defaults.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from export_bench import (
    DEFAULT_SPEC,
    MESH,
    RULES,
    make_tensor,
    peak_rss,
    qwen3_moe_config,
    rss_now,
    runtime_tensors,
    sharded_state,
    to_hf,
)
from plan_bench import reset_peak_rss

ENGINE_RULES = "vllm_qwen3_moe"
ENGINE_LAYOUT = "vllm_tp"
ENGINE_MESH = "dp=2,tp=2"
OUT = Path(__file__).resolve().parent / "out"
ALIGN = 64  # each tensor's offset in a packed buffer, so that any dtype's view of it is aligned


# ------------------------------------------------------------------------------------------ the engine side


def engine_plan(config: Mapping):
    """The shipped vLLM layout plan, its config-named unit counts resolved (its rules shard on `tp` and
    replicate on `dp`, the other engine replica)."""
    import remapdsl

    return remapdsl.read_layout(ENGINE_LAYOUT).resolved(config)


def engine_state(folder: str, config: Mapping, plan, mesh, rank: int) -> dict:
    """This rank's vLLM parameters: plain local tensors of its shard shapes, filled with NaN (touched)."""
    import torch

    import remapdsl
    from remapdsl.sharding import local_shard

    compiled = remapdsl.compile_rules(ENGINE_RULES, folder, config)
    out = {}
    for t in compiled.runtime_tensors:
        shape = local_shard(t.shape, mesh.sizes, remapdsl.layout_for(t.runtime_key, t.shape, plan, mesh),
                            mesh.coordinate(rank)).shape
        out[t.runtime_key] = torch.full(shape, float("nan"), dtype=getattr(torch, t.dtype))
    return out


# ------------------------------------------------------------------------------------------ the transport


class Transport:
    """Time and bytes of the transport on one rank."""

    def __init__(self) -> None:
        self.export_seconds = 0.0  # inside the export's rounds
        self.seconds = 0.0  # metadata, packing, broadcasts (waiting for peers included)
        self.rounds = 0
        self.sent = 0
        self.received = 0
        self.largest = 0  # the largest buffer


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def broadcast_rounds(groups: Iterator[list], rank: int, world: int, stats: Transport) -> Iterator[tuple]:
    """(checkpoint key, tensor) pairs of every rank's export on every rank: per round (`groups`:
    `export(..., by_round=True)`, one list a round on every rank), the ranks' (key, shape, dtype) lists
    exchanged, then each rank's tensors broadcast from it in one flat buffer, yielded as views of it."""
    import torch
    import torch.distributed as dist

    groups = iter(groups)
    flat = None
    while True:
        started = time.perf_counter()
        group = next(groups, None)
        stats.export_seconds += time.perf_counter() - started
        if group is None:
            return
        started = time.perf_counter()
        stats.rounds += 1
        metas: list = [None] * world
        dist.all_gather_object(metas, [(k, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.nbytes)
                                       for k, t in group])
        size = max((sum(_aligned(n) for *_, n in meta) for meta in metas), default=0)
        stats.largest = max(stats.largest, size)
        buffer = torch.empty(size, dtype=torch.uint8)
        for src, meta in enumerate(metas):
            if not meta:
                continue
            # a round of one tensor is sent as it is (its own length), others packed at aligned offsets
            flat = buffer[:meta[0][-1] if len(meta) == 1 else sum(_aligned(n) for *_, n in meta)]
            if src == rank and len(group) == 1:  # one tensor (one over the round's budget is alone): sent
                flat = group.pop()[1].reshape(-1).view(torch.uint8)  # as it is, no second copy of it
                stats.sent += flat.numel()
            elif src == rank:
                at = 0
                for _, t in group:
                    flat[at:at + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
                    at += _aligned(t.nbytes)
                group.clear()  # this rank's own tensors: the buffer holds them now
                stats.sent += flat.numel()
            else:
                stats.received += flat.numel()
            dist.broadcast(flat, src)
            stats.seconds += time.perf_counter() - started
            at = 0
            for key, shape, dtype, n in meta:
                yield key, flat[at:at + n].view(getattr(torch, dtype)).view(shape)
                at += _aligned(n)
            started = time.perf_counter()
        del group, flat
        # the consumer read every pair before asking for more, but still holds the last one: free the
        # buffer's memory now, not after the next round's export
        buffer.untyped_storage().resize_(0)
        del buffer
        stats.seconds += time.perf_counter() - started


# ------------------------------------------------------------------------------------------ on the ranks


def rank_phase(rank: int, world: int, mode: str, spec: dict, folder: str, bucket_bytes: int,
               verify: bool) -> dict:
    """One phase on one rank of a fresh job: make the trainer's and the engine's shards, then time `mode`
    and measure the growth of the peak RSS during it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    # loaded before the base RSS is taken, as DTensor's machinery is (below)
    import remapdsl
    import remapdsl.drivers.export
    import remapdsl.drivers.ingest

    mesh = init_device_mesh("cpu", tuple(n for _, n in MESH), mesh_dim_names=tuple(d for d, _ in MESH))
    DTensor.from_local(torch.zeros(2), mesh, [Replicate(), Shard(0)]).to_local()
    engine_mesh = remapdsl.parse_mesh(ENGINE_MESH)
    config = qwen3_moe_config(spec)
    plan = engine_plan(config)
    gc.collect()
    rss_base = rss_now()  # the process before any shard
    started = time.perf_counter()
    trainer = sharded_state(spec, mesh)
    engine = engine_state(folder, config, plan, engine_mesh, rank)
    trainer_bytes = sum(t.to_local().nbytes for t in trainer.values())
    engine_bytes = sum(t.nbytes for t in engine.values())
    rss_shards = rss_now()
    pairs = None
    if mode == "ingest":  # the whole checkpoint in this rank's own memory (copied from the file's mapping)
        from safetensors.torch import load_file

        pairs = {k: v.clone() for k, v in load_file(str(Path(folder) / "model.safetensors")).items()}
        gc.collect()
    setup = time.perf_counter() - started
    names: list[str] = []
    stats = Transport()
    report = None
    gc.collect()
    dist.barrier()
    reset = reset_peak_rss()
    rss_before, peak_before = rss_now(), peak_rss()
    started = time.perf_counter()
    if mode == "export":
        for name, tensor in remapdsl.export(trainer, RULES, config=config, gather=("dp_shard",),
                                            bucket_bytes=bucket_bytes):
            names.append(name)
            del tensor
    elif mode == "ingest":
        report = remapdsl.ingest(engine, iter(pairs.items()), ENGINE_RULES, like=folder, config=config,
                                 layout=plan, mesh=engine_mesh)
    else:
        groups = remapdsl.export(trainer, RULES, config=config, gather=("dp_shard",),
                                 bucket_bytes=bucket_bytes // 2, by_round=True)  # half for the transport
        report = remapdsl.ingest(engine, broadcast_rounds(groups, rank, world, stats), ENGINE_RULES,
                                 like=folder, config=config, layout=plan, mesh=engine_mesh)
    seconds = time.perf_counter() - started
    peak_after = peak_rss()
    growth = peak_after - (rss_before if reset else max(rss_before, peak_before))
    dist.barrier()
    differ: list[str] = []
    del pairs
    if mode != "export" and verify:  # not timed: the same shards loaded from the checkpoint's files
        want = {k: torch.full_like(v, float("nan")) for k, v in engine.items()}
        remapdsl.load(want, folder, ENGINE_RULES, config=config, layout=plan, mesh=engine_mesh)
        differ = sorted(k for k in engine
                        if not torch.equal(engine[k].view(torch.uint8), want[k].view(torch.uint8)))
        del want
    return {"seconds": seconds, "growth": growth, "reset": reset, "rss_base": rss_base,
            "rss_shards": rss_shards, "trainer_bytes": trainer_bytes, "engine_bytes": engine_bytes,
            "setup": setup, "names": names, "export_seconds": stats.export_seconds,
            "transport_seconds": stats.seconds, "rounds": stats.rounds, "sent": stats.sent,
            "received": stats.received, "largest": stats.largest, "differ": differ,
            "pairs": report.pairs if report else 0, "used": report.used if report else 0,
            "bytes_read": report.bytes_read if report else 0}


# ------------------------------------------------------------------------------------------ the parent


def checkpoint_folder(spec: Mapping[str, int], rebuild: bool) -> Path:
    """The model as a Hugging Face checkpoint (one safetensors file and config.json), written once by
    safetensors from the baseline conversion of export_bench.py: the engine's `like`, and what the sync's
    result is checked against."""
    from safetensors.torch import save_file

    folder = OUT / f"weight_sync_L{spec['layers']}_E{spec['experts']}_H{spec['hidden']}"
    if (folder / "config.json").is_file() and not rebuild:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").unlink(missing_ok=True)  # written last: a folder without it is incomplete
    tensors = {}
    for runtime_key, (shape, blocks) in runtime_tensors(spec).items():
        whole = make_tensor(runtime_key, shape, blocks)
        tensors.update({k: t.contiguous() for k, t in to_hf({runtime_key: whole}, spec)})
        del whole
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (folder / "config.json").write_text(json.dumps(qwen3_moe_config(spec), indent=1))
    return folder


def problems(mode: str, results: list[dict], keys: set[str]) -> list[str]:
    """What is wrong with a job: the export's keys over the ranks (each exactly once), or the sync's
    engine tensors against the load."""
    found = []
    if mode == "export":
        counts = Counter(n for r in results for n in r["names"])
        missing = sorted(keys - set(counts))
        twice = sorted(k for k, c in counts.items() if c > 1)
        if missing or set(counts) - keys:
            found.append(f"{len(missing)} keys never yielded, {len(set(counts) - keys)} unknown")
        if twice:
            found.append(f"{len(twice)} keys yielded more than once, e.g. {twice[:3]}")
    else:
        for i, r in enumerate(results):
            if r["pairs"] != len(keys):
                found.append(f"rank {i}: ingest saw {r['pairs']} pairs of {len(keys)}")
            if r["differ"]:
                found.append(f"rank {i}: {len(r['differ'])} engine tensors differ from the load, "
                             f"e.g. {r['differ'][:3]}")
    return found


def mb(n: float) -> str:
    return f"{n / 1e6:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", default="export,sync,ingest")
    parser.add_argument("--layers", type=int, default=DEFAULT_SPEC["layers"])
    parser.add_argument("--experts", type=int, default=DEFAULT_SPEC["experts"])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()

    import torch
    from safetensors import safe_open

    from remapdsl.testing.ranks import run_ranks

    torch.set_num_threads(1)
    spec = dict(DEFAULT_SPEC, layers=args.layers, experts=args.experts)
    modes = [m for m in args.modes.split(",") if m]
    bucket = args.bucket_mb << 20
    world = 1
    for _, n in MESH:
        world *= n
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    started = time.perf_counter()
    folder = checkpoint_folder(spec, args.rebuild)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    nbytes = (folder / "model.safetensors").stat().st_size
    print(f"model: Qwen3-MoE {spec}, bf16, {nbytes / 1e9:.3f} GB in {len(keys)} checkpoint tensors; "
          f"checkpoint {folder} ({time.perf_counter() - started:.1f} s)")
    trainer_mesh = " x ".join(f"{d}={n}" for d, n in MESH)
    print(f"{world} gloo ranks: trainer {trainer_mesh} (experts [Shard(0), Shard(1)], the rest "
          f"[Replicate(), Shard(0)]), engine {ENGINE_MESH} ({ENGINE_RULES}, layout {ENGINE_LAYOUT}); "
          f"bucket {args.bucket_mb} MiB; {args.runs} fresh jobs per mode, interleaved")

    order = []
    for r in range(args.runs):
        order += modes if r % 2 == 0 else modes[::-1]
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    failed: dict[str, str] = {}
    wrong: set[str] = set()
    for i, mode in enumerate(order):
        if mode in failed:
            continue
        started = time.perf_counter()
        try:
            results = run_ranks(rank_phase, world, mode, spec, str(folder), bucket, not args.no_verify,
                                timeout=args.timeout)
        except AssertionError as exc:  # a rank raised: shown, and that mode is not run again
            failed[mode] = str(exc)
            print(f"  job {i + 1} {mode:6s}: FAILED\n    " + "\n    ".join(str(exc).splitlines()[-12:]))
            continue
        found = problems(mode, results, keys)
        runs[mode].append(results)
        if found:
            wrong.add(mode)
        check = "keys" if mode == "export" else "pairs (not verified)" if args.no_verify else "engine tensors"
        each = ", ".join(f"{r['seconds']:.2f}" for r in results)
        growth = ", ".join(mb(r["growth"]) for r in results)
        print(f"  job {i + 1} {mode:6s}: {max(r['seconds'] for r in results):6.2f} s max over ranks "
              f"(per rank {each}); peak RSS growth MB per rank {growth}; {check} "
              f"{'ok' if not found else 'WRONG: ' + '; '.join(found)} "
              f"(job {time.perf_counter() - started:.1f} s, set-up {max(r['setup'] for r in results):.1f} s)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    modes = [m for m in modes if runs[m]]
    if not modes:
        return
    reset = all(r["reset"] for jobs in runs.values() for job in jobs for r in job)
    print("peak RSS: VmHWM reset to the current RSS just before the phase (/proc/self/clear_refs); growth = "
          "VmHWM after - RSS before the phase, when the rank already holds its shards: the memory the phase "
          "takes beyond them" if reset else
          "peak RSS: VmHWM deltas (the reset was refused: a growth may be hidden under an earlier peak)")
    if wrong:
        print(f"keys or tensors WRONG in some jobs of {sorted(wrong)}: their figures do not count")

    def med(mode: str, field: str, rank: int) -> float:
        return statistics.median(job[rank][field] for job in runs[mode])

    slowest = {m: statistics.median(max(r["seconds"] for r in job) for job in runs[m]) for m in modes}
    for m in modes:
        each = ", ".join(f"{max(r['seconds'] for r in job):.2f}" for job in runs[m])
        print(f"{m}: {slowest[m]:.2f} s median of the slowest rank ({each})")
    print(f"per rank, medians over the jobs (one bucket: {args.bucket_mb} MiB = {mb(bucket)} MB):")
    for rank in range(world):
        first = runs[modes[0]][0][rank]
        shards = first["trainer_bytes"] + first["engine_bytes"]
        resident = statistics.median(job[rank]["rss_shards"] - job[rank]["rss_base"]
                                     for m in modes for job in runs[m])
        parts = [(f"rank {rank}: own shards {mb(shards)} MB (trainer {mb(first['trainer_bytes'])}, engine "
                  f"{mb(first['engine_bytes'])}); its RSS once they are made {mb(resident)} MB above the "
                  f"process before them")]
        for m in modes:
            growth = med(m, "growth", rank)
            peak = "" if m == "ingest" else f" (peak = own shards + {mb(resident - shards + growth)} MB)"
            parts.append(f"{m}: {med(m, 'seconds', rank):.2f} s; peak RSS growth {mb(growth)} MB = "
                         f"{growth / bucket:.2f} buckets{peak}")
            if m == "sync":
                first = runs[m][0][rank]
                exported, moved = med(m, "export_seconds", rank), med(m, "transport_seconds", rank)
                rest = statistics.median(job[rank]["seconds"] - job[rank]["export_seconds"]
                                         - job[rank]["transport_seconds"] for job in runs[m])
                parts.append(f"  sync split: export rounds {exported:.2f} s, transport {moved:.2f} s, ingest "
                             f"(plan, reads, checks) {rest:.2f} s; {first['rounds']} rounds, sent "
                             f"{mb(first['sent'])} MB, received {mb(first['received'])} MB, largest buffer "
                             f"{first['largest'] / 2**20:.1f} MiB; ingest read {mb(first['bytes_read'])} MB "
                             f"from {first['used']} of {first['pairs']} pairs")
        print("  " + "\n    ".join(parts))
    if "sync" in slowest:
        growth = [max(r["growth"] for r in job) for job in runs["sync"]]
        worst = statistics.median(growth)
        print(f"memory, sync: the largest growth over the ranks {mb(worst)} MB median "
              f"({', '.join(mb(x) for x in growth)}) = {worst / bucket:.2f} buckets "
              f"(goal <= 1 bucket beyond the shards: {'meets' if worst <= bucket else 'MISSES'})")
    if "export" in slowest:
        growth = [max(r["growth"] for r in job) for job in runs["export"]]
        worst = statistics.median(growth)
        print(f"memory, export alone: the largest growth over the ranks {mb(worst)} MB median "
              f"({', '.join(mb(x) for x in growth)}) = {worst / bucket:.2f} buckets")
    if "sync" in slowest and "export" in slowest:
        ratio = slowest["sync"] / slowest["export"]
        verdict = "meets" if ratio <= 1.2 else "MISSES"
        print(f"time sync / export alone: {ratio:.2f}x (goal <= 1.2: {verdict})")
        if "ingest" in slowest:
            extra = slowest["sync"] - slowest["export"]
            print(f"of the sync's {extra:.2f} s beyond the export, ingest alone (the same pairs from memory, "
                  f"no transport) takes {slowest['ingest']:.2f} s")

if __name__ == "__main__":
    main()
