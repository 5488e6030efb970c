"""Save benchmarks: single-process save throughput against safetensors, and per-rank memory at 4 ranks.

--speed  The ~1.04 GB Llama-style checkpoint of dist_bench.py (bench/out/dist_llama_1gb, made on
         first use), loaded outside the timing, saved in fresh processes, interleaved, 5 rounds:
           safetensors        `safetensors.torch.save_file` of the same tensors (the checkpoint's
                              own keys) into one file, then `os.fsync` of it (timed apart).
           remapdsl-identity  `remapdsl.save(state, out, rules, like=checkpoint)`, identity rules:
                              two files at full size, positioned writes, fsync, index, rename.
           remapdsl-fused     the same from the fused/stacked layout of dist_bench's rules (a)
                              (q/k/v and gate/up concatenated, o/down stacked over layers).
         Goal: throughput >= 0.8x safetensors', compared with the fsync on both sides (a remapdsl
         save always syncs before its rename) and without it on either (remapdsl's sync time is in
         its report). Round 1 checks that each save is byte-identical to
         the checkpoint it was loaded from. Each child runs `sync` before its timing: writes into
         the page cache are throttled by whatever an earlier run left dirty.
--ranks  4 gloo ranks, FSDP x TP on a 2x2 mesh (rows over dp, then tp: `[Shard(0), Shard(0)]`
         for every tensor), each rank's shards of the same checkpoint loaded, then saved: peak
         RSS growth during the save / bytes of the rank's shards, and bytes written per rank
         against the bytes of its shards (this layout replicates nothing, so it owns them all). Goals: <= 1.1 (plus the documented buffer:
         the largest piece a writer thread holds), and written = owned.

    python bench/save_bench.py [--speed] [--ranks] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_bench import FOLDERS, RULE_FILES, destinations, ensure_checkpoint, write_rules
from load_bench import maxrss, rss_now, tensor_files

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "save_tmp"
MODES = ("safetensors", "remapdsl-identity", "remapdsl-fused")
GOAL = 0.8


def identical(a: Path, b: Path) -> bool:
    import filecmp

    names = [p.name for p in a.iterdir() if p.suffix in (".safetensors", ".json") and p.name != "bench_manifest.json"]
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def child_speed(mode: str, verify: bool) -> dict:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    import remapdsl
    import remapdsl.drivers.load  # noqa: F401
    import remapdsl.drivers.save  # noqa: F401

    folder = FOLDERS["1gb"]
    out = OUT / f"{mode}-{os.getpid()}"
    shutil.rmtree(out, ignore_errors=True)
    result: dict = {}
    if mode == "safetensors":
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        handles = {f: safe_open(str(folder / f), framework="pt") for f in set(index.values())}
        tensors = {k: handles[f].get_tensor(k).clone() for k, f in index.items()}
        out.mkdir(parents=True)
        os.sync()  # no earlier run's dirty pages left to throttle this one
        start = time.perf_counter()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        written = time.perf_counter()
        fd = os.open(out / "model.safetensors", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        result.update(seconds=time.perf_counter() - start, write_only=written - start)
    else:
        rules = "identity" if mode == "remapdsl-identity" else "concat"
        spec = json.loads((folder / "bench_manifest.json").read_text())["spec"]
        if rules == "identity":
            inventory = remapdsl.open_checkpoint(str(folder))
            state = {k: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for k, t in inventory.tensors.items()}
        else:
            state = {k: torch.empty(s, dtype=torch.bfloat16) for k, (s, _) in destinations(rules, spec).items()}
        remapdsl.load(state, str(folder), str(RULE_FILES[rules]))
        os.sync()  # no earlier run's dirty pages left to throttle this one
        start = time.perf_counter()
        report = remapdsl.save(state, out, str(RULE_FILES[rules]), like=str(folder))
        result.update(seconds=time.perf_counter() - start, bytes_written=report.bytes_written,
                      write_only=time.perf_counter() - start - report.sync_seconds)
        if verify:
            result["identical"] = identical(folder, out)
    result["maxrss"] = maxrss()
    shutil.rmtree(out, ignore_errors=True)
    return result


def child_rank(rank: int, world: int, port: int) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    import remapdsl
    import remapdsl.drivers.load  # noqa: F401
    import remapdsl.drivers.save  # noqa: F401
    from remapdsl.sharding import LayoutPlan, Mesh, Shard, layout_for, local_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        folder = FOLDERS["1gb"]
        mesh = Mesh.of({"dp": 2, "tp": 2})
        plan = LayoutPlan.from_mapping({"*": [Shard(dim=0), Shard(dim=0)]}, mesh_dim="tp")
        inventory = remapdsl.open_checkpoint(str(folder))
        rules = str(RULE_FILES["identity"])
        local = {}
        for key, t in inventory.tensors.items():
            shard = local_shard(tuple(t.shape), mesh.sizes, layout_for(key, tuple(t.shape), plan, mesh),
                                mesh.coordinate(rank))
            local[key] = torch.empty(shard.shape, dtype=getattr(torch, t.dtype))
        remapdsl.load(local, str(folder), rules, layout=plan, mesh=mesh)
        shard_bytes = sum(t.nbytes for t in local.values())
        owned_bytes = shard_bytes  # [Shard(0), Shard(0)] replicates nothing: each rank owns its shards
        largest = max(t.nbytes for t in local.values())
        out = OUT / "ranks"
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)  # --ranks alone: no speed run made it
        dist.barrier()
        rss_before, peak_before = rss_now(), maxrss()
        start = time.perf_counter()
        report = remapdsl.save(local, out, rules, like=str(folder), layout=plan, mesh=mesh)
        seconds = time.perf_counter() - start
        result = {"seconds": seconds, "shard_bytes": shard_bytes, "owned": owned_bytes,
                  "written": report.bytes_written, "rss_before": rss_before, "peak_before": peak_before,
                  "peak_after": maxrss(), "largest": largest}
        dist.barrier()
        if rank == 0:
            result["identical"] = identical(folder, out)
            shutil.rmtree(out, ignore_errors=True)
        return result
    finally:
        dist.barrier()
        dist.destroy_process_group()


def spawn(extra: list[str]) -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *extra], capture_output=True, text=True,
                          timeout=900, cwd=str(HERE.parent), check=False)
    return _result(proc.stdout, proc.stderr, proc.returncode)


def _result(stdout: str, stderr: str, code: int) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exit {code}: " + " | ".join((stderr or stdout).strip().splitlines()[-3:])}


def bench_speed(runs: int) -> None:
    folder = FOLDERS["1gb"]
    nbytes = sum(os.path.getsize(f) for f in tensor_files(folder))
    print(f"\n[1] save throughput, {folder.relative_to(HERE.parent)} ({nbytes / 1e9:.3f} GB); fresh processes, "
          f"{runs} rounds, interleaved; output on the same filesystem (bench/out/save_tmp)")
    results: dict[str, list] = {m: [] for m in MODES}
    errors: dict[str, str] = {}
    for r in range(runs):
        for mode in MODES[r % len(MODES):] + MODES[: r % len(MODES)]:
            if mode in errors:
                continue
            got = spawn(["--child", mode] + (["--verify"] if r == 0 else []))
            (errors.__setitem__(mode, got["error"]) if "error" in got else results[mode].append(got))
    med = {}
    print(f"  {'mode':18s} {'median s':>9s} {'min-max s':>15s} {'GB/s':>6s}")
    for mode in MODES:
        if not results[mode]:
            print(f"  {mode:18s} n/a: {errors.get(mode)}")
            continue
        secs = [x["seconds"] for x in results[mode]]
        med[mode] = statistics.median(secs)
        print(f"  {mode:18s} {med[mode]:9.3f} {min(secs):7.3f}-{max(secs):7.3f} {nbytes / med[mode] / 1e9:6.2f}")
    writes = {m: statistics.median(x["write_only"] for x in results[m]) for m in MODES if results[m]}
    print("  without the fsync: " + ", ".join(f"{m} {s:.3f} s" for m, s in writes.items()))
    for mode in ("remapdsl-identity", "remapdsl-fused"):
        if results[mode]:
            print(f"  {mode}: round 1 output byte-identical to the checkpoint: {results[mode][0].get('identical')}")
    if "safetensors" in med:
        for mode in ("remapdsl-identity", "remapdsl-fused"):
            if mode in med:
                ratio = med["safetensors"] / med[mode]
                alone = writes["safetensors"] / writes[mode]
                print(f"throughput {mode} / safetensors: {ratio:.2f}x with fsync on both sides, {alone:.2f}x "
                      f"without it on either; goal >= {GOAL}x -> {'meets' if min(ratio, alone) >= GOAL else 'MISSES'}")


def bench_ranks() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print("\n[2] 4 gloo ranks, FSDP x TP (2x2 mesh, [Shard(0), Shard(0)]), the same checkpoint")
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "rank", "--world", "4", "--port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    procs = [subprocess.Popen(command + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=str(HERE.parent)) for r in range(4)]
    results = [_result(*p.communicate(timeout=900), p.returncode) for p in procs]
    for rank, x in enumerate(results):
        if "error" in x:
            print(f"  rank {rank}: {x['error']}")
            continue
        growth = max(0, x["peak_after"] - max(x["peak_before"], x["rss_before"]))
        print(f"  rank {rank}: shards {x['shard_bytes'] / 1e6:7.1f} MB, written {x['written'] / 1e6:7.1f} MB "
              f"(owned {x['owned'] / 1e6:7.1f} MB), {x['seconds']:.3f} s; peak RSS during the save "
              f"{(x['peak_after']) / 1e6:7.1f} MB = shards + {growth / 1e6:.1f} MB above the loaded state "
              f"(largest local tensor {x['largest'] / 1e6:.1f} MB)")
    if results and "identical" in results[0]:
        print(f"  output byte-identical to the checkpoint: {results[0]['identical']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--ranks", action="store_true")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child_rank(args.rank, args.world, args.port) if args.child == "rank" else \
            child_speed(args.child, args.verify)
        print("RESULT " + json.dumps(result), flush=True)
        return
    write_rules()
    ensure_checkpoint("1gb", False)
    chosen = [n for n in ("speed", "ranks") if getattr(args, n)] or ["speed", "ranks"]
    if "speed" in chosen:
        bench_speed(args.runs)
    if "ranks" in chosen:
        bench_ranks()


if __name__ == "__main__":
    main()
