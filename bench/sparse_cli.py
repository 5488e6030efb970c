"""A full-size DeepSeek-V3 checkpoint as sparse files -> the `remapdsl` CLI timed on it, as a user runs it.

The checkpoint is the released layout at its real sizes, made from `compile_bench.py`'s shape lists
(imported, not copied): 61 layers plus the MTP layer 61, 256 routed experts, BF16 (46,183 tensors,
1.37 TB) or, with `--fp8`, the FP8 release (E4M3 weights with a float32 `weight_scale_inv` per
128 x 128 block, 91,993 tensors, 0.69 TB). It is split over 163 files named as the release names
them (`model-00001-of-000163.safetensors`), with a `model.safetensors.index.json` and a
`config.json` holding the config values the rule files read. Each file is a real safetensors file:
the 8-byte little-endian header length, the JSON header (dtype, shape, data_offsets of every
tensor, `__metadata__`), padded with spaces to 8 bytes, then a data section that `os.truncate`
makes, so it reads as zeros and takes no disk. The folder is cached under `bench/out/` (git-ignored)
and rebuilt when its spec changes or with `--rebuild`. The benchmark prints the apparent size
against the allocated size (`st_blocks`) and the disk use before and after writing.

Then each command runs in a fresh process of the venv's `remapdsl` script, one at a time, from the
repository root: `check` (rules only, then against the checkpoint), `explain` (one layer, all of it,
`--json`), and `plan` under issue #11's EP x TP layout (`plan_bench.layout_plan`, written as the
JSON `--layout` reads) on `ep=8,tp=8` and `dp=8,ep=64,tp=8`, ranks first and last, summary,
`--tensors`, and `--rank` in detail. Reported per command: wall and CPU seconds, the child's peak
RSS (GNU time's `%M`, see `run_command`), lines and bytes of output, the first lines, and a verdict:
exit 0, no traceback, at most `--slow` seconds, output under 1 MB (summaries), and for `plan`
one `rank N {...}: ... MB read of ... MB owned` line per rank asked for and a `total:` line. The
first and last files are also read back with the safetensors library (headers only). Exit 1 when
any command has a problem.

No command here reads tensor data. Do not point `load` or `convert` at these folders: they would
read 1.4 TB of zeros.

    python bench/sparse_cli.py [--fp8] [--files 163] [--commands check,plan-64,...] [--runs 1]
                               [--timeout 120] [--slow 5] [--head 4] [--rebuild]

(first run: about 1 s to write the files; then about 40 s for BF16, 1 min for FP8, on the shared
2-core machine.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}
MESHES = {"64": "ep=8,tp=8", "4096": "dp=8,ep=64,tp=8"}
BIG_OUTPUT = 1_000_000  # bytes; past this a summary command's output is flagged, and a log is cut
KEPT_LINES = 2000  # lines a cut log keeps
MB, GB = 1e6, 1e9


# ------------------------------------------------------------------------------ the sparse checkpoint


def release_spec(fp8: bool) -> tuple[dict, dict[str, tuple[str, tuple[int, ...]]]]:
    """The config and checkpoint key -> (dtype, shape) of the DeepSeek-V3 release, MTP layer included."""
    from compile_bench import deepseek_v3_config, deepseek_v3_shapes, fp8_release

    config = deepseek_v3_config()
    shapes = deepseek_v3_shapes(config)
    if fp8:
        config, shapes = fp8_release(config, shapes)
    return config, shapes


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_BYTES[dtype]


def split_files(shapes: dict, files: int) -> list[list[str]]:
    """Checkpoint keys in order, cut into `files` groups of about equal bytes (the release's own split
    is by bytes too, layer after layer)."""
    total = sum(tensor_nbytes(*v) for v in shapes.values())
    groups: list[list[str]] = [[] for _ in range(files)]
    cursor = 0
    for ckpt_key, spec in shapes.items():
        groups[min(files - 1, cursor * files // total)].append(ckpt_key)
        cursor += tensor_nbytes(*spec)
    return [g for g in groups if g]


def write_sparse_safetensors(path: Path, entries: list[tuple[str, str, tuple[int, ...]]],
                             metadata: dict[str, str]) -> tuple[int, int]:
    """One safetensors file whose data section is a hole: (file size, tensor bytes)."""
    header: dict[str, object] = {"__metadata__": metadata}
    cursor = 0
    for ckpt_key, dtype, shape in entries:
        nbytes = tensor_nbytes(dtype, shape)
        header[ckpt_key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header so that the data starts aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
    size = 8 + len(text) + cursor
    os.truncate(path, size)
    return size, cursor


def spec_digest(config: dict, shapes: dict, files: int) -> str:
    text = json.dumps([config, sorted((k, d, list(s)) for k, (d, s) in shapes.items()), files])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def disk_figures(folder: Path, suffix: str = "") -> tuple[int, int, int]:
    """(files, apparent bytes, allocated bytes) of a folder's plain files whose names end with `suffix`."""
    count = apparent = allocated = 0
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False) and entry.name.endswith(suffix):
            st = entry.stat(follow_symlinks=False)
            count += 1
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return count, apparent, allocated


def ensure_checkpoint(folder: Path, fp8: bool, files: int, rebuild: bool) -> dict:
    """Write the sparse checkpoint unless an identical one is cached; its figures either way."""
    config, shapes = release_spec(fp8)
    digest = spec_digest(config, shapes, files)
    stamp = folder / "sparse.json"
    if not rebuild and stamp.exists() and json.loads(stamp.read_text()).get("digest") == digest:
        return json.loads(stamp.read_text()) | {"written": False}

    groups = split_files(shapes, files)
    used_before = shutil.disk_usage(OUT).used
    start = time.perf_counter()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    payload = 0
    for number, keys in enumerate(groups, 1):
        name = f"model-{number:05d}-of-{len(groups):06d}.safetensors"
        _, nbytes = write_sparse_safetensors(tmp / name, [(k, *shapes[k]) for k in keys], {"format": "pt"})
        payload += nbytes
        weight_map.update(dict.fromkeys(keys, name))
        taken = disk_figures(tmp)[2] if number == 1 else 0
        if taken > 1 << 20:  # a filesystem without holes would fill up
            shutil.rmtree(tmp)
            raise SystemExit(f"{tmp}: the first file took {taken} bytes of disk: no sparse files here")
    index = {"metadata": {"total_size": payload}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    write_s = time.perf_counter() - start
    _, apparent, allocated = disk_figures(tmp)
    figures = {"digest": digest, "tensors": len(shapes), "files": len(groups), "payload": payload,
               "apparent": apparent, "allocated": allocated, "write_s": write_s,
               "disk_used_before": used_before, "disk_used_after": shutil.disk_usage(OUT).used}
    (tmp / "sparse.json").write_text(json.dumps(figures, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return figures | {"written": True}


def read_own_header(path: Path) -> dict:
    """The JSON header of a safetensors file, its data section left unread."""
    with open(path, "rb") as f:
        (nbytes,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(nbytes))


def check_with_safetensors(folder: Path) -> str:
    """The first and last files read back by the safetensors library itself: keys, dtypes, shapes."""
    try:
        from safetensors import safe_open
    except ImportError:
        return "safetensors not installed: headers not cross-checked"
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    names = sorted(set(index.values()))
    for name in (names[0], names[-1]):
        own = read_own_header(folder / name)
        with safe_open(folder / name, "numpy") as f:  # metadata only: no torch import
            stored = f.keys()  # a safe_open handle is not iterable
            theirs = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in stored}
        ours = {k: (v["dtype"], v["shape"]) for k, v in own.items() if k != "__metadata__"}
        if theirs != ours or sorted(theirs) != sorted(k for k, v in index.items() if v == name):
            raise SystemExit(f"{folder / name}: safetensors reads another header than the one written")
    return f"safetensors reads {names[0]} and {names[-1]} back as written"


def write_layouts(folder: Path) -> dict[str, Path]:
    """Issue #11's layout (plan_bench.layout_plan) per mesh, as the JSON `remapdsl plan --layout` reads,
    checked to read back as the same LayoutPlan."""
    from plan_bench import layout_plan

    from remapdsl.sharding import read_layout
    from remapdsl.sharding.layouts import parse_mesh

    paths = {}
    for name, text in MESHES.items():
        layout = layout_plan(parse_mesh(text))
        plan = {r.pattern: r.style if r.style is not None else [p.model_dump() for p in r.placements]
                for r in layout.rules}
        path = folder / f"layout_{text.replace(',', '_').replace('=', '')}.json"
        path.write_text(json.dumps({"mesh_dim": layout.mesh_dim, "plan": plan}, indent=2))
        if read_layout(path) != layout:
            raise SystemExit(f"{path} does not read back as plan_bench's layout")
        paths[name] = path
    return paths


# ------------------------------------------------------------------------------------------ commands


def commands(rules: str, ckpt: str, layouts: dict[str, Path]) -> dict[str, tuple[list[str], str]]:
    """Name -> (argv after `remapdsl`, kind), kind "summary" (small output expected), "listing" (one
    line per tensor or piece: large by design) or "plan" (a summary with per-rank lines)."""
    def plan(size: str, *extra: str) -> list[str]:
        return ["plan", rules, "--checkpoint", ckpt, "--mesh", MESHES[size],
                "--layout", os.path.relpath(layouts[size], ROOT), *extra]

    return {
        "check": (["check", rules], "summary"),
        "check-ckpt": (["check", rules, "--checkpoint", ckpt], "summary"),
        "explain-layer": (["explain", rules, "--checkpoint", ckpt, "--key", "model.layers.3.*"], "summary"),
        "explain": (["explain", rules, "--checkpoint", ckpt], "listing"),
        "explain-json": (["explain", rules, "--checkpoint", ckpt, "--json"], "listing"),
        "plan-64": (plan("64", "--ranks", "first,last"), "plan"),
        "plan-4096": (plan("4096", "--ranks", "first,last"), "plan"),
        "plan-64-tensors": (plan("64", "--ranks", "first,last", "--tensors"), "listing"),
        "plan-64-rank0": (plan("64", "--rank", "0"), "listing"),
        "plan-4096-last": (plan("4096", "--rank", "4095"), "listing"),
    }


GNU_TIME = "/usr/bin/time"


def run_command(argv: list[str], log: Path, timeout: float) -> dict:
    """One command in a fresh process, output to `log`: exit code, wall and CPU seconds, peak RSS.

    The child runs under GNU time where there is one: a child spawned straight from this process
    starts as a vfork of it, and Linux carries the parent's RSS high-water mark through the exec into
    the child's ru_maxrss (this process holds the 92k-entry shape lists: +130-280 MiB). Without GNU
    time, os.wait4's figure is shown with that caveat. CPU seconds move less than wall seconds when
    other jobs share the 2 cores."""
    usage_file = log.with_suffix(".time")
    timed = os.access(GNU_TIME, os.X_OK)
    if timed:
        argv = [GNU_TIME, "-f", "%M %U %S", "-o", str(usage_file), *argv]
    with open(log, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        timer = threading.Timer(timeout, os.killpg, (proc.pid, 9))  # the command too, not only time
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        timer.cancel()
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    figures = {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss * 1024,
               "rss_from": "wait4 (includes this process's RSS at the spawn)"}
    lines = usage_file.read_text().splitlines() if timed and usage_file.exists() else []
    if lines and len(lines[-1].split()) == 3:  # empty when time itself was killed at the timeout
        if lines[0].startswith("Command exited with non-zero status"):
            rc = int(lines[0].rsplit(" ", 1)[1])
        elif lines[0].startswith("Command terminated by signal"):
            rc = -int(lines[0].rsplit(" ", 1)[1])
        kib, user, system = lines[-1].split()
        figures.update(cpu_s=float(user) + float(system), rss=int(kib) * 1024, rss_from="GNU time")
    return figures | {"rc": rc, "killed": wall >= timeout and rc < 0}


PLAN_RANK_LINE = re.compile(
    r"^rank \d+ \{.*\}: \d+ tensors, \d+ reads.*, [\d.]+ MB read of [\d.]+ MB owned, files ")


def problems(kind: str, argv: list[str], text: str, nbytes: int, result: dict, slow: float) -> list[str]:
    """What is wrong with one run, in words (empty when nothing is)."""
    out = []
    if result["killed"]:
        out.append(f"killed after {result['wall_s']:.0f} s")
    elif result["rc"] != 0:
        out.append(f"exit {result['rc']}")
    if "Traceback (most recent call last)" in text:
        out.append("traceback")
    if result["wall_s"] > slow:
        out.append(f"slow ({result['wall_s']:.1f} s > {slow:g} s)")
    if kind != "listing" and nbytes > BIG_OUTPUT:
        out.append(f"large output ({nbytes / MB:.1f} MB)")
    if kind == "plan" and result["rc"] == 0:
        asked = len(argv[argv.index("--ranks") + 1].split(","))
        lines = text.splitlines()
        ranks = sum(1 for line in lines if PLAN_RANK_LINE.match(line))
        if ranks != asked or not any(line.startswith("total: ") for line in lines):
            out.append(f"per-rank totals unreadable ({ranks} rank lines for {asked} ranks)")
    return out


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp8", action="store_true", help="the FP8 release (~92k tensors) and its rules")
    parser.add_argument("--files", type=int, default=163, help="safetensors files (163, as released)")
    parser.add_argument("--commands", help="names of the commands to run, comma separated (default: all)")
    parser.add_argument("--runs", type=int, default=1, help="runs of each command, median shown (1)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a command may take (120)")
    parser.add_argument("--slow", type=float, default=5.0, help="seconds past which a command is flagged (5)")
    parser.add_argument("--head", type=int, default=4, help="output lines shown per command (4)")
    parser.add_argument("--rebuild", action="store_true", help="write the checkpoint again")
    args = parser.parse_args()

    variant = "fp8" if args.fp8 else "bf16"
    folder = OUT / f"sparse_deepseek_v3_{variant}"
    logs = OUT / f"sparse_cli_{variant}"
    logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]

    ckpt = ensure_checkpoint(folder, args.fp8, args.files, args.rebuild)
    count, apparent, allocated = disk_figures(folder)
    in_shards = disk_figures(folder, ".safetensors")[2]
    print(f"{os.path.relpath(folder, ROOT)}: DeepSeek-V3 {variant.upper()}, {ckpt['tensors']:,} tensors in "
          f"{ckpt['files']} safetensors files ({count} files with index, config, stamp); "
          f"{'written in ' + format(ckpt['write_s'], '.1f') + ' s' if ckpt['written'] else 'cached'}")
    print(f"  apparent {apparent / GB:,.1f} GB ({ckpt['payload'] / GB:,.1f} GB of tensor data), "
          f"allocated {allocated / MB:.2f} MB (st_blocks; {in_shards / MB:.2f} MB of it the safetensors "
          f"files' headers, the rest the index and config); disk used {ckpt['disk_used_before'] / GB:.2f} GB "
          f"before writing, {ckpt['disk_used_after'] / GB:.2f} GB after (shared disk), "
          f"{shutil.disk_usage(OUT).used / GB:.2f} GB now")

    print(f"  {check_with_safetensors(folder)}")

    rules = f"rules/deepseek_v3{'_fp8' if args.fp8 else ''}.remap"
    table = commands(rules, os.path.relpath(folder, ROOT), write_layouts(logs))
    chosen = [c.strip() for c in args.commands.split(",")] if args.commands else list(table)
    unknown = [c for c in chosen if c not in table]
    if unknown:
        raise SystemExit(f"unknown command(s) {', '.join(unknown)}; known: {', '.join(table)}")
    script = Path(sys.executable).with_name("remapdsl")
    program = [str(script)] if script.exists() else [sys.executable, "-m", "remapdsl"]

    rows = []
    for name in chosen:
        argv, kind = table[name]
        log = logs / f"{name}.log"
        runs = [run_command(program + argv, log, args.timeout) for _ in range(args.runs)]
        raw = log.read_bytes()  # the last run's output
        text = raw.decode(errors="replace")
        if len(raw) > BIG_OUTPUT:  # the log keeps its beginning only (explain --json: ~80 MB)
            log.write_text("".join(text.splitlines(keepends=True)[:KEPT_LINES])
                           + f"... ({len(raw):,} bytes in all; cut here by sparse_cli.py)\n")
        last = runs[-1]
        found = sorted({p for r in runs for p in problems(kind, argv, text, len(raw), r, args.slow)})
        rows.append((name, runs, len(raw), text.count("\n"), found))
        print(f"\n$ remapdsl {shlex.join(argv)}")
        walls = [r["wall_s"] for r in runs]
        print(f"  exit {last['rc']}, {statistics.median(walls):.2f} s"
              f"{f' ({min(walls):.2f}-{max(walls):.2f} s, {len(runs)} runs)' if len(runs) > 1 else ''}, "
              f"CPU {statistics.median(r['cpu_s'] for r in runs):.2f} s, "
              f"peak RSS {max(r['rss'] for r in runs) / 2**20:.0f} MiB, "
              f"{text.count(chr(10)):,} lines / {len(raw) / 1e3:,.1f} kB of output "
              f"({os.path.relpath(log, ROOT)})")
        shown = text.splitlines()
        for line in shown[:args.head]:
            print(f"  | {line[:160]}{' ...' if len(line) > 160 else ''}")
        if kind == "plan" and len(shown) > args.head:
            print(f"  | {shown[-1][:160]}")
        elif len(shown) > args.head:
            print(f"  | ... ({len(shown) - args.head:,} more lines)")
        if last["rc"] != 0 and len(shown) > args.head:
            for line in shown[-8:]:
                print(f"  ! {line[:200]}")

    header = (f"{'command':<16} {'exit':>4} {'wall s':>8} {'CPU s':>7} {'peak RSS':>10} {'lines':>9} "
              f"{'output':>10}  verdict")
    print(f"\n{header}\n{'-' * len(header)}")
    for name, runs, nbytes, lines, found in rows:
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        rss = max(r["rss"] for r in runs)
        print(f"{name:<16} {runs[-1]['rc']:>4} {wall:>8.2f} {cpu:>7.2f} {rss / 2**20:>6.0f} MiB {lines:>9,} "
              f"{nbytes / 1e3:>7,.0f} kB  {'; '.join(found) or 'ok'}")
    print(f"peak RSS from {rows[0][1][-1]['rss_from'] if rows else '-'}; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    if any(found for *_, found in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
