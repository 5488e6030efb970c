"""Real checkpoints with random values in an inventory's or snapshot's layout, optionally scaled down to the
first layers and experts. Every float is +-(1 + m/8) * 2^k (k in -3..3, m in 0..7), exact in every float
dtype and, times such scales, in bfloat16: a wrong rule shows and a right one round-trips exactly. FP8
codes are finite, E8M0 scales between 2^-7 and 2^7."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from remapdsl import open_checkpoint
from remapdsl.checkpoint import Inventory
from remapdsl.checkpoint.header import METADATA_KEY, PREFIX_NBYTES
from remapdsl.checkpoint.snapshot import FORMAT, VERSION, SnapshotInventory, checkpoint_config, parse_snapshot
from remapdsl.dtypes import BY_NAME, DType

LAYER_WORDS = ("layers", "h", "blocks")  # `model.layers.3.`, `transformer.h.3.`: a layer's index follows
EXPERT_WORDS = ("experts",)  # `mlp.experts.7.`: an expert's index follows
LAYER_CONFIG_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
EXPERT_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def write_checkpoint(source: str | os.PathLike | Inventory, folder: str | os.PathLike, *, seed: int = 0,
                     layers: int | None = None, experts: int | None = None,
                     config: Mapping[str, Any] | None = None) -> Path:
    """Write a checkpoint in the layout of `source` (a snapshot, checkpoint folder or Inventory) with random
    values that depend on `seed` and each key only: the same keys, dtypes, shapes, files and index, and its
    config.json (`config`, by default the source's). `layers`, `experts`: keep the first N (`scale_down`)."""
    inventory = source if isinstance(source, Inventory) else open_checkpoint(source)
    given = dict(checkpoint_config(inventory) if config is None else config)
    if layers is not None or experts is not None:
        inventory = scale_down(inventory, layers=layers, experts=experts, config=given)
        given = inventory.config if config is None else given
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensors in _by_file(inventory).items():
        header_bytes, _ = _header(tensors, inventory.files[name].metadata)
        path = folder.joinpath(*name.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(len(header_bytes).to_bytes(8, "little"))
            f.write(header_bytes)
            f.writelines(random_bytes(BY_NAME[t.dtype], t.shape, _seed(seed, t.ckpt_key)) for t in tensors)
    if inventory.index_file is not None:
        weight_map = {k: t.file for k, t in inventory.tensors.items()}
        total = sum(t.nbytes for t in inventory.tensors.values())
        (folder / inventory.index_file).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    if given or isinstance(inventory, SnapshotInventory):
        (folder / "config.json").write_text(json.dumps(given, indent=2) + "\n")
    return folder


def _by_file(inventory: Inventory, keep=lambda t: True) -> dict[str, list]:
    """File name -> the tensors in it that `keep` takes, in byte order."""
    by_file: dict[str, list] = {name: [] for name in inventory.files}
    for t in sorted(inventory.tensors.values(), key=lambda t: t.byte_offset):
        if keep(t):
            by_file[t.file].append(t)
    return by_file


def _header(tensors: Sequence, metadata: Mapping[str, str]) -> tuple[bytes, dict]:
    """A safetensors header for `tensors` back to back in this order (space-padded to 8 bytes, as the
    safetensors library pads it), and the header as an object."""
    obj: dict[str, Any] = {METADATA_KEY: dict(metadata)} if metadata else {}
    offset = 0
    for t in tensors:
        obj[t.ckpt_key] = {"dtype": BY_NAME[t.dtype].safetensors, "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(obj, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8), obj


def _seed(seed: int, ckpt_key: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(ckpt_key.encode())) % 2**63


# What `random_bytes` draws per dtype: finite codes only.
_FP8_CODES = {
    "float8_e4m3fn": [c for c in range(256) if c & 0x7F != 0x7F],
    "float8_e5m2": [c for c in range(256) if c & 0x7C != 0x7C],
    "float8_e4m3fnuz": [c for c in range(256) if c != 0x80],
    "float8_e5m2fnuz": [c for c in range(256) if c != 0x80],
    "float8_e8m0fnu": list(range(120, 135)),
}


def random_bytes(dtype: DType, shape: Sequence[int], seed: int) -> bytes:
    """Random finite bytes of a tensor of `dtype` (a `remapdsl.dtypes` row) and `shape` (module docstring)."""
    rng = np.random.default_rng(seed)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if dtype.name in _FP8_CODES:
        return rng.choice(np.array(_FP8_CODES[dtype.name], dtype=np.uint8), size=count).tobytes()
    if dtype.bits < 8:  # F4, F6: packed codes; every code is finite
        return rng.integers(0, 256, size=count * dtype.bits // 8, dtype=np.uint8).tobytes()
    if dtype.kind in ("float", "complex"):
        n = count * (2 if dtype.kind == "complex" else 1)
        values = (rng.choice([-1.0, 1.0], n) * (1 + rng.integers(0, 8, n) / 8)
                  * np.exp2(rng.integers(-3, 4, n))).astype(np.float32)
        if dtype.name == "bfloat16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        wanted = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "complex64": np.float32}
        return values.astype(wanted[dtype.name]).tobytes()
    if dtype.kind == "bool":
        return rng.integers(0, 2, size=count, dtype=np.uint8).tobytes()
    numpy_dtype = np.dtype(f"{'i' if dtype.kind == 'int' else 'u'}{dtype.bits // 8}").newbyteorder("<")
    low = -100 if dtype.kind == "int" else 0
    return rng.integers(low, low + 200, size=count).astype(numpy_dtype).tobytes()


def layer_and_expert(ckpt_key: str) -> tuple[int | None, int | None]:
    """The layer and expert indices a key names (`model.layers.3.mlp.experts.7.w1` -> (3, 7)): an
    integer segment right after one of LAYER_WORDS / EXPERT_WORDS."""
    parts = ckpt_key.split(".")
    layer = expert = None
    for word, following in pairwise(parts):
        if following.isdigit():
            if word in LAYER_WORDS and layer is None:
                layer = int(following)
            elif word in EXPERT_WORDS and expert is None:
                expert = int(following)
    return layer, expert


def scale_down(inventory: Inventory, *, layers: int | None = None, experts: int | None = None,
               config: Mapping[str, Any] | None = None) -> SnapshotInventory:
    """The inventory of the first `layers` layers and `experts` experts of a checkpoint, files laid out
    anew (empty ones dropped), its config's counts and per-layer lists cut to match. Tensors that stack
    all experts in one keep their shape."""
    config = dict(checkpoint_config(inventory) if config is None else config)

    def keep(t) -> bool:
        layer, expert = layer_and_expert(t.ckpt_key)
        return (layers is None or layer is None or layer < layers) and (experts is None or expert is None
                                                                         or expert < experts)

    files = {}
    for name, tensors in _by_file(inventory, keep).items():
        if not tensors:
            continue
        header_bytes, header = _header(tensors, inventory.files[name].metadata)
        data_offset = PREFIX_NBYTES + len(header_bytes)
        files[name] = {"nbytes": data_offset + sum(t.nbytes for t in tensors), "data_offset": data_offset,
                       "header": header}
    caps = [(key, layers) for key in (*LAYER_CONFIG_KEYS, "first_k_dense_replace")]
    caps += [(key, experts) for key in (*EXPERT_CONFIG_KEYS, "num_experts_per_tok")]
    for key, most in caps:
        if most is not None and isinstance(config.get(key), int):
            config[key] = min(config[key], most)
    if layers is not None:
        if isinstance(config.get("mlp_only_layers"), list):
            config["mlp_only_layers"] = [n for n in config["mlp_only_layers"] if n < layers]
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = config["layer_types"][:layers]
    snapshot = {"format": FORMAT, "version": VERSION, "index_file": inventory.index_file, "ignored_files": [],
                "files": files, "config": config}
    return parse_snapshot(snapshot, f"{inventory.root} (scaled down)")


def write_pretrained(config: Mapping, folder: Path, seed: int = 0) -> Path:
    """A tiny transformers model of `config` (with `model_type`) saved with `save_pretrained`, every
    floating tensor random (from_config's norms of 1 and biases of 0 would hide a swapped mapping)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    values = dict(config)
    model_config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config)
        with torch.no_grad():
            for value in model.state_dict(keep_vars=True).values():
                if value.is_floating_point():
                    value.copy_(torch.randn(value.shape, dtype=torch.float32).to(value.dtype))
    model.save_pretrained(folder)
    return Path(folder)


def write_dcp_sharded(tensors: Mapping[str, Any], folder: str | os.PathLike, tilings: Mapping[str, Any],
                      config: Mapping[str, Any] | None = None) -> Path:
    """Write `tensors` (key -> torch tensor) as torch's `HuggingFaceStorageWriter(save_distributed=True)`
    does: chunk i of each key (`tilings[key]`: a `strategies.Tiling` or `(offsets, sizes)` boxes; none: whole)
    in file i, `shard-0000i-model-00001-of-00001.safetensors`, whose `DCP_SHARDING_INFO` gives its chunks'
    offsets (empty chunks too, as DCP writes them); and `config` as config.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[int, tuple[dict, dict]] = {}
    for key, tensor in tensors.items():
        tiling = tilings.get(key)
        boxes = getattr(tiling, "boxes", tiling) or [((0,) * tensor.dim(), tuple(tensor.shape))]
        for i, (offsets, sizes) in enumerate(boxes):
            piece = tensor[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            chunk, info = files.setdefault(i, ({}, {}))
            chunk[key] = piece.contiguous()
            info[key] = {"saved_offsets": list(offsets)}
    for i, (chunk, info) in sorted(files.items()):
        save_file(chunk, str(folder / f"shard-{i + 1:05d}-model-00001-of-00001.safetensors"),
                  metadata={"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"})
    if config is not None:
        (folder / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
    return folder
