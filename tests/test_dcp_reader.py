"""`dcp.load` through `remapdsl.dcp.RuleStorageReader` on real gloo process groups.

Every case loads the same state dict twice, through DCP's default planner with the rule reader and
through `remapdsl.load`, and the two must agree bit for bit (DTensors sharded on several dims,
replicated, 2-D meshes, and plain tensors), with each rank reading exactly the bytes `remapdsl.load`
reads for the same shards. Identity rules must also agree with DCP's own HuggingFaceStorageReader.
Errors (a key the rules do not make, a rule error, a missing checkpoint, a file gone before the
reads) must reach every rank as RemapErrors. One spawn of ranks runs many checks: the 2-rank one
under a default group with NCCL's device contract (`cuda:gloo`), DCP's own collectives on a CPU
group (`process_group=`) as an NCCL job loading CPU tensors has them.
"""

from __future__ import annotations

import difflib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from depth import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import DefaultLoadPlanner

import remapdsl
from remapdsl.runtime.bounds import control_group
from remapdsl.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
QWEN3_MOE = str(ROOT / "examples" / "tiny-qwen3-moe")
IDENTITY = "remap 1\n{P:path} -> {P}\n"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (checkpoint folder, rules): stacking and fusing (qwen3_moe), interleaving
    (llama_fused), dequantizing (deepseek_v3_fp8 on block-FP8 values; gpt_oss: MXFP4 experts,
    4-bit values packed two a byte, gate and up interleaved). transformers is imported
    here only: the rank processes import this module, and need not pay for it."""
    pytest.importorskip("transformers")
    from hf_models import CASES, build, fp8_release, gpt_oss_mxfp4_release

    root = tmp_path_factory.mktemp("dcp")
    llama = build(CASES["llama"], root / "llama").folder
    deepseek = build(CASES["deepseek_v3"], root / "deepseek_v3").folder
    fp8 = fp8_release(deepseek, root / "deepseek_v3_fp8", (4, 4))
    return {"qwen3_moe": (QWEN3_MOE, str(ROOT / "rules" / "qwen3_moe.remap")),
            "llama_fused": (str(llama), str(ROOT / "rules" / "llama_fused.remap")),
            "deepseek_v3_fp8": (str(fp8), str(ROOT / "rules" / "deepseek_v3_fp8.remap")),
            "gpt_oss": (str(gpt_oss_mxfp4_release(root / "gpt_oss")), str(ROOT / "rules" / "gpt_oss.remap"))}


# ------------------------------------------------------------------------------------ on the ranks


def _placements(index: int, ndim: int, mesh_ndim: int):
    """Varied placements: tensor `index` of `ndim` dims on a mesh of `mesh_ndim` dims."""
    from torch.distributed.tensor import Replicate, Shard

    choices = [Replicate()] + [Shard(d) for d in range(ndim)]
    return [choices[(index + 2 * m + 1) % len(choices)] for m in range(mesh_ndim)]


def _dtensors(like: dict, mesh) -> dict:
    """Zeroed DTensors shaped as `like`, placed by `_placements`; made from their local shards
    (`distribute_tensor` would make collectives a tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for i, (k, v) in enumerate(sorted(like.items())):
        placements = _placements(i, v.dim(), mesh.ndim)
        shape, _ = compute_local_shape_and_global_offset(v.shape, mesh, placements)
        out[k] = DTensor.from_local(torch.zeros(shape, dtype=v.dtype), mesh, placements, run_check=False,
                                    shape=v.shape, stride=v.stride())
    return out


def _dcp_load(state_dict: dict, reader, planner=None) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=control_group())


def _dcp_load_from(state_dict: dict, reader, checkpoint_id: str) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=reader, process_group=control_group())


def _differing(got: dict, want: dict) -> list[str]:
    """Keys whose local tensors differ in a bit (or in shape or dtype)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    return [k for k in want if local(got[k]).dtype != local(want[k]).dtype
            or local(got[k]).shape != local(want[k]).shape
            or not torch.equal(local(got[k]).contiguous().view(torch.uint8),
                               local(want[k]).contiguous().view(torch.uint8))]


def _agree(rank: int, world: int, cases: dict, mesh_shape: tuple[int, ...]) -> dict:
    """Per case: DTensors and plain tensors through the rule reader equal remapdsl.load's, and
    the reader read what remapdsl.load reads for the same shards."""
    from torch.distributed.device_mesh import init_device_mesh

    from remapdsl.dcp import RuleStorageReader

    mesh = init_device_mesh("cpu", mesh_shape)
    out = {}
    for name, (folder, rules) in cases.items():
        compiled = remapdsl.compile_rules(remapdsl.load_rules(rules), remapdsl.open_checkpoint(folder), None)
        whole = compiled.empty_state_dict()
        remapdsl.load(whole, folder, rules)
        reader = RuleStorageReader(folder, rules)

        plain = {k: torch.zeros_like(v) for k, v in whole.items()}
        _dcp_load(plain, reader)
        assert _differing(plain, whole) == [], f"{name}: plain tensors differ"

        by_dcp, by_remapdsl = _dtensors(whole, mesh), _dtensors(whole, mesh)
        _dcp_load(by_dcp, reader)
        report = remapdsl.load(by_remapdsl, folder, rules)
        assert _differing(by_dcp, by_remapdsl) == [], f"{name}: DTensors differ"
        assert reader.report.bytes_read == report.bytes_read, name
        assert reader.report.bytes_owned == report.bytes_owned, name
        held = sum(t.to_local().nbytes for t in by_dcp.values())
        out[name] = {"bytes_read": reader.report.bytes_read, "held": held, "requests": reader.report.requests}
    return out


def _identity(folder: str, mesh_shape: tuple[int, ...]):
    """DTensors through identity rules and through HuggingFaceStorageReader: whether they agree
    (and the rule reader read what the rank holds), the reader, its DTensors, the rules."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh

    from remapdsl.dcp import RuleStorageReader
    from remapdsl.language import rules_from_text

    mesh = init_device_mesh("cpu", mesh_shape)
    identity = rules_from_text(IDENTITY, "identity.remap")
    like = remapdsl.compile_rules(identity, remapdsl.open_checkpoint(folder), None).empty_state_dict()
    ours, theirs = _dtensors(like, mesh), _dtensors(like, mesh)
    reader = RuleStorageReader(folder, identity)
    _dcp_load(ours, reader)
    _dcp_load(theirs, HuggingFaceStorageReader(folder))
    agree = _differing(ours, theirs) == [] and reader.report.bytes_read == sum(t.to_local().nbytes
                                                                              for t in ours.values())
    return agree, reader, ours, identity, like, mesh


def _identity_and_errors(rank: int, world: int, folder: str, broken: str) -> dict:
    """Identity rules against HuggingFaceStorageReader; then each error case, as codes per rank."""
    from remapdsl.dcp import RuleStorageReader, remap_errors
    from remapdsl.language import rules_from_text

    agree, reader, ours, identity, like, mesh = _identity(folder, (world,))
    seen = {"identity": agree}

    def record(name, call):
        try:
            with remap_errors():
                call()
            seen[name] = None
        except remapdsl.RemapError as exc:
            seen[name] = [d.code for d in exc.diagnostics]

    misspelled = dict(ours)
    misspelled["model.layers.0.self_attn.q_proj.weigth"] = misspelled.pop("model.layers.0.self_attn.q_proj.weight")
    record("wrong key", lambda: _dcp_load(misspelled, reader))
    try:
        _dcp_load(misspelled, reader)
    except BaseException as exc:  # noqa: BLE001 - DCP's own wrapper, shown to the user as is
        seen["wrong key text"] = str(exc)
    record("rule error", lambda: RuleStorageReader(folder, rules_from_text("remap 1\n{P:path} -> \n", "bad.remap")))
    record("missing checkpoint", lambda: RuleStorageReader(folder + "-missing", identity))
    again = _dtensors(like, mesh)
    _dcp_load_from(again, reader, broken)  # DCP's reset(checkpoint_id): the reader re-opens there
    seen["reset to another checkpoint"] = (str(reader.checkpoint_id) == broken and _differing(again, ours) == [])
    gone = RuleStorageReader(broken, identity)
    if rank == 0:
        Path(broken, "model.safetensors").unlink()
    torch.distributed.barrier(group=control_group())
    record("file gone before the reads", lambda: _dcp_load(dict(ours), gone))
    return seen


def _from_dcp_sharded(rank: int, world: int, original: str, out: str) -> bool:
    """The tiny Qwen3-MoE written by torch's HuggingFaceStorageWriter(save_distributed=True) from
    DTensors Shard(0) (each key in chunks over the ranks' files), then read back through the
    stacking rules into DTensors placed otherwise: equal to remapdsl.load of the original, and
    each rank reads exactly the bytes it holds across the chunks."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from remapdsl.dcp import RuleStorageReader

    mesh = init_device_mesh("cpu", (world,))
    full = load_file(str(Path(original) / "model.safetensors"))
    keys = sorted(full)
    mapping = {k: 1 + (i * 2 // len(keys)) for i, k in enumerate(keys)}  # two output files
    state = {k: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for k, t in full.items()}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True, fqn_to_index_mapping=mapping),
             process_group=control_group())
    if rank == 0:
        shutil.copyfile(Path(original) / "config.json", Path(out) / "config.json")
    torch.distributed.barrier(group=control_group())
    rules = str(ROOT / "rules" / "qwen3_moe.remap")
    whole = remapdsl.compile_rules(rules, original).empty_state_dict()
    by_dcp, by_remapdsl = _dtensors(whole, mesh), _dtensors(whole, mesh)
    reader = RuleStorageReader(out, rules)
    _dcp_load(by_dcp, reader)
    remapdsl.load(by_remapdsl, original, rules)
    chunked = any(len(c) > 1 for c in getattr(remapdsl.open_checkpoint(out), "chunks", {}).values())
    return chunked and _differing(by_dcp, by_remapdsl) == [] and reader.report.bytes_read == sum(
        t.to_local().nbytes for t in by_dcp.values())


def _two_ranks(rank: int, world: int, cases: dict, folder: str, broken: str, sharded: str) -> dict:
    return {"agree": _agree(rank, world, cases, (world,)), **_identity_and_errors(rank, world, folder, broken),
            "from dcp-sharded": _from_dcp_sharded(rank, world, folder, sharded)}


# ------------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory) -> list[dict]:
    """One spawn of 2 ranks for every 2-rank check: what each rank saw."""
    broken = tmp_path_factory.mktemp("broken") / "tiny"
    shutil.copytree(QWEN3_MOE, broken)
    sharded = tmp_path_factory.mktemp("dcp_sharded") / "tiny"
    return run_ranks(_two_ranks, 2, checkpoints, QWEN3_MOE, str(broken), str(sharded), backend="cuda:gloo")


@pytest.mark.distributed
def test_two_ranks_equal_remapdsl_load(two_ranks, checkpoints):
    """Fusing, stacking, interleaving and dequantizing rules; checked on the ranks (`_agree`)."""
    for name in checkpoints:
        assert two_ranks[0]["agree"][name]["requests"] > 0
    for name in ("qwen3_moe", "llama_fused"):  # no quantization scales: each rank reads what it holds
        assert [r["agree"][name]["bytes_read"] for r in two_ranks] == [r["agree"][name]["held"] for r in two_ranks]


@pytest.mark.distributed
def test_identity_rules_equal_hf_storage_reader(two_ranks):
    assert all(r["identity"] for r in two_ranks)


@pytest.mark.distributed
def test_a_key_the_rules_do_not_make_is_e600_on_every_rank(two_ranks):
    for r in two_ranks:
        assert r["wrong key"] == ["E600"]
        assert "did you mean `model.layers.0.self_attn.q_proj.weight`?" in r["wrong key text"]


@pytest.mark.distributed
def test_rule_and_checkpoint_errors_are_remap_errors_on_every_rank(two_ranks):
    for r in two_ranks:
        assert r["rule error"] and r["rule error"][0].startswith("E0")
        assert r["missing checkpoint"] and r["missing checkpoint"][0].startswith("E3")
        assert r["file gone before the reads"] and r["file gone before the reads"][0].startswith("E3")


@pytest.mark.distributed
def test_a_checkpoint_torch_wrote_sharded_loads_through_stacking_rules(two_ranks):
    assert all(r["from dcp-sharded"] for r in two_ranks)


@pytest.mark.distributed
def test_reset_with_a_checkpoint_id_reopens_there(two_ranks):
    assert all(r["reset to another checkpoint"] for r in two_ranks)


def test_validate_checkpoint_id(tmp_path):
    from remapdsl.dcp import RuleStorageReader

    assert RuleStorageReader.validate_checkpoint_id(QWEN3_MOE)
    assert RuleStorageReader.validate_checkpoint_id(Path(QWEN3_MOE) / "model.safetensors")
    assert not RuleStorageReader.validate_checkpoint_id(tmp_path)  # no .safetensors in it
    assert not RuleStorageReader.validate_checkpoint_id(tmp_path / "missing")
    assert not RuleStorageReader.validate_checkpoint_id(tmp_path / "missing.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "notes.json").write_text("{}")
    assert RuleStorageReader.validate_checkpoint_id(tmp_path / "model.safetensors.index.json")
    assert not RuleStorageReader.validate_checkpoint_id(tmp_path / "notes.json")


def test_errors_cross_dcp_exchanges_intact():
    """DCP pickles what a rank raised to send it to the others: class, diagnostics and the
    attributes set on the error must survive."""
    import pickle

    from remapdsl.dcp import ReaderError
    from remapdsl.errors import BindError, Diagnostic

    for error in (ReaderError(Diagnostic(code="E600", message="m", hint="h")),
                  BindError(Diagnostic(code="E232", message="m"))):
        error.failed_ranks = (1,)
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and again.diagnostics == error.diagnostics
        assert str(again) == str(error) and again.failed_ranks == (1,)


def _four_ranks(rank: int, world: int, cases: dict) -> bool:
    _agree(rank, world, cases, (2, 2))
    return _identity(QWEN3_MOE, (2, 2))[0]


@pytest.mark.distributed
def test_four_ranks_on_a_2d_mesh_equal_remapdsl_load_and_the_hf_reader(checkpoints):
    agree = run_ranks(_four_ranks, 4, {k: checkpoints[k] for k in ("qwen3_moe", "deepseek_v3_fp8")})
    assert agree == [True] * 4


# ------------------------------------------------------------------ one process (no process group)


def test_a_subset_of_the_runtime_tensors_loads_alone():
    from remapdsl.dcp import RuleStorageReader

    rules = str(ROOT / "rules" / "qwen3_moe.remap")
    whole = remapdsl.compile_rules(rules, QWEN3_MOE).empty_state_dict()
    remapdsl.load(whole, QWEN3_MOE, rules)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    part = {key: torch.zeros_like(whole[key])}
    reader = RuleStorageReader(QWEN3_MOE, rules)
    _dcp_load(part, reader)
    assert torch.equal(part[key], whole[key])
    assert reader.report.tensors == 1 and reader.report.bytes_read == whole[key].nbytes


def test_another_dtype_is_e601_naming_the_tensor():
    from remapdsl.dcp import RuleStorageReader, remap_errors

    reader = RuleStorageReader(QWEN3_MOE, "qwen3_moe")
    with pytest.raises(remapdsl.RemapError) as caught, remap_errors():
        _dcp_load({"model.norm.weight": torch.zeros(16, dtype=torch.bfloat16)}, reader)
    (d,) = caught.value.diagnostics
    assert (d.code, d.message, d.hint) == (
        "E601", "`model.norm.weight` is bfloat16 in the state dict, but the rules make it float32",
        "give the state dict the dtype the rules make, or add `| cast(...)` to the rule")
    assert caught.value.failed_ranks == (0,)


class _Bytes(DefaultLoadPlanner):
    """A planner asking for a tensor the rules make as bytes."""

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

        at = MetadataIndex("model.norm.weight")
        return LoadPlan([ReadItem(LoadItemType.BYTE_IO, at, torch.Size([0]), at, torch.Size([0]), torch.Size([16]))])


class _Misfit(DefaultLoadPlanner):
    """A planner resolving each request to a view of another shape than the request's."""

    def resolve_tensor(self, read_item):
        return torch.zeros(3)


@pytest.mark.parametrize("planner, code, message, hint", [
    (_Bytes, "E603", "`model.norm.weight` is asked for as bytes, but the rules make only tensors",
     "leave non-tensor values out of the state dict given to dcp.load through this reader"),
    (_Misfit, "E604", ("`model.norm.weight` is asked for as the box at [0] of size [16] into a view of [3], but the "
                       "rules make it [16]"),
     "the planner's request does not fit the tensor; DCP's default planner makes requests that do")])
def test_a_planner_asking_what_the_rules_do_not_make_is_refused_whole(planner, code, message, hint):
    """A custom planner's request as bytes (E603), or resolved to a view that does not fit it (E604)."""
    from remapdsl.dcp import RuleStorageReader, remap_errors

    reader = RuleStorageReader(QWEN3_MOE, "qwen3_moe")
    with pytest.raises(remapdsl.RemapError) as caught, remap_errors():
        _dcp_load({"model.norm.weight": torch.zeros(16)}, reader, planner())
    (d,) = caught.value.diagnostics
    assert (d.code, d.message, d.hint) == (code, message, hint)


@pytest.fixture(scope="module")
def loaded() -> dict:
    """Every runtime tensor of the tiny Qwen3-MoE through its shipped rules, by `remapdsl.load`."""
    rules = str(ROOT / "rules" / "qwen3_moe.remap")
    whole = remapdsl.compile_rules(rules, QWEN3_MOE).empty_state_dict()
    remapdsl.load(whole, QWEN3_MOE, rules)
    return whole


_CONFIG = json.loads((Path(QWEN3_MOE) / "config.json").read_text())


@pytest.fixture(scope="module")
def copies(tmp_path_factory) -> dict[str, str]:
    """Copies of the tiny Qwen3-MoE: "stray" with one more file holding a tensor no rule takes, "no config"
    without its config.json."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("copies")
    shutil.copytree(QWEN3_MOE, root / "stray")
    save_file({"stray.weight": torch.ones(3)}, str(root / "stray" / "stray.safetensors"))
    shutil.copytree(QWEN3_MOE, root / "bare", ignore=shutil.ignore_patterns("config.json"))
    return {"stray": str(root / "stray"), "no config": str(root / "bare")}


@pytest.mark.parametrize("case, code", [("staging", "E416"), ("snapshot", "E331"), ("config", "E207"),
                                        ("stray", "E202"), ("stray, strict", "E202"), ("no config", "E211")])
def test_the_reader_refuses_what_load_refuses(copies, tmp_path, case, code):
    """Too few staging bytes, a snapshot (no data, named as dcp.load's), a config that does not fit the
    checkpoint, a tensor no rule takes (`strict`, the default, or given), a folder without a config."""
    from remapdsl.dcp import RuleStorageReader

    checkpoint, keywords = QWEN3_MOE, {}
    if case == "staging":
        keywords["staging_bytes"] = 1
    elif case == "snapshot":
        checkpoint = str(tmp_path / "qwen3.headers.json")
        remapdsl.write_snapshot(QWEN3_MOE, checkpoint)
    elif case == "config":
        keywords["config"] = {**_CONFIG, "moe_intermediate_size": 9}
    elif case.startswith("stray"):
        checkpoint = copies["stray"]
        keywords.update({"strict": True} if case.endswith("strict") else {})
    else:
        checkpoint = copies["no config"]
    with pytest.raises(remapdsl.RemapError) as caught:
        RuleStorageReader(checkpoint, "qwen3_moe", **keywords)
    d = caught.value.diagnostics[0]
    assert d.code == code, d
    if code == "E331":
        assert (d.message, d.path) == ("dcp.load needs tensor data, and a snapshot holds headers only", checkpoint)


class _Committed(DefaultLoadPlanner):
    """DCP's default planner, keeping each request the reader commits and the tensor it commits."""

    def __init__(self):
        super().__init__()
        self.committed = []

    def commit_tensor(self, read_item, tensor):
        self.committed.append((read_item.dest_index.fqn, tensor))


@settings(max_examples=scaled(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_the_reader_with_any_keywords_fills_any_destination_layout_as_load_does(loaded, copies, data):
    """Through `dcp.load` in one process, whatever the reader's keywords (rules as a path, a shipped name,
    `auto`, or a RuleSet read from a file, from text or built in code; the checkpoint as a folder, a Path
    or its file; `config` read from the folder or given, also where the folder has none; `strict`, off
    over a tensor no rule takes; `timeout`; `staging_bytes`) and whatever memory layout each destination
    has: the destinations hold what `remapdsl.load` loads, the memory around them untouched, each is
    committed to the planner, and the report counts the requests and their bytes. A key the rules do not
    make is E600 naming the rules and the checkpoint."""
    import datetime
    import time

    from remapdsl.dcp import RuleStorageReader, remap_errors
    from remapdsl.language import RuleSet, rules_from_text
    from remapdsl.testing.strategies import memory_layouts

    path = ROOT / "rules" / "qwen3_moe.remap"
    rules = data.draw(st.sampled_from([str(path), path, "qwen3_moe", "auto", "file", "text", "code"]))
    named = {"text": "the rules of `<text>`", "code": "the rules"}.get(rules, "the rules of `qwen3_moe.remap`")
    if rules in ("file", "code"):
        rules = remapdsl.load_rules(path)
        if named == "the rules":
            rules = RuleSet(files=(), statements=rules.statements)
    elif rules == "text":
        rules = rules_from_text(path.read_text())
    folder = data.draw(st.sampled_from(["plain", "stray", "no config"]))
    keywords = data.draw(st.fixed_dictionaries({}, optional={
        "strict": st.booleans(), "timeout": st.sampled_from([30, 30.0, datetime.timedelta(seconds=30)]),
        "staging_bytes": st.sampled_from([4 << 10, 1 << 20])}))
    if folder == "stray":  # strict refuses its stray tensor (test_the_reader_refuses_what_load_refuses)
        keywords["strict"] = False
    config = data.draw(st.sampled_from([None, _CONFIG] if folder != "no config" else [_CONFIG]))
    folder = {"plain": QWEN3_MOE, **copies}[folder]
    checkpoint = data.draw(st.sampled_from([folder, Path(folder), Path(folder) / "model.safetensors"]))
    reader = RuleStorageReader(checkpoint, rules, config=config, **keywords)
    assert reader.report is None
    keys = data.draw(st.lists(st.sampled_from(sorted(loaded)), min_size=1, max_size=6, unique=True))
    held = {key: data.draw(memory_layouts(loaded[key].shape, loaded[key].dtype)) for key in keys}
    stray = data.draw(st.sampled_from([None, "model.layers.0.mlp.experts.up_proj", "optimizer.step"]))
    if stray is not None:  # one key the rules do not make: named, with the close key it may be a typo of
        with pytest.raises(remapdsl.RemapError) as caught, remap_errors():
            _dcp_load({**{key: h.tensor for key, h in held.items()}, stray: torch.zeros(1)}, reader)
        (d,) = caught.value.diagnostics
        message = f"the state dict asks for `{stray}`, but {named} make no such tensor from this checkpoint"
        close = difflib.get_close_matches(stray, list(loaded), n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`?" if close else \
            "add a rule that makes it, or leave it out of the state dict given to dcp.load"
        assert (d.code, d.message, d.path, d.hint) == ("E600", message, str(checkpoint), hint)
        assert bool(close) == (stray != "optimizer.step")  # both hints are drawn
        return
    planner = _Committed()
    start = time.perf_counter()
    _dcp_load({key: h.tensor for key, h in held.items()}, reader, planner)
    took = time.perf_counter() - start
    assert reader.is_coordinator is True  # one process: the coordinator
    for key, h in held.items():
        assert torch.equal(h.tensor, loaded[key]), (key, h.how)
        assert h.outside().isnan().all(), (key, h.how)
    assert {key: t.data_ptr() for key, t in planner.committed} == {key: h.tensor.data_ptr() for key, h in held.items()}
    assert len(planner.committed) == len(keys)
    nbytes = sum(loaded[key].nbytes for key in keys)
    report = reader.report
    assert (report.requests, report.tensors, report.bytes_read, report.bytes_owned) == (len(keys), len(keys), nbytes, nbytes)
    assert 0 < report.seconds <= took


def test_the_reader_fills_zero_dim_and_zero_size_tensors(tmp_path):
    """A 0-dim tensor (a scale) and one with no elements come through `dcp.load` as `remapdsl.load` gives them."""
    from safetensors.torch import save_file

    from remapdsl.dcp import RuleStorageReader
    from remapdsl.language import rules_from_text

    tensors = {"scale": torch.tensor(0.25), "empty": torch.zeros(0, 3), "w": torch.arange(6.0).view(2, 3)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    got = {key: torch.full_like(t, float("nan")) for key, t in tensors.items()}
    reader = RuleStorageReader(tmp_path, rules_from_text(IDENTITY), config={})
    _dcp_load(got, reader)
    assert all(torch.equal(got[key], t) for key, t in tensors.items())
    assert (reader.report.requests, reader.report.bytes_read) == (2, 4 + 24)  # DCP asks nothing of `empty`
