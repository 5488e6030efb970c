"""Where the time of a 2-rank sharded load goes, phase by phase (warm cache, steady state).

Each of 2 gloo ranks loads its Shard(0) DTensors of the 400 MB checkpoint that dist_bench.py
writes (run `python bench/dist_bench.py --dcp` once first), three times, timing the phases of
`remapdsl.load` separately: rules, shared headers, compile and digest agreement (one exchange), plan + reads. The
last two rounds show the steady state; the first includes one-time costs.

    OMP_NUM_THREADS=1 python bench/dist_phases.py
"""

from __future__ import annotations

import datetime
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OUT = Path(__file__).resolve().parent / "out"
FOLDER = OUT / os.environ.get("PHASES_FOLDER", "dist_llama_400mb")
RULES = OUT / os.environ.get("PHASES_RULES", "dist_rules_identity.remap")


def _worker(rank: int, world: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import remapdsl
    from remapdsl.runtime import dist as shared
    from remapdsl.runtime.read import run_load_plan
    from remapdsl.sharding.holdings import hold
    from remapdsl.sharding.plans import make_load_plan
    from remapdsl.gcpause import paused_gc

    inventory = remapdsl.open_checkpoint(FOLDER)
    mesh = init_device_mesh("cpu", (world,))
    targets = {k: distribute_tensor(torch.zeros(t.shape, dtype=getattr(torch, t.dtype)), mesh, [Shard(0)])
               for k, t in inventory.tensors.items()}
    for round_ in range(3):
        dist.barrier()
        phases = {}
        start = mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            phases[name] = (time.perf_counter() - mark) * 1e3
            mark = time.perf_counter()

        pause = paused_gc()  # as remapdsl.load does
        pause.__enter__()
        rules = remapdsl.load_rules(RULES)
        lap("rules")
        inv = shared.share_inventory(FOLDER)
        lap("shared headers")
        compiled = shared.together(lambda: remapdsl.compile_rules(rules, inv),
                                   agree_on=("compiled rules", remapdsl.compile.Compiled.digest))
        lap("compile + agreement")
        def plan_and_read():
            holding = hold(compiled, targets, rank=shared.rank())
            plan = make_load_plan(compiled, inv, holding.held(), shared.rank())
            run_load_plan(plan, inv, holding.local)
            return plan

        report = shared.together(plan_and_read)
        lap("plan + reads")
        pause.__exit__(None, None, None)
        if rank == 0:
            total = (time.perf_counter() - start) * 1e3
            detail = ", ".join(f"{k} {v:.1f} ms" for k, v in phases.items())
            print(f"round {round_}: {detail}; total {total:.1f} ms; "
                  f"{report.bytes_read / 1e6:.1f} MB read per rank")
    _shut_down()


def main() -> None:
    if not FOLDER.is_dir():
        raise SystemExit(f"{FOLDER} is missing: run `python bench/dist_bench.py --dcp` first")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    subprocess.run(f"cat {FOLDER}/*.safetensors > /dev/null", shell=True, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, f"{tmp}/rendezvous"), nprocs=2)


if __name__ == "__main__":
    main()


def _shut_down() -> None:
    """Leave the group together: a rank tearing down gloo while its peer is still in a collective
    can abort the peer's process."""
    import torch.distributed as dist

    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()

