"""DCP-sharded checkpoints whose chunks are not grids: any tiling a save's ranks may have written.

`remapdsl.testing.strategies.chunk_tilings` draws how each tensor was cut (grids; staircases, whose
bands are cut each at its own places, so no chunk edge runs across the tensor; guillotine cuts of
any rank; zero-size chunks), `write_dcp_sharded` writes them as torch's
`HuggingFaceStorageWriter(save_distributed=True)` does. Every check is against plain torch on the
whole tensors: loads through rules that transpose and fuse, `dcp.load` through the rule reader with
several requests for one key, a save `like` such a folder with the dropped tensors copied, each
rank's plan reading only its own bytes; and, where the chunks do not tile, the element the E350
message names (found from a coverage mask) and the two boxes E351 names.
"""

from __future__ import annotations

import random
import re
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from depth import scaled
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import remapdsl
from remapdsl.checkpoint import open_inventory
from remapdsl.language import rules_from_text
from remapdsl.sharding import LayoutPlan
from remapdsl.testing.data import write_dcp_sharded
from remapdsl.testing.strategies import Held, chunk_tilings, memory_layouts, meshes, placements

# x is dropped; w transposed; u.p and u.q fused by rows; v (3-d) as it is
RULES = rules_from_text("remap 1\ndrop x\nw -> a\n    | transpose(0, 1)\nu.{p,q} -> f\n    | concat(dim=0)\n"
                        "v -> v\n", "tilings.remap")
dims = st.integers(1, 9)


def examples(n: int) -> settings:
    return settings(max_examples=scaled(n), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tiled_checkpoints(draw) -> tuple[dict, dict]:
    """Whole tensors of random shapes and values, and a drawn tiling of each."""
    r, c, r2 = draw(dims), draw(dims), draw(dims)
    shapes = {"w": (r, c), "u.p": (r2, c), "u.q": (r2, c), "v": (draw(dims), 3, 2), "x": (draw(dims), 2)}
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(s, generator=generator) for k, s in shapes.items()}
    tilings = {k: draw(chunk_tilings(s, max_chunks=12)) for k, s in shapes.items()}
    note({k: (t.kind, t.boxes) for k, t in tilings.items()})
    return tensors, tilings


def expected(tensors: dict) -> dict:
    """What the rules make, in plain torch."""
    return {"a": tensors["w"].t(), "f": torch.cat([tensors["u.p"], tensors["u.q"]]), "v": tensors["v"]}


@examples(20)
@given(tiled_checkpoints(), st.data())
def test_any_tiling_loads_the_whole_tensors_into_any_memory_layout(tiled, data):
    """Loaded whole, into destinations of drawn strides: plain torch's tensors, each byte read once."""
    tensors, tilings = tiled
    want = expected(tensors)
    with tempfile.TemporaryDirectory() as tmp:
        write_dcp_sharded(tensors, tmp, tilings)
        inventory = open_inventory(tmp)
        assert {k for k, t in tilings.items() if sum(1 for _, s in t.boxes if all(s)) > 1} <= set(inventory.chunks)
        held = {k: data.draw(memory_layouts(t.shape), label=k) for k, t in want.items()}
        report = remapdsl.load({k: h.tensor for k, h in held.items()}, tmp, RULES, config={})
    for key, h in held.items():
        assert torch.equal(h.tensor, want[key]), key
        assert h.outside().isnan().all(), key  # nothing written outside the view
    assert report.bytes_read == sum(t.nbytes for k, t in tensors.items() if k != "x")


@examples(15)
@given(tiled_checkpoints(), meshes(max_ranks=4, max_dims=2), st.data())
def test_each_rank_of_any_mesh_reads_only_its_bytes_across_any_tiling(tiled, mesh, data):
    """Every rank's plan (`plan_rank`) reads exactly the bytes behind the elements it holds, however
    the chunks cut the tensors and its shard (pieces cut at every chunk edge they cross, no more)."""
    tensors, tilings = tiled
    with tempfile.TemporaryDirectory() as tmp:
        write_dcp_sharded(tensors, tmp, tilings)
        inventory = open_inventory(tmp)
        compiled = remapdsl.compile_rules(RULES, inventory, {})
        layout = LayoutPlan.from_mapping({t.runtime_key: list(data.draw(placements(t.shape, mesh)))
                                          for t in compiled.runtime_tensors}, mesh_dim=mesh.names[0])
        for rank in range(mesh.size):
            plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank, config={})
            assert plan.bytes_read == plan.bytes_owned, (rank, plan.bytes_read, plan.bytes_owned)


class SplitPlanner:
    """DCP's default planner, but every request it makes cut in up to three pieces along a dim chosen
    by `rng`, in shuffled order: several requests for one key in one plan, as a ShardedTensor with
    several local shards makes them."""

    def __new__(cls, rng):
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint.planner import ReadItem

        class Planner(DefaultLoadPlanner):
            def create_local_plan(self):
                plan = super().create_local_plan()
                items = []
                for item in plan.items:
                    lengths = list(item.lengths)
                    d = rng.choice([k for k, n in enumerate(lengths) if n > 1] or [0])
                    cuts = sorted(rng.sample(range(1, lengths[d]), rng.randint(1, 2))) if lengths[d] > 2 else \
                        [1] if lengths[d] == 2 else []
                    for a, b in zip([0, *cuts], [*cuts, lengths[d]]):
                        def at(values, by=a, d=d):
                            return torch.Size([v + by if k == d else v for k, v in enumerate(values)])
                        items.append(ReadItem(item.type, item.dest_index, at(item.dest_offsets), item.storage_index,
                                              at(item.storage_offsets),
                                              torch.Size([b - a if k == d else n for k, n in enumerate(lengths)])))
                rng.shuffle(items)
                return plan.__class__(items, plan.storage_data, plan.planner_data)

        return Planner()


@examples(15)
@given(tiled_checkpoints(), st.data())
def test_dcp_load_with_several_requests_for_one_key_fills_each_piece(tiled, data):
    """`dcp.load` through `RuleStorageReader` with a planner asking for each tensor in up to three
    pieces, in any order, into destinations of drawn strides: plain torch's tensors, each byte once."""
    import torch.distributed.checkpoint as dcp

    from remapdsl.dcp import RuleStorageReader

    tensors, tilings = tiled
    want = expected(tensors)
    with tempfile.TemporaryDirectory() as tmp:
        write_dcp_sharded(tensors, tmp, tilings)
        held: dict[str, Held] = {k: data.draw(memory_layouts(t.shape), label=k) for k, t in want.items()}
        state = {k: h.tensor for k, h in held.items()}
        reader = RuleStorageReader(tmp, RULES, config={})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader, planner=SplitPlanner(random.Random(data.draw(st.integers(0, 2**32)))))
    for key, h in held.items():
        assert torch.equal(h.tensor, want[key]), key
        assert h.outside().isnan().all(), key
    assert reader.report.tensors == len(want) and reader.report.requests > len(want)
    assert reader.report.bytes_read == reader.report.bytes_owned == sum(t.nbytes for t in want.values())


@examples(15)
@given(tiled_checkpoints())
def test_a_save_like_a_tiled_folder_copies_the_dropped_chunks_and_writes_the_same_files(tiled):
    """dropped="copy" from a DCP-sharded `like`: the dropped tensor's chunks are copied where they are,
    the rest written into the chunks they came from: the same files, byte for byte. dropped="error"
    refuses the save (E501), and "omit" cannot lay chunk files out anew (E524; where no key is in
    chunks, it writes the files without `x`)."""
    tensors, tilings = tiled
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_dcp_sharded(tensors, Path(tmp) / "in", tilings)
        state = {k: v.contiguous() for k, v in expected(tensors).items()}
        report = remapdsl.save(state, Path(tmp) / "out", RULES, like=folder, config={}, dropped="copy")
        files = sorted(p.name for p in folder.iterdir())
        assert sorted(p.name for p in (Path(tmp) / "out").iterdir()) == files
        for name in files:
            assert (Path(tmp) / "out" / name).read_bytes() == (folder / name).read_bytes(), name
        assert report.bytes_copied == tensors["x"].nbytes
        chunked = bool(open_inventory(folder).chunks)
        for dropped, code in (("error", "E501"), ("omit", "E524" if chunked else None)):
            if code is None:  # no key in chunks: the files are laid out anew, without `x`
                remapdsl.save(state, Path(tmp) / dropped, RULES, like=folder, config={}, dropped=dropped)
                assert "x" not in open_inventory(Path(tmp) / dropped).tensors
                continue
            with pytest.raises(remapdsl.RemapError) as info:
                remapdsl.save(state, Path(tmp) / dropped, RULES, like=folder, config={}, dropped=dropped)
            d = info.value.diagnostics[0]
            assert d.code == code and "`x`" in d.message
            if code == "E524":
                assert d.message == 'dropped="omit" would leave out 1 tensor(s), starting with `x`, and lay their ' \
                    "files out anew, but `like` is a DCP checkpoint (its tensors stored in chunks)"


# -- chunks that do not tile --------------------------------------------------------------------------


def _expected_gap(tiling) -> tuple[tuple[int, ...], torch.Tensor]:
    """The shape the chunks give (where they end, zero-size ones included) and which of its elements
    they cover, in plain torch."""
    ndim = len(tiling.shape)
    shape = tuple(max(o[k] + s[k] for o, s in tiling.boxes) for k in range(ndim))
    covered = torch.zeros(shape, dtype=torch.bool)
    for o, s in tiling.boxes:
        covered[tuple(slice(a, a + n) for a, n in zip(o, s))] = True
    return shape, covered


@examples(40)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=3).flatmap(
    lambda shape: chunk_tilings(shape, max_chunks=10, gaps=True)))
def test_a_gap_is_named_at_the_first_element_no_chunk_holds(tiling):
    """Chunks taken out of a tiling: where the others still tile where they end, the tensor opens at
    that shape with their values; else E350 says how many elements are covered and names the first
    element no chunk holds (its dim-0 index where no chunk touches that slab), wherever it lies."""
    note(tiling)
    tensor = torch.randn(tiling.shape)
    shape, covered = _expected_gap(tiling)
    with tempfile.TemporaryDirectory() as tmp:
        write_dcp_sharded({"g": tensor}, tmp, {"g": tiling})
        if bool(covered.all()):
            inventory = open_inventory(tmp)
            assert inventory.tensors["g"].shape == shape
            state = {"g": torch.full(shape, float("nan"))}
            remapdsl.load(state, tmp, rules_from_text("remap 1\ng -> g\n"), config={})
            assert torch.equal(state["g"], tensor[tuple(slice(0, n) for n in shape)])
            return
        with pytest.raises(remapdsl.RemapError) as info:
            open_inventory(tmp)
        files = sorted(p.name for p in Path(tmp).glob("*.safetensors"))  # each holds a chunk of `g`
    (d,) = info.value.diagnostics
    first = tuple(int(i) for i in torch.unravel_index((~covered).flatten().nonzero()[0, 0], shape))
    where = f"dim-0 index {first[0]}" if not covered[first[0]].any() else f"element {list(first)}"
    listed = ", ".join(files[:6]) + (" …" if len(files) > 6 else "")  # six files, then an ellipsis
    assert (d.code, d.message, d.hint) == (
        "E350", f"tensor `g` {list(shape)}: its chunks in {listed} cover {int(covered.sum())} of its "
        f"{covered.numel()} elements: a gap (no chunk holds {where})",
        "a rank's shard file is missing, or it was written by another save"), d
    assert Path(d.path).parent == Path(tmp) and Path(d.path).name in files, d.path


_BOX = re.compile(r"\[([0-9:, ]+)\] in (\S+)")


@examples(30)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=3).flatmap(
    lambda shape: st.tuples(chunk_tilings(shape, max_chunks=10, empty=False), st.data())))
def test_an_overlap_names_two_chunks_that_share_elements(drawn):
    """One more chunk, anywhere inside the tensor, over an exact tiling: E351 names two chunks, by
    box and file, that are both there and share an element."""
    tiling, data = drawn
    offsets = [data.draw(st.integers(0, n - 1)) for n in tiling.shape]
    sizes = tuple(data.draw(st.integers(1, n - o)) for o, n in zip(offsets, tiling.shape))
    boxes = (*tiling.boxes, (tuple(offsets), sizes))
    with tempfile.TemporaryDirectory() as tmp:
        write_dcp_sharded({"g": torch.randn(tiling.shape)}, tmp, {"g": boxes})
        with pytest.raises(remapdsl.RemapError) as info:
            open_inventory(tmp)
        (d,) = info.value.diagnostics
        assert d.code == "E351" and d.message.startswith("tensor `g`: chunks overlap: "), d
        assert d.hint == "each element of a tensor must be saved by exactly one rank", d
        assert Path(d.path).parent == Path(tmp) and Path(d.path).name == _BOX.findall(d.message)[1][1], d.path
        named = []
        for spans, file in _BOX.findall(d.message):
            box = tuple(tuple(int(x) for x in span.split(":")) for span in spans.split(", "))
            index = int(file.split("-")[1]) - 1  # write_dcp_sharded: box i in file i + 1
            assert boxes[index] == (tuple(a for a, _ in box), tuple(b - a for a, b in box)), (box, file)
            named.append(box)
        assert len(named) == 2
        assert all(max(a[0], b[0]) < min(a[1], b[1]) for a, b in zip(*named)), named


def test_the_kinds_of_tiling_include_ones_no_grid_describes():
    """The strategy's staircases and guillotine cuts reach tilings whose chunk edges make far more
    grid cells than chunks: the reader's scan, not its grid, cuts pieces there (checked above)."""
    from remapdsl.checkpoint.chunks import Chunk, ChunkTable

    seen = set()

    @settings(max_examples=60, deadline=None, database=None)
    @given(chunk_tilings((16, 18), max_chunks=40, kinds=["staircase"], empty=False))
    def draw(tiling):
        seen.add(ChunkTable(sorted(Chunk("f", 0, o, s) for o, s in tiling.boxes)).grid is None)

    draw()
    assert seen == {True, False}
    tensors = {"w": torch.randn(16, 18)}
    rows = [(i, i + 1) for i in range(16)]  # 16 bands of one row, each cut at another column
    boxes = [((a, 0), (1, 1 + a)) for a, _ in rows] + [((a, 1 + a), (1, 17 - a)) for a, _ in rows]
    with tempfile.TemporaryDirectory() as tmp:
        write_dcp_sharded(tensors, tmp, {"w": boxes})
        assert open_inventory(tmp).chunks["w"].grid is None
        state = {"a": torch.full((18, 16), float("nan"))}
        remapdsl.load(state, tmp, rules_from_text("remap 1\nw -> a\n    | transpose(0, 1)\n"), config={})
    assert torch.equal(state["a"], tensors["w"].t())


def test_an_omitting_save_like_a_dcp_folder_of_whole_tensors_opens(tmp_path):
    """A DCP folder in which every key lies whole in one file (one rank, or every tensor replicated)
    is laid out anew by dropped="omit": the omitted tensor leaves the files' DCP_SHARDING_INFO too, so
    the output opens (it named a tensor no file held: E354) and loads what was saved."""
    tensors = {"w": torch.randn(3, 2), "u.p": torch.randn(2, 2), "u.q": torch.randn(2, 2), "v": torch.randn(1, 3, 2),
               "x": torch.randn(4, 2)}
    folder = write_dcp_sharded(tensors, tmp_path / "in", {})
    state = {k: v.contiguous() for k, v in expected(tensors).items()}
    remapdsl.save(state, tmp_path / "out", RULES, like=folder, config={}, dropped="omit")
    assert sorted(open_inventory(tmp_path / "out").tensors) == sorted(k for k in tensors if k != "x")
    again = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    remapdsl.load(again, tmp_path / "out", RULES, config={})
    assert all(torch.equal(again[k], v) for k, v in state.items())


def test_a_piece_over_elements_no_chunk_holds_is_e355_naming_them():
    """The planner's own check behind E350 (which `open_inventory` raises first, so no file reaches it):
    a piece whose elements lie in no chunk is E355 naming its source key and those elements, never a
    read of a wrong chunk."""
    from remapdsl.checkpoint.chunks import Chunk
    from remapdsl.indexmap import Block
    from remapdsl.sharding.chunked import split_by_chunks

    table = (Chunk("f", 0, (0,), (4,)), Chunk("f", 16, (6,), (2,)))  # rows 4 and 5 in no chunk
    piece = Block(offsets=(0,), sizes=(8,), source_key="w", base=(0,), coeff=((1,),))
    with pytest.raises(remapdsl.RemapError) as info:
        split_by_chunks(piece, table)
    (d,) = info.value.diagnostics
    assert (d.code, d.message) == ("E355", "`w`: elements [4]..[5] lie in 0 chunks, not one (the chunks do not "
                                           "tile the tensor)")
