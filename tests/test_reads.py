"""The read executor's units: file ranges cut into chunks and handed to reader threads as they are
worked out fill the same bytes as one thread reading whole ranges; an error on a thread is raised."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from depth import scaled
from hypothesis import given, settings
from hypothesis import strategies as st

import remapdsl
from remapdsl.checkpoint import reader as files
from remapdsl.errors import CheckpointError, Diagnostic
from remapdsl.runtime import read
from remapdsl.sharding import Mesh, read_layout
from remapdsl.sharding.holdings import held_by_layout

TINY = Path(__file__).resolve().parent.parent / "examples" / "tiny-qwen3-moe"
RULES = "qwen3_moe"


def loaded(layout=None, rank: int = 0) -> dict:
    """The tiny checkpoint loaded through the Qwen3-MoE rules: fused experts (a layer's experts read
    as one file range into many places), whole or as one tensor-parallel rank's shards."""
    compiled = remapdsl.compile_rules(remapdsl.load_rules(RULES), TINY)
    if layout is None:
        state = {k: torch.full_like(v, -1) for k, v in compiled.empty_state_dict().items()}
        remapdsl.load(state, str(TINY), RULES)
        return state
    mesh = Mesh.of({"tp": 2})
    held = held_by_layout(compiled, layout, mesh, rank)
    state = {k: torch.full(s.shape, -1, dtype=getattr(torch, compiled.runtime_tensor(k).dtype))
             for k, s in held.items()}
    remapdsl.load(state, str(TINY), RULES, layout=layout, mesh=mesh)
    return state


@pytest.mark.parametrize("chunk, iov_max", [(64, 1024), (4096, 3), (1 << 20, 2), (1 << 20, 1024)])
@pytest.mark.parametrize("sharded", [False, True])
def test_threads_and_small_chunks_fill_what_one_thread_fills(monkeypatch, chunk, iov_max, sharded):
    layout = read_layout(TINY.parent / "tp2_layout.json") if sharded else None
    expected = loaded(layout)
    units: list = []
    run = read._run_batch

    def recorded(unit, reader, rings):
        units.append(type(unit).__name__)
        return run(unit, reader, rings)

    monkeypatch.setattr(read, "_run_batch", recorded)
    monkeypatch.setattr(read, "SMALL_UNIT", 0)  # threads however small the items
    monkeypatch.setattr(read, "CHUNK", chunk)
    monkeypatch.setattr(files, "IOV_MAX", iov_max)
    got = loaded(layout)
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    assert "_Scatter" in units  # experts merged into one range, then cut
    if chunk == 64:
        assert len(units) > 100  # many chunks, handed out while later ones were worked out


def test_a_file_range_cut_where_chunks_end_keeps_its_places(monkeypatch):
    """A range that goes on past a whole chunk is cut there and the rest carried on: every byte of
    each place is read once, in file order, whatever the chunk and place limits."""
    monkeypatch.setattr(read, "CHUNK", 10)
    monkeypatch.setattr(files, "IOV_MAX", 3)
    merged = ["f", 100, 25, [(1000, 7), (2000, 18)]]
    out = list(read._cut(merged, whole=False))
    assert out == [read._Scatter("f", 100, ((1000, 7), (2000, 3))), read._Scatter("f", 110, ((2003, 10),))]
    assert merged == ["f", 120, 5, [(2013, 5)]]  # the rest, for the items that continue it
    merged[3].append((3000, 12))
    merged[2] += 12
    assert list(read._cut(merged)) == [read._Scatter("f", 120, ((2013, 5), (3000, 5))),
                                       read._Scatter("f", 130, ((3005, 7),))]
    assert list(read._cut(["f", 0, 4, [(50, 4)]])) == [read._Scatter("f", 0, ((50, 4),))]  # one read call


def test_an_error_on_a_reader_thread_is_raised_and_the_other_units_stop(monkeypatch):
    monkeypatch.setattr(read, "SMALL_UNIT", 0)
    monkeypatch.setattr(read, "CHUNK", 4096)
    calls = []
    run = read._run_batch

    def failing(unit, reader, rings):
        calls.append(unit)
        if len(calls) == 3:
            raise CheckpointError(Diagnostic(code="E343", message="a read failed"))  # as a failing read would
        return run(unit, reader, rings)

    monkeypatch.setattr(read, "_run_batch", failing)
    with pytest.raises(CheckpointError, match="a read failed"):
        loaded()
    units = sum(1 for _ in read._work(_plan().items, _tensors(), False))
    assert len(calls) < units  # the units after the error were only taken off the queue


def _plan():
    compiled = remapdsl.compile_rules(remapdsl.load_rules(RULES), TINY)
    from remapdsl.sharding.holdings import whole_shard
    from remapdsl.sharding.plans import make_load_plan

    held = {d.runtime_key: whole_shard(d.shape) for d in compiled.runtime_tensors}
    return make_load_plan(compiled, remapdsl.open_checkpoint(TINY), held)


def _tensors():
    compiled = remapdsl.compile_rules(remapdsl.load_rules(RULES), TINY)
    return compiled.empty_state_dict()


def test_readers_start_on_the_first_units_while_later_ones_are_worked_out(monkeypatch):
    monkeypatch.setattr(read, "SMALL_UNIT", 0)
    monkeypatch.setattr(read, "CHUNK", 4096)
    events = []
    work, run = read._work, read._run_batch

    def slow_work(items, tensors, staged):
        for unit in work(items, tensors, staged):
            events.append("worked out")
            yield unit
            time.sleep(0.01)  # the readers have time to take what was handed out

    def recorded(unit, reader, rings):
        events.append("read")
        return run(unit, reader, rings)

    monkeypatch.setattr(read, "_work", slow_work)
    monkeypatch.setattr(read, "_run_batch", recorded)
    expected_units = sum(1 for _ in work(_plan().items, _tensors(), False))
    loaded()
    assert events.count("read") == events.count("worked out") == expected_units > 3
    assert events.index("read") < len(events) - 1 - events[::-1].index("worked out")  # a read before the last unit


def test_an_error_while_units_are_worked_out_stops_the_readers_and_is_raised(monkeypatch):
    monkeypatch.setattr(read, "SMALL_UNIT", 0)
    monkeypatch.setattr(read, "CHUNK", 4096)
    work = read._work

    def failing_work(items, tensors, staged):
        for n, unit in enumerate(work(items, tensors, staged)):
            if n == 2:
                raise KeyError("a runtime tensor the plan names")
            yield unit

    monkeypatch.setattr(read, "_work", failing_work)
    with pytest.raises(KeyError, match="a runtime tensor the plan names"):
        loaded()  # and returns: the reader threads were told to stop


def test_small_units_run_on_the_calling_thread_and_large_ones_on_readers(monkeypatch):
    monkeypatch.setattr(read, "CHUNK", 4096)
    monkeypatch.setattr(read, "SMALL_UNIT", 4096)  # whole chunks go to readers, the ends of ranges not
    where = []
    run = read._run_batch

    def recorded(unit, reader, rings):
        where.append((not read._small(unit, rings), threading.current_thread() is threading.main_thread()))
        return run(unit, reader, rings)

    monkeypatch.setattr(read, "_run_batch", recorded)
    loaded()
    assert {on_main for large, on_main in where if large} == {False}
    assert {on_main for large, on_main in where if not large} == {True}


def _one_item_plan(change):
    """The plan of the bundled example's `model.norm.weight` alone (a direct read: one run into a
    contiguous CPU tensor), its item changed by `change`."""
    plan = _plan()
    (item,) = [i for i in plan.items if i.runtime_key == "model.norm.weight"]
    return plan.model_copy(update={"items": (change(item),), "decodes": ()}), item


E417_HINT = ("the plan does not fit the tensors it runs on: a defect of remapdsl; please report it with the rule file, "
             "the checkpoint's headers and the layout")


@pytest.mark.parametrize("case", ["offset past the end", "runs longer than the region", "offset before the start",
                                  "a fill past the end"])
def test_a_plan_item_outside_its_tensor_is_e417_naming_it_and_writes_nothing(case):
    """A read (or a pad's fill, which names no checkpoint tensor) whose region is not in its tensor: E417,
    whole, and the tensor unchanged."""
    from remapdsl.indexmap import Runs

    change, offsets, held = {
        "offset past the end": (lambda i: i._replace(local_offsets=(8,)), 8, "(64 bytes) as 64 bytes at byte 0"),
        "runs longer than the region": (lambda i: i._replace(runs=Runs(i.runs.first, i.runs.length + 4)), 0,
                                        "(64 bytes) as 68 bytes at byte 0"),
        "offset before the start": (lambda i: i._replace(local_offsets=(-4,)), -4, "(64 bytes) as 64 bytes at byte 0"),
        "a fill past the end": (lambda i: i._replace(ckpt_key=None, local_offsets=(8,)), 8, None),
    }[case]
    plan, _ = _one_item_plan(change)
    tensors = _tensors()
    tensors["model.norm.weight"] = torch.full((16,), 3.0)
    with pytest.raises(remapdsl.RemapError) as info:
        read.run_load_plan(plan, remapdsl.open_checkpoint(TINY), tensors)
    (d,) = info.value.diagnostics
    source, held = (" from `model.norm.weight`", f" {held}") if held else ("", "")
    message = (f"a plan item for `model.norm.weight`{source}, offsets [{offsets}] sizes [16], does not lie in a "
               f"tensor of shape [16]{held}: nothing of it was read or written")
    assert (d.code, d.message, d.hint) == ("E417", message, E417_HINT), d
    assert torch.equal(tensors["model.norm.weight"], torch.full((16,), 3.0))


def test_a_decode_item_outside_its_tensor_is_e417_naming_its_logical_source(tmp_path):
    """A dequantized tensor's piece (a decode item) whose region is not in its tensor: E417 names the
    logical source it decodes, and nothing is written."""
    from checkpoints import tiny_checkpoint

    from remapdsl.language import rules_from_text
    from remapdsl.sharding.holdings import whole_shard
    from remapdsl.sharding.plans import make_load_plan

    tiny_checkpoint(tmp_path, {"a.weight": torch.ones(128, 128).to(torch.float8_e4m3fn),
                               "a.weight_scale_inv": torch.ones(1, 1)}, {})
    rules = rules_from_text("remap 1\ndequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight"
                            " | fp8_block(block=[128, 128], to=bfloat16)\na.weight -> w\n", "q.remap")
    compiled = remapdsl.compile_rules(rules, tmp_path, {})
    plan = make_load_plan(compiled, remapdsl.open_checkpoint(tmp_path),
                          {d.runtime_key: whole_shard(d.shape) for d in compiled.runtime_tensors})
    (item,) = plan.decodes
    plan = plan.model_copy(update={"decodes": (item._replace(local_offsets=(8, 0)),)})
    tensors = {"w": torch.full((128, 128), 3.0, dtype=torch.bfloat16)}
    with pytest.raises(remapdsl.RemapError) as info:
        read.run_load_plan(plan, remapdsl.open_checkpoint(tmp_path), tensors)
    (d,) = info.value.diagnostics
    message = ("a plan item for `w` from `a.weight`, offsets [8, 0] sizes [128, 128], does not lie in a tensor of "
               "shape [128, 128]: nothing of it was read or written")
    assert (d.code, d.message, d.hint) == ("E417", message, E417_HINT), d
    assert tensors["w"].eq(3).all()


@pytest.mark.parametrize("change", [lambda i: i._replace(local_offsets=(8,)),
                                    lambda i: i._replace(local_offsets=(0, 0), sizes=(*i.sizes, 1),
                                                         strides=(*i.strides, 1))],
                         ids=["offset past the end", "a dim more than the tensor's"])
def test_a_plan_item_outside_a_strided_tensor_is_e417_too(change):
    """A destination that is no contiguous CPU tensor (a transposed view) is filled through torch
    views: a region the view cannot hold whole is refused, not cut short."""
    plan, _ = _one_item_plan(change)
    tensors = _tensors()
    tensors["model.norm.weight"] = torch.zeros(2, 16).t()[:, 0]  # 16 elements, stride 2
    with pytest.raises(remapdsl.RemapError) as info:
        read.run_load_plan(plan, remapdsl.open_checkpoint(TINY), tensors)
    assert info.value.diagnostic.code == "E417" and "a tensor of shape [16]" in str(info.value)


@settings(max_examples=scaled(40), deadline=None)
@given(st.data())
def test_one_process_load_with_any_keywords_fills_what_it_holds_or_refuses(tmp_path_factory, data):
    """One process, each keyword drawn or left at its default (`config` given or the folder's, `strict` over a
    tensor no rule reads, local names, rank 0's shard under a layout, `read_replicated_once` with no one to
    share with, `staging_bytes`, `timeout`), the one-shot call or a prepared object's: each tensor holds
    its layer (rank 0's rows of it under the layout), or the load is refused with the code that applies."""
    from checkpoints import tiny_checkpoint

    from remapdsl.language import rules_from_text
    from remapdsl.sharding import LayoutPlan, Shard

    layers = {f"layers.{i}.w": torch.arange(12.0).reshape(4, 3) + 100 * i for i in range(3)}
    stray = data.draw(st.booleans(), label="a tensor no rule reads")
    folder = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), layers | ({"stray": torch.ones(2)} if stray else {}),
                             {"n": 2})
    rules = rules_from_text("remap 1\nlayers.{L}.w -> blocks.{L}.w\ndrop layers.{L}.w when L >= config.n\n")
    config = data.draw(st.sampled_from([None, {"n": 2}, {"n": 3}]), label="config")
    n = (config or {"n": 2})["n"]
    keywords = data.draw(st.fixed_dictionaries({}, optional={
        "strict": st.booleans(), "read_replicated_once": st.booleans(), "timeout": st.just(30),
        "staging_bytes": st.sampled_from([1 << 20, 100]), "local": st.just({"stage.{}": ("blocks.{}", 0)})}),
        label="keywords")
    sharded = data.draw(st.booleans(), label="rank 0 of tp=2")
    if sharded:
        keywords |= {"layout": LayoutPlan.from_mapping({"blocks.*": [Shard(dim=0)]}), "mesh": Mesh.of({"tp": 2})}
    want = {f"blocks.{i}.w": layers[f"layers.{i}.w"][:2] if sharded else layers[f"layers.{i}.w"] for i in range(n)}
    named = {k.replace("blocks.", "stage.") if "local" in keywords else k: v for k, v in want.items()}
    state = {k: torch.full_like(v, float("nan")) for k, v in named.items()}
    if data.draw(st.booleans(), label="through remapdsl.prepare"):
        def load():
            prepared = remapdsl.prepare(rules, folder, config=config, strict=keywords.get("strict", True))
            return prepared.load(state, **{k: v for k, v in keywords.items() if k != "strict"})
    else:
        def load():
            return remapdsl.load(state, folder, rules, config=config, **keywords)
    refused = "E202" if stray and keywords.get("strict", True) else \
        "E416" if keywords.get("staging_bytes") == 100 else None  # the rules compile first
    if refused:
        with pytest.raises(remapdsl.RemapError) as caught:
            load()
        assert caught.value.diagnostics[0].code == refused, str(caught.value)
        return
    report = load()
    assert all(torch.equal(state[k], named[k]) for k in named)
    assert report.bytes_read == sum(t.nbytes for t in want.values())
