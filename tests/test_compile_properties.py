"""Compiled blocks against the oracle: random rules, loaded from a real safetensors file.

For random source shapes and random valid op chains, a rule file is written, compiled with
remapdsl.compile_rules, loaded with remapdsl.load into fresh tensors, and compared bit for bit with
remapdsl.testing.reference.apply_ops (whole-tensor torch ops) on the same sources. Every destination must
also be tiled by its blocks exactly once.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from depth import scaled
from hypothesis import HealthCheck, currently_in_test_context, given, note, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import remapdsl
from remapdsl.language import ir
from remapdsl.testing.reference import apply_ops
from remapdsl.testing.strategies import Chain, _dim, draw_ops


def examples(n: int) -> settings:
    """Hypothesis settings drawing `n` examples (scaled by the profile: tests/depth.py)."""
    return settings(max_examples=scaled(n), deadline=None, suppress_health_check=[HealthCheck.too_slow])


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
            if b.source_key is not None:  # the corners of the box read inside the source (or its view)
                source = b.view or shapes[b.source_key]
                assert math.prod(source) == math.prod(shapes[b.source_key]), (d.runtime_key, b)
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


@examples(150)
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
