"""Consolidating a DCP-sharded checkpoint into the hub layout: `remapdsl convert` with identity rules
against torch's own `consolidate_safetensors_files`, on the same folder, in the same run.

The checkpoint (~1.04 GB, bf16, Llama-style names: 11 layers of q/k/v/o/gate/up/down at hidden 2048,
intermediate 5632, 32/4 heads, plus embed_tokens and lm_head at vocab 8192) is written once by
torch's `HuggingFaceStorageWriter(save_distributed=True)` from 2 gloo ranks holding DTensors (o_proj
and down_proj sharded on dim 1, the rest on dim 0; norms replicated), into two output files
(`fqn_to_index_mapping`), and cached under bench/out/ (git-ignored).

Each run is a fresh child process (`--child`) that imports torch and both consolidators, warms the
input files (reads them once), then consolidates into an empty folder and reports its wall time
(imports excluded; remapdsl's includes reading the headers, compiling the rules, and its fsync of
the output before the rename, which torch does not do) and its own peak RSS
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`, which includes the interpreter and torch's import);
the modes alternate, `--runs` rounds (default 3), medians. Round 1 checks that both outputs hold the
same tensors (values and dtypes), read back with safetensors' own `safe_open`.

    remapdsl  remapdsl.convert(src, dst, "identity", budget_bytes=--memory), one process (default 1GB, as
              `remapdsl convert --memory`; forward batches hold at most 64 MiB)
    torch     torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files(
              src, dst, fqn_to_index_mapping) (num_threads=1, its default)

    python bench/consolidate_bench.py [--runs 3] [--memory 1GB] [--rebuild]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
SOURCE = OUT / "consolidate_dcp"
LAYERS, HIDDEN, INTER, HEADS, KV, VOCAB = 11, 2048, 5632, 32, 4, 8192


def _shapes() -> dict[str, tuple[int, ...]]:
    hd = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
              "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (HEADS * hd, HIDDEN), p + "self_attn.k_proj.weight": (KV * hd, HIDDEN),
            p + "self_attn.v_proj.weight": (KV * hd, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HEADS * hd),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER), p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,)})
    return shapes


def mapping() -> dict[str, int]:
    """Each key's output file (1 or 2): the first half of the keys, then the second."""
    keys = sorted(_shapes())
    return {k: 1 + (i * 2 // len(keys)) for i, k in enumerate(keys)}


def _write_rank(rank: int, world: int, folder: str) -> None:
    """One writer rank: its local shard of every tensor (random, seeded by key and rank), saved by DCP."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for n, (key, shape) in enumerate(sorted(_shapes().items())):
        gen = torch.Generator().manual_seed(n * 16 + rank)
        if len(shape) == 1:
            local = torch.randn(shape, generator=torch.Generator().manual_seed(n * 16)).to(torch.bfloat16)
            state[key] = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
            continue
        dim = 1 if key.endswith(("o_proj.weight", "down_proj.weight")) else 0
        local_shape = list(shape)
        local_shape[dim] //= world
        local = torch.randn(local_shape, generator=gen).to(torch.bfloat16)
        state[key] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                        stride=torch.empty(shape, device="meta").stride())
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True,
                                                            fqn_to_index_mapping=mapping()))


def build(rebuild: bool) -> Path:
    if SOURCE.exists() and not rebuild:
        return SOURCE
    sys.path.insert(0, str(HERE.parent))
    from remapdsl.testing.ranks import run_ranks

    shutil.rmtree(SOURCE, ignore_errors=True)
    SOURCE.mkdir(parents=True)
    start = time.perf_counter()
    run_ranks(_write_rank, 2, str(SOURCE), timeout=900)
    print(f"wrote {SOURCE} with 2 gloo ranks in {time.perf_counter() - start:.1f} s", flush=True)
    return SOURCE


def _warm(folder: Path) -> None:
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def child(mode: str, src: str, dst: str, memory: int) -> None:
    import torch  # noqa: F401 - imported before the timing by both: the figure is the consolidation
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    import remapdsl
    import remapdsl.drivers.convert

    _warm(Path(src))
    start = time.perf_counter()
    if mode == "remapdsl":
        remapdsl.convert(src, dst, "identity", budget_bytes=memory)
    else:
        os.makedirs(dst)
        consolidate_safetensors_files(src, dst, mapping())
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"seconds": seconds, "peak_rss": rss}))


def _same(a: Path, b: Path) -> None:
    """Both outputs hold the same keys, dtypes and values (one tensor in memory at a time)."""
    import torch
    from safetensors import safe_open

    def where(folder: Path) -> dict[str, Path]:
        out = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                out.update(dict.fromkeys(f.keys(), path))
        return out

    ours, theirs = where(a), where(b)
    assert sorted(ours) == sorted(theirs), "different keys"
    for key in sorted(ours):
        with safe_open(str(ours[key]), "pt") as f, safe_open(str(theirs[key]), "pt") as g:
            x, y = f.get_tensor(key), g.get_tensor(key)
        assert x.dtype == y.dtype and torch.equal(x, y), key


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[:-2]) * factor)
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--memory", default="1GB", help="remapdsl's budget (budget_bytes; the CLI's --memory)")
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, _size(args.memory))
        return
    src = build(args.rebuild)
    data = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"checkpoint: {src} ({data / 1e9:.2f} GB, {len(list(src.glob('*.safetensors')))} files); "
          f"remapdsl budget {args.memory}; {args.runs} rounds", flush=True)
    figures: dict[str, list[dict]] = {"remapdsl": [], "torch": []}
    with tempfile.TemporaryDirectory(dir=OUT, prefix="consolidated-") as scratch:
        for round_ in range(args.runs):
            order = ("remapdsl", "torch") if round_ % 2 == 0 else ("torch", "remapdsl")
            for mode in order:
                dst = Path(scratch) / mode
                shutil.rmtree(dst, ignore_errors=True)
                done = subprocess.run([sys.executable, __file__, "--memory", args.memory, "--child", mode, str(src),
                                       str(dst)], check=True, capture_output=True, text=True, cwd=HERE.parent)
                got = json.loads(done.stdout.strip().splitlines()[-1])
                figures[mode].append(got)
                print(f"round {round_ + 1} {mode:9s} {got['seconds']:6.2f} s  peak RSS {got['peak_rss'] / 2**20:7.0f} MiB",
                      flush=True)
            if round_ == 0:
                _same(Path(scratch) / "remapdsl", Path(scratch) / "torch")
                print("round 1: both outputs hold the same tensors (values and dtypes)", flush=True)
    print()
    print(f"{'mode':9s} {'median s':>9s} {'GB/s':>6s} {'peak RSS MiB':>13s}")
    for mode, rows in figures.items():
        seconds = statistics.median(r["seconds"] for r in rows)
        rss = statistics.median(r["peak_rss"] for r in rows)
        print(f"{mode:9s} {seconds:9.2f} {data / seconds / 1e9:6.2f} {rss / 2**20:13.0f}")
    speed = statistics.median(r["seconds"] for r in figures["torch"]) / \
        statistics.median(r["seconds"] for r in figures["remapdsl"])
    print(f"remapdsl is {speed:.2f}x torch's speed")


if __name__ == "__main__":
    main()
