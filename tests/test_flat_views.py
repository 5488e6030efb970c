"""A reshape that merges dims whose rows follow each other in the checkpoint's bytes keeps one
block, indexing the tensor's flat view (`Block.view`), not a block per row: compiled, planned for
any rank, loaded and saved back exactly, at the size of a real embedding."""

from __future__ import annotations

import itertools

import pytest
import torch
from checkpoints import tiny_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import remapdsl
from remapdsl.compile import symbolic as sym
from remapdsl.compile.inverse import writers
from remapdsl.indexmap import Runs, source_box
from remapdsl.language import rules_from_text
from remapdsl.runtime.read import run_load_plan
from remapdsl.sharding import LayoutPlan, Mesh, Shard
from remapdsl.sharding.holdings import held_by_layout, hold, owned
from remapdsl.sharding.plans import make_load_plan, make_write_plan


def _checkpoint(tmp_path, tensors):
    return tiny_checkpoint(tmp_path / "src", tensors, {})


@pytest.mark.parametrize("shape, target", [((1000, 2), "[2000]"), ((4, 3, 5), "[4, 15]"), ((4, 3, 5), "[60]"),
                                           ((6, 1, 4), "[24]")])
def test_a_merge_of_whole_rows_is_one_block_over_the_flat_view(shape, target):
    inventory = remapdsl.Inventory.from_shapes({"w": ("float32", shape)})
    compiled = remapdsl.compile_rules(rules_from_text(f"remap 1\nw -> s | reshape({target})\n", "t.remap"),
                                      inventory, {})
    (s,) = compiled.runtime_tensors
    (block,) = s.blocks
    n = 1
    for size in shape:
        n *= size
    assert block.view == (n,) and block.base == (0,)
    assert source_box(block, shape) == tuple((0, size, 1) for size in shape)
    assert "flattened" in remapdsl.explain(compiled)


def test_a_merge_of_cut_rows_still_makes_a_block_per_row():
    """Columns 0:2 of w [5, 4] merged: the rows are not adjacent in w's bytes, so five blocks."""
    inventory = remapdsl.Inventory.from_shapes({"w": ("float32", (5, 4))})
    rules = rules_from_text("remap 1\nw -> s | slice(dim=1, start=0, stop=2) | reshape([10])\n", "t.remap")
    (s,) = remapdsl.compile_rules(rules, inventory, {}).runtime_tensors
    assert [(b.offsets, b.base) for b in s.blocks] == [((2 * r,), (r, 0)) for r in range(5)]


def test_a_dequantized_tensor_keeps_its_own_dims():
    """A tensor read through a format is cut on its own grid: no flat view of it is taken."""
    inventory = remapdsl.Inventory.from_shapes({"q.weight": ("float8_e4m3fn", (4, 4)),
                                                "q.weight_scale_inv": ("float32", (4, 1))})
    rules = rules_from_text("remap 1\ndequantize q.weight, q.weight_scale_inv -> q | fp8_block(block=[1, 4], "
                            "to=float32)\nq -> w | reshape([16])\n", "t.remap")
    (w,) = remapdsl.compile_rules(rules, inventory, {}).runtime_tensors
    assert len(w.blocks) == 4 and all(b.view == () for b in w.blocks)


def test_a_flattened_embedding_plans_an_item_a_rank_at_full_size():
    """DeepSeek-V3's embedding [129280, 7168] flattened and cut over 7 ranks (edges inside rows):
    one block, and each rank's plan one item of one run, its bytes exactly its share."""
    inventory = remapdsl.Inventory.from_shapes({"e": ("bfloat16", (129280, 7168))})
    compiled = remapdsl.compile_rules(rules_from_text("remap 1\ne -> flat | reshape([-1])\n", "t.remap"),
                                      inventory, {})
    assert len(compiled.runtime_tensors[0].blocks) == 1
    layout = LayoutPlan.from_mapping({"flat": [Shard(dim=0)]}, mesh_dim="tp")
    mesh = Mesh.of({"tp": 7})
    share = 129280 * 7168 // 7 * 2  # bytes
    start = inventory.tensors["e"].byte_offset
    for rank in (0, 3, 6):
        plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)
        (item,) = plan.items
        assert item.runs == Runs(start + rank * share, share)
        assert plan.bytes_read == plan.bytes_owned == share


def test_shards_cut_inside_rows_load_and_save_back_exactly(tmp_path):
    """w [7, 3] flattened to [21] and cut over 4 ranks (6, 6, 6, 3 elements: edges inside rows):
    each rank loads its elements of w in order, and the ranks' write plans together write every
    byte of w once."""
    w = torch.arange(21, dtype=torch.float32).reshape(7, 3)
    folder = _checkpoint(tmp_path, {"w": w})
    rules = rules_from_text("remap 1\nw -> s | reshape([21])\n", "t.remap")
    inventory = remapdsl.open_checkpoint(folder)
    compiled = remapdsl.compile_rules(rules, inventory, {})
    layout = LayoutPlan.from_mapping({"s": [Shard(dim=0)]}, mesh_dim="tp")
    mesh = Mesh.of({"tp": 4})
    chosen = writers(compiled)
    written = []
    for rank in range(4):
        local = torch.zeros(held_by_layout(compiled, layout, mesh, rank)["s"].shape)
        holding = hold(compiled, {"s": local}, layout, mesh, rank)
        plan = make_load_plan(compiled, inventory, holding.held(), rank)
        assert plan.bytes_read == plan.bytes_owned == 4 * local.numel()
        run_load_plan(plan, inventory, holding.local)
        assert torch.equal(local, w.flatten()[rank * 6:rank * 6 + local.numel()])
        for item in make_write_plan(chosen, inventory, owned(holding, rank), rank, compiled.logical_by_key()).items:
            written.extend(range(item.runs.first, item.runs.end))
    assert sorted(written) == list(range(inventory.tensors["w"].byte_offset, inventory.tensors["w"].byte_offset + 84))


def test_a_flattened_tensor_saves_back_to_the_same_bytes(tmp_path):
    w = torch.randn(5, 4)
    folder = _checkpoint(tmp_path, {"w": w, "b": torch.randn(3)})
    rules = rules_from_text("remap 1\nw -> s | reshape([20])\nb -> b\n", "t.remap")
    state = {"s": torch.zeros(20), "b": torch.zeros(3)}
    remapdsl.load(state, folder, rules, config={})
    assert torch.equal(state["s"], w.flatten())
    state["s"] += 1
    remapdsl.save(state, tmp_path / "out", rules, like=folder)
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], w + 1)


@st.composite
def _flat_pieces(draw):
    """A source shape, and a block of its flat view: flattened, narrowed, maybe seen as 2-D."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    n = 1
    for size in shape:
        n *= size
    t = sym.reshape(sym.source("w", shape, "float32", True), (n,))
    lo = draw(st.integers(0, n - 1))
    hi = draw(st.integers(lo + 1, n))
    t = sym.narrow(t, 0, lo, hi)
    rows = draw(st.sampled_from([d for d in range(1, hi - lo + 1) if (hi - lo) % d == 0]))
    t = sym.reshape(t, (rows, (hi - lo) // rows))
    return shape, t.blocks


@settings(max_examples=300, deadline=None)
@given(_flat_pieces())
def test_the_box_of_a_flat_view_block_holds_exactly_its_elements(case):
    """Where `source_box` finds a box for a block of a flat view, its indices are exactly the
    elements the block reads, listed one by one; where it finds none, they are no box."""
    shape, blocks = case
    for block in blocks:
        flat_index = {block.base[0] + sum(c * i for c, i in zip(block.coeff[0], index))
                      for index in itertools.product(*map(range, block.sizes))}
        strides = [1] * len(shape)
        for k in range(len(shape) - 2, -1, -1):
            strides[k] = strides[k + 1] * shape[k + 1]
        read = {tuple(f // s % n for s, n in zip(strides, shape)) for f in flat_index}
        box = source_box(block, shape)
        if box is not None:
            assert read == set(itertools.product(*(range(b, b + s * c, s) for b, c, s in box)))
        else:  # no box: some dim's indices are no progression, or the set is not their product
            ranges = [sorted({index[k] for index in read}) for k in range(len(shape))]
            assert len(read) != len(list(itertools.product(*ranges))) or any(
                len({b - a for a, b in zip(r, r[1:])}) > 1 for r in ranges)


def test_two_flat_readers_cut_inside_rows_save_each_element_once_first_rule_first(tmp_path):
    """w [7, 3] read flattened by two rules: a takes elements 0:10, b 5:21 (both edges inside rows
    of w). The save writes 0:10 from a and 10:21 from b: every element once, the first rule's where
    both hold it."""
    w = torch.arange(21, dtype=torch.float32).reshape(7, 3)
    folder = _checkpoint(tmp_path, {"w": w})
    rules = rules_from_text("remap 1\nw -> a | reshape([21]) | slice(dim=0, start=0, stop=10)\n"
                            "w -> b | reshape([21]) | slice(dim=0, start=5, stop=21)\n", "t.remap")
    state = {"a": torch.zeros(10), "b": torch.zeros(16)}
    remapdsl.load(state, folder, rules, config={})
    assert torch.equal(state["a"], w.flatten()[:10]) and torch.equal(state["b"], w.flatten()[5:])
    state["a"] += 100
    state["b"] += 200
    remapdsl.save(state, tmp_path / "out", rules, like=folder)
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))["w"].flatten()
    assert torch.equal(saved, torch.cat([w.flatten()[:10] + 100, w.flatten()[10:] + 200]))


@pytest.mark.parametrize("shape, start, steps, sizes, box", [
    # runtime dims that continue each other merge first, even past a unit dim: the whole tensor
    ((2, 3, 3), 0, (6, 2, 1), (3, 1, 6), ((0, 2, 1), (0, 3, 1), (0, 3, 1))),
    ((2, 3), 0, (0,), (3,), None),  # a dim that moves nothing
    ((4, 3), 0, (2,), (3,), None),  # every other element: 0, 2 of row 0, then 1 of row 1
    ((2, 2), 0, (2,), (4,), None),  # a walk past the tensor's last row
    ((2, 3), 0, (1,), (4,), None),  # row 0 and the first element of row 1
    ((2, 4), 2, (2,), (2,), None),  # columns 2 of row 0 and 0 of row 1
    ((2, 4), 1, (2,), (4,), ((0, 2, 1), (1, 2, 2))),  # columns 1 and 3 of both rows
])
def test_the_box_of_a_flat_view_block_at_its_edges(shape, start, steps, sizes, box):
    n = 1
    for size in shape:
        n *= size
    block = remapdsl.indexmap.Block((0,) * len(sizes), sizes, "w", (start,), (steps,), view=(n,))
    assert source_box(block, shape) == box
