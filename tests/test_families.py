"""More model families in the shipped rule library, each verified bit for bit.

Plain layouts (the transformers in-memory layout): a tiny random model of the family, saved with
``save_pretrained``, loads into exactly ``model.state_dict()`` and saves back to the same bytes.
Layouts that transformers does not build (``*_split``, ``vllm_*``) are checked against torch
operations that reproduce what the model's own forward pass, or vLLM's weight loader, does with
the checkpoint's tensors; the FP8 release against transformers' own dequantization and against the
quantizer's reference inverse. Every file added here passes ``remapdsl check --checkpoint`` on its
test checkpoint. Skipped where transformers is not installed.
"""

from __future__ import annotations

import filecmp
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import quant_reference as ref
import torch
from hf_models import (
    CASES,
    FAMILY_CASES,
    Built,
    build,
    checkpoint_tensor_bytes,
    copy_checkpoint,
    fp8_release,
    safetensors_files,
    transformers_state_dict,
    wrong_rules,
)

import remapdsl
from remapdsl.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> Built, each checkpoint made once (FAMILY_CASES first, then the oracle's CASES)."""
    root = tmp_path_factory.mktemp("families")
    built: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in built:
            built[name] = build(FAMILY_CASES.get(name) or CASES[name], root / name)
        return built[name]

    return get


def rules_path(name: str) -> str:
    return str(REPO / "rules" / f"{name}.remap")


def nan_like(state) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, float("nan")) for k, v in state.items()}


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """What the checkpoint stores, read with safetensors itself (not with remapdsl)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        out.update(load_file(path))
    return out


def assert_bit_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    wrong = [
        f"{k}: {got[k].dtype} {list(got[k].shape)} vs {want[k].dtype} {list(want[k].shape)}"
        if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
        else f"{k}: values differ"
        for k in want
        if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))
    ]
    assert wrong == [], "\n".join(wrong)


def assert_saves_the_original_files(state: dict, rules: str, folder: Path, out: Path) -> None:
    remapdsl.save(state, out, rules, like=str(folder))
    files = [p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".json")]
    assert files
    for name in files:
        assert filecmp.cmp(folder / name, out / name, shallow=False), name


# -- plain layouts: transformers is the oracle ------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_load_matches_transformers_state_dict(models, name):
    built = models(name)
    assert not [k for k, v in built.state_dict.items() if v.numel() > 1 and bool((v == v.flatten()[0]).all())]
    target = nan_like(built.state_dict)
    report = remapdsl.load(target, str(built.folder), str(REPO / built.case.rules))
    assert_bit_equal(target, dict(built.state_dict))
    assert sorted(report.loaded) == sorted(built.state_dict)
    stored = checkpoint_tensor_bytes(built.folder)
    if built.case.tied:  # lm_head.weight is the embedding, not stored: read once or twice
        assert "lm_head.weight" not in stored
        assert (
            sum(stored.values())
            <= report.bytes_read
            <= sum(stored.values()) + stored["model.embed_tokens.weight"]
        )
    else:
        assert report.bytes_read == sum(stored.values()), "every stored byte read exactly once"


@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_save_reproduces_the_save_pretrained_checkpoint(models, tmp_path, name):
    built = models(name)
    target = nan_like(built.state_dict)
    remapdsl.load(target, str(built.folder), str(REPO / built.case.rules))
    assert_saves_the_original_files(target, str(REPO / built.case.rules), built.folder, tmp_path / "saved")


@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_auto_picks_the_plain_layout(models, name):
    built = models(name)
    chosen, reason = remapdsl.choose_rules(str(built.folder))
    assert chosen.path == built.case.rules, name
    assert reason == f"model_type `{built.case.model_type}`"


def test_gpt_neox_stores_the_output_projection_as_embed_out(models):
    """transformers 5 writes lm_head.weight back under its original name, and reads it from there."""
    stored = checkpoint_tensor_bytes(models("gpt_neox").folder)
    assert "embed_out.weight" in stored and "lm_head.weight" not in stored


# -- split layouts: the model's own forward pass is the oracle ---------------------------------------


def phi3_split(built: Built) -> dict[str, torch.Tensor]:
    """Phi3Attention: q = qkv[..., :NH D], k = the next KV D, v = the rest; Phi3MLP: gate, up =
    gate_up.chunk(2, dim=-1). On a linear layer's output these are the same cuts of its weight rows."""
    cfg = built.case.config
    q_rows = cfg["num_attention_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
    kv_rows = cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
    out = {}
    for key, value in built.state_dict.items():
        if key.endswith("self_attn.qkv_proj.weight"):
            stem = key.removesuffix("qkv_proj.weight")
            out[stem + "q_proj.weight"] = value[:q_rows]
            out[stem + "k_proj.weight"] = value[q_rows : q_rows + kv_rows]
            out[stem + "v_proj.weight"] = value[q_rows + kv_rows :]
        elif key.endswith("mlp.gate_up_proj.weight"):
            stem = key.removesuffix("gate_up_proj.weight")
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = value.chunk(2, dim=0)
        else:
            out[key] = value
    return out


def gpt_neox_split(built: Built) -> dict[str, torch.Tensor]:
    """GPTNeoXAttention: qkv(x).view(..., NH, 3 D), then chunk(3) of the last dim: on the weight,
    rows viewed [NH, 3 D, ...] and chunked in three along dim 1, each reshaped back to [NH D, ...]."""
    heads = built.case.config["num_attention_heads"]
    out = {}
    for key, value in built.state_dict.items():
        if ".attention.query_key_value." in key:
            stem, _, leaf = key.rpartition(".query_key_value.")
            per_head = value.reshape(heads, -1, *value.shape[1:])
            for name, part in zip("qkv", per_head.chunk(3, dim=1)):
                out[f"{stem}.{name}_proj.{leaf}"] = part.reshape(-1, *value.shape[1:])
        else:
            out[key] = value
    return out


SPLIT = {"phi3_split": ("phi3", phi3_split), "gpt_neox_split": ("gpt_neox", gpt_neox_split)}


@pytest.mark.parametrize("rules", list(SPLIT))
def test_split_layouts_equal_torch_slicing(models, rules):
    case, expected_of = SPLIT[rules]
    built = models(case)
    want = expected_of(built)
    assert len(want) > len(built.state_dict)
    got = nan_like(want)
    report = remapdsl.load(got, str(built.folder), rules_path(rules))
    assert_bit_equal(got, want)
    assert report.bytes_read == sum(checkpoint_tensor_bytes(built.folder).values())


def test_gpt_neox_split_matches_the_attention_forward(models):
    """The split projections give the attention's own q, k and v: x through query_key_value, viewed
    and chunked as GPTNeoXAttention does, equals x through each of q_proj, k_proj, v_proj."""
    built = models("gpt_neox")
    got = nan_like(gpt_neox_split(built))
    remapdsl.load(got, str(built.folder), rules_path("gpt_neox_split"))
    cfg = built.case.config
    heads, head_dim = cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    x = torch.randn(3, 5, cfg["hidden_size"], generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    prefix = "gpt_neox.layers.1.attention."
    fused = torch.nn.functional.linear(
        x,
        built.state_dict[prefix + "query_key_value.weight"].double(),
        built.state_dict[prefix + "query_key_value.bias"].double(),
    )
    qkv = fused.view(3, 5, -1, 3 * head_dim).transpose(1, 2).chunk(3, dim=-1)
    for name, want in zip("qkv", qkv):
        mine = torch.nn.functional.linear(
            x, got[f"{prefix}{name}_proj.weight"].double(), got[f"{prefix}{name}_proj.bias"].double()
        )
        torch.testing.assert_close(mine.view(3, 5, heads, head_dim).transpose(1, 2), want)


def test_phi3_split_matches_the_mlp_forward(models):
    """transformers' own Phi3MLP on the fused gate_up_proj equals down(silu(gate(x)) * up(x)) with
    the split gate and up (float64, so that the two matmul orders agree to rounding)."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    built = models("phi3")
    got = nan_like(phi3_split(built))
    remapdsl.load(got, str(built.folder), rules_path("phi3_split"))
    mlp = Phi3MLP(AutoConfig.for_model("phi3", **built.case.config)).double()
    prefix = "model.layers.1.mlp."
    mlp.load_state_dict(
        {k: built.state_dict[prefix + k].double() for k in ("gate_up_proj.weight", "down_proj.weight")}
    )
    x = torch.randn(
        5, built.case.config["hidden_size"], generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    gate, up, down = (got[f"{prefix}{name}_proj.weight"].double() for name in ("gate", "up", "down"))
    with torch.no_grad():
        want = mlp(x)
    torch.testing.assert_close(torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ down.T, want)


WRONG_CUTS = {  # the same shapes, the wrong rows: the oracle above must tell them apart
    "phi3_split": ("chunk(dim=0, n=2)", "deinterleave(dim=0, groups=2)"),
    "gpt_neox_split": ("deinterleave(dim=0, groups=NH)", "chunk(dim=0, n=3)"),
}


@pytest.mark.parametrize("rules", list(WRONG_CUTS))
def test_a_wrong_cut_of_the_same_shapes_is_caught(models, tmp_path, rules):
    case, expected_of = SPLIT[rules]
    built = models(case)
    want = expected_of(built)
    got = nan_like(want)
    remapdsl.load(
        got, str(built.folder), str(wrong_rules(tmp_path, Path(rules_path(rules)), *WRONG_CUTS[rules]))
    )
    assert [k for k in want if not torch.equal(got[k], want[k])]


@pytest.mark.parametrize("rules", list(SPLIT))
def test_split_layouts_save_the_original_files(models, tmp_path, rules):
    case, expected_of = SPLIT[rules]
    built = models(case)
    state = nan_like(expected_of(built))
    remapdsl.load(state, str(built.folder), rules_path(rules))
    assert_saves_the_original_files(state, rules_path(rules), built.folder, tmp_path / "saved")


# -- vLLM's serving layouts ----------------------------------------------------------------------------


def vllm_llama(built: Built) -> dict[str, torch.Tensor]:
    """vLLM's QKVParallelLinear.weight_loader writes shard "q" at row 0, "k" at NH D, "v" at
    (NH + KV) D, so qkv_proj = cat(q, k, v); MergedColumnParallelLinear writes gate_up_proj's
    shard 0 (gate) then shard 1 (up): cat(gate, up). Source: vllm/model_executor/layers/linear.py
    and the stacked_params_mapping of vllm/model_executor/models/llama.py (github.com/vllm-project/vllm)."""
    out = checkpoint_tensors(built.folder)

    def fuse(stem: str, parts: tuple[str, ...], fused: str, leaf: str) -> None:
        keys = [f"{stem}.{part}.{leaf}" for part in parts]
        if all(k in out for k in keys):
            out[f"{stem}.{fused}.{leaf}"] = torch.cat([out.pop(k) for k in keys])

    for layer in range(built.case.config["num_hidden_layers"]):
        for leaf in ("weight", "bias"):
            fuse(f"model.layers.{layer}.self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj", leaf)
        fuse(f"model.layers.{layer}.mlp", ("gate_proj", "up_proj"), "gate_up_proj", "weight")
    # vLLM pads the vocabulary to a multiple of 64 with zero rows, and a tied checkpoint has no
    # lm_head parameter (vocab_parallel_embedding.py; llama.py's tie_weights).
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in out:
            rows = -(-out[key].shape[0] // 64) * 64
            out[key] = torch.cat([out[key], out[key].new_zeros(rows - out[key].shape[0], out[key].shape[1])])
    return out


def vllm_qwen3_moe(built: Built) -> dict[str, torch.Tensor]:
    """vLLM's FusedMoE holds a layer's experts in its RoutedExperts module (`experts.routed_experts.`)
    as w13_weight [E, 2 I, H] and w2_weight [E, H, I]; its
    weight_loader puts expert e's gate_proj (shard w1) in rows 0:I of w13_weight[e] and up_proj (w3)
    in rows I:2I, and down_proj (w2) in w2_weight[e] (FusedMoE.make_expert_params_mapping and
    _load_w13 in vllm/model_executor/layers/fused_moe/layer.py). Attention and dense MLPs are fused
    as for Llama (vllm/model_executor/models/qwen3_moe.py)."""
    out = vllm_llama(built)
    for layer in range(built.case.config["num_hidden_layers"]):
        stem = f"model.layers.{layer}.mlp.experts"
        if f"{stem}.0.down_proj.weight" not in out:
            continue  # a dense layer
        experts = range(built.case.config["num_experts"])
        out[f"{stem}.routed_experts.w13_weight"] = torch.stack(
            [
                torch.cat([out.pop(f"{stem}.{e}.gate_proj.weight"), out.pop(f"{stem}.{e}.up_proj.weight")])
                for e in experts
            ]
        )
        out[f"{stem}.routed_experts.w2_weight"] = torch.stack([out.pop(f"{stem}.{e}.down_proj.weight") for e in experts])
    return out


VLLM = {
    "vllm_llama-llama": ("vllm_llama", "llama", vllm_llama),
    "vllm_llama-llama_tied": ("vllm_llama", "llama_tied", vllm_llama),
    "vllm_llama-qwen2": ("vllm_llama", "qwen2", vllm_llama),  # q/k/v biases fused too
    "vllm_llama-qwen3": ("vllm_llama", "qwen3", vllm_llama),  # q/k norms kept
    "vllm_qwen3_moe-qwen3_moe": ("vllm_qwen3_moe", "qwen3_moe", vllm_qwen3_moe),
    "vllm_qwen3_moe-qwen3_moe_dense0": ("vllm_qwen3_moe", "qwen3_moe_dense0", vllm_qwen3_moe),
}


@pytest.mark.parametrize("which", list(VLLM))
def test_vllm_layouts_equal_vllms_stacking(models, which):
    rules, case, expected_of = VLLM[which]
    built = models(case)
    want = expected_of(built)
    got = nan_like(want)
    remapdsl.load(got, str(built.folder), rules_path(rules))
    assert_bit_equal(got, want)
    assert any(k.endswith("qkv_proj.weight") for k in want)


@pytest.mark.parametrize("which", list(VLLM))
def test_vllm_layouts_save_the_original_files(models, tmp_path, which):
    rules, case, expected_of = VLLM[which]
    built = models(case)
    state = nan_like(expected_of(built))
    remapdsl.load(state, str(built.folder), rules_path(rules))
    assert_saves_the_original_files(state, rules_path(rules), built.folder, tmp_path / "saved")


# -- Qwen3-MoE as released in FP8 ----------------------------------------------------------------------


@pytest.mark.parametrize("rules, case", [("qwen3_moe_fp8", "qwen3_moe"), ("llama_fp8", "qwen3"),
                                         ("llama_fp8", "qwen2")])
def test_fp8_releases_equal_transformers(models, tmp_path, rules, case):
    """An FP8 release (Qwen3-MoE's, its experts stacked; a dense one in Qwen3-8B-FP8's layout; Qwen2
    with its unquantized biases) against transformers' CPU dequantization, bit for bit, every value
    and scale byte read once, and saved back byte for byte; `auto` picks the file. 8x8 blocks:
    transformers infers the block from the scale grid, so only dividing shapes are fair."""
    built = models(case)
    folder = fp8_release(built.folder, tmp_path / "fp8", (8, 8))
    want = transformers_state_dict(folder, torch.float32)
    got = nan_like(want)
    report = remapdsl.load(got, str(folder), rules_path(rules))
    assert_bit_equal(got, dict(want))
    assert report.bytes_read == sum(checkpoint_tensor_bytes(folder).values()) and report.scale_bytes_read > 0
    assert remapdsl.choose_rules(str(folder))[0].name == rules
    assert_saves_the_original_files(got, rules_path(rules), folder, tmp_path / "saved")


def test_qwen3_moe_fp8_128_blocks_are_the_dequantized_release(models, tmp_path):
    """The release's own 128x128 blocks, partial on every dim of the tiny model: each weight is the
    reference value x scale of its block (quant_reference.fp8_block), then stacked as qwen3_moe."""
    built = models("qwen3_moe")
    folder = fp8_release(built.folder, tmp_path / "fp8", (128, 128))

    def dequantize(tensors):
        out = {}
        for key, value in tensors.items():
            scale = tensors.get(key + "_scale_inv")
            if scale is not None:
                out[key] = ref.fp8_block(value, scale, (128, 128), torch.float32)
            elif not key.endswith("weight_scale_inv"):
                out[key] = value
        return out

    plain = copy_checkpoint(folder, tmp_path / "reference", dequantize)
    want = nan_like(built.state_dict)
    remapdsl.load(want, str(plain), rules_path("qwen3_moe"))
    got = nan_like(built.state_dict)
    remapdsl.load(got, str(folder), rules_path("qwen3_moe_fp8"))
    assert_bit_equal(got, want)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert not torch.equal(got[key], built.state_dict[key])  # quantized: near, not equal
    assert torch.allclose(got[key], built.state_dict[key], rtol=0.07, atol=0.05)


# -- remapdsl check --checkpoint on each added file --------------------------------------------------------

CHECKED = [
    ("llama", "qwen3"),
    ("llama", "qwen3_tied"),
    ("llama", "qwen2"),
    ("llama", "mistral"),
    ("gemma2", "gemma2"),
    ("gemma2", "gemma3_text"),
    ("phi3", "phi3"),
    ("phi3_split", "phi3"),
    ("gpt_neox", "gpt_neox"),
    ("gpt_neox_split", "gpt_neox"),
    ("llama4_text", "llama4_text"),
    ("llama4_text", "llama4_text_interleaved"),
    ("vllm_llama", "llama"),
    ("vllm_qwen3_moe", "qwen3_moe_dense0"),
]


@pytest.mark.parametrize("rules, case", CHECKED, ids=[f"{r}-{c}" for r, c in CHECKED])
def test_check_passes_on_its_test_checkpoint(models, capsys, rules, case):
    assert main(["check", rules, "--checkpoint", str(models(case).folder)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("rules, case", [("qwen3_moe_fp8", "qwen3_moe"), ("llama_fp8", "qwen3")])
def test_check_passes_on_the_fp8_release(models, capsys, tmp_path, rules, case):
    folder = fp8_release(models(case).folder, tmp_path / "fp8", (128, 128))
    assert main(["check", rules, "--checkpoint", str(folder)]) == 0, capsys.readouterr().err
    assert main(["check", "auto", "--checkpoint", str(folder)]) == 0
    assert f"auto chose {rules} " in capsys.readouterr().err


# -- the cookbook shows the shipped files -------------------------------------------------------------


def test_cookbook_snippets_are_the_shipped_files():
    """Each `remap` block of docs/cookbook.md that names a shipped file (`# rules/NAME.remap`) is
    that file's body, from `remap 1` on, so the page cannot drift from what ships."""
    blocks = re.findall(
        r"```remap\n# (rules/\w+\.remap)\n(.*?)```", (REPO / "docs/cookbook.md").read_text(), re.DOTALL
    )
    assert len(blocks) >= 5
    for path, block in blocks:
        text = (REPO / path).read_text()
        assert block == text[text.index("remap 1\n") :], path


# -- the fused and split layouts shard -----------------------------------------------------------------


@pytest.mark.distributed
def test_gpt_neox_split_shards_on_two_gloo_ranks(models):
    """Every runtime tensor cut in two (tp=2, dim 0): each rank's shard of q, k and v (one in
    three rows of the fused tensor, per head) equals the whole load sliced to it and reads only its
    bytes, and the two ranks' save writes the checkpoint back byte for byte, interleaving again.
    One case only: each spawns two processes (the expert stacking is covered by test_distributed)."""
    from remapdsl.testing import assert_sharded_round_trip

    ranks = assert_sharded_round_trip(rules_path("gpt_neox_split"), models("gpt_neox").folder, mesh="tp=2")
    assert len(ranks) == 2 and all(r["bytes_read"] > 0 for r in ranks)


def test_each_added_file_lists_the_cases_that_verify_it():
    """The `# verified:` lines of the files added here name their cases, as `remapdsl rules` shows.
    (llama.remap, which Qwen3, Qwen2 and Mistral share, is held to the oracle's cases by
    tests/test_rule_library.py.)"""
    by_path = {e.path: e for e in remapdsl.shipped_rules()}
    for case in FAMILY_CASES.values():
        if case.rules == "rules/llama.remap":
            continue
        entry = by_path[case.rules]
        assert any(
            "tests/test_families.py" in v and re.search(rf"\b{case.name}\b", v) for v in entry.verified
        ), case.name
    for name in [*SPLIT, *(rules for rules, _, _ in VLLM.values())]:
        assert any(re.search(rf"\({name}\)", v) for v in by_path[f"rules/{name}.remap"].verified), name
