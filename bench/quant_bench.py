"""Quantized-load benchmarks: fp8_block dequantize-on-read against transformers, and TP=4 bytes.

--speed  A ~0.5 GB block-FP8 checkpoint (DeepSeek-V3 MoE shapes: experts' gate/up [2048, 7168],
         down [7168, 2048], and a kv_a_proj_with_mqa [576, 7168] with a partial last block row;
         E4M3 values, float32 scales per [128, 128] block; random values under a fixed seed; two
         files), dequantized to bfloat16, in fresh processes, interleaved, 5 rounds (median), the
         files warmed with `cat` before each timing. The timed set leaves out the [576, 7168] weight,
         on which transformers raises; --tp and the tests cover it.
           transformers  every weight and its scale through safetensors (`safe_open`, `get_tensor`)
                         and transformers' own `Fp8Dequantize._dequantize_one(q, s, bfloat16)`,
                         outputs kept (its work when `from_pretrained` dequantizes on CPU).
           remapdsl      `remapdsl.load` of the same tensors through `dequantize ... | fp8_block`,
                         its destinations allocated inside the timing (as transformers' outputs are).
           remapdsl-touched  the same into destinations allocated and zeroed before the timing
                         (a model's parameters); shown only.
         Goal: transformers median / remapdsl median >= 2. Round 1 checks every output of both
         against each other, bit for bit.
--tp     TP=4 (rows of gate/up and kv_a, columns of down: colwise / rowwise) on the same
         checkpoint, `remapdsl.plan_rank` per rank, no process group: bytes read / (value bytes of
         the rank's elements + bytes of the scale tiles that cover them), both computed here by
         plain arithmetic, not taken from the plan. Goal: 1.00 on every rank.

    python bench/quant_bench.py [--speed] [--tp] [--runs 5] [--rebuild]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_bench import maxrss, tensor_files, warm

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
FOLDER = OUT / "fp8_block_500mb"
RULES = OUT / "quant_rules_fp8.remap"
SPEED_RULES = OUT / "quant_rules_fp8_speed.remap"
BLOCK = 128
SEED = 0
EXPERTS = 11
SHAPES = ([("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 7168))]
          + [(f"model.layers.0.mlp.experts.{e}.{name}_proj.weight", shape) for e in range(EXPERTS)
             for name, shape in (("gate", (2048, 7168)), ("up", (2048, 7168)), ("down", (7168, 2048)))])
RULE_TEXT = f"""remap 1
dequantize {{P:path}}.weight, {{P}}.weight_scale_inv -> {{P}}.weight
    | fp8_block(block=[{BLOCK}, {BLOCK}], scale=float32, to=bfloat16)
{{P:path}}.weight -> {{P}}.weight
"""
PARTIAL = SHAPES[0][0]  # 576 rows in 128-row blocks: transformers raises on it
SPEED_RULE_TEXT = RULE_TEXT + f"drop {PARTIAL}\n"  # the speed comparison leaves it out for transformers
TP = 4
TP_PLAN = {"*.gate_proj": "colwise", "*.up_proj": "colwise", "*.kv_a_proj_with_mqa": "colwise",
           "*.down_proj": "rowwise"}
MODES = ("transformers", "remapdsl", "remapdsl-touched")
GOAL = 2.0


def ceil(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------- children


def child_create() -> dict:
    import torch
    from safetensors.torch import save_file

    tmp = FOLDER.with_name(FOLDER.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    generator = torch.Generator().manual_seed(SEED)
    weight_map, total = {}, 0
    for index, half in enumerate((SHAPES[: len(SHAPES) // 2], SHAPES[len(SHAPES) // 2:])):
        part = {}
        for key, (rows, cols) in half:
            part[key] = (torch.randn(rows, cols, generator=generator) * 100).to(torch.float8_e4m3fn)
            part[key + "_scale_inv"] = torch.rand(ceil(rows, BLOCK), ceil(cols, BLOCK), generator=generator) / 100
        file = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file(part, str(tmp / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
        total += sum(t.nbytes for t in part.values())
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text("{}")
    (tmp / "bench_manifest.json").write_text(json.dumps({"shapes": SHAPES, "seed": SEED, "block": BLOCK}))
    shutil.rmtree(FOLDER, ignore_errors=True)
    tmp.rename(FOLDER)
    return {"bytes": total}


def digest(tensors: dict) -> dict:
    import hashlib

    import torch

    return {k: hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().data, digest_size=16).hexdigest()
            for k, t in sorted(tensors.items())}


def child_transformers(verify: bool) -> dict:
    import torch
    from safetensors import safe_open
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    index = json.loads((FOLDER / "model.safetensors.index.json").read_text())["weight_map"]
    dequantize = Fp8Dequantize(None)
    warm(tensor_files(FOLDER))
    start = time.perf_counter()
    handles = {f: safe_open(str(FOLDER / f), framework="pt") for f in sorted(set(index.values()))}
    out = {}
    for key, _ in SHAPES[1:]:
        q = handles[index[key]].get_tensor(key)
        s = handles[index[key + "_scale_inv"]].get_tensor(key + "_scale_inv")
        out[key] = dequantize._dequantize_one(q, s, output_dtype=torch.bfloat16)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "maxrss": maxrss()}
    if verify:
        result["digest"] = digest(out)
    return result


def child_remapdsl(touched: bool, verify: bool) -> dict:
    import torch

    import remapdsl
    import remapdsl.drivers.load  # noqa: F401  (imports stay out of the timing)

    shapes = dict(SHAPES[1:])

    def allocate():
        return {k: torch.empty(shape, dtype=torch.bfloat16) for k, shape in shapes.items()}

    target = allocate() if touched else None
    if touched:
        for t in target.values():
            t.zero_()
    warm(tensor_files(FOLDER))
    start = time.perf_counter()
    if not touched:
        target = allocate()
    report = remapdsl.load(target, str(FOLDER), str(SPEED_RULES))
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "maxrss": maxrss(), "bytes_read": report.bytes_read,
              "scale_bytes_read": report.scale_bytes_read, "inner": report.seconds}
    if verify:
        result["digest"] = digest(target)
    return result


def child_tp() -> dict:
    import remapdsl
    from remapdsl.sharding import LayoutPlan, Mesh, layout_for, local_shard

    inventory = remapdsl.open_checkpoint(str(FOLDER))
    compiled = remapdsl.compile_rules(remapdsl.load_rules(str(RULES)), inventory, {})
    mesh = Mesh.of({"tp": TP})
    layout = LayoutPlan.from_mapping(TP_PLAN, mesh_dim="tp")
    ranks = []
    for rank in range(TP):
        plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)
        values = scales = 0
        for key, (rows, cols) in SHAPES:  # the minimum, by arithmetic on the shard boxes
            shard = local_shard((rows, cols), mesh.sizes, layout_for(key, (rows, cols), layout, mesh),
                                mesh.coordinate(rank))
            for box in shard.boxes:
                (r0, c0), (h, w) = box.offsets, box.sizes
                if h and w:
                    values += h * w
                    scales += 4 * (ceil(r0 + h, BLOCK) - r0 // BLOCK) * (ceil(c0 + w, BLOCK) - c0 // BLOCK)
        ranks.append({"bytes_read": plan.bytes_read, "values": values, "scales": scales,
                      "plan_scales": plan.scale_bytes_read, "pieces": len(plan.decodes)})
    return {"ranks": ranks}


# --------------------------------------------------------------------------------------------- parent


def spawn(extra: list[str], timeout: float = 900) -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *extra], capture_output=True,
                          text=True, timeout=timeout, cwd=str(HERE.parent), check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def ensure(rebuild: bool) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    RULES.write_text(RULE_TEXT)
    SPEED_RULES.write_text(SPEED_RULE_TEXT)
    manifest = FOLDER / "bench_manifest.json"
    if not rebuild and manifest.exists():
        cached = json.loads(manifest.read_text())
        if cached == json.loads(json.dumps({"shapes": SHAPES, "seed": SEED, "block": BLOCK})):
            return
    start = time.perf_counter()
    result = spawn(["--child", "create"])
    if "error" in result:
        raise SystemExit(f"creating the checkpoint failed: {result['error']}")
    print(f"created {FOLDER.relative_to(HERE.parent)} ({result['bytes'] / 1e9:.3f} GB) in "
          f"{time.perf_counter() - start:.1f} s")


def bench_speed(runs: int) -> None:
    values = sum(r * c for _, (r, c) in SHAPES[1:])
    print(f"\n[1] fp8_block dequantize-on-read, the {len(SHAPES) - 1} expert weights (transformers raises on "
          f"the [576, 7168] one: 'not divisible by scale grid'), {values / 1e9:.3f} GB of E4M3 values "
          f"-> {2 * values / 1e9:.3f} GB of bfloat16; fresh processes, {runs} rounds, interleaved")
    results: dict[str, list] = {m: [] for m in MODES}
    errors: dict[str, str] = {}
    for r in range(runs):
        for mode in MODES[r % len(MODES):] + MODES[: r % len(MODES)]:
            if mode in errors:
                continue
            extra = ["--child", mode] + (["--verify"] if r == 0 else [])
            result = spawn(extra)
            if "error" in result:
                errors[mode] = result["error"]
            else:
                results[mode].append(result)
    medians = {}
    print(f"  {'mode':18s} {'median s':>9s} {'min-max s':>15s} {'GB/s out':>9s} {'peak RSS':>9s}")
    for mode in MODES:
        if not results[mode]:
            print(f"  {mode:18s} n/a: {errors.get(mode)}")
            continue
        secs = [x["seconds"] for x in results[mode]]
        medians[mode] = statistics.median(secs)
        peak = statistics.median(x["maxrss"] for x in results[mode])
        print(f"  {mode:18s} {medians[mode]:9.3f} {min(secs):7.3f}-{max(secs):7.3f} "
              f"{2 * values / medians[mode] / 1e9:9.2f} {peak / 2**20:6.0f} MiB")
    digests = {m: results[m][0].get("digest") for m in MODES if results[m]}
    if digests.get("transformers") and digests.get("remapdsl"):
        differ = [k for k in digests["transformers"] if digests["transformers"][k] != digests["remapdsl"].get(k)]
        same_touched = digests.get("remapdsl-touched") == digests["remapdsl"]
        print(f"  round 1: {len(digests['transformers'])} outputs of remapdsl vs transformers: "
              + ("all equal bit for bit" if not differ else f"DIFFERENT: {differ[:3]}")
              + ("" if same_touched else "; remapdsl-touched DIFFERS from remapdsl"))
    if results["remapdsl"]:
        x = results["remapdsl"][0]
        print(f"  remapdsl read {x['bytes_read'] / 1e9:.3f} GB ({x['scale_bytes_read'] / 1e6:.2f} MB of scales)")
    if "transformers" in medians and "remapdsl" in medians:
        speedup = medians["transformers"] / medians["remapdsl"]
        print(f"speed-up (transformers median / remapdsl median): {speedup:.2f}x, goal >= {GOAL}x -> "
              + ("meets" if speedup >= GOAL else "MISSES")
              + f"; into touched destinations {medians['transformers'] / medians.get('remapdsl-touched', float('nan')):.2f}x")


def bench_tp() -> None:
    print(f"\n[2] TP={TP} on {FOLDER.relative_to(HERE.parent)} (colwise gate/up/kv_a, rowwise down), "
          "remapdsl.plan_rank, no process group")
    result = spawn(["--child", "tp"])
    if "error" in result:
        print(f"  n/a: {result['error']}")
        return
    worst = 0.0
    for rank, x in enumerate(result["ranks"]):
        ratio = x["bytes_read"] / (x["values"] + x["scales"])
        worst = max(worst, abs(ratio - 1))
        print(f"  rank {rank}: read {x['bytes_read'] / 1e6:8.2f} MB = values {x['values'] / 1e6:8.2f} MB + "
              f"covering scales {x['scales'] / 1e3:6.1f} kB (plan says {x['plan_scales'] / 1e3:.1f} kB) "
              f"-> {ratio:.4f}; {x['pieces']} pieces")
    print(f"bytes read / (owned values + covering scales): {'1.00 on every rank -> meets' if worst < 5e-5 else 'MISSES'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", action="store_true", help="[1] dequantize throughput vs transformers")
    parser.add_argument("--tp", action="store_true", help="[2] TP=4 bytes read per rank")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run = {"create": child_create, "transformers": lambda: child_transformers(args.verify),
               "remapdsl": lambda: child_remapdsl(False, args.verify),
               "remapdsl-touched": lambda: child_remapdsl(True, args.verify), "tp": child_tp}[args.child]
        print("RESULT " + json.dumps(run()), flush=True)
        return
    ensure(args.rebuild)
    chosen = [n for n in ("speed", "tp") if getattr(args, n)] or ["speed", "tp"]
    if "speed" in chosen:
        bench_speed(args.runs)
    if "tp" in chosen:
        bench_tp()


if __name__ == "__main__":
    main()
