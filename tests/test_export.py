"""`remapdsl.export` and `remapdsl.ingest`: the checkpoint layout streamed from and into a sharded
runtime state dict, without files.

On 2 and 4 real gloo ranks, with DTensors placed FSDP x EP (`ep` x `dp_shard`, stacked experts cut
by both), plain TP shards under a layout plan, and the shipped MoE rules (Qwen3-MoE, Mixtral,
DeepSeek-V3): a vLLM-style consumer on every rank (a function taking `(name, tensor)` pairs and
comparing each with the checkpoint `save_pretrained` wrote) receives every checkpoint key exactly
once over the ranks; an ingest of those pairs fills each rank's shards with exactly what a load from
the files gives. What each export round assembles stays within half a bucket per owner (the
schedule, drawn and as the ranks run it, rounds told apart by their exchanges); zero-size checkpoint
tensors are yielded once over the ranks, with and without `regions`; tensors split over a mesh dim
that `gather` does not name are refused on every rank.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoints import tiny_checkpoint
from depth import scaled
from gloo import distributed_like
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import remapdsl
from remapdsl.checkpoint import open_inventory, read_config
from remapdsl.language import rules_from_text
from remapdsl.sharding import LayoutPlan, Mesh, layout_for, local_shard
from remapdsl.sharding.placements import Replicate, Shard
from remapdsl.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
# not importorskip: the ranks import this file too, and need no transformers (seconds a rank)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

# (world, name, mesh dims, placements by pattern, gather)
FSDP_EP = {"*.mlp.experts.*": [Shard(dim=0), Shard(dim=1)], "*": [Replicate(), Shard(dim=0)]}
MESHES = [
    (2, "fsdp", {"dp_shard": 2}, {"*": [Shard(dim=0)]}, ("dp_shard",)),
    (2, "ep", {"ep": 2}, {"*.mlp.experts.*": [Shard(dim=0)], "*": [Replicate()]}, ()),
    (4, "fsdp_ep", {"ep": 2, "dp_shard": 2}, FSDP_EP, ("dp_shard",)),
]


def _checkpoint(case: str, folder: Path) -> tuple[Path, str]:
    from hf_models import CASES, build

    built = build(CASES[case], folder)
    return built.folder, str(ROOT / built.case.rules)


def _full_state(folder: str, rules: str) -> tuple[dict, dict]:
    inventory = open_inventory(folder)
    config = read_config(inventory)
    compiled = remapdsl.compile_rules(remapdsl.load_rules(rules), inventory, config)
    state = compiled.empty_state_dict()
    remapdsl.load(state, folder, rules)
    return state, config


def _consumer(folder: str):
    """A vLLM-style `load_weights`: takes (name, tensor) pairs, checks each against the checkpoint
    file's tensor and records the names it got."""
    want = {}
    for file in Path(folder).glob("*.safetensors"):
        want.update(load_file(str(file)))
    got: list[str] = []

    def load_weights(pairs) -> None:
        for name, tensor in pairs:
            assert name in want, name
            assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
            got.append(name)
    return load_weights, got, sorted(want)


def _export_on_ranks(rank: int, world: int, models: list[tuple[str, str]], meshes: list) -> dict:
    """Each model under each mesh of this world: the keys this rank's consumer got (checked
    against the files), after the export's pairs were ingested back into fresh shards equal to a
    load's."""
    out = {}
    for folder, rules in models:
        state, config = _full_state(folder, rules)
        pairs = {}
        for file in sorted(Path(folder).glob("*.safetensors")):
            pairs.update(load_file(str(file)))
        for _, name, dims, placements, gather in meshes:
            mesh = Mesh.of(dims)
            sharded, wanted = distributed_like(state, mesh, LayoutPlan.from_mapping(placements, mesh_dim=mesh.names[-1]))
            for key, target in sharded.items():  # the shards of the loaded model
                target.to_local().copy_(wanted[key])
            load_weights, got, keys = _consumer(folder)
            load_weights(remapdsl.export(sharded, rules, config=config, gather=gather, bucket_bytes=4096))
            # the mirror: every rank is handed every pair and fills its own shards
            refilled, _ = distributed_like(state, mesh, LayoutPlan.from_mapping(placements, mesh_dim=mesh.names[-1]))
            for t in refilled.values():
                t.to_local().fill_(float("nan"))
            remapdsl.ingest(refilled, iter(pairs.items()), rules, config=config)
            for key, t in refilled.items():
                assert torch.equal(t.to_local(), wanted[key]), (name, key)
            out[f"{Path(folder).name} {name}"] = (got, keys)
    return out


def _each_key_once(results: list[dict], meshes: list) -> None:
    assert len(results[0]) == 2 * len(meshes)
    for case in results[0]:
        received = [k for r in results for k in r[case][0]]
        assert sorted(received) == results[0][case][1], case  # every key, none twice
        assert all(r[case][0] for r in results), case  # every rank assembled some


@pytest.mark.distributed
def test_every_key_reaches_the_consumer_exactly_once_on_four_ranks(four_ranks):
    """Qwen3-MoE and DeepSeek-V3 under FSDP x EP, one process group for both."""
    _each_key_once([r["meshes"] for r in four_ranks], [m for m in MESHES if m[0] == 4])


@pytest.mark.distributed
def test_every_key_reaches_the_consumer_exactly_once_on_two_ranks(two_ranks):
    """Qwen3-MoE and DeepSeek-V3 under FSDP and under EP (where nothing moves)."""
    _each_key_once([r["meshes"] for r in two_ranks[0]], [m for m in MESHES if m[0] == 2])


def _tp_on_ranks(rank: int, world: int, folder: str, rules: str) -> list[str]:
    state, _ = _full_state(folder, rules)
    mesh = Mesh.of({"tp": world})
    plan = LayoutPlan.from_mapping({"*norm.weight": "replicate", "*.mlp.gate.weight": "replicate",
                                    "*": [Shard(dim=1)]}, mesh_dim="tp")
    local = {}
    for key, full in state.items():
        shard = local_shard(full.shape, mesh.sizes, layout_for(key, full.shape, plan, mesh), mesh.coordinate(rank))
        local[key] = full[tuple(slice(o, o + n) for o, n in zip(shard.boxes[0].offsets, shard.boxes[0].sizes))] \
            .clone() if shard.boxes else full[:0]
    load_weights, got, _ = _consumer(folder)
    load_weights(remapdsl.export(local, rules, like=folder, layout=plan, mesh=mesh, gather="tp",
                                 bucket_bytes=1 << 20))
    return got


def _several(rank: int, world: int, calls: list) -> dict:
    """Several of this file's rank functions in one process group: name -> what each returned."""
    return {name: globals()[function](rank, world, *args) for name, function, args in calls}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """The transformers checkpoints the ranks export (case -> folder, rules), built once."""
    root = tmp_path_factory.mktemp("models")
    made = {case: _checkpoint(case, root / case) for case in ("mixtral", "llama", "qwen3_moe", "deepseek_v3")}
    cube = tiny_checkpoint(root / "cube", {"a": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)}, {})
    (root / "cube.remap").write_text("remap 1\na -> b\n")
    return made | {"cube": (cube, str(root / "cube.remap")), "zero size": _zero_size_cases(root / "zero")}


@pytest.fixture(scope="module")
def two_ranks(folders) -> tuple[list[dict], dict]:
    """The 2-rank cases below, run in one process group: each rank's results, and the folders."""
    titan = str(ROOT / "rules" / "torchtitan_llama3.remap")
    models = [tuple(map(str, folders[case])) for case in ("qwen3_moe", "deepseek_v3")]
    calls = [("meshes", "_export_on_ranks", (models, [m for m in MESHES if m[0] == 2])),
             ("tp", "_tp_on_ranks", tuple(map(str, folders["mixtral"]))),
             ("refused", "_refused_on_ranks", tuple(map(str, folders["qwen3_moe"]))),
             ("unnamed", "_unnamed_mesh_on_ranks", tuple(map(str, folders["qwen3_moe"]))),
             ("rows", "_regions_on_ranks", (str(EXAMPLE), QWEN, {"*": [Shard(dim=0)]})),
             ("columns", "_regions_on_ranks", (str(EXAMPLE), QWEN, {"*norm*": "replicate", "*": [Shard(dim=1)]})),
             ("strided", "_regions_on_ranks", (str(folders["llama"][0]), titan, {"*": [Shard(dim=0)]})),
             ("last dim", "_regions_on_ranks", (*map(str, folders["cube"]), {"b": [Shard(dim=2)]})),
             ("zero size", "_zero_size_on_ranks", (folders["zero size"],))]
    return run_ranks(_several, 2, calls, timeout=300, backend="cuda:gloo"), folders


@pytest.mark.distributed
def test_tp_shards_under_a_layout_plan_on_two_ranks(two_ranks):
    results, folders = two_ranks
    folder = folders["mixtral"][0]
    keys = sorted(k for f in Path(folder).glob("*.safetensors") for k in load_file(str(f)))
    assert sorted(results[0]["tp"] + results[1]["tp"]) == keys


def _refused_on_ranks(rank: int, world: int, folder: str, rules: str) -> dict:
    state, config = _full_state(folder, rules)
    mesh = Mesh.of({"dp_shard": world})
    sharded, _ = distributed_like(state, mesh, LayoutPlan.from_mapping({"*": [Shard(dim=0)]}, mesh_dim="dp_shard"))
    out = {}
    for gather in ((), ("tp",)):
        try:
            list(remapdsl.export(sharded, rules, config=config, gather=gather))
        except remapdsl.RemapError as exc:
            out[str(gather)] = (exc.diagnostics[0].code, exc.diagnostics[0].message, exc.diagnostics[0].hint)
    return out


def _unnamed_mesh_on_ranks(rank: int, world: int, folder: str, rules: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor

    state, config = _full_state(folder, rules)
    unnamed = init_device_mesh("cpu", (world,))  # a mesh made without dim names: its dims are dim0, dim1, ...
    plain = {k: distribute_tensor(t, unnamed, [TorchShard(0)], src_data_rank=None) for k, t in state.items()}
    out = {}
    try:
        list(remapdsl.export(plain, rules, config=config))
    except remapdsl.RemapError as exc:
        out["refused"] = (exc.diagnostics[0].code, exc.diagnostics[0].message, exc.diagnostics[0].hint)
    files = {k: v for f in Path(folder).glob("*.safetensors") for k, v in load_file(str(f)).items()}
    out["gathered"] = {k: torch.equal(t, files[k]) for k, t in remapdsl.export(plain, rules, config=config,
                                                                               gather=("dim0",))}
    return out


@pytest.mark.distributed
def test_a_split_the_gather_does_not_name_is_refused_on_every_rank(two_ranks):
    results = [r["refused"] for r in two_ranks[0]]
    assert results[0] == results[1]
    code, message, hint = results[0]["()"]
    assert code == "E541" and "split over the mesh dim(s) `dp_shard`" in message and "ranks 0, 1" in message
    assert "gather=('dp_shard',)" in hint
    code, message, hint = results[0]["('tp',)"]
    assert code == "E542" and "`tp`" in message and "`dp_shard`" in hint


@pytest.mark.distributed
def test_the_dims_of_a_mesh_made_without_names_are_dim0_and_on(two_ranks):
    """DTensors on a DeviceMesh without dim names: E541 names its dim `dim0`, and gather=("dim0",) assembles
    every checkpoint tensor with the file's values, once over the ranks."""
    results, folders = two_ranks
    code, message, hint = results[0]["unnamed"]["refused"]
    assert (code, hint) == ("E541", "assemble it over them: gather=('dim0',)") and "dim(s) `dim0`" in message
    got = [r["unnamed"]["gathered"] for r in results]
    keys = sorted(k for f in Path(folders["qwen3_moe"][0]).glob("*.safetensors") for k in load_file(str(f)))
    assert sorted([*got[0], *got[1]]) == keys and all(v for g in got for v in g.values())


# -- memory: half a bucket assembled a round ---------------------------------------------------------


def _rounds_on_ranks(rank: int, world: int, experts: int, bucket: int) -> tuple[int, list[list[int]], int]:
    """Export a model of `experts` 1 MiB experts per layer on an ep x dp_shard mesh, telling its rounds
    apart by their exchanges (the real all-to-all runs: the spy only counts); returns this rank's shard
    bytes, per round the nbytes of each tensor this rank yields (assembles) in it, and how many of the
    round's receive buffers were still alive when its tensors were yielded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as TorchShard

    from remapdsl.runtime import dist

    config = {"moe_intermediate_size": 256, "tie_word_embeddings": False}
    rules = remapdsl.language.rules_from_text(
        "remap 1\nmodel.layers.{L}.mlp.experts.{E}.{gate,up}_proj.weight -> model.layers.{L}.mlp.experts.gate_up_proj\n"
        "    | stack(E, dim=0)\n    | concat(dim=1, sizes=[config.moe_intermediate_size, config.moe_intermediate_size])\n",
        "experts.remap")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "dp_shard"))
    torch.manual_seed(rank)
    shape = (experts, 512, 512)
    state = {f"model.layers.{L}.mlp.experts.gate_up_proj": DTensor.from_local(
        torch.randn(experts // 2, 512 // (world // 2), 512), mesh, [TorchShard(0), TorchShard(1)], shape=shape,
        stride=(512 * 512, 512, 1)) for L in range(4)}
    shards = sum(t.to_local().nbytes for t in state.values())
    rounds: list[list[int]] = []
    exchange = dist.exchange
    received: list = []  # weak references to the last round's receive buffers

    def counted(*args, **kwargs):
        rounds.append([])  # a round's tensors are yielded after its exchange
        out = exchange(*args, **kwargs)
        received[:] = [weakref.ref(t) for t in out]
        return out

    dist.exchange = counted
    kept = 0  # receive buffers still alive when a round's tensor is yielded
    try:
        for _, tensor in remapdsl.export(state, rules, config=config, gather="dp_shard", bucket_bytes=bucket):
            rounds[-1].append(tensor.nbytes)
            kept += sum(ref() is not None for ref in received)
            del tensor
    finally:
        dist.exchange = exchange
    return shards, rounds, kept


BUCKET = 16 << 20


@pytest.fixture(scope="module")
def four_ranks(folders) -> list[dict]:
    """The 4-rank cases, run in one process group: the export's rounds, then the exports."""
    models = [tuple(map(str, folders[case])) for case in ("qwen3_moe", "deepseek_v3")]
    calls = [("rounds", "_rounds_on_ranks", (32, BUCKET)),
             ("meshes", "_export_on_ranks", (models, [m for m in MESHES if m[0] == 4]))]
    return run_ranks(_several, 4, calls, timeout=240)


@pytest.mark.distributed
def test_each_round_assembles_at_most_half_a_bucket_per_rank(four_ranks):
    """4 layers of 32 stacked 1 MiB experts, 128 MiB in all, 32 MiB of shards on each of 4 ranks (ep=2 x
    dp_shard=2), 16 MiB buckets: in every round each rank assembles at most 8 MiB (so it holds about one
    bucket beyond its shards, with the pieces it sends and receives), where a gather to one rank would
    hold all 128 MiB; every rank takes part in every round, and every byte is assembled once."""
    results = [r["rounds"] for r in four_ranks]
    total = sum(shards for shards, _, _ in results)
    assert sum(n for _, rounds, _ in results for r in rounds for n in r) == total
    assert len({len(rounds) for _, rounds, _ in results}) == 1  # the exchanges are collectives
    for shards, rounds, _ in results:
        assert len(rounds) > 1 and any(rounds)
        for assembled in rounds:
            assert sum(assembled) <= BUCKET // 2 or len(assembled) == 1, assembled


@pytest.mark.distributed
def test_a_round_s_receive_buffers_are_freed_before_its_tensors_are_yielded(four_ranks):
    """What the other ranks sent a round is scattered into its tensors, and that buffer is gone by the time
    the consumer gets them: a consumer holding the last round's tensors while the next is assembled
    (as `for key, t in export(...)` does) holds nothing of the exchange besides."""
    assert [r["rounds"][2] for r in four_ranks] == [0] * 4


@st.composite
def _schedules(draw) -> tuple[list[dict], dict, int, list[str]]:
    """What the ranks share before an export (per rank: checkpoint key -> its mesh coordinates), the
    checkpoint tensors' sizes, a bucket, and the tensors without bytes."""
    world = draw(st.integers(1, 4))
    sizes = draw(st.dictionaries(st.sampled_from([f"t{i:02}" for i in range(12)]), st.integers(0, 600)))
    everyone: list[dict] = [{} for _ in range(world)]
    for key, n in sizes.items():
        if n:
            for r in draw(st.sets(st.integers(0, world - 1), min_size=1)):
                everyone[r][key] = (("dp_shard", r),)
    out = SimpleNamespace(tensors={k: SimpleNamespace(nbytes=n) for k, n in sizes.items()})
    return everyone, out, draw(st.integers(1, 1500)), [k for k, n in sizes.items() if not n]


@st.composite
def _splits(draw) -> tuple[list[dict], tuple]:
    """Up to 12 ranks, each writing pieces of some of three checkpoint tensors, each piece at the rank's
    coordinates on a mesh of drawn dims (or at none: a plain tensor), and a `gather` of drawn dims, perhaps one
    no mesh has."""
    world = draw(st.integers(1, 12))
    dims = draw(st.lists(st.sampled_from(["dp", "ep", "tp"]), min_size=1, unique=True))
    at = [tuple((d, draw(st.integers(0, 1))) for d in dims) for _ in range(world)]  # each rank's coordinates
    everyone: list[dict] = [{} for _ in range(world)]
    for key in ("a", "b", "c"):
        for r in draw(st.sets(st.integers(0, world - 1))):
            everyone[r][key] = at[r] if draw(st.sampled_from(["mesh"] * 5 + ["plain"])) == "mesh" else ()
    return everyone, tuple(draw(st.lists(st.sampled_from([*dims, "pp"]), unique=True)))


@settings(max_examples=scaled(100), deadline=None)
@given(_splits())
def test_a_tensor_split_over_dims_gather_does_not_name_is_refused_at_any_scale(drawn):
    """E542 for a gather dim no mesh has (the hint lists the meshes' dims, or none); else E541 for the first
    tensor (by key) whose writers' coordinates differ on a dim gather leaves out, or that some writer holds as
    a plain tensor (the whole job), naming six of its writers and counting the rest; else a schedule."""
    from remapdsl.drivers.export import _schedule

    everyone, gather = drawn
    out = SimpleNamespace(tensors={k: SimpleNamespace(nbytes=1) for k in "abc"})
    names = sorted({d for keys in everyone for coordinates in keys.values() for d, _ in coordinates})
    want = None
    if any(g not in names for g in gather):
        unknown = next(g for g in gather if g not in names)
        want = ("E542", f"gather={gather!r}: the mesh has no dim `{unknown}`", "the state dict's meshes have dims "
                + (", ".join(f"`{n}`" for n in names) or "none (plain tensors)"))
    for key in "abc":
        writers = [r for r, keys in enumerate(everyone) if key in keys]
        if want or len(writers) < 2:
            continue
        held = [dict(everyone[r][key]) for r in writers]
        split = ["(the whole job)"] if not all(held) else \
            sorted(d for d in held[0] if len({h[d] for h in held}) > 1)
        left = [d for d in split if d not in gather]
        if left:
            shown = ", ".join(map(str, writers[:6])) + (f" and {len(writers) - 6} more" if len(writers) > 6 else "")
            want = ("E541", f"checkpoint tensor `{key}` is split over the mesh dim(s) "
                    + ", ".join(f"`{d}`" for d in left) + f" (ranks {shown} hold its pieces), which `gather` does "
                    "not name", f"assemble it over them: gather={tuple(dict.fromkeys((*gather, *left)))!r}")
    if want is None:
        assert set(_schedule(everyone, out, 4, gather, []).owner) == {k for keys in everyone for k in keys}
        return
    with pytest.raises(remapdsl.RemapError) as info:
        _schedule(everyone, out, 4, gather, [])
    d = info.value.diagnostic
    assert (d.code, d.message, d.hint) == want


@settings(max_examples=scaled(100), deadline=None)
@given(_schedules())
def test_the_schedule_puts_at_most_half_a_bucket_in_each_round_of_each_owner(drawn):
    """Drawn writers, sizes and buckets: each tensor's owner is one of its writers (rank 0 for one of no
    bytes), each owner's round holds at most half a bucket unless one tensor (and ones of no bytes) fills it
    alone, rounds are numbered from 0 without a gap (none without tensors); where every rank holds every
    tensor, the owners' loads differ by at most the largest tensor. Exactly: in key order each tensor goes to
    its least loaded writer, and an owner's next round starts only where its next tensor would not fit beside
    the round before."""
    from remapdsl.drivers.export import _schedule

    everyone, out, bucket, empty = drawn
    gather = ("dp_shard",) if any(everyone) else ()
    schedule = _schedule(everyone, out, bucket, gather, empty)
    assert set(schedule.owner) == set(out.tensors) == set(schedule.round_of)
    per_round: dict[tuple[int, int], list[int]] = {}
    for key, owner in schedule.owner.items():
        writers = [r for r, keys in enumerate(everyone) if key in keys]
        assert owner in (writers or [0]), (key, owner, writers)
        per_round.setdefault((owner, schedule.round_of[key]), []).append(out.tensors[key].nbytes)
    for (owner, at), sizes in per_round.items():
        assert sum(sizes) <= max(1, bucket // 2) or sum(1 for n in sizes if n) == 1, (owner, at, sizes, bucket)
    assert sorted({at for _, at in per_round}) == list(range(schedule.rounds))
    if all(keys.keys() == everyone[0].keys() for keys in everyone):  # every rank writes every tensor
        loads = [sum(out.tensors[k].nbytes for k, o in schedule.owner.items() if o == r) for r in range(len(everyone))]
        assert max(loads) - min(loads) <= max((t.nbytes for t in out.tensors.values()), default=0), loads
    load = [0] * len(everyone)  # in key order, each tensor goes to its least loaded writer (the lowest rank of ties)
    for key in sorted(k for k in out.tensors if any(k in keys for keys in everyone)):
        writers = [r for r, keys in enumerate(everyone) if key in keys]
        assert (load[schedule.owner[key]], schedule.owner[key]) == min((load[r], r) for r in writers), key
        load[schedule.owner[key]] += out.tensors[key].nbytes
    for owner in set(schedule.owner.values()):  # an owner's rounds: its tensors in key order, each round full
        mine = sorted(k for k, o in schedule.owner.items() if o == owner)
        assert [schedule.round_of[k] for k in mine] == sorted(schedule.round_of[k] for k in mine)
        for at in range(1, 1 + max(schedule.round_of[k] for k in mine)):
            before = sum(out.tensors[k].nbytes for k in mine if schedule.round_of[k] == at - 1)
            first = next(k for k in mine if schedule.round_of[k] == at)
            assert before and before + out.tensors[first].nbytes > max(1, bucket // 2), (owner, at)


# -- one process: the pairs themselves, and what an export or ingest refuses ----------------------

QWEN = str(ROOT / "rules" / "qwen3_moe.remap")
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe"


def _example() -> tuple[dict, dict, dict]:
    state, config = _full_state(str(EXAMPLE), QWEN)
    return state, config, load_file(str(EXAMPLE / "model.safetensors"))


def test_one_process_exports_the_checkpoint_and_ingests_it_back():
    state, config, files = _example()
    for like in (None, EXAMPLE):
        pairs = list(remapdsl.export(state, QWEN, like=like, config=config, bucket_bytes=1000))
        assert sorted(k for k, _ in pairs) == sorted(files)
        assert all(torch.equal(t, files[k]) for k, t in pairs)
        again = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
        report = remapdsl.ingest(again, iter(pairs), QWEN, like=like, config=config)
        assert report.pairs == report.used == len(files)
        assert all(torch.equal(again[k], v) for k, v in state.items())


_RESEND = "send the checkpoint's own tensors (cast them back first)"


@pytest.mark.parametrize("edit, code, words, hint", [
    (lambda p: p | {"model.layers.0.mlp.gate.wieght": p["model.layers.0.mlp.gate.weight"]}, "E545",
     "pair `model.layers.0.mlp.gate.wieght`: the rules read no checkpoint tensor of that name",
     "did you mean `model.layers.0.mlp.gate.weight`?"),
    (lambda p: p | {"zz.unknown": torch.zeros(1)}, "E545",
     "pair `zz.unknown`: the rules read no checkpoint tensor of that name", "drop it in the rules, or leave it out"),
    (lambda p: p | {"model.norm.weight": p["model.norm.weight"].half()}, "E546",
     "pair `model.norm.weight` is [16] float16, but the checkpoint layout has it [16] float32", _RESEND),
    (lambda p: p | {"model.norm.weight": [0.0] * 16}, "E546",
     "pair `model.norm.weight` is a list, not a tensor; the checkpoint layout has it [16] float32", _RESEND),
    (lambda p: {k: v for k, v in p.items() if k != "model.norm.weight"}, "E547",
     "1 checkpoint tensor(s) this rank needs never came, starting with `model.norm.weight`", None),
    (lambda p: list(p.items()) + [("model.norm.weight", p["model.norm.weight"])], "E548",
     "pair `model.norm.weight` came twice", "send each tensor once"),
])
def test_ingest_names_the_pair_that_does_not_fit(edit, code, words, hint):
    state, config, files = _example()
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.ingest(state, edit(files), QWEN, config=config)
    d = info.value.diagnostics[0]
    assert (d.code, d.message) == (code, words)
    if hint is not None:
        assert d.hint == hint


_STREAM_RULES = "remap 1\nmodel.layers.{L}.w -> layers.{L}.w\ndrop model.rotary.{L}.inv_freq when L < config.n\n"


@st.composite
def faulty_streams(draw) -> tuple[dict, dict, list, list]:
    """A checkpoint of 1-4 layers and keys the rules `drop`; a stream of its pairs in any order, each tensor
    sent once, never, as a float16 copy or a list, or twice, among keys no rule reads; and the problems an
    ingest must name, in the order the pairs come: a key no rule reads (E545), a second copy (E548) of one
    taken, another dtype or no tensor (E546), then the tensors that never came (E547). Pairs the rules drop
    are skipped unchecked, however they come."""
    layers = draw(st.integers(1, 4))
    read = {f"model.layers.{i}.w": torch.arange(6.0).reshape(2, 3) + i for i in range(layers)}
    dropped = {f"model.rotary.{i}.inv_freq": torch.ones(2) for i in range(layers)}
    stream = [(f"model.extra.{j}", torch.zeros(1)) for j in range(draw(st.integers(0, 9)))]
    for key, tensor in (read | dropped).items():
        sent = draw(st.sampled_from(["once", "never", "half", "half then once", "list", "twice"]))
        copies = {"once": [tensor], "never": [], "half": [tensor.half()], "half then once": [tensor.half(), tensor],
                  "list": [tensor.tolist()], "twice": [tensor, tensor.clone()]}[sent]
        stream += [(key, c) for c in copies]
    stream = draw(st.permutations(stream))
    problems, taken, laid = [], set(), "[2, 3] float32"
    for key, value in stream:  # the contract, pair by pair
        if key.startswith("model.extra."):
            problems.append(("E545", f"pair `{key}`: the rules read no checkpoint tensor of that name"))
        elif key in dropped:
            continue
        elif key in taken:
            problems.append(("E548", f"pair `{key}` came twice"))
        elif isinstance(value, list):
            problems.append(("E546", f"pair `{key}` is a list, not a tensor; the checkpoint layout has it {laid}"))
        elif value.dtype != torch.float32:
            problems.append(("E546", f"pair `{key}` is [2, 3] float16, but the checkpoint layout has it {laid}"))
        else:
            taken.add(key)
    never = sorted(set(read) - taken)
    if never:
        came = f"{len(never)} checkpoint tensor(s) this rank needs never came, starting with `{never[0]}`"
        problems.append(("E547", came))
    return read, dropped, stream, problems


@settings(max_examples=scaled(40), deadline=None)
@given(faulty_streams(), st.booleans(), st.booleans())
def test_an_ingest_reads_the_whole_stream_and_names_every_bad_pair_at_once(tmp_path_factory, drawn, with_like, as_dict):
    """Pairs the rules drop (in `like` or not; the drop guarded by the config) are skipped and a bad pair
    stops nothing: the pairs after it are still read, so the problems are exactly the stream's, in its
    order, the first eight of them; a stream with none fills every tensor."""
    read, dropped, stream, problems = drawn
    like = tiny_checkpoint(tmp_path_factory.mktemp("like"), read | dropped) if with_like else None
    state = {k.removeprefix("model."): torch.full((2, 3), float("nan")) for k in read}
    pairs = dict(stream) if as_dict and len(dict(stream)) == len(stream) else iter(stream)
    start = time.perf_counter()
    if problems:
        with pytest.raises(remapdsl.RemapError) as info:
            remapdsl.ingest(state, pairs, rules_from_text(_STREAM_RULES), like=like, config={"n": 4})
        assert [(d.code, d.message) for d in info.value.diagnostics] == problems[:8]
        if problems[-1][0] == "E547" and len(problems) <= 8:
            assert info.value.diagnostics[-1].hint == "the pairs must hold every tensor the rules read for this " \
                "rank's part"
        return
    report = remapdsl.ingest(state, pairs, rules_from_text(_STREAM_RULES), like=like, config={"n": 4})
    assert (report.rank, report.pairs, report.used, report.bytes_read) == (0, len(stream), len(read), 24 * len(read))
    assert 0 <= report.seconds <= time.perf_counter() - start
    assert all(torch.equal(state[k.removeprefix("model.")], t) for k, t in read.items())


def _rank_0_shards(compiled, layout, mesh) -> dict:
    return {d.runtime_key: torch.full(local_shard(d.shape, mesh.sizes, layout_for(d.runtime_key, d.shape, layout, mesh),
                                                  mesh.coordinate(0)).shape, float("nan"), dtype=getattr(torch, d.dtype))
            for d in compiled.runtime_tensors}


def test_one_process_ingests_rank_0_s_shards_as_a_load_fills_them_and_a_prepared_object_plans_each_holding():
    """With a layout and a mesh, one process holds rank 0's shards (as `plan_rank` plans them); a prepared
    object that ingested the whole model before plans the shards anew."""
    from remapdsl.sharding import read_layout

    layout, mesh = read_layout(EXAMPLE.parent / "tp2_layout.json"), Mesh.of({"tp": 2})
    compiled = remapdsl.compile_rules(remapdsl.load_rules(QWEN), EXAMPLE)
    want = _rank_0_shards(compiled, layout, mesh)
    remapdsl.load(want, EXAMPLE, QWEN, layout=layout, mesh=mesh)
    assert all(not t.isnan().any() for t in want.values())
    files = load_file(str(EXAMPLE / "model.safetensors"))
    got = _rank_0_shards(compiled, layout, mesh)
    report = remapdsl.ingest(got, files, QWEN, like=EXAMPLE, layout=layout, mesh=mesh)
    assert all(torch.equal(got[k], want[k]) for k in want)
    prepared = remapdsl.prepare(QWEN, EXAMPLE)
    whole = compiled.empty_state_dict()
    assert prepared.ingest(whole, files).bytes_read == sum(t.nbytes for t in files.values())
    again = _rank_0_shards(compiled, layout, mesh)
    assert prepared.ingest(again, files, layout=layout, mesh=mesh).bytes_read == report.bytes_read
    assert all(torch.equal(again[k], want[k]) for k in want)


_DERIVED = "without `like`, the checkpoint's shapes come from every rank's shards: run every rank of the mesh, or " \
    "give `like`"
_SAVED = "a save writes every rank's bytes, and one process holds only rank 0's: run every rank of the mesh"
_ASSEMBLED = "whole tensors are assembled from every rank's part, and one process holds only rank 0's: run every " \
    "rank of the mesh, or export `regions=True` (rank 0's boxes)"


@pytest.mark.parametrize("call, like, hint", [
    *((call, None, _DERIVED) for call in ("save", "export", "export regions", "ingest")),
    ("save", EXAMPLE, _SAVED),
    ("export", EXAMPLE, _ASSEMBLED)])
def test_one_process_refuses_what_needs_every_rank_of_a_larger_mesh(call, like, hint, tmp_path):
    """One process may hold rank 0's part of a mesh of two (a load, an ingest, `regions=True` fill or yield
    just that part), but a save writes every rank's bytes, an export assembles every rank's part, and a
    layout derived without `like` needs every rank's shapes: E414, before a byte is written, never a file
    with rank 1's part missing."""
    from remapdsl.sharding import read_layout

    layout, mesh = read_layout(EXAMPLE.parent / "tp2_layout.json"), Mesh.of({"dp": 1, "tp": 2})
    compiled = remapdsl.compile_rules(remapdsl.load_rules(QWEN), EXAMPLE)
    state = _rank_0_shards(compiled, layout, mesh)
    remapdsl.load(state, EXAMPLE, QWEN, layout=layout, mesh=mesh)
    kw = {"like": like, "layout": layout, "mesh": mesh}
    calls = {"save": lambda: remapdsl.save(state, tmp_path / "out", QWEN, **kw),
             "export": lambda: list(remapdsl.export(state, QWEN, **kw)),
             "export regions": lambda: list(remapdsl.export(state, QWEN, regions=True, **kw)),
             "ingest": lambda: remapdsl.ingest(state, load_file(str(EXAMPLE / "model.safetensors")), QWEN, **kw)}
    with pytest.raises(remapdsl.RemapError) as info:
        calls[call]()
    d = info.value.diagnostic
    assert (d.code, d.message, d.hint) == ("E414", "the mesh `dp=1, tp=2` has 2 ranks; this job has 1", hint)
    assert not (tmp_path / "out").exists()


def test_export_refuses_dequantized_rules_and_a_bucket_of_no_bytes(tmp_path):
    state, config, _ = _example()
    with pytest.raises(remapdsl.RemapError) as info:
        next(remapdsl.export(state, QWEN, config=config, bucket_bytes=0))
    assert info.value.diagnostics[0].code == "E544" and "bucket_bytes=0" in info.value.diagnostics[0].message
    from hf_models import fp8_release

    fp8 = fp8_release(EXAMPLE, tmp_path / "fp8", (4, 4))
    rules = str(ROOT / "rules" / "qwen3_moe_fp8.remap")
    quantized, _ = _full_state(str(fp8), rules)
    export_hint = ("export with the rule file of the unquantized layout (`deepseek_v3`, not `deepseek_v3_fp8`); "
                   "the engine quantizes what it loads")
    export_why = "an export streams the runtime tensors' own values, and re-encoding them in the stored format is " \
                 "not supported"
    ingest_why = "an ingest takes the checkpoint tensors' own values, and decoding streamed quantized parts is not " \
                 "supported"
    for call, why, hint in (
            (lambda: next(remapdsl.export(quantized, rules, like=fp8)), export_why, export_hint),
            (lambda: remapdsl.ingest(quantized, {}, rules, like=fp8), ingest_why,
             "ingest with the rule file of the unquantized layout")):
        with pytest.raises(remapdsl.RemapError) as info:
            call()
        d = info.value.diagnostics[0]
        key = d.message.split("`")[1]  # the first tensor the rules dequantize
        assert (d.code, d.message, d.hint) == ("E543", f"the rules dequantize `{key}`: {why}", hint)


# -- regions: the boxes each rank holds, no communication -------------------------------------------


def _regions_on_ranks(rank: int, world: int, folder: str, rules: str, placements: dict) -> list:
    state, config = _full_state(folder, rules)
    mesh = Mesh.of({"dp_shard": world})
    sharded, wanted = distributed_like(state, mesh, LayoutPlan.from_mapping(placements, mesh_dim="dp_shard"))
    for key, target in sharded.items():
        target.to_local().copy_(wanted[key])
    try:
        return [(k, o, t.clone()) for k, o, t in remapdsl.export(sharded, rules, config=config, regions=True,
                                                                 bucket_bytes=2000)]
    except remapdsl.RemapError as exc:
        d = exc.diagnostics[0]
        return [(d.code, d.message, d.hint)]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["rows", "columns", "last dim"])
def test_regions_tile_every_checkpoint_tensor_once_without_moving_a_byte(two_ranks, case):
    """FSDP rows and TP columns on 2 ranks, and the last dim of a 3-d tensor (each rank's piece is
    rows of 2 elements repeated over both outer dims as one run set): each rank's boxes, put where
    their offsets say, make every checkpoint tensor exactly once."""
    results = [r[case] for r in two_ranks[0]]
    folder = two_ranks[1]["cube"][0] if case == "last dim" else EXAMPLE
    want = load_file(str(Path(folder) / "model.safetensors"))
    full = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    covered = dict.fromkeys(want, 0)
    for regions in results:
        assert regions, "every rank holds some"
        for key, offsets, tensor in regions:
            full[key][tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
            covered[key] += tensor.numel()
    assert covered == {k: v.numel() for k, v in want.items()}
    assert all(torch.equal(full[k], want[k]) for k in want)


@pytest.mark.parametrize("keywords, name, why, got", [
    ({"gather": "dp_shard"}, "gather", "takes no gather", "('dp_shard',)"),
    ({"gather": ["dp", "tp"]}, "gather", "takes no gather", "('dp', 'tp')"),
    ({"by_round": True}, "by_round", "has no rounds to group by", "True")])
def test_regions_refuse_a_gather_or_rounds_naming_which(keywords, name, why, got):
    """A gather (one name or several) or by_round beside regions=True: E542 saying which, whole."""
    with pytest.raises(remapdsl.RemapError) as info:
        next(remapdsl.export({}, QWEN, regions=True, **keywords))
    d = info.value.diagnostic
    message = f"regions=True yields the boxes each rank holds and moves nothing, so it {why} (got {name}={got})"
    hint = f"drop `{name}`, or drop `regions` to assemble whole tensors"
    assert (d.code, d.message, d.hint) == ("E542", message, hint)


@pytest.mark.parametrize("gather", ["tp", {"tp"}, iter(["tp"])], ids=["a name", "a set", "an iterator"])
def test_a_gather_given_as_one_name_or_any_iterable_is_those_names(gather):
    """gather="tp" is gather=("tp",), not its letters, as a set or an iterator of names is: with plain tensors
    no mesh has it (E542)."""
    state, config, _ = _example()
    with pytest.raises(remapdsl.RemapError) as info:
        next(remapdsl.export(state, QWEN, config=config, gather=gather))
    d = info.value.diagnostic
    assert (d.code, d.message, d.hint) == ("E542", "gather=('tp',): the mesh has no dim `tp`",
                                           "the state dict's meshes have dims none (plain tensors)")


@pytest.mark.distributed
def test_a_strided_piece_is_no_region(two_ranks):
    """torchtitan's Llama 3 stores q and k in rotary pair order: a row shard's rows of the
    checkpoint tensor are strided, so the piece is named, with the way to assemble it instead."""
    (code, message, hint), = two_ranks[0][0]["strided"]
    assert code == "E549" and "is no box of it" in message and "_proj.weight`" in message
    assert "regions=False" in hint
    with pytest.raises(remapdsl.RemapError) as info:
        next(remapdsl.export({}, QWEN, gather="dp_shard", regions=True))
    assert info.value.diagnostics[0].code == "E542" and "takes no gather" in info.value.diagnostics[0].message


def test_one_process_names_a_strided_piece_of_rank_0_s_shard(tmp_path):
    """Rank 0's row shard of a tensor in rotary pair order holds strided rows of the checkpoint tensor:
    E549 whole, in one process as on ranks."""
    folder = tiny_checkpoint(tmp_path, {"a": torch.randn(8, 3)})
    rules = remapdsl.language.rules_from_text("remap 1\na -> b\n    | rope_permute(heads=2)\n")
    plan, mesh = LayoutPlan.from_mapping({"b": [Shard(dim=0)]}), Mesh.of({"tp": 2})
    state = {"b": torch.zeros(4, 3)}
    remapdsl.load(state, folder, rules, config={}, layout=plan, mesh=mesh)
    with pytest.raises(remapdsl.RemapError) as info:
        list(remapdsl.export(state, rules, like=folder, config={}, layout=plan, mesh=mesh, regions=True))
    d = info.value.diagnostic
    assert d.code == "E549"
    assert d.message == "checkpoint tensor `a`: a piece this rank holds is no box of it (its rows are strided, as a " \
        "rope order or an interleave leaves them)"
    assert d.hint == "assemble whole tensors instead (regions=False, with the mesh dims it is split over in `gather`)"

def test_a_tensor_of_strided_pieces_written_whole_is_one_region(tmp_path):
    """Rows in a rotary pair order: each of the pieces one process writes is no box of the checkpoint
    tensor, but together they are all of it, so the tensor comes whole, once, at offsets 0 (E549 is
    for a piece of a tensor the rank does not write whole: `test_a_strided_piece_is_no_region`)."""
    a = torch.randn(8, 3)
    folder = tiny_checkpoint(tmp_path, {"a": a, "c": torch.randn(2, 2)})
    rules = remapdsl.language.rules_from_text("remap 1\na -> b\n    | rope_permute(heads=2)\nc -> c\n")
    state = remapdsl.compile_rules(rules, folder, {}).empty_state_dict()
    remapdsl.load(state, folder, rules, config={})
    regions = list(remapdsl.export(state, rules, like=folder, config={}, regions=True, bucket_bytes=16))
    assert [(k, o) for k, o, _ in regions if k == "a"] == [("a", (0, 0))]
    assert torch.equal(next(t for k, _, t in regions if k == "a"), a)


def _is_box(indices: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether the row-major flat `indices` (each once) are exactly the elements of one box of `shape`."""
    if not indices.numel():
        return True
    at = torch.stack(torch.unravel_index(indices.long(), shape))  # one row per dim
    low, high = at.min(dim=1).values, at.max(dim=1).values
    return math.prod((high - low + 1).tolist()) == indices.numel()


@settings(max_examples=scaled(40), deadline=None)
@given(st.data())
def test_rank_0_s_shards_of_any_layout_come_as_boxes_that_tile_what_it_holds(data):
    """One process holding rank 0's shards (a mesh of one or two dims, each cutting each runtime tensor
    along any dim: no element held twice, so rank 0 writes all it holds) of runtime tensors that `split`
    one checkpoint tensor, or merge its first two dims (`reshape`), then perhaps transpose it or put its
    rows in rotary order: boxes of the checkpoint tensor that tile what rank 0 holds, or E549 (`_rank_0_regions`)."""
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3), label="shape"))
    merge = len(shape) == 3 and data.draw(st.booleans(), label="merge dims 0 and 1")
    dim = 0 if merge else data.draw(st.integers(0, len(shape) - 1), label="split dim")
    cuts = [] if merge or shape[dim] == 1 else sorted(data.draw(st.sets(st.integers(1, shape[dim] - 1), max_size=2)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, shape[dim]])]
    ndim = len(shape) - merge  # the runtime tensors'
    turn = " | transpose(0, 1)" if ndim > 1 and data.draw(st.booleans(), label="transpose") else ""
    if not cuts and not turn and not merge and shape[0] % 2 == 0 and data.draw(st.booleans(), label="rotary order"):
        turn = " | rope_permute(heads=1)"  # rows strided in the checkpoint tensor: a piece may be no box
    targets = [f"p{i}" for i in range(len(sizes))]
    split = f"\n    | split(dim={dim}, sizes={sizes})" if len(sizes) > 1 else ""
    split += f" | reshape([{shape[0] * shape[1]}, {shape[2]}])" if merge else ""
    named = f"{{{','.join(targets)}}}" if len(sizes) > 1 else targets[0]
    rules = rules_from_text(f"remap 1\nw -> {named}{split}{turn}\n", "split.remap")
    mesh = Mesh.of(dict(zip(("a", "b"), data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))))
    cut = st.sampled_from([Shard(dim=d) for d in range(ndim)])
    plan = LayoutPlan.from_mapping({t: data.draw(st.lists(cut, min_size=len(mesh.sizes), max_size=len(mesh.sizes)),
                                                 label=t) for t in targets})
    _rank_0_regions(rules, shape, plan, mesh, data.draw(st.sampled_from([8, 32, 1 << 20]), label="bucket"),
                    rotary="rope" in turn)


@pytest.mark.parametrize("merge, mesh, cuts", [
    (False, {"a": 2, "b": 2}, [1, 2]), (False, {"a": 2, "b": 2}, [2, 1]),
    (True, {"a": 2, "b": 2}, [0, 1]), (True, {"a": 2, "b": 2}, [1, 0]), (True, {"a": 3}, [0])])
@pytest.mark.parametrize("shape", list(itertools.product(range(1, 4), repeat=3)))
def test_rank_0_s_shards_of_a_tensor_cut_on_two_dims_or_merging_two_come_as_boxes_or_e549_where_they_are_none(
        shape, merge, mesh, cuts):
    """Every (a, b, c) to 3, whole or merged by `reshape([a * b, c])`, and rank 0's shards of it on those
    meshes: a shard cut on dims 1 and 2 repeats its rows at two strides; one of the merged tensor may run
    past a row of dim 0 without filling the next, as no split or transpose leaves them."""
    reshape = f" | reshape([{shape[0] * shape[1]}, {shape[2]}])" if merge else ""
    rules = rules_from_text(f"remap 1\nw -> p0{reshape}\n", "cut.remap")
    _rank_0_regions(rules, shape, LayoutPlan.from_mapping({"p0": [Shard(dim=d) for d in cuts]}), Mesh.of(mesh), 32)


def _rank_0_regions(rules, shape: tuple[int, ...], plan, mesh, bucket: int, rotary: bool = False) -> None:
    """One process holding rank 0's shards of the runtime tensors `rules` make of one checkpoint tensor `w`
    of `shape` (counting 0, 1, 2, ...): `regions=True` yields boxes of `w`, each with its values, covering
    exactly the elements rank 0 holds, each once; or E549 naming `w`, only where some shard's elements are no
    box of it (or, `rotary`, lie in rotary order)."""
    import tempfile

    w = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    with tempfile.TemporaryDirectory() as folder:
        tiny_checkpoint(folder, {"w": w}, {})
        compiled = remapdsl.compile_rules(rules, folder, {})
        state = _rank_0_shards(compiled, plan, mesh)
        remapdsl.load(state, folder, rules, config={}, layout=plan, mesh=mesh)
        boxes = all(_is_box(t.flatten(), shape) for t in state.values())
        try:
            regions = list(remapdsl.export(state, rules, like=folder, config={}, layout=plan, mesh=mesh, regions=True,
                                           bucket_bytes=bucket))
        except remapdsl.RemapError as exc:  # a strided piece, named (whole in the test below)
            assert (rotary or not boxes) and exc.diagnostic.code == "E549", str(exc)
            assert "`w`" in exc.diagnostic.message, str(exc)
            return
    held = torch.zeros(math.prod(shape), dtype=torch.int64)
    for t in state.values():
        held[t.flatten().long()] = 1
    seen = torch.zeros(shape, dtype=torch.int64)
    for key, offsets, tensor in regions:
        box = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
        assert key == "w" and len(offsets) == len(shape) and torch.equal(tensor, w[box]), (offsets, tensor.shape)
        seen[box] += 1
    assert torch.equal(seen.flatten(), held), (seen, held.reshape(shape))


# -- zero-size checkpoint tensors, on 2 ranks -------------------------------------------------------


def _zero_size_cases(root: Path) -> list[tuple[str, str, dict]]:
    """Checkpoints whose tensors have a dim of size 0 (drawn shapes), each with drawn placements on a
    `dp_shard` mesh of 2: (folder, rules, placements)."""
    cases: list[tuple[str, str, dict]] = []

    @settings(max_examples=4, deadline=None, database=None)
    @given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), min_size=2, max_size=4)
           .filter(lambda shapes: any(0 in s for s in shapes) and any(0 not in s for s in shapes)), st.data())
    def draw(shapes, data):
        folder = root / f"case{len(cases)}"
        tensors = {f"t{i}": torch.randn(s) for i, s in enumerate(shapes)}
        tiny_checkpoint(folder, tensors, {})
        (folder / "r.remap").write_text("remap 1\nt{I} -> r{I}\n")
        placements = {f"r{i}": [data.draw(st.sampled_from([Replicate()] + [Shard(dim=d) for d in range(len(s))]))]
                      for i, s in enumerate(shapes)}
        cases.append((str(folder), str(folder / "r.remap"), placements))

    draw()
    return cases


def _zero_size_on_ranks(rank: int, world: int, cases: list) -> list[dict]:
    """Each case exported whole (gather) and as regions: the keys this rank yielded, with shapes."""
    out = []
    for folder, rules, placements in cases:
        state, config = _full_state(folder, rules)
        mesh = Mesh.of({"dp_shard": world})
        sharded, wanted = distributed_like(state, mesh, LayoutPlan.from_mapping(placements, mesh_dim="dp_shard"))
        for key, target in sharded.items():
            target.to_local().copy_(wanted[key])
        out.append({"whole": [(k, t.clone()) for k, t in remapdsl.export(sharded, rules, config=config,
                                                                          gather="dp_shard", bucket_bytes=16)],
                    "regions": [(k, o, t.clone()) for k, o, t in remapdsl.export(sharded, rules, config=config,
                                                                                 regions=True, bucket_bytes=16)]})
    return out


@pytest.mark.distributed
def test_zero_size_tensors_are_yielded_once_over_the_ranks(two_ranks):
    """Checkpoint tensors with a dim of size 0 among others, sharded or replicated on 2 ranks: exported
    whole and as regions, each key comes once over both ranks (a zero-size one from one rank, in its
    shape and dtype), and the regions tile the others exactly once."""
    results, folders = two_ranks
    for number, (folder, _, placements) in enumerate(folders["zero size"]):
        want = load_file(str(Path(folder) / "model.safetensors"))
        whole = [pair for r in results for pair in r["zero size"][number]["whole"]]
        assert sorted(k for k, _ in whole) == sorted(want), placements
        assert all(torch.equal(t, want[k]) for k, t in whole)
        regions = [piece for r in results for piece in r["zero size"][number]["regions"]]
        count = {k: 0 for k in want}
        full = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
        for key, offsets, tensor in regions:
            if not want[key].numel():
                assert tensor.shape == want[key].shape and offsets == (0,) * want[key].dim(), (key, offsets)
                count[key] += 1
                continue
            full[key][tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
            count[key] += tensor.numel()
        assert count == {k: v.numel() or 1 for k, v in want.items()}, placements
        assert all(torch.equal(full[k], want[k]) for k in want)


@settings(max_examples=scaled(30), deadline=None)
@given(st.data())
def test_a_checkpoint_tensor_written_in_pieces_along_any_dim_comes_as_boxes_that_tile_it(data):
    """One process, a checkpoint tensor of 1 to 3 dims cut by `split` along any dim into runtime tensors
    (each then kept, or transposed, so its bytes are strided in the checkpoint tensor): `regions=True`
    yields each piece as the box it is, with any bucket, nothing assembled: every element once, with its
    value; a tensor of no elements comes once, whole."""
    import tempfile

    from remapdsl.language import rules_from_text

    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    dim = data.draw(st.integers(0, len(shape) - 1))
    cuts = sorted(data.draw(st.sets(st.integers(1, shape[dim] - 1), max_size=3))) if shape[dim] > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, shape[dim]])]
    turn = " | transpose(0, 1)" if len(shape) > 1 and data.draw(st.booleans()) else ""
    targets = ",".join(f"p{i}" for i in range(len(sizes)))
    split = f"\n    | split(dim={dim}, sizes={sizes})" if len(sizes) > 1 else ""
    named = f"{{{targets}}}" if len(sizes) > 1 else targets
    rules = rules_from_text(f"remap 1\nw -> {named}{split}{turn}\nz -> z\n", "split.remap")
    w = torch.randn(shape)
    with tempfile.TemporaryDirectory() as folder:
        tiny_checkpoint(folder, {"w": w, "z": torch.zeros(2, 0, dtype=torch.bfloat16)}, {})
        state = remapdsl.compile_rules(rules, folder, {}).empty_state_dict()
        remapdsl.load(state, folder, rules, config={})
        bucket = data.draw(st.sampled_from([4, 16, 64, 1 << 20]))
        regions = list(remapdsl.export(state, rules, config={}, regions=True, bucket_bytes=bucket))
    seen = torch.zeros(shape, dtype=torch.int64)
    got = torch.full(shape, float("nan"))
    assert [(k, o, tuple(t.shape), t.dtype) for k, o, t in regions if k == "z"] == [
        ("z", (0, 0), (2, 0), torch.bfloat16)]  # no bytes, its dtype
    regions = [region for region in regions if region[0] == "w"]
    for key, offsets, tensor in regions:
        assert len(offsets) == len(shape)
        box = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
        seen[box] += 1
        got[box] = tensor
    assert seen.eq(1).all() and torch.equal(got, w)
    starts = [0, *cuts]  # each piece a box of its own, as it was written: nothing assembled
    assert sorted((o, tuple(t.shape)) for _, o, t in regions) == sorted(
        (tuple(a if d == dim else 0 for d in range(len(shape))),
         tuple(n if d == dim else m for d, m in enumerate(shape))) for a, n in zip(starts, sizes))


@settings(max_examples=scaled(60), deadline=None)
@given(st.data())
def test_one_process_export_with_any_keywords_yields_each_checkpoint_tensor_once(data):
    """One process, each keyword drawn or left at its default (`like` or the derived layout, the bucket,
    `allow_lossy`, `regions`, `by_round`, `timeout`, a zero-size tensor kept or dropped), the one-shot call
    or a prepared object's (with `like`): the pairs, regions
    or rounds hold each checkpoint tensor once with the value its rule writes back. A cast that lost values
    on load (float32 read as bfloat16) is E502 unless `allow_lossy` (E520 with no `like` to say what it
    was cast from); a bucket of no bytes is E544 at the first item, a timeout of none E416 at the call."""
    import tempfile

    from remapdsl.language import rules_from_text

    w, v = torch.randn(3, 4), torch.randn(5)
    lossy = data.draw(st.booleans())
    drop_z = data.draw(st.booleans())
    text = ("remap 1\nw -> w" + (" | cast(bfloat16)" if lossy else "") + "\nv -> v | scale(2)\n"
            + ("drop z\n" if drop_z else "z -> z\n"))
    rules = rules_from_text(text, "k.remap")
    keywords = data.draw(st.fixed_dictionaries({}, optional={
        "bucket_bytes": st.sampled_from([1, 16, 1 << 20, 1 << 20, 0, True]), "allow_lossy": st.booleans(),
        "regions": st.booleans(), "by_round": st.booleans(), "timeout": st.sampled_from([30, 0])}))
    with tempfile.TemporaryDirectory() as folder:
        tiny_checkpoint(folder, {"w": w, "v": v, "z": torch.zeros(0, 3)}, {})
        state = remapdsl.compile_rules(rules, folder, {}).empty_state_dict()
        remapdsl.load(state, folder, rules, config={})
        like = data.draw(st.sampled_from([None, folder]))
        if like is not None and data.draw(st.booleans(), label="through remapdsl.prepare"):
            def export():
                return remapdsl.prepare(rules, like, config={}).export(state, **keywords)
        else:
            def export():
                return remapdsl.export(state, rules, like=like, config={}, **keywords)
        if keywords.get("timeout") == 0:  # refused at the call itself
            with pytest.raises(remapdsl.RemapError) as caught:
                export()
            assert caught.value.diagnostics[0].code == "E416"
            return
        out = export()
        refused = next((code for code, why in [
            ("E542", keywords.get("regions") and keywords.get("by_round")),
            ("E520", lossy and like is None),  # no checkpoint says what the cast was made from
            ("E544", repr(keywords.get("bucket_bytes")) in ("0", "True")),
            ("E502", lossy and not keywords.get("allow_lossy"))] if why), None)
        if refused:
            with pytest.raises(remapdsl.RemapError) as caught:
                next(iter(out))
            d = caught.value.diagnostics[0]
            assert d.code == refused, str(caught.value)
            if refused == "E544":
                assert d.message == (f"bucket_bytes={keywords['bucket_bytes']!r}: the most bytes a rank assembles at "
                                     "once is a whole number of bytes, 1 or more")
            return
        got = list(out)
    if keywords.get("by_round"):
        got = [pair for batch in got for pair in batch]
    pairs = [(k, t) for k, _, t in got] if keywords.get("regions") else got
    want = {"w": w.bfloat16().float() if lossy else w, "v": v} | ({} if drop_z else {"z": torch.zeros(0, 3)})
    assert sorted(k for k, _ in pairs) == sorted(want)
    assert all(torch.equal(t, want[k]) for k, t in pairs)


@pytest.mark.parametrize("bucket", [1, 0, -1, True, 1.5, "64"])
def test_a_bucket_of_no_whole_positive_number_of_bytes_is_e544_at_the_first_item(bucket):
    """`bucket_bytes` is a count of bytes: 1 is the least a rank may assemble at once."""
    state, config, files = _example()
    out = remapdsl.export(state, QWEN, config=config, bucket_bytes=bucket)
    if bucket == 1 and bucket is not True:
        assert sorted(k for k, _ in out) == sorted(files)
        return
    with pytest.raises(remapdsl.RemapError) as caught:
        next(out)
    (d,) = caught.value.diagnostics
    message = f"bucket_bytes={bucket!r}: the most bytes a rank assembles at once is a whole number of bytes, 1 or more"
    assert (d.code, d.message, d.hint) == ("E544", message, "e.g. bucket_bytes=256 << 20 (256 MiB)")
