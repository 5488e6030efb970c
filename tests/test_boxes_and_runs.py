"""Boxes, blocks and byte runs (remapdsl/indexmap.py) against brute force: every function is checked
on small random blocks by listing the elements it describes, one by one, so that any change to its
arithmetic that a caller could see fails here, whatever the compiler happens to feed it today."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from remapdsl.indexmap import (
    Block,
    FirstDimIndex,
    Runs,
    block_runs,
    box_overlap,
    box_volume,
    column,
    common,
    cut,
    intersect,
    is_row_major,
    nbytes,
    row_major_strides,
    source_box,
    source_runs,
    volume,
)

FAST = settings(max_examples=150, deadline=None, derandomize=True)


def _points(offsets, sizes):
    return itertools.product(*(range(o, o + n) for o, n in zip(offsets, sizes)))


def _source(block: Block, x) -> tuple[int, ...]:
    return tuple(b + sum(c * (xi - o) for c, xi, o in zip(row, x, block.offsets))
                 for b, row in zip(block.base, block.coeff))


@st.composite
def blocks(draw, ndim=None, source_dims=None):
    ndim = draw(st.integers(1, 3)) if ndim is None else ndim
    source_dims = draw(st.integers(1, 3)) if source_dims is None else source_dims
    offsets = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    coeff = tuple(tuple(draw(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim))) for _ in range(source_dims))
    base = tuple(draw(st.lists(st.integers(0, 5), min_size=source_dims, max_size=source_dims)))
    return Block(offsets, sizes, "w", base, coeff, (("scale", 2.0),), None)


def _runs_units(runs: Runs) -> list[int]:
    return [s + i for s in runs.starts() for i in range(runs.length)]


# ---- small functions -----------------------------------------------------------------------------


def test_volumes_byte_counts_and_row_major_strides_of_shapes_with_empty_and_unit_dims():
    assert (volume((2, 3, 4)), volume(()), volume((3, 0))) == (24, 1, 0)
    assert (nbytes("bfloat16", (3, 5)), nbytes("float4_e2m1fn_x2", (4, 2)), nbytes("float32", ())) == (30, 4, 4)
    assert type(nbytes("bfloat16", (3, 5))) is int  # a byte count, never a float
    assert row_major_strides((2, 3, 4)) == [12, 4, 1] and row_major_strides((5,)) == [1]
    assert row_major_strides(()) == [] and row_major_strides((2, 0, 3)) == [0, 3, 1]


def test_is_row_major_ignores_dims_of_size_one_only():
    assert is_row_major([12, 4, 1], [2, 3, 4]) and is_row_major([99, 4, 1], [1, 3, 4])
    assert is_row_major([1, 7], [2, 1]) and is_row_major([], []) and not is_row_major([5, 1], [2, 1])
    assert not is_row_major([4, 1], [2, 3]) and not is_row_major([3, 2], [2, 3]) and not is_row_major([1, 3], [3, 2])


def test_intersect_rebases_a_block_cut_on_every_dim():
    b = Block((0, 0), (4, 4), "w", (1, 2), ((1, 0), (0, 3)))
    assert intersect(b, (2, 1), (2, 2)) == Block((2, 1), (2, 2), "w", (3, 5), ((1, 0), (0, 3)))
    assert intersect(b, (0, 1), (9, 9)) == Block((0, 1), (4, 3), "w", (1, 5), ((1, 0), (0, 3)))
    assert intersect(Block((0,), (4,), "w", (0,), ((2,),)), (2,), (2,)) == Block((2,), (2,), "w", (4,), ((2,),))
    fill = Block((0,), (4,), None, (), (), (), 0.5)
    assert intersect(fill, (1,), (2,)) == Block((1,), (2,), None, (), (), (), 0.5)
    assert intersect(b, (4, 0), (1, 4)) is None and intersect(b, (0, 0), (0, 4)) is None


def test_column_and_the_rebased_cut_of_one_dim():
    b = Block((2, 0), (4, 3), "w", (1, 10), ((1, 0), (0, 2)))
    assert column(b, 0) == (1, 0) and column(b, 1) == (0, 2)
    assert cut(b, 0, 3, 5) == Block((3, 0), (2, 3), "w", (2, 10), ((1, 0), (0, 2)))
    assert cut(b, 1, 1, 9) == Block((2, 1), (4, 2), "w", (1, 12), ((1, 0), (0, 2)))
    assert cut(b, 0, 6, 9) is None and cut(b, 0, 0, 2) is None and cut(b, 0, 0, 9) == b


def _assert_the_same_map(piece, block, inside: list, fill: bool) -> None:
    """`piece` covers exactly the points `inside` and maps each as `block` did (a fill keeps no base)."""
    assert sorted(_points(piece.offsets, piece.sizes)) == inside
    assert (piece.source_key, piece.coeff, piece.steps, piece.fill) == (block.source_key, block.coeff, block.steps,
                                                                         block.fill)
    if fill:
        assert piece.base == ()
    else:
        assert all(_source(piece, x) == _source(block, x) for x in inside)


@FAST
@given(blocks(), st.data())
def test_cut_keeps_exactly_the_part_inside_and_maps_it_as_before(block, data):
    fill = data.draw(st.booleans())
    if fill:
        block = Block(block.offsets, block.sizes, None, (), (), (), 0.5)
    dim = data.draw(st.integers(0, len(block.sizes) - 1))
    start = data.draw(st.integers(0, 9))
    stop = data.draw(st.integers(start, 10))
    piece = cut(block, dim, start, stop)
    inside = [x for x in _points(block.offsets, block.sizes) if start <= x[dim] < stop]
    if not inside:
        assert piece is None
        return
    _assert_the_same_map(piece, block, inside, fill)


@FAST
@given(blocks(), st.data())
def test_intersect_keeps_exactly_the_part_inside_the_box_and_maps_it_as_before(block, data):
    fill = data.draw(st.booleans())
    if fill:
        block = Block(block.offsets, block.sizes, None, (), (), (), 0.5)
    # a box near the block: before, across, inside or past it along each dim
    offsets = tuple(max(0, o + data.draw(st.integers(-2, n))) for o, n in zip(block.offsets, block.sizes))
    sizes = tuple(data.draw(st.integers(0, 5)) for _ in block.sizes)
    piece = intersect(block, offsets, sizes)
    box = set(_points(offsets, sizes))
    inside = [x for x in _points(block.offsets, block.sizes) if x in box]
    if not inside:
        assert piece is None
        return
    _assert_the_same_map(piece, block, inside, fill)
    assert intersect(block, block.offsets, block.sizes) is block


# ---- runs ----------------------------------------------------------------------------------------


def test_runs_count_total_end_starts_and_bytes():
    r = Runs(5, 2, (3, 2), (10, 3))
    assert (r.count, r.total, r.end) == (6, 12, 5 + 2 + 20 + 3)
    assert r.starts() == [5, 8, 15, 18, 25, 28]
    assert Runs(7, 4).starts() == [7] and (Runs(7, 4).count, Runs(7, 4).total, Runs(7, 4).end) == (1, 4, 11)
    empty = Runs(7, 4, (0,), (0,))
    assert (empty.count, empty.total, empty.end, empty.starts()) == (0, 0, 7, [])
    assert r.in_bytes(100, 4) == Runs(120, 8, (3, 2), (40, 12))


@FAST
@given(st.integers(0, 9), st.integers(1, 3), st.lists(st.tuples(st.integers(0, 4), st.integers(1, 20)), max_size=3),
       st.integers(1, 12))
def test_chunks_are_the_runs_in_order_at_most_most_a_chunk(first, length, dims, most):
    runs = Runs(first, length, tuple(n for n, _ in dims), tuple(t for _, t in dims))
    chunks = list(runs.chunks(most))
    assert [s for c in chunks for s in c.starts()] == runs.starts()
    assert all(c.length == length for c in chunks)
    if runs.count > most:
        assert all(c.count <= most for c in chunks)
    elif runs.count:
        assert chunks == [runs]
    if runs.count:
        assert runs.end == max(runs.starts()) + length


def test_chunks_keep_inner_dims_whole_and_cut_the_next_one():
    r = Runs(0, 1, (2, 3, 4), (100, 10, 1))
    assert list(r.chunks(24)) == [r]
    assert list(r.chunks(12)) == [Runs(0, 1, (1, 3, 4), (100, 10, 1)), Runs(100, 1, (1, 3, 4), (100, 10, 1))]
    assert list(r.chunks(8)) == [Runs(0, 1, (2, 4), (10, 1)), Runs(20, 1, (1, 4), (10, 1)),
                                 Runs(100, 1, (2, 4), (10, 1)), Runs(120, 1, (1, 4), (10, 1))]
    assert list(Runs(3, 2, (5,), (7,)).chunks(2)) == [Runs(3, 2, (2,), (7,)), Runs(17, 2, (2,), (7,)),
                                                      Runs(31, 2, (1,), (7,))]


@FAST
@given(st.integers(0, 5), st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3)), min_size=1, max_size=4))
def test_source_runs_list_the_block_elements_and_stride_into_them(start, dims):
    flat = [t for t, _ in dims]
    sizes = tuple(n for _, n in dims)
    runs, strides = source_runs(start, flat, sizes)
    units = _runs_units(runs)
    assert len(units) == volume(sizes) == runs.total
    for x in itertools.product(*(range(n) for n in sizes)):
        assert units[sum(s * i for s, i in zip(strides, x))] == start + sum(t * i for t, i in zip(flat, x))
    if len(set(units)) == len(units):  # a map that reads each element once: the runs ascend
        assert units == sorted(units)


def test_source_runs_refuse_a_reversed_dim():
    with pytest.raises(NotImplementedError, match="^negative source strides$"):
        source_runs(5, [1, -4], (4, 2))


def test_source_runs_merge_contiguous_dims_into_one_run():
    assert source_runs(3, [4, 1], (2, 4)) == (Runs(3, 8, (), ()), (4, 1))
    assert source_runs(0, [8, 1], (3, 2)) == (Runs(0, 2, (3,), (8,)), (2, 1))
    assert source_runs(0, [1, 10, 30], (4, 3, 2)) == (Runs(0, 4, (6,), (10,)), (1, 4, 12))
    assert source_runs(0, [5, 0], (2, 1)) == (Runs(0, 1, (2,), (5,)), (1, 0))
    assert source_runs(9, [1], (0,)) == (Runs(9, 1, (0,), (0,)), (0,))


@FAST
@given(blocks(), st.integers(0, 64), st.sampled_from([1, 2, 4]))
def test_block_runs_are_the_bytes_of_the_elements_the_block_reads(block, byte_offset, itemsize):
    shape = tuple(b + 1 + sum(c * (n - 1) for c, n in zip(row, block.sizes)) for b, row in zip(block.base, block.coeff))
    runs, strides, flat = block_runs(block, shape, byte_offset, itemsize)
    major = row_major_strides(shape)
    assert flat == tuple(sum(m * row[j] for m, row in zip(major, block.coeff)) for j in range(len(block.sizes)))
    units = _runs_units(runs)
    assert len(units) == volume(block.sizes) * itemsize
    for x in _points(block.offsets, block.sizes):
        at = sum(s * (xi - o) for s, xi, o in zip(strides, x, block.offsets)) * itemsize
        element = sum(m * i for m, i in zip(major, _source(block, x)))
        assert units[at:at + itemsize] == list(range(byte_offset + element * itemsize,
                                                     byte_offset + (element + 1) * itemsize))


# ---- strided boxes -------------------------------------------------------------------------------


@st.composite
def box_blocks(draw):
    """Blocks whose map is one strided box: each source dim moved by its own runtime dims, the inner
    one by a step and the outer one (a split dim) by the step times the inner count."""
    source_dims = draw(st.integers(1, 3))
    sizes, columns = [], []
    for k in range(source_dims):
        step = draw(st.integers(1, 3))
        for n in draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)):
            sizes.append(n)
            columns.append((k, step))
            step *= n
    order = draw(st.permutations(range(len(sizes))))
    sizes = [sizes[j] for j in order]
    columns = [columns[j] for j in order]
    coeff = tuple(tuple(c if k == kk else 0 for kk, c in columns) for k in range(source_dims))
    base = tuple(draw(st.lists(st.integers(0, 4), min_size=source_dims, max_size=source_dims)))
    return Block(tuple([0] * len(sizes)), tuple(sizes), "w", base, coeff)


def _progression(p):
    first, count, step = p
    return {first + i * step for i in range(count)}


@FAST
@given(box_blocks())
def test_a_block_whose_map_is_a_box_gives_that_box(block):
    box = source_box(block, block.base)
    assert box is not None
    listed = {_source(block, x) for x in _points(block.offsets, block.sizes)}
    assert set(itertools.product(*(sorted(_progression(p)) for p in box))) == listed
    assert box_volume(box) == len(listed)


@FAST
@given(blocks())
def test_source_box_when_given_lists_exactly_the_elements_read(block):
    box = source_box(block, block.base)
    listed = [_source(block, x) for x in _points(block.offsets, block.sizes)]
    if box is not None:
        assert set(itertools.product(*(sorted(_progression(p)) for p in box))) == set(listed)
        assert box_volume(box) == len(listed) == len(set(listed))


def test_a_map_that_moves_dims_together_or_leaves_gaps_is_no_box_but_one_element_is():
    assert source_box(Block((0, 0), (2, 2), "w", (0,), ((1, 1),)), (4,)) is None  # two dims move one
    assert source_box(Block((0,), (2,), "w", (0, 0), ((1,), (1,))), (4, 4)) is None  # one dim moves two
    assert source_box(Block((0,), (3,), "w", (0,), ((0,),)), (4,)) is None  # a dim that moves nothing
    assert source_box(Block((0, 0), (2, 2), "w", (0,), ((1, 3),)), (8,)) is None  # a gap between them
    assert source_box(Block((0,), (1,), "w", (2, 3), ((5,), (7,))), (9, 9)) == ((2, 1, 1), (3, 1, 1))


@FAST
@given(st.tuples(st.integers(0, 12), st.integers(0, 6), st.integers(1, 5)),
       st.tuples(st.integers(0, 12), st.integers(0, 6), st.integers(1, 5)))
def test_common_counts_the_shared_indices_of_two_progressions(a, b):
    shared = common(a, b)
    assert shared == len(_progression(a) & _progression(b)) and type(shared) is int


@FAST
@given(st.lists(st.tuples(st.tuples(st.integers(0, 6), st.integers(0, 4), st.integers(1, 3)),
                          st.tuples(st.integers(0, 6), st.integers(0, 4), st.integers(1, 3))), min_size=1, max_size=3))
def test_box_overlap_counts_the_shared_elements_of_two_boxes(pairs):
    a, b = tuple(p for p, _ in pairs), tuple(q for _, q in pairs)
    expect = math.prod(len(_progression(p) & _progression(q)) for p, q in pairs)
    assert box_overlap(a, b) == expect


@FAST
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 6)), max_size=8), st.integers(0, 24), st.integers(1, 6))
@example([(0, 2), (10, 2), (5, 2), (15, 2)], 5, 1)  # out of order between neighbours only
def test_first_dim_index_finds_every_block_meeting_a_box_and_none_past_it(spans, start, size):
    blocks_ = [Block((o, 0), (n, 1), "w", (0,), ((1, 0),)) for o, n in spans]
    entries = [f"e{i}" for i in range(len(blocks_))]
    index = FirstDimIndex(entries, blocks_)
    found = index.meeting((start, 0), (size, 1))
    meets = {e for e, b in zip(entries, blocks_) if b.offsets[0] < start + size and start < b.offsets[0] + b.sizes[0]}
    assert meets <= set(found)
    reach = max((n for _, n in spans), default=0)
    by_entry = dict(zip(entries, blocks_))
    assert all(start - reach < by_entry[e].offsets[0] < start + size for e in found)
    assert [by_entry[e].offsets[0] for e in found] == sorted(by_entry[e].offsets[0] for e in found)
