"""Export benchmark (issue #16): a sharded Qwen3-MoE streamed in the Hugging Face layout on 4 gloo ranks
by `remapdsl.export`, against gathering the whole model to rank 0 and converting it there.

The model is a state dict in transformers' in-memory Qwen3-MoE layout (what `rules/qwen3_moe.remap`
loads into: per layer `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I],
attention q/k/v/o with q/k norms, layer norms, router `mlp.gate.weight`, embed and an untied lm_head),
bf16, about 1.02 GB with the default sizes, no weights downloaded: random values, generated in fixed
blocks under seeds derived from the key, so that each rank makes only the blocks of its shards and the
parent makes the whole tensors (once, for the expected checksums). The ranks hold DTensors on
`init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp_shard"))`: stacked experts
`[Shard(0), Shard(1)]` (experts split by ep, then rows by dp_shard), every other tensor
`[Replicate(), Shard(0)]` (FSDP-style rows over dp_shard, replicated over ep).

Two phases, each in a fresh 4-rank job (`remapdsl.testing.ranks.run_ranks`), interleaved
(export, baseline, baseline, export, ...), `--runs` of each (median of 3 by default):
  export    `remapdsl.export(sharded, "qwen3_moe", config=cfg, gather=("dp_shard",),
            bucket_bytes=64 << 20)` on every rank, each pair fed to the consumer on that rank.
  baseline  `full_tensor()` of every DTensor on every rank (ranks other than 0 drop each at once),
            then on rank 0 the HF conversion by torch ops (experts unbound, gate_up chunked into
            gate and up) fed to the same consumer.
The consumer (vLLM `load_weights`-style: `(name, tensor)` pairs) checks each tensor's shape, dtype
and a cheap position-weighted checksum of its bits against the expected HF tensor and counts the
keys; the parent checks that the union over ranks is every checkpoint key exactly once.
Reported: wall time (max over ranks, each rank timing its own phase after a barrier), the ratio
baseline / export (goal >= 2), and peak RSS growth of the phase per rank: the rank's high-water
mark reset to its current RSS (/proc/self/clear_refs, Linux >= 4.0) right before the phase, then
VmHWM after it minus the RSS before; ru_maxrss deltas where the reset is refused. Goal: the
export's maximum over ranks <= 1/3 of the baseline's rank 0. A self-check first saves a tiny model
of the same layout with `remapdsl.save` (no `like`) and compares the files with the baseline's
conversion, so that both sides are held to the layout the rules define.

    python bench/export_bench.py [--runs 3] [--modes export,baseline] [--layers 9] [--experts 32]
        [--bucket-mb 64] [--no-self-check]

(3.2 min of CPU; 3-4 min on 2 shared cores). Without `remapdsl.export` (not yet merged) only the baseline runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_bench import reset_peak_rss

RULES = "qwen3_moe"
MESH = (("ep", 2), ("dp_shard", 2))
DEFAULT_SPEC = {"layers": 9, "experts": 32, "hidden": 1024, "moe_intermediate": 512, "vocab": 16384,
                "heads": 16, "kv_heads": 4, "head_dim": 64}
TINY_SPEC = {"layers": 2, "experts": 4, "hidden": 64, "moe_intermediate": 32, "vocab": 256,
             "heads": 4, "kv_heads": 2, "head_dim": 16}


# ------------------------------------------------------------------------------------------ the model


def qwen3_moe_config(spec: Mapping[str, int]) -> dict:
    """The config dict of a Qwen3-MoE model of these sizes (what the rules and the export read)."""
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": spec["hidden"], "intermediate_size": 4 * spec["moe_intermediate"],
            "moe_intermediate_size": spec["moe_intermediate"], "num_experts": spec["experts"],
            "num_experts_per_tok": 2, "num_hidden_layers": spec["layers"],
            "num_attention_heads": spec["heads"], "num_key_value_heads": spec["kv_heads"],
            "head_dim": spec["head_dim"], "vocab_size": spec["vocab"], "tie_word_embeddings": False,
            "mlp_only_layers": [], "decoder_sparse_step": 1, "rms_norm_eps": 1e-6, "dtype": "bfloat16"}


def runtime_tensors(spec: Mapping[str, int]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """runtime_key -> (global shape, blocks per dim): the grid the values are generated in. Stacked
    experts are cut per expert and in two along dim 1, the rest in two along dim 0, so that every
    shard of the mesh is a whole number of blocks."""
    h, e, i, d = spec["hidden"], spec["experts"], spec["moe_intermediate"], spec["head_dim"]
    q, kv = spec["heads"] * d, spec["kv_heads"] * d
    out: dict = {"model.embed_tokens.weight": ((spec["vocab"], h), (2, 1))}
    for layer in range(spec["layers"]):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = ((h,), (2,))
        out[p + "post_attention_layernorm.weight"] = ((h,), (2,))
        out[p + "self_attn.q_proj.weight"] = ((q, h), (2, 1))
        out[p + "self_attn.k_proj.weight"] = ((kv, h), (2, 1))
        out[p + "self_attn.v_proj.weight"] = ((kv, h), (2, 1))
        out[p + "self_attn.o_proj.weight"] = ((h, q), (2, 1))
        out[p + "self_attn.q_norm.weight"] = ((d,), (2,))
        out[p + "self_attn.k_norm.weight"] = ((d,), (2,))
        out[p + "mlp.gate.weight"] = ((e, h), (2, 1))
        out[p + "mlp.experts.gate_up_proj"] = ((e, 2 * i, h), (e, 2, 1))
        out[p + "mlp.experts.down_proj"] = ((e, h, i), (e, 2, 1))
    out["model.norm.weight"] = ((h,), (2,))
    out["lm_head.weight"] = ((spec["vocab"], h), (2, 1))
    return out


def is_experts(runtime_key: str) -> bool:
    return ".mlp.experts." in runtime_key


def make_tensor(runtime_key: str, shape: tuple[int, ...], blocks: tuple[int, ...],
                first: tuple[int, ...] | None = None, count: tuple[int, ...] | None = None):
    """The blocks `first[d]:first[d] + count[d]` of a tensor (all of it by default), each block
    random bf16 under its own seed: a shard made alone equals the same region of the whole."""
    import itertools

    import torch

    first = first or (0,) * len(shape)
    count = count or blocks
    size = tuple(s // b for s, b in zip(shape, blocks))
    out = torch.empty(tuple(z * c for z, c in zip(size, count)), dtype=torch.bfloat16)
    for index in itertools.product(*(range(c) for c in count)):
        at = tuple(f + j for f, j in zip(first, index))
        g = torch.Generator().manual_seed(zlib.crc32(f"{runtime_key}/{at}".encode()))
        region = tuple(slice(j * z, (j + 1) * z) for j, z in zip(index, size))
        out[region] = torch.randn(size, generator=g, dtype=torch.bfloat16)
    return out


def to_hf(state: Mapping, spec: Mapping[str, int]) -> Iterator[tuple[str, object]]:
    """The baseline's conversion of whole runtime tensors to Hugging Face checkpoint tensors, by
    torch ops (views: nothing is copied): experts unbound, gate_up chunked into gate and up."""
    for runtime_key, t in state.items():
        if runtime_key.endswith("mlp.experts.gate_up_proj"):
            prefix = runtime_key[: -len("gate_up_proj")]
            for e, fused in enumerate(t.unbind(0)):
                gate, up = fused.chunk(2, dim=0)
                yield f"{prefix}{e}.gate_proj.weight", gate
                yield f"{prefix}{e}.up_proj.weight", up
        elif runtime_key.endswith("mlp.experts.down_proj"):
            prefix = runtime_key[: -len("down_proj")]
            for e, down in enumerate(t.unbind(0)):
                yield f"{prefix}{e}.down_proj.weight", down
        else:
            yield runtime_key, t


def checksum(t) -> tuple[int, int]:
    """Position-weighted sums of a tensor's bits, read 8 bytes at a time (~6 GB/s on one core):
    rows weighted by their index, and 8-byte columns by theirs, so moved rows or columns show."""
    import torch

    flat = t.contiguous().reshape(t.shape[0] if t.dim() > 1 else 1, -1)
    if flat.shape[1] * flat.element_size() % 8:  # rows of an odd byte length: 2 bytes at a time
        words = flat.view(torch.int16) if flat.element_size() == 2 else flat.view(torch.uint8)
        rows, cols = words.sum(1, dtype=torch.int64), words.sum(0, dtype=torch.int64)
    else:
        words = flat.view(torch.int64)
        rows, cols = words.sum(1), words.sum(0)
    return (int((rows * torch.arange(1, rows.numel() + 1)).sum()),
            int((cols * torch.arange(1, cols.numel() + 1)).sum()))


def expected_checksums(spec: Mapping[str, int]) -> dict[str, tuple]:
    """checkpoint_key -> (shape, dtype, checksum) of every HF tensor, from the whole runtime tensors
    made one at a time."""
    out = {}
    for runtime_key, (shape, blocks) in runtime_tensors(spec).items():
        whole = make_tensor(runtime_key, shape, blocks)
        for ckpt_key, t in to_hf({runtime_key: whole}, spec):
            out[ckpt_key] = (tuple(t.shape), str(t.dtype), checksum(t))
        del whole
    return out


class Consumer:
    """A vLLM `load_weights`-style sink: takes `(name, tensor)` pairs, checks each against the
    expected tensor's shape, dtype and checksum, and keeps the names it got."""

    def __init__(self, expected: Mapping[str, tuple]) -> None:
        self.expected = expected
        self.names: list[str] = []
        self.bad: list[str] = []
        self.nbytes = 0
        self.seconds = 0.0

    def __call__(self, name: str, tensor) -> None:
        started = time.perf_counter()
        self._check(name, tensor)
        self.seconds += time.perf_counter() - started

    def _check(self, name: str, tensor) -> None:
        self.names.append(name)
        self.nbytes += tensor.numel() * tensor.element_size()
        want = self.expected.get(name)
        if want is None:
            self.bad.append(f"{name}: not a checkpoint key")
            return
        got = (tuple(tensor.shape), str(tensor.dtype))
        if got != want[:2]:
            self.bad.append(f"{name}: {got} where {want[:2]} was expected")
        elif checksum(tensor) != want[2]:
            self.bad.append(f"{name}: checksum differs")


# ------------------------------------------------------------------------------------------ on the ranks


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """VmHWM: the process's peak RSS since it started or since `reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024




def sharded_state(spec: Mapping[str, int], mesh) -> dict:
    """This rank's DTensors: experts [Shard(0), Shard(1)] on (ep, dp_shard), the rest
    [Replicate(), Shard(0)]; each rank makes only the blocks of its own shards."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ep, dp = mesh.get_coordinate()
    n_ep, n_dp = mesh.size(0), mesh.size(1)
    state = {}
    for runtime_key, (shape, blocks) in runtime_tensors(spec).items():
        if is_experts(runtime_key):
            per = blocks[0] // n_ep
            first, count = (ep * per, dp * blocks[1] // n_dp, 0), (per, blocks[1] // n_dp, 1)
            placements = [Shard(0), Shard(1)]
        else:
            per = blocks[0] // n_dp
            first = (dp * per,) + (0,) * (len(shape) - 1)
            count = (per,) + blocks[1:]
            placements = [Replicate(), Shard(0)]
        local = make_tensor(runtime_key, shape, blocks, first, count)
        stride = torch.empty(shape, device="meta").stride()
        state[runtime_key] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                                stride=stride)
    return state


def rank_phase(rank: int, world: int, mode: str, spec: dict, expected: dict, bucket_bytes: int) -> dict:
    """One phase on one rank of a fresh job: build the shards, then time `mode` and measure the
    growth of the peak RSS during it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import remapdsl

    mesh = init_device_mesh("cpu", tuple(n for _, n in MESH), mesh_dim_names=tuple(d for d, _ in MESH))
    started = time.perf_counter()
    state = sharded_state(spec, mesh)
    shard_bytes = sum(t.to_local().nbytes for t in state.values())
    setup = time.perf_counter() - started
    config = qwen3_moe_config(spec)
    consumer = Consumer(expected)
    gc.collect()
    dist.barrier()
    reset = reset_peak_rss()
    rss_before, peak_before = rss_now(), peak_rss()
    started = time.perf_counter()
    if mode == "export":
        for name, tensor in remapdsl.export(state, RULES, config=config, gather=("dp_shard",),
                                            bucket_bytes=bucket_bytes):
            consumer(name, tensor)
    else:
        gathered = {}
        for runtime_key, t in state.items():
            whole = t.full_tensor()  # a collective: every rank takes part
            if rank == 0:
                gathered[runtime_key] = whole
            del whole
        if rank == 0:
            for name, tensor in to_hf(gathered, spec):
                consumer(name, tensor)
        del gathered
    seconds = time.perf_counter() - started
    peak_after = peak_rss()
    growth = peak_after - (rss_before if reset else max(rss_before, peak_before))
    dist.barrier()
    return {"seconds": seconds, "growth": growth, "reset": reset, "rss_before": rss_before,
            "shard_bytes": shard_bytes, "setup": setup, "names": consumer.names, "bad": consumer.bad[:10],
            "n_bad": len(consumer.bad), "nbytes": consumer.nbytes, "consumer": consumer.seconds}


# ------------------------------------------------------------------------------------------ the parent


def self_check() -> str:
    """Save a tiny model of this layout with `remapdsl.save` (no `like`) and compare every file
    tensor with the baseline's conversion: '' when equal, else what differs."""
    import torch
    from safetensors import safe_open

    import remapdsl

    state = {k: make_tensor(k, shape, blocks) for k, (shape, blocks) in runtime_tensors(TINY_SPEC).items()}
    want = {k: t for k, t in to_hf(state, TINY_SPEC)}
    with tempfile.TemporaryDirectory(prefix="export-bench-") as tmp:
        out = os.path.join(tmp, "ckpt")
        remapdsl.save(state, out, RULES, config=qwen3_moe_config(TINY_SPEC))
        got = {}
        for f in sorted(Path(out).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as handle:
                got.update({k: handle.get_tensor(k) for k in handle.keys()})  # noqa: SIM118
    if set(got) != set(want):
        return f"keys differ: {sorted(set(got) ^ set(want))[:5]}"
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    return f"{len(differ)} tensors differ, e.g. {differ[:3]}" if differ else ""


def key_problems(results: list[dict], expected: Mapping) -> list[str]:
    """What is wrong with the union of the names the ranks' consumers got (each key exactly once)
    and with their checks."""
    counts = Counter(n for r in results for n in r["names"])
    found = [f"rank {i}: {r['n_bad']} bad tensors, e.g. {r['bad'][:3]}" for i, r in enumerate(results) if r["n_bad"]]
    missing = [k for k in expected if k not in counts]
    twice = [k for k, c in counts.items() if c > 1]
    if missing:
        found.append(f"{len(missing)} keys never yielded, e.g. {missing[:3]}")
    if twice:
        found.append(f"{len(twice)} keys yielded more than once, e.g. {twice[:3]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", default="export,baseline")
    parser.add_argument("--layers", type=int, default=DEFAULT_SPEC["layers"])
    parser.add_argument("--experts", type=int, default=DEFAULT_SPEC["experts"])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--no-self-check", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()

    import torch

    import remapdsl
    from remapdsl.testing.ranks import run_ranks

    torch.set_num_threads(1)
    spec = dict(DEFAULT_SPEC, layers=args.layers, experts=args.experts)
    modes = [m for m in args.modes.split(",") if m]
    if "export" in modes and not hasattr(remapdsl, "export"):
        print("remapdsl.export is not in this tree yet: the baseline runs alone")
        modes = [m for m in modes if m != "export"]
    world = 1
    for _, n in MESH:
        world *= n
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    if not args.no_self_check:
        started = time.perf_counter()
        why = self_check()
        print(f"self-check (tiny model, remapdsl.save without like == the baseline's conversion): "
              f"{'ok' if not why else 'FAILED: ' + why} ({time.perf_counter() - started:.1f} s)")
    started = time.perf_counter()
    expected = expected_checksums(spec)
    total = len(expected)
    nbytes = sum(torch.Size(s).numel() * 2 for s, _, _ in expected.values())
    print(f"model: Qwen3-MoE {spec}, bf16, {nbytes / 1e9:.3f} GB in {total} checkpoint tensors "
          f"({len(runtime_tensors(spec))} runtime tensors); expected checksums {time.perf_counter() - started:.1f} s")
    print(f"{world} gloo ranks, mesh {' x '.join(f'{d}={n}' for d, n in MESH)}; experts [Shard(0), Shard(1)], "
          f"the rest [Replicate(), Shard(0)]; bucket {args.bucket_mb} MiB; {args.runs} fresh jobs per mode, interleaved")

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
            results = run_ranks(rank_phase, world, mode, spec, expected, args.bucket_mb << 20, timeout=args.timeout)
        except AssertionError as exc:  # a rank raised: shown, and that mode is not run again
            failed[mode] = str(exc)
            print(f"  job {i + 1} {mode:8s}: FAILED\n    " + "\n    ".join(str(exc).splitlines()[-12:]))
            continue
        problems = key_problems(results, expected) if mode == "export" else \
            key_problems(results[:1], expected)
        runs[mode].append(results)
        if problems:
            wrong.add(mode)
        seconds = max(r["seconds"] for r in results)
        growth = ", ".join(f"{r['growth'] / 1e6:.0f}" for r in results)
        each = ", ".join(f"{r['seconds']:.2f}" for r in results)
        print(f"  job {i + 1} {mode:8s}: {seconds:6.2f} s (max over ranks; per rank {each}), "
              f"peak RSS growth MB per rank {growth}; "
              f"keys {'ok' if not problems else 'WRONG: ' + '; '.join(problems)} "
              f"(job {time.perf_counter() - started:.1f} s, set-up {max(r['setup'] for r in results):.1f} s)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    modes = [m for m in modes if runs[m]]
    if not modes:
        return
    reset = all(r["reset"] for jobs in runs.values() for job in jobs for r in job)
    print("peak RSS: VmHWM reset to the current RSS just before the phase (/proc/self/clear_refs), growth = "
          "VmHWM after - RSS before" if reset else "peak RSS: ru_maxrss/VmHWM delta (the reset was refused)")
    shards = runs[modes[0]][0]
    print("shards per rank: " + ", ".join(f"{r['shard_bytes'] / 1e6:.1f} MB" for r in shards))
    seconds = {m: [max(r["seconds"] for r in job) for job in runs[m]] for m in modes}
    med = {m: statistics.median(v) for m, v in seconds.items()}
    if "baseline" in med:
        peaks = [job[0]["growth"] for job in runs["baseline"]]
        base_peak = statistics.median(peaks)
        print(f"baseline: {med['baseline']:.2f} s median ({', '.join(f'{x:.2f}' for x in seconds['baseline'])}); "
              f"rank 0 peak RSS growth {base_peak / 1e6:.0f} MB median ({', '.join(f'{x / 1e6:.0f}' for x in peaks)}); "
              f"rank 0's consumer {statistics.median(job[0]['consumer'] for job in runs['baseline']):.2f} s of it")
    if "export" in med:
        peaks = [max(r["growth"] for r in job) for job in runs["export"]]
        exp_peak = statistics.median(peaks)
        print(f"export: {med['export']:.2f} s median ({', '.join(f'{x:.2f}' for x in seconds['export'])}); "
              f"peak RSS growth, max over ranks, {exp_peak / 1e6:.0f} MB median "
              f"({', '.join(f'{x / 1e6:.0f}' for x in peaks)}) = {exp_peak / (args.bucket_mb << 20):.2f} buckets; consumers "
              f"{statistics.median(max(r['consumer'] for r in job) for job in runs['export']):.2f} s (max over ranks); "
              f"keys yielded per rank {[len(r['names']) for r in runs['export'][0]]}")
    if wrong:
        print(f"keys or checksums WRONG in some jobs of {sorted(wrong)}: their figures do not count")
    if "baseline" in med and "export" in med:
        ratio = med["baseline"] / med["export"]
        share = exp_peak / base_peak if base_peak else float("inf")
        print(f"time baseline / export: {ratio:.2f}x (goal >= 2: {'meets' if ratio >= 2 else 'MISSES'}); "
              f"peak export max / baseline rank 0: {share:.2f} (goal <= 0.33: {'meets' if share <= 1 / 3 else 'MISSES'})")


if __name__ == "__main__":
    main()
