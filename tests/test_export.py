"""`remapdsl.export` and `remapdsl.ingest`: the checkpoint layout streamed from and into a sharded
runtime state dict, without files.

On 2 and 4 real gloo ranks, with DTensors placed FSDP x EP (`ep` x `dp_shard`, stacked experts cut
by both), plain TP shards under a layout plan, and the shipped MoE rules (Qwen3-MoE, Mixtral,
DeepSeek-V3): a vLLM-style consumer on every rank (a function taking `(name, tensor)` pairs and
comparing each with the checkpoint `save_pretrained` wrote) receives every checkpoint key exactly
once over the ranks; an ingest of those pairs fills each rank's shards with exactly what a load from
the files gives. Each rank's memory during an export stays within one bucket of its shards (peak
RSS, measured in fresh processes); tensors split over a mesh dim that `gather` does not name are
refused on every rank.
"""

from __future__ import annotations

import importlib.util
import resource
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint
from gloo import distributed_like
from safetensors.torch import load_file

import remapdsl
from remapdsl.checkpoint import open_inventory, read_config
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
    return made | {"cube": (cube, str(root / "cube.remap"))}


@pytest.fixture(scope="module")
def two_ranks(folders) -> tuple[list[dict], dict]:
    """The 2-rank cases below, run in one process group: each rank's results, and the folders."""
    titan = str(ROOT / "rules" / "torchtitan_llama3.remap")
    models = [tuple(map(str, folders[case])) for case in ("qwen3_moe", "deepseek_v3")]
    calls = [("meshes", "_export_on_ranks", (models, [m for m in MESHES if m[0] == 2])),
             ("tp", "_tp_on_ranks", tuple(map(str, folders["mixtral"]))),
             ("refused", "_refused_on_ranks", tuple(map(str, folders["qwen3_moe"]))),
             ("rows", "_regions_on_ranks", (str(EXAMPLE), QWEN, {"*": [Shard(dim=0)]})),
             ("columns", "_regions_on_ranks", (str(EXAMPLE), QWEN, {"*norm*": "replicate", "*": [Shard(dim=1)]})),
             ("strided", "_regions_on_ranks", (str(folders["llama"][0]), titan, {"*": [Shard(dim=0)]})),
             ("last dim", "_regions_on_ranks", (*map(str, folders["cube"]), {"b": [Shard(dim=2)]}))]
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


@pytest.mark.distributed
def test_a_split_the_gather_does_not_name_is_refused_on_every_rank(two_ranks):
    results = [r["refused"] for r in two_ranks[0]]
    assert results[0] == results[1]
    code, message, hint = results[0]["()"]
    assert code == "E541" and "split over the mesh dim(s) `dp_shard`" in message and "ranks 0, 1" in message
    assert "gather=('dp_shard',)" in hint
    code, message, hint = results[0]["('tp',)"]
    assert code == "E542" and "`tp`" in message and "`dp_shard`" in hint


# -- memory: shards plus one bucket ----------------------------------------------------------------


def _peak_growth(rank: int, world: int, experts: int, bucket: int) -> tuple[int, int, int]:
    """Export a model of `experts` 1 MiB experts per layer on an ep x dp_shard mesh; returns this
    rank's shard bytes, its peak RSS growth during the export, and the bytes it assembled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as TorchShard

    config = {"moe_intermediate_size": 256, "tie_word_embeddings": False}
    rules = remapdsl.language.rules_from_text(
        "remap 1\nmodel.layers.{L}.mlp.experts.{E}.{gate,up}_proj.weight -> model.layers.{L}.mlp.experts.gate_up_proj\n"
        "    | stack(E, dim=0)\n    | concat(dim=1, sizes=[config.moe_intermediate_size, config.moe_intermediate_size])\n",
        "experts.remap")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "dp_shard"))
    torch.manual_seed(rank)  # each rank makes only its own shards: no whole tensor ever raised the peak
    shape = (experts, 512, 512)
    state = {f"model.layers.{L}.mlp.experts.gate_up_proj": DTensor.from_local(
        torch.randn(experts // 2, 512 // (world // 2), 512), mesh, [TorchShard(0), TorchShard(1)], shape=shape,
        stride=(512 * 512, 512, 1)) for L in range(4)}
    shards = sum(t.to_local().nbytes for t in state.values())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assembled = 0
    for _, tensor in remapdsl.export(state, rules, config=config, gather="dp_shard", bucket_bytes=bucket):
        assembled += tensor.nbytes
        del tensor
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return shards, after - before, assembled


BUCKET = 16 << 20


@pytest.fixture(scope="module")
def four_ranks(folders) -> list[dict]:
    """The 4-rank cases, run in one process group: the memory check first (its peak is measured
    in processes that have done nothing else yet), then the exports."""
    models = [tuple(map(str, folders[case])) for case in ("qwen3_moe", "deepseek_v3")]
    calls = [("memory", "_peak_growth", (32, BUCKET)),
             ("meshes", "_export_on_ranks", (models, [m for m in MESHES if m[0] == 4]))]
    return run_ranks(_several, 4, calls, timeout=240)


@pytest.mark.distributed
def test_each_rank_holds_its_shards_plus_one_bucket(four_ranks):
    """4 layers of 32 stacked experts, 128 MiB in all, 32 MiB of shards on each of 4 ranks (ep=2 x
    dp_shard=2), 16 MiB buckets: each rank's peak RSS grows by at most one bucket (and 4 MiB of
    allocator slack) while it exports, where a gather to one rank would hold all 128 MiB."""
    bucket = BUCKET
    results = [r["memory"] for r in four_ranks]
    total = sum(shards for shards, _, _ in results)
    assert sum(a for _, _, a in results) == total  # every byte assembled once
    for shards, growth, _ in results:
        assert growth <= bucket + (4 << 20) < shards, (growth, shards)


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


@pytest.mark.parametrize("edit, code, words", [
    (lambda p: p | {"model.layers.0.mlp.gate.wieght": p["model.layers.0.mlp.gate.weight"]}, "E545",
     "pair `model.layers.0.mlp.gate.wieght`: the rules read no checkpoint tensor of that name"),
    (lambda p: p | {"model.norm.weight": p["model.norm.weight"].half()}, "E546",
     "pair `model.norm.weight` is [16] float16, but the checkpoint layout has it [16] float32"),
    (lambda p: {k: v for k, v in p.items() if k != "model.norm.weight"}, "E547",
     "1 checkpoint tensor(s) this rank needs never came, starting with `model.norm.weight`"),
    (lambda p: list(p.items()) + [("model.norm.weight", p["model.norm.weight"])], "E548",
     "pair `model.norm.weight` came twice"),
])
def test_ingest_names_the_pair_that_does_not_fit(edit, code, words):
    state, config, files = _example()
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.ingest(state, edit(files), QWEN, config=config)
    d = info.value.diagnostics[0]
    assert (d.code, d.message) == (code, words)
    if code == "E545":
        assert d.hint == "did you mean `model.layers.0.mlp.gate.weight`?"


def test_export_refuses_dequantized_rules_and_a_bucket_of_no_bytes(tmp_path):
    state, config, _ = _example()
    with pytest.raises(remapdsl.RemapError) as info:
        next(remapdsl.export(state, QWEN, config=config, bucket_bytes=0))
    assert info.value.diagnostics[0].code == "E544" and "bucket_bytes=0" in info.value.diagnostics[0].message
    from hf_models import fp8_release

    fp8 = fp8_release(EXAMPLE, tmp_path / "fp8", (4, 4))
    rules = str(ROOT / "rules" / "qwen3_moe_fp8.remap")
    quantized, _ = _full_state(str(fp8), rules)
    for call, hint in ((lambda: next(remapdsl.export(quantized, rules, like=fp8)), "`deepseek_v3`, not"),
                       (lambda: remapdsl.ingest(quantized, {}, rules, like=fp8), "the unquantized layout")):
        with pytest.raises(remapdsl.RemapError) as info:
            call()
        d = info.value.diagnostics[0]
        assert d.code == "E543" and "the rules dequantize `" in d.message and hint in d.hint


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
