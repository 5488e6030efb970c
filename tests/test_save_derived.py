"""A save without `like`: the checkpoint layout derived from the rules, the config and the runtime
tensors' shapes (remapdsl/compile/derive.py), or E520 naming the rule and the size it lacks.

For every shipped rule file, on the test checkpoint it loads: the derived tensors are the
checkpoint's own (keys, shapes, dtypes); a save without `like` then a load gives the runtime state
dict bit for bit, and transformers' `from_pretrained` reads the files into the original model. The
quantized files write their logical values unquantized (which tensors a release stores quantized is
not a function of the runtime tensors) and load back bit for bit. Real safetensors files, real
transformers checkpoints, 2 gloo ranks with DTensors.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import remapdsl
from remapdsl import RemapError
from remapdsl.checkpoint import Inventory, open_inventory, read_config
from remapdsl.compile import compile_rules
from remapdsl.compile.derive import derive_checkpoint
from remapdsl.language import rules_from_text
from remapdsl.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent

# shipped file -> the test checkpoint it loads (hf_models CASES / FAMILY_CASES; ":fp8" an FP8 release of it)
PLAIN = {
    "llama": "llama_tied", "qwen3_moe": "qwen3_moe_dense0", "mixtral": "mixtral", "qwen2_moe": "qwen2_moe",
    "deepseek_v3": "deepseek_v3_bf16", "gemma2": "gemma3_text", "phi3": "phi3", "phi3_split": "phi3",
    "gpt_neox": "gpt_neox", "gpt_neox_split": "gpt_neox", "llama4_text": "llama4_text_interleaved",
    "vllm_llama": "qwen2", "vllm_qwen3_moe": "qwen3_moe_dense0", "llama_fused": "llama", "identity": "qwen3_moe",
    "torchtitan_llama3": "llama", "torchtitan_qwen3": "qwen3_moe", "torchtitan_deepseek_v3": "deepseek_v3",
}
QUANTIZED = {"deepseek_v3_fp8": "deepseek_v3:fp8", "llama_fp8": "llama:fp8", "qwen3_moe_fp8": "qwen3_moe:fp8",
             "gpt_oss": "gpt_oss"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> checkpoint folder, each made once."""
    pytest.importorskip("transformers")
    from hf_models import CASES, FAMILY_CASES, build, fp8_release, gpt_oss_mxfp4_release

    root = tmp_path_factory.mktemp("derived")
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            if case == "gpt_oss":
                made[case] = gpt_oss_mxfp4_release(root / case)
            elif case.endswith(":fp8"):
                made[case] = fp8_release(get(case[:-4]), root / case.replace(":", "_"), (4, 4))
            else:
                made[case] = build(FAMILY_CASES.get(case) or CASES[case], root / case).folder
        return made[case]
    return get


def _runtime(rules: str, folder: Path) -> tuple[dict, dict, object]:
    """The runtime state dict a load of `folder` gives, its config, and the compile."""
    inventory = open_inventory(folder)
    config = read_config(inventory)
    compiled = compile_rules(remapdsl.load_rules(rules), inventory, config)
    state = {d.runtime_key: torch.full(d.shape, float("nan"), dtype=getattr(torch, d.dtype))
             for d in compiled.runtime_tensors}
    remapdsl.load(state, folder, rules)
    return state, config, compiled


def _shapes(state: dict) -> dict:
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_every_shipped_file_derives_its_checkpoint_and_round_trips(checkpoints, tmp_path, name):
    rules = str(ROOT / "rules" / f"{name}.remap")
    folder = checkpoints(PLAIN[name])
    state, config, compiled = _runtime(rules, folder)
    inventory = open_inventory(folder)
    want = {k: (t.dtype, t.shape) for k, t in inventory.tensors.items() if k not in compiled.dropped}
    assert derive_checkpoint(remapdsl.load_rules(rules), _shapes(state), config) == want

    start = time.perf_counter()
    report = remapdsl.save(state, tmp_path / "out", rules, config=dict(reversed(config.items())),  # keys unsorted
                           max_shard_size="20kB")
    assert report.folder == str(tmp_path / "out")
    assert 0 < report.sync_seconds <= report.seconds <= time.perf_counter() - start  # an fsync takes time
    again = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    remapdsl.load(again, tmp_path / "out", rules)
    assert all(torch.equal(again[k], state[k]) and again[k].dtype == state[k].dtype for k in state), name
    # the layout is Hugging Face's: sharded by size with an index, `format: pt`, config.json as given
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 1 and files == sorted(report.files)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want) and sorted(set(index["weight_map"].values())) == files
    with safe_open(str(tmp_path / "out" / files[0]), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # config.json the same bytes from every save of it: keys sorted, indented by 2
    assert (tmp_path / "out" / "config.json").read_text() == json.dumps(config, indent=2, sort_keys=True) + "\n"
    # transformers reads the files into a model equal to the one the checkpoint came from (the split,
    # fused and torchtitan layouts too: they save the Hugging Face layout)
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    derived = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert original.keys() == derived.keys() and all(torch.equal(original[k], derived[k]) for k in original), name


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_files_save_their_logical_values_unquantized(checkpoints, tmp_path, name, caplog):
    """Which tensors a release stores quantized is not a function of the runtime tensors: without
    `like`, each tensor the rules dequantize is written as its logical values (no scales, logged),
    and the same rules load those files back bit for bit (a `dequantize` binds only where the
    packed parts are)."""
    rules = str(ROOT / "rules" / f"{name}.remap")
    state, config, compiled = _runtime(rules, checkpoints(QUANTIZED[name]))
    with caplog.at_level("INFO", logger="remapdsl"):
        remapdsl.save(state, tmp_path / "out", rules, config=config)
    assert "derived unquantized (no stored scales)" in caplog.text and "`dequantize` statement at" in caplog.text
    stored = open_inventory(tmp_path / "out").tensors
    logical = {t.logical_key: t for t in compiled.logical}
    assert logical and all(stored[k].dtype == t.dtype and stored[k].shape == t.shape for k, t in logical.items())
    assert not any(k.endswith(("_scale_inv", "_scales", "_blocks")) for k in stored)
    again = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    remapdsl.load(again, tmp_path / "out", rules)
    assert all(torch.equal(again[k], state[k]) for k in state), name


# -- sizes the rules state, and the ones they do not ------------------------------------------------


def _derive(text: str, checkpoint: dict, config: dict | None = None) -> dict:
    """Compile `text` forward against `checkpoint` (key -> (dtype, shape)), then derive it back
    from the runtime shapes alone."""
    rules = rules_from_text(text)
    compiled = compile_rules(rules, Inventory.from_shapes(checkpoint), config or {})
    return derive_checkpoint(rules, {d.runtime_key: (d.shape, d.dtype) for d in compiled.runtime_tensors}, config)


def _refused(text: str, runtime: dict, config: dict | None = None):
    with pytest.raises(RemapError) as info:
        derive_checkpoint(rules_from_text(text), runtime, config)
    assert info.value.diagnostics[0].code == "E520"
    return info.value.diagnostics[0]


def test_unequal_concat_sizes_from_let_values():
    text = ("remap 1\nlet Q = config.q\nlet KV = config.kv\n"
            "a.{L}.{q,k,v} -> a.{L}.qkv | concat(dim=0, sizes=[Q, KV, KV])\n")
    checkpoint = {f"a.{L}.{p}": ("bfloat16", (n, 6)) for L in range(3) for p, n in (("q", 8), ("k", 2), ("v", 2))}
    assert _derive(text, checkpoint, {"q": 8, "kv": 2}) == checkpoint


def test_stack_ranges_come_from_the_stacked_dim_and_start():
    text = "remap 1\ne.{E}.w -> w | stack(E, dim=1, start=4)\n"
    checkpoint = {f"e.{E}.w": ("float32", (3, 5)) for E in range(4, 11)}
    assert _derive(text, checkpoint) == checkpoint


def test_unstack_split_transpose_permute_repeat_pad_and_chunk_undo():
    text = ("remap 1\nw -> e.{E}.w | unstack(E, dim=0)\nqkv -> {q,k,v} | split(dim=1, sizes=[4, 2, 2])\n"
            "t -> t | transpose(0, 1)\ngu -> {g,u} | chunk(dim=0, n=2)\np -> p | permute([2, 0, -2])\n"
            "r -> r | repeat(dim=-1, times=3)\none -> one | repeat(dim=0, times=1)\n"
            "x -> x | pad(dim=-2, to=8, size=5)\n")
    checkpoint = {"w": ("float32", (5, 3, 2)), "qkv": ("int8", (3, 8)), "t": ("float16", (2, 7)),
                  "gu": ("float32", (6, 4)), "p": ("float32", (2, 3, 5)), "r": ("bfloat16", (2, 4)),
                  "one": ("float32", (3,)), "x": ("float32", (5, 2))}
    assert _derive(text, checkpoint) == checkpoint


def test_a_target_index_shifted_by_a_let_is_solved_back():
    """The MTP layer's `mtp_layers.{L - N}`: the checkpoint layer is solved from the runtime index."""
    text = ("remap 1\nlet N = config.n\nprefix @l = m.layers.{L} -> layers.{L} when L < N\n"
            "prefix @l = m.layers.{L} -> mtp_layers.{L - N} when L >= N\n@l.w -> @l.w\n")
    checkpoint = {f"m.layers.{L}.w": ("float32", (2,)) for L in range(5)}
    assert _derive(text, checkpoint, {"n": 3}) == checkpoint


def test_a_constant_substitution_in_a_target_reads_back_as_its_text():
    assert _derive("remap 1\nlet N = config.n\nx -> y.{N + 1}.w\n", {"x": ("float32", (2,))}, {"n": 3}) == \
        {"x": ("float32", (2,))}


def test_a_target_substitution_of_two_captures_is_refused_whole():
    """`{L * 8 + E}` does not give L and E back: E520 naming both, at the substitution."""
    d = _refused("remap 1\na.{L}.{E}.w -> b.{L * 8 + E}\n", {"b.9": ((2,), "float32")})
    assert (d.message, (d.span.line, d.span.column), d.line_text, d.hint) == (
        "the target's `{...}` at <text>:2:18 reads E, L: its value does not give back the captures", (2, 18),
        "a.{L}.{E}.w -> b.{L * 8 + E}", _LACKS)


def test_a_guard_boundary_picks_the_layer_s_rule():
    text = ("remap 1\nl.{L}.w -> dense.{L}.w when L < 2\nl.{L}.w -> moe.{L}.w when L >= 2\n")
    checkpoint = {f"l.{L}.w": ("float32", (L + 1,)) for L in range(4)}
    assert _derive(text, checkpoint) == checkpoint
    with pytest.raises(RemapError) as info:  # a dense layer at index 2 no rule makes there
        remapdsl.compile.derive.derive_checkpoint(rules_from_text(text), {"dense.2.w": ((3,), "float32")})
    assert info.value.diagnostics[0].code == "E520" and "dense.2.w" in info.value.diagnostics[0].message


_LACKS = "give the rule the size it lacks (docs/saving.md#without-like), or save with `like`"
_GU = {"gu": ((12, 4), "float32")}


@pytest.mark.parametrize("text, runtime, config, expected", [
    ("e.{a,b,c}.w -> w\n    | stack(dim=0)\n", {"w": ((4, 2), "float32")}, {},
     ("E520", "runtime tensor `w`: `stack` stacks 3 sources, but the model's dim 0 has 4", (3, 7),
      "    | stack(dim=0)", _LACKS)),
    ("a.{g,u} -> gu\n    | concat(dim=0)\n", _GU, {},
     ("E520", ("runtime tensor `gu`: `concat` joins 2 sources into dim 0 of size 12, and how it divides among them "
              "is not given: add `sizes=[...]`"), (3, 7), "    | concat(dim=0)", _LACKS)),
    ("e.{E}.w -> w\n    | concat(E, dim=0)\n", {"w": ((12, 4), "float32")}, {},
     ("E520", ("runtime tensor `w`: `concat` joins the E sources into dim 0 of size 12, and how it divides among "
              "them is not given: add `sizes=[...]`"), (3, 7), "    | concat(E, dim=0)", _LACKS)),
    ("{a,b} -> c\n    | interleave(dim=0, groups=2)\n", {"c": ((8, 2), "float32")}, {},
     ("E520", ("runtime tensor `c`: `interleave` joins 2 sources into dim 0 of size 8, and how it divides among "
              "them is not given: add `sizes=[...]`"), (3, 7), "    | interleave(dim=0, groups=2)", _LACKS)),
    ("a.{g,u} -> gu\n    | concat(dim=0, sizes=[4, 4])\n", _GU, {},
     ("E520", "runtime tensor `gu`: `concat`'s sizes [4, 4] do not fit the model's dim 0 of size 12 in 2 parts",
      (3, 7), "    | concat(dim=0, sizes=[4, 4])", _LACKS)),
    ("a.{g,u} -> gu\n    | concat(dim=0, sizes=[4, 4, 4])\n", _GU, {},
     ("E520", ("runtime tensor `gu`: `concat`'s sizes [4, 4, 4] do not fit the model's dim 0 of size 12 in 2 "
              "parts"), (3, 7), "    | concat(dim=0, sizes=[4, 4, 4])", _LACKS)),
    ("e.{E}.w -> w\n    | concat(E, dim=0, sizes=[2, 2])\n", {"w": ((5, 3), "float32")}, {},
     ("E520", "runtime tensor `w`: `concat`'s sizes [2, 2] do not fit the model's dim 0 of size 5", (3, 7),
      "    | concat(E, dim=0, sizes=[2, 2])", _LACKS)),
    # an argument a config value makes no integer: named as the op's parameter
    ("let D = config.d\na.{g,u} -> gu\n    | concat(dim=D, sizes=[4, 8])\n", _GU, {"d": 1.5},
     ("E210", "`dim` must be an integer, got 1.5", (4, 18), "    | concat(dim=D, sizes=[4, 8])", None)),
    ("let D = config.d\na.{g,u} -> gu\n    | concat(dim=0, sizes=[D, 8])\n", _GU, {"d": 1.5},
     ("E210", "`sizes` must be a list of integers, got [1.5, 8]", (4, 27), "    | concat(dim=0, sizes=[D, 8])", None)),
    ("let D = config.d\nt -> t\n    | transpose(D, 1)\n", {"t": ((2, 3), "float32")}, {"d": 0.5},
     ("E210", "`a` must be an integer, got 0.5", (4, 17), "    | transpose(D, 1)", None)),
    ("let D = config.d\nt -> t\n    | transpose(0, D)\n", {"t": ((2, 3), "float32")}, {"d": 0.5},
     ("E210", "`b` must be an integer, got 0.5", (4, 20), "    | transpose(0, D)", None)),
    ("let D = config.d\nw -> e.{E}.w\n    | unstack(E, dim=D)\n", {"e.0.w": ((2, 3), "float32")}, {"d": 0.5},
     ("E210", "`dim` must be an integer, got 0.5", (4, 22), "    | unstack(E, dim=D)", None)),
    ("let D = config.d\ne.{E}.w -> w\n    | stack(E, dim=D)\n", {"w": ((2, 3), "float32")}, {"d": 0.5},
     ("E210", "`dim` must be an integer, got 0.5", (4, 20), "    | stack(E, dim=D)", None)),
    ("let D = config.d\nqkv -> {q,k,v}\n    | split(dim=D, sizes=[2, 2, 2])\n",
     dict.fromkeys("qkv", ((2, 3), "float32")), {"d": 0.5},
     ("E210", "`dim` must be an integer, got 0.5", (4, 17), "    | split(dim=D, sizes=[2, 2, 2])", None)),
    ("let D = config.d\np -> p\n    | permute([D, 0, 1])\n", {"p": ((2, 3, 4), "float32")}, {"d": 0.5},
     ("E210", "`dims` must be a list of integers, got [0.5, 0, 1]", (4, 15), "    | permute([D, 0, 1])", None)),
    ("let D = config.d\nr -> r\n    | repeat(dim=0, times=D)\n", {"r": ((2, 3), "float32")}, {"d": 0.5},
     ("E210", "`times` must be an integer, got 0.5", (4, 27), "    | repeat(dim=0, times=D)", None)),
    ("let D = config.d\nr -> r\n    | repeat(dim=D, times=2)\n", {"r": ((2, 3), "float32")}, {"d": 0.5},
     ("E210", "`dim` must be an integer, got 0.5", (4, 18), "    | repeat(dim=D, times=2)", None)),
    ("x -> x\n    | pad(dim=0, to=8, size=5)\n", {"x": ((7, 2), "float32")}, {},
     ("E520", "runtime tensor `x`: `pad` pads dim 0 to 8, but the model's has 7", (3, 7),
      "    | pad(dim=0, to=8, size=5)", _LACKS)),
    *((f"let D = config.d\nx -> x\n    | pad({args})\n", {"x": ((8, 2), "float32")}, {"d": 0.5},
       ("E210", f"`{name}` must be an integer, got 0.5", (4, column), f"    | pad({args})", None))
      for name, args, column in [("dim", "dim=D, to=8, size=5", 15), ("to", "dim=0, to=D, size=5", 21),
                                 ("size", "dim=0, to=8, size=D", 29)]),
], ids=["stack width", "concat without sizes", "concat over a capture without sizes", "interleave without sizes",
        "sizes of another sum", "sizes of another count", "sizes over a capture", "dim", "sizes", "transpose a",
        "transpose b", "unstack dim", "stack dim", "split dim", "permute dims", "repeat times", "repeat dim", "pad to another size",
        "pad dim", "pad to", "pad size"])
def test_each_size_a_derived_layout_cannot_know_is_named_whole(text, runtime, config, expected):
    """Every way the runtime shapes leave a checkpoint size open (a stack of another width, a join with no
    `sizes=`, sizes that do not fit) and every argument that is no integer: the code, the whole message,
    the op's line and column, its line and the hint."""
    with pytest.raises(RemapError) as info:
        derive_checkpoint(rules_from_text("remap 1\n" + text), runtime, config)
    d = info.value.diagnostics[0]
    assert (d.code, d.message, (d.span.line, d.span.column), d.line_text, d.hint) == expected

def test_a_concat_without_sizes_names_the_op_and_the_dim():
    text = "remap 1\na.{L}.{g,u} -> a.{L}.gu\n    | concat(dim=0)\n"
    d = _refused(text, {"a.0.gu": ((12, 4), "float32")})
    assert (d.span.line, d.span.column) == (3, 7) and "sizes=" in d.message and "size 12" in d.message
    assert "a.0.gu" in d.message


@pytest.mark.parametrize("op, why", [
    ("slice(dim=0, start=1)", "`slice`: a slice leaves out rows whose number it does not state"),
    ("pad(dim=0, to=8)", "`pad`: a pad's input size is not given by the padded size: add `size=`"),
    ("reshape([2, 6])", "`reshape`: a reshape's input shape is not given by its output"),
    ("cast(bfloat16)", "`cast`: the dtype before a cast is not given by the dtype after it")])
def test_ops_whose_input_size_the_output_does_not_give_are_refused(op, why):
    d = _refused(f"remap 1\na -> b | {op}\n", {"b": ((2, 6), "bfloat16")})
    assert d.message == f"runtime tensor `b`: {why}" and (d.span.line, d.span.column) == (2, 10)


def test_a_wildcard_source_and_cast_all_are_refused():
    d = _refused("remap 1\nx.*.w -> y\n", {"y": ((2,), "float32")})
    assert "wildcard" in d.message and d.span.line == 2
    d = _refused("remap 1\ncast bfloat16\na -> b\n", {"b": ((2,), "bfloat16")})
    assert "`cast`" in d.message and d.span.line == 2


def test_a_model_lacking_one_target_of_a_rule_is_named():
    d = _refused("remap 1\nqkv -> {q,k,v} | chunk(dim=0, n=3)\n", {"q": ((2,), "float32"), "k": ((2,), "float32")})
    assert "`q`" in d.message and "not `v`" in d.message and d.span.line == 2


def test_the_forward_compile_checks_what_was_derived():
    """A runtime dtype the rule's op cannot give back (a split whose pieces disagree) is refused."""
    d = _refused("remap 1\nw -> {a,b} | split(dim=0, sizes=[2, 2])\n", {"a": ((2,), "float32"), "b": ((3,), "float32")})
    assert "does not load back" in d.message or "loads" in d.message


def test_stated_sizes_are_checked_on_load():
    rules = rules_from_text("remap 1\n{a,b} -> ab | concat(dim=0, sizes=[3, 2])\n")
    with pytest.raises(remapdsl.errors.BindError) as info:
        compile_rules(rules, Inventory.from_shapes({"a": ("float32", (2,)), "b": ("float32", (3,))}), {})
    d = info.value.diagnostics[0]
    assert d.code == "E207" and "[2, 3]" in d.message and "[3, 2]" in d.message and d.span.column == 15
    with pytest.raises(remapdsl.errors.BindError) as info:  # a pad's `size=`, the size it pads from
        compile_rules(rules_from_text("remap 1\na -> b | pad(dim=0, to=8, size=5)\n"),
                      Inventory.from_shapes({"a": ("float32", (6, 2))}), {})
    d = info.value.diagnostics[0]
    assert d.code == "E207" and "pads dim 0 of size 6, but `size=` says 5" in d.message


def test_a_pad_saves_back_without_like_when_it_states_its_size(tmp_path):
    """`pad(..., size=N)` is undone: the derived checkpoint tensor has N rows; without `size=` a save
    without `like` cannot know them (E520, saying to add it)."""
    state = {"b": torch.cat([torch.arange(10.0).reshape(5, 2), torch.zeros(3, 2)])}
    remapdsl.save(state, tmp_path / "out", rules_from_text("remap 1\na -> b | pad(dim=0, to=8, size=5)\n"))
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["a"], state["b"][:5])
    with pytest.raises(RemapError) as info:
        remapdsl.save(state, tmp_path / "unsized", rules_from_text("remap 1\na -> b | pad(dim=0, to=8)\n"))
    assert info.value.diagnostics[0].code == "E520" and "add `size=`" in info.value.diagnostics[0].message


def test_max_shard_size_takes_bytes_or_hugging_face_s_text(tmp_path):
    rules = rules_from_text("remap 1\n{a,b} -> ab | concat(dim=0, sizes=[500, 500])\n")
    state = {"ab": torch.zeros(1000)}  # two 2,000-byte tensors
    for size, files in ((3000, 2), ("3kB", 2), ("1MiB", 1)):
        report = remapdsl.save(state, tmp_path / str(size), rules, max_shard_size=size)
        assert len(report.files) == files, size
    with pytest.raises(RemapError) as info:
        remapdsl.save(state, tmp_path / "bad", rules, max_shard_size="5 XB")
    d = info.value.diagnostics[0]
    assert d.code == "E522" and d.message == "`max_shard_size='5 XB'` is not a size" and not (tmp_path / "bad").exists()


def test_no_config_writes_no_config_json_and_ignores_the_destination_s(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"q": 99}')
    rules = rules_from_text("remap 1\nlet Q = config.q ?? 2\n{a,b} -> ab | concat(dim=0, sizes=[Q, 1])\n")
    remapdsl.save({"ab": torch.arange(3.0)}, out, rules, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("a").tolist() == [0.0, 1.0] and f.get_tensor("b").tolist() == [2.0]


# -- on ranks: DTensors, no gather ------------------------------------------------------------------


def _save_dtensors(rank: int, world: int, rules: str, source: str, out: str) -> list[int]:
    """The state saved as DTensors into `out`, and as plain local shards under a layout into `out`-plain,
    each row-sharded where the rows divide: the bytes this rank wrote, each time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from remapdsl.sharding import LayoutPlan, Mesh
    from remapdsl.sharding import Shard as RowShard

    state, config, _ = _runtime(rules, Path(source))
    split = {k for k, v in state.items() if v.dim() and v.shape[0] % world == 0}
    mesh = init_device_mesh("cpu", (world,))
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)] if k in split else [], src_data_rank=None)
               for k, v in state.items()}
    local = {k: v.chunk(world)[rank].clone() if k in split else v for k, v in state.items()}
    layout = LayoutPlan.from_mapping({k: [RowShard(dim=0)] for k in split}, mesh_dim="dp")
    return [remapdsl.save(sharded, out, rules, config=config, max_shard_size="20kB").bytes_written,
            remapdsl.save(local, f"{out}-plain", rules, config=config, layout=layout, mesh=Mesh.of({"dp": world}),
                          max_shard_size="20kB").bytes_written]


@pytest.mark.distributed
def test_two_ranks_save_dtensors_or_local_shards_without_like_to_the_one_process_files(checkpoints, tmp_path):
    """Without `like`, the layout derived from every rank's shards (DTensors, or plain local shards under
    a layout plan, whose global shapes the plan gives) is the one process's: the same files, byte for byte."""
    rules = str(ROOT / "rules" / "qwen3_moe.remap")
    source = checkpoints("qwen3_moe")
    state, config, _ = _runtime(rules, source)
    remapdsl.save(state, tmp_path / "one", rules, config=config, max_shard_size="20kB")
    written = run_ranks(_save_dtensors, 2, rules, str(source), str(tmp_path / "two"), timeout=90,
                        backend="cuda:gloo")
    one = sorted(p.name for p in (tmp_path / "one").iterdir())
    total = sum(p.stat().st_size for p in (tmp_path / "one").glob("*.safetensors"))
    for kind, folder in enumerate(("two", "two-plain")):
        assert one == sorted(p.name for p in (tmp_path / folder).iterdir()), folder
        assert all((tmp_path / "one" / n).read_bytes() == (tmp_path / folder / n).read_bytes() for n in one), folder
        mine = [w[kind] for w in written]
        assert 0 < min(mine) and max(mine) < total, folder  # each rank wrote its part, none the whole


@pytest.mark.parametrize("page", ["saving.md", pytest.param("export.md", marks=pytest.mark.distributed)])
def test_the_pages_python_blocks_run_as_printed(tmp_path, page):
    """docs/saving.md's and docs/export.md's examples run in a fresh process, offline, and print
    what the page shows (the export page's second one on 2 gloo ranks)."""
    import re

    from doc_blocks import ran, run_block

    pytest.importorskip("transformers")
    blocks = re.findall(r"```python\n((?:(?!```).)*)```\n\nIt prints:\n\n```text\n(.*?)```", (ROOT / "docs" / page).read_text(),
                        re.DOTALL)
    assert blocks
    for number, (code, printed) in enumerate(blocks):
        run = run_block(code, tmp_path, f"{page[:-3]}_{number}")
        assert ran(run, printed), run.stderr[-4000:]
        assert run.stdout == printed
