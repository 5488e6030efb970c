"""save(load(x)) == x, byte for byte, for random shapes, random op chains and random meshes.

The op chains are tests/test_compile_properties.py's (layout ops, casts, scale/add, pad, repeat,
slice...). A chain the save refuses (E501: a slice left elements out; E502: a narrowing cast) is
checked to be one that loses data; any other chain whose values survive the round trip (no
`scale`/`add`, whose float32 inverse may round) must write the original file back exactly. The
ranks of a random mesh (1-D or 2-D, up to 4 ranks, random Shard/Replicate placements per tensor)
are played in one process: each writes what it owns into the same staging files, so every byte
must have exactly one writer.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st
from safetensors.torch import save_file
from test_compile_properties import examples, list_axis_cases

import remapdsl
from remapdsl import RemapError
from remapdsl.checkpoint.writer import FileWriter, create_files
from remapdsl.compile.inverse import writers
from remapdsl.runtime.write import run_write_plan
from remapdsl.sharding.holdings import hold, owned
from remapdsl.sharding import LayoutPlan, Mesh, Replicate, Shard, layout_for, local_shard
from remapdsl.sharding.plans import make_write_plan


@st.composite
def meshes(draw) -> Mesh:
    if draw(st.booleans()):
        return Mesh.of({"a": draw(st.integers(1, 4))})
    return Mesh.of({"a": draw(st.integers(1, 2)), "b": draw(st.integers(1, 2))})


def _placements(draw, mesh: Mesh, ndim: int):
    return [draw(st.sampled_from([Replicate()] + [Shard(dim=d) for d in range(ndim)])) for _ in mesh.sizes]


@examples(200)
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
        try:
            chosen = writers(compiled)
        except RemapError as exc:
            codes = {d.code for d in exc.diagnostics}
            assert codes <= {"E501", "E502"}, str(exc)
            assert "E501" not in codes or "slice" in case.text, (case.text, str(exc))
            assert "E502" not in codes or "cast" in case.text, (case.text, str(exc))
            return
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
