"""A user's own script on gloo ranks exits cleanly after `load`, `save`, `convert`, `export` and `ingest`.

The script is what a user writes (a process group, DTensors on a device mesh, one remapdsl call,
`dist.destroy_process_group()`), run as plain processes, with no helper of this suite's: no
`gc.collect()`, no barrier before leaving the group. A collective whose buffers a gloo worker
thread still held when the interpreter shut down aborted such a script (SIGABRT, "terminate called
without an active exception") in about one run of four; every run must now exit with 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = str(ROOT / "examples" / "tiny-qwen3-moe")
RULES = str(ROOT / "rules" / "qwen3_moe.remap")

SCRIPT = textwrap.dedent("""
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import remapdsl

    rank, world, rendezvous, call, out, checkpoint, rules = sys.argv[1:]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=int(rank), world_size=int(world))
    mesh = init_device_mesh("cpu", (int(world),))
    shapes = remapdsl.compile_rules(remapdsl.load_rules(rules), checkpoint).empty_state_dict()
    model = {key: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)]) for key, t in shapes.items()}
    remapdsl.load(model, checkpoint, rules)
    if call == "save":
        remapdsl.save(model, out, rules, like=checkpoint)
    elif call == "convert":
        remapdsl.convert(checkpoint, out, rules)
    elif call == "export":
        pairs = dict(remapdsl.export(model, rules, like=checkpoint, gather=("dim0",), bucket_bytes=4096))
    elif call == "ingest":
        from safetensors.torch import load_file

        remapdsl.ingest(model, load_file(checkpoint + "/model.safetensors"), rules, like=checkpoint)
    dist.destroy_process_group()
""")

WORLD = 2
CALLS = ["load", "save", "convert", "export", "ingest"]  # the call made last before exit


def _run(script: Path, tmp: Path, run: int, call: str) -> list[tuple[int, str]]:
    rendezvous, out = tmp / f"rendezvous{run}", tmp / f"out{run}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "TORCH_DISTRIBUTED"))}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(WORLD), str(rendezvous), call, str(out),
                               CHECKPOINT, RULES], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
             for r in range(WORLD)]
    results = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        results.append((proc.returncode, output.decode(errors="replace")[-2000:]))
    return results


def test_user_scripts_exit_cleanly_after_every_call(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    failures = []
    for run, call in enumerate(CALLS):
        for rank, (code, output) in enumerate(_run(script, tmp_path, run, call)):
            if code != 0:
                failures.append(f"run {run} ({call}), rank {rank}: exit {code}\n{output}")
    assert not failures, "\n\n".join(failures)
