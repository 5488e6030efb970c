"""Load a legacy per-expert Qwen3-MoE checkpoint (~0.4 GB) into the fused layout; compare with baselines.

What is timed, each in a fresh process, interleaved, 5 runs each (median), the file warmed with
`cat` in the child right before its timing:

  preadv-touched   baseline: the file's tensor bytes read with os.preadv on 2 threads into one
                   buffer allocated and touched before the timing (page cache -> touched memory).
  preadv-fresh     baseline: the same, the buffer allocated inside the timing and faulted in by the
                   reads (page cache -> fresh memory, page-fault bound).
  mmap-fresh       baseline: safetensors' mmap views, each `copy_`-ed into a new `torch.empty`
                   (page cache -> fresh memory, as a plain safetensors user would).
  remapdsl-touched remapdsl.load alone, into the fused destinations, allocated and zeroed (touched)
                   before the timing. Compared with preadv-touched.
  remapdsl-fresh   allocation (`torch.empty`, untouched) + remapdsl.load, both timed. Compared with
                   preadv-fresh, mmap-fresh and transformers.
  transformers     AutoModelForCausalLM.from_pretrained(folder, dtype=bfloat16), then one element of
                   every 4 KiB page of every tensor of its state_dict read, so that parameters left as
                   lazy mmap views are mapped in; fixed costs (config, model build) included.

Peak RSS is the child's ru_maxrss; "growth" is that peak minus the RSS after imports: the
destinations plus whatever else the load held at its peak (mapped page-cache pages included),
shown as a multiple of the destination bytes. The first round checks every destination tensor
against the model's own state_dict (a blake2b per tensor, recorded when the checkpoint was made).

The checkpoint is made once, by transformers (`from_config` under a fixed seed, `save_pretrained`,
which writes the per-expert layout), and cached under bench/out/ (git-ignored).

Each ratio of medians is shown with the median of each round's own ratio (its two processes ran
back to back), steadier where the machine's speed drifts. Goals, as ratios to baselines of the
same run: remapdsl-touched <= 1.25x preadv-touched; remapdsl-fresh <= 1.25x preadv-fresh and
<= 1.25x mmap-fresh; remapdsl-fresh faster than transformers; RSS growth of remapdsl within 1.1x
of the destination bytes.

`--base DIR` (a checkout of another commit) adds `remapdsl-touched@base`: remapdsl-touched with that
checkout's remapdsl, shown beside this one's (`remapdsl-touched / remapdsl-touched@base`).

    python bench/load_bench.py [--runs 5] [--modes remapdsl-fresh,transformers,...] [--rebuild] [--base DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The parent only orchestrates and imports neither torch nor transformers: a child's ru_maxrss can
# start from the parent's high-water mark (vfork + exec), so the parent stays small.

HERE = Path(__file__).resolve().parent
RULES = HERE.parent / "rules" / "qwen3_moe.remap"
DEFAULT_OUT = HERE / "out" / "qwen3_moe_400mb"
MANIFEST = "bench_manifest.json"
MODES = ("preadv-touched", "preadv-fresh", "mmap-fresh", "remapdsl-touched", "remapdsl-fresh", "transformers")
PAGE = 4096
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
CHUNK = 64 << 20  # preadv chunk

# ~0.41 GB of bf16: 3 MoE layers of 48 experts (0.34 GB), attention, embeddings and an untied head.
SPEC = {
    "vocab_size": 12288,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "moe_intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_experts": 48,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
SEED = 0
RSS_GOAL = 1.1  # remapdsl's peak RSS growth, as a multiple of the destination bytes
# (mode, baseline, goal as the most the ratio of median times may be; None: shown only)
RATIOS = (
    ("remapdsl-touched", "preadv-touched", 1.25),
    ("remapdsl-touched", "remapdsl-touched@base", None),
    ("remapdsl-fresh", "preadv-fresh", 1.25),
    ("remapdsl-fresh", "mmap-fresh", 1.25),
    ("remapdsl-fresh", "transformers", 1.0),
    ("remapdsl-fresh", "preadv-touched", None),
    ("transformers", "preadv-touched", None),
)


# ---------------------------------------------------------------------------------------------- child


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def warm(files: list[str]) -> None:
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)


def tensor_files(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.glob("*.safetensors"))


def data_sections(files: list[str]) -> list[tuple[str, int, int]]:
    """(file, byte offset, nbytes) of each file's tensor data: everything after the JSON header."""
    out = []
    for path in files:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        start = 8 + header_len
        out.append((path, start, os.path.getsize(path) - start))
    return out


def blake(t) -> str:
    import hashlib

    import torch

    flat = t.detach().contiguous().reshape(-1)
    return hashlib.blake2b(flat.view(torch.uint8).numpy().data, digest_size=16).hexdigest()


def check(tensors: dict, manifest: dict) -> list[str]:
    """Problems of `tensors` against the manifest's destinations: missing, extra, wrong shape or bytes."""
    want = manifest["destinations"]
    problems = [f"missing {k}" for k in want if k not in tensors]
    problems += [f"unexpected {k}" for k in tensors if k not in want]
    for k, t in tensors.items():
        if k in want:
            if list(t.shape) != want[k]["shape"] or str(t.dtype) != "torch." + want[k]["dtype"]:
                problems.append(
                    f"{k}: {t.dtype} {list(t.shape)}, expected {want[k]['dtype']} {want[k]['shape']}")
            elif blake(t) != want[k]["blake2b"]:
                problems.append(f"{k}: values differ from the model's state_dict")
    return problems


def allocate(manifest: dict, touch: bool) -> dict:
    import torch

    target = {k: torch.empty(d["shape"], dtype=getattr(torch, d["dtype"]))
              for k, d in manifest["destinations"].items()}
    if touch:
        for t in target.values():
            t.zero_()
    return target


def child_remapdsl(folder: Path, manifest: dict, touched: bool, verify: bool) -> dict:
    import torch  # noqa: F401  (imports stay out of the timing and the RSS growth, as in the other modes)

    import remapdsl

    if not hasattr(remapdsl, "load"):
        return {"error": "remapdsl.load is not available"}
    try:
        try:
            import remapdsl.drivers.load  # noqa: F401  (imports stay out of the timing)
        except ModuleNotFoundError:  # a --base checkout from before remapdsl/drivers/
            import remapdsl.runtime.load  # noqa: F401
    except ImportError:
        pass
    files = tensor_files(folder)
    rss0 = rss_now()
    if touched:
        target = allocate(manifest, touch=True)
        warm(files)
        start = time.perf_counter()
        report = remapdsl.load(target, str(folder), str(RULES))
        seconds = time.perf_counter() - start
    else:
        warm(files)
        start = time.perf_counter()
        target = allocate(manifest, touch=False)
        report = remapdsl.load(target, str(folder), str(RULES))
        seconds = time.perf_counter() - start
    result = {"seconds": seconds, "rss0": rss0, "maxrss": maxrss(),
              "bytes_read": getattr(report, "bytes_read", None)}
    if verify:
        result["problems"] = check(target, manifest)
    return result


def child_transformers(folder: Path, manifest: dict, verify: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    files = tensor_files(folder)
    rss0 = rss_now()
    warm(files)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    state = model.state_dict()
    for t in state.values():  # one element per page: maps lazy mmap views, copies nothing
        flat = t.detach().reshape(-1)
        float(flat[:: max(1, PAGE // t.element_size())].float().sum())
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "rss0": rss0, "maxrss": maxrss()}
    if verify:
        result["problems"] = check(state, manifest)
    return result


def child_preadv(folder: Path, touched: bool) -> dict:
    """2-thread preadv of every file's tensor data into one buffer: touched beforehand, or allocated
    inside the timing and faulted in by the reads."""
    import threading

    import torch

    sections = data_sections(tensor_files(folder))
    total = sum(n for _, _, n in sections)
    rss0 = rss_now()
    if touched:
        buffer = torch.empty(total, dtype=torch.uint8)
        buffer.zero_()
    fds = {path: os.open(path, os.O_RDONLY) for path, _, _ in sections}
    chunks, at = [], 0
    for path, offset, nbytes in sections:
        for done in range(0, nbytes, CHUNK):
            size = min(CHUNK, nbytes - done)
            chunks.append((fds[path], offset + done, at + done, size))
        at += nbytes
    errors: list[BaseException] = []

    def worker(mine):
        try:
            for fd, offset, dst, size in mine:
                got = 0
                while got < size:
                    n = os.preadv(fd, [view[dst + got: dst + size]], offset + got)
                    if n <= 0:
                        raise OSError(f"short read at {offset + got}")
                    got += n
        except BaseException as exc:  # reported by the parent
            errors.append(exc)

    warm([path for path, _, _ in sections])
    start = time.perf_counter()
    if not touched:
        buffer = torch.empty(total, dtype=torch.uint8)
    view = memoryview(buffer.numpy()).cast("B")
    threads = [threading.Thread(target=worker, args=(chunks[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    for fd in fds.values():
        os.close(fd)
    if errors:
        return {"error": repr(errors[0])}
    return {"seconds": seconds, "rss0": rss0, "maxrss": maxrss(), "bytes_read": total}


def child_mmap_fresh(folder: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    files = tensor_files(folder)
    rss0 = rss_now()
    warm(files)
    start = time.perf_counter()
    out = {}
    for path in files:
        for k, v in load_file(path).items():
            out[k] = torch.empty_like(v)
            out[k].copy_(v)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rss0": rss0, "maxrss": maxrss()}


def child_create(folder: Path) -> dict:
    """Build the model from SPEC under a fixed seed, save it per expert, and record its state_dict."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(SEED)
    config = Qwen3MoeConfig(**SPEC)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    state = model.state_dict()
    manifest = {
        "spec": SPEC,
        "seed": SEED,
        "destinations": {
            k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "blake2b": blake(t)}
            for k, t in state.items()
        },
    }
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return {"tensors": len(state)}


def run_child(mode: str, folder: Path, verify: bool) -> dict:
    if mode == "create":
        return child_create(folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    if mode in ("preadv-touched", "preadv-fresh"):
        return child_preadv(folder, touched=mode == "preadv-touched")
    if mode == "mmap-fresh":
        return child_mmap_fresh(folder)
    if mode == "remapdsl-touched":
        return child_remapdsl(folder, manifest, touched=True, verify=verify)
    if mode == "remapdsl-fresh":
        return child_remapdsl(folder, manifest, touched=False, verify=verify)
    if mode == "transformers":
        return child_transformers(folder, manifest, verify=verify)
    raise SystemExit(f"unknown mode {mode}")


# --------------------------------------------------------------------------------------------- parent


def spawn(mode: str, folder: Path, verify: bool = False, timeout: float = 600, base: str | None = None) -> dict:
    """`mode` in a fresh process; a mode ending in `@base` imports the remapdsl of the checkout `base`."""
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    if mode.endswith("@base"):
        mode = mode.removesuffix("@base")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [base, env.get("PYTHONPATH")]))
        env["REMAPDSL_CACHE"] = "0"  # a checkout from before the disk caches were removed: theirs off
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--out", str(folder)]
    if verify:
        command.append("--verify")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=str(HERE.parent))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def ensure_checkpoint(folder: Path, rebuild: bool) -> None:
    manifest = folder / MANIFEST
    if not rebuild and manifest.exists():
        cached = json.loads(manifest.read_text())
        if cached.get("spec") == SPEC and cached.get("seed") == SEED and tensor_files(folder):
            return
    start = time.perf_counter()
    result = spawn("create", folder)
    if "error" in result:
        raise SystemExit(f"creating the checkpoint failed: {result['error']}")
    print(f"created {folder} in {time.perf_counter() - start:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint folder (cached)")
    parser.add_argument("--rebuild", action="store_true", help="make the checkpoint again")
    parser.add_argument("--base", help="a checkout of another commit: adds remapdsl-touched@base")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = args.out.resolve()
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, folder, args.verify)), flush=True)
        return

    modes = [m for m in args.modes.split(",") if m] + (["remapdsl-touched@base"] if args.base else [])
    base = args.base and os.path.abspath(args.base)
    unknown = set(modes) - set(MODES) - {"remapdsl-touched@base"}
    if unknown:
        raise SystemExit(f"unknown modes: {', '.join(sorted(unknown))}")
    ensure_checkpoint(folder, args.rebuild)
    manifest = json.loads((folder / MANIFEST).read_text())
    dest_bytes = sum(ITEMSIZE[d["dtype"]] * _prod(d["shape"]) for d in manifest["destinations"].values())
    files = tensor_files(folder)
    file_bytes = sum(os.path.getsize(p) for p in files)
    data_bytes = sum(n for _, _, n in data_sections(files))
    print(f"checkpoint {folder.relative_to(HERE.parent) if folder.is_relative_to(HERE.parent) else folder}: "
          f"{len(files)} file(s), {file_bytes / 1e9:.3f} GB ({data_bytes / 1e9:.3f} GB of tensor data); "
          f"{len(manifest['destinations'])} fused destinations, {dest_bytes / 1e9:.3f} GB")

    load_before = os.getloadavg()[0]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    errors: dict[str, str] = {}
    problems: dict[str, list[str]] = {}
    start = time.perf_counter()
    for r in range(args.runs):
        order = modes[r % len(modes):] + modes[: r % len(modes)]  # rotate: no mode always goes first
        for mode in order:
            if mode in errors:
                continue
            verify = r == 0 and mode in ("remapdsl-touched", "remapdsl-fresh", "transformers")
            result = spawn(mode, folder, verify=verify, base=base)
            if "error" in result:
                errors[mode] = result["error"]
                continue
            if "problems" in result:
                problems[mode] = result["problems"]
            results[mode].append(result)
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs "
          "(other work on the machine skews absolute figures more than the ratios)")
    print(f"{args.runs} rounds of {len(modes)} fresh processes in {time.perf_counter() - start:.0f} s; "
          f"median seconds, GB/s of {dest_bytes / 1e9:.3f} GB, peak RSS (ru_maxrss) and its growth "
          "over the RSS after imports, as multiples of the destination bytes")

    median: dict[str, float | None] = {}
    print(f"  {'mode':18s} {'median s':>9s} {'min-max s':>13s} {'GB/s':>6s} {'peak RSS':>9s} "
          f"{'x dest':>7s} {'growth':>7s}")
    for mode in modes:
        runs = results[mode]
        if not runs:
            median[mode] = None
            print(f"  {mode:18s} n/a: {errors.get(mode, 'no runs')}")
            continue
        secs = [x["seconds"] for x in runs]
        med = median[mode] = statistics.median(secs)
        peak = statistics.median(x["maxrss"] for x in runs)
        growth = statistics.median(x["maxrss"] - x["rss0"] for x in runs)
        print(f"  {mode:18s} {med:9.3f} {min(secs):6.3f}-{max(secs):6.3f} {dest_bytes / med / 1e9:6.2f} "
              f"{peak / 2**20:6.0f} MiB {peak / dest_bytes:6.2f}x {growth / dest_bytes:6.2f}x")
    for mode, found in problems.items():
        if found:
            print(f"  WRONG: {mode} gave {len(found)} wrong destinations, e.g. {found[:3]}")
        else:
            print(f"  {mode}: all {len(manifest['destinations'])} tensors equal the model's state_dict "
                  "(checked in round 1)")
    for mode in ("remapdsl-touched", "remapdsl-fresh"):
        for x in results.get(mode, [])[:1]:
            if x.get("bytes_read") is not None:
                print(f"  {mode}: report.bytes_read = {x['bytes_read'] / 1e9:.3f} GB "
                      f"({x['bytes_read'] / data_bytes:.2f}x the tensor data)")
    for mode in ("remapdsl-touched", "remapdsl-fresh"):
        if results.get(mode):
            growth = statistics.median(x["maxrss"] - x["rss0"] for x in results[mode]) / dest_bytes
            print(f"  {mode}: RSS growth {growth:.2f}x the destination bytes, goal <= {RSS_GOAL:.2f}x -> "
                  f"{'meets' if growth <= RSS_GOAL else 'MISSES'}")
    print("ratios of median times (lower is better for the first name), and the median of each round's "
          "own ratio (its two processes ran back to back: steadier where the machine's speed drifts):")
    for a, b, goal in RATIOS:
        if a in median and b in median:
            ratio = median[a] / median[b] if median[a] and median[b] else None
            pairs = [x["seconds"] / y["seconds"] for x, y in zip(results[a], results[b])]
            paired = f" (per round {statistics.median(pairs):5.2f}x)" if ratio and len(pairs) == args.runs else ""
            verdict = ""
            if goal is not None and ratio is not None:
                verdict = f"  goal <= {goal:.2f}x -> {'meets' if ratio <= goal else 'MISSES'}"
            print(f"  {a:16s} / {b:16s} = " + (f"{ratio:5.2f}x" if ratio else "  n/a") + paired + verdict)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
