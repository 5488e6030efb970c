"""Block-FP8 loads on real gloo process groups: the bundled tiny Qwen3-MoE re-saved with every
projection as E4M3 values plus float32 scales per [3, 5] block (so tensor-parallel shard edges
cut through blocks), loaded under TP=2 and EP=2 (plain tensors with a layout, and DTensors).
Every rank's shards must equal the single-process dequantized load sliced to it, each rank must
read its own values plus the scale tiles that cover them, nothing else, and saving the shards
back must write the FP8 checkpoint byte for byte."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import quant_reference as ref
import torch
import torch.distributed as dist
from checkpoints import tiny_checkpoint
from gloo import CHECK_FAILURES, distributed_like
from safetensors.torch import load_file

import remapdsl
from remapdsl.checkpoint import read_config
from remapdsl.sharding import LayoutPlan, Mesh, layout_for, local_shard
from remapdsl.testing.ranks import run_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
BLOCK = (3, 5)
RULES = (ROOT / "rules" / "qwen3_moe.remap").read_text() + f"""
dequantize {{P:path}}.weight, {{P}}.weight_scale_inv -> {{P}}.weight
    | fp8_block(block=[{BLOCK[0]}, {BLOCK[1]}], to=float32)
"""
TP = {
    "*.self_attn.q_proj": "colwise", "*.self_attn.k_proj": "colwise", "*.self_attn.v_proj": "colwise",
    "*.self_attn.o_proj": "rowwise", "*.mlp.experts.gate_up_proj": "packed_colwise",
    "*.mlp.experts.down_proj": "rowwise",
}
EP = {"*.mlp.experts.*": "grouped_gemm"}


def fp8_checkpoint(folder: Path) -> Path:
    source = ROOT / "examples" / "tiny-qwen3-moe"
    tensors = {}
    for key, value in load_file(str(source / "model.safetensors")).items():
        if key.endswith("_proj.weight"):
            tensors[key], tensors[key.removesuffix("weight") + "weight_scale_inv"] = ref.quantize_fp8_block(value, BLOCK)
        else:
            tensors[key] = value
    tiny_checkpoint(folder, tensors)
    (folder / "config.json").write_text((source / "config.json").read_text())
    return folder


def _on_ranks(rank: int, world: int, folder: str, out: str) -> list[str]:
    """TP and EP, each as plain shards (loaded, then saved back) and as DTensors; the failures."""
    failures: list[str] = []
    rules = remapdsl.language.rules_from_text(RULES, "qwen3_moe_fp8.remap")
    inventory = remapdsl.open_checkpoint(folder)
    compiled = remapdsl.compile_rules(rules, inventory, read_config(inventory))
    expected = compiled.empty_state_dict()
    remapdsl.load(expected, folder, rules)
    for name, plan_map, mesh_dim in (("tp", TP, "tp"), ("ep", EP, "ep")):
        try:
            mesh, plan = Mesh.of({mesh_dim: world}), LayoutPlan.from_mapping(plan_map, mesh_dim=mesh_dim)
            _plain(rank, expected, rules, folder, mesh, plan, Path(out) / f"saved-{name}")
            _dtensors(expected, rules, folder, mesh, plan)
        except CHECK_FAILURES:  # reported by the parent
            failures.append(f"{name}: {traceback.format_exc()}")
    return failures


def _plain(rank, expected, rules, folder, mesh, plan, out: Path) -> None:
    local, shards = {}, {}
    for key, full in expected.items():
        shard = local_shard(full.shape, mesh.sizes, layout_for(key, full.shape, plan, mesh), mesh.coordinate(rank))
        local[key] = torch.full(shard.shape, float("nan"), dtype=full.dtype)
        shards[key] = shard
    report = remapdsl.load(local, folder, rules, layout=plan, mesh=mesh)
    for key, shard in shards.items():
        for box, at in zip(shard.boxes, shard.local_offsets):
            want = expected[key][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            got = local[key][tuple(slice(o, o + s) for o, s in zip(at, box.sizes))]
            assert torch.equal(got, want), (key, box)
    assert report.bytes_read == report.bytes_owned + report.scale_bytes_read
    assert 0 < report.scale_bytes_read < report.bytes_owned
    # and back: every rank encodes the values it is the lowest holder of with the stored scales
    remapdsl.save(local, out, rules, like=folder, layout=plan, mesh=mesh)
    dist.barrier()
    assert (out / "model.safetensors").read_bytes() == (Path(folder) / "model.safetensors").read_bytes()


def _dtensors(expected, rules, folder, mesh, plan) -> None:
    targets, wanted = distributed_like(expected, mesh, plan)
    remapdsl.load(targets, folder, rules)
    for key in expected:
        assert torch.equal(targets[key].to_local(), wanted[key]), key


def test_block_fp8_under_tp_and_ep_equals_the_sliced_single_process_load(tmp_path):
    folder = fp8_checkpoint(tmp_path / "fp8")
    failures = run_ranks(_on_ranks, 2, str(folder), str(tmp_path))
    assert failures == [[], []], "\n\n".join(f for r in failures for f in r)
