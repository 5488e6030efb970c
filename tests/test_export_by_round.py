"""`export(..., by_round=True)`: one list of pairs per round, the same number of lists on every rank.

A consumer that runs its own collective after each round (a transport to engine ranks that need parts of
every tensor, bench/weight_sync_bench.py) cannot find the round boundaries in the plain stream: each rank
yields only the tensors it assembles, a different number on each. Grouped, every rank yields one list per
round (empty where it assembles nothing that round), and the lists put end to end are the plain export.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import remapdsl
from remapdsl.checkpoint import open_inventory, read_config
from remapdsl.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe"
QWEN = str(ROOT / "rules" / "qwen3_moe.remap")

# stacked experts cut by ep and dp_shard (gathered over dp_shard), the rest FSDP rows replicated over ep
RULES = """remap 1
model.layers.{L}.mlp.experts.{E}.{gate,up}_proj.weight -> model.layers.{L}.mlp.experts.gate_up_proj
    | stack(E, dim=0)
    | concat(dim=1, sizes=[config.moe_intermediate_size, config.moe_intermediate_size])
model.layers.{L}.mlp.gate.weight -> model.layers.{L}.mlp.gate.weight
model.norm.weight -> model.norm.weight
model.embed_tokens.weight -> model.embed_tokens.weight
"""
CONFIG = {"moe_intermediate_size": 8}
LAYERS, EXPERTS, HIDDEN = 3, 8, 16


def _grouped_on_ranks(rank: int, world: int, bucket: int) -> dict:
    """This rank's export grouped by round and plain, on an ep=2 x dp_shard=2 mesh: the keys of each
    round's list, the keys of the plain stream, and whether the tensors are equal one for one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rules = remapdsl.language.rules_from_text(RULES, "grouped.remap")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "dp_shard"))
    torch.manual_seed(0)  # the same global tensors on every rank; each keeps its shards
    # a 4 kB embedding, over the bucket: a round of its own, in which only its owner assembles anything
    whole = {"model.norm.weight": torch.randn(HIDDEN), "model.embed_tokens.weight": torch.randn(64, HIDDEN)}
    for layer in range(LAYERS):
        whole[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.randn(EXPERTS, 16, HIDDEN)
        whole[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(EXPERTS, HIDDEN)
    state = {k: distribute_tensor(v, mesh, [Shard(0), Shard(1)] if ".experts." in k else [Replicate(), Shard(0)])
             for k, v in whole.items()}

    def run(by_round: bool):
        return remapdsl.export(state, rules, config=CONFIG, gather=("dp_shard",), bucket_bytes=bucket,
                               by_round=by_round)

    groups = [list(group) for group in run(True)]
    plain = list(run(False))
    flat = [pair for group in groups for pair in group]
    return {"rounds": [[k for k, _ in group] for group in groups], "plain": [k for k, _ in plain],
            "equal": len(flat) == len(plain) and all(a == b and torch.equal(x, y)
                                                     for (a, x), (b, y) in zip(flat, plain)),
            "pairs": all(isinstance(group, list) and all(isinstance(p, tuple) and len(p) == 2 for p in group)
                         for group in groups)}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    # 2 kB buckets: a 1 kB gate_up tensor or a 512 B gate, at most 1 kB assembled per owner a round
    return run_ranks(_grouped_on_ranks, 4, 2048, timeout=120)


@pytest.mark.distributed
def test_every_rank_yields_the_same_number_of_rounds(four_ranks):
    counts = [len(r["rounds"]) for r in four_ranks]
    assert len(set(counts)) == 1 and counts[0] > 1, counts
    assert all(r["pairs"] for r in four_ranks)
    # a rank that assembles nothing in a round (the embedding's, alone over the bucket) still yields its list
    assert any(not group for r in four_ranks for group in r["rounds"])


@pytest.mark.distributed
def test_the_rounds_end_to_end_are_the_plain_export(four_ranks):
    for r in four_ranks:
        assert [k for group in r["rounds"] for k in group] == r["plain"]
        assert r["equal"]
    every = sorted(k for r in four_ranks for k in r["plain"])
    names = {"model.norm.weight", "model.embed_tokens.weight"} | {
        f"model.layers.{layer}.mlp.gate.weight" for layer in range(LAYERS)} | {
        f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for layer in range(LAYERS) for e in range(EXPERTS)
        for p in ("gate", "up")}
    assert every == sorted(names)  # each key once over the ranks


def test_one_process_groups_its_rounds_and_prepared_export_takes_the_option():
    inventory = open_inventory(str(EXAMPLE))
    config = read_config(inventory)
    state = remapdsl.compile_rules(remapdsl.load_rules(QWEN), inventory, config).empty_state_dict()
    remapdsl.load(state, str(EXAMPLE), QWEN)
    plain = list(remapdsl.export(state, QWEN, like=EXAMPLE, bucket_bytes=1000))
    prepared = remapdsl.prepare(QWEN, EXAMPLE)
    for groups in (list(remapdsl.export(state, QWEN, like=EXAMPLE, bucket_bytes=1000, by_round=True)),
                   list(prepared.export(state, bucket_bytes=1000, by_round=True))):
        assert len(groups) > 1 and all(groups)  # one rank: every round is its own
        flat = [pair for group in groups for pair in group]
        assert [k for k, _ in flat] == [k for k, _ in plain]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(flat, plain))


def test_by_round_takes_no_regions():
    inventory = open_inventory(str(EXAMPLE))
    state = remapdsl.compile_rules(remapdsl.load_rules(QWEN), inventory, read_config(inventory)).empty_state_dict()
    with pytest.raises(remapdsl.RemapError) as info:
        next(remapdsl.export(state, QWEN, like=EXAMPLE, regions=True, by_round=True))
    d = info.value.diagnostics[0]
    assert d.code == "E542" and "by_round=True" in d.message and "drop `by_round`" in d.hint
