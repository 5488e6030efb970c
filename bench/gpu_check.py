"""Device check: remapdsl loads into CUDA tensors, bit for bit, and how fast, on one NVIDIA GPU.

Needs one CUDA GPU (written for one H100); on a machine without one it prints a line saying so and
exits with status 2. It runs in one process on a 1-rank NCCL process group and checks:

  1. the bundled example (examples/tiny-qwen3-moe, rules/qwen3_moe.remap: stacked, fused experts)
     loaded by `remapdsl.load` into plain CUDA tensors, into CUDA DTensors (Shard(0), 1-rank mesh)
     and through a 4 kB staging bound equals, bit for bit, the same load into CPU tensors; with
     identity rules it equals `safetensors.torch.load_file(file, device="cuda")`;
  2. a ~4.3 GB checkpoint (32 bf16 tensors of 8192 x 8192 in 4 Hugging Face shards with an index,
     made once under --scratch and reused) loaded with identity rules into plain CUDA tensors and
     into DTensors (Shard(0) on a 1-rank CUDA mesh), by `remapdsl.load` and through `dcp.load`
     with remapdsl's `RuleStorageReader` and with DCP's `HuggingFaceStorageReader`: every
     destination equals `safetensors.torch.load_file(file, device="cuda")` bit for bit;
  3. each of those `remapdsl.load` calls staged its bytes through pinned buffers, no more of them
     than the `Staging` bound (16 MiB by default).

And it times, side by side on the 4.3 GB checkpoint (files warmed in the page cache first; each
way once untimed, then --runs times between `torch.cuda.synchronize()` calls, destinations
zeroed before each, medians):

  pinned copy_        baseline: the same byte count copied host to device in 256 MiB pieces
                      from one pinned buffer (the bus's bandwidth);
  remapdsl plain      `remapdsl.load` into plain CUDA tensors: GB/s, as a share of pinned copy_,
                      and the most pinned staging bytes its rings allocated (`StagingRing`'s
                      `allocated`, summed over the rings of one call) against the `Staging` bound;
  safetensors         baseline: `safetensors.torch.load_file(f)` then `.to("cuda")` per tensor;
  remapdsl DTensor    `remapdsl.load` into the DTensors;
  dcp + hf reader     baseline: `dcp.load` into the same DTensors through DCP's own
                      `HuggingFaceStorageReader(folder)`;
  dcp + rule reader   `dcp.load` into the same DTensors through `RuleStorageReader`.

It ends with a table (figure, value, ratio) and exits 0 when every check passed, 1 naming the
first that failed (an error raised by a load ends it with a traceback, also status 1). Under 5
minutes on one H100 (the checkpoint's first writing included; its GPU memory stays under 20 GB),
plus ~4.3 GB of disk under --scratch. Its figures go into bench/README.md.

    python bench/gpu_check.py [--scratch DIR] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import remapdsl
from remapdsl.dcp import RuleStorageReader
from remapdsl.language import rules_from_text
from remapdsl.runtime.staging import STAGING, StagingRing

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe"
EXAMPLE_RULES = ROOT / "rules" / "qwen3_moe.remap"
IDENTITY = "remap 1\n{P:path} -> {P}\n"

# The generated checkpoint: TENSORS bf16 tensors of SHAPE in FILES shards (32 x 128 MiB = 4 GiB).
SHAPE = (8192, 8192)
TENSORS = 32
FILES = 4
SEED = 20240601
MARKER = "gpu_check.json"  # written last: the folder holds this very checkpoint, complete
SPEC = {"shape": list(SHAPE), "tensors": TENSORS, "files": FILES, "seed": SEED, "dtype": "bfloat16",
        "version": 1}

PIECE = 256 << 20  # the pinned copy_ baseline's buffer, copied piece by piece
READER_THREADS = 2  # remapdsl's reader threads a load (run_load_plan's default): the staging bound's factor
GB = 1e9
MiB = 1 << 20


class Checks:
    """The equality checks of the run, in order; the first failure is the one named at exit."""

    def __init__(self):
        self.passed = 0
        self.failed: list[str] = []

    def expect(self, name: str, ok: bool, detail: str = "") -> None:
        """Record one check and print its line."""
        if ok:
            self.passed += 1
        else:
            self.failed.append(f"{name}: {detail}" if detail else name)
        print(f"  {'ok      ' if ok else 'MISMATCH'} {name}" + ("" if ok or not detail else f": {detail}"),
              flush=True)


def local(tensor):
    """A DTensor's local shard (on one rank, the whole tensor); any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def flat_bytes(tensor):
    """A tensor's (local) bytes as a flat uint8 tensor."""
    return local(tensor).contiguous().reshape(-1).view(torch.uint8)


def difference(got, want) -> str | None:
    """None when `got` and `want` hold the same dtype, shape and bits; else where they differ."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"
    a, b = flat_bytes(got), flat_bytes(want.to(local(got).device))
    if torch.equal(a, b):
        return None
    differ = (a != b).nonzero()
    return f"{differ.numel()} bytes differ, the first at byte {int(differ[0])} of {a.numel()}"


def compare(checks: Checks, name: str, got: dict, want) -> None:
    """One check: `got` (key -> tensor) holds exactly the keys of `want` (pairs of key and tensor,
    consumed one at a time), each bit for bit equal."""
    seen, bad = set(), []
    for key, expected in want:
        seen.add(key)
        if key not in got:
            bad.append(f"{key} missing")
        elif (why := difference(got[key], expected)) is not None:
            bad.append(f"{key}: {why}")
    bad += [f"{key} not in the reference" for key in sorted(set(got) - seen)]
    checks.expect(f"{name} ({len(seen)} tensors)", not bad,
                  f"{bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") if bad else "")


def reference(files: list[Path]):
    """(key, tensor) of every tensor of `files` as `safetensors.torch.load_file(file, device="cuda")`
    gives it, one file held on the GPU at a time."""
    for file in files:
        tensors = load_file(str(file), device="cuda")
        while tensors:
            yield tensors.popitem()


def dtensors_like(tensors: dict, mesh) -> dict:
    """A zeroed CUDA DTensor, Shard(0) on `mesh`, of each tensor's shape and dtype."""
    return {key: DTensor.from_local(torch.zeros(t.shape, dtype=t.dtype, device="cuda"), mesh, [Shard(0)],
                                    run_check=False)
            for key, t in tensors.items()}


def zero(tensors: dict) -> None:
    """Zero every destination (a DTensor's local shard), so a load must write every byte again."""
    for tensor in tensors.values():
        local(tensor).zero_()


class PinnedPeak:
    """While active, every `StagingRing` made is recorded (remapdsl makes its rings per call);
    on exit the bytes of staging buffers the rings allocated, summed (a ring frees none before the
    call ends), raise `peak`. With torch's host allocator statistics, `host_peak` is its peak of
    pinned bytes handed out over the same span, as a cross-check."""

    def __init__(self):
        self.peak = 0
        self.rings = 0
        self.host_peak: int | None = None
        self._made: list = []

    def __enter__(self):
        made, original = self._made, StagingRing.__init__

        def init(ring, *args, **kwargs):
            original(ring, *args, **kwargs)
            made.append(ring)

        self._original = original
        StagingRing.__init__ = init
        if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        StagingRing.__init__ = self._original
        self.peak = max(self.peak, sum(ring.allocated for ring in self._made))
        self.rings = max(self.rings, len(self._made))
        self._made.clear()
        if hasattr(torch.cuda, "host_memory_stats"):
            peak = torch.cuda.host_memory_stats().get("active_bytes.peak")
            if peak is not None:
                self.host_peak = max(self.host_peak or 0, peak)


def timed(run, reset, runs: int) -> list[float]:
    """Seconds of `runs` calls of `run` after one untimed call, `reset()` before each, the device
    synchronized before the clock starts and before it stops."""
    times = []
    for at in range(runs + 1):
        reset()
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        if at:
            times.append(time.perf_counter() - start)
    return times


def rendezvous() -> str:
    """A file:// rendezvous for a 1-rank group (no TCP port to race for)."""
    return "file://" + os.path.join(tempfile.mkdtemp(prefix="gpu-check-"), "rendezvous")


def ensure_checkpoint(folder: Path) -> list[Path]:
    """The generated checkpoint's files, written under `folder` unless its marker says they are
    there: each file's tensors made on the GPU (a seeded randn per tensor), saved with
    `safetensors.torch.save_file`, then freed, so the host holds one file's tensors at a time."""
    names = [f"model-{i + 1:05d}-of-{FILES:05d}.safetensors" for i in range(FILES)]
    files = [folder / name for name in names]
    marker = folder / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == SPEC and all(f.is_file() for f in files):
        print(f"  reusing {folder} (its {MARKER} matches)")
        return files
    folder.mkdir(parents=True, exist_ok=True)
    strays = sorted(p.name for p in folder.glob("*.safetensors") if p.name not in names)
    if strays:
        raise SystemExit(f"{folder} holds other .safetensors files ({', '.join(strays[:3])}); "
                         "give --scratch an empty or a new folder")
    marker.unlink(missing_ok=True)
    start = time.perf_counter()
    weight_map, total, per_file = {}, 0, -(-TENSORS // FILES)
    for n, (name, file) in enumerate(zip(names, files, strict=True)):
        tensors = {}
        for i in range(n * per_file, min(TENSORS, (n + 1) * per_file)):
            generator = torch.Generator(device="cuda").manual_seed(SEED + i)
            key = f"layers.{i}.weight"
            tensors[key] = torch.randn(SHAPE, generator=generator, dtype=torch.bfloat16, device="cuda").cpu()
            weight_map[key] = name
            total += tensors[key].nbytes
        save_file(tensors, str(file), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    marker.write_text(json.dumps(SPEC))
    print(f"  wrote {folder}: {TENSORS} tensors, {total / GB:.2f} GB in {FILES} files, "
          f"{time.perf_counter() - start:.1f} s")
    return files


def warm(files: list[Path]) -> float:
    """Read every file once (into the page cache); the seconds it took."""
    start = time.perf_counter()
    buffer = bytearray(64 * MiB)
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


def check_example(checks: Checks, mesh) -> None:
    """The bundled example into CUDA tensors, plain and DTensor, equal to the same load into CPU
    tensors; with identity rules equal to safetensors' own load."""
    folder, rules = str(EXAMPLE), str(EXAMPLE_RULES)
    compiled = remapdsl.compile_rules(remapdsl.load_rules(rules), folder)
    on_cpu = compiled.empty_state_dict()
    remapdsl.load(on_cpu, folder, rules)
    expected = {key: t.to("cuda") for key, t in on_cpu.items()}

    plain = {key: torch.zeros_like(t) for key, t in expected.items()}
    remapdsl.load(plain, folder, rules)
    compare(checks, "example, qwen3_moe rules, plain CUDA tensors = CPU load", plain, expected.items())

    small = {key: torch.zeros_like(t) for key, t in expected.items()}
    remapdsl.load(small, folder, rules, staging_bytes=4096)
    compare(checks, "example, qwen3_moe rules, staging_bytes=4096 (1 kB buffers) = CPU load", small,
            expected.items())

    sharded = dtensors_like(expected, mesh)
    remapdsl.load(sharded, folder, rules)
    compare(checks, "example, qwen3_moe rules, DTensors Shard(0) = CPU load", sharded, expected.items())

    identity = rules_from_text(IDENTITY, "identity.remap")
    whole = remapdsl.compile_rules(identity, folder).empty_state_dict(device="cuda")
    zero(whole)
    remapdsl.load(whole, folder, identity)
    compare(checks, "example, identity rules, plain CUDA tensors = load_file(device='cuda')", whole,
            reference(sorted(EXAMPLE.glob("*.safetensors"))))


def pinned_copy(total: int):
    """Baseline: a call copying `total` bytes host to device in PIECE pieces from one pinned buffer."""
    pinned = torch.ones(PIECE, dtype=torch.uint8).pin_memory()
    target = torch.empty(total, dtype=torch.uint8, device="cuda")

    def copy():
        for at in range(0, total, PIECE):
            n = min(PIECE, total - at)
            target[at:at + n].copy_(pinned[:n], non_blocking=True)

    return copy


def safetensors_to_cuda(files: list[Path]):
    """Baseline: a call running `load_file(f)` then `.to("cuda")` of every tensor, file by file."""

    def load():
        for file in files:
            moved = {key: t.to("cuda") for key, t in load_file(str(file)).items()}
            del moved

    return load


def check_large(checks: Checks, mesh, folder: Path, files: list[Path], runs: int) -> list[tuple[str, ...]]:
    """The generated checkpoint: every way loaded, verified and timed; the table's rows."""
    identity = rules_from_text(IDENTITY, "identity.remap")
    plain = remapdsl.compile_rules(identity, str(folder)).empty_state_dict(device="cuda")
    sharded = dtensors_like(plain, mesh)
    total = sum(t.nbytes for t in plain.values())
    print(f"  {len(plain)} tensors, {total / GB:.2f} GB; page cache warmed in {warm(files):.1f} s; "
          f"{runs} timed runs each, after one untimed", flush=True)

    def measure(name: str, run, filled: dict | None = None) -> float:
        """The median seconds of `run` (`filled`: the destinations it fills, zeroed before each call
        and checked after the last)."""
        seconds = statistics.median(timed(run, lambda: zero(filled or {}), runs))
        print(f"  {name}: {seconds:.3f} s, {total / seconds / GB:.2f} GB/s", flush=True)
        if filled is not None:
            compare(checks, f"4 GiB, {name} = load_file(device='cuda')", filled, reference(files))
        return seconds

    plain_pins, sharded_pins = PinnedPeak(), PinnedPeak()

    def remap_plain():
        with plain_pins:
            remapdsl.load(plain, str(folder), identity)

    def remap_sharded():
        with sharded_pins:
            remapdsl.load(sharded, str(folder), identity)

    def dcp_rules():
        dcp.load(sharded, storage_reader=RuleStorageReader(str(folder), identity))

    def dcp_hf():
        dcp.load(sharded, storage_reader=HuggingFaceStorageReader(str(folder)))

    copy_s = measure(f"pinned copy_, {PIECE // MiB} MiB pieces", pinned_copy(total))
    plain_s = measure("remapdsl.load, plain CUDA tensors", remap_plain, plain)
    st_s = measure("safetensors load_file + .to('cuda')", safetensors_to_cuda(files))
    sharded_s = measure("remapdsl.load, DTensors Shard(0)", remap_sharded, sharded)
    rule_s = measure("dcp.load + RuleStorageReader, DTensors", dcp_rules, sharded)
    hf_s = measure("dcp.load + HuggingFaceStorageReader, DTensors", dcp_hf, sharded)

    bound = STAGING.bound(READER_THREADS)
    for name, pins in (("plain", plain_pins), ("DTensor", sharded_pins)):
        checks.expect(f"4 GiB, remapdsl.load {name}: staging allocated, within its bound",
                      0 < pins.peak <= bound, f"{pins.peak} bytes in {pins.rings} rings, bound {bound}")

    def rate(seconds: float) -> str:
        return f"{total / seconds / GB:.2f} GB/s ({seconds:.3f} s)"

    def pinned(pins: PinnedPeak) -> tuple[str, str]:
        host = "" if pins.host_peak is None else f"; torch host allocator peak {pins.host_peak / MiB:.0f} MiB"
        return (f"{pins.peak / MiB:.0f} MiB in {pins.rings} rings{host}",
                f"{pins.peak / bound:.2f} of bound {bound / MiB:.0f} MiB")

    return [
        ("pinned copy_ H2D, 256 MiB pieces (baseline)", rate(copy_s), "1.00"),
        ("remapdsl.load, plain CUDA tensors", rate(plain_s), f"{copy_s / plain_s:.2f} of pinned copy_"),
        ("  peak pinned staging, plain", *pinned(plain_pins)),
        ("safetensors load_file + .to('cuda') (baseline)", rate(st_s),
         f"{st_s / plain_s:.2f}x remapdsl.load's time"),
        ("remapdsl.load, DTensors Shard(0)", rate(sharded_s), f"{copy_s / sharded_s:.2f} of pinned copy_"),
        ("  peak pinned staging, DTensor", *pinned(sharded_pins)),
        ("dcp.load + HuggingFaceStorageReader (baseline)", rate(hf_s),
         f"{hf_s / sharded_s:.2f}x remapdsl.load's time"),
        ("dcp.load + RuleStorageReader", rate(rule_s), f"{rule_s / hf_s:.2f}x the hf reader's time"),
    ]


def commit() -> str:
    """The repository's commit, where there is a git checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10, check=False)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> int:
    """Run every check and timing; 0 when all checks passed, 1 when one failed, 2 without CUDA."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "remapdsl-gpu-check",
                        help="folder of the generated ~4.3 GB checkpoint (made once, reused)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each way (median)")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("bench/gpu_check.py needs a CUDA device (torch.cuda.is_available() is False); nothing checked")
        return 2

    started = time.perf_counter()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=rendezvous(), rank=0, world_size=1)
    checks = Checks()
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
        print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
              f"remapdsl {remapdsl.__version__} at {commit()}; load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; 1-rank NCCL group", flush=True)
        print("bundled example:", flush=True)
        check_example(checks, mesh)
        print("generated checkpoint:", flush=True)
        files = ensure_checkpoint(args.scratch)
        rows = check_large(checks, mesh, args.scratch, files, max(1, args.runs))
    finally:
        dist.destroy_process_group()

    width = max(len(r[0]) for r in rows)
    value = max(len(r[1]) for r in rows)
    print(f"\n{'figure':{width}}  {'value':{value}}  ratio")
    for figure, measured, ratio in rows:
        print(f"{figure:{width}}  {measured:{value}}  {ratio}")
    print(f"checks: {checks.passed} passed, {len(checks.failed)} failed; "
          f"{time.perf_counter() - started:.0f} s in all")
    if checks.failed:
        print(f"FIRST MISMATCH: {checks.failed[0]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
