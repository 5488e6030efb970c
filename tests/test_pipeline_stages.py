"""Pipeline stages: each rank holds only its stage's tensors, and loads and saves exactly those.

Four gloo ranks as pp=2 x tp=2 over the bundled tiny Qwen3-MoE: stage 0 (ranks 0, 1) holds the
embedding and layer 0, stage 1 (ranks 2, 3) layer 1, the final norm and the head. Inside a stage the
tensors are DTensors on the stage's own tp submesh, plain whole tensors, or plain shards under a
layout plan, under global names (as torchtitan keeps them) or, the shards, under Megatron-style local
names (each stage's layer numbered from 0, `local=` its offset). Then four ranks as pp=2 x ep=2 under
Megatron-Core's local names (experts numbered from 0 per expert rank) and under global names. The
ranks check together that every runtime tensor is held by some rank (E230 on every rank otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gloo import BACKENDS
from safetensors.torch import load_file, save_file

import remapdsl
from remapdsl.sharding import LayoutPlan, Mesh
from remapdsl.testing import run_ranks

pytestmark = pytest.mark.distributed

CHECKPOINT = str(Path(__file__).parent.parent / "examples" / "tiny-qwen3-moe")
CONFIG = json.loads((Path(CHECKPOINT) / "config.json").read_text())
# plain local shards: Megatron-style column and row cuts on tp, the stages on pp (replicated there)
LAYOUT = LayoutPlan.from_mapping({"*.self_attn.*_proj": "colwise", "*.mlp.experts.down_proj": "rowwise",
                                  "model.embed_tokens": "embedding_rowwise", "lm_head": "colwise"}, mesh_dim="tp")
MESH = Mesh.of({"pp": 2, "tp": 2})
KINDS = ("dtensor", "plain", "layout", "local")  # how a stage holds its tensors (_stages)


def stage_of(key: str) -> int:
    """The pipeline stage holding a runtime tensor: layer L on stage L; the embedding first, the head last."""
    if key.startswith("model.layers."):
        return int(key.split(".")[2])
    return 0 if key.startswith("model.embed_tokens") else 1


def _stages(rank: int, world: int, whole_path: str, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from remapdsl.runtime.dist import gather_all
    from remapdsl.sharding.holdings import held_by_layout

    whole = load_file(whole_path)
    compiled = remapdsl.compile_rules(remapdsl.load_rules("qwen3_moe"), CHECKPOINT)
    results = {}
    for kind in KINDS:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        stage, tp = rank // 2, mesh["tp"]
        mine = {k: v for k, v in whole.items() if stage_of(k) == stage}
        shards = {"layout": LAYOUT, "mesh": MESH} if kind in ("layout", "local") else {}
        # "local": the layout's shards under Megatron-style names, each stage's layer numbered from 0
        renamed = {"local": {"model.layers.{}": stage}} if kind == "local" else {}

        def placed(k, v):
            placement = Shard(0) if v.dim() and v.shape[0] % 2 == 0 else Replicate()
            return distribute_tensor(v, tp, [placement], src_data_rank=None)

        if kind == "dtensor":
            state = {k: placed(k, torch.zeros_like(v)) for k, v in mine.items()}
            expected = {k: placed(k, v).to_local() for k, v in mine.items()}
        elif kind == "plain":
            state = {k: torch.zeros_like(v) for k, v in mine.items()}
            expected = mine
        else:  # this rank's shards under a layout plan (each one box: Shard placements only)
            held = held_by_layout(compiled, LAYOUT, MESH, rank)
            expected = {k: v[tuple(slice(o, o + n) for o, n in zip(*held[k].boxes[0]))].clone()
                        for k, v in mine.items()}
            state = {k: torch.zeros_like(v) for k, v in expected.items()}
        given = {k.replace(f"model.layers.{stage}.", "model.layers.0.") if renamed else k: v for k, v in state.items()}
        report = remapdsl.load(given, CHECKPOINT, "qwen3_moe", **shards, **renamed)
        local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in state.items()}
        assert all(torch.equal(local[k], expected[k]) for k in mine), kind
        assert sorted(report.loaded) == sorted(mine)
        saved = Path(out) / f"{kind}-like"
        remapdsl.save(given, saved, "qwen3_moe", like=CHECKPOINT, **shards, **renamed)
        if kind == "plain":  # torchtitan's adapter saves from the stages too
            from remapdsl.torchtitan import RuleStateDictAdapter

            RuleStateDictAdapter(None, CHECKPOINT, rules="qwen3_moe").save_hf(state, Path(out) / "titan")
        derived = Path(out) / f"{kind}-derived"
        remapdsl.save(given, derived, "qwen3_moe", config=CONFIG, **shards, **renamed)
        exported = dict(remapdsl.export(given, "qwen3_moe", like=CHECKPOINT, gather="tp" if kind != "plain" else (),
                                        **shards, **renamed))
        for value in state.values():  # ingest what every rank exported into zeroed stages
            (value.to_local() if hasattr(value, "to_local") else value).zero_()
        everyone = {}
        for part in gather_all(exported, "sharing the exported pairs"):
            everyone.update(part)
        remapdsl.ingest(given, everyone, "qwen3_moe", like=CHECKPOINT, **shards, **renamed)
        local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in state.items()}
        assert all(torch.equal(local[k], expected[k]) for k in mine), f"{kind}: ingest"
        results[kind] = report.bytes_read, exported
    with pytest.raises(remapdsl.RemapError) as info:  # stage 1 gone: nothing of it is held
        remapdsl.load({k: torch.zeros_like(v) for k, v in whole.items() if rank < 2 and stage_of(k) == 0},
                      CHECKPOINT, "qwen3_moe")
    results["missing"] = (info.value.diagnostic.code, info.value.diagnostic.message)
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_stage_loads_and_saves_what_it_holds(tmp_path, backend):
    compiled = remapdsl.compile_rules(remapdsl.load_rules("qwen3_moe"), CHECKPOINT)
    whole = {d.runtime_key: torch.zeros(d.shape, dtype=getattr(torch, d.dtype)) for d in compiled.runtime_tensors}
    remapdsl.load(whole, CHECKPOINT, "qwen3_moe")
    save_file(whole, str(tmp_path / "whole.safetensors"))
    results = run_ranks(_stages, 4, str(tmp_path / "whole.safetensors"), str(tmp_path), backend=backend)
    source = (Path(CHECKPOINT) / "model.safetensors").read_bytes()
    assert (tmp_path / "titan" / "model.safetensors").read_bytes() == source
    for name in KINDS:
        assert (tmp_path / f"{name}-like" / "model.safetensors").read_bytes() == source, name
        derived = load_file(str(tmp_path / f"{name}-derived" / "model.safetensors"))
        original = load_file(str(Path(CHECKPOINT) / "model.safetensors"))
        assert derived.keys() == original.keys() and all(torch.equal(derived[k], original[k]) for k in original)
    for kind in KINDS:  # the export: every checkpoint tensor once, from the stage holding it
        exported = [r[kind][1] for r in results]
        keys = [k for part in exported for k in part]
        assert sorted(keys) == sorted(original) and all(
            torch.equal(part[k], original[k]) for part in exported for k in part), kind
    missing = {r["missing"] for r in results}
    (code, message), = missing
    assert code == "E230" and message.startswith("the rules produce 13 runtime tensors that no rank holds: "
                                                 "`lm_head.weight`, `model.layers.1.input_layernorm.weight`"), message


# Megatron-Core's rank-local names: a stage numbers its layers from 0, an expert-parallel rank its experts
MEGATRON_STYLE = """remap 1
model.layers.{L}.mlp.experts.{E}.{gate,up}_proj.weight -> decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}
    | concat(dim=0)
model.layers.{L}.mlp.experts.{E}.down_proj.weight -> decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}
model.layers.{L}.self_attn.{N:seg}.weight -> decoder.layers.{L}.self_attention.{N}.weight
model.layers.{L}.{N:seg}_layernorm.weight -> decoder.layers.{L}.{N}_layernorm.weight
model.layers.{L}.mlp.gate.weight -> decoder.layers.{L}.mlp.router.weight
model.embed_tokens.weight -> embedding.word_embeddings.weight
model.norm.weight -> decoder.final_layernorm.weight
lm_head.weight -> output_layer.weight
"""


def local_name(key: str, stage: int, ep: int) -> str | None:
    """The name rank (stage, ep) gives a global runtime tensor, or None where it does not hold it: its
    stage's layer as layer 0, its two of the four experts as 0 and 1; the rest of a stage on both ep ranks."""
    parts = key.split(".")
    if key.startswith("decoder.layers."):
        if int(parts[2]) != stage:
            return None
        parts[2] = "0"
        if "experts" in parts:
            expert = int(parts[-1].removeprefix("weight"))
            if expert // 2 != ep:
                return None
            parts[-1] = f"weight{expert % 2}"
        return ".".join(parts)
    return key if (stage == 0) == key.startswith("embedding.") else None


def _local_names(rank: int, world: int, whole_path: str, rules_path: str, out: str) -> dict:
    whole = load_file(whole_path)
    stage, ep = divmod(rank, 2)
    local = {"decoder.layers.{}": stage, "decoder.layers.*.mlp.experts.linear_fc1.weight{}": 2 * ep,
             "decoder.layers.*.mlp.experts.linear_fc2.weight{}": 2 * ep}
    names = {local_name(k, stage, ep): k for k in whole if local_name(k, stage, ep)}
    state = {name: torch.zeros_like(whole[key]) for name, key in names.items()}
    report = remapdsl.load(state, CHECKPOINT, rules_path, local=local)
    assert all(torch.equal(state[name], whole[key]) for name, key in names.items())
    by_global = {key: torch.zeros_like(whole[key]) for key in names.values()}  # torchtitan's convention
    remapdsl.load(by_global, CHECKPOINT, rules_path)
    assert all(torch.equal(by_global[key], whole[key]) for key in names.values())
    remapdsl.save(state, Path(out) / "megatron-like", rules_path, like=CHECKPOINT, local=local)
    errors = []
    shifted = dict(local, **{"decoder.layers.*.mlp.experts.linear_fc2.weight{}": 2 * ep + 1})  # one off
    twice = {**state, "chunk1.decoder.layers.0.input_layernorm.weight": state["decoder.layers.0.input_layernorm.weight"]}
    for wrong in ({"local": shifted if rank == 0 else local},  # rank 0's experts 0, 1 as 1, 2: no rank holds 0
                  {"state_dict": twice if rank == 0 else state,  # a chunk renamed onto layer 0 of the stage
                   "local": {**local, "chunk1.decoder.layers.{}": ("decoder.layers.{}", stage)}}):
        with pytest.raises(remapdsl.RemapError) as info:
            remapdsl.load(**{"state_dict": state, "checkpoint": CHECKPOINT, "rules": rules_path, **wrong})
        errors.append((info.value.diagnostic.code, info.value.diagnostic.message))
    return sorted(report.loaded), errors


def test_rank_local_names_of_stages_and_expert_ranks_load_and_save(tmp_path):
    """4 ranks as pp=2 x ep=2, each naming what it holds as Megatron-Core does (`decoder.layers.0...`,
    `linear_fc1.weight0` and `weight1`), with `local=` its offsets: each loads its global tensors, and
    the ranks together save the checkpoint back byte for byte. On rank 0 alone, an offset one off
    leaves a tensor no rank holds (E230), and a renaming that makes two local names one global name
    is E419: both on every rank."""
    rules = tmp_path / "megatron_style.remap"
    rules.write_text(MEGATRON_STYLE)
    compiled = remapdsl.compile_rules(remapdsl.load_rules(rules), CHECKPOINT)
    whole = compiled.empty_state_dict()
    remapdsl.load(whole, CHECKPOINT, rules)
    save_file(whole, str(tmp_path / "whole.safetensors"))
    results = run_ranks(_local_names, 4, str(tmp_path / "whole.safetensors"), str(rules), str(tmp_path))
    assert (tmp_path / "megatron-like" / "model.safetensors").read_bytes() == \
        (Path(CHECKPOINT) / "model.safetensors").read_bytes()
    loaded = [r[0] for r in results]
    assert loaded[1] == [k for k in sorted(whole) if local_name(k, 0, 1)]  # global names in the report
    assert sorted(k for part in loaded for k in part) == sorted(k for k in whole for _ in
                                                                range(1 if "experts" in k else 2))
    (shifted, twice), = {tuple(r[1]) for r in results}  # the same errors on every rank
    assert shifted == ("E230", "the rules produce 1 runtime tensor that no rank holds: "
                               "`decoder.layers.0.mlp.experts.linear_fc2.weight0`")
    assert twice == ("E419", "local names `decoder.layers.0.input_layernorm.weight` and "
                             "`chunk1.decoder.layers.0.input_layernorm.weight` both become "
                             "`decoder.layers.0.input_layernorm.weight` (on rank 0)")
