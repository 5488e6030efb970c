"""`prefix @name = SOURCE -> TARGET`: a block of rules written once, repeated per definition.

The case the statement exists for: DeepSeek-V3's multi-token-prediction layer is a decoder layer
stored as `model.layers.{N}` (one past the last decoder layer) that a trainer keeps as
`mtp_layers.0.block`; the decoder's rules apply to both, and a checkpoint without the layer
simply has no bindings for the second definition.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import tiny_checkpoint

import remapdsl
from remapdsl import RuleCheckError
from remapdsl.language import rules_from_text
from remapdsl.language.prefixes import MAX_DEFINITIONS

RULES = """remap 1
let N = config.num_hidden_layers
prefix @layer = model.layers.{L} -> layers.{L} when L < N
prefix @layer = model.layers.{L} -> mtp_layers.{L - N}.block when L >= N

model.embed_tokens.weight -> tok.weight
@layer.self_attn.{q,k,v}_proj.weight -> @layer.attention.wqkv.weight | concat(dim=0)
@layer.mlp.experts.{E}.down_proj.weight -> @layer.moe.w2 | stack(E, dim=0)
drop @layer.self_attn.rotary_emb.inv_freq
optional model.layers.{L}.enorm.weight -> mtp_layers.{L - N}.enorm.weight when L >= N
"""


def _checkpoint(folder, layers: int, mtp: bool, buffers: bool = False) -> dict[str, torch.Tensor]:
    tensors = {"model.embed_tokens.weight": torch.randn(16, 8)}
    for layer in range(layers + mtp):
        for name in "qkv":
            tensors[f"model.layers.{layer}.self_attn.{name}_proj.weight"] = torch.randn(8 if name == "q" else 4, 8)
        for e in range(3):
            tensors[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] = torch.randn(8, 6)
        if buffers:  # dropped: a save cannot write them back
            tensors[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.randn(4)
    if mtp:
        tensors[f"model.layers.{layers}.enorm.weight"] = torch.randn(8)
    tiny_checkpoint(folder, tensors, {"num_hidden_layers": layers})
    return tensors


def _load(folder):
    rules = rules_from_text(RULES, "t.remap")
    target = remapdsl.compile_rules(rules, str(folder)).empty_state_dict()
    remapdsl.load(target, str(folder), rules)
    return rules, target


def test_the_mtp_layer_takes_the_decoder_rules_under_its_own_prefix(tmp_path):
    source = _checkpoint(tmp_path / "ckpt", layers=2, mtp=True)
    rules, target = _load(tmp_path / "ckpt")
    assert sorted(target) == sorted(
        ["tok.weight", "mtp_layers.0.enorm.weight"]
        + [f"{p}.{t}" for p in ("layers.0", "layers.1", "mtp_layers.0.block") for t in ("attention.wqkv.weight", "moe.w2")])
    for prefix, layer in (("layers.1", 1), ("mtp_layers.0.block", 2)):
        qkv = [source[f"model.layers.{layer}.self_attn.{n}_proj.weight"] for n in "qkv"]
        assert torch.equal(target[f"{prefix}.attention.wqkv.weight"], torch.cat(qkv))
        experts = [source[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] for e in range(3)]
        assert torch.equal(target[f"{prefix}.moe.w2"], torch.stack(experts))
    remapdsl.save(target, tmp_path / "out", rules, like=str(tmp_path / "ckpt"))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "ckpt" / "model.safetensors").read_bytes()


def test_a_checkpoint_without_the_mtp_layer_binds_only_the_decoder(tmp_path):
    _checkpoint(tmp_path / "ckpt", layers=2, mtp=False, buffers=True)
    _, target = _load(tmp_path / "ckpt")
    assert not [k for k in target if k.startswith("mtp_layers")] and "layers.1.moe.w2" in target


def test_a_drop_under_a_prefix_drops_under_every_definition(tmp_path):
    _checkpoint(tmp_path / "ckpt", layers=2, mtp=True, buffers=True)
    compiled = remapdsl.compile_rules(rules_from_text(RULES, "t.remap"), str(tmp_path / "ckpt"))
    assert compiled.dropped == tuple(f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(3))


def test_a_prefix_maps_a_nested_model_and_its_dequantize_and_keep(tmp_path):
    """A language model nested under `language_model.` loads with the plain model's rules written
    under a prefix; `dequantize` builds its logical key under the checkpoint-side prefix."""
    values = torch.randn(4, 4).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.5)
    folder = tiny_checkpoint(tmp_path / "ckpt", {"language_model.model.w": values, "language_model.model.w_scale": scale,
                                                 "language_model.model.norm": torch.randn(4)})
    text = ("prefix @lm = language_model.model -> model\n"
            "dequantize @lm.w, @lm.w_scale -> @lm.w | fp8_tensor(to=float32)\n"
            "@lm.w -> @lm.proj.weight\n"
            "@lm.norm -> @lm.norm.weight\n"
            "keep @lm.cache\n")
    rules = rules_from_text(text, "t.remap")
    compiled = remapdsl.compile_rules(rules, str(folder), {})
    assert sorted(d.runtime_key for d in compiled.runtime_tensors) == ["model.norm.weight", "model.proj.weight"]
    assert compiled.keep == (r"model\.cache",)  # the keep matches the runtime-side key
    target = compiled.empty_state_dict()
    remapdsl.load(target, str(folder), rules, config={})
    assert torch.equal(target["model.proj.weight"], values.float() * 0.5)


@pytest.mark.parametrize("text, code, words", [
    ("@layr.x -> y\nprefix @layer = a -> b\n", "E150", "did you mean `@layer`"),
    ("prefix @a = x -> y\nprefix @b = x -> z\n@a.q -> @b.q\n", "E151", "`@a` and `@b`"),
    ("prefix @a = x.{L} -> y.{L + 1}\nkeep @a.z\n", "E151", "by arithmetic"),
    ("prefix @a = x.{q,k} -> y\n", "E151", "alternatives"),
    ("prefix @a = x.{L} -> y.{L}\n@a.w, z.{L:seg} -> v.{L}\n", "E151", "capture `L` has two types in one statement"),
    ("prefix @a = x.{L:seg} -> y.{L}\ndrop @a.w, z.{L}\n", "E151", "with `@a` read as `x.{L:seg}` -> `y.{L}`"),
    ("prefix @when = x -> y\n", "E017", "`@when` is not a valid prefix name: `when` is a keyword"),
    ("prefix @a = x -> y\n@config.q -> w\n", "E017", "`@config` is not a valid prefix name"),
    ("prefix @a = x -> y\nz.@a.q -> w\n", "E016", "stands first"),
    ("".join(f"prefix @a = x{i} -> y{i}\n" for i in range(MAX_DEFINITIONS + 1)) + "@a.q -> @a.w\n", "E152",
     f"more than {MAX_DEFINITIONS}"),
])
def test_prefix_errors_name_the_statement(text, code, words):
    with pytest.raises(remapdsl.RemapError) as info:
        rules_from_text("remap 1\n" + text, "t.remap")
    codes = [d.code for d in info.value.diagnostics]
    assert codes[0] == code and words in str(info.value), str(info.value)


@pytest.mark.parametrize("text, column", [("@p{a,b}.x -> y\n", 1), ("z.@p.q -> w\n", 3)])
def test_a_misplaced_prefix_is_one_e016(text, column):
    """A prefix glued to more key text, or not first, is told once, where it stands: not a second
    time as a misplaced `**` (a prefix stands for whole segments, as `**` does)."""
    with pytest.raises(remapdsl.RemapError) as info:
        rules_from_text("remap 1\nprefix @p = x -> y\n" + text, "t.remap")
    assert [(d.code, d.message, d.span.line, d.span.column) for d in info.value.diagnostics] == [
        ("E016", "`@p` stands first in a pattern, then `.` and the rest of the key", 3, column)]


def test_an_error_in_a_repeated_rule_is_reported_once():
    with pytest.raises(RuleCheckError) as info:
        rules_from_text("remap 1\nprefix @a = x.{L} -> y.{L}\nprefix @a = z.{L} -> w.{L}\n@a.q -> @a.r | cast(bfloat17)\n")
    assert [d.code for d in info.value.diagnostics] == ["E121"]


def test_a_hint_quotes_the_whole_guard_a_prefix_joins(tmp_path):
    """The definition's guard and the statement's, joined with `and`, are quoted together in E201's
    note (in canonical form: the join is written nowhere), not as the statement's part alone."""
    tiny_checkpoint(tmp_path, {"a.0.w": torch.zeros(2)}, {"on": True, "two": 2})
    text = ("remap 1\nprefix @x = a.{L} -> b.{L} when config.on or L > 3\n@x.w -> @x.v\n"
            "@x.u -> @x.y when config.two > 1\n")
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.compile_rules(rules_from_text(text, "t.remap"), tmp_path)
    (d,) = info.value.diagnostics
    assert (d.code, d.span.line, d.span.column) == ("E201", 4, 1)
    assert d.hint == ("no checkpoint key has a segment `u`; no key matched to decide its guard "
                      "`(config.on or L > 3) and config.two > 1`, so the rule is on; mark it `optional` "
                      "if this key may be absent")

