"""Reuse across calls is an object the caller keeps (`remapdsl.prepare`), in memory; the library
writes nothing but where it is told, and a fresh process reads nothing it did not produce."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gloo import each_backend

import remapdsl
from remapdsl.drivers import load as load_driver
from remapdsl.drivers import prepare as prepare_step
from remapdsl.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "examples" / "tiny-qwen3-moe"
RULES = ROOT / "rules" / "qwen3_moe.remap"


def _whole() -> dict[str, torch.Tensor]:
    state = remapdsl.compile_rules(str(RULES), str(CHECKPOINT)).empty_state_dict()
    remapdsl.load(state, str(CHECKPOINT), str(RULES))
    return state


def _nan_like(state: dict) -> dict:
    return {k: torch.full_like(v, float("nan")) if v.is_floating_point() else torch.zeros_like(v)
            for k, v in state.items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Counted:
    """Counts the calls of a module function while installed (monkeypatch undoes it)."""

    def __init__(self, monkeypatch, module, name: str):
        self.calls = 0
        original = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


def test_a_second_load_reuses_the_compiled_program_and_the_plan_and_fills_the_same_values(monkeypatch):
    whole = _whole()
    compiles = _Counted(monkeypatch, prepare_step, "compile_rules")
    plans = _Counted(monkeypatch, load_driver, "make_load_plan")
    prepared = remapdsl.prepare(str(RULES), str(CHECKPOINT))
    for _ in range(3):
        state = _nan_like(whole)
        report = prepared.load(state)
        assert _equal(state, whole)
    assert (compiles.calls, plans.calls) == (1, 1)
    assert report.rules == str(RULES) and report.bytes_read > 0


def test_an_edited_rule_file_or_a_rewritten_checkpoint_file_is_prepared_again(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINT, folder)
    rules = tmp_path / "rules.remap"
    rules.write_text(RULES.read_text())
    whole = _whole()
    compiles = _Counted(monkeypatch, prepare_step, "compile_rules")
    prepared = remapdsl.prepare(str(rules), str(folder))
    prepared.load(_nan_like(whole))
    rules.write_text(RULES.read_text() + "# edited\n")
    state = _nan_like(whole)
    prepared.load(state)
    assert compiles.calls == 2 and _equal(state, whole)
    shard = sorted(folder.glob("*.safetensors"))[0]
    time.sleep(0.01)
    shard.write_bytes(shard.read_bytes())  # same bytes, a new file time: read again, not trusted
    prepared.load(_nan_like(whole))
    assert compiles.calls == 3
    prepared.load(_nan_like(whole))
    assert compiles.calls == 3
    rules.write_text("remap 1\nnot a rule\n")
    with pytest.raises(remapdsl.RuleSyntaxError):
        prepared.load(_nan_like(whole))


@pytest.mark.parametrize("config", [None, "given"])
def test_an_edited_config_json_is_prepared_again_only_where_it_was_read(config, tmp_path, monkeypatch):
    """The folder's config.json is an input of the compile only when the caller gave no `config`: then an
    edit of it prepares again (with the new values), else it is not looked at."""
    folder = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINT, folder)
    given = remapdsl.checkpoint.read_config(remapdsl.open_checkpoint(folder)) if config else None
    whole = _whole()
    compiles = _Counted(monkeypatch, prepare_step, "compile_rules")
    prepared = remapdsl.prepare(str(RULES), str(folder), config=given)
    prepared.load(_nan_like(whole))
    time.sleep(0.01)
    (folder / "config.json").write_text((folder / "config.json").read_text() + "\n")
    state = _nan_like(whole)
    prepared.load(state)
    assert compiles.calls == (1 if config else 2) and _equal(state, whole)

def test_a_prepared_save_export_and_ingest_match_the_one_shot_calls(tmp_path):
    whole = _whole()
    prepared = remapdsl.prepare(str(RULES), str(CHECKPOINT))
    for n in range(2):
        prepared.save(whole, tmp_path / f"saved{n}")
        for original in sorted(CHECKPOINT.glob("*.safetensors")):
            assert (tmp_path / f"saved{n}" / original.name).read_bytes() == original.read_bytes()
    once = dict(remapdsl.export(whole, str(RULES), like=str(CHECKPOINT)))
    for _ in range(2):
        pairs = dict(prepared.export(whole))
        assert _equal(pairs, once)
    state = _nan_like(whole)
    report = prepared.ingest(state, pairs)
    assert _equal(state, whole) and report.used == len(pairs)


def test_prepare_needs_the_checkpoint_and_refuses_a_snapshot(tmp_path):
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.prepare(str(RULES), None)
    assert info.value.diagnostics[0].code == "E418"
    snapshot = tmp_path / "m.headers.json"
    remapdsl.write_snapshot(str(CHECKPOINT), snapshot)
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.prepare(str(RULES), str(snapshot))
    assert info.value.diagnostics[0].code == "E331"


def test_a_fresh_process_writes_nothing_outside_its_destination(tmp_path):
    """Loading, saving and compiling in a new process (the parser built there) leave the home,
    cache and temp folders as they were: no cache on disk, nothing to read back later."""
    home, cache, temp = (tmp_path / name for name in ("home", "cache", "tmp"))
    for folder in (home, cache, temp):
        folder.mkdir()
    script = (
        "import remapdsl\n"
        f"state = remapdsl.compile_rules({str(RULES)!r}, {str(CHECKPOINT)!r}).empty_state_dict()\n"
        f"remapdsl.load(state, {str(CHECKPOINT)!r}, 'auto')\n"
        f"remapdsl.save(state, {str(tmp_path / 'out')!r}, {str(RULES)!r}, like={str(CHECKPOINT)!r})\n"
    )
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(cache), TMPDIR=str(temp))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=tmp_path, timeout=120)
    assert (tmp_path / "out").is_dir()
    assert [p for folder in (home, cache, temp) for p in folder.rglob("*")] == []


def _ranks_prepare_again_together(rank: int, world: int, folder: str, backend_note: str) -> dict:
    """Rank 1 edits its own copy of the rule file between two loads: both ranks prepare again (no
    rank left in a collective alone) and, the texts now differing, both refuse it (E410)."""
    whole = _whole()
    rules = Path(folder) / f"rules{rank}.remap"
    rules.write_text(RULES.read_text())
    prepared = remapdsl.prepare(str(rules), str(CHECKPOINT))
    prepared.load(_nan_like(whole))
    if rank == 1:
        rules.write_text(RULES.read_text() + "# edited on rank 1 only\n")
    try:
        prepared.load(_nan_like(whole))
    except remapdsl.RemapError as exc:
        return {"codes": [d.code for d in exc.diagnostics], "text": str(exc)}
    return {"codes": []}


def _under_each_backend(rank: int, world: int, folder: str) -> dict:
    """`_ranks_prepare_again_together` under each default group in turn (plain gloo, then
    `cuda:gloo`, NCCL's device contract), each in a folder of its own: backend -> what it returned,
    and the failures (a traceback) of any that raised."""
    results = {}

    def run(backend: str) -> list[str]:
        own = Path(folder) / backend.replace(":", "-")
        own.mkdir(exist_ok=True)
        results[backend] = _ranks_prepare_again_together(rank, world, str(own), backend)
        return []

    return {"results": results, "failures": each_backend(rank, world, folder, run)}


@pytest.fixture(scope="module")
def prepared_again(tmp_path_factory) -> list[dict]:
    """Each rank's results of the one spawn of two ranks that runs the case under both backends."""
    return run_ranks(_under_each_backend, 2, str(tmp_path_factory.mktemp("prepared")), timeout=120)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["gloo", "cuda:gloo"])
def test_a_change_seen_by_one_rank_prepares_every_rank_again(backend, prepared_again):
    assert not [f for r in prepared_again for f in r["failures"]], prepared_again
    results = [r["results"][backend] for r in prepared_again]
    assert [r["codes"] for r in results] == [["E410"], ["E410"]]
    assert all("rules1.remap" in r["text"] or "line" in r["text"] for r in results)


def test_a_load_leaves_the_collector_as_it_found_it_and_collects_during_its_reads(monkeypatch):
    """The heap is frozen only during a call, and a caller's own frozen objects stay frozen; a
    collection that runs during the reads finds garbage made then (the collector is not off)."""
    import gc

    import remapdsl.drivers.load as load_driver

    whole = _whole()
    seen = {}
    original = load_driver.run_load_plan

    def reads(*args, **kwargs):
        class Cycle:
            pass

        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        del a, b
        seen["enabled"], seen["collected"] = gc.isenabled(), gc.collect()
        return original(*args, **kwargs)

    monkeypatch.setattr(load_driver, "run_load_plan", reads)
    assert gc.get_freeze_count() == 0
    remapdsl.load(_nan_like(whole), str(CHECKPOINT), str(RULES))
    assert seen["enabled"] and seen["collected"] >= 2 and gc.get_freeze_count() == 0 and gc.isenabled()
    gc.freeze()  # the caller's own: left as it is
    try:
        frozen = gc.get_freeze_count()
        remapdsl.load(_nan_like(whole), str(CHECKPOINT), str(RULES))
        assert 0 < gc.get_freeze_count() <= frozen  # none unfrozen nor added (a few died meanwhile)
    finally:
        gc.unfreeze()


# -- a prepared object's calls act as the one-shot calls, keyword by keyword ------------------------

_KEYED = "remap 1\nlayers.{L}.w -> blocks.{L}.w | cast(bfloat16)\nv -> v\ndrop x\n"


def _outcome(call, *args) -> tuple:
    """What `call(*args)` gave, comparable: its values (tensors as lists; a save's files read back) or its errors."""
    from safetensors.torch import load_file

    def plain(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", str(value.dtype), value.tolist())
        if isinstance(value, (list, tuple)):
            return tuple(plain(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, plain(v)) for k, v in value.items()))
        if isinstance(value, Path) and value.is_dir():
            return plain({f.name: load_file(str(f)) for f in sorted(value.glob("*.safetensors"))})
        return value

    try:
        return ("done", plain(call(*args)))
    except remapdsl.RemapError as exc:
        return ("refused", tuple((d.code, d.message) for d in exc.diagnostics))


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> tuple[Path, object, dict]:
    """A checkpoint of two numbered layers, a tensor the rules drop, and its rules (a lossy cast)."""
    from checkpoints import tiny_checkpoint

    g = torch.Generator().manual_seed(0)
    folder = tiny_checkpoint(tmp_path_factory.mktemp("keyed"), {
        "layers.0.w": torch.randn(4, 3, generator=g), "layers.1.w": torch.randn(4, 3, generator=g),
        "v": torch.randn(5, generator=g), "x": torch.randn(3, generator=g)}, {})
    rules = remapdsl.language.rules_from_text(_KEYED, "keyed.remap")
    state = remapdsl.compile_rules(rules, folder, {}).empty_state_dict()
    remapdsl.load(state, folder, rules, config={})
    return folder, rules, state


def _keywords(state: dict) -> dict[str, tuple[dict, dict]]:
    """Per keyword: the keywords to pass (each changes what the call gives from its defaults') and the state
    dict to pass them with."""
    from remapdsl.sharding import LayoutPlan, Mesh, Shard

    local = {k.replace("blocks.", "stage."): v for k, v in state.items()}
    half = {k: v[:2].clone() if k.startswith("blocks.") else v for k, v in state.items()}
    layout = LayoutPlan.from_mapping({"blocks.*": [Shard(dim=0)]})
    return {
        "timeout": ({"timeout": 0}, state),
        "local": ({"local": {"stage.{}": ("blocks.{}", 0)}}, local),
        "layout": ({"layout": layout, "mesh": Mesh.of({"tp": 2})}, half),
    }


@pytest.mark.parametrize("method", ["load", "ingest", "save", "export"])
def test_each_keyword_of_a_prepared_call_acts_as_on_the_one_shot_call(method, keyed, tmp_path):
    """Every keyword a prepared object's method takes, given a value that changes what the call gives
    from its defaults', gives what the one-shot call gives with it: values, files, or the same errors; and
    the same object's next call without it gives what a one-shot call without it gives."""
    from safetensors.torch import load_file

    folder, rules, state = keyed
    pairs = load_file(str(folder / "model.safetensors"))
    prepared = remapdsl.prepare(rules, folder, config={}, strict=True)
    cases = _keywords(state)
    cases |= {"load": {"staging_bytes": ({"staging_bytes": 100}, state)},
              "ingest": {"staging_bytes": ({"staging_bytes": 100}, state)},
              "save": {"dropped": ({"dropped": "omit"}, state), "overwrite": ({"overwrite": True}, state),
                       "allow_lossy": ({"allow_lossy": True}, state)},
              "export": {"bucket_bytes": ({"bucket_bytes": 0}, state), "regions": ({"regions": True}, state),
                         "by_round": ({"by_round": True}, state), "gather": ({"gather": "tp"}, state),
                         "allow_lossy": ({"allow_lossy": True}, state)}}[method]
    if method == "export":  # one process assembles no part of a larger mesh (E414 with or without the layout)
        cases["layout"][0]["regions"] = True
    # what each call needs to write at all (the rules cast lossily and drop `x`), unless the case is that keyword
    common = {"save": {"allow_lossy": True, "dropped": "copy"}, "export": {"allow_lossy": True}}.get(method, {})
    runs = iter(range(10**6))

    def call(through, keywords, given, exists=False):
        target = {k: torch.full_like(v, float("nan")) for k, v in given.items()}
        out = tmp_path / f"out{next(runs)}"
        if exists:  # a save's destination there already
            out.mkdir()
        args = {"load": (target,), "ingest": (target, pairs), "save": (given, out), "export": (given,)}[method]
        one_shot = {"load": lambda: remapdsl.load(target, folder, rules, config={}, **keywords),
                    "ingest": lambda: remapdsl.ingest(target, pairs, rules, like=folder, config={}, **keywords),
                    "save": lambda: remapdsl.save(given, out, rules, like=folder, config={}, **keywords),
                    "export": lambda: list(remapdsl.export(given, rules, like=folder, config={}, **keywords))}
        result = one_shot[method]() if through == "one shot" else getattr(prepared, method)(*args, **keywords)
        result = list(result) if method == "export" else result
        return {"load": target, "ingest": target, "save": out, "export": result}[method] if result is not None else None

    for name, (case, given) in cases.items():
        keywords, base = common | case, {k: v for k, v in common.items() if k not in case}
        exists = name == "overwrite"
        want, plain = (_outcome(call, "one shot", k, given, exists) for k in (keywords, base))
        assert plain != want, f"{name} changes nothing here"
        # with the keyword, then without it: what the object keeps for one call never answers the other
        assert _outcome(call, "prepared", keywords, given, exists) == want, name
        assert _outcome(call, "prepared", base, given, exists) == plain, name
