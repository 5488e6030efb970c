"""Megatron-Bridge as the oracle for the Megatron-Core rule files (rules/megatron_*.remap), from goldens.

oracles/megatron_bridge/generate.py ran Megatron-Bridge 0.6.2's own `load_hf_weights` on gloo CPU ranks
and kept what each Megatron-Core rank held, by its rank-local names, in tests/goldens/megatron_bridge/
CASE/rank{R}.safetensors (manifest.json: versions, config, tp / pp / ep, each rank's coordinates, and
how the bridge's `export_hf_weights` compared with the checkpoint). The checkpoints it read are written
again here, byte for byte, by tests/megatron_checkpoints.py. No Megatron-Bridge is imported.

A rank's local names map to the global ones the rule files make by Megatron-Core's conventions:
a pipeline stage numbers its layers from 0 (global layer = pp_rank * layers / pp + local), and an
expert-parallel rank its experts (global expert = ep_rank * experts / ep + local, in
`linear_fc1.weight{i}` and `local_experts.{i}.`). Tensor-parallel shards are the boxes that
examples/megatron_tp_layout.json gives each rank.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from megatron_checkpoints import write_checkpoint
from safetensors.torch import load_file

import remapdsl
from remapdsl.sharding import Mesh, layout_for, local_shard, read_layout

REPO = Path(__file__).resolve().parent.parent
GOLDENS = REPO / "tests" / "goldens" / "megatron_bridge"
LAYOUT = REPO / "examples" / "megatron_tp_layout.json"

# checkpoint -> rule file, for each expert layout
RULES = {("llama", "grouped"): "megatron_llama", ("qwen3", "grouped"): "megatron_qwen3",
         ("qwen3_moe", "grouped"): "megatron_qwen3_moe", ("qwen3_moe", "sequential"): "megatron_qwen3_moe_sequential",
         ("deepseek_v3", "grouped"): "megatron_deepseek_v3", ("deepseek_v3_fp8", "grouped"): "megatron_deepseek_v3_fp8"}
CASES = sorted(p.name for p in GOLDENS.iterdir() if (p / "manifest.json").is_file())


def manifest(case: str) -> dict:
    return json.loads((GOLDENS / case / "manifest.json").read_text())


def rules_of(m: dict) -> str:
    return RULES[(m["checkpoint"], m["experts"])]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each checkpoint the oracle read, written once."""
    root = tmp_path_factory.mktemp("megatron_checkpoints")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_checkpoint(name, root / name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def whole(checkpoints):
    """remapdsl's load of a checkpoint through a rule file, every runtime tensor whole (once each)."""
    loaded: dict[tuple[str, str], dict] = {}

    def get(checkpoint: str, rules: str) -> dict:
        if (checkpoint, rules) not in loaded:
            folder = checkpoints(checkpoint)
            state = remapdsl.compile_rules(rules, str(folder)).empty_state_dict()
            remapdsl.load(state, str(folder), rules)
            loaded[checkpoint, rules] = state
        return loaded[checkpoint, rules]

    return get


def global_name(local: str, m: dict, coordinates: dict) -> str:
    """A rank's local Megatron-Core name -> the global one (layer by pipeline stage, expert by EP rank)."""
    config = m["config"]
    parts = local.split(".")
    if m["pp"] > 1 and parts[:2] == ["decoder", "layers"]:
        parts[2] = str(coordinates["pp"] * config["num_hidden_layers"] // m["pp"] + int(parts[2]))
    if m["ep"] > 1 and "experts" in parts:
        experts = config.get("num_experts") or config["n_routed_experts"]
        first = coordinates["ep"] * experts // m["ep"]
        at = parts.index("experts")
        if parts[at + 1] == "local_experts":
            parts[at + 2] = str(first + int(parts[at + 2]))
        elif parts[-1].startswith("weight") and parts[-1] != "weight":
            parts[-1] = f"weight{first + int(parts[-1].removeprefix('weight'))}"
    return ".".join(parts)


def golden(case: str, rank: int) -> dict[str, torch.Tensor]:
    return load_file(GOLDENS / case / f"rank{rank}.safetensors")


def differences(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype} {list(got.shape)} != {want.dtype} {list(want.shape)}"
    return None if torch.equal(got, want) else "values differ"


# -- the goldens themselves -------------------------------------------------------------------------------


def test_goldens_are_complete_and_small():
    assert {rules_of(manifest(c)) for c in CASES} == set(RULES.values())
    for case in CASES:
        m = manifest(case)
        assert m["versions"]["megatron-bridge"] == "0.6.2" and m["versions"]["megatron-core"] == "0.19.2"
        assert [r["rank"] for r in m["ranks"]] == list(range(m["world"]))
        assert all(r["unwritten"] == [] for r in m["ranks"]), case  # the bridge wrote every parameter
    assert sum(p.stat().st_size for p in GOLDENS.rglob("*") if p.is_file()) < 5_000_000


def test_every_megatron_file_names_the_cases_that_verify_it():
    by_name = {e.name: e for e in remapdsl.shipped_rules()}
    for case in CASES:
        entry = by_name[rules_of(manifest(case))]
        assert any("tests/test_megatron_bridge.py" in v and f"{case}," in v.replace(":", ",") for v in entry.verified), case


# -- loads ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in CASES if manifest(c)["world"] == 1])
def test_whole_load_equals_the_bridge_bit_for_bit(case, whole):
    """tp = pp = ep = 1: the rule file makes exactly the names and tensors Megatron-Bridge made."""
    m = manifest(case)
    state = whole(m["checkpoint"], rules_of(m))
    want = golden(case, 0)
    assert sorted(state) == sorted(want)
    wrong = {k: d for k in want if (d := differences(state[k], want[k]))}
    assert wrong == {}


@pytest.mark.parametrize("case", [c for c in CASES if manifest(c)["pp"] > 1 or manifest(c)["ep"] > 1])
def test_pipeline_and_expert_ranks_hold_the_global_tensors_by_local_names(case, whole):
    """pp = 2 or ep = 2: each rank's local tensors, named globally, are the whole load's, and the ranks
    together hold every runtime tensor."""
    m = manifest(case)
    state = whole(m["checkpoint"], rules_of(m))
    held = set()
    for r in m["ranks"]:
        tensors = golden(case, r["rank"])
        names = {local: global_name(local, m, r["coordinates"]) for local in tensors}
        assert len(set(names.values())) == len(names)
        wrong = {f"{local} ({name})": d for local, name in names.items()
                 if (d := differences(state[name], tensors[local]) if name in state else "no such runtime tensor")}
        assert wrong == {}, f"rank {r['rank']}"
        held |= set(names.values())
    assert held == set(state)


def local_tensor(whole_tensor: torch.Tensor, key: str, plan, mesh: Mesh, rank: int) -> torch.Tensor:
    """What the layout gives `rank` of a whole tensor: its boxes, placed at their local offsets."""
    shard = local_shard(whole_tensor.shape, mesh.sizes, layout_for(key, whole_tensor.shape, plan, mesh),
                        mesh.coordinate(rank))
    out = torch.empty(shard.shape, dtype=whole_tensor.dtype)
    for box, at in zip(shard.boxes, shard.local_offsets):
        src = whole_tensor[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        out[tuple(slice(o, o + s) for o, s in zip(at, box.sizes))] = src
    return out


TP_CASES = [c for c in CASES if manifest(c)["tp"] > 1]


@pytest.mark.parametrize("case", TP_CASES)
def test_the_tp_layout_gives_each_rank_its_megatron_shard(case, whole):
    """tp = 2: the boxes examples/megatron_tp_layout.json gives each rank, cut from the whole load, are
    the rank's tensors bit for bit (grouped qkv by rows, [gate_r; up_r], rows of the vocabulary)."""
    m = manifest(case)
    state = whole(m["checkpoint"], rules_of(m))
    plan, mesh = read_layout(LAYOUT), Mesh.of({"tp": m["tp"]})
    for r in m["ranks"]:
        tensors = golden(case, r["rank"])
        assert sorted(tensors) == sorted(state)
        wrong = {k: d for k, t in tensors.items()
                 if (d := differences(local_tensor(state[k], k, plan, mesh, r["coordinates"]["tp"]), t))}
        assert wrong == {}, f"rank {r['rank']}"


@pytest.mark.parametrize("case", TP_CASES)
def test_each_tp_rank_plans_to_read_only_its_own_bytes(case, checkpoints):
    m = manifest(case)
    folder = str(checkpoints(m["checkpoint"]))
    inventory = remapdsl.open_checkpoint(folder)
    compiled = remapdsl.compile_rules(rules_of(m), folder)
    plan, mesh = read_layout(LAYOUT), Mesh.of({"tp": m["tp"]})
    plans = [remapdsl.plan_rank(compiled, inventory, plan, mesh, rank) for rank in range(m["tp"])]
    assert all(p.bytes_read == p.bytes_owned for p in plans)
    total = sum(golden(case, r).get(k).numel() * golden(case, r).get(k).element_size()
                for r in range(m["tp"]) for k in golden(case, r))
    assert sum(p.bytes_owned for p in plans) == total


def _load_on_rank(rank: int, world: int, jobs: list[dict]) -> None:
    for job in jobs:
        state = {k: torch.full_like(t, float("nan")) for k, t in load_file(job["golden"].format(rank=rank)).items()}
        remapdsl.load(state, job["folder"], job["rules"], layout=read_layout(LAYOUT), mesh=Mesh.of({"tp": world}))
        want = load_file(job["golden"].format(rank=rank))
        wrong = [k for k in want if differences(state[k], want[k])]
        assert not wrong, f"{job['case']}: {wrong}"


@pytest.mark.distributed
def test_tp2_loads_on_two_gloo_ranks_equal_the_bridge(checkpoints):
    """Every tp = 2 case loaded on 2 real gloo ranks through the layout: each rank's tensors, NaN-filled
    at its golden's local shapes, end equal to what Megatron-Bridge gave that rank."""
    from remapdsl.testing.ranks import run_ranks

    jobs = [{"case": c, "folder": str(checkpoints(manifest(c)["checkpoint"])), "rules": rules_of(manifest(c)),
             "golden": str(GOLDENS / c / "rank{rank}.safetensors")} for c in TP_CASES]
    run_ranks(_load_on_rank, 2, jobs, timeout=120)


def local_of(m: dict, coordinates: dict) -> dict:
    """The `local=` a Megatron-Core rank passes (docs/distributed.md): its stage's first layer, its first
    expert, for the names that number them."""
    config, local = m["config"], {}
    if m["pp"] > 1:
        local["decoder.layers.{}"] = coordinates["pp"] * config["num_hidden_layers"] // m["pp"]
    if m["ep"] > 1:
        first = coordinates["ep"] * (config.get("num_experts") or config["n_routed_experts"]) // m["ep"]
        for layer in ("decoder.layers.*", "mtp.layers.*.mtp_model_layer"):
            if m["experts"] == "sequential":
                local[f"{layer}.mlp.experts.local_experts.{{}}"] = first
            else:
                local |= {f"{layer}.mlp.experts.{fc}.weight{{}}": first for fc in ("linear_fc1", "linear_fc2")}
    return local


def _local_names_on_rank(rank: int, world: int, jobs: list[dict]) -> None:
    for job in jobs:
        m = manifest(job["case"])
        local = local_of(m, m["ranks"][rank]["coordinates"])
        want = load_file(job["golden"].format(rank=rank))
        state = {k: torch.full_like(t, float("nan")) for k, t in want.items()}
        remapdsl.load(state, job["folder"], job["rules"], local=local)
        wrong = [k for k in want if differences(state[k], want[k])]
        assert not wrong, f"{job['case']}: {wrong}"
        remapdsl.save(state, job["out"], job["rules"], like=job["folder"], local=local,
                      dropped="copy" if m["checkpoint"].startswith("deepseek_v3") else "error")


@pytest.mark.distributed
def test_pipeline_and_expert_ranks_load_and_save_by_their_local_names(checkpoints, tmp_path):
    """pp = 2 and ep = 2 on 2 real gloo ranks, each holding exactly what Megatron-Bridge gave it, under
    its rank-local names, with `local=` its offsets: each rank's load equals its golden, and the ranks
    together save the checkpoint back byte for byte."""
    from remapdsl.testing.ranks import run_ranks

    cases = [c for c in CASES if manifest(c)["pp"] > 1 or manifest(c)["ep"] > 1]
    jobs = [{"case": c, "folder": str(checkpoints(manifest(c)["checkpoint"])), "rules": rules_of(manifest(c)),
             "golden": str(GOLDENS / c / "rank{rank}.safetensors"), "out": str(tmp_path / c)} for c in cases]
    run_ranks(_local_names_on_rank, 2, jobs, timeout=120)
    for job in jobs:
        assert filecmp.cmp(Path(job["folder"]) / "model.safetensors", Path(job["out"]) / "model.safetensors",
                           shallow=False), job["case"]


# -- saves ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in CASES if manifest(c)["world"] == 1])
def test_save_writes_the_checkpoint_back_where_the_bridge_exports_it(case, whole, checkpoints, tmp_path):
    """remapdsl.save(like=checkpoint) of the whole load writes the checkpoint's bytes. Megatron-Bridge's
    `export_hf_weights` gave back every tensor it exports equal; it does not export DeepSeek-V3's MTP
    copies of the embedding and output head (which Megatron-Core shares): remapdsl copies those
    (`dropped="copy"`). The FP8 release it exports dequantized (bf16); remapdsl writes FP8 back."""
    m = manifest(case)
    folder = checkpoints(m["checkpoint"])
    export = m["export"]
    not_exported = sorted(k for k, v in export.items() if v == "not exported")
    mtp_copies = ["model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"]
    if m["checkpoint"] == "deepseek_v3_fp8":
        fp8 = [k for k in export if k.endswith("_scale_inv")]
        assert fp8 and all(export[k] == "not exported" for k in fp8)
        assert all(export[k.removesuffix("_scale_inv")].startswith("exported as torch.bfloat16") for k in fp8)
        assert sorted(set(not_exported) - set(fp8)) == mtp_copies
    else:
        assert all(v == "equal" for k, v in export.items() if k not in not_exported)
        assert not_exported == ([] if m["checkpoint"] != "deepseek_v3" else mtp_copies)
    state = whole(m["checkpoint"], rules_of(m))
    dropped = "copy" if m["checkpoint"].startswith("deepseek_v3") else "error"
    remapdsl.save(state, tmp_path / "saved", rules_of(m), like=str(folder), dropped=dropped)
    for name in ("model.safetensors", "config.json"):
        assert filecmp.cmp(folder / name, tmp_path / "saved" / name, shallow=False), name


def test_check_passes_on_each_megatron_file(checkpoints, capsys):
    from remapdsl.cli import main

    for case in CASES:
        m = manifest(case)
        assert main(["check", rules_of(m), "--checkpoint", str(checkpoints(m["checkpoint"]))]) == 0, \
            capsys.readouterr().err


def test_a_megatron_model_of_the_fp8_release_exports_bf16_without_like(whole, checkpoints, tmp_path):
    """As Megatron-Bridge exports the FP8 release: the model loaded through `megatron_deepseek_v3_fp8`
    (dequantized) saved without `like` through the unquantized `megatron_deepseek_v3` gives a bf16 Hugging
    Face checkpoint with no scales, whose load is the model again, bit for bit."""
    folder = checkpoints("deepseek_v3_fp8")
    state = whole("deepseek_v3_fp8", "megatron_deepseek_v3_fp8")
    config = json.loads((folder / "config.json").read_text())
    remapdsl.save(state, tmp_path / "bf16", "megatron_deepseek_v3", config=config)
    written = load_file(tmp_path / "bf16" / "model.safetensors")
    assert not [k for k in written if k.endswith("_scale_inv")]
    assert {str(t.dtype) for k, t in written.items() if k.endswith("proj.weight")} == {"torch.bfloat16"}
    again = remapdsl.compile_rules("megatron_deepseek_v3", str(tmp_path / "bf16")).empty_state_dict()
    remapdsl.load(again, str(tmp_path / "bf16"), "megatron_deepseek_v3")
    assert sorted(again) == sorted(state) and not {k for k in state if differences(again[k], state[k])}


def _dense_stages(rank: int, world: int, whole_path: str, folder: str, out: str) -> None:
    """pp=2 x tp=2: stage `rank // 2` holds its layer (and the embedding first, the head last), each
    tensor the layout's tp shard, under global names and under Megatron-Core's local names."""
    whole = load_file(whole_path)
    plan, mesh, tp_mesh = read_layout(LAYOUT), Mesh.of({"pp": 2, "tp": 2}), Mesh.of({"tp": 2})
    stage, tp = divmod(rank, 2)

    def of_stage(key: str) -> bool:
        if key.startswith("decoder.layers."):
            return int(key.split(".")[2]) == stage
        return (stage == 0) == key.startswith("embedding.")

    shards = {k: local_tensor(v, k, plan, tp_mesh, tp) for k, v in whole.items() if of_stage(k)}
    for names, local in (("global", None), ("local", {"decoder.layers.{}": stage})):
        state = {(k.replace(f"decoder.layers.{stage}.", "decoder.layers.0.") if local else k): torch.full_like(
            v, float("nan")) for k, v in shards.items()}
        remapdsl.load(state, folder, "megatron_llama", layout=plan, mesh=mesh, local=local)
        given = dict(zip(shards, state.values()))
        wrong = [k for k in shards if differences(given[k], shards[k])]
        assert not wrong, f"{names}: {wrong}"
        remapdsl.save(state, Path(out) / names, "megatron_llama", like=folder, layout=plan, mesh=mesh, local=local)


@pytest.mark.distributed
def test_dense_pipeline_stages_with_tensor_parallel_shards_by_both_names(whole, checkpoints, tmp_path):
    """4 gloo ranks as pp=2 x tp=2 on the Llama checkpoint through `megatron_llama` and
    examples/megatron_tp_layout.json: each stage's tp shards, named globally (torchtitan's way) or
    locally (Megatron-Core's, `local=` the stage's offset), load to the whole load's boxes, and the
    stages together save the checkpoint back byte for byte."""
    from safetensors.torch import save_file

    from remapdsl.testing.ranks import run_ranks

    folder = checkpoints("llama")
    save_file(whole("llama", "megatron_llama"), str(tmp_path / "whole.safetensors"))
    run_ranks(_dense_stages, 4, str(tmp_path / "whole.safetensors"), str(folder), str(tmp_path), timeout=120)
    for names in ("global", "local"):
        assert filecmp.cmp(folder / "model.safetensors", tmp_path / names / "model.safetensors", shallow=False), names
