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
import os
import json
import multiprocessing
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# A gloo rank this file's two-rank test spawns imports it only for its worker, which needs neither
# transformers nor torchtitan's models (seconds of imports per rank on a shared CPU).
IN_A_RANK = multiprocessing.parent_process() is not None
if not IN_A_RANK:
    pytest.importorskip("transformers")
    try:
        from torchtitan.models import deepseek_v3, llama3, qwen3
        from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    except ImportError as exc:  # torchtitan absent, or without triton (torchtitan.models.common needs it)
        pytest.skip(f"torchtitan 0.3.0's state-dict adapters cannot be imported ({exc}); install them with "
                    "`pip install torchtitan==0.3.0 --no-deps tyro spmd_types triton==3.9.0`",
                    allow_module_level=True)

import torch
from hf_models import _DSV3, _QWEN3_MOE, Case, build, copy_checkpoint, safetensors_files
from safetensors.torch import load_file

import remapdsl
from remapdsl import RemapError
from remapdsl.testing.ranks import run_ranks
from remapdsl.torchtitan import RuleStateDictAdapter

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
CASES = {} if IN_A_RANK else {c.name: c for c in [
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
    _case("deepseek_v3_all_moe", "deepseek_v3", dict(_DSV3, first_k_dense_replace=0), "torchtitan_deepseek_v3",
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
    # the adapter's save_hf, as torchtitan's trainer calls it: a key the rules do not make is left out
    adapter = RuleStateDictAdapter.with_rules(REPO / built.case.hf.rules)(
        built.case.titan_config(built.case.hf_config), str(built.folder))
    adapter.save_hf({**expected, "freqs_cis": torch.zeros(2)}, tmp_path / "adapter")
    for out in ("out", "adapter"):
        written = sorted(p.name for p in (tmp_path / out).iterdir())
        assert written == sorted(p.name for p in built.folder.iterdir())
        assert [n for n in written if not filecmp.cmp(tmp_path / out / n, built.folder / n, shallow=False)] == []


def test_the_mtp_layers_copies_of_embedding_and_head_cannot_be_saved_back(checkpoints, tmp_path):
    """torchtitan holds no copy of them (its MTP layer shares the model's): the rule file drops them,
    so a save `like` the release has nothing to write them from, and says so instead of writing a
    checkpoint without them."""
    built = checkpoints("deepseek_v3_mtp")
    expected, _ = torchtitan_load(built)
    with pytest.raises(RemapError) as info:
        remapdsl.save(expected, tmp_path / "out", REPO / built.case.hf.rules, like=built.folder)
    assert any(k in str(info.value) for k in _MTP_COPIES)


# -- RuleStateDictAdapter -------------------------------------------------------------------------------


def _checkpointer(adapter, model):
    """What torchtitan's CheckpointManager.dcp_load / dcp_save read of themselves: the adapter and
    the model's wrapper (its real ModelWrapper); their code runs as it is."""
    from torchtitan.components.checkpointer.base import MODEL, ModelWrapper

    return types.SimpleNamespace(sd_adapter=adapter, states={MODEL: ModelWrapper(model)})


@pytest.mark.parametrize("name", ["llama3", "qwen3_moe", "deepseek_v3"])
def test_torchtitans_checkpointer_loads_a_model_through_the_adapter(checkpoints, name):
    """CheckpointManager.dcp_load(from_hf=True) with the adapter in place of torchtitan's own: a real
    torchtitan model (fused wqkv, grouped experts) ends up holding what torchtitan's adapter loads."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    built = checkpoints(name)
    expected, _ = torchtitan_load(built)
    config = built.case.titan_config(built.case.hf_config)
    model = config.build()
    adapter = RuleStateDictAdapter.with_rules(REPO / built.case.hf.rules)(config, str(built.folder))
    holder = _checkpointer(adapter, model)
    CheckpointManager.dcp_load(holder, holder.states["model"].state_dict(), checkpoint_id=str(built.folder),
                               from_hf=True, from_quantized=False)
    state = model.state_dict()
    assert sorted(adapter.match.loaded) == sorted(expected)
    assert [k for k, v in expected.items() if not torch.equal(state[k], v.to(state[k].dtype))] == []
    assert set(adapter.match.not_in_rules) == set(state) - set(expected)  # buffers such as moe.expert_bias_E


def test_torchtitans_own_hf_save_is_refused_before_writing(checkpoints, tmp_path):
    from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager

    built = checkpoints("llama3")
    config = built.case.titan_config(built.case.hf_config)
    adapter = RuleStateDictAdapter.with_rules(REPO / built.case.hf.rules)(config, str(built.folder))
    holder = _checkpointer(adapter, config.build())
    with pytest.raises(RemapError) as info:
        CheckpointManager.dcp_save(holder, holder.states["model"].state_dict(), str(tmp_path / "out"),
                                   AsyncMode.DISABLED, to_hf=True)
    assert info.value.diagnostic.code == "E612" and "save_hf" in info.value.diagnostic.hint
    assert not (tmp_path / "out").exists()


def test_the_model_spec_example_runs_as_printed():
    """docs/torchtitan.md's model spec, run as printed: a class torchtitan can construct."""
    import re

    from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

    text = (REPO / "docs" / "torchtitan.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "with_rules" in b)
    scope: dict = {}
    exec(compile(code, "docs/torchtitan.md", "exec"), scope)  # noqa: S102 - the doc, run as printed
    cls = scope["spec"].state_dict_adapter
    assert issubclass(cls, BaseStateDictAdapter) and cls.default_rules == "torchtitan_qwen3"
    adapter = cls(scope["spec"].model, None)
    assert adapter.rules == "torchtitan_qwen3" and adapter.strict


def test_adapter_errors_name_what_is_missing(checkpoints):
    built = checkpoints("llama3")
    config = built.case.titan_config(built.case.hf_config)
    with pytest.raises(RemapError) as info:
        RuleStateDictAdapter(config, str(built.folder))
    d = info.value.diagnostic
    assert (d.code, d.message, d.hint) == ("E610", "RuleStateDictAdapter was made without a rule file",
                                           'pass rules="model.remap", or name RuleStateDictAdapter.with_rules('
                                           '"model.remap") in the model spec')
    with pytest.raises(RemapError) as info:
        RuleStateDictAdapter.with_rules("torchtitan_llama3")(config, None).to_hf({})
    d = info.value.diagnostic
    assert (d.code, d.message, d.hint) == (
        "E611", "RuleStateDictAdapter has no checkpoint folder to compile its rules against (hf_assets_path is None)",
        "set hf_assets_path in the trainer config to the Hugging Face checkpoint folder")
    with torch.device("meta"):
        state = config.build().state_dict()
    with pytest.raises(RemapError) as info:  # the transformers layout's rules for a torchtitan model
        RuleStateDictAdapter.with_rules("llama")(config, str(built.folder)).to_hf(state)
    made = {t.runtime_key for t in remapdsl.compile_rules("llama", str(built.folder)).runtime_tensors}
    unknown = [k for k in state if k not in made]  # more than five: the first five, then a count
    d = info.value.diagnostic
    assert len(unknown) > 5 and (d.code, d.message, d.hint, str(d.path)) == (
        "E613", f"{len(unknown)} of the state dict's {len(state)} tensors are made by no rule and named by no "
        f"`keep`: {', '.join(f'`{k}`' for k in unknown[:5])} and {len(unknown) - 5} more",
        "is this the rule file for this model? Tensors that take nothing from the checkpoint (buffers) belong "
        "in a `keep` statement; or pass strict=False", str(built.folder))
    with torch.device("meta"):  # a model of other sizes than the checkpoint's config.json
        wider = llama3_config(dict(built.case.hf_config, intermediate_size=48)).build().state_dict()
    with pytest.raises(RemapError) as info:
        RuleStateDictAdapter.with_rules("torchtitan_llama3")(config, str(built.folder)).to_hf(wider)
    wrong = [f"`{k}` is {tuple(t.shape)} in the model, {tuple(state[k].shape)} from the rules"
             for k, t in wider.items() if t.shape != state[k].shape]  # more than five: the first five
    d = info.value.diagnostic
    assert len(wrong) > 5 and (d.code, d.message, d.hint, str(d.path)) == (
        "E614", f"{len(wrong)} tensors differ in shape between the model and the rules: " + "; ".join(wrong[:5]),
        "the model config and the checkpoint's config.json describe different sizes", str(built.folder))


@pytest.mark.parametrize("strays", [1, 5, 6])
def test_e613_lists_up_to_five_tensors_no_rule_makes_then_counts_the_rest(checkpoints, strays):
    """The tensors no rule makes, in the state dict's order: all of them up to five, else five and a count."""
    built = checkpoints("llama3")
    config = built.case.titan_config(built.case.hf_config)
    with torch.device("meta"):
        state = config.build().state_dict()
        extra = {f"layers.0.stray{i}": torch.empty(2) for i in range(strays)}
    with pytest.raises(RemapError) as info:
        RuleStateDictAdapter.with_rules("torchtitan_llama3")(config, str(built.folder)).to_hf({**state, **extra})
    shown = ", ".join(f"`{k}`" for k in list(extra)[:5]) + (f" and {strays - 5} more" if strays > 5 else "")
    assert info.value.diagnostic.message == (f"{strays} of the state dict's {len(state) + strays} tensors are made "
                                             f"by no rule and named by no `keep`: {shown}")


@pytest.mark.parametrize("bound", [True, False])
def test_the_adapters_config_reaches_its_rules_bound_or_given(checkpoints, bound, tmp_path):
    """`config=` (bound by `with_rules`, or given to the adapter) is the config the rules compile with, in
    place of config.json, on the way to the checkpoint and back: one without the head count the rules read
    is E211 naming it, in `to_hf` and in `save_hf`. The bound class is named for its rule file, in this
    module, as torchtitan's logs print it."""
    built = checkpoints("llama3")
    config = built.case.titan_config(built.case.hf_config)
    with torch.device("meta"):
        state = config.build().state_dict()
    headless = {k: v for k, v in built.case.hf_config.items() if k != "num_attention_heads"}
    cls = RuleStateDictAdapter.with_rules("torchtitan_llama3", config=headless if bound else None)
    assert (cls.__name__, cls.__module__) == ("RuleStateDictAdapter[torchtitan_llama3]", "remapdsl.torchtitan")
    adapter = cls(config, str(built.folder)) if bound else cls(config, str(built.folder), config=headless)
    for call in (lambda: adapter.to_hf(state), lambda: adapter.save_hf(state, tmp_path / "saved")):
        with pytest.raises(RemapError) as info:
            call()
        assert info.value.diagnostics[0].code == "E211" and "config.num_attention_heads" in str(info.value)
    assert not (tmp_path / "saved").exists()


def test_the_adapters_config_is_the_one_it_saves_with(checkpoints, tmp_path):
    """An adapter given a config other than config.json (twice the heads: another valid rotary order of
    q_proj's rows) saves with it too: a state loaded with that config is written back as the original files."""
    built = checkpoints("llama3")
    rules = REPO / built.case.hf.rules
    heads = dict(built.case.hf_config, num_attention_heads=2 * built.case.hf_config["num_attention_heads"])
    state = remapdsl.compile_rules(remapdsl.load_rules(rules), built.folder, heads).empty_state_dict()
    remapdsl.load(state, built.folder, rules, config=heads)
    adapter = RuleStateDictAdapter.with_rules(rules)(built.case.titan_config(built.case.hf_config), str(built.folder),
                                                     config=heads)
    adapter.save_hf(state, tmp_path / "out")
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert [n for n in written if not filecmp.cmp(tmp_path / "out" / n, built.folder / n, shallow=False)] == []


def test_the_adapter_keeps_what_it_is_given_and_logs_how_the_state_dict_met_the_rules(checkpoints, caplog):
    """Rules given to the adapter win over the class's bound ones; it keeps torchtitan's model config as
    given, has no match before its first `to_hf`, and logs the counts of that match: tensors the rules make,
    state-dict keys they do not make (strict=False), tensors they make that this state dict lacks (a
    pipeline stage's). A class bound to a RuleSet is named for its file."""
    built = checkpoints("llama3")
    config = built.case.titan_config(built.case.hf_config)
    ruleset = remapdsl.load_rules(REPO / "rules" / "torchtitan_llama3.remap")
    cls = RuleStateDictAdapter.with_rules(ruleset)
    assert cls.__name__ == f"RuleStateDictAdapter[{ruleset.path}]"
    adapter = RuleStateDictAdapter.with_rules("llama")(config, built.folder, rules=ruleset, strict=False)
    assert adapter.model_config is config and adapter.match is None and adapter.rules is ruleset
    assert adapter.get_hf_storage_reader(built.folder) is adapter.get_hf_storage_reader(built.folder)  # opened once
    with torch.device("meta"):
        state = config.build().state_dict()
    dropped = [k for k in state if k.startswith("layers.1.")]
    state = {k: v for k, v in state.items() if k not in dropped} | {"extra.buffer": torch.empty(2)}
    with caplog.at_level("INFO", logger="remapdsl"):
        asked = adapter.to_hf(state)
    assert sorted(asked) == sorted(k for k in state if k != "extra.buffer")
    assert adapter.match.not_in_rules == ("extra.buffer",) and sorted(adapter.match.not_in_state_dict) == sorted(dropped)
    assert f"torchtitan adapter: {len(asked)} tensors from the rules, 1 state-dict keys not made by them, " \
           f"{len(dropped)} made but not in this state dict" in [r.getMessage() for r in caplog.records]


def _placements(runtime_key: str, shape) -> list:
    """A mix of what torchtitan's parallelisms make: whole experts per rank (EP), rows or columns of
    the projections (TP), norms replicated."""
    from torch.distributed.tensor import Replicate, Shard

    if len(shape) == 3:
        return [Shard(0)]
    if len(shape) == 2:
        return [Shard(1) if runtime_key.endswith(("wo.weight", "w2.weight")) else Shard(0)]
    return [Replicate()]


def _load_and_save_sharded(rank: int, world: int, folder: str, hf_config: dict, out: str) -> dict:
    """On each gloo rank: DTensors shaped as the model's, loaded the way torchtitan's checkpointer
    does through the adapter, compared with torchtitan's own result, then saved back with save_hf."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    expected = torch.load(Path(out) / "expected.pt")
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(torch.zeros_like(v), mesh, _placements(k, v.shape)) for k, v in expected.items()}
    state["layers.0.moe.expert_bias_E"] = torch.zeros(hf_config["num_experts"])  # a buffer no rule makes
    # no model config: the adapter reads none (the rules read config.json), and building one would
    # import torchtitan's models on this rank
    adapter = RuleStateDictAdapter.with_rules("torchtitan_qwen3")(None, folder)
    hf_state = adapter.to_hf(state)
    reader = adapter.get_hf_storage_reader(folder)
    dcp.load(hf_state, storage_reader=reader)
    loaded = adapter.from_hf(hf_state)
    wrong = [k for k, v in loaded.items()
             if not torch.equal(v.to_local(), distribute_tensor(expected[k], mesh, v.placements).to_local())]
    adapter.save_hf(loaded, Path(out) / "saved")
    result = {"wrong": wrong, "keys": sorted(loaded), "not_in_rules": adapter.match.not_in_rules,
              "read": reader.report.bytes_read, "owned": reader.report.bytes_owned}
    if rank == 1:  # a tensor only this rank's model has: every rank fails, naming rank 1
        state["layers.0.moe.stray"] = torch.zeros(1)
    try:
        adapter.to_hf(state)
    except RemapError as exc:
        result["stray"] = (exc.diagnostic.code, exc.diagnostic.message, exc.failed_ranks)
    return result


@pytest.mark.distributed
def test_adapter_loads_dtensors_through_dcp_and_saves_them_back_on_two_ranks(checkpoints, tmp_path):
    built = checkpoints("qwen3_moe_12e_sharded")
    expected, _ = torchtitan_load(built)
    torch.save(expected, tmp_path / "expected.pt")
    results = run_ranks(_load_and_save_sharded, 2, str(built.folder), built.case.hf_config, str(tmp_path))
    for result in results:
        assert result["wrong"] == [] and result["keys"] == sorted(expected)
        assert result["not_in_rules"] == ("layers.0.moe.expert_bias_E",)
        assert result["read"] == result["owned"]  # each rank read only the bytes of its own shards
        code, message, failed = result["stray"]
        assert code == "E613" and "`layers.0.moe.stray`" in message and "rank 1" in message and failed == (1,)
    assert results[0]["owned"] < sum(t.numel() * t.element_size() for t in expected.values())
    saved = tmp_path / "saved"
    assert sorted(p.name for p in saved.iterdir()) == sorted(p.name for p in built.folder.iterdir())
    assert [p.name for p in saved.iterdir() if not filecmp.cmp(p, built.folder / p.name, shallow=False)] == []


# -- the adapter's non-default arguments ------------------------------------------------------------


def _dcp_load(state_dict: dict, reader) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state_dict, storage_reader=reader)


@pytest.mark.parametrize("given", ["argument", "with_rules"])
@pytest.mark.parametrize("extra", ["checkpoint", "state dict", "both"])
def test_a_non_strict_adapter_passes_over_tensors_no_rule_takes(checkpoints, tmp_path, given, extra):
    """strict=False, given to the adapter or bound by `with_rules`: a checkpoint tensor no rule reads and
    a state-dict tensor no rule makes (neither named by a `keep`) are passed over, and the rest loads
    as torchtitan's own adapter loads it; the strict adapter refuses each (E202 from the reader's
    compile, E613 from `to_hf`) before anything is read."""
    built = checkpoints("llama3")
    expected, model_state = torchtitan_load(built)
    folder = built.folder
    if extra in ("checkpoint", "both"):
        folder = copy_checkpoint(built.folder, tmp_path / "extra", lambda t: t | {"model.extra.weight": torch.ones(3)})
    state = {k: torch.full(v.shape, float("nan"), dtype=v.dtype) for k, v in model_state.items()}
    if extra in ("state dict", "both"):
        state["extra.buffer"] = torch.zeros(2)
    config = built.case.titan_config(built.case.hf_config)
    rules = REPO / built.case.hf.rules

    def adapter(strict: bool):
        if given == "argument":
            return RuleStateDictAdapter.with_rules(rules)(config, str(folder), strict=strict)
        return RuleStateDictAdapter.with_rules(rules, strict=strict)(config, str(folder))

    with pytest.raises(RemapError) as info:
        adapter(True).to_hf(state)
    assert info.value.diagnostics[0].code == ("E613" if extra == "state dict" else "E202"), str(info.value)
    lenient = adapter(False)
    asked = lenient.to_hf(state)
    assert sorted(asked) == sorted(expected) and sorted(lenient.match.loaded) == sorted(expected)
    assert lenient.match.not_in_rules == (("extra.buffer",) if extra != "checkpoint" else ())
    _dcp_load(asked, lenient.get_hf_storage_reader(folder))
    assert [k for k, v in expected.items() if not torch.equal(lenient.from_hf(asked)[k], v)] == []
    if "extra.buffer" in state:
        assert state["extra.buffer"].eq(0).all()  # not the adapter's: left as it was


def test_the_storage_reader_of_another_folder_reads_that_folder(checkpoints, tmp_path):
    """`get_hf_storage_reader(path)` for a folder other than `hf_assets_path` (another step's
    checkpoint of the same model) serves that folder's values; asked for `hf_assets_path` again, its
    own; each equal to remapdsl.load of that folder."""
    built = checkpoints("llama3")
    other = copy_checkpoint(built.folder, tmp_path / "step2", lambda t: {k: v * 2 + 1 for k, v in t.items()})
    rules = REPO / built.case.hf.rules
    config = built.case.titan_config(built.case.hf_config)
    adapter = RuleStateDictAdapter.with_rules(rules)(config, str(built.folder))
    with torch.device("meta"):
        model_state = config.build().state_dict()
    wanted = {}
    for name, folder in (("own", built.folder), ("other", other)):
        wanted[name] = remapdsl.compile_rules(rules, folder).empty_state_dict()
        remapdsl.load(wanted[name], folder, rules)
    assert any(not torch.equal(wanted["own"][k], wanted["other"][k]) for k in wanted["own"])
    for name, folder in (("other", other), ("own", built.folder), ("other", other)):
        state = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in model_state.items()}
        asked = adapter.to_hf(state)
        reader = adapter.get_hf_storage_reader(folder)
        assert os.path.abspath(reader.checkpoint_id) == os.path.abspath(folder)
        _dcp_load(asked, reader)
        assert [k for k, v in wanted[name].items() if not torch.equal(asked[k], v)] == [], name
