"""The load cache: a later load given the same inputs reads back the inventory, compiled program and
plan that an earlier process made, and any changed input makes them again."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import remapdsl
from remapdsl.errors import RemapError
from remapdsl.language.includes import load_rules, rule_sources, sources_of
from remapdsl.language.library import display_path
from remapdsl.runtime import cache, load, prepare
from gloo import CHECK_FAILURES, shut_down

TINY = Path(__file__).resolve().parent.parent / "examples" / "tiny-qwen3-moe"
RULES = Path(__file__).resolve().parent.parent / "rules" / "qwen3_moe.remap"


@pytest.fixture
def private(tmp_path, monkeypatch):
    """A private cache folder of the test's own, files kept as soon as they are written (the
    two-second rule has a test of its own), and the checkpoint copied into the test's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("REMAPDSL_CACHE", raising=False)
    monkeypatch.setattr(cache, "SETTLED_SECONDS", 0)
    shutil.copytree(TINY, tmp_path / "ckpt")
    return tmp_path


def entries(root: Path) -> dict[str, int]:
    folder = root / "cache" / "remapdsl" / "loads"
    return {kind: len(list((folder / kind).rglob("*.pickle"))) for kind in ("inventories", "compiled", "plans")}


class Calls:
    """Counts the calls that make what the cache keeps."""

    def __init__(self, monkeypatch):
        self.made: list[str] = []
        for module, name in ((cache, "open_inventory"), (prepare, "compile_rules"), (load, "make_load_plan")):
            monkeypatch.setattr(module, name, self.counted(name, getattr(module, name)))

    def counted(self, name, fn):
        def call(*args, **kwargs):
            self.made.append(name)
            return fn(*args, **kwargs)
        return call

    def take(self) -> list[str]:
        made, self.made = self.made, []
        return made


def load_tiny(root: Path, rules=RULES, **kwargs) -> dict:
    compiled = remapdsl.compile_rules(remapdsl.load_rules(rules), root / "ckpt")
    state = {k: torch.full_like(v, -1) for k, v in compiled.empty_state_dict().items()}
    remapdsl.load(state, str(root / "ckpt"), rules, **kwargs)
    return state


def test_a_second_load_reads_back_the_headers_the_compiled_program_and_the_plan(private, monkeypatch):
    calls = Calls(monkeypatch)
    first = load_tiny(private)
    assert calls.take() == ["open_inventory", "compile_rules", "make_load_plan"]
    assert entries(private) == {"inventories": 1, "compiled": 1, "plans": 1}
    again = load_tiny(private)
    assert calls.take() == []  # nothing made again
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    monkeypatch.setenv("REMAPDSL_CACHE", "1")  # any value but the off ones keeps it on
    load_tiny(private)
    assert calls.take() == []


def test_what_is_read_back_equals_what_is_made(private):
    load_tiny(private)
    inventory, key = cache.open_checkpoint(private / "ckpt")
    assert key is not None and inventory == remapdsl.open_checkpoint(private / "ckpt")
    ruleset = remapdsl.load_rules(RULES)
    rule_files = sources_of(ruleset)
    config = json.loads((private / "ckpt" / "config.json").read_text())
    compiled_key = cache.compiled_key(key, rule_files, config, True)
    there, compiled = cache.kept_compiled(compiled_key)
    assert there and compiled_key is not None
    assert compiled.digest() == remapdsl.compile_rules(ruleset, private / "ckpt").digest()
    assert rule_sources(RULES) == rule_files  # and the files the program was read from, unchanged


def test_a_program_loaded_before_is_not_parsed_again(private, monkeypatch):
    """A load whose compiled program is kept reads its rule files' text, not their IR; whatever
    would change which files the program reads (a file's text, a file appearing where an include
    looks) makes it parse and check the rules again."""
    rules = private / "rules"
    rules.mkdir()
    (rules / "top.remap").write_text('remap 1\ninclude "qwen3_moe"\n')
    load_tiny(private, rules / "top.remap")
    parsed = []
    monkeypatch.setattr(prepare, "load_rules", lambda *a, **k: parsed.append(1) or load_rules(*a, **k))
    calls = Calls(monkeypatch)
    first = load_tiny(private, rules / "top.remap")
    assert parsed == [] and calls.take() == []
    # a file of the shipped name beside the top-level file: the include now reads it instead
    shutil.copy(RULES, rules / "qwen3_moe")
    (rules / "qwen3_moe").write_text((rules / "qwen3_moe").read_text() + "\n# a local copy\n")
    assert rule_sources(rules / "top.remap") is None
    again = load_tiny(private, rules / "top.remap")
    assert parsed == [1] and calls.take() == ["compile_rules", "make_load_plan"]
    assert all(torch.equal(again[k], first[k]) for k in first)
    assert [path for path, _ in rule_sources(rules / "top.remap")] == \
        [str(rules / "top.remap"), display_path((rules / "qwen3_moe").resolve())]
    (rules / "qwen3_moe").write_text((rules / "qwen3_moe").read_text() + "# edited\n")  # an included file's text
    assert rule_sources(rules / "top.remap") is None
    load_tiny(private, rules / "top.remap")
    assert parsed == [1, 1] and calls.take() == ["compile_rules", "make_load_plan"]


def test_rules_read_back_but_compiled_anew_are_parsed_from_the_files(private, monkeypatch):
    """The files are unchanged, the config is not: the program is compiled again, from the files."""
    load_tiny(private)
    calls = Calls(monkeypatch)
    config = {**json.loads((private / "ckpt" / "config.json").read_text()), "unused_by_the_rules": 2}
    load_tiny(private, config=config)
    assert calls.take() == ["compile_rules", "make_load_plan"]


@pytest.mark.parametrize("change, made", [
    ("rules", ["compile_rules", "make_load_plan"]),
    ("config", ["compile_rules", "make_load_plan"]),
    ("strict", ["compile_rules", "make_load_plan"]),
    ("file replaced", ["open_inventory", "compile_rules", "make_load_plan"]),
    ("file touched", ["open_inventory", "compile_rules", "make_load_plan"]),
    ("file added", ["open_inventory", "compile_rules", "make_load_plan"]),
    ("layout", ["make_load_plan"]),
])
def test_each_input_changed_makes_what_depends_on_it_again(private, monkeypatch, change, made):
    rules = private / "qwen3_moe.remap"
    shutil.copy(RULES, rules)
    load_tiny(private, rules)
    calls = Calls(monkeypatch)
    kwargs: dict = {}
    ckpt = private / "ckpt"
    if change == "rules":
        rules.write_text(rules.read_text() + "\n# the same rules, another text\n")
    elif change == "config":
        kwargs["config"] = {**json.loads((ckpt / "config.json").read_text()), "unused_by_the_rules": 1}
    elif change == "strict":
        kwargs["strict"] = False
    elif change == "file replaced":  # the same bytes in a new file (another inode)
        shutil.copy(ckpt / "model.safetensors", private / "copy")
        os.replace(private / "copy", ckpt / "model.safetensors")
    elif change == "file touched":
        stat = os.stat(ckpt / "model.safetensors")
        os.utime(ckpt / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    elif change == "file added":  # another file beside it that an index could name
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: "model.safetensors"
                                            for k in remapdsl.open_checkpoint(ckpt / "model.safetensors").tensors}}))
    else:  # the same tensors held another way: rank 0 of two, tensor parallel
        from remapdsl.sharding import Mesh, read_layout
        layout = read_layout(TINY.parent / "tp2_layout.json")
        compiled = remapdsl.compile_rules(remapdsl.load_rules(rules), ckpt)
        mesh = Mesh.of({"tp": 2})
        held = remapdsl.sharding.holdings.held_by_layout(compiled, layout, mesh, 0)
        state = {k: torch.empty(s.shape, dtype=getattr(torch, compiled.runtime_tensor(k).dtype))
                 for k, s in held.items()}
        remapdsl.load(state, str(ckpt), str(rules), layout=layout, mesh=mesh)
        assert calls.take() == made
        return
    load_tiny(private, rules, **kwargs)
    assert calls.take() == made
    load_tiny(private, rules, **kwargs)  # and kept: the same inputs again make nothing
    assert calls.take() == []


def test_files_changed_in_the_last_two_seconds_are_not_kept(private, monkeypatch):
    """A file's times move in clock ticks: one rewritten within the tick of an earlier look keeps
    every number the cache would compare, so nothing is kept of files that new."""
    monkeypatch.setattr(cache, "SETTLED_SECONDS", 2.0)
    os.utime(private / "ckpt" / "model.safetensors")  # changed now
    load_tiny(private)
    assert entries(private) == {"inventories": 0, "compiled": 0, "plans": 0}
    assert cache.open_checkpoint(private / "ckpt")[1] is None


@pytest.mark.parametrize("off", ["0", "off", "no", "false", "OFF"])
def test_remapdsl_cache_off_keeps_nothing(private, monkeypatch, off):
    monkeypatch.setenv("REMAPDSL_CACHE", off)
    calls = Calls(monkeypatch)
    load_tiny(private)
    load_tiny(private)
    assert calls.take() == ["open_inventory", "compile_rules", "make_load_plan"] * 2
    assert not (private / "cache" / "remapdsl").exists()


def test_a_damaged_entry_is_made_again_and_replaced(private, monkeypatch):
    first = load_tiny(private)
    folder = private / "cache" / "remapdsl" / "loads"
    for entry in folder.rglob("*.pickle"):
        entry.write_bytes(b"not a pickle")
    calls = Calls(monkeypatch)
    again = load_tiny(private)
    assert calls.take() == ["open_inventory", "compile_rules", "make_load_plan"]
    assert all(torch.equal(again[k], first[k]) for k in first)
    load_tiny(private)
    assert calls.take() == []  # the damaged entries were written anew


def test_an_entry_under_another_key_is_not_read(private, monkeypatch):
    """Entries are named by the first 40 hex digits of their key and hold the whole key: one that
    holds another key is not taken for this one."""
    load_tiny(private)
    (entry,) = (private / "cache" / "remapdsl" / "loads" / "compiled").glob("*.pickle")
    import pickle
    key, value = pickle.loads(entry.read_bytes())
    entry.write_bytes(pickle.dumps((key[:40] + "0" * 24, value)))
    calls = Calls(monkeypatch)
    load_tiny(private)
    assert calls.take() == ["compile_rules"]  # the plan's key is the same: it is read back


def test_a_failing_compile_is_not_kept(private, monkeypatch):
    rules = private / "broken.remap"
    rules.write_text("remap 1\nmodel.embed_tokens.weight -> embed\n")  # leaves every other key unused
    for _ in range(2):
        with pytest.raises(RemapError) as failed:
            remapdsl.load({}, str(private / "ckpt"), str(rules))
        assert failed.value.diagnostics[0].code == "E202"
    assert entries(private)["compiled"] == 0


def test_a_format_the_program_registered_turns_the_compile_cache_off(private, monkeypatch):
    from remapdsl.quant import register_format, unregister_format
    from formats import Int8Row

    class Mine(Int8Row):
        name = "cache_test_int8_row"

    register_format(Mine())
    try:
        calls = Calls(monkeypatch)
        load_tiny(private)
        load_tiny(private)
    finally:
        unregister_format("cache_test_int8_row")
    assert calls.take() == ["open_inventory", "compile_rules", "make_load_plan", "compile_rules", "make_load_plan"]
    assert entries(private) == {"inventories": 1, "compiled": 0, "plans": 0}


def test_an_inventory_given_is_not_kept(private, monkeypatch):
    inventory = remapdsl.open_checkpoint(private / "ckpt")
    compiled = remapdsl.compile_rules(remapdsl.load_rules(RULES), inventory)
    remapdsl.load(compiled.empty_state_dict(), inventory, str(RULES))
    assert entries(private) == {"inventories": 0, "compiled": 0, "plans": 0}


def test_the_folder_keeps_its_newest_entries(private, monkeypatch):
    monkeypatch.setattr(cache, "ENTRIES", 2)
    for n in range(6):
        cache._put("plans", f"{n:040d}", n)
        time.sleep(0.01)
    kept = sorted(p.stem for p in (private / "cache" / "remapdsl" / "loads" / "plans").rglob("*.pickle"))
    assert len(kept) == 3 and kept[-1] == f"{5:040d}"  # trimmed to two past four, then one more written
    assert cache._get("plans", f"{5:040d}") == (True, 5) and cache._get("plans", f"{0:040d}") == (False, None)


def test_a_shard_in_a_subfolder_rewritten_since_is_read_anew(private):
    """An index may name shards in subfolders, which the folder's listing does not show: a kept
    inventory is checked against every file it was read from, so a shard rewritten in place, its
    modification time put back, is read again, not through stale offsets."""
    ckpt = private / "nested"
    (ckpt / "sub").mkdir(parents=True)
    tensors = {k: torch.full((2, 3), float(i)) for i, k in enumerate(["a.w", "b.w"])}
    save_file(tensors, str(ckpt / "sub" / "part.safetensors"))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "sub/part.safetensors" for k in tensors}}))
    rules = private / "same.remap"
    rules.write_text("remap 1\na.w -> a.w\nb.w -> b.w\n")

    def load_nested() -> dict:
        state = {k: torch.zeros(2, 3) for k in tensors}
        remapdsl.load(state, str(ckpt), str(rules))
        return state

    assert torch.equal(load_nested()["b.w"], tensors["b.w"])
    assert entries(private)["inventories"] == 1
    shard = ckpt / "sub" / "part.safetensors"
    before = os.stat(shard)
    save_file({"a.w": torch.full((2, 3), 7.0), "b.w": torch.full((2, 3), 9.0)}, str(shard), {"v": "2"})
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    got = load_nested()
    assert torch.equal(got["a.w"], torch.full((2, 3), 7.0)) and torch.equal(got["b.w"], torch.full((2, 3), 9.0))


def test_a_config_with_look_alike_values_is_not_kept(private, monkeypatch):
    """A config whose JSON text stands for another config (a tuple read back as a list) is compiled
    each time."""
    config = {**json.loads((private / "ckpt" / "config.json").read_text()), "extra": (1, 2)}
    calls = Calls(monkeypatch)
    load_tiny(private, config=config)
    load_tiny(private, config=config)
    assert calls.take().count("compile_rules") == 2


def test_the_cache_is_not_read_from_a_folder_others_can_write(private, monkeypatch):
    load_tiny(private)
    (private / "cache" / "remapdsl" / "loads" / "compiled").chmod(0o777)
    calls = Calls(monkeypatch)
    load_tiny(private)
    assert calls.take() == ["compile_rules"]  # not read from there; the plan, kept elsewhere, is


def _worker(rank: int, folder: str, out: str) -> None:
    import torch.distributed as dist

    os.environ["XDG_CACHE_HOME"] = str(Path(folder) / "cache")
    os.environ.pop("REMAPDSL_CACHE", None)  # on, whatever the run around the test says
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    result: dict = {}
    try:
        from remapdsl.sharding import Mesh, read_layout
        from remapdsl.sharding.holdings import held_by_layout

        layout = read_layout(TINY.parent / "tp2_layout.json")
        mesh = Mesh.of({"tp": 2})
        ckpt = str(Path(folder) / "ckpt")
        compiled = remapdsl.compile_rules(remapdsl.load_rules(RULES), ckpt)
        shards = []
        for again in (False, True):
            if again:  # the second load makes nothing: every rank reads back what it kept
                def made_again(*args, **kwargs):
                    raise AssertionError("made again on a second load")

                prepare.compile_rules = load.make_load_plan = cache.open_inventory = made_again
            held = held_by_layout(compiled, layout, mesh, rank)
            state = {k: torch.full(s.shape, -1, dtype=getattr(torch, compiled.runtime_tensor(k).dtype))
                     for k, s in held.items()}
            remapdsl.load(state, ckpt, str(RULES), layout=layout, mesh=mesh)
            shards.append(state)
        result["equal"] = all(torch.equal(shards[0][k], shards[1][k]) for k in shards[0])
        result["sums"] = {k: float(v.double().sum()) for k, v in shards[1].items()}
    except CHECK_FAILURES as exc:
        result["error"] = repr(exc)
    finally:
        shut_down()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_two_ranks_read_back_what_they_kept(tmp_path):
    """In a job, rank 0's headers and each rank's compiled program and plan are kept; a second load
    on the same ranks reads them back and fills the same shards."""
    import torch.multiprocessing as mp

    shutil.copytree(TINY, tmp_path / "ckpt")
    time.sleep(cache.SETTLED_SECONDS + 0.1)  # files this new are not kept
    mp.spawn(_worker, args=(str(tmp_path), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r.get("error") for r in results] == [None, None]
    assert all(r["equal"] for r in results)
    assert results[0]["sums"] != results[1]["sums"]  # each rank its own half
    assert entries(tmp_path) == {"inventories": 1, "compiled": 1, "plans": 2}  # one plan a rank
