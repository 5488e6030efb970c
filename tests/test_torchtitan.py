"""torchtitan 0.3.0's own state-dict adapters as the oracle for the shipped `torchtitan_*` rule files,
and `remapdsl.torchtitan.RuleStateDictAdapter` through `dcp.load` on real gloo ranks.

Each case is a tiny random transformers checkpoint (tests/hf_models.py `build`: `save_pretrained`,
every float tensor random) and a torchtitan model config of the same sizes. The oracle is what
torchtitan's checkpointer does with its adapter: `to_hf` of the model's state dict names the
checkpoint tensors it reads, `from_hf` of those tensors is the state dict it loads. The rule file
must make the same keys, shapes, dtypes and values, and save them back to byte-identical files.

torchtitan 0.3.0 is installed without its training dependencies (`pip install torchtitan==0.3.0
--no-deps tyro spmd_types`), plus `triton` (`pip install triton==3.9.0`, CPU-importable), which
torchtitan.models.common imports through its async expert-parallel kernels. These tests skip only
when those adapters cannot be imported.
"""

from __future__ import annotations

import filecmp
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("transformers")
try:
    from torchtitan.models import deepseek_v3, llama3, qwen3
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
except ImportError as exc:  # torchtitan absent, or without triton (torchtitan.models.common needs it)
    pytest.skip(f"torchtitan 0.3.0's state-dict adapters cannot be imported ({exc}); install them with "
                "`pip install torchtitan==0.3.0 --no-deps tyro spmd_types triton==3.9.0`", allow_module_level=True)

import torch
from hf_models import _DSV3, _QWEN3_MOE, Case, build, copy_checkpoint, safetensors_files
from safetensors.torch import load_file

import remapdsl
from remapdsl import RemapError

REPO = Path(__file__).resolve().parents[1]
_LLAMA = {"vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "num_hidden_layers": 2, "intermediate_size": 32}
_QWEN3 = dict(_LLAMA, head_dim=16)


# -- torchtitan model configs of the tiny transformers configs ---------------------------------------


def _model(cls, hf: dict, layers: list, **extra):
    dim, vocab = hf["hidden_size"], hf["vocab_size"]
    return cls.Config(dim=dim, vocab_size=vocab, layers=layers, norm=RMSNorm.Config(normalized_shape=dim),
                      tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
                      lm_head=Linear.Config(in_features=dim, out_features=vocab), **extra)


def llama3_config(hf: dict):
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=hf["max_position_embeddings"], theta=10000.0)
    layers = llama3._build_llama3_layers(n_layers=hf["num_hidden_layers"], dim=dim, n_heads=heads,
                                         n_kv_heads=hf["num_key_value_heads"], hidden_dim=hf["intermediate_size"],
                                         rope=rope, attn_backend="flex")
    return _model(llama3.Llama3Model, hf, layers, enable_weight_tying=hf.get("tie_word_embeddings", False))


def qwen3_config(hf: dict):
    shape = {"dim": hf["hidden_size"], "n_heads": hf["num_attention_heads"], "n_kv_heads": hf["num_key_value_heads"],
             "head_dim": hf["head_dim"], "attn_backend": "flex",
             "rope": CosSinRoPE.Config(dim=hf["head_dim"], max_seq_len=hf["max_position_embeddings"], theta=1e6)}
    n = hf["num_hidden_layers"]
    dense = qwen3._build_qwen3_layers(n_layers=n, hidden_dim=hf["intermediate_size"], **shape)
    if "num_experts" not in hf:
        layers = dense
    else:
        layers = qwen3._build_qwen3_moe_layers(n_layers=n, moe_hidden_dim=hf["moe_intermediate_size"],
                                               num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                                               moe_comm_backend="standard", **shape)
        layers = [dense[i] if i in hf.get("mlp_only_layers", ()) else layer for i, layer in enumerate(layers)]
    return _model(qwen3.Qwen3Model, hf, layers, enable_weight_tying=hf.get("tie_word_embeddings", False))


def deepseek_v3_config(hf: dict):
    layers = deepseek_v3._build_dsv3_layers(
        n_layers=hf["num_hidden_layers"], n_dense_layers=hf["first_k_dense_replace"], dim=hf["hidden_size"],
        n_heads=hf["num_attention_heads"], q_lora_rank=hf["q_lora_rank"] or 0, kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], mscale=1.0, dense_hidden_dim=hf["intermediate_size"],
        moe_hidden_dim=hf["moe_intermediate_size"], num_experts=hf["n_routed_experts"],
        num_shared_experts=hf["n_shared_experts"], router_top_k=hf["num_experts_per_tok"],
        router_score_func="sigmoid", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=hf["qk_rope_head_dim"], max_seq_len=hf["max_position_embeddings"], theta=1e4))
    mtp = deepseek_v3._build_mtp_layers(layers[-1], dim=hf["hidden_size"],
                                        num_mtp_layers=hf.get("num_nextn_predict_layers", 0))
    return _model(deepseek_v3.DeepSeekV3Model, hf, layers, mtp_layers=mtp)


# -- the cases -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TitanCase:
    """A transformers checkpoint, the torchtitan model of its sizes, its adapter and rule file."""

    hf: Case
    titan_config: Callable
    adapter: type
    mtp: bool = False  # add a multi-token-prediction layer after the last decoder layer
    unread: tuple[str, ...] = field(default=())  # checkpoint keys torchtitan's to_hf never asks for

    @property
    def name(self) -> str:
        return self.hf.name

    @property
    def hf_config(self) -> dict:
        return dict(self.hf.config, num_nextn_predict_layers=1) if self.mtp else dict(self.hf.config)


def _case(name, model_type, config, rules, titan_config, adapter, **kw) -> TitanCase:
    hf_kw = {k: kw.pop(k) for k in ("dtype", "fp32_keys", "max_shard_size") if k in kw}
    return TitanCase(Case(name, model_type, config, f"rules/{rules}.remap", **hf_kw), titan_config, adapter, **kw)


_MTP_COPIES = ("model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight")
CASES = {c.name: c for c in [
    _case("llama3", "llama", _LLAMA, "torchtitan_llama3", llama3_config, Llama3StateDictAdapter),
    _case("llama3_tied", "llama", dict(_LLAMA, tie_word_embeddings=True), "torchtitan_llama3", llama3_config,
          Llama3StateDictAdapter),
    _case("qwen3", "qwen3", _QWEN3, "torchtitan_qwen3", qwen3_config, Qwen3StateDictAdapter),
    _case("qwen3_tied", "qwen3", dict(_QWEN3, tie_word_embeddings=True), "torchtitan_qwen3", qwen3_config,
          Qwen3StateDictAdapter),
    _case("qwen3_moe", "qwen3_moe", _QWEN3_MOE, "torchtitan_qwen3", qwen3_config, Qwen3StateDictAdapter),
    _case("qwen3_moe_dense0", "qwen3_moe", dict(_QWEN3_MOE, mlp_only_layers=[0]), "torchtitan_qwen3",
          qwen3_config, Qwen3StateDictAdapter),
    # experts.10 after experts.9, one layer's experts spread over several files
    _case("qwen3_moe_12e_sharded", "qwen3_moe", dict(_QWEN3_MOE, num_experts=12), "torchtitan_qwen3",
          qwen3_config, Qwen3StateDictAdapter, max_shard_size="40KB"),
    _case("deepseek_v3", "deepseek_v3", _DSV3, "torchtitan_deepseek_v3", deepseek_v3_config,
          DeepSeekV3StateDictAdapter),
    _case("deepseek_v3_no_q_lora", "deepseek_v3", dict(_DSV3, q_lora_rank=None), "torchtitan_deepseek_v3",
          deepseek_v3_config, DeepSeekV3StateDictAdapter),
    _case("deepseek_v3_bf16", "deepseek_v3", _DSV3, "torchtitan_deepseek_v3", deepseek_v3_config,
          DeepSeekV3StateDictAdapter, dtype=torch.bfloat16, fp32_keys=("e_score_correction_bias",)),
    # its MTP layer's own embedding and output head: torchtitan shares the model's, reads neither
    _case("deepseek_v3_mtp", "deepseek_v3", _DSV3, "torchtitan_deepseek_v3", deepseek_v3_config,
          DeepSeekV3StateDictAdapter, mtp=True, unread=_MTP_COPIES),
]}


def _add_mtp_layer(tensors: dict, config: dict) -> dict:
    """A DeepSeek-V3 release's multi-token-prediction layer after the last decoder layer: a copy of
    the last layer's tensors (fresh values) plus its norms, projection, embedding and head."""
    n, dim, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    dtype = tensors["model.norm.weight"].dtype
    last = f"model.layers.{n - 1}."
    extra = {f"model.layers.{n}." + k[len(last):]: v.shape for k, v in tensors.items() if k.startswith(last)}
    extra.update({f"model.layers.{n}.{k}": s for k, s in [
        ("enorm.weight", (dim,)), ("hnorm.weight", (dim,)), ("eh_proj.weight", (dim, 2 * dim)),
        ("shared_head.norm.weight", (dim,)), ("embed_tokens.weight", (vocab, dim)),
        ("shared_head.head.weight", (vocab, dim))]})
    out = dict(tensors)
    for key, shape in extra.items():
        like = tensors.get(last + key.split(".", 3)[3])
        out[key] = torch.randn(shape, generator=gen).to(dtype if like is None else like.dtype)
    return out


@dataclass(frozen=True)
class Built:
    case: TitanCase
    folder: Path
    hf_tensors: dict  # every tensor of the checkpoint, by key


class Checkpoints:
    """Builds each case's checkpoint at most once, under a session tmp folder."""

    def __init__(self, root: Path):
        self.root, self._built = root, {}

    def __call__(self, name: str) -> Built:
        if name not in self._built:
            case = CASES[name]
            folder = build(case.hf, self.root / name).folder
            if case.mtp:
                source, folder = folder, self.root / f"{name}_with_mtp"
                copy_checkpoint(source, folder, lambda t: _add_mtp_layer(t, case.hf.config))
                config = json.loads((folder / "config.json").read_text())
                (folder / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1), indent=2))
            tensors = {}
            for path in safetensors_files(folder):
                tensors.update(load_file(path))
            self._built[name] = Built(case, folder, tensors)
        return self._built[name]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("torchtitan"))


def torchtitan_load(built: Built) -> tuple[dict, dict]:
    """What torchtitan's checkpointer loads with its own adapter: `to_hf` of the model's state dict
    (built on the meta device) names the tensors read; `from_hf` of them is the result. Also the
    model's state dict itself (meta tensors), which the result must fit."""
    config = built.case.titan_config(built.case.hf_config)
    with torch.device("meta"):
        model_state = config.build().state_dict()
    adapter = built.case.adapter(config, str(built.folder))
    asked = adapter.to_hf(model_state)
    assert set(built.hf_tensors) - set(asked) == set(built.case.unread)
    return adapter.from_hf({k: built.hf_tensors[k] for k in asked}), model_state


# -- the rule files against torchtitan's adapters ------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_rules_equal_torchtitans_adapter(checkpoints, name):
    built = checkpoints(name)
    expected, model_state = torchtitan_load(built)
    for key, value in expected.items():  # the oracle fits the model it is for (load_state_dict casts)
        assert model_state[key].shape == value.shape, key

    compiled = remapdsl.compile_rules(REPO / built.case.hf.rules, built.folder)
    assert [d.runtime_key for d in compiled.runtime_tensors] == sorted(expected)
    got = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
    remapdsl.load(got, built.folder, REPO / built.case.hf.rules)
    wrong = [k for k, v in expected.items() if got[k].dtype != v.dtype or not torch.equal(got[k], v)]
    assert wrong == []


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.unread])
def test_save_writes_the_original_files(checkpoints, tmp_path, name):
    built = checkpoints(name)
    expected, _ = torchtitan_load(built)
    remapdsl.save(expected, tmp_path / "out", REPO / built.case.hf.rules, like=built.folder)
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == sorted(p.name for p in built.folder.iterdir())
    assert [n for n in written if not filecmp.cmp(tmp_path / "out" / n, built.folder / n, shallow=False)] == []


def test_the_mtp_layers_copies_of_embedding_and_head_cannot_be_saved_back(checkpoints, tmp_path):
    """torchtitan holds no copy of them (its MTP layer shares the model's): the rule file drops them,
    so a save `like` the release has nothing to write them from, and says so instead of writing a
    checkpoint without them."""
    built = checkpoints("deepseek_v3_mtp")
    expected, _ = torchtitan_load(built)
    with pytest.raises(RemapError) as info:
        remapdsl.save(expected, tmp_path / "out", REPO / built.case.hf.rules, like=built.folder)
    assert any(k in str(info.value) for k in _MTP_COPIES)
