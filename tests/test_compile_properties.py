"""Compiled blocks against the oracle: random rules, loaded from a real safetensors file.

For random source shapes and random valid op chains, a rule file is written, compiled with
remapdsl.compile_rules, loaded with remapdsl.load into fresh tensors, and compared bit for bit with
layout_reference.apply_ops (whole-tensor torch ops) on the same sources. Every destination must
also be tiled by its blocks exactly once.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, given, note, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import remapdsl
from remapdsl.language import ir
from remapdsl.language.parser import parse_text
from layout_reference import apply_ops

MAX_DIM = 12  # no dim grows past this, so every example stays tiny
DTYPES = ("float32", "bfloat16", "float16", "float64")
# Value ops after a pad once skipped the padded region (test_value_ops_after_pad_apply_to_the_fill);
# the generator covers them again.
AVOID_VALUE_OPS_AFTER_PAD = False


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ops(text: str) -> list[ir.Op]:
    return list(parse_text(f"a -> b | {text}").statements[0].ops)


# ---- drawing valid op chains -----------------------------------------------------------------


@dataclass
class Chain:
    """An op chain being drawn, with the shapes of the list axis it holds so far."""

    shapes: list[tuple[int, ...]]
    combined: bool = False  # a combining op has run (list axis -> one tensor)
    padded: bool = False  # a `pad` has run
    cut: int | None = None  # the pieces of a cutting op, when one has run
    ops: list[str] = field(default_factory=list)

    def push(self, text: str, targets: int | None = None) -> None:
        out = apply_ops(_ops(text), [torch.zeros(s) for s in self.shapes], targets=targets)
        self.shapes = [tuple(t.shape) for t in out]
        self.ops.append(text)


def _dim(draw, ndim: int) -> int:
    d = draw(st.integers(0, ndim - 1))
    return d - ndim if draw(st.booleans()) and draw(st.booleans()) else d  # sometimes negative


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _factorization(draw, numel: int) -> list[int]:
    ndim = draw(st.integers(1, 4))
    sizes, left = [], numel
    for _ in range(ndim - 1):
        k = draw(st.sampled_from(_divisors(left)))
        sizes.append(k)
        left //= k
    sizes.append(left)
    sizes = draw(st.permutations(sizes))
    if draw(st.booleans()):
        sizes[draw(st.integers(0, len(sizes) - 1))] = -1
    return sizes


def _combine(draw, chain: Chain) -> str | None:
    shapes = chain.shapes
    ndim = len(shapes[0])
    kinds = []
    if all(s == shapes[0] for s in shapes):
        kinds.append("stack")
    along = [d for d in range(ndim) if all(s[:d] + s[d + 1:] == shapes[0][:d] + shapes[0][d + 1:]
                                           for s in shapes)]
    if along:
        kinds += ["concat", "interleave"]
    if not kinds:
        return None
    kind = draw(st.sampled_from(kinds))
    if kind == "stack":
        d = draw(st.integers(0, ndim))
        return f"stack(dim={d})"
    d = draw(st.sampled_from(along))
    text_d = d - ndim if draw(st.booleans()) and draw(st.booleans()) else d
    if kind == "concat":
        return f"concat(dim={text_d})"
    groups = draw(st.sampled_from(_divisors(math.gcd(*(s[d] for s in shapes)))))
    return f"interleave(dim={text_d}, groups={groups})"


def _cut(draw, shape: tuple[int, ...]) -> tuple[str, int] | None:
    d = draw(st.integers(0, len(shape) - 1))
    size = shape[d]
    kind = draw(st.sampled_from(["split", "chunk", "deinterleave"]))
    if kind == "split":
        if size < 2:
            return None
        cuts = sorted(draw(st.sets(st.integers(1, size - 1), min_size=1, max_size=min(2, size - 1))))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [size])]
        return f"split(dim={d}, sizes={sizes})", len(sizes)
    if kind == "chunk":
        n = draw(st.sampled_from([k for k in _divisors(size) if 2 <= k <= 3] or [1]))
        return f"chunk(dim={d}, n={n})", n
    pairs = [(g, p) for g in _divisors(size) for p in (2, 3) if size % (g * p) == 0]
    if not pairs:
        return None
    groups, parts = draw(st.sampled_from(pairs))
    return f"deinterleave(dim={d}, groups={groups})", parts


def _per_tensor(draw, shapes: list[tuple[int, ...]]) -> str | None:
    ndim = len(shapes[0])
    kind = draw(st.sampled_from(["transpose", "permute", "reshape", "slice", "pad", "repeat",
                                 "rope_permute", "cast", "scale", "add"]))
    if kind == "transpose":
        return f"transpose({_dim(draw, ndim)}, {_dim(draw, ndim)})"
    if kind == "permute":
        return f"permute({draw(st.permutations(range(ndim)))})"
    if kind == "reshape":
        if any(s != shapes[0] for s in shapes):
            return None
        return f"reshape({_factorization(draw, math.prod(shapes[0]))})"
    if kind in ("slice", "pad", "repeat"):
        d = _dim(draw, ndim)
        low, high = min(s[d] for s in shapes), max(s[d] for s in shapes)
        if kind == "slice":
            start = draw(st.integers(0, low - 1))
            stop = draw(st.integers(start + 1, low))
            args = f"dim={d}" + (f", start={start}" if start or draw(st.booleans()) else "")
            return f"slice({args}" + (f", stop={stop})" if stop < low or draw(st.booleans()) else ")")
        if kind == "pad":
            if high >= MAX_DIM:
                return None
            to = draw(st.integers(high, min(MAX_DIM, high + 3)))
            value = draw(st.sampled_from(["", ", value=0", ", value=1.5", ", value=-2"]))
            return f"pad(dim={d}, to={to}{value})"
        times = draw(st.integers(1, max(1, MAX_DIM // high)))
        return f"repeat(dim={d}, times={times})"
    if kind == "rope_permute":
        heads = [h for h in range(1, 5) if all(s[0] % (2 * h) == 0 for s in shapes)]
        return f"rope_permute(heads={draw(st.sampled_from(heads))})" if heads else None
    if kind == "cast":
        return f"cast({draw(st.sampled_from(DTYPES))})"
    if kind == "scale":
        return f"scale({draw(st.sampled_from(['2', '0.5', '-1', '-0.25', '3']))})"
    return f"add({draw(st.sampled_from(['1', '-0.5', '0.25', '-3']))})"


def draw_ops(draw, chain: Chain, count: int, *, may_cut: bool = True) -> Chain:
    """Add up to `count` ops valid for the chain's shapes (a combine when several sources)."""
    def may_combine() -> bool:  # a combine after a cut would leave too few targets (E111)
        return len(chain.shapes) > 1 and not chain.combined and chain.cut is None

    while len(chain.ops) < count or (may_combine() and draw(st.booleans())):
        choice = draw(st.integers(0, 9))
        if may_combine() and choice < 4:
            text = _combine(draw, chain)
            if text is None:
                break  # no combine fits: the sources pair with the targets by position
            chain.combined = True
            chain.push(text)
        elif may_cut and len(chain.shapes) == 1 and chain.cut is None and choice == 9:
            cut = _cut(draw, chain.shapes[0])
            if cut is not None:
                chain.cut = cut[1]
                chain.push(cut[0], targets=cut[1])
        else:
            text = _per_tensor(draw, chain.shapes)
            if text is not None and chain.padded and AVOID_VALUE_OPS_AFTER_PAD \
                    and text.startswith(("scale", "add")):
                text = None
            if text is not None:
                chain.padded |= text.startswith("pad")
                chain.push(text)
        if len(chain.ops) > count + 2:
            break
    return chain


@dataclass
class Case:
    text: str  # the rule file
    sources: dict[str, torch.Tensor]  # checkpoint key -> tensor
    ordered: list[str] | dict[int, list[str]]  # the rule's source keys, as apply_ops takes them
    targets: list[str]  # runtime keys, in list-axis order (capture values ascending for unstack)


def _values(draw, shape, dtype: str) -> torch.Tensor:
    seed = draw(st.integers(0, 2**16))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(getattr(torch, dtype))


NAMES = ("x", "y", "z")


@st.composite
def list_axis_cases(draw) -> Case:
    ndim = draw(st.integers(1, 4))
    base = draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim))
    n = draw(st.sampled_from([1, 1, 2, 3]))
    shapes = [tuple(base)] * n
    if n > 1 and draw(st.booleans()):  # sources that differ along one dim
        vary = draw(st.integers(0, ndim - 1))
        unit = draw(st.integers(1, 3))
        shapes = [tuple(base[:vary] + [unit * draw(st.integers(1, 3))] + base[vary + 1:])
                  for _ in range(n)]
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    count = max(draw(st.integers(1, 4)), draw(st.integers(1, 4)))  # leaning to longer chains
    chain = draw_ops(draw, Chain(list(shapes)), count)
    keys = [f"a.{NAMES[i]}" for i in range(n)]
    if n > 1 and draw(st.booleans()):  # the list axis as several patterns
        source = ", ".join(keys)
    else:
        source = f"a.{{{','.join(NAMES[:n])}}}" if n > 1 else keys[0]
    width = len(chain.shapes)
    targets = [f"out.t{i}" for i in range(width)] if width > 1 else ["out"]
    target = f"out.{{{','.join(f't{i}' for i in range(width))}}}" if width > 1 else "out"
    text = f"{source} -> {target}\n" + "".join(f"    | {op}\n" for op in chain.ops)
    sources = {k: _values(draw, s, dtype) for k, s in zip(keys, shapes)}
    return Case(text, sources, keys, targets)


# ---- running a case ------------------------------------------------------------------------


def _empty(shape, dtype: str) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=getattr(torch, dtype))


def check_tiling(compiled: remapdsl.compile.Compiled) -> None:
    """Every destination is covered by its blocks exactly once, and every read is in bounds."""
    shapes = {s.ckpt_key: s.shape for s in compiled.ckpt_tensors}
    for d in compiled.runtime_tensors:
        count = torch.zeros(d.shape, dtype=torch.int32)
        for b in d.blocks:
            assert len(b.offsets) == len(b.sizes) == len(d.shape)
            assert all(o >= 0 and o + s <= n for o, s, n in zip(b.offsets, b.sizes, d.shape)), b
            count[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))] += 1
            if b.source_key is not None:  # the corners of the box read inside the source
                source = shapes[b.source_key]
                for k, n in enumerate(source):
                    low = b.base[k] + sum(min(0, c * (s - 1)) for c, s in zip(b.coeff[k], b.sizes))
                    high = b.base[k] + sum(max(0, c * (s - 1)) for c, s in zip(b.coeff[k], b.sizes))
                    assert 0 <= low and high < n, (d.runtime_key, b)
        assert sum(math.prod(b.sizes) for b in d.blocks) == math.prod(d.shape), d.runtime_key
        assert bool((count == 1).all()), f"{d.runtime_key}: coverage {count.unique().tolist()}"


def run_case(case: Case) -> None:
    if currently_in_test_context():
        note(case.text)
        note({k: (tuple(t.shape), str(t.dtype)) for k, t in case.sources.items()})
    rules = remapdsl.language.rules_from_text(case.text)
    (rule,) = [s for s in rules.statements if isinstance(s, ir.Rule)]
    if isinstance(case.ordered, dict):
        given_ = {v: [case.sources[k] for k in keys] for v, keys in case.ordered.items()}
    else:
        given_ = [case.sources[k] for k in case.ordered]
    expected = apply_ops(list(rule.ops), given_, targets=len(case.targets))
    if isinstance(expected, dict):
        expected = [t for v in sorted(expected) for t in expected[v]]
    with tempfile.TemporaryDirectory() as tmp:
        save_file(case.sources, str(Path(tmp) / "model.safetensors"))
        inventory = remapdsl.open_checkpoint(tmp)
        compiled = remapdsl.compile_rules(rules, inventory, {})
        check_tiling(compiled)
        assert sorted(d.runtime_key for d in compiled.runtime_tensors) == sorted(case.targets)
        loaded = {d.runtime_key: _empty(d.shape, d.dtype) for d in compiled.runtime_tensors}
        remapdsl.load(loaded, tmp, rules, config={})
    assert len(expected) == len(case.targets)
    for name, want in zip(case.targets, expected):
        got = loaded[name]
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.shape, want.shape)
        assert torch.equal(got, want), f"{name}:\n{got}\n!=\n{want}"


# ---- (a) random layout chains over the list axis -------------------------------------------


@examples(300)
@given(list_axis_cases())
def test_load_equals_reference(case):
    run_case(case)


# ---- (b) stack / concat over a capture, in numeric order -----------------------------------


@st.composite
def capture_cases(draw) -> Case:
    """e.{E}.{x,y} -> ... | ops per expert | stack(E, dim=d) or concat(E, dim=d) | more ops."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    count = draw(st.integers(1, 13))
    start = draw(st.sampled_from([0, 0, 0, 3, 9]))
    names = NAMES[:draw(st.sampled_from([1, 1, 2]))]
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    chain = draw_ops(draw, Chain([shape] * len(names)), draw(st.integers(0, 2)), may_cut=False)
    join = draw(st.sampled_from(["stack", "concat"]))
    ndim = len(chain.shapes[0])
    d = draw(st.integers(0, ndim if join == "stack" else ndim - 1))
    text_d = d - (ndim + (join == "stack")) if draw(st.integers(0, 3)) == 0 else d
    chain.ops.append(f"{join}(E, dim={text_d}" + (f", start={start})" if start else ")"))
    if join == "stack":
        chain.shapes = [s[:d] + (count,) + s[d:] for s in chain.shapes]
    else:
        chain.shapes = [s[:d] + (count * s[d],) + s[d + 1:] for s in chain.shapes]
    chain = draw_ops(draw, chain, len(chain.ops) + draw(st.integers(0, 2)), may_cut=False)
    source = "e.{E}." + (f"{{{','.join(names)}}}" if len(names) > 1 else names[0])
    width = len(chain.shapes)
    target = f"out.{{{','.join(names)}}}" if width > 1 else "out"
    targets = [f"out.{n}" for n in names] if width > 1 else ["out"]
    text = f"{source} -> {target}\n" + "".join(f"    | {o}\n" for o in chain.ops)
    ordered = {e: [f"e.{e}.{n}" for n in names] for e in range(start, start + count)}
    sources = {k: _values(draw, shape, dtype) for keys in ordered.values() for k in keys}
    return Case(text, sources, ordered, targets)


@examples(100)
@given(capture_cases())
def test_capture_load_equals_reference(case):
    run_case(case)


@pytest.mark.parametrize("join", ["stack", "concat"])
def test_experts_past_nine_in_numeric_order(join):
    n = 12
    experts = {f"e.{i}.w": torch.full((2, 3), float(i)) for i in range(n)}
    case = Case(f"e.{{E}}.w -> out | {join}(E, dim=1)\n", experts,
                {i: [f"e.{i}.w"] for i in range(n)}, ["out"])
    run_case(case)  # against the reference, and directly against torch:
    with tempfile.TemporaryDirectory() as tmp:
        save_file(experts, str(Path(tmp) / "model.safetensors"))
        shape = (2, n, 3) if join == "stack" else (2, n * 3)
        out = {"out": torch.empty(shape)}
        remapdsl.load(out, tmp, remapdsl.language.rules_from_text(case.text), config={})
    combine = torch.stack if join == "stack" else torch.cat
    assert torch.equal(out["out"], combine([experts[f"e.{i}.w"] for i in range(n)], 1))


@st.composite
def unstack_cases(draw) -> Case:
    """a -> out.{X}.w | ops | unstack(X, dim=d) | more ops, one target per index."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    chain = draw_ops(draw, Chain([shape]), draw(st.integers(0, 2)), may_cut=False)
    (before,) = chain.shapes
    d = _dim(draw, len(before))
    start = draw(st.sampled_from([0, 0, 5]))
    pieces = before[d]
    chain.ops.append(f"unstack(X, dim={d}" + (f", start={start})" if start else ")"))
    d %= len(before)
    chain.shapes = [before[:d] + before[d + 1:]]  # 0-d targets when the source is 1-d
    if chain.shapes[0]:
        chain = draw_ops(draw, chain, len(chain.ops) + draw(st.integers(0, 2)), may_cut=False)
    text = "a -> out.{X}.w\n" + "".join(f"    | {o}\n" for o in chain.ops)
    return Case(text, {"a": _values(draw, shape, draw(st.sampled_from(["float32", "bfloat16"])))},
                ["a"], [f"out.{start + i}.w" for i in range(pieces)])


@examples(100)
@given(unstack_cases())
def test_unstack_load_equals_reference(case):
    run_case(case)


@pytest.mark.parametrize("op", ["add(1)", "scale(2)"])
def test_value_ops_after_pad_apply_to_the_fill(op):
    # the reference pads [0.5] to [0.5, 1.5], then maps both elements: [1.5, 2.5] or [1.0, 3.0]
    run_case(Case(f"a.x -> out | pad(dim=0, to=2, value=1.5) | {op}\n",
                  {"a.x": torch.tensor([0.5])}, ["a.x"], ["out"]))
