"""Ops applied to a rule's state (reduced capture values -> the list axis of symbolic tensors), one op
at a time with its arguments evaluated: from a binding group to the tensors its targets name."""

from __future__ import annotations

from collections import defaultdict

from ..errors import runs_text
from ..language import ir
from . import symbolic as sym
from .evaluate import Evaluator


class GapError(Exception):
    pass


def apply_op(op: ir.Op, ev: Evaluator, state: dict, targets: int) -> dict:
    """Apply one op to every entry of a rule's state (reduced capture values -> list axis)."""
    if isinstance(op, (ir.Stack, ir.Concat)) and op.capture is not None:
        return _combine_capture(op, ev, state)
    if isinstance(op, ir.Unstack):
        start = ev.integer(op.start, "start") if op.start is not None else 0
        if start < 0:
            raise ev.fail(f"`unstack({op.capture}, ...)` with `start={start}` makes target keys with "
                          f"negative indexes", op.start.span, "keys count from 0: `start` is 0 or more",
                          code="E213")
        dim = ev.integer(op.dim, "dim")
        out: dict = {}
        for key, tensors in state.items():
            pieces = [sym.unstack(t, dim) for t in tensors]
            for i in range(len(pieces[0])):
                out[key + ((op.capture, start + i),)] = [p[i] for p in pieces]
        return out
    return {key: _list_op(op, ev, tensors, targets) for key, tensors in state.items()}


def by_capture(state: dict, capture: str) -> dict[tuple, dict[int, list]]:
    """A rule's state grouped by its other captures, each group keyed by `capture`'s value."""
    grouped: dict[tuple, dict[int, list]] = defaultdict(dict)
    for key, tensors in state.items():
        grouped[tuple([kv for kv in key if kv[0] != capture])][dict(key)[capture]] = tensors
    return grouped


def _combine_capture(op, ev: Evaluator, state: dict) -> dict:
    start = ev.integer(op.start, "start") if op.start is not None else 0
    ev.integer(op.dim, "dim")  # a `dim` that does not evaluate is reported before a gap
    out = {}
    for rest, by_value in by_capture(state, op.capture).items():
        values = sorted(by_value)
        if values != list(range(start, start + len(values))):
            gaps = sorted(set(range(start, max(values) + 1)) - set(values))
            raise GapError(f"`{op.op_name()}({op.capture}, ...)` needs {op.capture} to run from {start} "
                           f"without a gap; found {_ranges(values)}"
                           + (f", missing {_ranges(gaps)}" if gaps else ""))
        out[rest] = [_list_op(op, ev, list(each), 1)[0] for each in zip(*(by_value[v] for v in values))]
    return out


def _list_op(op: ir.Op, ev: Evaluator, tensors: list, targets: int) -> list:
    if isinstance(op, (ir.Stack, ir.Concat, ir.Interleave)):
        dim = ev.integer(op.dim, "dim")
        if not isinstance(op, ir.Stack) and op.sizes is not None:  # the parts are that big along `dim`
            sizes = list(ev.integers(op.sizes, "sizes"))
            found = [p.shape[dim % len(p.shape)] if p.shape else None for p in tensors]
            if found != sizes:
                raise sym.OpError(f"the parts it joins are {found} along dim {dim}, "
                                  f"but `sizes=` says {sizes}")
        if isinstance(op, ir.Interleave):
            return [sym.interleave(tensors, dim, ev.integer(op.groups, "groups"))]
        return [(sym.stack if isinstance(op, ir.Stack) else sym.concat)(tensors, dim)]
    if isinstance(op, ir.Split):
        return sym.split(tensors[0], ev.integer(op.dim, "dim"), ev.integers(op.sizes, "sizes"))
    if isinstance(op, ir.Chunk):
        return sym.chunk(tensors[0], ev.integer(op.dim, "dim"), ev.integer(op.n, "n"))
    if isinstance(op, ir.Deinterleave):
        return sym.deinterleave(tensors[0], ev.integer(op.dim, "dim"), ev.integer(op.groups, "groups"),
                                targets)
    return [_one(op, ev, t) for t in tensors]


def _one(op: ir.Op, ev: Evaluator, t: sym.Sym) -> sym.Sym:
    if isinstance(op, ir.Transpose):
        return sym.transpose(t, ev.integer(op.a, "a"), ev.integer(op.b, "b"))
    if isinstance(op, ir.Permute):
        return sym.permute(t, ev.integers(op.dims, "dims"))
    if isinstance(op, ir.Reshape):
        return sym.reshape(t, ev.integers(op.shape, "shape"))
    if isinstance(op, ir.Slice):
        start = ev.integer(op.start, "start") if op.start is not None else None
        stop = ev.integer(op.stop, "stop") if op.stop is not None else None
        return sym.slice_(t, ev.integer(op.dim, "dim"), start, stop)
    if isinstance(op, ir.Pad):
        value = ev.number(op.value, "value") if op.value is not None else 0.0
        dim = ev.integer(op.dim, "dim")
        if op.size is not None and t.shape:
            found, size = t.shape[dim % len(t.shape)], ev.integer(op.size, "size")
            if found != size:
                raise sym.OpError(f"it pads dim {dim} of size {found}, but `size=` says {size}")
        return sym.pad(t, dim, ev.integer(op.to, "to"), value)
    if isinstance(op, ir.Repeat):
        return sym.repeat(t, ev.integer(op.dim, "dim"), ev.integer(op.times, "times"))
    if isinstance(op, ir.RopePermute):
        return sym.rope_permute(t, ev.integer(op.heads, "heads"))
    if isinstance(op, ir.RopeUnpermute):
        return sym.rope_unpermute(t, ev.integer(op.heads, "heads"))
    if isinstance(op, ir.Cast):
        return sym.value_step(t, ("cast", ev.dtype(op.dtype)))
    if isinstance(op, ir.Scale):
        return sym.value_step(t, ("scale", float(ev.number(op.factor, "factor"))))
    if isinstance(op, ir.Add):
        return sym.value_step(t, ("add", float(ev.number(op.value, "value"))))
    raise sym.OpError(f"`{op.op_name()}` cannot stand in a mapping rule")


def expand_macros(ops, macros: dict, config, lets: dict, line_text, env: dict | None = None
                  ) -> list[tuple[ir.Op, dict]]:
    """Ops with macro calls replaced by their bodies, each with its parameter values."""
    out = []
    for op in ops:
        if isinstance(op, ir.MacroCall):
            macro = macros[op.name]
            args = {}
            for position, arg in enumerate(op.args):
                name = arg.name or macro.params[position]
                args[name] = Evaluator(config, lets | (env or {}), line_text).integer(arg.value, name)
            out.extend(expand_macros(macro.ops, macros, config, lets, line_text, args))
        else:
            out.append((op, env or {}))
    return out


def _ranges(values: list[int]) -> str:
    """{0,1,2,5} -> `{0-2, 5}` (`values` sorted, without repeats)."""
    return "{" + runs_text(values) + "}"
