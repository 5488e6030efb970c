"""The compiler's fast paths say what the plain algorithms say.

Binding reads keys through a KeyPool (literal tails found without a scan, a path that ends the key
matched by single-character repeats, matches collected column by column); the tiling check tells grids
of one block size in a few passes; dequantize remembers a format's shapes. Each is compared here with a direct version: a `fullmatch` of every key and the
slot-by-slot join the compiler used before, the pairwise overlap test, a fresh format call per
binding (whose errors name their own keys).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remapdsl
from remapdsl.checkpoint.inventory import Inventory
from remapdsl.compile import symbolic as sym
from remapdsl.compile.bind import Binding, Bound, KeyPool, Partial, bind, compile_pattern, list_axis
from remapdsl.compile.model import Compiled, LogicalTensor, StoredQuantized
from remapdsl.indexmap import Block
from remapdsl.language import ir, rules_from_text
from remapdsl.language.parser import parse_text

SEGMENTS = ("model", "layers", "0", "1", "2", "10", "01", "a", "b", "q", "k", "weight", "w", "x",
            "gate_proj", "up_proj", "mlp", "weight_scale_inv", "")  # "" makes `a..b`, `.a`, `a.`
STATEMENTS = (
    "model.layers.{L}.mlp.{gate,up}_proj.weight",
    "model.layers.{L}.{m:seg}.weight",
    "{P:path}.weight, {P}.weight_scale_inv",
    "{m:seg}.weight",
    "{L}.weight, {L}.w",
    "a.{L}.{E}.{q,k}.w, a.{L}.x",  # the second source lacks a capture: it fills every binding of its L
    "model.layers.{L}.**",
    "model.{P:path}",
    "*.weight, *.w",
    "{m:seg}.{L}.{L}",
    "model.weight",
    "{a,b}.{q,k}.weight",
    "model.layers.{L}.{gate_proj,up_proj}",
)


def sources(statement: str) -> tuple[ir.Pattern, ...]:
    return parse_text(f"{statement} -> t").statements[0].sources


def reference_bind(patterns, keys) -> Bound:
    """Bindings as the compiler found them before its fast paths: each key fullmatched, slot by slot."""
    compiled = [compile_pattern(p) for p in patterns]
    axis = list_axis(patterns)
    position = {entry: i for i, entry in enumerate(axis)}
    names = list(dict.fromkeys(n for c in compiled for n, _ in c.captures))
    slots: dict[tuple, list] = {}
    unmatched, ambiguous = [], []
    for index, c in enumerate(compiled):
        found = 0
        for k in keys:
            m = c.regex.fullmatch(k)
            if m is None:
                continue
            found += 1
            values = {n: int(m[f"c{i}"]) if t == "int" else m[f"c{i}"] for i, (n, t) in enumerate(c.captures)}
            choice = tuple(options.index(m[f"a{i}"]) for i, options in enumerate(c.alternatives))
            row = slots.setdefault(tuple(values.get(n, ANY) for n in names), [None] * len(axis))
            at = position[(index, choice)]
            if row[at] is not None and row[at] != k:
                ambiguous.append((row[at], k))
            row[at] = k
        if not found:
            unmatched.append(index)
    full = {k: v for k, v in slots.items() if ANY not in k}
    loose = {k: v for k, v in slots.items() if ANY in k}
    if not loose:
        rows = sorted(full.items())
    elif not full:
        rows = sorted(((tuple(None if v is ANY else v for v in k), e) for k, e in loose.items()),
                      key=lambda kv: order(kv[0]))
    else:
        rows = []
        for k, entries in full.items():
            merged = list(entries)
            for lk, lentries in loose.items():
                if all(a is ANY or a == b for a, b in zip(lk, k)):
                    merged = [e if e is not None else m for e, m in zip(lentries, merged)]
            rows.append((k, merged))
        rows.sort(key=lambda kv: order(kv[0]))
    bindings = [Binding(dict(zip(names, v)), tuple(e)) for v, e in rows if None not in e]
    partial = [Partial(dict(zip(names, v)), tuple(x for x in e if x is not None),
                       tuple(i for i, x in enumerate(e) if x is None)) for v, e in rows if None in e]
    return Bound(bindings, partial, unmatched, ambiguous)


ANY = object()


def order(values: tuple) -> tuple:
    return tuple((0, v, "") if isinstance(v, int) else (1, 0, str(v)) for v in values)


keys_strategy = st.sets(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=5).map(".".join),
                        max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keys=keys_strategy, statement=st.sampled_from(STATEMENTS))
def test_bind_finds_what_fullmatching_every_key_finds(keys, statement):
    keys.update(("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight", "1.weight",
                 "a..weight", ".weight", "a.weight", "a.weight_scale_inv", ".a.weight_scale_inv", "01.weight",
                 "model.layers.1..x", "model.layers.1.x."))
    patterns = sources(statement)
    want = reference_bind(patterns, keys)
    assert bind(patterns, keys) == want
    assert bind(patterns, KeyPool(keys, indexed=True)) == want


def test_a_pool_finds_literal_tails_by_group_as_by_scan():
    keys = {"a.b.c.weight", "c.weight", "weight", "x.gate_proj.weight", "y.up_proj.weight", "bweight",
            ".weight"}
    for tails in ((".weight",), ("weight",), ("c.weight",), (".b.c.weight",), ("_proj.weight", "c.weight"),
                  ("t",), ("a.b.c.weight",), ("zzz",)):
        assert list(KeyPool(keys, indexed=True).ending(tails)) == list(KeyPool(keys).ending(tails))


def test_keys_holding_a_newline_are_read_as_their_lines():
    keys = ["x\nmodel.weight", "model.weight.y"]
    (pattern,) = sources("model.weight")
    assert bind((pattern,), keys).bindings == [Binding({}, ("model.weight",))]


blocks_strategy = st.lists(st.tuples(st.lists(st.integers(-1, 6), min_size=2, max_size=2),
                                     st.lists(st.integers(0, 4), min_size=2, max_size=2)), max_size=6)


def reference_tiles(blocks, shape) -> bool:
    inside = all(0 <= o and o + s <= n for b in blocks for o, s, n in zip(b.offsets, b.sizes, shape))
    ordered = sorted(blocks, key=lambda b: b.offsets[0])
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if all(ao < bo + bs and bo < ao + as_
                   for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                return False
    return inside


@settings(max_examples=300, deadline=None)
@given(boxes=blocks_strategy, grid=st.booleans(), shape=st.tuples(st.integers(1, 8), st.integers(1, 8)))
def test_tiles_says_what_the_pairwise_check_says(boxes, grid, shape):
    if grid:  # one size at multiples of it, as `stack` makes: the fast path
        boxes = [([o * 2 for o in offsets], [2, 2]) for offsets, _ in boxes]
    blocks = tuple(Block(tuple(o), tuple(s), "k", (0, 0), ((1, 0), (0, 1))) for o, s in boxes)
    assert sym.tiles(blocks, shape) == reference_tiles(blocks, shape)


def test_a_compiled_record_reads_back_from_json_as_it_was_made():
    values = {"values": "a.weight", "format": "fp8_block", "params": (("to", "bfloat16"),),
              "parts": ("a.weight", "a.s"), "grid": (2, 2)}
    built = StoredQuantized(**values)
    compiled = Compiled.model_construct(runtime_tensors=(), ckpt_tensors=(), quantized=(built,), bindings=())
    again = Compiled.model_validate_json(compiled.model_dump_json())
    assert again.quantized == (built,) and type(again.quantized[0]) is StoredQuantized
    assert again.model_dump_json() == compiled.model_dump_json()


FP8 = """remap 1
dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight
    | fp8_block(block=[2, 2], scale=float32, to=bfloat16)
{P:path}.weight -> {P}.weight
"""


def test_each_binding_that_does_not_fit_its_format_is_reported_with_its_own_keys():
    shapes = {f"{name}.weight": ("F8_E4M3", (4, 4)) for name in ("a", "b", "c")}
    shapes |= {"a.weight_scale_inv": ("F32", (2, 2)), "b.weight_scale_inv": ("F32", (3, 2)),
               "c.weight_scale_inv": ("F32", (3, 2))}
    with pytest.raises(remapdsl.BindError) as info:
        remapdsl.compile_rules(rules_from_text(FP8, "t.remap"), Inventory.from_shapes(shapes), {})
    messages = [d.message for d in info.value.diagnostics if d.code == "E221"]
    assert len(messages) == 2
    assert "`b.weight`" in messages[0] and "`b.weight_scale_inv`" in messages[0]
    assert "`c.weight`" in messages[1] and "`c.weight_scale_inv`" in messages[1]


def test_bindings_of_one_shape_share_the_format_s_answer():
    shapes = {f"{name}.weight": ("F8_E4M3", (4, 6)) for name in ("a", "b")}
    shapes |= {f"{name}.weight_scale_inv": ("F32", (2, 3)) for name in ("a", "b")}
    compiled = remapdsl.compile_rules(rules_from_text(FP8, "t.remap"), Inventory.from_shapes(shapes), {})
    for made in compiled.logical:  # built as tuples: what the named tuple's own constructor makes
        assert type(made) is LogicalTensor and made == LogicalTensor(**made._asdict())
    assert Compiled.model_validate_json(compiled.model_dump_json()).logical == compiled.logical
    assert [(t.logical_key, t.shape, t.parts) for t in compiled.logical] == [
        ("a.weight", (4, 6), ("a.weight", "a.weight_scale_inv")),
        ("b.weight", (4, 6), ("b.weight", "b.weight_scale_inv"))]


DEQUANTIZE = """remap 1
dequantize {{P:path}}.weight, {scales} -> {target}
    | fp8_block(block=[2, 2], scale=float32, to=bfloat16)
{{X:path}} -> {{X}}
"""
W, S = ("F8_E4M3", (4, 4)), ("F32", (2, 2))


def _outcome(text: str, inventory: Inventory):
    try:
        compiled = remapdsl.compile_rules(rules_from_text(text, "t.remap"), inventory, {})
    except remapdsl.RemapError as exc:
        return [(d.code, d.message) for d in exc.diagnostics]
    return [(t.logical_key, t.parts) for t in compiled.logical], [t.runtime_key for t in compiled.runtime_tensors]


@pytest.mark.parametrize("shapes, scales, target, want", [
    ({"a.weight": W, "b.weight": W, "a.weight_scale_inv": S, "b.weight_scale_inv": S}, "{P}.weight_scale_inv",
     "{P}.weight", ([("a.weight", ("a.weight", "a.weight_scale_inv")),
                     ("b.weight", ("b.weight", "b.weight_scale_inv"))], ["a.weight", "b.weight"])),
    # binding b takes a's scale, after binding a made a logical tensor of that name
    ({"a.weight": W, "b.weight": W, "a.weight_scale_inv": S}, "a.weight_scale_inv", "{P}.weight_scale_inv",
     ([("a.weight_scale_inv", ("a.weight", "a.weight_scale_inv")),
       ("b.weight_scale_inv", ("b.weight", "a.weight_scale_inv"))], ["b.weight_scale_inv"])),
    ({"a.weight": W, "a.weight_scale_inv": S, "a.deq": S}, "{P}.weight_scale_inv", "{P}.deq",
     [("E223", "logical tensor `a.deq` has the name of a checkpoint tensor it does not consume")]),
    ({"a.weight": W, "a.s.weight": W, "a.weight_scale_inv": S, "a.s.weight_scale_inv": S}, "{P}.weight_scale_inv",
     "{P}.s.weight", [("E223", ("logical tensor `a.s.weight` has the name of a checkpoint tensor it does not "
                      "consume"))]),
    ({"a.weight": W, "b.weight": W, "a.weight_scale_inv": S, "b.weight_scale_inv": ("F32", (3, 2))},
     "{P}.weight_scale_inv", "{P}.weight",
     [("E221", ("`fp8_block` does not fit the tensors of `b.weight`: scales `b.weight_scale_inv` are [3, 2], but "
       "values [4, 4] in blocks of [2, 2] need a grid of [2, 2]"))]),
])
def test_dequantize_binds_each_binding_in_turn(shapes, scales, target, want):
    """Each binding takes its parts and makes its name in turn: a name may be a part an earlier binding
    consumed, never a free checkpoint key or a part that stays; a binding that does not fit is E221."""
    text = DEQUANTIZE.format(scales=scales, target=target)
    assert _outcome(text, Inventory.from_shapes(shapes)) == want


def test_dequantize_names_made_twice_are_reported():
    """Two bindings that name one logical tensor (`{L // 2}`): the second is E223."""
    text = """remap 1
dequantize w.{L}, s.{L} -> m.{L // 2} | fp8_block(block=[2, 2], scale=float32, to=bfloat16)
{X:path} -> {X}
"""
    shapes = {f"w.{i}": ("F8_E4M3", (4, 4)) for i in range(3)} | {f"s.{i}": ("F32", (2, 2)) for i in range(3)}
    found = _outcome(text, Inventory.from_shapes(shapes))
    assert [code for code, _ in found] == ["E223"] and "`m.0` is made twice" in found[0][1]
