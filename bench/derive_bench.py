"""Derive a DeepSeek-V3 checkpoint layout from runtime shapes alone (a save without `like`).

`compile_bench.py`'s BF16 DeepSeek-V3 inventory (46,183 tensors; `--experts 512` for ~91k) is
compiled once with `rules/deepseek_v3.remap` (stacked experts: 967 runtime tensors) and with
`rules/identity.remap` (every name kept: one runtime tensor per checkpoint tensor); the runtime
shapes are then handed to `derive_checkpoint`, which undoes the rules and checks its result by
compiling forward. Baseline, in the same run: the plain compile of the same rules and inventory.
Reported: median of 5 of each, the ratio derive / compile, and the tracemalloc peak of one derive.
Goal: derive within 3x of one compile (it is one backward pass plus one compile), under 3 s.
Run: `python bench/derive_bench.py [--experts 256]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compile_bench import deepseek_v3_config, deepseek_v3_shapes

import remapdsl
from remapdsl.checkpoint.inventory import Inventory
from remapdsl.compile.derive import derive_checkpoint

RULES = Path(__file__).resolve().parent.parent / "rules"


def median_seconds(fn, runs: int = 5) -> tuple[float, object]:
    """The median CPU seconds of `runs` calls of `fn` (this process's own, not the noisy wall
    clock), and what the last call returned."""
    times, result = [], None
    for _ in range(runs):
        start = time.process_time()
        result = fn()
        times.append(time.process_time() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    args = parser.parse_args()
    config = deepseek_v3_config(args.experts)
    shapes = deepseek_v3_shapes(config)
    inventory = Inventory.from_shapes(shapes)
    print(f"load average {os.getloadavg()[0]:.2f}; {len(shapes)} checkpoint tensors")
    for name in ("deepseek_v3", "identity"):
        rules = remapdsl.load_rules(RULES / f"{name}.remap")
        compiled = remapdsl.compile_rules(rules, inventory, config)
        runtime = {d.runtime_key: (d.shape, d.dtype) for d in compiled.runtime_tensors}
        derived = derive_checkpoint(rules, runtime, config)
        want = {k: v for k, v in shapes.items() if k not in compiled.dropped}
        assert derived == {k: (BY_NAME_OR(v[0]), tuple(v[1])) for k, v in want.items()}, name
        compile_s, _ = median_seconds(lambda r=rules: remapdsl.compile_rules(r, inventory, config))
        derive_s, _ = median_seconds(lambda r=rules, t=runtime: derive_checkpoint(r, t, config))
        tracemalloc.start()
        derive_checkpoint(rules, runtime, config)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"{name}: {len(runtime)} runtime -> {len(derived)} checkpoint tensors; derive {derive_s:.2f} s, "
              f"compile {compile_s:.2f} s (baseline), ratio {derive_s / compile_s:.2f}; "
              f"derive peak {peak / 2**20:.0f} MiB")


def BY_NAME_OR(dtype: str) -> str:
    """A shape table's dtype (a name or a safetensors code) as the inventory stores it: the name."""
    from remapdsl.dtypes import BY_NAME, BY_SAFETENSORS

    return dtype if dtype in BY_NAME else BY_SAFETENSORS[dtype].name


if __name__ == "__main__":
    main()
