"""Compiled -> text for people: each runtime tensor's shape and dtype, and which region of which
checkpoint tensor fills each region of it, through which rule. Reads no tensor data."""

from __future__ import annotations

import fnmatch

from ..indexmap import nbytes, source_box
from .model import Block, Compiled


def explain(compiled: Compiled, key: str | None = None, max_blocks: int = 8) -> str:
    """The runtime tensors (those whose runtime key, or one of whose checkpoint keys, matches the
    glob `key`), each with up to `max_blocks` blocks, then a summary line."""
    shown = [d for d in compiled.runtime_tensors
             if key is None or fnmatch.fnmatchcase(d.runtime_key, key)
             or any(fnmatch.fnmatchcase(k, key) for k in d.ckpt_keys)]
    sources = {s.ckpt_key: s for s in compiled.ckpt_tensors}
    logical = compiled.logical_by_key()
    lines: list[str] = []
    for d in shown:
        where = f"  ({d.rule.path}:{d.rule.line})" if d.rule else ""
        lines.append(f"{d.runtime_key}  {list(d.shape)} {d.dtype}{where}")
        for b in d.blocks[:max_blocks]:
            source = sources.get(b.source_key)
            viewed = b.view and source is not None and b.view != tuple(source.shape)
            box = ", ".join(str(o) if s == 1 else f"{o}:{o + s}" for o, s in zip(b.offsets, b.sizes))
            lines.append(f"    [{box}] <- {_viewed(b, source.shape) if viewed else _source(b)}")
        if len(d.blocks) > max_blocks:
            lines.append(f"    ... and {_count(len(d.blocks) - max_blocks, 'more block')}")
    stored = {p for d in shown for k in d.ckpt_keys for p in (logical[k].parts if k in logical else (k,))}
    read = sum(nbytes(sources[k].dtype, sources[k].shape) for k in stored)
    used = [logical[k] for k in sorted({k for d in shown for k in d.ckpt_keys}) if k in logical]
    for source in used[:max_blocks]:
        params = ", ".join(f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in source.params)
        lines.append(f"{source.logical_key}  {list(source.shape)} {source.dtype} = {source.format}({params}) of "
                     + ", ".join(f"`{p}`" for p in source.parts))
    if len(used) > max_blocks:
        lines.append(f"... and {_count(len(used) - max_blocks, 'more dequantized tensor')}")
    lines.append(f"{_count(len(shown), 'runtime tensor')} from {_count(len(stored), 'checkpoint tensor')} "
                 f"({read / 1e6:.1f} MB)"
                 + (f"; {len(compiled.dropped)} dropped" if compiled.dropped and key is None else ""))
    return "\n".join(lines)


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _source(b: Block) -> str:
    if b.source_key is None:
        return f"fill {b.fill:g}"
    # When each runtime dim moves one source dim by +-1, the source region is a box.
    region = []
    for k, row in enumerate(b.coeff):
        moving = [(j, c) for j, c in enumerate(row) if c]
        if not moving:
            region.append(str(b.base[k]))
        elif len(moving) == 1 and abs(moving[0][1]) == 1:
            j, c = moving[0]
            lo, hi = sorted((b.base[k], b.base[k] + c * (b.sizes[j] - 1)))
            region.append(str(lo) if lo == hi else f"{lo}:{hi + 1}" + ("" if c > 0 else " reversed"))
        else:
            return f"{b.source_key} from {list(b.base)}, steps {[list(r) for r in b.coeff]}{_steps(b)}"
    # for each runtime dim, the source dim it walks (a transpose shows as a permutation)
    walking = [[k for k, row in enumerate(b.coeff) if row[j]] for j in range(len(b.sizes))]
    order = [w[0] for w in walking if len(w) == 1]
    moved = f" (dims {order})" if order and order != sorted(order) else ""
    return f"{b.source_key} [{', '.join(region)}]{moved}{_steps(b)}"


def _viewed(b: Block, shape) -> str:
    """A block that indexes its source's flat view (a reshape merged its dims): the source box it
    reads where it is one, else its flat map."""
    steps = _steps(b)
    box = source_box(b, shape)
    if box is None:
        return f"{b.source_key} flattened, from {b.base[0]}, steps {list(b.coeff[0])}{steps}"
    region = [str(first) if count == 1 else f"{first}:{first + count}" if step == 1
              else f"{first}:{first + step * (count - 1) + 1}:{step}" for first, count, step in box]
    return f"{b.source_key} [{', '.join(region)}] flattened{steps}"


def _steps(b: Block) -> str:
    return "".join(f" | {kind}({value if kind == 'cast' else f'{value:g}'})" for kind, value in b.steps)
