"""Failures on one rank of a real gloo group (3 processes, CPU) end in one error on every rank.

Before any tensor byte moves, each failure (a rule file that does not parse, a checkpoint that
cannot be opened, rules that do not fit) and each disagreement (other rules, another checkpoint,
config, layout or mesh; the last two in each of load, save, export and ingest) must surface on every
rank as the same RemapError, naming the rank it came from and, for a disagreement (E410), what
differs; and the group must stay usable for the next call.
Each rank returns what it raised per case; the parent compares the ranks.
"""

from __future__ import annotations

import datetime
import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo import CHECK_FAILURES, record_cases, run_with_bound
from safetensors.torch import load_file

import remapdsl
from remapdsl.sharding import LayoutPlan, Mesh, layout_for, local_shard
from remapdsl.testing.ranks import run_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = str(ROOT / "examples" / "tiny-qwen3-moe")
RULES = str(ROOT / "rules" / "qwen3_moe.remap")
WORLD = 3
TP = {"*.self_attn.q_proj": "colwise", "*.self_attn.o_proj": "rowwise"}


def _state() -> dict[str, torch.Tensor]:
    return remapdsl.compile_rules(remapdsl.load_rules(RULES), CHECKPOINT).empty_state_dict()


def _broken_rules(tmp: Path) -> str:
    path = tmp / "broken.remap"
    path.write_text(Path(RULES).read_text().replace("concat(dim=", "concatt(dim=", 1))
    return str(path)


def _edited_rules(tmp: Path) -> str:
    """The shipped rules with one comment line more at line 3: the same program, another text."""
    lines = Path(RULES).read_text().splitlines(keepends=True)
    path = tmp / "qwen3_moe.remap"
    path.write_text("".join(lines[:2] + ["# edited on one rank\n"] + lines[2:]))
    return str(path)


def _local(expected, plan, mesh, rank):
    return {k: torch.zeros(local_shard(t.shape, mesh.sizes, layout_for(k, t.shape, plan, mesh),
                                       mesh.coordinate(rank)).shape, dtype=t.dtype) for k, t in expected.items()}


def _cases(rank: int, tmp: Path) -> dict:
    """Each case: what this rank calls (raising, on every rank, the error the parent checks)."""
    mesh = Mesh.of({"tp": WORLD})
    colwise = LayoutPlan.from_mapping(TP, mesh_dim="tp")
    rowwise = LayoutPlan.from_mapping({**TP, "*.self_attn.q_proj": "rowwise"}, mesh_dim="tp")
    plan = rowwise if rank == 1 else colwise
    config = json.loads((Path(CHECKPOINT) / "config.json").read_text())
    # rank 1's mesh has a dim of size 1 more: the same shards, another mesh
    other = Mesh.of({"dp": 1, "tp": WORLD}) if rank == 1 else mesh
    pairs = list(load_file(str(Path(CHECKPOINT) / "model.safetensors")).items())
    drivers = {  # each driver on this rank's shards, laid out by `layout` on `on`
        "load": lambda layout, on: remapdsl.load(_local(_state(), layout, on, rank), CHECKPOINT, RULES,
                                                 layout=layout, mesh=on),
        "save": lambda layout, on: remapdsl.save(_local(_state(), layout, on, rank), tmp.parent / "saved", RULES,
                                                 like=CHECKPOINT, layout=layout, mesh=on),
        "export": lambda layout, on: list(remapdsl.export(_local(_state(), layout, on, rank), RULES, like=CHECKPOINT,
                                                          layout=layout, mesh=on, regions=True)),
        "ingest": lambda layout, on: remapdsl.ingest(_local(_state(), layout, on, rank), pairs, RULES, like=CHECKPOINT,
                                                     layout=layout, mesh=on),
    }
    return {
        "rules_do_not_parse": lambda: remapdsl.load(_state(), CHECKPOINT,
                                                    _broken_rules(tmp) if rank == 2 else RULES),
        "checkpoint_missing_on_rank_0": lambda: remapdsl.load(
            _state(), str(tmp / "nowhere") if rank == 0 else CHECKPOINT, RULES),
        "checkpoint_missing_on_rank_1": lambda: remapdsl.load(
            _state(), str(tmp / "nowhere") if rank == 1 else CHECKPOINT, RULES),
        "config_differs": lambda: remapdsl.load(_state(), CHECKPOINT, RULES, config={
            **config, **({"rope_theta": 1.0} if rank == 1 else {})}),
        "config_breaks_the_compile": lambda: remapdsl.load(_state(), CHECKPOINT, RULES, config={
            **config, **({"tie_word_embeddings": "yes"} if rank == 2 else {})}),
        "rules_differ_by_a_line": lambda: remapdsl.load(_state(), CHECKPOINT,
                                                        _edited_rules(tmp) if rank == 1 else RULES),
        **{f"layouts_differ_on_{name}": lambda call=call: call(plan, mesh) for name, call in drivers.items()},
        **{f"meshes_differ_on_{name}": lambda call=call: call(colwise, other) for name, call in drivers.items()},
        "save_without_like_on_one_rank": lambda: remapdsl.save(_state(), tmp.parent / "saved2", RULES,
                                                               like=None if rank == 1 else CHECKPOINT),
        "save_without_like_on_rank_0": lambda: remapdsl.save(_state(), tmp.parent / "saved3", RULES, config=config,
                                                             like=None if rank == 0 else CHECKPOINT),
        "the_group_still_works": lambda: remapdsl.load(_state(), CHECKPOINT, RULES),
    }


def test_failures_on_one_rank_raise_one_error_on_every_rank(tmp_path):
    seen = run_ranks(record_cases, WORLD, str(tmp_path), _cases)
    for name in seen[0]:
        first = seen[0][name]
        # one error, the same text on every rank
        texts = {json.dumps(s[name]) for s in seen}
        assert len(texts) == 1, (name, [s[name] for s in seen])
        if name == "the_group_still_works":
            assert first is None
            continue
        assert first is not None and first["type"] != "escaped", (name, first)
        text = first["text"]
        if name == "rules_do_not_parse":
            assert first["codes"] == ["E134"] and first["type"] == "RuleCheckError", first
            assert "unknown op `concatt`" in text and "(on rank 2)" in text and first["failed_ranks"] == [2]
        elif name == "checkpoint_missing_on_rank_0":
            assert first["type"] == "CheckpointError" and "(on rank 0)" in text and first["failed_ranks"] == [0]
        elif name == "checkpoint_missing_on_rank_1":  # rank 0 read the headers: only the agreement can tell
            assert first["codes"] == ["E410"], first
            assert "checkpoint: ranks 0, 2 have" in text and "rank 1 has" in text, text
            assert "checkpoint folder `tiny-qwen3-moe` vs `nowhere (missing)`" in text, text
            size = (Path(CHECKPOINT) / "model.safetensors").stat().st_size
            assert f"file `model.safetensors`: {size} B vs missing" in text, text
        elif name == "config_differs":
            assert first["codes"] == ["E410"] and "config key `rope_theta`: missing vs `1.0`" in text, text
        elif name == "config_breaks_the_compile":
            assert first["type"] == "BindError" and first["codes"] == ["E210"], first
            assert "(on rank 2)" in text and first["failed_ranks"] == [2], text
        elif name == "rules_differ_by_a_line":
            assert first["codes"] == ["E410"], first
            assert "rule files: ranks 0, 2 have" in text and "line 3: " in text and "`# edited on one rank`" in text
        elif name.startswith("layouts_differ"):
            assert first["codes"] == ["E410"] and "tensor layouts" in text, text
            assert "tensor `model.layers.0.self_attn.q_proj.weight`: `mesh [3] Shard(0)` vs " \
                   "`mesh [3] Shard(1)`" in text, text
        elif name.startswith("meshes_differ"):
            assert first["codes"] == ["E410"] and "mesh: ranks given different meshes" in text, text
            assert "rank 0 vs rank 1: mesh `tp=3` vs `dp=1, tp=3`" in text, text
        elif name.startswith("save_without_like"):
            which = "this rank was given no `like` and rank 0 was (on rank 1)" if name.endswith("one_rank") else \
                "this rank was given `like` and rank 0 was not (on ranks 1-2)"
            assert first["codes"] == ["E520"] and f"a save writes one layout on every rank, but {which}" in text, text
            assert text.endswith("\n  hint: give every rank the same `like`, or none to derive the layout"), text
    assert not any((tmp_path / f"saved{n}").exists() for n in ("", 2, 3))  # no failed save left one


LOST_TIMEOUT = 60  # the group's timeout in the lost-rank test: the bound on any wait


def _loses_a_rank(rank: int, rendezvous: str, out: str) -> None:
    """Rank 2 dies (SIGKILL) as it opens a checkpoint file to read tensor bytes; the others must
    fail, not hang.
    Each survivor then exits as a job's rank does on an uncaught error, without leaving the group."""
    import os
    import signal
    import time

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=LOST_TIMEOUT))
    state = _state()
    if rank == 2:
        from remapdsl.checkpoint.reader import CheckpointReader

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        CheckpointReader._fd = CheckpointReader.mapped = die  # every read opens or maps its file first
    start = time.monotonic()
    try:
        remapdsl.load(state, CHECKPOINT, RULES)
        seen = {"type": None}
    except remapdsl.RemapError as exc:
        seen = {"type": type(exc).__name__, "codes": [d.code for d in exc.diagnostics], "text": str(exc)}
    except CHECK_FAILURES:
        seen = {"type": "escaped", "text": traceback.format_exc()}
    seen["seconds"] = time.monotonic() - start
    Path(out, f"lost{rank}.json").write_text(json.dumps(seen))
    os._exit(1)


def test_a_rank_killed_mid_load_fails_the_others_within_the_bound(tmp_path):

    alive = run_with_bound(_loses_a_rank, WORLD, (str(tmp_path / "rendezvous"), str(tmp_path)), 3 * LOST_TIMEOUT)
    assert not alive, f"ranks {alive} hung after rank 2 was killed"
    assert not (tmp_path / "lost2.json").exists()  # rank 2 died before it could report anything
    for r in (0, 1):
        seen = json.loads((tmp_path / f"lost{r}.json").read_text())
        assert seen["type"] == "RemapError" and seen["codes"] == ["E413"], seen
        assert f"rank {r} lost the group while reading" in seen["text"], seen
        assert "rank 2 did not answer a roll call" in seen["text"], seen  # the lost rank, named
        assert seen["seconds"] < LOST_TIMEOUT + 10, seen
