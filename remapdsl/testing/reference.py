"""The reference conversion, an oracle for property tests: a rule's ops applied to whole tensors with plain
torch ops, each from its definition (docs/language.md), knowing nothing of the compiler's blocks. Value
ops compute in float32 and cast back, as the load executor does."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Union

import torch

from remapdsl.language import ir

State = Union[list[torch.Tensor], dict[int, list[torch.Tensor]]]


def literal(expr: ir.Node) -> Any:
    """The value of a literal argument: ints, numbers, lists, `-x` and dtype names."""
    if isinstance(expr, (ir.Int, ir.Float, ir.Bool)):
        return expr.value
    if isinstance(expr, ir.List):
        return [literal(item) for item in expr.items]
    if isinstance(expr, ir.Neg):
        return -literal(expr.operand)
    if isinstance(expr, ir.Name):
        return expr.id  # a dtype name
    raise ValueError(f"not a literal argument: {expr!r}; pass `evaluate=`")


def apply_ops(ops: list[ir.Op], tensors: State, evaluate: Callable[[ir.Node], Any] = literal,
              targets: int | None = None) -> State:
    """Apply a rule's ops (no macro calls) in order to its sources: a list, or capture value -> sources while
    a capture is still to be reduced; returns the state they leave. `evaluate`: an argument's value (by
    default literals only); `targets`: the number of targets `deinterleave` cuts into."""
    state = tensors
    for op in ops:
        state = _apply(op, state, evaluate, targets)
    return state


def _apply(op: ir.Op, state: State, ev: Callable, targets: int | None) -> State:
    def arg(name: str, default: Any = None) -> Any:
        value = getattr(op, name)
        return default if value is None else ev(value)

    join = torch.stack if isinstance(op, ir.Stack) else torch.cat
    if isinstance(op, (ir.Stack, ir.Concat)) and op.capture is not None:
        assert isinstance(state, Mapping), "a capture is reduced from a dict of capture values"
        start = arg("start", 0)
        values = sorted(state)
        assert values == list(range(start, start + len(values))), f"gap in {op.capture}: {values}"
        return [join([state[v][i] for v in values], dim=arg("dim"))
                for i in range(len(state[values[0]]))]
    if isinstance(state, Mapping):
        return {k: _apply(op, v, ev, targets) for k, v in state.items()}
    if isinstance(op, ir.Unstack):
        (t,) = state
        return {arg("start", 0) + i: [piece] for i, piece in enumerate(t.unbind(arg("dim")))}
    if isinstance(op, (ir.Stack, ir.Concat)):
        return [join(state, dim=arg("dim"))]
    if isinstance(op, ir.Interleave):
        dim, groups = arg("dim"), arg("groups")
        chunks = [_equal_parts(t, dim, groups) for t in state]
        return [torch.cat([c[g] for g in range(groups) for c in chunks], dim=dim)]
    if isinstance(op, ir.Deinterleave):
        (t,) = state
        dim, groups = arg("dim"), arg("groups")
        assert targets is not None, "deinterleave needs the number of targets"
        pieces = _equal_parts(t, dim, groups * targets)
        return [torch.cat([pieces[g * targets + i] for g in range(groups)], dim=dim)
                for i in range(targets)]
    if isinstance(op, ir.Split):
        (t,) = state
        sizes = arg("sizes")
        assert sum(sizes) == t.shape[arg("dim")]
        return list(torch.split(t, sizes, dim=arg("dim")))
    if isinstance(op, ir.Chunk):
        (t,) = state
        return _equal_parts(t, arg("dim"), arg("n"))
    return [_one(op, t, arg) for t in state]


def _one(op: ir.Op, t: torch.Tensor, arg: Callable) -> torch.Tensor:
    if isinstance(op, ir.Transpose):
        return t.transpose(arg("a"), arg("b"))
    if isinstance(op, ir.Permute):
        return t.permute(arg("dims"))
    if isinstance(op, ir.Reshape):
        return t.reshape(arg("shape"))
    if isinstance(op, ir.Slice):
        dim = arg("dim")
        start, stop = arg("start", 0), arg("stop", t.shape[dim])
        assert 0 <= start < stop <= t.shape[dim]
        return t.narrow(dim, start, stop - start)
    if isinstance(op, ir.Pad):
        dim, to = arg("dim"), arg("to")
        assert to >= t.shape[dim]
        shape = list(t.shape)
        shape[dim] = to - t.shape[dim]
        return torch.cat([t, torch.full(shape, float(arg("value", 0)), dtype=t.dtype)], dim=dim)
    if isinstance(op, ir.Repeat):
        return torch.cat([t] * arg("times"), dim=arg("dim"))
    if isinstance(op, (ir.RopePermute, ir.RopeUnpermute)):  # each head's rows: halves <-> interleaved pairs
        heads, rows, rest = arg("heads"), t.shape[0], t.shape[1:]
        assert rows % (2 * heads) == 0
        split = (rows // heads // 2, 2) if isinstance(op, ir.RopePermute) else (2, rows // heads // 2)
        return t.reshape(heads, *split, *rest).transpose(1, 2).reshape(rows, *rest)
    if isinstance(op, ir.Cast):
        return t.to(getattr(torch, arg("dtype")))
    if isinstance(op, ir.Scale):
        return (t.float() * float(arg("factor"))).to(t.dtype)
    if isinstance(op, ir.Add):
        return (t.float() + float(arg("value"))).to(t.dtype)
    raise NotImplementedError(f"`{op.op_name()}` has no reference implementation")


def _equal_parts(t: torch.Tensor, dim: int, n: int) -> list[torch.Tensor]:
    assert t.shape[dim] % n == 0, f"dim {dim} of size {t.shape[dim]} does not divide into {n}"
    return list(torch.split(t, t.shape[dim] // n, dim=dim))
