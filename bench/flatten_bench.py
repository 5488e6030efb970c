"""A flattening reshape at DeepSeek-V3 size costs what reading the tensor as it is costs.

Headers only (`Inventory.from_shapes`): DeepSeek-V3's embedding [129280, 7168] and an MLA
`kv_b_proj`-shaped [128, 192, 7168] tensor, compiled two ways, side by side in one process:
- identity: `e -> e`, `k -> k` (the baseline: one block a tensor);
- flatten: `e -> flat | reshape([-1])`, `k -> k2 | reshape([24576, 7168])` (merged dims whose rows
  follow each other in the file: one block a tensor over its flat view, where it once took a block a
  row, 129,408 in all).
Each is compiled, then one rank's load plan and save plan (`hold` of meta tensors of its shards,
`owned`, `writers` and `make_write_plan`) are made
on a `tp=8` mesh, `Shard(0)` of every tensor, for ranks 0 and 7; the median of `--repeat` rounds
(all variants interleaved, so machine noise hits both) and the ratio flatten / identity are shown,
with blocks, plan items and byte runs. Goal: every phase of the flatten under 10 ms, with the
identity's blocks, items and runs (the per-row blocks took seconds: compile 8.7 s, a load plan
2.2 s); the ratios are a few reshape ops on tensors this cheap, not a cost that grows.

    python bench/flatten_bench.py [--repeat 21]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import remapdsl
from remapdsl.compile.inverse import writers
from remapdsl.language import rules_from_text
from remapdsl.sharding import LayoutPlan, Mesh, Shard
from remapdsl.sharding.holdings import held_by_layout, hold, owned
from remapdsl.sharding.plans import make_write_plan

SHAPES = {"e": ("bfloat16", (129280, 7168)), "k": ("bfloat16", (128, 192, 7168))}
VARIANTS = {
    "identity": ("remap 1\ne -> e\nk -> k\n", ("e", "k")),
    "flatten": ("remap 1\ne -> flat | reshape([-1])\nk -> k2 | reshape([24576, 7168])\n", ("flat", "k2")),
}
RANKS = 8


def one_round(name: str, inventory) -> dict:
    """Seconds of compile, load plan and save plan (ranks 0 and last), and the plans' sizes."""
    text, keys = VARIANTS[name]
    rules = rules_from_text(text, f"{name}.remap")
    start = time.perf_counter()
    compiled = remapdsl.compile_rules(rules, inventory, {})
    compiled_at = time.perf_counter()
    layout = LayoutPlan.from_mapping({k: [Shard(dim=0)] for k in keys}, mesh_dim="tp")
    mesh = Mesh.of({"tp": RANKS})
    load = save = 0.0
    items = runs = 0
    for rank in (0, RANKS - 1):
        t0 = time.perf_counter()
        plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)
        t1 = time.perf_counter()
        held = held_by_layout(compiled, layout, mesh, rank)  # the model's local shards, as meta tensors
        tensors = {k: torch.empty(held[k].shape, dtype=torch.bfloat16, device="meta") for k in keys}
        t2 = time.perf_counter()
        mine = owned(hold(compiled, tensors, layout, mesh, rank), rank)
        write = make_write_plan(writers(compiled), inventory, mine, rank, compiled.logical_by_key())
        t3 = time.perf_counter()
        load, save = load + t1 - t0, save + t3 - t2
        items += len(plan.items) + len(write.items)
        runs += sum(i.runs.count for i in plan.items) + sum(i.runs.count for i in write.items)
        assert plan.bytes_read == plan.bytes_owned, (name, rank)
    return {"compile": compiled_at - start, "load plan": load / 2, "save plan": save / 2,
            "blocks": sum(len(d.blocks) for d in compiled.runtime_tensors), "items": items, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args()
    inventory = remapdsl.Inventory.from_shapes(SHAPES)
    rounds: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeat):
        for name in VARIANTS:
            rounds[name].append(one_round(name, inventory))
    print(f"{'variant':<10} {'compile s':>10} {'load plan s':>12} {'save plan s':>12} {'blocks':>7} {'items':>6} "
          f"{'runs':>6}")
    median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    for name, m in median.items():
        print(f"{name:<10} {m['compile']:>10.4f} {m['load plan']:>12.4f} {m['save plan']:>12.4f} "
              f"{m['blocks']:>7.0f} {m['items']:>6.0f} {m['runs']:>6.0f}")
    ratios = {k: median["flatten"][k] / median["identity"][k] for k in ("compile", "load plan", "save plan")}
    met = max(median["flatten"][k] for k in ratios) < 0.01 and all(
        median["flatten"][k] == median["identity"][k] for k in ("blocks", "items", "runs"))
    print("flatten / identity: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
          + f"  (goal: each phase under 10 ms, the identity's plan sizes: {'met' if met else 'NOT met'})")


if __name__ == "__main__":
    main()
