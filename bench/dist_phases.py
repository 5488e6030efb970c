"""Where the time of a 2-rank sharded load goes, phase by phase (first round and steady state).

Each of 2 gloo ranks loads its Shard(0) DTensors (built with `DTensor.from_local`, as dist_bench.py
does: `distribute_tensor` would be one collective a tensor) of the 400 MB checkpoint that
dist_bench.py writes (run `python bench/dist_bench.py --dcp` once first), three times, timing the
phases of `remapdsl.load` separately, in the order `prepare_everywhere` and `load` run them: rules,
shared headers (rank 0 reads them, one broadcast), config, compile digest (of the inputs), compile +
agreement (one exchange), then this rank's holdings (`hold`), its plan (`make_load_plan`) and the
reads (`run_load_plan`), those three inside one `together` exchange as in `load`; "plan + reads" is
their sum. Every round makes everything anew, as a one-shot `remapdsl.load` does; the collector is
paused inside compile and plan only, as there. The last two rounds show the steady state; the first
includes one-time costs (building the parser). Each round's lines also give rank 0's CPU time per phase
(`time.process_time`, less sensitive than wall time to other work on the machine) and the wall time
a tensor of each phase (microseconds per checkpoint tensor).

    OMP_NUM_THREADS=1 python bench/dist_phases.py

PHASES_FOLDER and PHASES_RULES name another checkpoint and rule file under bench/out/:
`PHASES_FOLDER=dist_llama_moe PHASES_RULES=dist_rules_everything.remap` (the 1,008 tensors of
`--dcp-spec moe`), `PHASES_FOLDER=dist_llama_deepseek PHASES_RULES=dist_rules_everything.remap` (the
23,123 tensors of `--dcp-spec deepseek`). PHASES_ROUNDS sets the number of rounds (3).
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
ROUNDS = int(os.environ.get("PHASES_ROUNDS", "3"))


def sharded_targets(inventory, mesh, world: int, rank: int) -> dict:
    """Zeroed local Shard(0) pieces (torch.chunk's split, uneven allowed) wrapped as DTensors."""
    from torch.distributed.tensor import DTensor, Shard

    targets = {}
    for key, info in inventory.tensors.items():
        shape = tuple(info.shape)
        step = -(-shape[0] // world)
        rows = max(0, min(shape[0], (rank + 1) * step) - min(shape[0], rank * step))
        local = torch.zeros((rows, *shape[1:]), dtype=getattr(torch, info.dtype))
        stride = tuple(int(torch.Size(shape[d + 1:]).numel()) for d in range(len(shape)))
        targets[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                          shape=torch.Size(shape), stride=stride)
    return targets


def _worker(rank: int, world: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from torch.distributed.device_mesh import init_device_mesh

    import remapdsl

    inventory = remapdsl.open_checkpoint(FOLDER)
    count = len(inventory.tensors)
    mesh = init_device_mesh("cpu", (world,))
    targets = sharded_targets(inventory, mesh, world, rank)
    for round_ in range(ROUNDS):
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        phases, cpu, inner, report = _one_load(targets)
        if rank == 0:
            total = (time.perf_counter() - start) * 1e3
            detail = ", ".join(f"{k} {v:.1f} ms" for k, v in phases.items())
            split = ", ".join(f"{k} {v:.1f}" for k, v in inner.items())
            per = ", ".join(f"{k} {v * 1e3 / count:.1f}" for k, v in {**phases, **inner}.items()
                            if k != "plan + reads")
            used = ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
            print(f"round {round_}: {detail} ({split}); total {total:.1f} ms; "
                  f"{report.bytes_read / 1e6:.1f} MB read per rank; {len(report.items)} items\n"
                  f"  rank 0 CPU ms (process_time, both reader threads): {used}; total "
                  f"{(time.process_time() - cpu_start) * 1e3:.1f}\n"
                  f"  us per tensor ({count} tensors): {per}; total {total * 1e3 / count:.1f}", flush=True)
    _shut_down()


def _one_load(targets: dict) -> tuple[dict, dict, dict, object]:
    """One `remapdsl.load`, its phases run one by one: wall and CPU ms per phase, the split of
    plan + reads, and the plan."""
    import remapdsl
    from remapdsl.checkpoint import read_config
    from remapdsl.checkpoint import open_inventory
    from remapdsl.drivers.prepare import compile_digest
    from remapdsl.runtime import dist as shared
    from remapdsl.runtime.read import run_load_plan
    from remapdsl.sharding.holdings import hold
    from remapdsl.sharding.plans import make_load_plan

    phases, cpu, inner = {}, {}, {}
    mark, cpu_mark = time.perf_counter(), time.process_time()

    def lap(name: str) -> None:
        nonlocal mark, cpu_mark
        phases[name] = (time.perf_counter() - mark) * 1e3
        cpu[name] = (time.process_time() - cpu_mark) * 1e3
        mark, cpu_mark = time.perf_counter(), time.process_time()

    rules = remapdsl.load_rules(RULES)
    lap("rules")
    inv = shared.from_first(lambda: open_inventory(str(FOLDER)), "reading the checkpoint's headers")
    inv = inv.restamped(str(FOLDER)) if shared.rank() else inv
    lap("shared headers")
    config = read_config(inv)
    lap("config")
    digest = compile_digest(rules, config, True, str(FOLDER))
    lap("digest")
    compiled = shared.together(lambda: remapdsl.compile_rules(rules, inv, config, strict=True),
                               agree_on=shared.Agreement("compiled rules and checkpoint",
                                                         lambda _: {"compiled rules and checkpoint": digest}),
                               phase="compiling")
    lap("compile + agreement")

    def plan_and_read():
        t0 = time.perf_counter()
        holding = hold(compiled, targets, rank=shared.rank())
        t1 = time.perf_counter()
        held = holding.held()
        plan = make_load_plan(compiled, inv, held, shared.rank())
        t2 = time.perf_counter()
        run_load_plan(plan, inv, holding.local)
        t3 = time.perf_counter()
        inner.update(hold=(t1 - t0) * 1e3, plan=(t2 - t1) * 1e3, reads=(t3 - t2) * 1e3)
        return plan

    report = shared.together(plan_and_read, phase="planning and reading")
    lap("plan + reads")
    return phases, cpu, inner, report


def main() -> None:
    if not FOLDER.is_dir():
        raise SystemExit(f"{FOLDER} is missing: run `python bench/dist_bench.py --dcp` first")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    subprocess.run(f"cat {FOLDER}/*.safetensors > /dev/null", shell=True, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, f"{tmp}/rendezvous"), nprocs=2)


def _shut_down() -> None:
    """Leave the group together: a rank tearing down gloo while its peer is still in a collective
    can abort the peer's process."""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
