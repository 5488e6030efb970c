"""`dequantize` statements -> logical sources made from a format's parts (values plus scales), in the
parts' place; `quantized` statements -> parts moved as stored, checked that no op or shard cuts a block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..language import RuleSet, ir
from ..language.check import check_program
from ..quant import FormatError, Part, QuantFormat, format_names, get_format
from .bind import bind
from .evaluate import Evaluator
from .model import LogicalTensor, StoredQuantized


def check_formats(rules: RuleSet) -> None:
    """The static checks of a program that names formats, run again with the registered formats'
    parameters: each format call names one, with arguments that fit it (E035, E128, E120, E121)."""
    if any(isinstance(s, (ir.Dequantize, ir.Quantized)) for s in rules.statements):
        check_program(rules.statements, rules.line_text, {name: get_format(name).params for name in format_names()})


def format_of(op: ir.FormatCall, ev: Evaluator) -> tuple[QuantFormat, dict[str, Any]]:
    """The registered format a `dequantize` or `quantized` statement names, with its arguments
    evaluated (the static checks have found the format and matched the arguments to its params)."""
    fmt = get_format(op.name)
    given = {arg.name or fmt.params[position].name: arg.value for position, arg in enumerate(op.args)}
    read = {"ints": ev.integers, "int": ev.integer, "number": ev.number}
    params: dict[str, Any] = {}
    for p in (p for p in fmt.params if p.name in given):
        expr = given[p.name]
        if p.kind in read:
            params[p.name] = read[p.kind](expr, p.name)
        elif p.kind == "dtype":
            params[p.name] = ev.dtype(expr)
        else:  # scale_dtype and other names: checked by the static checks
            params[p.name] = expr.id if isinstance(expr, ir.Name) else ev.value(expr)
    return fmt, params


def bind_dequantize(s: ir.Dequantize, available: set[str], inventory_tensors, ev: Evaluator,
                    error: Callable[..., None], logical: dict[str, LogicalTensor]) -> None:
    """Bind one statement: add its logical sources to `logical` and to `available`, take its parts
    out of `available`; report problems through `error(code, message, span, hint)`."""
    fmt, params, bindings = _bound(s, available, ev, error)
    name = ev.namer(s.target)
    shape_of = _memo(lambda parts: tuple(fmt.logical_shape(parts, params)), inventory_tensors)
    plain = _plain_params(params)
    for captures, keys in bindings:
        key = name(captures)
        try:
            shape = shape_of(keys)
        except FormatError as exc:
            error("E221", f"`{fmt.name}` does not fit the tensors of `{key}`: {exc}", s.format.span or s.span)
            continue
        if key in logical:
            error("E223", f"logical tensor `{key}` is made twice (also by the statement at "
                  f"{logical[key].rule})", s.span)
            continue
        available.difference_update(keys)
        if key in available:
            error("E223", f"logical tensor `{key}` has the name of a checkpoint tensor it does not "
                  "consume", s.span,
                  "name the logical tensor after its values part, or after a free key")
            continue
        available.add(key)
        logical[key] = LogicalTensor(key, fmt.name, plain, tuple(keys), shape, params["to"], s.span)


def _memo(compute: Callable[[list[Part]], Any], inventory_tensors) -> Callable[[tuple[str, ...]], Any]:
    """`compute(parts)` of a binding's keys, remembered by the parts' dtypes and shapes (a format decides
    from them alone); a failure is not remembered, so each error names its own keys."""
    known: dict[tuple, Any] = {}

    def of(keys: tuple[str, ...]) -> Any:
        infos = list(map(inventory_tensors.__getitem__, keys))
        signature = tuple((t.dtype, tuple(t.shape)) for t in infos)  # a shape may be held as a list
        found = known.get(signature)
        if found is None:
            parts = [Part(k, t.dtype, tuple(t.shape)) for k, t in zip(keys, infos)]
            found = known[signature] = compute(parts)
        return found
    return of


def _bound(s: ir.Dequantize | ir.Quantized, available: set[str], ev: Evaluator, error: Callable[..., None]):
    """The statement's format, its evaluated arguments, and the bindings with every part present
    that its guard accepts (none when the sources do not match the format's parts)."""
    fmt, params = format_of(s.format, ev)
    if len(s.sources) != len(fmt.parts):
        error("E221", f"`{fmt.name}` takes {len(fmt.parts)} source tensors ({', '.join(fmt.parts)}), "
              f"the statement names {len(s.sources)}", s.span)
        return fmt, params, []
    bound = bind(s.sources, available)
    for p in bound.partial:
        if 0 in p.missing:  # scales (or another part) without the values they scale
            captures = ", ".join(f"{k}={v}" for k, v in p.captures.items())
            present = ", ".join(f"`{k}`" for k in p.present)
            error("E222", f"`{p.present[0]}` has no `{fmt.parts[0]}` to scale: {{{captures}}} matches the "
                  f"{fmt.name} parts {present} but not the first", s.span,
                  "a quantized weight needs every part; drop stray scales with `drop`")
    bindings = bound.bindings
    if s.guard is not None:
        bindings = [b for b in bindings if ev.boolean(s.guard, b.captures)]
    return fmt, params, bindings


def _plain_params(params: dict[str, Any]) -> tuple:
    """A statement's evaluated arguments as the sorted (name, value) pairs a Compiled holds."""
    return tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in params.items()))


def bind_quantized(s: ir.Quantized, available: set[str], inventory_tensors, ev: Evaluator,
                   error: Callable[..., None], stored: dict[str, StoredQuantized]) -> None:
    """Bind one `quantized` statement: its parts stay checkpoint tensors for the rules to move; the
    values' block grid is recorded for the cut checks."""
    fmt, params, bindings = _bound(s, available, ev, error)

    def checked_grid(parts: list[Part]) -> tuple[int, ...]:
        fmt.logical_shape(parts, params)  # raises when the parts do not fit
        return tuple(fmt.value_grid(parts, params))

    grid_of = _memo(checked_grid, inventory_tensors)
    plain = _plain_params(params)
    for b in bindings:
        try:
            grid = grid_of(b.keys)
        except FormatError as exc:
            error("E221", f"`{fmt.name}` does not fit the tensors of `{b.keys[0]}`: {exc}", s.format.span or s.span)
            continue
        stored[b.keys[0]] = StoredQuantized(values=b.keys[0], format=fmt.name, params=plain,
                                            parts=tuple(b.keys), grid=grid, rule=s.span)


def check_cuts(tensor, stored: dict[str, StoredQuantized], shape_of, error: Callable[..., None]):
    """E224 unless each block of `tensor` moving stored quantized values cuts no quantization block (it would
    pair values with another tensor's scales); returns the runtime tensor's grid per dim, () if none."""
    grid = [1] * len(tensor.shape)
    sources_one_scale = {b.source_key for b in tensor.blocks if b.source_key in stored
                         and get_format(stored[b.source_key].format).one_scale}
    if len(sources_one_scale) > 1:
        first, second = sorted(sources_one_scale)[:2]
        error("E224", f"`{tensor.runtime_key}` joins `{first}` and `{second}`, stored with one scale "
              "each: one tensor cannot keep both scales", tensor.rule,
              "dequantize them first (`dequantize`), or keep them as separate tensors")
        return ()
    for block in tensor.blocks:
        declared = stored.get(block.source_key)
        if declared is None:
            continue
        extent = shape_of(block.source_key)
        for k, g in enumerate(declared.grid):
            if g == 1:
                continue
            moving = [j for j, c in enumerate(block.coeff[k]) if c and block.sizes[j] > 1]
            low = block.base[k]
            if len(moving) > 1 or any(abs(block.coeff[k][j]) != 1 for j in moving):
                error("E224", f"`{block.source_key}` is stored quantized in blocks of {g} along dim {k} "
                      f"(declared at {declared.rule}); this rule reshapes or strides that dim into "
                      f"`{tensor.runtime_key}`", tensor.rule, "dequantize it first")
                return ()
            if not moving:  # one index of this dim: a cut on both sides unless the dim is one block
                if extent[k] > 1:
                    _cut(error, declared, tensor, k, g, low, "source", low)
                    return ()
                continue
            (j,) = moving
            n, at = block.sizes[j], block.offsets[j]
            for offset, end, where in ((low, extent[k], "source"), (at, tensor.shape[j], "runtime tensor")):
                for edge in (offset, offset + n):
                    if edge % g and edge != end:
                        _cut(error, declared, tensor, k, g, edge, where, low, j, at, n)
                        return ()
            grid[j] = max(grid[j], g)
    return tuple(grid) if any(g > 1 for g in grid) else ()


def _cut(error, declared, tensor, k, g, edge, where, low, j=None, at=None, n=1) -> None:
    placed = (f"; the rule puts its dim-{k} range {low}:{low + n} at {at}:{at + n} of dim {j} of "
              f"`{tensor.runtime_key}`" if j is not None else "")
    error("E224", f"`{declared.values}` is stored quantized in blocks of {g} along dim {k} (declared at "
          f"{declared.rule}){placed}: {where} offset {edge} falls inside a block", tensor.rule,
          f"a cut of block-scaled values must fall on a multiple of {g}; dequantize first to cut anywhere")

