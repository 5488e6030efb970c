"""Distributed-load benchmarks: single-process throughput, a 2-rank resharded load against DCP, TP=4 bytes.

Three measurements, each alone with its flag (none given: all three). Every figure is set beside a
baseline timed in the same run; timed modes run in fresh processes, interleaved, 5 rounds (median),
and each child warms the checkpoint files with `cat` right before each timing (a cold page cache on these VMs reads at a fraction of memory speed).
Each remapdsl (and DCP) child loads twice: the process's first call is the figure, and it includes
remapdsl's one-off costs (building the rule grammar's parser, mostly); the second call, into the
same destinations after warming the files again, is shown beside it.
The checkpoints are plain 2-D bf16 tensors with Llama-style Hugging Face names (q/k/v/o/gate/up/down
per layer, embed_tokens, lm_head; random values under a fixed seed), written once as two shards
plus `model.safetensors.index.json` and cached under bench/out/ (git-ignored). The rule files the
benchmark uses are written to bench/out/dist_rules_*.remap on every run.

--single  ~1.04 GB checkpoint (11 layers, hidden 2048, intermediate 5632, 32/4 heads, vocab 8192).
          preadv-touched      baseline (the machine limit): every byte of the files' data sections
                              read with os.preadv on 2 threads into memory touched beforehand
                              (load_bench.child_preadv).
          remapdsl-concat     remapdsl.load into destinations allocated and zeroed before the timing,
                              through rules (a): renames, q/k/v and gate/up `concat(dim=0)`, o_proj
                              and down_proj `stack(L, dim=0)` over the layers.
          remapdsl-transpose  the same, through rules (b): every projection `transpose(0, 1)` into
                              [in, out] kernels (Flax style); the embedding is a rename.
          copy-transpose      shown only: safetensors mmap views `copy_`-ed transposed into touched
                              memory, i.e. torch's own transpose-copy speed on this machine.
          Goals, as fractions of the limit (preadv median / mode median, 1st call): >= 0.85 for (a),
          >= 0.5 for (b). Round 1 checks every destination against torch.cat/stack/t of the sources.
--dcp     ~0.42 GB checkpoint (4 layers, same dims), 2 gloo ranks, DTensor destinations Shard(0) on a
          1-D mesh of 2, allocated and zeroed before the timing. Timed between two barriers (rank 0
          warms the files first); each rank runs with OMP_NUM_THREADS=1 unless it is set, as torchrun
          does (with 2 intra-op threads per rank on 2 cores, DCP's `copy_` ran 4-5x slower).
          dist-remapdsl       remapdsl.load(dtensors, folder, identity rules).
          dist-dcp            torch.distributed.checkpoint.load(dtensors,
                              storage_reader=HuggingFaceStorageReader(folder)) (thread_count=1, default).
          dist-dcp-t2         the same with thread_count=2 (DCP parallelises across files only; the
                              checkpoint has two).
          Goal: remapdsl >= 3x faster than dist-dcp. Round 1 checks every local shard of all three
          against the checkpoint, and the parent compares the digests of the loads rank by rank.
          `--shard-dim 1` shards columns instead (one byte run per row; 1-D tensors stay Shard(0));
          `--cold` evicts the files from the page cache (posix_fadvise DONTNEED, these files only) instead of warming them.
          `--dcp-spec moe`: a Qwen3-MoE-shaped checkpoint (~0.47 GB, 1,008 tensors, four files) and
          identity rules over every key (`{P:path} -> {P}`). `--dcp-spec deepseek`: DeepSeek-V3's key
          layout (compile_bench.deepseek_v3_shapes, no MTP layer: 61 layers, the first 3 dense, 128
          routed experts and 1 shared a layer, MLA, F32 score-correction biases) at small shapes
          (hidden 128, moe_intermediate 32, intermediate 352, vocab 4096): 23,123 tensors, 0.19 GB,
          eight files, the same identity rules; every first dim is even, so Shard(0) splits every
          tensor (norms and biases included) evenly and both loaders read the same halves.
          Goal there: remapdsl >= 5x faster than dist-dcp.
--tp      bytes read / bytes owned per rank at TP=4 (Mesh.of({"tp": 4}), transformers tp_plan styles:
          colwise q/k/v/gate/up and lm_head, rowwise o/down, embedding_rowwise embed_tokens):
          `remapdsl.plan_rank` on the --single checkpoint for the identity rules, rules (a) and rules
          (b) (explicit placements on the [in, out] kernels), no process group; then a real 4-rank
          gloo load of a small (~62 MB, uneven intermediate 2818) checkpoint into plain local shards
          (layout + mesh), checked against the checkpoint and against plan_rank. Goal: 1.00 on every rank.

    python bench/dist_bench.py [--single] [--dcp [--dcp-spec moe|deepseek] [--shard-dim 1] [--cold]] [--tp]
                               [--runs 5] [--rebuild]

About 20 s to write the checkpoints the first time, then about 2.5 min for all three;
`--dcp --dcp-spec deepseek` takes about 8 s for its checkpoint, then 7-8 min (DCP ~10 s a load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The parent only orchestrates and imports neither torch nor remapdsl's torch side (as load_bench).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_bench import _prod, child_preadv, data_sections, maxrss, rss_now, tensor_files, warm

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
MANIFEST = "bench_manifest.json"
SEED = 0

SPECS = {  # name -> Llama-like dims; every tensor is 2-D bf16
    "1gb": {"layers": 11, "hidden": 2048, "intermediate": 5632, "heads": 32, "kv_heads": 4, "vocab": 8192,
            "files": 2},
    "400mb": {"layers": 4, "hidden": 2048, "intermediate": 5632, "heads": 32, "kv_heads": 4, "vocab": 8192,
              "files": 2},
    "tiny": {"layers": 2, "hidden": 1024, "intermediate": 2818, "heads": 16, "kv_heads": 4, "vocab": 4096,
             "files": 2},
    # Qwen3-MoE-shaped, per-expert tensors plus norms: ~0.42 GB in ~1,000 tensors, as real MoE files are.
    "moe": {"layers": 5, "hidden": 1024, "heads": 16, "kv_heads": 4, "vocab": 16384, "experts": 64,
            "expert_intermediate": 192, "files": 4},
    # DeepSeek-V3's key layout (compile_bench.deepseek_v3_shapes: MLA, 3 dense layers, routed and shared
    # experts, F32 score-correction biases; no MTP layer) at small shapes: 23,123 tensors, 0.19 GB.
    "deepseek": {"layout": "deepseek_v3", "layers": 61, "dense_layers": 3, "hidden": 128, "intermediate": 352,
                 "experts": 128, "expert_intermediate": 32, "heads": 4, "q_lora": 64, "kv_lora": 32,
                 "qk_nope": 16, "qk_rope": 8, "v_head": 16, "vocab": 4096, "files": 8},
}
FOLDERS = {name: OUT / f"dist_llama_{name}" for name in SPECS}

RULES = {
    "identity": """\
remap 1
# Identity: the runtime keys are the checkpoint keys (for DCP's HF reader and the TP plans).
model.embed_tokens.weight -> model.embed_tokens.weight
lm_head.weight -> lm_head.weight
model.layers.{L}.self_attn.{q,k,v,o}_proj.weight -> model.layers.{L}.self_attn.{q,k,v,o}_proj.weight
model.layers.{L}.mlp.{gate,up,down}_proj.weight -> model.layers.{L}.mlp.{gate,up,down}_proj.weight
""",
    "everything": """\
remap 1
# Identity over every key (the --dcp-spec moe checkpoint's norms, routers and per-expert tensors).
{P:path} -> {P}
""",
    "concat": """\
remap 1
# (a) Renames, concatenations and stacks: every source fills one contiguous region of its destination.
model.embed_tokens.weight -> tok_embeddings.weight
lm_head.weight -> output.weight
model.layers.{L}.self_attn.{q,k,v}_proj.weight -> layers.{L}.attn.wqkv.weight | concat(dim=0)
model.layers.{L}.mlp.{gate,up}_proj.weight -> layers.{L}.mlp.w13.weight | concat(dim=0)
model.layers.{L}.self_attn.o_proj.weight -> stacked.attn.wo.weight | stack(L, dim=0)
model.layers.{L}.mlp.down_proj.weight -> stacked.mlp.w2.weight | stack(L, dim=0)
""",
    "transpose": """\
remap 1
# (b) Transposes: every projection becomes an [in, out] kernel (Flax style); the embedding is renamed.
model.embed_tokens.weight -> tok_embeddings.weight
lm_head.weight -> output.kernel | transpose(0, 1)
model.layers.{L}.self_attn.{q,k,v,o}_proj.weight -> layers.{L}.attn.{q,k,v,o}.kernel | transpose(0, 1)
model.layers.{L}.mlp.{gate,up,down}_proj.weight -> layers.{L}.mlp.{gate,up,down}.kernel | transpose(0, 1)
""",
}
RULE_FILES = {name: OUT / f"dist_rules_{name}.remap" for name in RULES}

SINGLE_MODES = ("preadv-touched", "remapdsl-concat", "remapdsl-transpose", "copy-transpose")
SINGLE_GOALS = (("remapdsl-concat", 0.85), ("remapdsl-transpose", 0.5))  # fraction of preadv-touched
DCP_MODES = ("dist-remapdsl", "dist-dcp", "dist-dcp-t2")
# --dcp, shown with --modes: the same load under a default group with NCCL's device contract (a backend
# for CUDA tensors only, so remapdsl makes its gloo control group), and under another checkout (--base)
EXTRA_DCP_MODES = ("dist-remapdsl-nccl", "dist-remapdsl@base")
DCP_GOALS = {"deepseek": 5.0}  # dist-dcp median / dist-remapdsl median at least this, by --dcp-spec
DCP_GOAL = 3.0  # ... for the other specs
TP = 4
# transformers styles on the identity names; (b)'s kernels are [in, out], so explicit placements.
TP_PLANS = {
    "identity": {
        "*.self_attn.q_proj": "colwise", "*.self_attn.k_proj": "colwise", "*.self_attn.v_proj": "colwise",
        "*.self_attn.o_proj": "rowwise", "*.mlp.gate_proj": "colwise", "*.mlp.up_proj": "colwise",
        "*.mlp.down_proj": "rowwise", "model.embed_tokens": "embedding_rowwise", "lm_head": "colwise",
    },
    "concat": {
        "*.attn.wqkv": "colwise", "*.mlp.w13": "colwise", "stacked.attn.wo": "rowwise",
        "stacked.mlp.w2": "rowwise", "tok_embeddings": "embedding_rowwise", "output": "colwise",
    },
    "transpose": {  # colwise of an [in, out] kernel is Shard(1), rowwise Shard(0)
        "*.attn.[qkv].kernel": [("shard", 1)], "*.mlp.gate.kernel": [("shard", 1)],
        "*.mlp.up.kernel": [("shard", 1)], "output.kernel": [("shard", 1)],
        "*.attn.o.kernel": [("shard", 0)], "*.mlp.down.kernel": [("shard", 0)],
        "tok_embeddings": [("shard", 0)],
    },
}


# ------------------------------------------------------------------------------------------ checkpoints


def deepseek_tensors(spec: dict) -> list[tuple[str, str, list[int]]]:
    """(key, safetensors dtype, shape) of compile_bench's DeepSeek-V3 layout at the spec's small dims."""
    from compile_bench import deepseek_v3_config, deepseek_v3_shapes

    config = dict(deepseek_v3_config(spec["experts"]), num_hidden_layers=spec["layers"],
                  num_nextn_predict_layers=0, first_k_dense_replace=spec["dense_layers"],
                  hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                  moe_intermediate_size=spec["expert_intermediate"], vocab_size=spec["vocab"],
                  num_attention_heads=spec["heads"], num_key_value_heads=spec["heads"],
                  q_lora_rank=spec["q_lora"], kv_lora_rank=spec["kv_lora"], qk_nope_head_dim=spec["qk_nope"],
                  qk_rope_head_dim=spec["qk_rope"], v_head_dim=spec["v_head"])
    return [(k, dtype, list(shape)) for k, (dtype, shape) in deepseek_v3_shapes(config).items()]


def checkpoint_tensors(spec: dict) -> list[tuple[str, str, list[int]]]:
    """The checkpoint's (key, safetensors dtype, shape), in the order the files hold them."""
    if spec.get("layout") == "deepseek_v3":
        return deepseek_tensors(spec)
    return [(k, "BF16", s) for k, s in tensor_shapes(spec)]


def dcp_rule_name(spec: dict) -> str:
    """Identity rules over the Llama keys, or over every key where there are norms and experts."""
    return "everything" if "experts" in spec else "identity"


def tensor_shapes(spec: dict) -> list[tuple[str, list[int]]]:
    """The Llama-like checkpoint's (key, shape) in layer order: embed, layers, lm_head."""
    h, i, v = spec["hidden"], spec.get("intermediate"), spec["vocab"]
    hd = h // spec["heads"]
    out = [("model.embed_tokens.weight", [v, h])]
    for layer in range(spec["layers"]):
        p = f"model.layers.{layer}."
        out += [(p + "self_attn.q_proj.weight", [spec["heads"] * hd, h]),
                (p + "self_attn.k_proj.weight", [spec["kv_heads"] * hd, h]),
                (p + "self_attn.v_proj.weight", [spec["kv_heads"] * hd, h]),
                (p + "self_attn.o_proj.weight", [h, spec["heads"] * hd])]
        if "experts" not in spec:
            out += [(p + "mlp.gate_proj.weight", [i, h]),
                    (p + "mlp.up_proj.weight", [i, h]),
                    (p + "mlp.down_proj.weight", [h, i])]
            continue
        e = spec["expert_intermediate"]
        out += [(p + "input_layernorm.weight", [h]), (p + "post_attention_layernorm.weight", [h]),
                (p + "self_attn.q_norm.weight", [hd]), (p + "self_attn.k_norm.weight", [hd]),
                (p + "mlp.gate.weight", [spec["experts"], h])]
        for x in range(spec["experts"]):
            out += [(p + f"mlp.experts.{x}.gate_proj.weight", [e, h]),
                    (p + f"mlp.experts.{x}.up_proj.weight", [e, h]),
                    (p + f"mlp.experts.{x}.down_proj.weight", [h, e])]
    if "experts" in spec:
        out.append(("model.norm.weight", [h]))
    out.append(("lm_head.weight", [v, h]))
    return out


def child_create(name: str) -> dict:
    """Write the checkpoint `name` as `files` shards (split in key order) and an index, under a fixed seed."""
    import torch
    from safetensors.torch import save_file

    spec, folder = SPECS[name], FOLDERS[name]
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = checkpoint_tensors(spec)
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32}
    itemsize = {"BF16": 2, "F32": 4}
    total = sum(itemsize[d] * _prod(s) for _, d, s in tensors)
    generator = torch.Generator().manual_seed(SEED)
    weight_map, part, size, index = {}, {}, 0, 0

    def flush():
        nonlocal part, size, index
        index += 1
        file = f"model-{index:05d}-of-{spec['files']:05d}.safetensors"
        save_file(part, str(tmp / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
        part, size = {}, 0

    for key, dtype, shape in tensors:
        part[key] = torch.randn(shape, generator=generator, dtype=dtypes[dtype])
        size += itemsize[dtype] * _prod(shape)
        if size >= total / spec["files"] and index < spec["files"] - 1:
            flush()
    flush()
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / MANIFEST).write_text(json.dumps({"spec": spec, "seed": SEED}))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return {"tensors": len(tensors), "bytes": total}


def ensure_checkpoint(name: str, rebuild: bool) -> Path:
    folder = FOLDERS[name]
    manifest = folder / MANIFEST
    if not rebuild and manifest.exists():
        cached = json.loads(manifest.read_text())
        if cached.get("spec") == SPECS[name] and cached.get("seed") == SEED and tensor_files(folder):
            return folder
    start = time.perf_counter()
    result = spawn(["--child", "create", "--spec", name])
    if "error" in result:
        raise SystemExit(f"creating the {name} checkpoint failed: {result['error']}")
    print(f"created {rel(folder)} ({result['bytes'] / 1e9:.3f} GB) in {time.perf_counter() - start:.1f} s")
    return folder


def write_rules() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in RULES.items():
        RULE_FILES[name].write_text(text)


# ------------------------------------------------------------------------------- child: single process


def destination_keys(rules: str, layers: int) -> list[str]:
    """The runtime keys rules (a) or (b) make, written out independently of remapdsl."""
    if rules == "concat":
        return (["tok_embeddings.weight", "output.weight", "stacked.attn.wo.weight", "stacked.mlp.w2.weight"]
                + [f"layers.{L}.{x}" for L in range(layers) for x in ("attn.wqkv.weight", "mlp.w13.weight")])
    return (["tok_embeddings.weight", "output.kernel"]
            + [f"layers.{L}.attn.{x}.kernel" for L in range(layers) for x in "qkvo"]
            + [f"layers.{L}.mlp.{x}.kernel" for L in range(layers) for x in ("gate", "up", "down")])


def destinations(rules: str, spec: dict) -> dict:
    """Runtime key -> (shape, dtype) of rules (a) or (b), from `expected_tensor` on meta tensors: no
    remapdsl call before the timed one, so its first-call costs stay inside the timing."""
    import torch

    shapes = dict(tensor_shapes(spec))
    meta = lambda k: torch.empty(shapes[k], dtype=torch.bfloat16, device="meta")
    return {k: (tuple(expected_tensor(rules, k, meta, spec["layers"]).shape), "bfloat16")
            for k in destination_keys(rules, spec["layers"])}


def expected_tensor(rules: str, key: str, source, layers: int):
    """What the destination `key` must hold, built from the checkpoint tensors with plain torch ops."""
    import torch

    parts = key.split(".")
    if key == "tok_embeddings.weight":
        return source("model.embed_tokens.weight")
    if rules == "concat":
        if key == "output.weight":
            return source("lm_head.weight")
        if key.endswith("attn.wqkv.weight"):
            return torch.cat([source(f"model.layers.{parts[1]}.self_attn.{x}_proj.weight") for x in "qkv"])
        if key.endswith("mlp.w13.weight"):
            return torch.cat([source(f"model.layers.{parts[1]}.mlp.{x}_proj.weight") for x in ("gate", "up")])
        name = {"stacked.attn.wo.weight": "self_attn.o_proj", "stacked.mlp.w2.weight": "mlp.down_proj"}[key]
        return torch.stack([source(f"model.layers.{L}.{name}.weight") for L in range(layers)])
    if key == "output.kernel":
        return source("lm_head.weight").t()
    group = "self_attn" if parts[2] == "attn" else "mlp"
    return source(f"model.layers.{parts[1]}.{group}.{parts[3]}_proj.weight").t()


def check_single(target: dict, folder: Path, rules: str) -> list[str]:
    import torch
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    handles = {f: safe_open(str(folder / f), framework="pt") for f in set(index.values())}
    layers = json.loads((folder / MANIFEST).read_text())["spec"]["layers"]
    problems = []
    for key, tensor in target.items():
        want = expected_tensor(rules, key, lambda k: handles[index[k]].get_tensor(k), layers)
        if tuple(want.shape) != tuple(tensor.shape) or not torch.equal(want, tensor):
            problems.append(key)
    return problems


def allocate_touched(shapes: dict) -> dict:
    import torch

    target = {k: torch.empty(shape, dtype=getattr(torch, dtype)) for k, (shape, dtype) in shapes.items()}
    for t in target.values():
        t.zero_()
    return target


def child_remapdsl_single(folder: Path, rules: str, verify: bool) -> dict:
    """remapdsl.load into touched destinations: the process's first call (timed, the figure), then,
    with the files warmed again, a second call into the same destinations (fixed costs paid)."""
    import torch  # noqa: F401  (imports stay out of the timing)

    import remapdsl
    try:
        import remapdsl.drivers.load  # noqa: F401  (imports stay out of the timing)
    except ModuleNotFoundError:  # a --base checkout from before remapdsl/drivers/
        import remapdsl.runtime.load  # noqa: F401

    spec = json.loads((folder / MANIFEST).read_text())["spec"]
    files = tensor_files(folder)
    rss0 = rss_now()
    target = allocate_touched(destinations(rules, spec))
    times, reports = [], []
    for _ in range(2):
        warm(files)
        start = time.perf_counter()
        reports.append(remapdsl.load(target, str(folder), str(RULE_FILES[rules])))
        times.append(time.perf_counter() - start)
    result = {"seconds": times[0], "seconds2": times[1], "rss0": rss0, "maxrss": maxrss(),
              "bytes_read": reports[0].bytes_read, "inner": reports[0].seconds, "inner2": reports[1].seconds}
    if verify:
        result["problems"] = check_single(target, folder, rules)
        result["checked"] = len(target)
    return result


def child_copy_transpose(folder: Path) -> dict:
    """torch's transpose-copy: safetensors mmap views copied transposed into touched [in, out] kernels
    (the embedding plainly), twice like the remapdsl modes."""
    import torch  # noqa: F401
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    spec = json.loads((folder / MANIFEST).read_text())["spec"]
    files = tensor_files(folder)
    rss0 = rss_now()
    target = allocate_touched(destinations("transpose", spec))
    times = []
    for _ in range(2):
        warm(files)
        start = time.perf_counter()
        handles = {f: safe_open(str(folder / f), framework="pt") for f in set(index.values())}

        def source(k, handles=handles):
            return handles[index[k]].get_tensor(k)

        for key, tensor in target.items():
            tensor.copy_(expected_tensor("transpose", key, source, spec["layers"]))
        times.append(time.perf_counter() - start)
    return {"seconds": times[0], "seconds2": times[1], "rss0": rss0, "maxrss": maxrss()}


# ----------------------------------------------------------------------------------- child: 2-rank DCP


def init_group(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))


def shard_range(length: int, world: int, rank: int) -> tuple[int, int]:
    step = -(-length // world)  # torch.chunk, as Shard(0)
    return min(length, rank * step), min(length, (rank + 1) * step)


def evict(files: list[str]) -> None:
    """Drop these files' pages from the page cache (never a global drop_caches: other jobs share the machine)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child_dist(mode: str, folder: Path, rank: int, world: int, port: int, verify: bool, cold: bool,
               dim: int) -> dict:
    import hashlib

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import remapdsl
    try:
        import remapdsl.drivers.load  # noqa: F401  (imports stay out of the timing)
    except ModuleNotFoundError:  # a --base checkout from before remapdsl/drivers/
        import remapdsl.runtime.load  # noqa: F401

    init_group(rank, world, port, "cuda:gloo" if mode == "dist-remapdsl-nccl" else "gloo")
    # the timing's barriers: a gloo group of the benchmark's own under the NCCL-like group (one that
    # remapdsl's first load does not know of: it makes its own control group inside the timing)
    timing = dist.new_group(backend="gloo") if mode == "dist-remapdsl-nccl" else None

    def barrier():
        dist.barrier(group=timing)

    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        inventory = remapdsl.open_checkpoint(str(folder))
        files = tensor_files(folder)
        rules = RULE_FILES[dcp_rule_name(json.loads((folder / MANIFEST).read_text())["spec"])]
        rss0 = rss_now()
        targets, rows = {}, {}
        for key, info in inventory.tensors.items():
            shape = tuple(info.shape)
            on = dim if dim < len(shape) else 0  # --shard-dim 1: 1-D norms and biases stay Shard(0)
            a, b = shard_range(shape[on], world, rank)
            rows[key] = tuple(slice(a, b) if d == on else slice(None) for d in range(len(shape)))
            local = torch.zeros(tuple(b - a if d == on else n for d, n in enumerate(shape)),
                                dtype=getattr(torch, info.dtype))
            stride = tuple(_prod(shape[d + 1:]) for d in range(len(shape)))
            targets[key] = DTensor.from_local(local, mesh, [Shard(on)], run_check=False,
                                              shape=torch.Size(shape), stride=stride)
        local_bytes = sum(t.to_local().nbytes for t in targets.values())

        def timed() -> tuple[float, object]:
            if rank == 0:
                (evict if cold else warm)(files)
            barrier()
            start = time.perf_counter()
            report = None
            if mode.startswith("dist-remapdsl"):
                report = remapdsl.load(targets, str(folder), str(rules))
            else:
                reader = HuggingFaceStorageReader(str(folder), thread_count=2 if mode == "dist-dcp-t2" else 1)
                dcp.load(targets, storage_reader=reader)
            barrier()
            return time.perf_counter() - start, report

        seconds, report = timed()  # the process's first load: the figure
        result = {"seconds": seconds, "rss0": rss0, "local_bytes": local_bytes}
        if report is not None:
            result.update(bytes_read=report.bytes_read, bytes_owned=report.bytes_owned, inner=report.seconds)
        if verify:
            index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
            problems, digest = [], hashlib.blake2b(digest_size=16)
            handles = {f: safe_open(str(folder / f), framework="pt") for f in set(index.values())}
            for key in sorted(targets):
                local = targets[key].to_local()
                if not torch.equal(local, handles[index[key]].get_slice(key)[rows[key]]):
                    problems.append(key)
                digest.update(local.contiguous().view(torch.uint8).numpy().data)
            del handles
            result.update(problems=problems, checked=len(targets), digest=digest.hexdigest())
        for t in targets.values():
            t.to_local().zero_()
        result["seconds2"], report = timed()  # a second load in the same process: fixed costs paid
        if report is not None:
            result["inner2"] = report.seconds
        result["maxrss"] = maxrss()
        return result
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ child: TP bytes


def torch_free_plan(rules: str):
    from remapdsl.sharding import LayoutPlan, Shard

    plan = {glob: value if isinstance(value, str) else [Shard(dim=d) for _, d in value]
            for glob, value in TP_PLANS[rules].items()}
    return LayoutPlan.from_mapping(plan, mesh_dim="tp")


def child_tp_plan(folder: Path) -> dict:
    import remapdsl
    from remapdsl.sharding import Mesh

    mesh = Mesh.of({"tp": TP})
    inventory = remapdsl.open_checkpoint(str(folder))
    total = sum(info.nbytes for info in inventory.tensors.values())
    out = {"checkpoint_bytes": total, "rules": {}}
    for rules in ("identity", "concat", "transpose"):
        compiled = remapdsl.compile_rules(remapdsl.load_rules(str(RULE_FILES[rules])), inventory)
        layout = torch_free_plan(rules)
        ranks = []
        start = time.perf_counter()
        for rank in range(TP):
            plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)
            ranks.append({"bytes_read": plan.bytes_read, "bytes_owned": plan.bytes_owned,
                          "items": len(plan.items), "runs": sum(len(i.runs) for i in plan.items)})
        out["rules"][rules] = {"ranks": ranks, "seconds": time.perf_counter() - start}
    return out


def child_tp_load(folder: Path, rank: int, world: int, port: int) -> dict:
    import torch
    from safetensors import safe_open

    import remapdsl
    try:
        import remapdsl.drivers.load  # noqa: F401  (imports stay out of the timing)
    except ModuleNotFoundError:  # a --base checkout from before remapdsl/drivers/
        import remapdsl.runtime.load  # noqa: F401
    from remapdsl.sharding import Mesh, layout_for, local_shard

    init_group(rank, world, port)
    try:
        mesh = Mesh.of({"tp": world})
        layout = torch_free_plan("identity")
        inventory = remapdsl.open_checkpoint(str(folder))
        compiled = remapdsl.compile_rules(remapdsl.load_rules(str(RULE_FILES["identity"])), inventory)
        predicted = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)
        local, shards = {}, {}
        for d in compiled.runtime_tensors:
            shard = local_shard(d.shape, mesh.sizes, layout_for(d.runtime_key, d.shape, layout, mesh),
                                mesh.coordinate(rank))
            local[d.runtime_key] = torch.full(shard.shape, float("nan"), dtype=getattr(torch, d.dtype))
            shards[d.runtime_key] = shard
        warm(tensor_files(folder))
        start = time.perf_counter()
        report = remapdsl.load(local, str(folder), str(RULE_FILES["identity"]), layout=layout, mesh=mesh)
        seconds = time.perf_counter() - start
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        handles = {f: safe_open(str(folder / f), framework="pt") for f in set(index.values())}
        problems = []
        for key, shard in shards.items():
            full = handles[index[key]].get_slice(key)
            for box, at in zip(shard.boxes, shard.local_offsets):
                want = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
                got = local[key][tuple(slice(o, o + s) for o, s in zip(at, box.sizes))]
                if not torch.equal(got, want):
                    problems.append(key)
        return {"seconds": seconds, "bytes_read": report.bytes_read, "bytes_owned": report.bytes_owned,
                "planned_read": predicted.bytes_read, "planned_owned": predicted.bytes_owned,
                "local_bytes": sum(t.nbytes for t in local.values()), "problems": problems,
                "checked": len(shards), "maxrss": maxrss()}
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def run_child(args) -> dict:
    if args.child == "create":
        return child_create(args.spec)
    folder = FOLDERS[args.spec]
    if args.child == "preadv-touched":
        return child_preadv(folder, touched=True)
    if args.child in ("remapdsl-concat", "remapdsl-transpose"):
        return child_remapdsl_single(folder, args.child.removeprefix("remapdsl-"), args.verify)
    if args.child == "copy-transpose":
        return child_copy_transpose(folder)
    if args.child in DCP_MODES + EXTRA_DCP_MODES:
        return child_dist(args.child, folder, args.rank, args.world, args.port, args.verify, args.cold,
                          args.shard_dim)
    if args.child == "tp-plan":
        return child_tp_plan(folder)
    if args.child == "tp-load":
        return child_tp_load(folder, args.rank, args.world, args.port)
    raise SystemExit(f"unknown mode {args.child}")


# --------------------------------------------------------------------------------------------- parent


def rel(path: Path) -> str:
    return str(path.relative_to(HERE.parent)) if path.is_relative_to(HERE.parent) else str(path)


def child_env(ranks: bool = False, base: str | None = None) -> dict:
    """A child's environment; rank processes get OMP_NUM_THREADS=1 unless it is set, as torchrun does
    (with 2 intra-op threads per rank on 2 cores, DCP's single-thread `copy_` ran 4-5x slower).
    `base`: a checkout whose remapdsl the child imports instead of this one's."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if base:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [base, env.get("PYTHONPATH")]))
        env["REMAPDSL_CACHE"] = "0"  # a checkout from before the disk caches were removed: theirs off
    if ranks:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def parse_result(stdout: str, stderr: str, returncode: int) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (stderr or stdout).strip().splitlines()[-3:]
    return {"error": f"exit {returncode}: " + " | ".join(tail)}


def spawn(extra: list[str], timeout: float = 600) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), *extra]
    proc = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=timeout,
                          cwd=str(HERE.parent), check=False)
    return parse_result(proc.stdout, proc.stderr, proc.returncode)


def spawn_ranks(extra: list[str], world: int, timeout: float = 600, script: str = __file__,
                base: str | None = None) -> list[dict]:
    """`world` fresh processes of `script` (this one by default), one per rank, on a fresh TCP port
    (importing `base`'s remapdsl where given); their results by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, str(Path(script).resolve()), *extra,
               "--world", str(world), "--port", str(port)]
    procs = [subprocess.Popen(command + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env(ranks=True, base=base), cwd=str(HERE.parent))
             for r in range(world)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results.append(parse_result(out, err, proc.returncode))
    return results


def interleaved(modes, runs: int, one) -> tuple[dict, dict]:
    """Run `one(mode, verify)` for each mode, rotated each round; results and first errors by mode."""
    results: dict[str, list] = {m: [] for m in modes}
    errors: dict[str, str] = {}
    for r in range(runs):
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
            if mode in errors:
                continue
            result = one(mode, r == 0)
            if "error" in result:
                errors[mode] = result["error"]
            else:
                results[mode].append(result)
    return results, errors


def table(modes, results, errors, nbytes: float) -> tuple[dict, dict]:
    """Print medians of the first call (the figure) and of the second call where a mode has one;
    return both medians by mode."""
    first, second = {}, {}
    print(f"  {'mode':20s} {'1st call s':>10s} {'min-max s':>15s} {'GB/s':>6s}   {'2nd call s':>10s} "
          f"{'GB/s':>6s}   {'peak RSS':>8s}")
    for mode in modes:
        runs = results[mode]
        first[mode] = second[mode] = None
        if not runs:
            print(f"  {mode:20s} n/a: {errors.get(mode, 'no runs')}")
            continue
        secs = [x["seconds"] for x in runs]
        med = first[mode] = statistics.median(secs)
        line = f"  {mode:20s} {med:10.3f} {min(secs):7.3f}-{max(secs):7.3f} {nbytes / med / 1e9:6.2f}   "
        if all("seconds2" in x for x in runs):
            med2 = second[mode] = statistics.median(x["seconds2"] for x in runs)
            line += f"{med2:10.3f} {nbytes / med2 / 1e9:6.2f}   "
        else:
            line += f"{'-':>10s} {'':6s}   "
        peak = statistics.median(x["maxrss"] for x in runs)
        print(line + f"{peak / 2**20:5.0f} MiB")
    return first, second


def bench_single(runs: int, rebuild: bool) -> None:
    folder = ensure_checkpoint("1gb", rebuild)
    files = tensor_files(folder)
    data = sum(n for _, _, n in data_sections(files))
    print(f"\n[1] single process, {rel(folder)}: {len(files)} files, {data / 1e9:.3f} GB of tensor data; "
          f"rules {rel(RULE_FILES['concat'])} (a), {rel(RULE_FILES['transpose'])} (b)")
    start = time.perf_counter()
    results, errors = interleaved(
        SINGLE_MODES, runs,
        lambda mode, verify: spawn(["--child", mode, "--spec", "1gb"] + (["--verify"] if verify else [])))
    print(f"  {runs} rounds of {len(SINGLE_MODES)} fresh processes in {time.perf_counter() - start:.0f} s; "
          f"median seconds and GB/s of {data / 1e9:.3f} GB; destinations allocated and zeroed before the "
          "timing; 1st call: the process's first load (the figure), 2nd call: again in the same process")
    first, second = table(SINGLE_MODES, results, errors, data)
    for mode in ("remapdsl-concat", "remapdsl-transpose"):
        for x in results[mode][:1]:
            verdict = "all equal" if not x.get("problems") else f"WRONG: {x['problems'][:3]}"
            print(f"  {mode}: {x.get('checked')} destinations checked against torch.cat/stack/t of the "
                  f"sources: {verdict}; report.bytes_read {x['bytes_read'] / data:.3f}x the tensor data")
        if results[mode]:
            inner = statistics.median(x["inner"] for x in results[mode])
            print(f"  {mode}: of the 1st call, {inner:.3f} s (median) in plan + reads (report.seconds), "
                  f"{max(first[mode] - inner, 0):.3f} s before them (rules, headers, compile)")
    limit = first.get("preadv-touched")
    print("fraction of the machine limit (preadv-touched median / mode median; higher is better):")
    for mode, goal in SINGLE_GOALS + (("copy-transpose", None),):
        if limit and first.get(mode):
            frac = limit / first[mode]
            verdict = (f"goal >= {goal:.2f} -> {'meets' if frac >= goal else 'MISSES'}" if goal
                       else "(shown only)")
            frac2 = f"2nd call {limit / second[mode]:5.2f}" if second.get(mode) else ""
            print(f"  {mode:20s} 1st call {frac:5.2f}  {frac2}   {verdict} (on the 1st call)")
    if first.get("remapdsl-transpose") and first.get("copy-transpose"):
        ratio = first["remapdsl-transpose"] / first["copy-transpose"]
        print(f"  remapdsl-transpose takes {ratio:.2f}x the time of torch's own transpose-copy from mmap "
              "views (1st calls)")


def bench_dcp(runs: int, rebuild: bool, cold: bool, dim: int, spec: str, modes=DCP_MODES,
              base: str | None = None) -> None:
    folder = ensure_checkpoint(spec, rebuild)
    files = tensor_files(folder)
    data = sum(n for _, _, n in data_sections(files))
    print(f"\n[2] 2 gloo ranks, DTensor Shard({dim}) on a mesh of 2, {rel(folder)}: {len(files)} files, "
          f"{data / 1e9:.3f} GB in {len(checkpoint_tensors(SPECS[spec]))} tensors; "
          f"rules {rel(RULE_FILES[dcp_rule_name(SPECS[spec])])}; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '1')} per rank; "
          + ("COLD: the files evicted from the page cache before each load" if cold else
             "warm: the files read with `cat` before each load"))
    start = time.perf_counter()
    digests: dict[str, list] = {}

    def one(mode, verify):
        child = "dist-remapdsl" if mode == "dist-remapdsl@base" else mode
        ranks = spawn_ranks(["--child", child, "--spec", spec] + (["--verify"] if verify else [])
                            + (["--cold"] if cold else []) + ["--shard-dim", str(dim)], 2,
                            base=base if mode == "dist-remapdsl@base" else None)
        bad = [r for r in ranks if "error" in r]
        if bad:
            return bad[0]
        if verify:
            digests[mode] = ranks
        merged = dict(ranks[0])
        for key in ("seconds", "seconds2", "maxrss"):
            merged[key] = max(r[key] for r in ranks)
        merged["ranks"] = ranks
        return merged

    results, errors = interleaved(modes, runs, one)
    print(f"  {runs} rounds of {len(modes)} fresh 2-process jobs in {time.perf_counter() - start:.0f} s; "
          f"seconds between barriers (slowest rank), GB/s of all {data / 1e9:.3f} GB; destinations zeroed "
          "before the timing; 1st call: the processes' first load (the figure), 2nd call: again")
    first, second = table(modes, results, errors, data)
    for mode, ranks in digests.items():
        bad = [p for r in ranks for p in r["problems"]]
        print(f"  {mode}: {sum(r['checked'] for r in ranks)} local shards checked against the checkpoint: "
              + ("all equal" if not bad else f"WRONG: {bad[:3]}"))
    if "dist-remapdsl" in digests:
        for mode in modes:
            if mode == "dist-remapdsl":
                continue
            if mode in digests:
                same = all(a["digest"] == b["digest"]
                           for a, b in zip(digests["dist-remapdsl"], digests[mode]))
                print(f"  dist-remapdsl vs {mode}: local shards "
                      + ("identical on both ranks" if same else "DIFFER"))
    if results.get("dist-remapdsl"):
        for k, x in enumerate(results["dist-remapdsl"][0]["ranks"]):
            print(f"  dist-remapdsl rank {k}: bytes_read {x['bytes_read'] / 1e6:.1f} MB, bytes_owned "
                  f"{x['bytes_owned'] / 1e6:.1f} MB, local shards {x['local_bytes'] / 1e6:.1f} MB")
        inner = statistics.median(r["inner"] for x in results["dist-remapdsl"] for r in x["ranks"])
        print(f"  dist-remapdsl: of the 1st call, {inner:.3f} s (median over ranks and rounds) in plan + "
              "reads (report.seconds); the rest is rules, shared headers, compile and agreement")
    print("speed-up (mode median / dist-remapdsl median; higher is better for remapdsl):")
    for mode in modes:
        if mode == "dist-remapdsl":
            continue
        if first.get(mode) and first.get("dist-remapdsl"):
            ratio = first[mode] / first["dist-remapdsl"]
            ratio2 = (f"2nd call {second[mode] / second['dist-remapdsl']:5.2f}x"
                      if second.get(mode) and second.get("dist-remapdsl") else "")
            goal = DCP_GOALS.get(spec, DCP_GOAL)
            verdict = (f"goal >= {goal:.1f}x -> {'meets' if ratio >= goal else 'MISSES'} "
                       "(on the 1st call)" if mode == "dist-dcp" else "(shown only)")
            print(f"  {mode:18s} 1st call {ratio:5.2f}x  {ratio2}   {verdict}")


def bench_tp(rebuild: bool, rebuild_small: bool) -> None:
    folder = ensure_checkpoint("1gb", rebuild)
    print(f"\n[3] TP={TP} bytes per rank, remapdsl.plan_rank on {rel(folder)} (no process group; "
          "colwise q/k/v/gate/up/lm_head, rowwise o/down, embedding_rowwise embed)")
    result = spawn(["--child", "tp-plan", "--spec", "1gb"])
    if "error" in result:
        print(f"  n/a: {result['error']}")
    else:
        total = result["checkpoint_bytes"]
        for rules, x in result["rules"].items():
            ranks = x["ranks"]
            print(f"  rules {rules:9s} ({x['seconds']:.2f} s for {TP} plans)")
            for k, r in enumerate(ranks):
                print(f"    rank {k}: bytes_read {r['bytes_read'] / 1e6:8.1f} MB  bytes_owned "
                      f"{r['bytes_owned'] / 1e6:8.1f} MB  "
                      f"read/owned {r['bytes_read'] / r['bytes_owned']:.2f}  "
                      f"({r['items']} items, {r['runs']} byte runs)")
            read = sum(r["bytes_read"] for r in ranks)
            worst = max(r["bytes_read"] / r["bytes_owned"] for r in ranks)
            print(f"    all ranks read {read / total:.3f}x the checkpoint; worst read/owned {worst:.2f} "
                  f"-> {'meets' if worst <= 1.0 else 'MISSES'} the goal 1.00")
    small = ensure_checkpoint("tiny", rebuild_small)
    data = sum(n for _, _, n in data_sections(tensor_files(small)))
    print(f"  a real {TP}-rank gloo load (plain local shards, layout + mesh) of {rel(small)}, "
          f"{data / 1e6:.1f} MB, identity rules:")
    start = time.perf_counter()
    ranks = spawn_ranks(["--child", "tp-load", "--spec", "tiny"], TP)
    print(f"    ({time.perf_counter() - start:.1f} s for the {TP} processes)")
    for k, r in enumerate(ranks):
        if "error" in r:
            print(f"    rank {k}: n/a: {r['error']}")
            continue
        ok = r["bytes_read"] == r["bytes_owned"]
        planned = (r["planned_read"], r["planned_owned"]) == (r["bytes_read"], r["bytes_owned"])
        values = "equal the checkpoint" if not r["problems"] else f"WRONG: {r['problems'][:3]}"
        print(f"    rank {k}: report.bytes_read {r['bytes_read']:>10,d}  "
              f"bytes_owned {r['bytes_owned']:>10,d}  "
              f"{'equal' if ok else 'DIFFER'}; local shards {r['local_bytes']:,d} B; plan_rank predicted "
              f"{'the same' if planned else 'OTHER bytes'}; {r['checked']} shards {values}; "
              f"{r['seconds']:.3f} s")
    good = [r for r in ranks if "error" not in r]
    if len(good) == TP:
        total_read = sum(r["bytes_read"] for r in good)
        print(f"    sum of bytes_read over ranks: {total_read / data:.3f}x the checkpoint")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", action="store_true",
                        help="[1] single-process throughput vs the preadv limit")
    parser.add_argument("--dcp", action="store_true", help="[2] 2-rank DTensor load vs DCP's HF reader")
    parser.add_argument("--tp", action="store_true", help="[3] TP=4 bytes read / bytes owned per rank")
    parser.add_argument("--cold", action="store_true",
                        help="[2] only: evict the files from the page cache before each load, not warm them")
    parser.add_argument("--shard-dim", type=int, choices=(0, 1), default=0,
                        help="[2] only: the DTensors' Shard dim (1: column shards, one byte run per row)")
    parser.add_argument("--dcp-spec", choices=("400mb", "moe", "deepseek"), default="400mb",
                        help="[2] only: the checkpoint (moe: ~1,000 tensors, norms and per-expert weights; "
                             "deepseek: 23,123 small tensors in DeepSeek-V3's key layout)")
    parser.add_argument("--modes", default=",".join(DCP_MODES),
                        help=f"[2] only: the modes to run, of {', '.join(DCP_MODES + EXTRA_DCP_MODES)}")
    parser.add_argument("--base", help="[2] only: a checkout of another commit, for dist-remapdsl@base")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rebuild", action="store_true", help="write the checkpoints again")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", choices=sorted(SPECS), help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(args)), flush=True)
        return
    chosen = [name for name in ("single", "dcp", "tp") if getattr(args, name)] or ["single", "dcp", "tp"]
    write_rules()
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    rebuilt = set()

    def fresh(name):  # --rebuild rewrites each checkpoint once per run
        if not args.rebuild or name in rebuilt:
            return False
        rebuilt.add(name)
        return True

    if "single" in chosen:
        bench_single(args.runs, fresh("1gb"))
    if "dcp" in chosen:
        modes = tuple(args.modes.split(","))
        unknown = set(modes) - set(DCP_MODES + EXTRA_DCP_MODES)
        if unknown or ("dist-remapdsl@base" in modes) != bool(args.base):
            parser.error(f"unknown modes {sorted(unknown)}" if unknown else "dist-remapdsl@base goes with --base")
        bench_dcp(args.runs, fresh(args.dcp_spec), args.cold, args.shard_dim, args.dcp_spec, modes,
                  args.base and os.path.abspath(args.base))
    if "tp" in chosen:
        bench_tp(fresh("1gb"), fresh("tiny"))
    print(f"\nload average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} "
          f"CPUs; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
