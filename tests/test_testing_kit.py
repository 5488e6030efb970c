"""remapdsl.testing, the kit users run in their own CI: checkpoints written from a snapshot, the
assertions (passing on the shipped rules, failing with the tensor named on deliberately wrong
ones), the gloo runner, the strategies and the pytest plugin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from formats import Int8Row
from hf_models import wrong_rules
from hypothesis import given, settings
from hypothesis import strategies as st

import remapdsl
from remapdsl.checkpoint import Inventory
from remapdsl.dtypes import DTYPES
from remapdsl.quant import register_format, unregister_format
from remapdsl.testing import (
    assert_matches_reference,
    assert_round_trip,
    assert_sharded_equals_whole,
    assert_sharded_round_trip,
    assert_state_dicts_equal,
    load_whole,
    scale_down,
    write_checkpoint,
)
from remapdsl.testing.compare import file_differences
from remapdsl.testing.strategies import affine_indices, chunk_tilings, memory_layouts

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-qwen3-moe"
QWEN3_RULES = ROOT / "rules" / "qwen3_moe.remap"
LLAMA_RULES = ROOT / "rules" / "llama.remap"
QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, num_hidden_layers=2, intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                 num_experts_per_tok=2, max_position_embeddings=64)
LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=1, intermediate_size=48, max_position_embeddings=64)



# -- state dicts ---------------------------------------------------------------------------------


def test_state_dict_differences_name_keys_first_then_the_first_differing_index():
    a = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.zeros(2), "only_a": torch.zeros(1)}
    b = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.zeros(3), "only_b": torch.zeros(1)}
    b["x"][1, 2] = 9.0
    with pytest.raises(AssertionError) as info:
        assert_state_dicts_equal(a, b)
    lines = str(info.value).splitlines()
    assert lines[1:3] == ["  only in actual: `only_a`", "  only in expected: `only_b`"]
    assert lines[3] == "  `x`: 1 of 6 elements differ; first at [1, 2]: actual 5.0, expected 9.0"
    assert lines[4] == "  `y`: actual is float32 [2], expected float32 [3]"
    nan = torch.tensor([float("nan"), 1.0])
    assert_state_dicts_equal({"n": nan}, {"n": nan.clone()})  # bits: NaN equals itself
    fp8 = torch.zeros(3, dtype=torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match=r"`f`: 1 of 3 elements differ; first at \[2\]"):
        assert_state_dicts_equal({"f": fp8}, {"f": torch.tensor([0.0, 0.0, 2.0]).to(torch.float8_e4m3fn)})


# -- checkpoints from a snapshot ---------------------------------------------------------------------


def test_a_checkpoint_written_from_a_snapshot_has_its_layout(tmp_path):
    snapshot = tmp_path / "model.headers.json"
    remapdsl.write_snapshot(TINY, snapshot)
    folder = write_checkpoint(snapshot, tmp_path / "random", seed=3)
    original, written = remapdsl.open_checkpoint(TINY), remapdsl.open_checkpoint(folder)
    assert written.tensors == original.tensors  # the same keys, dtypes, shapes, files, offsets
    assert json.loads((folder / "config.json").read_text()) == json.loads((TINY / "config.json").read_text())
    again = write_checkpoint(snapshot, tmp_path / "again", seed=3)
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    other = write_checkpoint(snapshot, tmp_path / "other", seed=4)
    assert (other / "model.safetensors").read_bytes() != (folder / "model.safetensors").read_bytes()


def test_every_dtype_is_written_with_finite_values(tmp_path):
    from safetensors import safe_open

    shapes = {f"t.{d.name}": (d.name, (4, 12)) for d in DTYPES}
    folder = write_checkpoint(Inventory.from_shapes(shapes), tmp_path / "all", seed=1)
    inventory = remapdsl.open_checkpoint(folder)
    assert {k: (t.dtype, t.shape) for k, t in inventory.tensors.items()} == shapes
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for d in DTYPES:
            if not d.in_torch or d.bits < 8 or d.name == "float8_e8m0fnu":
                continue
            value = f.get_tensor(f"t.{d.name}")
            if d.kind == "float":
                assert torch.isfinite(value.float()).all(), d.name
                assert len(value.float().unique()) > 8, d.name
    raw = (folder / "model.safetensors").read_bytes()
    e8m0 = inventory.tensors["t.float8_e8m0fnu"]
    assert set(raw[e8m0.byte_offset:e8m0.byte_end]) <= set(range(120, 135))
    e4m3 = inventory.tensors["t.float8_e4m3fn"]
    assert not {0x7F, 0xFF} & set(raw[e4m3.byte_offset:e4m3.byte_end])


def test_scaled_down_keeps_the_first_layers_and_experts_and_adjusts_the_config(tmp_path):
    folder = write_checkpoint(TINY, tmp_path / "small", layers=1, experts=2, seed=5)
    inventory = remapdsl.open_checkpoint(folder)
    assert not any(".layers.1." in k for k in inventory.tensors)
    assert {k.split(".experts.")[1].split(".")[0] for k in inventory.tensors if ".experts." in k} == {"0", "1"}
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_experts"]) == (1, 2)
    full = write_checkpoint(TINY, tmp_path / "full", seed=5)
    key = "model.layers.0.mlp.experts.1.up_proj.weight"
    assert torch.equal(load_whole(QWEN3_RULES, folder)["model.layers.0.mlp.experts.gate_up_proj"][1],
                       load_whole(QWEN3_RULES, full)["model.layers.0.mlp.experts.gate_up_proj"][1]), key
    assert_round_trip(QWEN3_RULES, folder)
    small = scale_down(remapdsl.open_checkpoint(TINY), layers=1, config={"num_hidden_layers": 2, "mlp_only_layers": [0, 1],
                                                                         "num_experts_per_tok": 8})
    assert small.config == {"num_hidden_layers": 1, "mlp_only_layers": [0], "num_experts_per_tok": 8}


# -- round trips ---------------------------------------------------------------------------------------


def test_round_trip_passes_on_the_shipped_rules():
    assert_round_trip(QWEN3_RULES, TINY)


def test_round_trip_of_random_fp8_values_with_their_block_scales(tmp_path):
    inventory = Inventory.from_shapes({"w.weight": ("F8_E4M3", (8, 12)), "w.weight_scale_inv": ("F32", (2, 3)),
                                       "norm": ("BF16", (12,))})
    rules = tmp_path / "fp8.remap"
    rules.write_text("remap 1\ndequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight\n"
                     "    | fp8_block(block=[4, 4], to=bfloat16)\nw.weight -> w\nnorm -> norm\n")
    folder = write_checkpoint(inventory, tmp_path / "fp8", seed=2)
    assert_round_trip(rules, folder)


def test_a_differing_file_names_the_tensor_and_element(tmp_path):
    inventory = remapdsl.open_checkpoint(TINY)
    copy = tmp_path / "copy"
    copy.mkdir()
    raw = bytearray((TINY / "model.safetensors").read_bytes())
    t = inventory.tensors["model.layers.1.mlp.experts.2.gate_proj.weight"]
    raw[t.byte_offset + 4 * 17] ^= 0x40  # element 17 = [1, 1] of a [8, 16] float32 tensor
    (copy / "model.safetensors").write_bytes(bytes(raw))
    (found,) = file_differences(inventory, copy)
    assert found.startswith("model.safetensors: tensor `model.layers.1.mlp.experts.2.gate_proj.weight`: "
                            "1 of 128 elements differ; first at [1, 1]: written ")


# -- wrong rules are caught ----------------------------------------------------------------------------


def test_a_reference_catches_gate_and_up_swapped_which_round_trips_fine(remapdsl_checkpoint, tmp_path):
    folder = remapdsl_checkpoint(QWEN3_MOE)
    assert_matches_reference(QWEN3_RULES, folder, "transformers")
    swapped = wrong_rules(tmp_path, QWEN3_RULES, "experts.{E}.{gate,up}_proj.weight", "experts.{E}.{up,gate}_proj.weight")
    assert_round_trip(swapped, folder)  # consistent, so a round trip cannot see it
    with pytest.raises(AssertionError) as info:
        assert_matches_reference(swapped, folder, "transformers")
    message = str(info.value)
    assert "(remapdsl vs transformers)" in message
    assert "`model.layers.0.mlp.experts.gate_up_proj`: " in message and "first at [0, 0, 0]" in message


def test_a_reference_catches_experts_stacked_in_the_wrong_order(remapdsl_checkpoint, tmp_path):
    folder = remapdsl_checkpoint(QWEN3_MOE, seed=1)
    wrong = wrong_rules(tmp_path, QWEN3_RULES, "model.layers.{L}.mlp.experts.{E}.down_proj.weight -> "
                   "model.layers.{L}.mlp.experts.down_proj\n    | stack(E, dim=0)",
                   "model.layers.{L}.mlp.experts.{1,0,2,3}.down_proj.weight -> "
                   "model.layers.{L}.mlp.experts.down_proj\n    | stack(dim=0)")
    with pytest.raises(AssertionError) as info:
        assert_matches_reference(wrong, folder, "transformers")
    assert "`model.layers.0.mlp.experts.down_proj`: 1024 of 2048 elements differ; first at [0, 0, 0]" in str(info.value)


def test_a_reference_catches_qkv_split_at_the_wrong_sizes(remapdsl_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = remapdsl_checkpoint(LLAMA)
    fused = tmp_path / "fused"
    fused.mkdir()
    tensors = load_file(str(hf / "model.safetensors"))
    parts = [tensors.pop(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkv"]
    tensors["model.layers.0.self_attn.qkv_proj.weight"] = torch.cat(parts)  # [32 + 16 + 16, 32]
    save_file(tensors, str(fused / "model.safetensors"))
    (fused / "config.json").write_bytes((hf / "config.json").read_bytes())

    def reference(checkpoint):  # the user's own loader: the unfused model's state dict
        return load_file(str(hf / "model.safetensors"))

    split = ("model.layers.{L}.self_attn.qkv_proj.weight -> model.layers.{L}.self_attn.{q,k,v}_proj.weight\n"
             "    | split(dim=0, sizes=[%s])\nmodel.layers.{L}.self_attn.o_proj.weight -> model.layers.{L}.self_attn.o_proj.weight")
    old = "model.layers.{L}.self_attn.{q,k,v,o}_proj.weight -> model.layers.{L}.self_attn.{q,k,v,o}_proj.weight"
    assert_matches_reference(wrong_rules(tmp_path, LLAMA_RULES, old, split % "32, 16, 16"), fused, reference)
    with pytest.raises(AssertionError) as info:
        assert_matches_reference(wrong_rules(tmp_path, LLAMA_RULES, old, split % "16, 32, 16"), fused, reference)
    message = str(info.value)
    assert "`model.layers.0.self_attn.q_proj.weight`: the rules make float32 [16, 32], reference has float32 [32, 32]" in message
    assert "`model.layers.0.self_attn.k_proj.weight`: the rules make float32 [32, 32]" in message


def test_a_snapshot_is_refused_where_data_is_needed(tmp_path):
    snapshot = tmp_path / "m.headers.json"
    remapdsl.write_snapshot(TINY, snapshot)
    for check in (lambda: assert_round_trip(QWEN3_RULES, snapshot),
                  lambda: assert_matches_reference(QWEN3_RULES, snapshot, "transformers"),
                  lambda: assert_sharded_equals_whole(QWEN3_RULES, snapshot, mesh="tp=2")):
        with pytest.raises(remapdsl.RemapError) as info:
            check()
        assert info.value.diagnostics[0].code == "E331"


# -- real ranks ------------------------------------------------------------------------------------------


def _fails_on_rank_1(rank: int, world: int, word: str) -> int:
    import torch.distributed as dist

    dist.barrier()
    assert rank != 1, f"{word} on rank {rank}"
    return rank * 10


TP = {"*.self_attn.q_proj": "colwise", "*.self_attn.o_proj": "rowwise",
      "*.mlp.experts.gate_up_proj": "packed_colwise", "*.mlp.experts.down_proj": "rowwise"}


@pytest.mark.distributed
@pytest.mark.remapdsl_distributed
def test_sharded_loads_equal_the_whole_load_on_two_gloo_ranks(remapdsl_ranks, tmp_path):
    """Under a tp_plan-style layout, the sharded load's checks run in the round trip below (one
    spawn for both); here the default layout (every tensor cut on every mesh dim), a 2-d mesh, a
    random scaled-down checkpoint."""
    folder = write_checkpoint(TINY, tmp_path / "random", seed=7, experts=3)
    reports = assert_sharded_equals_whole(QWEN3_RULES, folder, mesh="dp=1,tp=2")
    assert sum(r["bytes_owned"] for r in reports) == sum(t.nbytes for t in remapdsl.open_checkpoint(folder).tensors.values())
    with pytest.raises(AssertionError) as info:
        remapdsl_ranks(_fails_on_rank_1, 2, "refused")
    assert str(info.value) == "rank 1: refused on rank 1"


@pytest.mark.distributed
def test_a_sharded_save_of_the_sharded_load_gives_the_checkpoint_back_and_names_a_lossy_cast(tmp_path):
    """The round trip runs `assert_sharded_equals_whole`'s checks of the load first (each shard
    equals the whole load sliced, each rank read exactly the bytes it owns), then the save."""
    reports = assert_sharded_round_trip(QWEN3_RULES, TINY, TP, mesh={"tp": 2})
    assert len(reports) == 2 and all(r["bytes_read"] == r["bytes_owned"] > 0 for r in reports)
    assert sum(r["bytes_written"] for r in reports) > 0
    lossy = wrong_rules(tmp_path, QWEN3_RULES, "model.norm.weight -> model.norm.weight",
                        "model.norm.weight -> model.norm.weight | cast(float16)")
    with pytest.raises(AssertionError) as info:
        assert_sharded_round_trip(lossy, TINY, TP, mesh={"tp": 2})
    assert "the sharded save failed" in str(info.value) and "E502" in str(info.value)
    assert "model.norm.weight" in str(info.value)


# -- strategies ------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_meshes_and_layouts_plan_every_rank_exactly(data):
    from remapdsl.testing.strategies import layouts, meshes

    compiled = _tiny_compiled()
    mesh = data.draw(meshes())
    assert 1 <= len(mesh.sizes) <= 3 and mesh.size <= 8
    layout = data.draw(layouts(compiled, mesh))
    for rank in range(mesh.size):
        plan = remapdsl.plan_rank(compiled, _tiny_inventory(), layout, mesh, rank)
        assert plan.bytes_read == plan.bytes_owned


@settings(max_examples=3, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_checkpoints_round_trip_and_load(data, tmp_path_factory):
    from remapdsl.testing.strategies import checkpoints

    root = tmp_path_factory.mktemp("drawn")
    folder = data.draw(checkpoints(TINY, root=root, layers=st.integers(1, 2), experts=st.sampled_from([None, 3])))
    assert_round_trip(QWEN3_RULES, folder)


_CACHE: dict = {}


def _tiny_inventory():
    return _CACHE.setdefault("inventory", remapdsl.open_checkpoint(TINY))


def _tiny_compiled():
    return _CACHE.setdefault("compiled", remapdsl.compile_rules(QWEN3_RULES, _tiny_inventory()))


# -- the plugin ------------------------------------------------------------------------------------------


def test_the_plugin_is_registered_through_its_entry_point(request):
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\nremapdsl = "remapdsl.testing.plugin"' in text
    assert request.config.pluginmanager.has_plugin("remapdsl")
    assert "remapdsl_distributed: a test that runs real gloo processes (remapdsl.testing)" in \
        request.config.getini("markers")
    profile = settings.get_profile("remapdsl-ci")
    assert profile.derandomize and profile.deadline is None


def test_importing_the_kit_does_not_need_hypothesis():
    code = ("import sys; sys.modules['hypothesis'] = None; import remapdsl.testing, remapdsl.testing.plugin; "
            "print(sorted(m for m in sys.modules if m.startswith('hypothesis')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['hypothesis']"


class _Int8Row(Int8Row):
    """A format of a user's own (the docs' example), under the kit's name."""

    name = "kit_int8_row"


@settings(max_examples=12, deadline=None, derandomize=True)
@given(data=st.data())
def test_op_chains_check_a_format_of_ones_own_against_the_reference(data, tmp_path_factory):
    """What a user who registers a format does with the kit: random op chains after the format's
    dequantize, each load compared with the reference ops on the values decoded by hand."""
    from safetensors.torch import save_file

    from remapdsl.testing.reference import apply_ops
    from remapdsl.testing.strategies import op_chains

    register_format(_Int8Row(), replace=True)
    try:
        rows, cols = data.draw(st.sampled_from([(4, 6), (6, 4), (2, 12)]))
        chain = data.draw(op_chains([(rows, cols)], max_ops=3))
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
        values = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
        scales = torch.rand(rows, generator=gen) + 0.5
        folder = tmp_path_factory.mktemp("own_format")
        save_file({"w.qweight": values, "w.scales": scales}, str(folder / "model.safetensors"))
        targets = [f"out.t{i}" for i in range(len(chain.shapes))] if len(chain.shapes) > 1 else ["out"]
        target = f"out.{{{','.join(t.split('.')[1] for t in targets)}}}" if len(targets) > 1 else "out"
        text = ("remap 1\ndequantize w.qweight, w.scales -> w.weight | kit_int8_row(to=float32)\n"
                f"w.weight -> {target}\n" + "".join(f"    | {op}\n" for op in chain.ops))
        rules = remapdsl.language.rules_from_text(text)
        (rule,) = [s for s in rules.statements if type(s).__name__ == "Rule"]
        expected = apply_ops(list(rule.ops), [values.to(torch.float32) * scales.unsqueeze(-1)],
                             targets=len(targets))
        compiled = remapdsl.compile_rules(rules, remapdsl.open_checkpoint(folder), {})
        loaded = {d.runtime_key: torch.full(d.shape, float("nan"), dtype=getattr(torch, d.dtype))
                  for d in compiled.runtime_tensors}
        remapdsl.load(loaded, str(folder), rules, config={})
        assert_state_dicts_equal(loaded, dict(zip(targets, expected)))
    finally:
        unregister_format("kit_int8_row")


@settings(max_examples=2, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_checkpoints_from_a_transformers_config_load_through_the_rules(data):
    from remapdsl.testing.strategies import checkpoints

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 48,
              "max_position_embeddings": 64}
    folder = data.draw(checkpoints(config))
    state = load_whole(LLAMA_RULES, folder)
    assert "model.layers.0.self_attn.q_proj.weight" in state
    assert_matches_reference(LLAMA_RULES, folder, "transformers")
    with pytest.raises(ValueError, match="its own numbers of layers"):
        checkpoints(config, layers=1)


# -- the strategies for memory layouts, index maps and chunk tilings -----------------------------------


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=3).flatmap(
    lambda shape: st.tuples(st.just(shape), memory_layouts(shape), memory_layouts(shape, expanded=True))))
def test_memory_layouts_are_views_of_the_shape_drawn(drawn):
    """A drawn layout is a view of the shape into its base, filled with the fill value; its elements
    are distinct memory unless expanded, and `outside()` is exactly the base's other elements (marked
    by writing through the view); an expanded one shares memory on a dim of several elements."""
    shape, held, expanded = drawn
    assert tuple(held.tensor.shape) == tuple(shape) and held.tensor.isnan().all()
    assert held.tensor.untyped_storage().data_ptr() == held.base.untyped_storage().data_ptr()
    held.tensor.copy_(torch.arange(held.tensor.numel(), dtype=torch.float32).reshape(shape))  # no overlap
    assert held.base.isnan().sum() == held.outside().numel() == held.base.numel() - held.tensor.numel()
    assert torch.equal(held.tensor.flatten(), torch.arange(held.tensor.numel(), dtype=torch.float32))
    wide = [d for d, n in enumerate(shape) if n > 1]
    assert bool(wide) == any(expanded.tensor.stride(d) == 0 for d in wide)


@settings(max_examples=40, deadline=None)
@given(affine_indices(st.integers(1, 5)))
def test_affine_indices_map_their_indices_to_distinct_non_negative_ones(affine):
    images = [affine(i) for i in affine.indices]
    assert min(affine.indices) >= 0 and min(images) >= 0 and len(set(images)) == len(images)
    L = affine.indices[-1]
    assert eval(affine.text.strip("{}"), {}, {affine.name: L}) == affine(L)  # noqa: S307 - the text is ours


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), max_size=3).flatmap(
    lambda shape: st.tuples(chunk_tilings(shape, max_chunks=10), chunk_tilings(shape, max_chunks=10, gaps=True))))
def test_chunk_tilings_cover_every_element_once_and_gaps_leave_the_removed_ones(drawn):
    tiling, gapped = drawn
    for t, boxes in ((tiling, tiling.boxes), (gapped, gapped.boxes + gapped.removed)):
        count = torch.zeros(t.shape, dtype=torch.int64)
        for offsets, sizes in boxes:
            assert all(o >= 0 and o + n <= m for o, n, m in zip(offsets, sizes, t.shape))
            count[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
        assert bool((count == 1).all()), (t.kind, boxes)
    assert not gapped.removed or all(all(n for n in sizes) for _, sizes in gapped.removed)
