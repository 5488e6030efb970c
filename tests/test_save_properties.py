"""save(load(x)) == x, byte for byte, for random shapes, random op chains and random meshes.

The op chains are tests/test_compile_properties.py's (layout ops, casts, scale/add, pad, repeat,
slice...). What the save must refuse is worked out apart from remapdsl: a checkpoint tensor read
through a cast to a dtype that cannot hold every value of the one before (torch.finfo) is E502
naming it; one whose elements the chain's layout ops leave out (the reference `apply_ops` run on
element ids, value ops removed) is E501 naming it; and nothing else is refused. Every chain the
save accepts whose values survive the round trip (no `scale`/`add`, whose float32 inverse may
round) must write the original file back exactly. The
ranks of a random mesh (1-D or 2-D, up to 4 ranks, random Shard/Replicate placements per tensor)
are played in one process: each writes what it owns into the same staging files, so every byte
must have exactly one writer.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import assume, event, given, note
from hypothesis import strategies as st
from safetensors.torch import save_file
from test_compile_properties import examples, list_axis_cases

import remapdsl
from remapdsl import RemapError
from remapdsl.checkpoint.writer import FileWriter, create_files
from remapdsl.compile.inverse import writers
from remapdsl.language import ir
from remapdsl.runtime.write import run_write_plan
from remapdsl.sharding import LayoutPlan, Mesh, Replicate, Shard, layout_for, local_shard
from remapdsl.sharding.holdings import hold, owned
from remapdsl.sharding.plans import make_write_plan
from remapdsl.testing.reference import apply_ops, literal


@st.composite
def meshes(draw) -> Mesh:
    if draw(st.booleans()):
        return Mesh.of({"a": draw(st.integers(1, 4))})
    return Mesh.of({"a": draw(st.integers(1, 2)), "b": draw(st.integers(1, 2))})


def _placements(draw, mesh: Mesh, ndim: int):
    return [draw(st.sampled_from([Replicate()] + [Shard(dim=d) for d in range(ndim)])) for _ in mesh.sizes]


def _lossless(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether dtype `b` holds every value of float dtype `a`: as fine a step, as large a range
    and as small a normal number (float16 -> bfloat16 loses digits, bfloat16 -> float16 range)."""
    fa, fb = torch.finfo(a), torch.finfo(b)
    return fb.eps <= fa.eps and fb.max >= fa.max and fb.smallest_normal <= fa.smallest_normal


def _refused(case, rules) -> dict[str, str]:
    """Checkpoint key -> the code the save must refuse it with (E502 for a lossy cast on its way,
    else E501 for elements the rule leaves out), found without remapdsl's compiler."""
    (rule,) = [s for s in rules.statements if isinstance(s, ir.Rule)]
    dtype = next(iter(case.sources.values())).dtype  # every source of a case has one dtype
    lossy = False
    for op in rule.ops:
        if isinstance(op, ir.Cast):
            lossy = lossy or not _lossless(dtype, getattr(torch, literal(op.dtype)))
            dtype = getattr(torch, literal(op.dtype))
    # element ids, 1 up, through the layout ops alone: an id missing from the outputs is left out
    ids, start = {}, 1
    for key, t in case.sources.items():
        ids[key] = torch.arange(start, start + t.numel(), dtype=torch.float64).reshape(t.shape)
        start += t.numel()
    layout = [op for op in rule.ops if not isinstance(op, (ir.Cast, ir.Scale, ir.Add))]
    given = {v: [ids[k] for k in keys] for v, keys in case.ordered.items()} if isinstance(case.ordered, dict) \
        else [ids[k] for k in case.ordered]
    out = apply_ops(layout, given, targets=len(case.targets))
    outputs = [t for v in sorted(out) for t in out[v]] if isinstance(out, dict) else out
    seen = set(torch.cat([t.reshape(-1) for t in outputs]).tolist()) if outputs else set()
    refused = {}
    for key, t in ids.items():
        kept = sum(1 for i in t.reshape(-1).tolist() if i in seen)
        if lossy and kept:
            refused[key] = "E502"
        elif kept < t.numel():
            refused[key] = "E501"
    return refused


def _named(d) -> tuple[str, str]:
    """The checkpoint key a save's E501/E502 names, and its code."""
    pattern = r"reads `([^`]+)` through `cast\(" if d.code == "E502" else r"^checkpoint tensor `([^`]+)`"
    found = re.search(pattern, d.message)
    assert d.code in ("E501", "E502") and found, d
    return found.group(1), d.code


@examples(100)
@given(list_axis_cases(), meshes(), st.data())
def test_save_of_load_writes_the_checkpoint_back(case, mesh, data):
    rules = remapdsl.language.rules_from_text(case.text)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "src"
        source.mkdir()
        save_file(case.sources, str(source / "model.safetensors"))
        inventory = remapdsl.open_checkpoint(source)
        compiled = remapdsl.compile_rules(rules, inventory, {})
        full = compiled.empty_state_dict()
        remapdsl.load(full, source, rules, config={})
        refused = _refused(case, rules)
        note(f"refused: {refused}")
        event(f"refused: {sorted(set(refused.values()))}")
        if refused:
            with pytest.raises(RemapError) as info:
                writers(compiled)
            assert sorted(_named(d) for d in info.value.diagnostics) == sorted(refused.items()), str(info.value)
            return
        chosen = writers(compiled)
        assume("scale(" not in case.text and "add(" not in case.text)
        plan = LayoutPlan.from_mapping(
            {key: _placements(data.draw, mesh, len(t.shape)) for key, t in full.items()}, mesh_dim=mesh.names[0])
        note(f"{case.text}\nmesh {mesh.sizes}: {plan}")
        staging = Path(tmp) / "out"
        create_files(staging, inventory)
        writer = FileWriter(staging)
        written = 0
        for rank in range(mesh.size):
            local = {}
            for key, tensor in full.items():
                shard = local_shard(tensor.shape, mesh.sizes, layout_for(key, tensor.shape, plan, mesh),
                                    mesh.coordinate(rank))
                local[key] = torch.empty(shard.shape, dtype=tensor.dtype)
                for box, at in zip(shard.boxes, shard.local_offsets):
                    local[key][tuple(slice(a, a + n) for a, n in zip(at, box.sizes))] = \
                        tensor[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
            holding = hold(compiled, local, plan, mesh, rank)
            rank_plan = make_write_plan(chosen, inventory, owned(holding, rank), rank)
            run_write_plan(rank_plan, writer, holding.local)
            written += rank_plan.bytes_written
        writer.close(sync=False)
        assert written == sum(t.nbytes for t in inventory.tensors.values())  # each byte written once
        assert (staging / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


@pytest.mark.parametrize("stored, loaded, lossy", [("int64", "int32", True), ("int32", "int16", True),
                                                   ("int32", "int64", False), ("int8", "int16", False),
                                                   ("uint8", "uint16", False), ("int32", "float32", True)])
def test_an_integer_cast_is_refused_exactly_when_it_narrows(tmp_path, stored, loaded, lossy):
    """An integer narrowing would write truncated values back (2**40 read as int32 is 0): E502
    naming the tensor and the rule; so would an integer read as a float (2**24 + 1 is no float32);
    a widening, signed or unsigned, writes the checkpoint back byte for byte."""
    save_file({"a.w": torch.tensor([1, -2, 2**6, 100], dtype=getattr(torch, stored))},
              str(tmp_path / "model.safetensors"))
    rules = remapdsl.language.rules_from_text(f"remap 1\na.w -> b\n    | cast({loaded})\n", "t.remap")
    state = {"b": torch.empty(4, dtype=getattr(torch, loaded))}
    remapdsl.load(state, tmp_path, rules, config={})
    if lossy:
        with pytest.raises(RemapError) as info:
            remapdsl.save(state, tmp_path / "out", rules, like=tmp_path, config={})
        (d,) = info.value.diagnostics
        assert d.code == "E502" and d.span[:3] == ("t.remap", 2, 1), d
        assert d.message.startswith(f"`b` reads `a.w` through `cast({loaded})`, which loses values"), d
        assert not (tmp_path / "out").exists()
    else:
        remapdsl.save(state, tmp_path / "out", rules, like=tmp_path, config={})
        assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_failed_write_stops_every_thread_taking_pieces(tmp_path, threads):
    """A save that fails on one piece raises that error and writes no more pieces, on any thread
    (a save of hours must not go on writing after its first failure)."""
    tensors = {f"w{i}": torch.full((4, 4), float(i)) for i in range(64)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    inventory = remapdsl.open_checkpoint(tmp_path)
    compiled = remapdsl.compile_rules(remapdsl.language.rules_from_text("{N:path} -> {N}\n"), inventory, {})
    holding = hold(compiled, tensors, LayoutPlan.from_mapping({}, mesh_dim="dp"), Mesh.of({"dp": 1}), 0)
    plan = make_write_plan(writers(compiled), inventory, owned(holding, 0), 0)

    class Failing:
        calls = 0

        def write_runs(self, *args):
            Failing.calls += 1
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        run_write_plan(plan, Failing(), holding.local, threads=threads)
    assert len(plan.items) == 64 and Failing.calls <= threads


@examples(40)
@given(st.data())
def test_one_process_save_with_any_keywords_writes_each_tensor_back_or_refuses(data):
    """One process, each keyword drawn or left at its default (`like` or the derived layout, `overwrite` onto
    a folder that exists or none, `allow_lossy` over a cast that lost values, `dropped` over a tensor the rules
    drop, `max_shard_size`), the one-shot call or a prepared object's (with `like`): the files hold each
    checkpoint tensor with the value its rule writes back (a dropped one copied or left out), or the save is
    refused with exactly the codes that apply, the destination as it was."""
    from safetensors.torch import load_file

    w, v, x = torch.randn(3, 4), torch.randn(5), torch.randn(2, 2)
    lossy, drop_x = data.draw(st.booleans(), label="lossy"), data.draw(st.booleans(), label="drop x")
    rules = remapdsl.language.rules_from_text(
        "remap 1\nw -> w" + (" | cast(bfloat16)" if lossy else "") + "\nv -> v | scale(2)\n"
        + ("drop x\n" if drop_x else "x -> x\n"), "k.remap")
    keywords = data.draw(st.fixed_dictionaries({}, optional={
        "overwrite": st.booleans(), "allow_lossy": st.booleans(), "timeout": st.just(30),
        "dropped": st.sampled_from(["error", "copy", "omit", "keep"]), "max_shard_size": st.sampled_from([16, "1KB"])}))
    exists = data.draw(st.booleans(), label="the destination exists")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "src"
        folder.mkdir()
        save_file({"w": w, "v": v, "x": x}, str(folder / "model.safetensors"))
        state = remapdsl.compile_rules(rules, folder, {}).empty_state_dict()
        remapdsl.load(state, folder, rules, config={})
        out = Path(tmp) / "out"
        if exists:
            out.mkdir()
            (out / "stray.txt").write_text("kept unless overwritten")
        like = data.draw(st.sampled_from([None, folder]), label="like")
        if like is not None and data.draw(st.booleans(), label="through remapdsl.prepare"):
            def save():
                return remapdsl.prepare(rules, like, config={}).save(
                    state, out, **{k: v for k, v in keywords.items() if k != "max_shard_size"})
        else:
            def save():
                return remapdsl.save(state, out, rules, like=like, config={}, **keywords)
        dropped = keywords.get("dropped", "error")
        if like is None and lossy:
            refused = {"E520"}  # no checkpoint says what the cast was made from
        elif dropped == "keep":
            refused = {"E523"}
        else:
            refused = {code for code, why in [("E502", lossy and not keywords.get("allow_lossy")),
                                              ("E501", like is not None and drop_x and dropped == "error")] if why}
            refused = refused or ({"E510"} if exists and not keywords.get("overwrite") else set())
        if refused:
            with pytest.raises(RemapError) as caught:
                save()
            assert {d.code for d in caught.value.diagnostics} == refused, str(caught.value)
            assert sorted(p.name for p in out.iterdir()) == ["stray.txt"] if exists else not out.exists()
            return
        save()
        got = {}
        for file in out.glob("*.safetensors"):
            got |= load_file(str(file))
    want = {"w": w.bfloat16().float() if lossy else w, "v": v}
    if not drop_x or (like is not None and dropped == "copy"):
        want["x"] = x
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
