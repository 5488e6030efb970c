"""The export's schedule (remapdsl/drivers/export.py's `_schedule`), asserted on what it decides: who assembles
each checkpoint tensor and in which round, drawn over writers, piece sizes and buckets. In a round no rank has
more than the bucket in flight (an owner: the tensor and the pieces it receives; every other writer: the
pieces it sends), unless one tensor alone is over it; every tensor has one owner among its writers."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from remapdsl.drivers.export import _schedule


@st.composite
def exports(draw):
    """(everyone, out, bucket): per rank {key: (bytes it writes, coordinates)}, the checkpoint tensors' sizes."""
    world = draw(st.integers(1, 6))
    keys = [f"t{i}" for i in range(draw(st.integers(1, 12)))]
    everyone: list[dict] = [{} for _ in range(world)]
    sizes = {}
    for key in keys:
        holders = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
        parts = [draw(st.integers(0, 400)) for _ in holders]
        sizes[key] = sum(parts)
        for r, n in zip(holders, parts):
            if n:
                everyone[r][key] = (n, (("dp", r),))
    out = SimpleNamespace(tensors={k: SimpleNamespace(nbytes=n) for k, n in sizes.items()})
    empty = [k for k in keys if not any(k in part for part in everyone)]
    return everyone, out, draw(st.integers(1, 1200)), empty


@settings(max_examples=300, deadline=None)
@given(exports())
def test_no_rank_has_more_than_a_bucket_in_flight_in_a_round(case):
    everyone, out, bucket, empty = case
    schedule = _schedule(everyone, out, bucket, ("dp",) if any(everyone) else (), empty)
    assert set(schedule.owner) == set(out.tensors)
    flight: dict = defaultdict(int)
    tensors: dict = defaultdict(list)
    for key, o in schedule.owner.items():
        writers = [r for r, part in enumerate(everyone) if key in part]
        assert o in writers or (not writers and o == 0)
        t = schedule.round_of[key]
        assert 0 <= t < schedule.rounds
        nbytes = out.tensors[key].nbytes
        need = {o: 2 * nbytes - everyone[o].get(key, (0,))[0], **{r: everyone[r][key][0] for r in writers if r != o}}
        for r, n in need.items():
            flight[r, t] += n
            if n:
                tensors[r, t].append(key)
    for (r, t), n in flight.items():
        assert n <= bucket or len(tensors[r, t]) == 1, (r, t, n, tensors[r, t])  # alone over the bucket
