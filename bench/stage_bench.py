"""Pipeline stages at DeepSeek-V3 scale, from headers alone: one rank's load and save plans, and the
check of what all ranks hold together, on a pp=16 x ep=8 x tp=8 mesh (1,024 ranks).

The inventory and rules are `compile_bench.py`'s synthetic BF16 DeepSeek-V3 (`Inventory.from_shapes`,
no files) and `rules/deepseek_v3.remap`; the layout is `plan_bench.py`'s EP x TP one, `Replicate()` on
`pp`. A rank of stage s holds only its stage's tensors: layers L with L * 16 // 61 == s, the embedding
on stage 0, the final norm and the head on stage 15 (plain local shards under the layout, meta tensors).

- load plan: `make_load_plan` of the rank's held boxes (what `remapdsl.load` plans on that rank);
- save plan: `writers`, `hold`, `owned` with the ranks' holders, `make_write_plan` (what `remapdsl.save`
  computes before its first write);
- the coverage check, simulated: every rank's part (`HeldTogether.part`: its placements as bit sets)
  is made and pickled as `dist.gather_all` sends it; then what each rank does with them, timed:
  unpickle all 1,024 and run `HeldTogether.check` (every tensor held by some rank, placed alike).

Goals (the pipeline-stages issue): load plan < 0.3 s, save plan < 0.5 s, coverage check < 50 ms of
CPU per rank. Run: `python bench/stage_bench.py [--ranks first,last]` (about a minute).
"""

from __future__ import annotations

import argparse
import gc
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MESH = "pp=16,ep=8,tp=8"
GOALS = {"load": 0.3, "save": 0.5, "check": 0.05}


def stage_of(key: str, stages: int, layers: int) -> int:
    if key.startswith("model.layers."):
        return int(key.split(".")[2]) * stages // layers
    return 0 if key.startswith("model.embed_tokens") else stages - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="first,last", help="ranks whose plans are timed: first, last, numbers")
    args = parser.parse_args()

    import os

    import torch
    from compile_bench import compile_once, deepseek_v3_config, deepseek_v3_shapes
    from plan_bench import layout_plan

    from remapdsl.checkpoint.inventory import Inventory
    from remapdsl.compile.inverse import writers
    from remapdsl.drivers.prepare import HeldTogether
    from remapdsl.gcpause import paused_gc
    from remapdsl.sharding.holdings import held_by_layout, hold, owned
    from remapdsl.sharding.layouts import parse_mesh
    from remapdsl.sharding.plans import make_load_plan, make_write_plan

    config = deepseek_v3_config(256)
    config["num_nextn_predict_layers"] = 0  # a save writes back what the model holds (as plan_bench's save)
    inventory = Inventory.from_shapes(deepseek_v3_shapes(config))
    mesh = parse_mesh(MESH)
    layout = layout_plan(mesh)
    stages, layers = mesh.sizes[0], config["num_hidden_layers"]
    with paused_gc():
        compiled = compile_once(inventory, config)
    print(f"DeepSeek-V3 BF16 headers: {len(inventory.tensors)} tensors, {len(compiled.runtime_tensors)} runtime "
          f"tensors; mesh {MESH} ({mesh.size} ranks); load average {os.getloadavg()[0]:.1f}")

    def tensors_of(rank: int) -> dict:
        stage = mesh.coordinate(rank)[0]
        held = held_by_layout(compiled, layout, mesh, rank)
        return {d.runtime_key: torch.empty(held[d.runtime_key].shape, dtype=getattr(torch, d.dtype), device="meta")
                for d in compiled.runtime_tensors if stage_of(d.runtime_key, stages, layers) == stage}

    # every rank's part of the coverage exchange, as gather_all sends it (made outside the timing)
    together = HeldTogether(compiled, lambda holding: holding, mesh)
    start = time.perf_counter()
    payloads, part_seconds = [], []
    for rank in range(mesh.size):
        holding = hold(compiled, tensors_of(rank), layout, mesh, rank, whole=False)
        t = time.perf_counter()
        part = together.part(holding)
        part_seconds.append(time.perf_counter() - t)
        payloads.append(pickle.dumps((None, None, part), protocol=pickle.HIGHEST_PROTOCOL))
    print(f"  {mesh.size} ranks' holdings made in {time.perf_counter() - start:.1f} s; a rank's part: "
          f"{max(part_seconds) * 1e3:.2f} ms at most, {sum(map(len, payloads)) / len(payloads):.0f} B pickled")
    gc.collect()
    with paused_gc():
        t0 = time.perf_counter()
        gathered = [pickle.loads(p) for p in payloads]
        t1 = time.perf_counter()
        together.check([p for _, _, p in gathered])
        t2 = time.perf_counter()
    check = max(part_seconds) + t2 - t0
    holders = together.holders
    print(f"  coverage check per rank: {check * 1e3:.1f} ms (own part {max(part_seconds) * 1e3:.2f} ms, unpickling "
          f"{mesh.size} parts {(t1 - t0) * 1e3:.1f} ms, check {(t2 - t1) * 1e3:.1f} ms): "
          f"{'meets' if check < GOALS['check'] else 'MISSES'} < {GOALS['check'] * 1e3:.0f} ms")

    chosen_ranks = [0 if r == "first" else mesh.size - 1 if r == "last" else int(r) for r in args.ranks.split(",")]
    for rank in chosen_ranks:
        tensors = tensors_of(rank)
        gc.collect()
        with paused_gc():
            t = time.perf_counter()
            holding = hold(compiled, tensors, layout, mesh, rank, whole=False)
            load = make_load_plan(compiled, inventory, holding.held(), rank)
            load_s = time.perf_counter() - t
        gc.collect()
        with paused_gc():
            t = time.perf_counter()
            chosen = writers(compiled)
            holding = hold(compiled, tensors, layout, mesh, rank, whole=False)
            mine = owned(holding, rank, holders=holders)
            save = make_write_plan(chosen, inventory, mine, rank, compiled.logical_by_key())
            save_s = time.perf_counter() - t
        print(f"  rank {rank} (stage {mesh.coordinate(rank)[0]}, {len(tensors)} runtime tensors): load plan "
              f"{load_s:.3f} s ({len(load.items)} items, {load.bytes_read / 1e9:.2f} GB read = "
              f"{load.bytes_read / max(load.bytes_owned, 1):.2f}x owned) "
              f"{'meets' if load_s < GOALS['load'] else 'MISSES'}; save plan {save_s:.3f} s "
              f"({len(save.items)} items, {save.bytes_written / 1e9:.2f} GB) "
              f"{'meets' if save_s < GOALS['save'] else 'MISSES'}")
    print(f"load average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
