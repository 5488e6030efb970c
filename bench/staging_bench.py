"""The staging ring on the CPU: a ~1 GB load through it against the direct reads, side by side.

A CUDA destination gets its bytes through a bounded ring of pinned host buffers
(remapdsl/runtime/staging.py). On this CPU machine the same path is taken with pinning off and the
"device" copy a host `copy_` (`Staging(everything=True)`): every byte is read into a ring buffer,
then copied to its place. Measured in one process, the two orders alternated round by round, the
files warmed with `cat` before each load:

  direct   run_load_plan into CPU tensors: reads straight into tensor memory (the default path).
  staged   the same plan, every item through the ring (remapdsl.runtime.staging.STAGING: four 2 MiB
           buffers per reader thread).
  per-item what the ring replaced, shown only: each item read into a staging buffer of its own,
           allocated for it and kept to the end of the load (as device destinations were served
           before the ring: there pinned, here not), then copied to its place; one thread.

and, for the whole-tensor layout, two limits of this machine outside remapdsl, on 2 threads into
touched memory: `one copy` (os.preadv straight into the destination, 32 MiB a call) and `two
copies` (os.preadv into a 2 MiB buffer of the thread's own, then `copy_` to the destination: what
any staged path does on a CPU, where the second copy is no copy engine's but the CPU's own).

Two layouts of the same checkpoint (dist_bench's ~1.04 GB Llama-shaped `1gb` one, identity rules):
whole tensors (one run per tensor) and rank 0 of tp=2 column shards (one run per row). Printed: the
median seconds and GB/s of each, the staged/direct throughput ratio (goal >= 0.9 for whole tensors),
and the staging bytes the ring allocated (never above its bound), checked against the direct load.

    python bench/staging_bench.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

import remapdsl
from remapdsl.runtime.read import run_load_plan
from remapdsl.runtime.staging import STAGING, Rings
from remapdsl.sharding import LayoutPlan, Mesh, Shard, layout_for, local_shard

HERE = Path(__file__).resolve().parent
GOAL = 0.9


def limit(files: list[str], two_copies: bool) -> float:
    """Seconds to read every file's bytes after its first 4 kB page into one touched buffer on 2
    threads: straight in (32 MiB a call), or through a 2 MiB buffer per thread then `copy_`."""
    pieces, total = [], 0
    step = (2 << 20) if two_copies else (32 << 20)
    for path in files:
        size = os.path.getsize(path) - 4096
        pieces += [(path, 4096 + at, total + at, min(step, size - at)) for at in range(0, size, step)]
        total += size
    destination = getattr(limit, "destination", None)
    if destination is None or destination.numel() < total:
        destination = limit.destination = torch.zeros(total, dtype=torch.uint8)
    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    view = memoryview(destination.numpy())

    def work(mine) -> None:
        buffer = torch.empty(step, dtype=torch.uint8)
        scratch = memoryview(buffer.numpy())
        for path, offset, at, n in mine:
            if two_copies:
                os.preadv(fds[path], [scratch[:n]], offset)
                destination[at:at + n].copy_(buffer[:n])
            else:
                os.preadv(fds[path], [view[at:at + n]], offset)

    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    threads = [threading.Thread(target=work, args=(pieces[k::2],)) for k in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    for fd in fds.values():
        os.close(fd)
    return seconds


def per_item(plan, inventory, tensors) -> None:
    """Each item read into a fresh buffer of its own, kept to the end, then copied to its region."""
    from remapdsl.checkpoint import CheckpointReader
    from remapdsl.runtime.pieces import region

    kept = []
    with CheckpointReader(inventory) as reader:
        for item in plan.items:
            staging = torch.empty(item.runs.total, dtype=torch.uint8)
            reader.read_runs_into(item.file, item.runs, staging)
            view = region(tensors[item.runtime_key], item)
            view.copy_(staging.view(view.dtype).as_strided(item.sizes, item.strides))
            kept.append(staging)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    import dist_bench

    folder = dist_bench.ensure_checkpoint("1gb", False)
    dist_bench.write_rules()
    rules = remapdsl.load_rules(str(dist_bench.RULE_FILES["identity"]))
    inventory = remapdsl.open_checkpoint(str(folder))
    compiled = remapdsl.compile_rules(rules, inventory)
    files = [str(folder / f) for f in inventory.files]
    staging = STAGING._replace(pin=False, everything=True)
    print(f"{folder.relative_to(HERE.parent)}: {sum(t.nbytes for t in inventory.tensors.values()) / 1e9:.3f} GB in {len(inventory.tensors)} tensors; "
          f"ring: {staging.buffers} buffers of {staging.buffer_bytes >> 10} kB per reader thread, 2 threads "
          f"(bound {staging.bound(2) >> 20} MiB), pinning off; {args.runs} rounds")
    for name, layout, mesh in (("whole tensors", None, None),
                               ("tp=2 columns, rank 0", LayoutPlan.from_mapping({"*": [Shard(dim=1)]},
                                                                               mesh_dim="tp"), Mesh.of({"tp": 2}))):
        if layout is None:
            from remapdsl.sharding.holdings import whole_shard
            from remapdsl.sharding.plans import make_load_plan

            plan = make_load_plan(compiled, inventory, {d.runtime_key: whole_shard(d.shape)
                                                        for d in compiled.runtime_tensors})
            shapes = {d.runtime_key: d.shape for d in compiled.runtime_tensors}
        else:
            plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, 0)
            shapes = {d.runtime_key: local_shard(d.shape, mesh.sizes, layout_for(d.runtime_key, d.shape, layout, mesh),
                                                 mesh.coordinate(0)).shape for d in compiled.runtime_tensors}
        dtypes = {d.runtime_key: getattr(torch, d.dtype) for d in compiled.runtime_tensors}
        direct = {k: torch.zeros(s, dtype=dtypes[k]) for k, s in shapes.items()}
        staged = {k: torch.zeros(s, dtype=dtypes[k]) for k, s in shapes.items()}
        times: dict[str, list[float]] = {"direct": [], "staged": [], "per-item": []}
        others = {k: torch.zeros(s, dtype=dtypes[k]) for k, s in shapes.items()}
        peak = 0
        for r in range(args.runs):
            for mode in ("direct", "staged", "per-item") if r % 2 == 0 else ("per-item", "staged", "direct"):
                subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
                rings = Rings(staging) if mode == "staged" else None
                start = time.perf_counter()
                if mode == "per-item":
                    per_item(plan, inventory, others)
                elif rings is None:
                    run_load_plan(plan, inventory, direct)
                else:
                    with rings:
                        run_load_plan(plan, inventory, staged, rings=rings)
                times[mode].append(time.perf_counter() - start)
                if rings is not None:
                    peak = max(peak, rings.allocated)
        same = all(torch.equal(staged[k], direct[k]) and torch.equal(others[k], direct[k]) for k in direct)
        nbytes = plan.bytes_read
        medians = {m: statistics.median(t) for m, t in times.items()}
        ratio = medians["direct"] / medians["staged"]
        per_round = statistics.median(d / s for d, s in zip(times["direct"], times["staged"]))
        print(f"\n{name}: {nbytes / 1e9:.3f} GB read, {len(plan.items)} items")
        for mode, t in medians.items():
            print(f"  {mode:7s} {t:.3f} s  {nbytes / t / 1e9:5.2f} GB/s  (min {min(times[mode]):.3f}, "
                  f"max {max(times[mode]):.3f})")
        print(f"  staged throughput / per-item: {medians['per-item'] / medians['staged']:.2f} (shown only)")
        print(f"  staged throughput / direct: {ratio:.2f} (per round {per_round:.2f})"
              + (f"; goal >= {GOAL} -> {'meets' if ratio >= GOAL else 'MISSES'}" if layout is None else " (shown only)"))
        if layout is None:
            one = statistics.median(limit(files, False) for _ in range(args.runs))
            two = statistics.median(limit(files, True) for _ in range(args.runs))
            print(f"  limits: one copy {one:.3f} s, two copies {two:.3f} s: two / one copy {one / two:.2f}; "
                  f"staged / two copies {two / medians['staged']:.2f}")
        print(f"  staging allocated at most {peak >> 20} MiB (bound {staging.bound(2) >> 20} MiB: "
              f"{'within' if peak <= staging.bound(2) else 'OVER'}); staged == per-item == direct: {same}")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(HERE))
    main()
