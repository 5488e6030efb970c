"""Per-rank load and save plans at DeepSeek-V3 scale, from headers alone; report time, memory and plan size.

The inventory is `compile_bench.py`'s synthetic BF16 DeepSeek-V3 (`Inventory.from_shapes`, 46,183
tensors, no files; `--experts 512` gives ~91,000), compiled with `rules/deepseek_v3.remap`; `--fp8`
takes the FP8 release layout instead (91,993 tensors: E4M3 weights and their block scales),
compiled with `rules/deepseek_v3_fp8.remap`, which dequantizes every weight on read (so the load
plan holds decode items, and the save plan encode items that write the values back with the
stored scales). The layout
is an expert-parallel x tensor-parallel one, placements per mesh dim (`Replicate()` where a dim is not
named; a `dp` dim replicates everything):
- routed experts `...mlp.experts.gate_up_proj`: ep `Shard(0)`, tp `StridedShard(dim=1, split_factor=2)`;
  `...mlp.experts.down_proj`: ep `Shard(0)`, tp `Shard(2)`;
- `q_b_proj`, `kv_b_proj`, the shared experts' `gate_proj`/`up_proj`, `lm_head`: colwise on tp;
  `o_proj`, the shared experts' `down_proj`: rowwise on tp; `embed_tokens`: embedding_rowwise on tp.
Meshes: `ep=8,tp=1` (8 ranks), `ep=8,tp=8` (64), `dp=8,ep=8,tp=8` (512), `dp=8,ep=64,tp=8` (4,096).

Each (mesh, rank, plan) runs in a fresh child process, one after another, so that memory peaks do not
mix: it builds the inventory (for a save, without the MTP layer 61 that the rules drop: a save writes
back only what the load read, E501, so its `like` is the checkpoint of what the model holds), compiles once (`load_rules` + `compile_rules`, timed: "compile"), then
- load: `remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)`;
- save: what `remapdsl.save` computes before its first write (`prepare` in remapdsl/runtime/save.py):
  `writers(compiled)`, `hold(...)` of plain tensors under the layout (meta-device tensors of the local
  shard shapes, made outside the timing), `owned(holding, rank)` and `make_write_plan(...)`.
Both with the cyclic GC paused, as `load` and `save` do. The timed call gives the seconds and the
peak-RSS growth (ru_maxrss after minus before, the plan included; the peak is reset to the current
RSS just before, through /proc/self/clear_refs, so the compile's own peak does not hide it); the tracemalloc peak is taken on a
second, untimed call (tracemalloc slows allocation-heavy code several-fold), skipped ("skipped")
where 8x the timed call would not fit in what is left of the timeout. Plan size: items (read
or write items, plus decode/encode items), byte runs described (sum of item.runs.count, parts included; each item holds one strided run set), and
bytes_read / bytes_owned (load) or bytes_written (save, beside the bytes of the boxes the rank owns).
A child that runs past `--timeout` is killed and its figures shown as "> T s"; one whose RSS passes
`--max-rss` is killed too.

Goals (the compact-plans issue): load plan under 0.3 s and under 64 MB extra; save plan under
0.5 s and under 64 MB extra; compile under 1.5 s ("extra": the larger of the tracemalloc peak and
the RSS growth; MB = 10^6 bytes). Before the compact plans one 64-rank case took ~7-12 s and ~3 GB.

    python bench/plan_bench.py [--meshes 8,64,512,4096] [--ranks first,last] [--experts 256] [--fp8]
                               [--plans load,save] [--timeout 60] [--no-trace]

(`--meshes 8`: about 1 min; the four meshes with the default timeout: up to ~16 min.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MESHES = {8: "ep=8,tp=1", 64: "ep=8,tp=8", 512: "dp=8,ep=8,tp=8", 4096: "dp=8,ep=64,tp=8"}
GOALS = {"compile": (1.5, None), "load": (0.3, 64e6), "save": (0.5, 64e6)}  # seconds, extra bytes
MB = 1e6


def layout_plan(mesh):
    """The EP x TP layout above, for `mesh` (a remapdsl Mesh with `ep` and `tp` dims, maybe `dp`)."""
    from remapdsl.sharding.layouts import LayoutPlan
    from remapdsl.sharding.placements import Replicate, Shard, StridedShard

    def per_dim(**given):
        return [given.get(name, Replicate()) for name in mesh.names]

    return LayoutPlan.from_mapping({
        "model.layers.*.mlp.experts.gate_up_proj": per_dim(ep=Shard(dim=0), tp=StridedShard(dim=1, split_factor=2)),
        "model.layers.*.mlp.experts.down_proj": per_dim(ep=Shard(dim=0), tp=Shard(dim=2)),
        "model.layers.*.self_attn.q_b_proj": "colwise",
        "model.layers.*.self_attn.kv_b_proj": "colwise",
        "model.layers.*.mlp.shared_experts.gate_proj": "colwise",
        "model.layers.*.mlp.shared_experts.up_proj": "colwise",
        "lm_head": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.shared_experts.down_proj": "rowwise",
        "model.embed_tokens": "embedding_rowwise",
    }, mesh_dim="tp")


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak_rss() -> bool:
    """Set the process's peak RSS (ru_maxrss, VmHWM) back to its current RSS (Linux >= 4.0), so that a
    call's growth is not hidden under an earlier peak (the compile's); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def emit(**figures) -> None:
    print(json.dumps(figures), flush=True)


# ------------------------------------------------------------------------------------------ the child


def child(spec: dict) -> None:
    from compile_bench import compile_once, deepseek_v3_config, deepseek_v3_shapes, fp8_release

    import remapdsl
    from remapdsl.checkpoint.inventory import Inventory
    from remapdsl.compile.inverse import writers
    from remapdsl.dtypes import BY_NAME
    from remapdsl.gcpause import paused_gc
    from remapdsl.indexmap import volume
    from remapdsl.sharding.holdings import held_by_layout, hold, owned
    from remapdsl.sharding.layouts import parse_mesh
    from remapdsl.sharding.plans import make_write_plan

    began = time.monotonic()
    kind, rank = spec["plan"], spec["rank"]
    config = deepseek_v3_config(spec["experts"])
    if kind == "save":  # the checkpoint a save can write is the one the model holds: no MTP layer 61
        config["num_nextn_predict_layers"] = 0
    shapes = deepseek_v3_shapes(config)
    if spec["fp8"]:  # the FP8 release: compile_once then takes rules/deepseek_v3_fp8.remap
        config, shapes = fp8_release(config, shapes)
    inventory = Inventory.from_shapes(shapes)
    mesh = parse_mesh(spec["mesh"])
    layout = layout_plan(mesh)
    gc.collect()
    start = time.perf_counter()
    with paused_gc():  # compile_rules pauses it itself; load_rules as the drivers do
        compiled = compile_once(inventory, config)
    emit(compile_s=time.perf_counter() - start, tensors=len(inventory.tensors),
         runtime_tensors=len(compiled.runtime_tensors))

    if kind == "load":
        def call():
            return remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)

        def describe(plan):
            return {"items": len(plan.items) + len(plan.decodes),
                        "runs": sum(i.runs.count for i in plan.items if i.runs)
                        + sum(p.runs.count for i in plan.decodes for p in i.parts),
                        "bytes_read": plan.bytes_read, "bytes_owned": plan.bytes_owned}
    else:
        import torch

        # the model's local shards exist before a save: meta tensors of their shapes, outside the timing
        held = held_by_layout(compiled, layout, mesh, rank)
        tensors = {d.runtime_key: torch.empty(held[d.runtime_key].shape, dtype=getattr(torch, d.dtype),
                                              device="meta") for d in compiled.runtime_tensors}
        del held
        parts: dict[str, float] = {}

        def call():
            t0 = time.perf_counter()
            chosen = writers(compiled)
            t1 = time.perf_counter()
            holding = hold(compiled, tensors, layout, mesh, rank)
            t2 = time.perf_counter()
            mine = owned(holding, rank)
            t3 = time.perf_counter()
            plan = make_write_plan(chosen, inventory, mine, rank, compiled.logical_by_key())
            t4 = time.perf_counter()
            parts.update(writers_s=t1 - t0, hold_s=t2 - t1, owned_s=t3 - t2, make_write_plan_s=t4 - t3)
            return plan, mine

        def describe(result):
            plan, mine = result
            dtypes = {d.runtime_key: d.dtype for d in compiled.runtime_tensors}
            owned_bytes = sum(volume(b.sizes) * BY_NAME[dtypes[k]].bits // 8
                              for k, s in mine.items() for b in s.boxes)
            return dict(items=len(plan.items) + len(plan.encodes),
                        runs=sum(i.runs.count for i in plan.items)
                        + sum(p.runs.count for i in plan.encodes for p in i.parts),
                        bytes_written=plan.bytes_written, bytes_owned=owned_bytes, **parts)

    gc.collect()
    reset = reset_peak_rss()
    rss_before = maxrss_bytes()
    start = time.perf_counter()
    with paused_gc():
        result = call()
    seconds = time.perf_counter() - start
    rss_growth = maxrss_bytes() - rss_before
    emit(seconds=seconds, rss_growth=rss_growth, rss_reset=reset, **describe(result))
    if not spec["trace"]:
        return
    if 8 * seconds > spec["timeout"] - (time.monotonic() - began):  # traced, it would run past the timeout
        emit(trace_skipped=True)
        return
    del result
    gc.collect()
    tracemalloc.start()
    with paused_gc():
        result = call()
    _, traced_peak = tracemalloc.get_traced_memory()  # the plan, still held, included
    tracemalloc.stop()
    del result
    emit(traced_peak=traced_peak)


# ----------------------------------------------------------------------------------------- the parent


def vm_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_child(spec: dict, timeout: float, max_rss: int) -> dict:
    """Run one case in a fresh interpreter; its JSON lines merged, plus `killed` when it was stopped."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    killed = None
    while proc.poll() is None:
        if time.monotonic() - start > timeout:
            killed = "timeout"
        elif vm_rss(proc.pid) > max_rss:
            killed = "rss"
        if killed:
            proc.kill()
            break
        time.sleep(0.1)
    out, err = proc.communicate()
    figures: dict = {}
    for line in out.splitlines():
        if line.startswith("{"):
            figures.update(json.loads(line))
    if killed:
        figures["killed"] = killed
    elif proc.returncode:
        lines = err.strip().splitlines() or [f"exit {proc.returncode}"]
        figures["error"] = next((x for x in lines if "error" in x.lower()), lines[-1])
    figures["wall_s"] = time.monotonic() - start
    return figures


def parse_meshes(text: str) -> list[str]:
    out = []
    for part in text.split(";") if "=" in text else text.split(","):
        part = part.strip()
        out.append(MESHES[int(part)] if part.isdigit() else part)
    return out


def parse_ranks(text: str, size: int) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        rank = 0 if part == "first" else size - 1 if part == "last" else int(part)
        if not 0 <= rank < size:
            raise SystemExit(f"rank {rank} is outside a mesh of {size} ranks")
        if rank not in out:
            out.append(rank)
    return out


def verdict(kind: str, seconds: float | None, extra: float | None, over: bool) -> str:
    limit_s, limit_b = GOALS[kind]
    if over:
        return "MISSES"
    ok = seconds is not None and seconds < limit_s and (limit_b is None or (extra is not None and extra < limit_b))
    return "meets" if ok else "MISSES"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="8,64,512,4096",
                        help="rank counts of the meshes above (8,64,512,4096), or mesh texts separated "
                             "by `;` (`ep=8,tp=8;dp=2,ep=8,tp=8`)")
    parser.add_argument("--ranks", default="first,last", help="ranks per mesh: first, last or numbers")
    parser.add_argument("--experts", type=int, default=256, help="routed experts per MoE layer (256)")
    parser.add_argument("--fp8", action="store_true",
                        help="the FP8 release layout (~92k tensors), dequantized on read by deepseek_v3_fp8.remap")
    parser.add_argument("--plans", default="load,save", help="load, save or both")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per child (60)")
    parser.add_argument("--max-rss", type=float, default=8.0, help="GiB of RSS a child may reach (8)")
    parser.add_argument("--no-trace", dest="trace", action="store_false",
                        help="skip the tracemalloc call (halves a child's time)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    from remapdsl.sharding.layouts import parse_mesh

    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    cases = []
    for text in parse_meshes(args.meshes):
        mesh = parse_mesh(text)
        for rank in parse_ranks(args.ranks, mesh.size):
            for kind in plans:
                cases.append({"mesh": text, "size": mesh.size, "rank": rank, "plan": kind, "experts": args.experts,
                              "fp8": args.fp8, "trace": args.trace, "timeout": args.timeout})

    load_before = os.getloadavg()[0]
    T = args.timeout
    print(f"DeepSeek-V3 {'FP8' if args.fp8 else 'BF16'}, {args.experts} routed experts; {len(cases)} child process(es), one at a time, "
          f"timeout {T:.0f} s each")
    header = (f"{'mesh':<16} {'ranks':>5} {'rank':>5} {'plan':<5} {'compile':>8} {'plan s':>8} "
              f"{'tracemalloc':>11} {'RSS +':>8} {'items':>9} {'runs':>10} {'bytes':>24}  goal")
    print(header)
    print("-" * len(header))
    compiles = []
    for case in cases:
        r = run_child(case, T, int(args.max_rss * 2**30))
        over = r.get("killed") is not None
        compile_s = r.get("compile_s")
        if compile_s is not None:
            compiles.append(compile_s)
        seconds, traced, growth = r.get("seconds"), r.get("traced_peak"), r.get("rss_growth")
        if seconds is None and over:
            plan_cell = f"> {T:.0f} s" if r["killed"] == "timeout" else "RSS cap"
        else:
            plan_cell = f"{seconds:.3f}" if seconds is not None else "error"
        trace_cell = (f"{traced / MB:.0f} MB" if traced is not None else
                      "-" if not case["trace"] else "skipped" if r.get("trace_skipped")
                      else "killed" if over else "error")
        if case["plan"] == "load" and "bytes_read" in r:
            ratio = r["bytes_read"] / r["bytes_owned"] if r["bytes_owned"] else float("nan")
            bytes_cell = f"{r['bytes_read'] / MB:.1f}/{r['bytes_owned'] / MB:.1f} MB ({ratio:.2f})"
        elif "bytes_written" in r:
            bytes_cell = f"{r['bytes_written'] / MB:.1f} MB w/{r['bytes_owned'] / MB:.1f} own"
        else:
            bytes_cell = "-"
        extras = [x for x in (traced, growth) if x is not None]
        extra = max(extras) if extras else None
        goal_s, goal_b = GOALS[case["plan"]]
        goal = (f"< {goal_s} s, < {goal_b / MB:.0f} MB: "
                f"{verdict(case['plan'], seconds, extra, over and seconds is None)}")
        print(f"{case['mesh']:<16} {case['size']:>5} {case['rank']:>5} {case['plan']:<5} "
              f"{(f'{compile_s:.2f} s' if compile_s is not None else '-'):>8} {plan_cell:>8} {trace_cell:>11} "
              f"{(f'{growth / MB:.0f} MB' if growth is not None else '-'):>8} "
              f"{r.get('items', '-'):>9} {r.get('runs', '-'):>10} {bytes_cell:>24}  {goal}", flush=True)
        if case["plan"] == "save" and "writers_s" in r:
            print(f"{'':<16} {'':>5} {'':>5} {'':<5} save parts: writers {r['writers_s']:.3f} s, "
                  f"hold {r['hold_s']:.3f} s, owned {r['owned_s']:.3f} s, "
                  f"make_write_plan {r['make_write_plan_s']:.3f} s")
        if r.get("rss_reset") is False:
            print("  (the peak RSS could not be reset: RSS + counts only growth past the compile's peak)")
        if "error" in r:
            print(f"  error: {r['error']}")
        if r.get("killed") and seconds is not None:
            print(f"  (killed by {r['killed']} after the timed call, at {r['wall_s']:.0f} s)")
    if compiles:
        worst = max(compiles)
        print(f"compile (load_rules + compile_rules, once per child): {min(compiles):.2f}-{worst:.2f} s; "
              f"goal < 1.5 s -> {'meets' if worst < 1.5 else 'MISSES'}")
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
