"""The `remapdsl` command: subcommands are views of the pipeline, over the public API only."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import textwrap
import traceback
from collections.abc import Sequence
from pathlib import Path

import remapdsl

EXIT_OK, EXIT_DIFFERS, EXIT_USER_ERROR, EXIT_BUG = 0, 1, 2, 3
RULES_HELP = ("a .remap file, the name of a shipped one (`remapdsl rules` lists them), or `auto`: the "
              "shipped file that fits the checkpoint's config.json")
FILE_HELP = ".remap files, or names of shipped ones (`remapdsl rules`)"
CHECKPOINT_HELP = "a Hugging Face checkpoint folder (safetensors, with config.json), or its snapshot (`remapdsl snapshot`)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status: 2 for a user error (RemapError, rendered on stderr), 3
    for any other exception (a bug in remapdsl: its traceback and a request to report it)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_USER_ERROR
    try:
        return args.run(args)
    except remapdsl.RemapError as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output cut short by `| head`: not an error
        sys.stderr.close()
        return EXIT_OK
    except Exception:  # noqa: BLE001 - anything else is our bug, not the user's
        traceback.print_exc()
        print(f"\nremapdsl {remapdsl.__version__}: this is a bug in remapdsl, not in your files; "
              "please report it with the traceback above.", file=sys.stderr)
        return EXIT_BUG


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remapdsl", description="Declarative, exact checkpoint remapping: check, "
                                     "format and inspect .remap rule files, and see how they map a checkpoint.")
    parser.add_argument("--version", action="version", version=f"remapdsl {remapdsl.__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    def command(name: str, run, summary: str, description: str,
                rules: bool = False) -> argparse.ArgumentParser:
        """A subcommand that calls `run(args)`; with `rules`, it takes RULES and --checkpoint."""
        sub = commands.add_parser(name, help=summary, description=description)
        sub.set_defaults(run=run)
        if rules:
            sub.add_argument("rules", metavar="RULES", help=RULES_HELP)
            sub.add_argument("--checkpoint", required=True, metavar="DIR|SNAPSHOT", help=CHECKPOINT_HELP)
        return sub

    check = command("check", _check, "parse and statically check rule files",
                    "Parse rule files, follow their includes and run every check that needs no checkpoint. "
                    "Exit 0 when clean, 2 on errors.")
    check.add_argument("files", nargs="+", metavar="FILE", help=FILE_HELP + "; `auto` with --checkpoint")
    check.add_argument("--root", help="folder that includes may not leave (default: each file's folder)")
    check.add_argument("--checkpoint", metavar="DIR|SNAPSHOT",
                       help="also compile against this checkpoint or snapshot (headers only) and report `drop` "
                       "statements that matched nothing and .safetensors files the index ignores")

    fmt = command("fmt", _fmt, "rewrite rule files in canonical form",
                  "Rewrite rule files in canonical form, keeping comments. "
                  "With --check, change nothing and exit 1 if a file is not formatted.")
    fmt.add_argument("files", nargs="+", metavar="FILE", help=FILE_HELP)
    fmt.add_argument("--check", action="store_true", help="report files that are not formatted")
    fmt.add_argument("--diff", action="store_true", help="print what would change, as a diff")

    explain = command(
        "explain", _explain, "show how a checkpoint's tensors fill each runtime tensor",
        "Compile rules against a checkpoint (headers only, no tensor data) and print, for each runtime "
        "tensor, its shape and dtype and which regions of which checkpoint tensors fill it, through which "
        "rule.", rules=True)
    explain.add_argument("--key", metavar="PATTERN",
                         help="only runtime tensors (or their checkpoint keys) matching this glob")
    explain.add_argument("--blocks", type=int, default=8, metavar="N", help="blocks shown per tensor (default 8)")
    explain.add_argument("--json", action="store_true", help="print the compiled form as JSON")
    explain.add_argument("--lenient", action="store_true",
                         help="leave out checkpoint tensors no rule takes, instead of failing")

    plan = command(
        "plan", _plan, "show what each rank of a sharded load reads, without reading tensor data",
        "Compile rules against a checkpoint and plan a sharded load on a device mesh: per rank, the tensors "
        "it holds, its boxes, the bytes it reads and the files it touches, and totals across ranks. Reads "
        "headers only.", rules=True)
    plan.add_argument("--mesh", required=True, metavar="DIMS",
                      help="mesh dims and sizes, outermost first, e.g. `dp=2,tp=4`")
    plan.add_argument("--layout", required=True, metavar="FILE",
                      help="JSON: {\"mesh_dim\": \"tp\", \"plan\": {glob: style, placement or [placements]}} "
                      "(styles as in a transformers tp_plan; docs/layout.md), or a shipped plan's name (vllm_tp)")
    plan.add_argument("--rank", type=int, metavar="R", help="show one rank in detail: every piece it reads")
    plan.add_argument("--ranks", metavar="LIST",
                      help="the ranks to summarize: `all`, or numbers, `first` and `last` separated by commas "
                      f"(default: all on a mesh of up to {ALL_RANKS} ranks, else first,last)")
    plan.add_argument("--tensors", action="store_true", help="one line per runtime tensor under each rank")

    convert = command(
        "convert", _convert, "convert a checkpoint between layouts, offline (also under torchrun)",
        "Write SRC in the runtime layout RULES make (keys = runtime keys; safetensors shards and an index as "
        "Hugging Face writes them), or with --reverse write SRC (in the runtime layout) back to the layout "
        "of the checkpoint --like names (without --like: the layout the rules, SRC's config.json and its "
        "shapes determine). Each rank converts a share of the tensors a batch at a time; the output appears "
        "at DST only when complete.")
    convert.add_argument("src", metavar="SRC", help="the checkpoint folder to convert")
    convert.add_argument("dst", metavar="DST", help="the output folder (must not exist unless --overwrite)")
    convert.add_argument("--rules", required=True, metavar="RULES", help="the rules that load the "
                         "original layout into the runtime layout: " + RULES_HELP + " (SRC's, or --like's "
                         "with --reverse)")
    convert.add_argument("--reverse", action="store_true", help="SRC is in the runtime layout; write the "
                         "original layout (--like's, or the one derived without it)")
    convert.add_argument("--like", metavar="DIR", help="with --reverse: a checkpoint in the original layout "
                         "(headers, index and config are taken from it)")
    convert.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                         help="forward, or --reverse without --like: start a new file past this size "
                         "(default 5GB; e.g. 500MB)")
    convert.add_argument("--memory", default="1GB", metavar="SIZE",
                         help="tensors a rank holds at once (default 1GB; a larger tensor alone)")
    convert.add_argument("--overwrite", action="store_true", help="replace DST once the new one is complete")
    convert.add_argument("--dropped", choices=("copy", "omit", "error"), default="error",
                         help="with --reverse: the tensors of --like the rules drop are copied unchanged "
                         "(copy), left out (omit) or refused (error, the default)")

    snapshot = command(
        "snapshot", _snapshot, "write a checkpoint's headers, index and config as a small JSON file",
        "Write the inventory of a checkpoint (keys, dtypes, shapes, file grouping, index, config.json), "
        "without tensor data, as a deterministic JSON file that check --checkpoint, explain and plan accept "
        "in place of the folder.")
    snapshot.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder (or index or .safetensors file)")
    snapshot.add_argument("-o", "--output", required=True, metavar="FILE",
                          help="the snapshot to write, e.g. model.headers.json (replaced if it exists)")

    verify = command(
        "verify", _verify, "prove a rule file right on a checkpoint: compile, sharded load, round trip",
        "Prove, on real data and real gloo CPU processes started for it, that the rules compile against the "
        "checkpoint and cover every tensor; that on each mesh every rank's sharded load equals the whole "
        "load and reads exactly the bytes it owns; that save(load(x)) is x byte for byte; and, with "
        "--against transformers, that the load equals transformers' own. A snapshot is replaced by random "
        "values in its layout. Exit 0 when all hold, 1 when one fails, 2 on a user error.", rules=True)
    verify.add_argument("--mesh", action="append", metavar="DIMS",
                        help="a mesh to shard on, e.g. `tp=2` or `ep=2,tp=2`; repeat for several "
                        "(default: one mesh, tp=2)")
    verify.add_argument("--layout", metavar="FILE",
                        help="a layout JSON file (docs/layout.md) or a shipped plan's name (vllm_tp); default: "
                        "every tensor cut on every mesh dim")
    verify.add_argument("--against", choices=["transformers"],
                        help="also compare the load with transformers' from_pretrained")
    verify.add_argument("--json", action="store_true", help="print the checks as JSON")

    show = command("ir", _ir, "print the parsed IR of a rule file",
                   "Print the typed IR of a rule file, for editors and tools.")
    show.add_argument("file", metavar="FILE", help="a .remap file, or the name of a shipped one")
    show.add_argument("--json", action="store_true", help="print the IR as JSON (with source spans)")
    show.add_argument("--resolved", action="store_true", help="print the checked program with includes expanded")

    library = command(
        "rules", _rules, "list the shipped rule files: what each converts, for which models, how verified",
        "List the rule files shipped with remapdsl, which any command (and remapdsl.load) takes by name: "
        "what each converts (its header comment), the config.json model_type and architectures `auto` "
        "matches it by, and the tests that verify it.")
    library.add_argument("--json", action="store_true", help="print the list as JSON")
    return parser


def _rules_arg(rules: str, checkpoint: str | None) -> str:
    """`auto` (with a checkpoint) -> the shipped file that fits it, said on stderr; else as given."""
    if rules != "auto" or checkpoint is None or Path(rules).is_file():
        return rules
    chosen, reason = remapdsl.choose_rules(checkpoint)
    print(f"rules: auto chose {chosen.name} ({reason}): {chosen.path}", file=sys.stderr)
    return chosen.path


def _rules(args: argparse.Namespace) -> int:
    entries = remapdsl.shipped_rules()
    if args.json:
        rows = [dict(e.model_dump(), summary=e.summary) for e in entries]
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for e in entries:
        match = ", ".join((*e.model_types, *e.architectures)) or "-"
        quant = f", {e.quantization} quantized" if e.quantization else ""
        auto = f"auto: {match}{quant}" if e.auto else f"by name only (converts {match}{quant})"
        print(f"{e.name}  [{auto}]")
        print(textwrap.fill(e.summary, 100, initial_indent="    ", subsequent_indent="    "))
        for test in e.verified:
            print(f"    verified: {test}")
        print(f"    file: {e.path}")
    print(f"{len(entries)} shipped rule files; pass a name wherever rules are taken, or `auto`")
    return EXIT_OK


def _check(args: argparse.Namespace) -> int:
    errors: list[remapdsl.RemapError] = []
    for name in args.files:
        try:
            rules = remapdsl.load_rules(_rules_arg(name, args.checkpoint), root=args.root)
            against = _against_checkpoint(rules, args.checkpoint) if args.checkpoint else ""
        except remapdsl.RemapError as exc:
            errors.append(exc)
            continue
        included = len(rules.files) - 1
        more = f", {_count(included, 'included file')}" if included else ""
        print(f"ok: {name} ({len(rules.statements)} statements{more}{against})")
    for exc in errors:
        print(exc.render(), file=sys.stderr)
    return EXIT_USER_ERROR if errors else EXIT_OK


def _against_checkpoint(rules, folder: str) -> str:
    """Compile against a checkpoint; notes on what it left unused, for the summary line."""
    inventory = remapdsl.open_checkpoint(folder)
    compiled = remapdsl.compile_rules(rules, inventory)
    for span in compiled.unused_drops:
        print(f"{span}: note: this `drop` removes no checkpoint tensor")
    for file in inventory.ignored_files:
        print(f"{folder}: note: `{file}` is not named by the index and is ignored")
    return f", {len(compiled.runtime_tensors)} runtime tensors from {len(compiled.ckpt_tensors)} checkpoint tensors"


def _snapshot(args: argparse.Namespace) -> int:
    text = remapdsl.write_snapshot(args.checkpoint, args.output)
    inventory = remapdsl.open_checkpoint(args.output)
    print(f"wrote {args.output}: {len(inventory.tensors)} tensors in {_count(len(inventory.files), 'file')}, "
          f"{_bytes(len(text.encode()))}", file=sys.stderr)
    return EXIT_OK


def _fmt(args: argparse.Namespace) -> int:
    differs = False
    for name in args.files:
        rules = remapdsl.parse_rules(name)  # a shipped name: its file
        name = rules.path
        canonical = remapdsl.format_rules(rules)
        if canonical == rules.source:
            continue
        differs = True
        if args.diff:
            sys.stdout.writelines(difflib.unified_diff(
                rules.source.splitlines(keepends=True), canonical.splitlines(keepends=True),
                fromfile=name, tofile=f"{name} (formatted)"))
        if args.check:
            print(f"would reformat {name}", file=sys.stderr)
        elif not args.diff:
            Path(name).write_text(canonical, encoding="utf-8")
            print(f"reformatted {name}", file=sys.stderr)
    return EXIT_DIFFERS if differs and (args.check or args.diff) else EXIT_OK


def _explain(args: argparse.Namespace) -> int:
    rules = remapdsl.load_rules(_rules_arg(args.rules, args.checkpoint))
    inventory = remapdsl.open_checkpoint(args.checkpoint)
    compiled = remapdsl.compile_rules(rules, inventory, strict=not args.lenient)
    if args.json:
        print(compiled.model_dump_json(indent=2))
    else:
        print(remapdsl.explain(compiled, args.key, args.blocks))
    return EXIT_OK


ALL_RANKS = 16  # `plan` summarizes every rank of a mesh up to this size by default


def _plan(args: argparse.Namespace) -> int:
    rules = remapdsl.load_rules(_rules_arg(args.rules, args.checkpoint))
    inventory = remapdsl.open_checkpoint(args.checkpoint)
    compiled = remapdsl.compile_rules(rules, inventory)
    mesh = remapdsl.parse_mesh(args.mesh)
    layout = remapdsl.read_layout(args.layout)
    ranks = [args.rank] if args.rank is not None else _ranks(args.ranks, mesh.size)
    total_read = total_owned = total_scales = 0
    for rank in ranks:
        plan = remapdsl.plan_rank(compiled, inventory, layout, mesh, rank)
        total_read += plan.bytes_read
        total_owned += plan.bytes_owned
        total_scales += plan.scale_bytes_read
        tensors = _per_tensor(plan)
        decoded = (f" ({len(plan.decodes)} dequantized, {plan.scale_bytes_read / 1e6:.2f} MB of scales)"
                   if plan.decodes else "")
        files = "files " + ", ".join(plan.files) if len(plan.files) <= 4 else f"{len(plan.files)} files"
        print(f"rank {rank} {dict(zip(mesh.names, mesh.coordinate(rank)))}: {len(tensors)} tensors, "
              f"{len(plan.items) + len(plan.decodes)} reads{decoded}, {plan.bytes_read / 1e6:.2f} MB read of "
              f"{plan.bytes_owned / 1e6:.2f} MB owned, {files if plan.files else 'no file'}")
        if args.tensors:
            for key, (pieces, runs, nbytes) in tensors.items():
                placed = remapdsl.layout_for(key, compiled.runtime_tensor(key).shape, layout, mesh)
                print(f"    {key} [{', '.join(map(str, placed))}]: {_count(pieces, 'piece')}, "
                      f"{_count(runs, 'run')}, {nbytes / 1e6:.2f} MB")
        if args.rank is not None:
            for item in plan.items:
                source = f"{item.ckpt_key} ({_runs(item.runs)})" if item.ckpt_key else f"fill {item.fill:g}"
                print(f"    {item.runtime_key}[{_box(item.local_offsets, item.sizes)}] <- {source}")
            for item in plan.decodes:
                parts = ", ".join(f"{p.ckpt_key} ({_runs(p.runs)})" for p in item.parts)
                print(f"    {item.runtime_key}[{_box(item.local_offsets, item.sizes)}] <- {item.format} "
                      f"{item.logical}[{_box(*item.box)}] of {parts}")
    ratio = (f" ({total_read / total_owned:.2f}x owned"
             + (f"; {total_read / (total_owned + total_scales):.2f}x owned values + covering scales"
                if total_scales else "") + ")") if total_owned else ""
    shown = f" of {mesh.size} (--ranks all for every rank)" if len(ranks) < mesh.size and args.rank is None else ""
    print(f"total: {total_read / 1e6:.2f} MB read{ratio} over {_count(len(ranks), 'rank')}{shown}")
    return EXIT_OK


def _box(offsets, sizes) -> str:
    return ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, sizes))


def _ranks(text: str | None, size: int) -> list[int]:
    """The ranks `--ranks` names, in order, each once."""
    if text is None:
        text = "all" if size <= ALL_RANKS else "first,last"
    if text.strip() == "all":
        return list(range(size))
    ranks: list[int] = []
    for part in text.split(","):
        word = part.strip()
        rank = 0 if word == "first" else size - 1 if word == "last" else int(word) if word.isdigit() else -1
        if not 0 <= rank < size:
            raise remapdsl.RemapError(remapdsl.Diagnostic(
                code="E409", message=f"`--ranks {text}`: `{word}` is not a rank of a mesh of {size}",
                hint=f"give `all`, or ranks 0 to {size - 1} (`first`, `last`) separated by commas"))
        ranks.append(rank)
    return list(dict.fromkeys(ranks))


def _per_tensor(plan) -> dict[str, tuple[int, int, int]]:
    """Runtime key -> (pieces, byte runs, bytes read) of one rank's plan, in key order."""
    out: dict[str, list[int]] = {}
    pieces = [(i.runtime_key, [] if i.runs is None else [i.runs]) for i in plan.items]
    for key, runs in pieces + [(i.runtime_key, [p.runs for p in i.parts]) for i in plan.decodes]:
        row = out.setdefault(key, [0, 0, 0])
        row[0] += 1
        row[1] += sum(r.count for r in runs)
        row[2] += sum(r.total for r in runs)
    return {k: tuple(out[k]) for k in sorted(out)}


def _runs(runs) -> str:
    """A strided run set in a few words: `1 run of 4.19 MB`, `2048 runs of 1.8 kB, 14336 B apart`,
    `8 x 2048 runs of 1.8 kB, 29360128 B / 14336 B apart` (outermost first)."""
    if runs.count == 1:
        return f"1 run of {_bytes(runs.length)}"
    counts = " x ".join(str(n) for n in runs.counts)
    apart = " / ".join(f"{t} B" for t in runs.strides)
    return f"{counts} runs of {_bytes(runs.length)}, {apart} apart"


def _size(text: str, option: str) -> int:
    return remapdsl.parse_size(text, f"{option} {text}")


def _convert(args: argparse.Namespace) -> int:
    started = _join_torchrun()
    try:
        rank = int(os.environ.get("RANK", "0"))
        tty = sys.stderr.isatty() and rank == 0

        def progress(done: int, total: int) -> None:
            print(f"\rconverting: {done / 1e9:.2f} of {total / 1e9:.2f} GB", end="", file=sys.stderr, flush=True)

        rules = _rules_arg(args.rules, args.like if args.reverse else args.src)
        report = remapdsl.convert(args.src, args.dst, rules, reverse=args.reverse, like=args.like,
                                  max_shard_bytes=_size(args.max_shard_size, "--max-shard-size"),
                                  budget_bytes=_size(args.memory, "--memory"), overwrite=args.overwrite,
                                  progress=progress if tty else None, dropped=args.dropped)
        if tty:
            print(file=sys.stderr)
        if rank == 0:
            rate = report.bytes_written / report.seconds / 1e9 if report.seconds else 0.0
            print(f"converted {args.src} -> {report.folder}: {_count(report.files, 'file')}; "
                  f"rank 0 of {report.ranks} wrote {report.tensors} tensors, {_bytes(report.bytes_written)}, "
                  f"in {report.seconds:.2f} s ({rate:.2f} GB/s)")
        return EXIT_OK
    finally:
        if started:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _bytes(n: int) -> str:
    return (f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"
            if n >= 1e3 else f"{n} B")


def _join_torchrun() -> bool:
    """Under torchrun (WORLD_SIZE > 1), join the process group; True if this call started it."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo")
    return True


def _ir(args: argparse.Namespace) -> int:
    rules = remapdsl.load_rules(args.file) if args.resolved else remapdsl.parse_rules(args.file)
    if args.json:
        print(rules.model_dump_json(indent=2))
    else:
        for statement in rules.statements:
            print(repr(statement))
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from remapdsl.testing.verify import DEFAULT_MESHES, verify

    result = verify(_rules_arg(args.rules, args.checkpoint), args.checkpoint, args.mesh or DEFAULT_MESHES,
                    args.layout, args.against)
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
    else:
        print(_verification_table(result))
    return EXIT_OK if result.ok else EXIT_DIFFERS


def _verification_table(result) -> str:
    """One row per property and mesh, then each failure's message in full."""
    data = " (a snapshot: random values in its layout)" if result.synthesized else ""
    lines = [f"verify {result.rules} on {result.checkpoint}{data}", ""]
    rows = [("property", "mesh", "result", "read", "owned", "time", "")]
    for c in result.checks:
        summary = c.detail if c.status == "pass" else c.detail.splitlines()[0] if c.detail else ""
        rows.append((c.property, c.mesh or "-", c.status, "-" if c.bytes_read is None else _bytes(c.bytes_read),
                     "-" if c.bytes_owned is None else _bytes(c.bytes_owned), f"{c.seconds:.2f} s",
                     summary if c.status != "fail" else "see below"))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[6])
    for c in result.checks:
        if c.status == "fail":
            lines += ["", f"FAIL {c.property}{f' ({c.mesh})' if c.mesh else ''}:", *("  " + x for x in c.detail.splitlines())]
    passed = sum(c.status == "pass" for c in result.checks)
    lines += ["", f"{'ok' if result.ok else 'FAILED'}: {passed} of {len(result.checks)} checks hold"]
    return "\n".join(line.rstrip() for line in lines)
