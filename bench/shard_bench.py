"""A column shard against a row shard of the same matrix: one TP rank's load, same bytes, same run.

A bf16 matrix `w` of [ROWS, COLS] (256 MiB by default) in one safetensors file, identity rules. One rank
of a TP=8 mesh loads its shard into a plain local tensor, in one process with no process group: what
`remapdsl.load` runs on that rank (open the checkpoint, load and compile the rules, `plan_rank`, then
the read executor `run_load_plan`), all timed:
  row      `Shard(0)` (rowwise): ROWS/8 whole rows, one contiguous byte range of the file;
  column   `Shard(-1)` (colwise on the last dim): COLS/8 columns of every row, one short run a row
           (ROWS runs of COLS/8 x 2 bytes, the row length apart).
Both shards hold the same number of bytes. Each mode runs in a fresh process (the first call is the
one a job pays), interleaved, `--runs` rounds, the file warmed with `cat` just before the timing, into
a local tensor allocated and touched before the timing. Reported: the median seconds and GB/s of the
shard bytes, and the column mode's throughput as a fraction of the row mode's. Round 1 checks both
shards against the matrix. Goal (the compact-plans issue): column >= 0.5 of row, the whole call;
the read executor's time alone is shown beside it.

    python bench/shard_bench.py [--runs 5] [--rows 16384] [--cols 8192] [--rank 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
TP = 8
MODES = ("row", "column")


def folder_for(rows: int, cols: int) -> Path:
    return OUT / f"shard_{rows}x{cols}_bf16"


def build(rows: int, cols: int) -> Path:
    import torch
    from safetensors.torch import save_file

    folder = folder_for(rows, cols)
    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    w = torch.arange(rows * cols, dtype=torch.float32).remainder_(65521).to(torch.bfloat16).view(rows, cols)
    save_file({"w": w}, str(folder / "model.safetensors"))
    (folder / "rules.remap").write_text("w -> w\n")
    (folder / "config.json").write_text("{}")
    return folder


def child(spec: dict) -> None:
    import torch

    import remapdsl
    from remapdsl.runtime.read import run_load_plan
    from remapdsl.sharding import LayoutPlan, Mesh, Shard

    folder = Path(spec["folder"])
    rows, cols, rank, mode = spec["rows"], spec["cols"], spec["rank"], spec["mode"]
    dim = 0 if mode == "row" else 1
    layout = LayoutPlan.from_mapping({"w": [Shard(dim=dim)]}, mesh_dim="tp")
    shape = (rows // TP, cols) if dim == 0 else (rows, cols // TP)
    local = {"w": torch.zeros(shape, dtype=torch.bfloat16)}
    subprocess.run(["cat", str(folder / "model.safetensors")], stdout=subprocess.DEVNULL, check=True)
    start = time.perf_counter()
    inventory = remapdsl.open_checkpoint(folder)
    compiled = remapdsl.compile_rules(remapdsl.load_rules(folder / "rules.remap"), inventory)
    plan = remapdsl.plan_rank(compiled, inventory, layout, Mesh.of({"tp": TP}), rank)
    reads = time.perf_counter()
    run_load_plan(plan, inventory, local)
    end = time.perf_counter()
    out = {"seconds": end - start, "read_s": end - reads, "bytes": local["w"].numel() * 2,
           "bytes_read": plan.bytes_read}
    if spec["verify"]:
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            w = f.get_tensor("w")
        part = w[rank * rows // TP:(rank + 1) * rows // TP] if dim == 0 else w[:, rank * cols // TP:(rank + 1) * cols // TP]
        out["equal"] = bool(torch.equal(part, local["w"]))
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=3, help="the TP rank loaded (0-7)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.rows % TP or args.cols % TP:
        raise SystemExit(f"--rows and --cols must be multiples of {TP}")
    folder = build(args.rows, args.cols)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    reads: dict[str, list[float]] = {m: [] for m in MODES}
    nbytes = {}
    for r in range(args.runs):
        for mode in MODES:
            spec = {"folder": str(folder), "rows": args.rows, "cols": args.cols, "rank": args.rank, "mode": mode,
                    "verify": r == 0}
            done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                  text=True)
            if done.returncode:
                raise SystemExit(f"{mode}: {done.stderr.strip().splitlines()[-1]}")
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            if r == 0 and not figures["equal"]:
                raise SystemExit(f"{mode}: the loaded shard differs from the matrix")
            if figures["bytes_read"] != figures["bytes"]:
                raise SystemExit(f"{mode}: read {figures['bytes_read']} bytes for a {figures['bytes']}-byte shard")
            times[mode].append(figures["seconds"])
            reads[mode].append(figures["read_s"])
            nbytes[mode] = figures["bytes"]
    print(f"bf16 [{args.rows}, {args.cols}], TP={TP}, rank {args.rank}: shard of {nbytes['row'] / 1e6:.1f} MB; "
          f"{args.runs} rounds of fresh processes, medians (both shards checked in round 1)")
    rate, read_rate = {}, {}
    for mode in MODES:
        median = statistics.median(times[mode])
        rate[mode] = nbytes[mode] / median
        read_rate[mode] = nbytes[mode] / statistics.median(reads[mode])
        runs = "" if mode == "row" else f", {args.rows} runs of {args.cols // TP * 2} B"
        print(f"  {mode:<7} {median:.4f} s  ({min(times[mode]):.4f}-{max(times[mode]):.4f})  "
              f"{rate[mode] / 1e9:5.2f} GB/s; reads alone {statistics.median(reads[mode]):.4f} s, "
              f"{read_rate[mode] / 1e9:5.2f} GB/s{runs}")
    fraction = rate["column"] / rate["row"]
    print(f"column / row throughput = {fraction:.2f}  goal >= 0.5 -> {'meets' if fraction >= 0.5 else 'MISSES'} "
          f"(reads alone: {read_rate['column'] / read_rate['row']:.2f})")


if __name__ == "__main__":
    main()
