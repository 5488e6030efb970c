"""remapdsl under any default process group, with its own bound on every wait.

A GPU job's default group is usually NCCL's, which has no backend for CPU tensors; `cuda:gloo`
gives a CPU machine a group with that contract. Every control exchange must go over a CPU-capable
group of remapdsl's own, made once per default group. And a rank that never makes a call must be
named by every rank that did, within the call's `timeout`, not after the group's 30 minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo import CHECK_FAILURES, join_group, run_with_bound

import remapdsl
from remapdsl.runtime import bounds
from remapdsl.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = str(ROOT / "examples" / "tiny-qwen3-moe")
RULES = str(ROOT / "rules" / "qwen3_moe.remap")
TORCHTITAN = importlib.util.find_spec("torchtitan") is not None  # a test extra: its adapter is checked where installed


def _whole() -> dict[str, torch.Tensor]:
    state = remapdsl.compile_rules(remapdsl.load_rules(RULES), CHECKPOINT).empty_state_dict()
    remapdsl.load(state, CHECKPOINT, RULES)
    return state


def _cuda_only_group(rank: int, world: int) -> dict:
    """On a `cuda:gloo` default group: torch's own broadcast of a CPU tensor fails (what every
    exchange of remapdsl did before it had a control group), and two loads succeed over one
    control group made for them."""
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.broadcast(torch.zeros(1), src=0)
    made = []
    new_group = dist.new_group

    def counted(*args, **kwargs):
        made.append(kwargs.get("backend"))
        return new_group(*args, **kwargs)

    dist.new_group = counted
    try:
        whole = _whole()
        state = {k: torch.full_like(v, float("nan")) for k, v in whole.items()}
        remapdsl.load(state, CHECKPOINT, RULES)
        remapdsl.load(state, CHECKPOINT, RULES)
    finally:
        dist.new_group = new_group
    assert all(torch.equal(state[k], whole[k]) for k in whole)
    return {"groups made": made}


@pytest.mark.distributed
def test_a_cuda_only_default_group_refuses_cpu_collectives_and_loads_still_work():
    results = run_ranks(_cuda_only_group, 2, backend="cuda:gloo")
    assert results == [{"groups made": ["gloo"]}] * 2  # one control group, made once, reused


def _one_rank_never_calls(rank: int, rendezvous: str, out: str, backend: str, timeout: float) -> None:
    """Ranks 0 and 1 load (then, on gloo, call each other entry point); rank 2 joins the group and never
    calls remapdsl, staying alive until the others have reported."""
    join_group(rank, 3, rendezvous, backend, seconds=600)  # the group's own timeout: far beyond the call's
    if rank == 2:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(Path(out, f"late{r}.json").exists() for r in (0, 1)):
            time.sleep(0.2)
        os._exit(0)
    state = remapdsl.compile_rules(remapdsl.load_rules(RULES), CHECKPOINT).empty_state_dict()
    calls = {"load": lambda: remapdsl.load(state, CHECKPOINT, RULES, timeout=timeout)}
    if backend == "gloo":  # every entry point's `timeout=`, one after the other
        from remapdsl.dcp import RuleStorageReader

        calls.update({
            "save": lambda: remapdsl.save(state, Path(out, f"saved{rank}"), RULES, like=CHECKPOINT, timeout=timeout),
            "export": lambda: list(remapdsl.export(state, RULES, like=CHECKPOINT, timeout=timeout)),
            "ingest": lambda: remapdsl.ingest(state, {}, RULES, like=CHECKPOINT, timeout=timeout),
            "prepare": lambda: remapdsl.prepare(RULES, CHECKPOINT, timeout=timeout),
            "convert": lambda: remapdsl.convert(CHECKPOINT, Path(out, f"converted{rank}"), RULES, timeout=timeout),
            "RuleStorageReader": lambda: RuleStorageReader(CHECKPOINT, RULES, timeout=timeout)})
        if TORCHTITAN:
            from remapdsl.torchtitan import RuleStateDictAdapter

            calls["RuleStateDictAdapter"] = lambda: RuleStateDictAdapter(
                None, CHECKPOINT, rules=RULES, timeout=timeout).to_hf(state)
    seen = {}
    for name, call in calls.items():
        start = time.monotonic()
        try:
            call()
            seen[name] = {"type": None}
        except remapdsl.RemapError as exc:
            seen[name] = {"type": type(exc).__name__, "codes": [d.code for d in exc.diagnostics], "text": str(exc),
                          "failed_ranks": list(getattr(exc, "failed_ranks", ()))}
        except CHECK_FAILURES:
            seen[name] = {"type": "escaped", "text": traceback.format_exc()}
        seen[name]["seconds"] = time.monotonic() - start
    Path(out, f"late{rank}.json").write_text(json.dumps(seen))
    deadline = time.monotonic() + 60  # the other caller may still be in its last call: leave after it
    while time.monotonic() < deadline and not Path(out, f"late{1 - rank}.json").exists():
        time.sleep(0.2)
    os._exit(1)  # the group is broken: leave as a job's rank does on an uncaught error


@pytest.mark.distributed
@pytest.mark.parametrize("backend, timeout", [("gloo", 2.0), ("cuda:gloo", 0.0004)])
def test_a_rank_that_never_calls_is_named_by_the_others_within_the_timeout(backend, timeout, tmp_path):
    """Every entry point that takes a `timeout=` (load, save, export, ingest, prepare, convert, the DCP
    reader, the torchtitan adapter) is bounded by it. Under cuda:gloo the ranks wait first for the control group's making; a
    bound under a millisecond (which torch would read as none at all) is still a bound."""
    alive = run_with_bound(_one_rank_never_calls, 3, (str(tmp_path / "rendezvous"), str(tmp_path), backend, timeout),
                           90)
    assert not alive, f"ranks {alive} still running"
    phase = "reading the checkpoint's headers" if backend == "gloo" else "making the group for control exchanges"
    phases = dict.fromkeys(("save", "export", "ingest"), "naming the tensors")  # they open no checkpoint first
    for r in (0, 1):
        calls = json.loads((tmp_path / f"late{r}.json").read_text())
        assert set(calls) == ({"load"} if backend != "gloo" else
                              {"load", "save", "export", "ingest", "prepare", "convert", "RuleStorageReader"}
                              | ({"RuleStateDictAdapter"} if TORCHTITAN else set()))
        for name, seen in calls.items():
            assert seen["type"] == "RemapError" and seen["codes"] == ["E415"], (name, seen)
            waited = f"rank {r} waited {timeout:g} s while {phases.get(name, phase)}: rank 2 never arrived"
            assert waited in seen["text"], (name, seen)
            assert seen["failed_ranks"] == [2], (name, seen)
            assert seen["seconds"] < timeout + bounds.ROLL_CALL_SECONDS + 3, (name, seen)


def entry_points(out: Path) -> dict:
    """Every public call that takes `timeout=`, on the bundled example, each taking its keywords."""
    from remapdsl.dcp import RuleStorageReader

    state = _whole()
    pairs = {k: v for k, v in remapdsl.export(state, RULES, like=CHECKPOINT)}
    prepared = remapdsl.prepare(RULES, CHECKPOINT)
    calls = {
        "load": lambda **kw: remapdsl.load(state, CHECKPOINT, RULES, **kw),
        "save": lambda **kw: remapdsl.save(state, out / "saved", RULES, like=CHECKPOINT, **kw),
        "export": lambda **kw: list(remapdsl.export(state, RULES, like=CHECKPOINT, **kw)),
        "ingest": lambda **kw: remapdsl.ingest(state, pairs, RULES, like=CHECKPOINT, **kw),
        "prepare": lambda **kw: remapdsl.prepare(RULES, CHECKPOINT, **kw),
        "convert": lambda **kw: remapdsl.convert(CHECKPOINT, out / "converted", RULES, **kw),
        "prepared.load": lambda **kw: prepared.load(state, **kw),
        "prepared.save": lambda **kw: prepared.save(state, out / "saved", **kw),
        "prepared.export": lambda **kw: list(prepared.export(state, **kw)),
        "prepared.ingest": lambda **kw: prepared.ingest(state, pairs, **kw),
        "RuleStorageReader": lambda **kw: RuleStorageReader(CHECKPOINT, RULES, **kw)}
    if TORCHTITAN:
        from remapdsl.torchtitan import RuleStateDictAdapter

        calls["RuleStateDictAdapter"] = lambda **kw: RuleStateDictAdapter(None, CHECKPOINT, rules=RULES, **kw)
    return calls


@pytest.fixture(scope="module")
def calls(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("out")
    return out, entry_points(out)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "60", True])
def test_every_entry_point_refuses_a_timeout_that_is_no_positive_duration(timeout, calls):
    """Refused before any work (nothing written), whatever the call."""
    out, calls = calls
    each_refuses(calls, {"timeout": timeout}, f"timeout={timeout!r} is not a positive, finite number of seconds "
                 "(or a datetime.timedelta)", f"the default is {bounds.DEFAULT_TIMEOUT:g} s: how long a rank waits "
                 "at one exchange for the others")
    assert not any(out.iterdir())


def each_refuses(calls: dict, keywords: dict, message: str, hint: str | None) -> None:
    """Each of `calls`, given `keywords`, refused with E416, `message` and `hint`."""
    for name, call in calls.items():
        with pytest.raises(remapdsl.RemapError) as info:
            call(**keywords)
        d = info.value.diagnostic
        assert (d.code, d.message, d.hint) == ("E416", message, hint), (name, str(info.value))


_LAYOUT = "a LayoutPlan (`remapdsl.read_layout(path)`, `LayoutPlan.from_mapping(...)`)"
_MESH = "a Mesh (`remapdsl.parse_mesh(\"tp=2\")`, `Mesh.of({\"tp\": 2})`)"


@pytest.mark.parametrize("argument, value, message", [
    ("layout", "colwise", f"layout= is a str, not {_LAYOUT}"),
    ("layout", {"*": "colwise"}, f"layout= is a dict, not {_LAYOUT}"),
    ("mesh", "tp=2", f"mesh= is a str, not {_MESH}"),
    ("mesh", {"tp": 2}, f"mesh= is a dict, not {_MESH}"),
])
def test_every_call_that_places_tensors_names_a_layout_or_mesh_of_another_kind(argument, value, message, calls):
    """A layout or mesh as the command line writes it (a string, a mapping) where an object is due: E416
    naming the argument and how to make one, never an AttributeError from deep inside."""
    out, calls = calls
    each_refuses({name: calls[name] for name in ("load", "save", "export", "ingest", "prepared.load", "prepared.save",
                                                 "prepared.export", "prepared.ingest")}, {argument: value}, message, None)
    with pytest.raises(remapdsl.RemapError) as info:
        compiled = remapdsl.compile_rules(remapdsl.load_rules(RULES), CHECKPOINT)
        remapdsl.plan_rank(compiled, remapdsl.open_checkpoint(CHECKPOINT), **{
            "layout": remapdsl.read_layout(Path(CHECKPOINT).parent / "tp2_layout.json"),
            "mesh": remapdsl.parse_mesh("tp=2"), argument: value}, rank=0)
    assert (info.value.diagnostic.code, info.value.diagnostic.message) == ("E416", message)
    assert not any(out.iterdir())


_FLAGS = {"strict": ("load", "prepare"), "read_replicated_once": ("load", "prepared.load"),
          "overwrite": ("save", "convert", "prepared.save"), "requantize": ("save", "prepared.save"),
          "allow_lossy": ("save", "export", "prepared.save", "prepared.export"),
          "regions": ("export", "prepared.export"), "by_round": ("export", "prepared.export"), "reverse": ("convert",)}


@pytest.mark.parametrize("flag", sorted(_FLAGS))
def test_every_flag_is_true_or_false_never_a_truthy_word(flag, calls):
    """`strict="no"` would be taken as true: a flag of another kind is E416, before any work."""
    out, calls = calls
    each_refuses({name: calls[name] for name in _FLAGS[flag]}, {flag: "no"}, f"{flag}= is a str, not True or False",
                 None)
    assert not any(out.iterdir())


_PATH, _FOLDER = "a checkpoint folder's path", "a folder's path"
_RULES = "a rule file's path, a shipped name (`\"qwen3_moe\"`) or a RuleSet"


@pytest.mark.parametrize("argument, value, given, wanted", [
    ("checkpoint", 5, "an int", _PATH), ("src", None, "None", _PATH), ("like", 5, "an int", _PATH + ", or None"),
    ("folder", None, "None", _FOLDER), ("dst", 5, "an int", _FOLDER), ("rules", None, "None", _RULES),
    ("config", "x", "a str", "a mapping of config keys to values, or None"),
    ("config", [("a", 1)], "a list", "a mapping of config keys to values, or None"),
    ("pairs", 5, "an int", "a mapping or an iterable of (checkpoint key, tensor) pairs"),
    ("gather", 5, "an int", "a tuple of mesh dim names")])
def test_every_call_names_a_path_rules_config_or_pairs_of_another_kind(argument, value, given, wanted, tmp_path):
    """E416 naming the argument, before any work, never a TypeError from `os.fspath` or `dict()` inside."""
    state, prepared = _whole(), remapdsl.prepare(RULES, CHECKPOINT)
    a = {"checkpoint": CHECKPOINT, "src": CHECKPOINT, "like": CHECKPOINT, "folder": tmp_path / "saved",
         "dst": tmp_path / "converted", "rules": RULES, "config": None, "pairs": {}, "gather": ()} | {argument: value}
    calls = {
        "load": lambda: remapdsl.load(state, a["checkpoint"], a["rules"], config=a["config"]),
        "prepare": lambda: remapdsl.prepare(a["rules"], a["checkpoint"], config=a["config"]),
        "save": lambda: remapdsl.save(state, a["folder"], a["rules"], like=a["like"], config=a["config"]),
        "export": lambda: list(remapdsl.export(state, a["rules"], like=a["like"], config=a["config"],
                                               gather=a["gather"])),
        "ingest": lambda: remapdsl.ingest(state, a["pairs"], a["rules"], like=a["like"], config=a["config"]),
        "convert": lambda: remapdsl.convert(a["src"], a["dst"], a["rules"], like=a["like"]),
        "prepared.save": lambda: prepared.save(state, a["folder"]),
        "prepared.export": lambda: list(prepared.export(state, gather=a["gather"])),
        "prepared.ingest": lambda: prepared.ingest(state, a["pairs"])}
    takes = {"checkpoint": ("load", "prepare"), "src": ("convert",), "dst": ("convert",),
             "like": ("save", "export", "ingest", "convert"), "folder": ("save", "prepared.save"),
             "rules": ("load", "prepare", "save", "export", "ingest", "convert"),
             "config": ("load", "prepare", "save", "export", "ingest"), "pairs": ("ingest", "prepared.ingest"),
             "gather": ("export", "prepared.export")}
    each_refuses({name: (lambda call=calls[name], **kw: call()) for name in takes[argument]}, {},
                 f"{argument}= is {given}, not {wanted}", None)
    assert not any(tmp_path.iterdir())


def test_an_ingest_names_an_item_of_the_pairs_that_is_no_pair():
    """Each item that is no (key, tensor) pair is E546 naming its place, and the pairs after it are still read."""
    state = _whole()
    pairs = [5, *remapdsl.export(state, RULES, like=CHECKPOINT), ("a", "b", "c")]
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.ingest(_whole(), pairs, RULES, like=CHECKPOINT)
    assert [(d.code, d.message) for d in info.value.diagnostics] == [
        ("E546", "item 1 of the pairs is 5, not a (checkpoint key, tensor) pair"),
        ("E546", f"item {len(pairs)} of the pairs is ('a', 'b', 'c'), not a (checkpoint key, tensor) pair")]


@pytest.mark.parametrize("state", [[torch.zeros(1)], None, torch.zeros(2)], ids=["a list", "None", "a tensor"])
def test_every_call_names_a_state_dict_that_is_no_mapping(state, tmp_path):
    """A list of tensors, None or one tensor where a state dict is due: E416 naming it, not an AttributeError."""
    given = {list: "a list", type(None): "None", torch.Tensor: "a Tensor"}[type(state)]
    for call in (lambda: remapdsl.load(state, CHECKPOINT, RULES),
                 lambda: remapdsl.save(state, tmp_path / "out", RULES, like=CHECKPOINT),
                 lambda: list(remapdsl.export(state, RULES, like=CHECKPOINT)),
                 lambda: remapdsl.ingest(state, {}, RULES, like=CHECKPOINT)):
        with pytest.raises(remapdsl.RemapError) as info:
            call()
        d = info.value.diagnostic
        assert (d.code, d.message) == ("E416", (f"state_dict= is {given}, not a mapping of names to tensors "
                                               "(`model.state_dict()`, or the module itself)"))
    assert not (tmp_path / "out").exists()
