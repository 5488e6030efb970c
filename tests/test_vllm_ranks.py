"""vLLM's tensor-parallel ranks as remapdsl layouts, on 2 real gloo ranks, against vLLM 0.32's own goldens.

Each rank holds what vLLM's rank holds (tests/goldens/vllm/CASE/rank{R}.safetensors, written by
oracles/vllm/generate.py) as plain local tensors placed by a shipped layout plan (rules/layouts/vllm_*.json)
on the mesh `tp=2`. On both ranks, for every tp=2 and tp=2 + expert-parallel case: the load equals vLLM's
parameters bit for bit; `save(like=...)` writes the checkpoint back byte for byte; `export` (whole tensors,
and `regions`) yields the checkpoint's tensors, and a save without `like` writes them; `ingest` of the checkpoint's tensors equals vLLM's
parameters. And the weight sync of an RL job: a trainer's FSDP DTensors of the same parameters exported
and ingested into vLLM's ranks.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_vllm import GOLDENS, RULES, golden, manifest
from vllm_checkpoints import write_checkpoint

import remapdsl

pytestmark = pytest.mark.distributed
LAYOUTS = Path(__file__).resolve().parent.parent / "rules" / "layouts"

CASES = sorted(p.name for p in GOLDENS.iterdir() if (p / "manifest.json").is_file() and manifest(p.name)["world"] == 2)


def layout_name(case: str) -> str:
    m = manifest(case)
    return ("vllm_gpt_oss_tp" if m["checkpoint"] == "gpt_oss" else "vllm_tp") + ("_ep" if m["ep"] else "")


def _nan_like(tensors: dict) -> dict:
    """vLLM's rank before its loader runs: every parameter of its shape and dtype, NaN."""
    return {k: torch.full_like(v, float("nan")) if v.is_floating_point() else torch.zeros_like(v)
            for k, v in tensors.items()}


def _equal(got: dict, want: dict) -> list[str]:
    """The keys whose tensors differ (names, shape, dtype or a bit), sorted."""
    return sorted(k for k in set(got) | set(want) if k not in got or k not in want or got[k].dtype != want[k].dtype
                  or got[k].shape != want[k].shape or not torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)))


def _serve(rank: int, world: int, jobs: list[dict]) -> dict:
    """Every case on this rank: what differs from vLLM's goldens or the checkpoint, per step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = remapdsl.parse_mesh("tp=2")
    out: dict = {}
    for job in jobs:
        case, folder, rules = job["case"], job["folder"], job["rules"]
        layout = remapdsl.read_layout(job["layout"])
        want = load_file(str(GOLDENS / case / f"rank{rank}.safetensors"))
        original = load_file(str(Path(folder) / "model.safetensors"))
        found: dict = {}

        state = _nan_like(want)
        remapdsl.load(state, folder, rules, layout=layout, mesh=mesh)
        found["load"] = _equal(state, want)

        saved = Path(job["out"]) / "saved"
        remapdsl.save(state, saved, rules, like=folder, layout=layout, mesh=mesh)
        found["save"] = [] if filecmp.cmp(Path(folder) / "model.safetensors", saved / "model.safetensors",
                                          shallow=False) else ["model.safetensors"]

        derived = Path(job["out"]) / "derived"  # no `like`: the layout derived from the shards and the config
        remapdsl.save(state, derived, rules, config=json.loads((Path(folder) / "config.json").read_text()),
                      layout=layout, mesh=mesh)
        found["save without like"] = _equal(load_file(str(derived / "model.safetensors")), original)

        # every rank's pieces go back to the parent, which assembles them (no collective of the test's own)
        found["export"] = dict(remapdsl.export(state, rules=rules, like=folder, layout=layout, mesh=mesh, gather="tp"))
        found["regions"] = list(remapdsl.export(state, rules=rules, like=folder, layout=layout, mesh=mesh,
                                                regions=True))

        fresh = _nan_like(want)
        remapdsl.ingest(fresh, original.items(), rules, like=folder, layout=layout, mesh=mesh)
        found["ingest"] = _equal(fresh, want)

        if job["weight sync"]:
            # a trainer's FSDP shards (DTensors on its own mesh) of vLLM's tp=1 parameters, exported in the
            # checkpoint layout and ingested into vLLM's ranks
            trainer_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
            trainer = {k: distribute_tensor(v, trainer_mesh, [Shard(0)]) for k, v in load_file(job["tp1"]).items()}
            synced = _nan_like(want)
            pairs = remapdsl.export(trainer, rules=rules, like=folder, gather="fsdp")
            remapdsl.ingest(synced, _all_ranks(pairs, world), rules, like=folder, layout=layout, mesh=mesh)
            found["weight sync"] = _equal(synced, want)
        out[case] = found
    return out


def _all_ranks(pairs, world: int):
    """Every rank's exported pairs on every rank (a test's stand-in for the trainer-to-engine transport)."""
    import torch.distributed as dist

    mine = list(pairs)
    every = [None] * world
    dist.all_gather_object(every, mine)
    return [pair for part in every for pair in part]


def run_cases(root: Path, cases: list[str], backend: str) -> dict:
    """The cases on 2 ranks of `backend`: per rank, case and step, the keys that differ (export and
    regions assembled here from every rank's pieces)."""
    from remapdsl.testing.ranks import run_ranks

    jobs = []
    for case in cases:
        m = manifest(case)
        folder = root / m["checkpoint"]
        if not folder.exists():
            write_checkpoint(m["checkpoint"], folder)
        (root / case).mkdir()
        jobs.append({"case": case, "folder": str(folder), "rules": RULES[m["checkpoint"]], "layout": layout_name(case),
                     "tp1": str(GOLDENS / f"{m['checkpoint']}_tp1" / "rank0.safetensors"), "out": str(root / case),
                     "weight sync": backend == "gloo"})  # its stand-in transport is a CPU collective
    per_rank = run_ranks(_serve, 2, jobs, timeout=300, backend=backend)
    for case in cases:
        original = load_file(str(root / manifest(case)["checkpoint"] / "model.safetensors"))
        exported = {k: v for found in per_rank for k, v in found[case]["export"].items()}
        assembled = {k: torch.full_like(v, float("nan")) for k, v in original.items()}
        for found in per_rank:
            for key, offsets, values in found[case]["regions"]:
                assembled[key][tuple(slice(o, o + n) for o, n in zip(offsets, values.shape))] = values
        for found in per_rank:
            found[case]["export"], found[case]["regions"] = _equal(exported, original), _equal(assembled, original)
    return dict(enumerate(per_rank))


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    """Every case run once on 2 gloo ranks."""
    return run_cases(tmp_path_factory.mktemp("vllm_ranks"), CASES, "gloo")


@pytest.fixture(scope="module")
def found_cuda_gloo(tmp_path_factory) -> dict:
    """Two cases (a replicated KV head; gpt-oss's rank-0 bias) on a default group with NCCL's device
    contract, as a GPU engine's job has: the library's collectives must carry no CPU tensor."""
    return run_cases(tmp_path_factory.mktemp("vllm_ranks_cuda_gloo"), CUDA_GLOO_CASES, "cuda:gloo")


STEPS = ("load", "save", "save without like", "export", "regions", "ingest", "weight sync")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("step", STEPS)
def test_vllm_ranks_match_vllm(found, case, step):
    """Nothing differs, on either rank."""
    assert {rank: per_case[case][step] for rank, per_case in found.items()} == {0: [], 1: []}


CUDA_GLOO_CASES = ["llama_tied_tp2", "gpt_oss_tp2"]


@pytest.mark.parametrize("case", CUDA_GLOO_CASES)
@pytest.mark.parametrize("step", STEPS[:-1])
def test_vllm_ranks_match_vllm_under_cuda_gloo(found_cuda_gloo, case, step):
    assert {rank: per_case[case][step] for rank, per_case in found_cuda_gloo.items()} == {0: [], 1: []}


def test_the_cases_cover_every_shipped_vllm_layout_and_the_new_placements():
    plans = {layout_name(c) for c in CASES}
    assert plans == {p.stem for p in LAYOUTS.glob("vllm_*.json")}
    kinds = {p["kind"] for name in plans for value in json.loads((LAYOUTS / f"{name}.json").read_text())["plan"].values()
             if not isinstance(value, str) for p in ([value] if isinstance(value, dict) else value)}
    assert {"packed_shard", "first_only"} <= kinds
