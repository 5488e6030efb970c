"""The export's schedule at DeepSeek-V3 scale on simulated meshes of 1,024 and 8,192 ranks.

Every rank of an export computes the same schedule: each checkpoint tensor's owner (one of its
writers, bytes balanced) and round, from what every rank writes. This runs that computation alone,
no process group: `compile_bench.py`'s BF16 DeepSeek-V3 inventory (46,183 tensors) with each
tensor's writers as an `ep` x `dp_shard` mesh places them (routed experts on the ep rank that holds
the expert, cut over its dp_shard group; everything else, replicated over ep, cut over the dp_shard
group of the ep replica its key picks, as an export's plan picks it),
checked against the mesh that `gather=("dp_shard",)` names. Baseline, in the same run: sorting the
(key, writer) entries once, the least any schedule must do. Reported: seconds (median of 3), the
ratio to the baseline, entries, rounds, the most bytes one rank assembles over the mean.
Run: `python bench/export_schedule_bench.py`.
"""

from __future__ import annotations

import os
import re
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compile_bench import deepseek_v3_config, deepseek_v3_shapes
from derive_bench import median_seconds

from remapdsl.checkpoint.inventory import Inventory
from remapdsl.drivers.export import _schedule
from remapdsl.sharding import Mesh

EXPERT = re.compile(r"\.experts\.(\d+)\.")


def writers_of(shapes: dict, ep: int, dp: int) -> list[dict]:
    """What each rank of an ep x dp_shard mesh writes (key -> its mesh coordinates), as the ranks of an
    export exchange it; rank = e * dp + d."""
    everyone: list[dict] = [{} for _ in range(ep * dp)]
    for key in shapes:
        m = EXPERT.search(key)
        e = int(m.group(1)) % ep if m else zlib.crc32(key.encode()) % ep  # a replicated tensor: its key's replica
        for d in range(dp):
            everyone[e * dp + d][key] = (("ep", e), ("dp_shard", d))
    return everyone


def main() -> None:
    config = deepseek_v3_config(256)
    shapes = deepseek_v3_shapes(config)
    inventory = Inventory.from_shapes(shapes)
    print(f"load average {os.getloadavg()[0]:.2f}; {len(shapes)} checkpoint tensors")
    for ep, dp in ((128, 8), (256, 32)):
        mesh = Mesh.of({"ep": ep, "dp_shard": dp})
        everyone = writers_of(shapes, ep, dp)

        def schedule(everyone=everyone):
            return _schedule(everyone, inventory, 256 << 20, ("dp_shard",), [])

        def baseline(everyone=everyone):
            return sorted((k, r) for r, keys in enumerate(everyone) for k in keys)

        seconds, result = median_seconds(schedule, runs=3)
        base, entries = median_seconds(baseline, runs=3)
        load = [0] * (ep * dp)
        for key, o in result.owner.items():
            load[o] += inventory.tensors[key].nbytes
        mean = sum(load) / len(load)
        print(f"ep={ep} x dp_shard={dp} ({ep * dp} ranks): schedule {seconds:.2f} s, sorting the entries "
              f"{base:.2f} s (baseline), ratio {seconds / base:.1f}; {len(entries)} entries, {result.rounds} rounds, "
              f"most assembled by one rank {max(load) / mean:.2f}x the mean")


if __name__ == "__main__":
    main()
