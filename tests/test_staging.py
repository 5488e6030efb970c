"""The staging ring that bytes bound for a device pass through, on the CPU with pinning off.

The ring's bookkeeping is checked with events that finish only when waited on (as a CUDA event of a
copy still running): never more than its bound allocated, every destination byte written once,
nothing in flight after a failure. Loads routed through it (`Staging(everything=True)`) must fill
exactly what the direct reads fill: row and column shards, value steps, dequantized FP8.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint
from depth import scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import remapdsl
from remapdsl.language import rules_from_text
from remapdsl.runtime import read
from remapdsl.runtime.read import run_load_plan
from remapdsl.runtime.staging import Rings, Staging, StagingRing, run_pieces, tensor_pieces
from remapdsl.sharding import LayoutPlan, Mesh, Shard, layout_for, local_shard, read_layout

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-qwen3-moe"
RULES = str(ROOT / "rules" / "qwen3_moe.remap")


class Pending:
    """An event of a copy that finishes only when waited on; every one made is kept."""

    made: list[Pending] = []

    def __init__(self, device):
        self.done = False
        Pending.made.append(self)

    def synchronize(self) -> None:
        self.done = True

    def query(self) -> bool:
        return self.done


@pytest.fixture
def pending():
    Pending.made = []
    return Pending


def _pieces(source: torch.Tensor, sizes: list[int], written: list[tuple[int, int]], fail_at: int | None = None):
    at = 0
    for k, n in enumerate(sizes):
        def fill(buffer, at=at, n=n, k=k):
            if k == fail_at:
                raise OSError("the read failed")
            buffer.copy_(source[at:at + n])
            written.append((at, n))
        yield n, fill
        at += n


def test_the_ring_never_allocates_past_its_bound_and_writes_every_byte_once(pending):
    source = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    destination = torch.zeros(1000, dtype=torch.uint8)
    written: list[tuple[int, int]] = []
    ring = StagingRing(Staging(buffer_bytes=64, buffers=3, pin=False), event=pending)
    sizes = [64, 1, 63, 64, 17] + [64] * 12 + [23]
    seen = []  # (allocated, in flight) as each piece is filled

    def watched():
        for n, fill in _pieces(source, sizes, written):
            yield n, lambda buffer, fill=fill: (seen.append((ring.allocated, ring.in_flight)), fill(buffer))

    ring.upload(destination, watched())
    ring.close()
    assert torch.equal(destination, source)
    assert sum(n for _, n in written) == 1000  # in order, each byte once
    assert all(a + n == b for (a, n), (b, _) in zip(written, written[1:]))
    assert max(a for a, _ in seen) <= 3 * 64 and ring.allocated == 3 * 64
    assert max(f for _, f in seen) == 2  # a third copy in flight only once a buffer's copy finished
    assert ring.in_flight == 0 and all(e.done for e in pending.made)
    assert len(pending.made) == len(sizes)  # one event a copy


def test_a_failure_mid_ring_leaves_no_copy_in_flight(pending):
    source = torch.randint(0, 256, (300,), dtype=torch.uint8)
    destination = torch.zeros(300, dtype=torch.uint8)
    written: list[tuple[int, int]] = []
    ring = StagingRing(Staging(buffer_bytes=50, buffers=2, pin=False), event=pending)
    with pytest.raises(OSError, match="the read failed"):
        try:
            ring.upload(destination, _pieces(source, [50] * 6, written, fail_at=4))
        finally:
            ring.close()
    assert ring.in_flight == 0 and len(pending.made) == 4 and all(e.done for e in pending.made)
    assert torch.equal(destination[:200], source[:200]) and written == [(0, 50), (50, 50), (100, 50), (150, 50)]
    ring.upload(destination, _pieces(source, [50] * 6, []))  # the ring is usable again, its buffers whole
    ring.close()
    assert torch.equal(destination, source) and ring.allocated == 100


def test_pieces_that_do_not_fill_the_destination_or_overflow_a_buffer_are_refused():
    ring = StagingRing(Staging(buffer_bytes=8, buffers=1, pin=False))
    with pytest.raises(ValueError, match="does not fit a 8-byte buffer"):
        ring.upload(torch.zeros(9, dtype=torch.uint8), tensor_pieces(torch.zeros(9, dtype=torch.uint8), 9))
    with pytest.raises(ValueError, match="the pieces hold 8 bytes, the destination 9"):
        ring.upload(torch.zeros(9, dtype=torch.uint8), tensor_pieces(torch.zeros(8, dtype=torch.uint8), 8))
    with pytest.raises(ValueError, match="at least one buffer"):
        StagingRing(Staging(buffer_bytes=0))


@pytest.mark.parametrize("most", [1, 5, 12, 13, 30, 40, 1000])
def test_run_pieces_cover_a_run_set_in_order_whatever_the_buffer(tmp_path, most):
    from remapdsl.checkpoint import CheckpointReader
    from remapdsl.indexmap import Runs

    data = torch.arange(600, dtype=torch.int16).reshape(20, 30)
    save_file({"x": data}, str(tmp_path / "model.safetensors"))
    inventory = remapdsl.open_checkpoint(tmp_path)
    info = inventory.tensors["x"]
    file, start = info.file, info.byte_offset
    runs = Runs(start + 2 * 4, 12, (20,), (60,))  # columns 4..9 of every row: 20 runs of 12 bytes
    want = data[:, 4:10].contiguous().view(torch.uint8).reshape(-1)
    with CheckpointReader(inventory) as reader:
        pieces = list(run_pieces(file, runs, reader, most))
        got = torch.zeros(runs.total, dtype=torch.uint8)
        at = 0
        for n, fill in pieces:
            assert n <= most
            fill(got[at:at + n])
            at += n
    assert at == runs.total and torch.equal(got, want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("sharded", [False, True])
def test_loads_through_the_ring_fill_what_direct_reads_fill(threads, sharded):
    compiled = remapdsl.compile_rules(remapdsl.load_rules(RULES), TINY)
    inventory = remapdsl.open_checkpoint(TINY)
    layout, mesh = (read_layout(TINY.parent / "tp2_layout.json"), Mesh.of({"tp": 2})) if sharded else (None, None)
    rings = Rings(Staging(buffer_bytes=4096, buffers=2, pin=False, everything=True))
    for rank in (0, 1) if sharded else (0,):
        if sharded:
            plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)
            shapes = {d.runtime_key: local_shard(d.shape, mesh.sizes, layout_for(d.runtime_key, d.shape, layout, mesh),
                                                 mesh.coordinate(rank)).shape for d in compiled.runtime_tensors}
        else:
            from remapdsl.sharding.holdings import whole_shard
            from remapdsl.sharding.plans import make_load_plan

            plan = make_load_plan(compiled, inventory, {d.runtime_key: whole_shard(d.shape)
                                                        for d in compiled.runtime_tensors})
            shapes = {d.runtime_key: d.shape for d in compiled.runtime_tensors}
        dtypes = {d.runtime_key: getattr(torch, d.dtype) for d in compiled.runtime_tensors}
        direct = {k: torch.full(s, float("nan"), dtype=dtypes[k]) for k, s in shapes.items()}
        staged = {k: torch.full(s, float("nan"), dtype=dtypes[k]) for k, s in shapes.items()}
        run_load_plan(plan, inventory, direct, threads=threads)
        run_load_plan(plan, inventory, staged, threads=threads, rings=rings)
        assert all(torch.equal(staged[k], direct[k]) for k in direct)
    rings.close()
    assert 1 <= rings.count <= max(1, threads)  # one ring a reader thread, reused by the next plan's threads
    assert 0 < rings.allocated <= rings.staging.bound(threads)


def test_dequantized_fp8_and_value_steps_through_the_ring_equal_direct_reads(tmp_path):
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (40, 48), generator=g, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # no NaN codes: equal values compare equal
    tiny_checkpoint(tmp_path, {"q.weight": codes.view(torch.float8_e4m3fn),
                               "q.weight_scale_inv": torch.rand(3, 3, generator=g) + 0.5,
                               "n.weight": torch.randn(40, 48, generator=g)}, {})
    rules = rules_from_text("""remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[16, 16], to=bfloat16)
q.weight -> q | transpose(0, 1)
n.weight -> n | scale(2) | cast(bfloat16)
""", "t.remap")
    inventory = remapdsl.open_checkpoint(tmp_path)
    compiled = remapdsl.compile_rules(rules, inventory, {})
    mesh = Mesh.of({"tp": 2})
    layout = LayoutPlan.from_mapping({"q": [Shard(dim=1)], "n": [Shard(dim=1)]}, mesh_dim="tp")
    rings = Rings(Staging(buffer_bytes=100, buffers=2, pin=False, everything=True))
    for rank in (0, 1):
        plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)
        shapes = {d.runtime_key: local_shard(d.shape, mesh.sizes, layout_for(d.runtime_key, d.shape, layout, mesh),
                                             mesh.coordinate(rank)).shape for d in compiled.runtime_tensors}
        direct = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
        staged = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
        run_load_plan(plan, inventory, direct)
        run_load_plan(plan, inventory, staged, rings=rings)
        assert plan.decodes and all(torch.equal(staged[k], direct[k]) for k in direct)
    rings.close()
    assert 0 < rings.allocated <= rings.staging.bound(2)


def test_device_tensors_never_take_the_direct_memory_path():
    """Addresses into tensor memory are only ever worked out for contiguous CPU tensors not staged."""
    tensor = torch.zeros(4, 4)
    assert read._memory(tensor, staged=False).address == tensor.data_ptr()
    assert read._memory(tensor, staged=True).address is None
    assert read._memory(tensor.t(), staged=False).address is None


@pytest.fixture(scope="module")
def staged_calls(tmp_path_factory) -> dict:
    """The calls that take `staging_bytes=`: those that fill tensors."""
    from test_process_groups import entry_points

    calls = entry_points(tmp_path_factory.mktemp("out"))
    return {name: calls[name] for name in ("load", "ingest", "prepared.load", "prepared.ingest", "RuleStorageReader")}


@pytest.mark.parametrize("staging_bytes", [0, 1000, 4.5e6, True, "256MB"])
def test_every_filling_call_refuses_a_staging_bound_too_small_or_not_a_whole_number(staging_bytes, staged_calls):
    from test_process_groups import each_refuses

    each_refuses(staged_calls, {"staging_bytes": staging_bytes}, f"staging_bytes={staging_bytes!r} is not a whole "
                 "number of bytes of at least 4 kB (two staging buffers of at least 1 kB for each of 2 reader threads)",
                 "the default is 16 MiB: the most host memory a call pins to copy bytes to a device")



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: loads into CUDA tensors")
def test_cuda_destinations_through_pinned_staging_equal_cpu_loads():
    """CUDA shards of the bundled example under its tp=2 layout (row and column shards of stacked,
    fused experts) through pinned 4 kB buffers: each equals the CPU load, within the bound."""
    compiled = remapdsl.compile_rules(remapdsl.load_rules(RULES), TINY)
    inventory = remapdsl.open_checkpoint(TINY)
    layout, mesh = read_layout(TINY.parent / "tp2_layout.json"), Mesh.of({"tp": 2})
    for rank in (0, 1):
        plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)
        shapes = {d.runtime_key: local_shard(d.shape, mesh.sizes, layout_for(d.runtime_key, d.shape, layout, mesh),
                                             mesh.coordinate(rank)).shape for d in compiled.runtime_tensors}
        dtypes = {d.runtime_key: getattr(torch, d.dtype) for d in compiled.runtime_tensors}
        on_cpu = {k: torch.zeros(s, dtype=dtypes[k]) for k, s in shapes.items()}
        on_cuda = {k: torch.zeros(s, dtype=dtypes[k], device="cuda") for k, s in shapes.items()}
        rings = Rings(Staging(buffer_bytes=4096, buffers=2))
        run_load_plan(plan, inventory, on_cpu)
        with rings:
            run_load_plan(plan, inventory, on_cuda, rings=rings)
        assert all(torch.equal(on_cuda[k].cpu(), on_cpu[k]) for k in on_cpu)
        assert 0 < rings.allocated <= rings.staging.bound(2)


@settings(max_examples=scaled(30), deadline=None)
@given(st.data())
def test_staged_loads_fill_any_destination_layout_as_direct_reads_do(data):
    """Through the ring (as for a device tensor), whatever a destination's memory layout (transposed,
    sliced, strided) and whatever the rule does (as it is, transposed, cast, scaled, cut by a slice): the
    destination holds what a direct read into a contiguous tensor holds, and the memory around it is
    untouched."""
    import tempfile

    from remapdsl.sharding.holdings import whole_shard
    from remapdsl.sharding.plans import make_load_plan
    from remapdsl.testing.strategies import memory_layouts

    op = data.draw(st.sampled_from(["", " | transpose(0, 1)", " | cast(bfloat16)", " | scale(2)",
                                    " | slice(dim=1, start=1, stop=5)"]))
    rows, cols = data.draw(st.integers(1, 9)), data.draw(st.integers(5, 9))
    with tempfile.TemporaryDirectory() as folder:
        tiny_checkpoint(folder, {"w": torch.randn(rows, cols)}, {})
        inventory = remapdsl.open_checkpoint(folder)
        compiled = remapdsl.compile_rules(rules_from_text(f"remap 1\nw -> w{op}\n", "t.remap"), inventory, {})
        (d,) = compiled.runtime_tensors
        plan = make_load_plan(compiled, inventory, {"w": whole_shard(d.shape)})
        direct = torch.full(d.shape, float("nan"), dtype=getattr(torch, d.dtype))
        run_load_plan(plan, inventory, {"w": direct})
        held = data.draw(memory_layouts(d.shape, getattr(torch, d.dtype)))
        rings = Rings(Staging(buffer_bytes=data.draw(st.sampled_from([64, 4096])), buffers=2, pin=False,
                              everything=True))
        run_load_plan(plan, inventory, {"w": held.tensor}, rings=rings)
        rings.close()
    assert torch.equal(held.tensor, direct), held.how
    assert held.outside().isnan().all(), held.how
