"""Sharded loads on real torch.distributed process groups (gloo, CPU, 2 and 4 ranks).

Every rank loads its own shards of the bundled tiny Qwen3-MoE checkpoint through
rules/qwen3_moe.remap, under tensor-, expert- and fully-sharded layouts and their combination, as
plain local tensors with a layout plan and as DTensors; each rank's shards must equal the
single-process load sliced to that rank (by torch's own `distribute_tensor` for DTensors), and each
rank must read exactly the bytes it owns. A rank with other rules, or a bad tensor, fails everyone.
"""

from __future__ import annotations

import functools
import pickle
import re
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoints import tiny_checkpoint
from gloo import CHECK_FAILURES, distributed_like, each_backend, held_from, layout_spec

import remapdsl
from remapdsl.sharding import LayoutPlan, Mesh, Replicate, Shard, layout_for, local_shard
from remapdsl.testing.ranks import run_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = str(ROOT / "examples" / "tiny-qwen3-moe")
RULES = str(ROOT / "rules" / "qwen3_moe.remap")

TP = {
    "*.self_attn.q_proj": "colwise", "*.self_attn.k_proj": "colwise", "*.self_attn.v_proj": "colwise",
    "*.self_attn.o_proj": "rowwise", "*.mlp.experts.gate_up_proj": "packed_colwise",
    "*.mlp.experts.down_proj": "rowwise", "model.embed_tokens": "embedding_rowwise", "lm_head": "colwise",
}
EP = {"*.mlp.experts.*": "grouped_gemm"}
FSDP_TP = {"*norm.weight": [Shard(dim=0), Replicate()], "*": [Shard(dim=1), Shard(dim=0)]}
CASES = {
    2: [("tp", {"tp": 2}, TP, "tp"), ("ep", {"ep": 2}, EP, "ep"), ("fsdp", {"dp": 2}, {"*": [Shard(dim=0)]}, "dp")],
    4: [("tp", {"tp": 4}, TP, "tp"), ("fsdp_tp", {"dp": 2, "tp": 2}, FSDP_TP, "tp")],
}


def full_state() -> dict[str, torch.Tensor]:
    rules = remapdsl.load_rules(RULES)
    inventory = remapdsl.open_checkpoint(CHECKPOINT)
    compiled = remapdsl.compile_rules(rules, inventory)
    return compiled.empty_state_dict()


def _on_ranks(rank: int, world: int, out: str) -> list[str]:
    """Every case under each default group in turn: plain gloo, then one with NCCL's device
    contract (`cuda:gloo`), each a group of its own; the failures."""
    return each_backend(rank, world, out, lambda backend: _cases(rank, world, out))


def _cases(rank: int, world: int, out: str) -> list[str]:
    failures: list[str] = []
    expected = full_state()
    remapdsl.load(expected, CHECKPOINT, RULES)  # the single-process load every shard must match
    for name, dims, plan_map, mesh_dim in CASES[world]:
        try:
            _plain_case(rank, expected, Mesh.of(dims), LayoutPlan.from_mapping(plan_map, mesh_dim=mesh_dim))
            _dtensor_case(rank, expected, Mesh.of(dims), LayoutPlan.from_mapping(plan_map, mesh_dim=mesh_dim))
        except CHECK_FAILURES:  # reported by the parent, pytest's outcomes included
            failures.append(f"{name}: {traceback.format_exc()}")
    for check in (functools.partial(_disagreeing_rules_fail_everyone, other=Path(out) / "other"),
                  _one_bad_rank_fails_everyone, _replicated_tensors_read_once,
                  functools.partial(_replicated_views_read_once, drawn=Path(out) / "views.pickle"),
                  functools.partial(_another_checkpoint_fails_everyone, other=Path(out) / "other")):
        try:
            check(rank)
        except CHECK_FAILURES:
            failures.append(f"{getattr(check, 'func', check).__name__}: {traceback.format_exc()}")
    return failures


def _plain_case(rank, expected, mesh, plan) -> None:
    local, shards = {}, {}
    for key, full in expected.items():
        placements = layout_for(key, full.shape, plan, mesh)
        shard = local_shard(full.shape, mesh.sizes, placements, mesh.coordinate(rank))
        local[key] = torch.full(shard.shape, float("nan"), dtype=full.dtype)
        shards[key] = shard
    report = remapdsl.load(local, CHECKPOINT, RULES, layout=plan, mesh=mesh)
    for key, shard in shards.items():
        for box, at in zip(shard.boxes, shard.local_offsets):
            want = expected[key][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            got = local[key][tuple(slice(o, o + s) for o, s in zip(at, box.sizes))]
            assert torch.equal(got, want), (key, box)
    assert report.bytes_read == report.bytes_owned, (report.bytes_read, report.bytes_owned)


def _dtensor_case(rank, expected, mesh, plan) -> None:
    targets, wanted = distributed_like(expected, mesh, plan)
    remapdsl.load(targets, CHECKPOINT, RULES)
    for key in expected:
        assert torch.equal(targets[key].to_local(), wanted[key]), key


def _another_checkpoint_fails_everyone(rank: int, other: Path) -> None:
    """Rank 1 names another checkpoint (the bundled one without its lm_head): every rank reads rank
    0's headers, so only the agreement can tell, and it must."""
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.load(full_state(), CHECKPOINT if rank == 0 else str(other), RULES)
    assert info.value.diagnostic.code == "E410", str(info.value)


def _disagreeing_rules_fail_everyone(rank: int, other: Path) -> None:
    """Rank 1's copy of the rules says `?? true` where rank 0's says `?? false`: both compile to
    the same tensors (config.json sets tie_word_embeddings), so only the ranks' comparison of
    their rule files can tell, and it must, naming the line on both sides."""
    original = Path(RULES).read_text()
    line = "drop lm_head.weight when config.tie_word_embeddings ?? false"
    number = original.splitlines().index(line) + 1
    rules = RULES
    if rank == 1:
        rules = str(other / "qwen3_moe.remap")
        Path(rules).write_text(original.replace(line, line.replace("?? false", "?? true")))
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.load(full_state(), CHECKPOINT, rules)
    (d,) = info.value.diagnostics
    assert d.code == "E410" and d.message.startswith("ranks disagree on the compiled rules"), str(info.value)
    assert re.search(r"^rule files: ranks? 0\b.*; rank 1 has [0-9a-f]{12}$", d.message, re.MULTILINE), d.message
    assert (f"qwen3_moe.remap` line {number}: `{line}` vs `{line.replace('?? false', '?? true')}`"
            in d.message), d.message


def _replicated_tensors_read_once(rank: int) -> None:
    expected = full_state()
    remapdsl.load(expected, CHECKPOINT, RULES)
    mesh, plan = Mesh.of({"tp": dist.get_world_size()}), LayoutPlan.from_mapping(TP, mesh_dim="tp")
    reports = {}
    for once in (False, True):
        local = {}
        for key, full in expected.items():
            shard = local_shard(full.shape, mesh.sizes, layout_for(key, full.shape, plan, mesh),
                                mesh.coordinate(rank))
            local[key] = torch.full(shard.shape, float("nan"), dtype=full.dtype)
        reports[once] = remapdsl.load(local, CHECKPOINT, RULES, layout=plan, mesh=mesh,
                                      read_replicated_once=once)
        for key in ("model.norm.weight", "model.layers.1.mlp.gate.weight"):  # replicated under TP
            assert torch.equal(local[key], expected[key]), key
    if rank == 0:
        assert reports[True].bytes_read == reports[False].bytes_read
    else:
        assert reports[True].bytes_read < reports[False].bytes_read


def _replicated_views_read_once(rank: int, drawn: Path) -> None:
    """The tensors TP replicates, each rank holding them in its own drawn memory layout (transposed,
    sliced out of a larger tensor, strided; `_drawn_views`), loaded with read_replicated_once: rank 0
    reads them and every rank's views hold the single-process load, their bases untouched outside the
    views; a replicated tensor one rank holds expanded is E234 on every rank, its memory untouched."""

    expected = full_state()
    remapdsl.load(expected, CHECKPOINT, RULES)
    mesh, plan = Mesh.of({"tp": dist.get_world_size()}), LayoutPlan.from_mapping(TP, mesh_dim="tp")
    for example in pickle.loads(drawn.read_bytes()):
        local, held = {}, {}
        for key, full in expected.items():
            if key in example:
                held[key] = held_from(example[key][rank % 2])
                local[key] = held[key].tensor
                continue
            shard = local_shard(full.shape, mesh.sizes, layout_for(key, full.shape, plan, mesh), mesh.coordinate(rank))
            local[key] = torch.full(shard.shape, float("nan"), dtype=full.dtype)
        expanded = [k for k, pair in example.items() if 0 in pair[rank % 2][2]]
        if any(0 in spec[2] for pair in example.values() for spec in pair):
            with pytest.raises(remapdsl.RemapError) as info:
                remapdsl.load(local, CHECKPOINT, RULES, layout=plan, mesh=mesh, read_replicated_once=True)
            assert info.value.diagnostics[0].code == "E234", str(info.value)
            assert all(held[k].base.isnan().all() for k in expanded), "written before the refusal"
            continue
        remapdsl.load(local, CHECKPOINT, RULES, layout=plan, mesh=mesh, read_replicated_once=True)
        for key, h in held.items():
            assert torch.equal(h.tensor, expected[key]), f"`{key}` ({h.how})"
            assert h.outside().isnan().all(), f"`{key}` ({h.how}): written outside the view"


def _drawn_views(world: int) -> list[dict]:
    """For `_replicated_views_read_once`: memory layouts (two per tensor, ranks 0 and 1; the others
    take them in turn) of the tensors TP replicates, drawn by `remapdsl.testing.strategies`, and last
    the first draw with one tensor expanded on rank 1. Plain data: `gloo.layout_spec`."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from remapdsl.testing.strategies import Held, memory_layouts

    mesh, plan = Mesh.of({"tp": world}), LayoutPlan.from_mapping(TP, mesh_dim="tp")
    shapes = {k: tuple(t.shape) for k, t in full_state().items()
              if all(isinstance(p, Replicate) for p in layout_for(k, t.shape, plan, mesh))}
    drawn: list[dict] = []

    @settings(max_examples=5, deadline=None, database=None)
    @given(st.fixed_dictionaries({k: st.tuples(memory_layouts(s), memory_layouts(s)) for k, s in shapes.items()}))
    def collect(example):
        drawn.append({k: tuple(layout_spec(h) for h in pair) for k, pair in example.items()})

    collect()
    key = max(shapes, key=lambda k: len(shapes[k]))  # a matrix: the gate's weight
    base = torch.full((1, *shapes[key][1:]), float("nan"))
    drawn.append(dict(drawn[0], **{key: (drawn[0][key][0], layout_spec(Held(base.expand(shapes[key]), base, "expanded")))}))
    assert len(drawn) > 2 and any(len(s) > 1 for s in shapes.values())
    return drawn


def _one_bad_rank_fails_everyone(rank: int) -> None:
    state = full_state()
    if rank == 1:
        state["model.norm.weight"] = torch.empty(3)
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.load(state, CHECKPOINT, RULES)
    (d,) = info.value.diagnostics  # rank 1's own error, raised on every rank
    assert d.code == "E232" and d.span.path.endswith("qwen3_moe.remap"), str(info.value)
    assert d.message == ("`model.norm.weight` is [3] float32 in the model, but the rules make it [16] float32"
                         " (on rank 1)"), d.message


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_loads_equal_the_sliced_single_process_load(world, tmp_path):
    """Every case of `_cases` on one group of `world` ranks; `other` is the bundled checkpoint without
    its lm_head, which rank 1 names where only the ranks' agreement can tell."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(CHECKPOINT) / "model.safetensors"))
    tensors.pop("lm_head.weight")
    tiny_checkpoint(tmp_path / "other", tensors)
    (tmp_path / "views.pickle").write_bytes(pickle.dumps(_drawn_views(world)))
    failures = run_ranks(_on_ranks, world, str(tmp_path), timeout=180)
    assert failures == [[]] * world, "\n\n".join(f for r in failures for f in r)
