"""The compact run sets of the plans cover exactly the bytes an element-by-element enumeration gives.

A plan item holds one strided description of its byte runs (`indexmap.Runs`), never a list of runs.
Two oracles that share nothing with that description:
- for random flat maps, every element's source index listed one by one, against the runs expanded
  and the strides into their concatenation;
- for random op chains (tests/test_compile_properties.py's) and random meshes and placements, every
  element a rank holds, mapped through the compiled blocks to its byte in the checkpoint file, against
  where the rank's load plan and write plan put it.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

from hypothesis import given, note
from hypothesis import strategies as st
from safetensors.torch import save_file
from test_compile_properties import examples, list_axis_cases
from test_save_properties import _placements, meshes

import remapdsl
from remapdsl import RemapError
from remapdsl.compile.inverse import writers
from remapdsl.dtypes import BY_NAME
from remapdsl.indexmap import Runs, box_overlap, box_volume, row_major_strides, source_runs
from remapdsl.sharding import LayoutPlan
from remapdsl.sharding.holdings import held_by_layout, whole_shard
from remapdsl.sharding.plans import make_load_plan, make_write_plan


def expanded(runs: Runs) -> list[int]:
    """Every unit the runs cover, in concatenation order (runs listed, then each run's units)."""
    return [start + i for start in runs.starts() for i in range(runs.length)]


def elements(sizes):
    return itertools.product(*(range(n) for n in sizes))


@st.composite
def flat_maps(draw):
    """The flat map of a random box of a random row-major tensor under a random dim order: what a
    block of slices, transposes and strided shards gives."""
    ndim = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    steps = draw(st.lists(st.integers(1, 2), min_size=ndim, max_size=ndim))
    sizes, base = [], []
    for n, step in zip(shape, steps):
        count = draw(st.integers(0, -(-n // step)))
        first = draw(st.integers(0, n - 1 - (count - 1) * step)) if count else 0
        sizes.append(count)
        base.append(first)
    order = draw(st.permutations(range(ndim)))
    strides = row_major_strides(shape)
    start = sum(b * t for b, t in zip(base, strides))
    flat = [strides[k] * steps[k] for k in order]
    return start, flat, tuple(sizes[k] for k in order)


@examples(400)
@given(flat_maps(), st.integers(1, 9))
def test_runs_are_the_elements_listed_one_by_one(case, most):
    start, flat, sizes = case
    runs, strides = source_runs(start, flat, sizes)
    covered = expanded(runs)
    listed = [start + sum(x * t for x, t in zip(index, flat)) for index in elements(sizes)]
    assert sorted(covered) == sorted(listed)  # the same elements, each once
    assert covered == sorted(covered)  # in ascending order
    assert runs.total == len(listed) and runs.end == (max(listed) + 1 if listed else runs.first)
    for index in elements(sizes):  # each element sits where the strides say in the concatenation
        at = sum(x * t for x, t in zip(index, strides))
        assert covered[at] == start + sum(x * t for x, t in zip(index, flat))
    chunks = list(runs.chunks(most))
    assert [u for c in chunks for u in expanded(c)] == covered
    assert all(c.count <= most for c in chunks)


def _oracle(compiled, inventory, key: str, index: tuple[int, ...]) -> tuple[str, int, int]:
    """(file, first byte, byte count) of the checkpoint element behind runtime element `index`, or
    None for a pad: found by trying every block of the runtime tensor."""
    d = compiled.runtime_tensor(key)
    for b in d.blocks:
        if all(o <= i < o + n for i, o, n in zip(index, b.offsets, b.sizes)):
            if b.source_key is None:
                return None
            info = inventory.tensors[b.source_key]
            source = [base + sum(c * (i - o) for c, i, o in zip(row, index, b.offsets))
                      for base, row in zip(b.base, b.coeff)]
            itemsize = BY_NAME[info.dtype].bits // 8
            flat = sum(s * t for s, t in zip(source, row_major_strides(b.view or info.shape)))
            return info.file, info.byte_offset + flat * itemsize, itemsize
    raise AssertionError(f"{key}{index} is in no block")


def _placed(items, inventory) -> dict:
    """(runtime key, local index) -> (file, first byte, byte count), as the plan items place them."""
    out = {}
    for item in items:
        if item.ckpt_key is None:
            continue
        itemsize = BY_NAME[item.dtype].bits // 8
        data = expanded(item.runs)
        assert len(data) == len(set(data)), "a byte is read twice"
        for x in elements(item.sizes):
            at = sum(i * t for i, t in zip(x, item.strides)) * itemsize
            local = tuple(o + i for o, i in zip(item.local_offsets, x))
            assert data[at:at + itemsize] == list(range(data[at], data[at] + itemsize))
            assert (item.runtime_key, local) not in out, "an element is filled twice"
            out[(item.runtime_key, local)] = (item.file, data[at], itemsize)
    return out


def _expected(compiled, inventory, shards) -> dict:
    """The same map from the oracle, for every element of every box the rank holds or owns."""
    out = {}
    for key, shard in shards.items():
        for box, at in zip(shard.boxes, shard.local_offsets):
            for x in elements(box.sizes):
                found = _oracle(compiled, inventory, key, tuple(o + i for o, i in zip(box.offsets, x)))
                if found is not None:
                    out[(key, tuple(a + i for a, i in zip(at, x)))] = found
    return out


@examples(75)
@given(list_axis_cases(), meshes(), st.data())
def test_plans_place_every_element_where_the_blocks_say(case, mesh, data):
    rules = remapdsl.language.rules_from_text(case.text)
    with tempfile.TemporaryDirectory() as tmp:
        save_file(case.sources, str(Path(tmp) / "model.safetensors"))
        inventory = remapdsl.open_checkpoint(tmp)
    compiled = remapdsl.compile_rules(rules, inventory, {})
    layout = LayoutPlan.from_mapping(
        {d.runtime_key: _placements(data.draw, mesh, len(d.shape)) for d in compiled.runtime_tensors},
        mesh_dim=mesh.names[0])
    note(f"{case.text}\nmesh {mesh.sizes}: {layout}")
    for rank in range(mesh.size):
        held = held_by_layout(compiled, layout, mesh, rank)
        plan = make_load_plan(compiled, inventory, held, rank)
        assert _placed(plan.items, inventory) == _expected(compiled, inventory, held)
        assert plan.bytes_read == plan.bytes_owned  # layout and value ops only: amplification 1.00
    try:
        chosen = writers(compiled)
    except RemapError:
        return  # a chain the save refuses: tests/test_save_properties.py checks which
    whole = {d.runtime_key: whole_shard(d.shape) for d in compiled.runtime_tensors}
    plan = make_write_plan(chosen, inventory, whole)
    placed = _placed(plan.items, inventory)
    targets = sorted(placed.values())
    assert len(targets) == len(set(targets))  # every checkpoint byte has one writer
    assert plan.bytes_written == sum(t.nbytes for t in inventory.tensors.values())
    expected = _expected(compiled, inventory, whole)
    assert all(expected[k] == v for k, v in placed.items())


progressions = st.tuples(st.integers(0, 40), st.integers(0, 8), st.integers(1, 7))


@examples(500)
@given(st.lists(st.tuples(progressions, progressions), min_size=1, max_size=3))
def test_box_overlap_counts_the_shared_elements(dims):
    """The save's coverage bookkeeping (strided boxes, overlaps by the Chinese remainder theorem)
    against the two boxes' elements listed."""
    def listed(box):
        return set(itertools.product(*({f + i * s for i in range(n)} for f, n, s in box)))

    a, b = tuple(p for p, _ in dims), tuple(q for _, q in dims)
    assert box_overlap(a, b) == len(listed(a) & listed(b))
    assert box_volume(a) == len(listed(a))
