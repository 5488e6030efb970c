"""How rules bind checkpoint keys (remapdsl/compile/compiler.py), and what the compiler says when
they do not: E201's whole hint in each of its branches (an unknown segment with and without a close
suggestion, keys that start like the pattern, none, and the note a guard adds), E204's message (the
captures, alternatives and wildcards of the missing key), guards over bindings where a capture has
no value, a failed rule's keys not reported again as E202, the other binding errors whole, and what
`drop`, `keep` and `cast` record. Rules are compiled against a real checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import dcp_chunk, tiny_checkpoint

import remapdsl
from remapdsl.language import rules_from_text

_KEYS = ["a.0.w", "a.1.w", "a.2.w", "a.3.w", "b.0.w", "b.1.w", "m.0.up", "m.0.gate", "m.1.up",
         "e.0.0.w", "e.0.1.w", "f.0.0.w"]
# every combination of n.0.{x,y}.{p,q}.{r,s} but n.0.x.q.r: its choices differ between the 2nd and 3rd part
_ALTERNATIVES = [f"n.0.{i}.{j}.{k}" for i in "xy" for j in "pq" for k in "rs" if (i, j, k) != ("x", "q", "r")]
_HINT_204 = ("every source of a rule must exist for each binding; mark the rule `optional` only if the "
             "whole binding may be absent")
_ON = ", so the rule is on; mark it `optional` if this key may be absent"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The keys above, each float32 [4, 2], with an empty config."""
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), {k: torch.zeros(4, 2) for k in _KEYS + _ALTERNATIVES},
                           {})


def _compile(checkpoint: Path, text: str, config: dict | None = None, strict: bool = False):
    return remapdsl.compile_rules(rules_from_text("remap 1\n" + text, "t.remap"), checkpoint, config or {},
                                  strict=strict)


def _diagnostics(checkpoint: Path, text: str, config: dict | None = None, strict: bool = False) -> list:
    with pytest.raises(remapdsl.RemapError) as info:
        _compile(checkpoint, text, config, strict)
    return [(d.code, d.message, tuple(d.span[:5]) if d.span else None, d.hint) for d in info.value.diagnostics]


def _e201(checkpoint: Path, text: str, config: dict | None = None) -> tuple:
    """The one E201 a one-line rule gives: its span (columns on line 2) and hint."""
    ((code, message, span, hint),) = _diagnostics(checkpoint, text + "\n", config)
    assert (code, message) == ("E201", "pattern matches no checkpoint key")
    return span[2:], hint


# -- E201: the hint --

@pytest.mark.parametrize("text, span, hint", [
    ("a.{L}.ww -> c.{L}", (1, 2, 9), "did you mean `w`?"),
    ("a.{L}.v -> c.{L}", (1, 2, 8), "no checkpoint key has a segment `v`"),
    # every segment is known: the keys that start with the literal text before the first capture,
    # sorted, three at most
    ("a.{L}.w.b -> c.{L}", (1, 2, 10), "checkpoint keys that start like this: `a.0.w`, `a.1.w`, `a.2.w`"),
    ("e.{L}.{E}.w.w -> c.{L}.{E}", (1, 2, 14), "checkpoint keys that start like this: `e.0.0.w`, `e.0.1.w`"),
    # no literal text before the first capture, every segment known: no hint at all
    ("{X}.a.w -> c.{X}", (1, 2, 8), None),
])
def test_an_unmatched_pattern_hints_a_segment_or_keys_that_start_like_it(checkpoint, text, span, hint):
    assert _e201(checkpoint, text) == (span, hint)


@pytest.mark.parametrize("text, hint", [
    # a suggestion is a question: the note follows as its own sentence
    ("a.{L}.ww -> c.{L} when config.on",
     "did you mean `w`? Its guard `config.on` holds for this config" + _ON),
    ("a.{L}.v -> c.{L} when config.on",
     "no checkpoint key has a segment `v`; its guard `config.on` holds for this config" + _ON),
    ("a.{L}.w.b -> c.{L} when config.on",
     "checkpoint keys that start like this: `a.0.w`, `a.1.w`, `a.2.w`; its guard `config.on` holds for "
     "this config" + _ON),
    # no hint of its own: the note is the hint, capitalized
    ("{X}.a.w -> c.{X} when config.on", "Its guard `config.on` holds for this config" + _ON),
])
def test_a_guard_that_holds_adds_its_note_to_each_kind_of_hint(checkpoint, text, hint):
    assert _e201(checkpoint, text, {"on": True})[1] == hint


def test_a_guard_over_captures_names_the_binding_it_holds_for(checkpoint):
    """b.{L}.v matches nothing; the guard holds for the bindings a.{L}.w found (L=0 first)."""
    assert _e201(checkpoint, "a.{L}.w, b.{L}.v -> c.{L}, d.{L} when L < 1") == (
        (10, 2, 17), "no checkpoint key has a segment `v`; its guard `L < 1` holds for (L=0)" + _ON)


def test_a_guard_no_binding_satisfies_switches_the_rule_off(checkpoint):
    compiled = _compile(checkpoint, "a.{L}.w, b.{L}.v -> c.{L}, d.{L} when L > 5\n")
    assert compiled.runtime_tensors == () and compiled.bindings == ()


def test_a_guard_a_capture_without_a_value_may_satisfy_keeps_the_rule_on(checkpoint):
    """No source binds both L and E, so each binding lacks one: the guard may hold for (L=0) (E has no value),
    and the rule stays on (E201) rather than being switched off."""
    assert _e201(checkpoint, "a.{L}.w, z.{E}.w -> c.{L}.{E}, d.{L}.{E} when L < 1") == (
        (10, 2, 17), "no checkpoint key has a segment `z`; its guard `L < 1` holds for (L=0)" + _ON)


def test_partial_bindings_a_capture_has_no_value_for_are_reported_despite_a_guard(checkpoint):
    """The guard cannot be decided for (L=None, E=0): it may hold, so that binding is reported too."""
    found = _diagnostics(checkpoint, "a.{L}.w, b.{E}.w -> c.{L}.{E}, d.{L}.{E} when L < 1\n")
    assert [message for _, message, _, _ in found][-1] == (
        "incomplete binding (E=0): found `b.0.w` but not `a.{L}.w`")
    assert len(found) == 5 and {code for code, *_ in found} == {"E204"}


# -- E204: the missing key --

def _e204(checkpoint: Path, text: str) -> list[str]:
    found = _diagnostics(checkpoint, text + "\n")
    assert {(code, span[:2], hint) for code, _, span, hint in found} == {("E204", ("t.remap", 2), _HINT_204)}
    return [message for _, message, _, _ in found]


def test_an_incomplete_binding_names_every_capture_it_has(checkpoint):
    assert _e204(checkpoint, "e.{L}.{E}.w, f.{L}.{E}.w -> c.{L}.{E}, d.{L}.{E}") == [
        "incomplete binding (L=0, E=1): found `e.0.1.w` but not `f.0.1.w`"]


def test_the_missing_key_takes_each_alternatives_part_s_own_choice(checkpoint):
    """Three alternatives parts: the second and third of the missing key choose differently."""
    assert _e204(checkpoint, "n.{L}.{x,y}.{p,q}.{r,s} -> o.{L}.{x,y}.{p,q}.{r,s}") == [
        "incomplete binding (L=0): found `n.0.x.p.r` but not `n.0.x.q.r`"]


@pytest.mark.parametrize("wildcard", ["*", "**"])
def test_a_missing_key_shows_a_wildcard_as_a_star(checkpoint, wildcard):
    assert _e204(checkpoint, f"b.{{L}}.{wildcard}, a.{{L}}.w -> c.{{L}}, d.{{L}}") == [
        "incomplete binding (L=2): found `a.2.w` but not `b.2.*`",
        "incomplete binding (L=3): found `a.3.w` but not `b.3.*`"]


def test_an_incomplete_binding_without_captures_shows_none(checkpoint):
    """Alternatives alone, no capture: the message names no captures, not `()`."""
    assert _e204(checkpoint, "m.0.{up,gate,down} -> c.{up,gate,down}") == [
        "incomplete binding: found `m.0.up` but not `m.0.down`"]


def test_a_guard_over_captures_filters_the_partial_bindings_reported(checkpoint):
    assert _e204(checkpoint, "a.{L}.w, b.{L}.w -> c.{L}, d.{L} when L < 3") == [
        "incomplete binding (L=2): found `a.2.w` but not `b.2.w`"]


# -- a failed rule's keys are taken: no E202 repeats its error --

_REST = "drop m.*.*, e.*.*.w, f.*.*.w, n.0.*.*.*\n"


def test_a_rule_with_incomplete_bindings_takes_its_complete_and_present_keys(checkpoint):
    found = _diagnostics(checkpoint, _REST + "a.{L}.w, b.{L}.w -> c.{L}, d.{L}\n", strict=True)
    assert [(code, message) for code, message, _, _ in found] == [
        ("E204", "incomplete binding (L=2): found `a.2.w` but not `b.2.w`"),
        ("E204", "incomplete binding (L=3): found `a.3.w` but not `b.3.w`")]


def test_a_rule_with_an_unmatched_pattern_takes_the_keys_it_bound(checkpoint):
    found = _diagnostics(checkpoint, _REST + "a.{L}.w, z.{L}.w -> c.{L}, d.{L}\nb.{L}.w -> b.{L}\n",
                         strict=True)
    assert [(code, span) for code, _, span, _ in found] == [("E201", ("t.remap", 3, 10, 3, 17))]


def test_the_keys_left_are_e202_when_strict(checkpoint):
    """The counterpart of the two above: what no rule takes is reported, by name."""
    found = _diagnostics(checkpoint, _REST + "a.{L}.w -> c.{L}\n", strict=True)
    assert found == [("E202", "2 checkpoint tensors taken by no rule: `b.0.w`, `b.1.w`", None,
                      "map them with a rule, name them in a `drop`, or compile with strict=False")]


# -- `quantized`: its errors, and the cut check over every runtime tensor --

_FP8 = "quantized {P:path}.weight, {P}.weight_scale | fp8_tensor()\n"


def _fp8_checkpoint(folder: Path, stray_scale: bool = False) -> Path:
    """q and k: float8 [8, 8] values with one scale each; a float32 norm; optionally a scale alone."""
    values = torch.zeros(8, 8).to(torch.float8_e4m3fn)
    tensors = {"q.weight": values, "q.weight_scale": torch.ones(1), "k.weight": values.clone(),
               "k.weight_scale": torch.ones(1), "norm.weight": torch.ones(8)}
    if stray_scale:
        tensors["z.weight_scale"] = torch.ones(1)
    return tiny_checkpoint(folder, tensors, {})


def test_the_cut_check_reaches_stored_values_moved_after_a_plain_tensor(tmp_path):
    """`norm` (no stored values) is the first runtime tensor; `qk` after it is still checked."""
    found = _diagnostics(_fp8_checkpoint(tmp_path), _FP8 + "norm.weight -> norm\n{q,k}.weight -> qk | concat(dim=0)\n")
    assert found == [("E224", "`qk` joins `k.weight` and `q.weight`, stored with one scale each: one tensor "
                      "cannot keep both scales", ("t.remap", 4, 1, 4, 35),
                      "dequantize them first (`dequantize`), or keep them as separate tensors")]


def test_a_quantized_statement_with_too_few_sources_is_e221(tmp_path):
    assert _diagnostics(_fp8_checkpoint(tmp_path), "quantized {P:path}.weight | fp8_tensor()\n") == [
        ("E221", "`fp8_tensor` takes 2 source tensors (values, scale), the statement names 1",
         ("t.remap", 2, 1, 2, 41), None)]


def test_a_scale_without_its_values_is_e222(tmp_path):
    assert _diagnostics(_fp8_checkpoint(tmp_path, stray_scale=True), _FP8) == [
        ("E222", "`z.weight_scale` has no `values` to scale: {P=z} matches the fp8_tensor parts "
         "`z.weight_scale` but not the first", ("t.remap", 2, 1, 2, 59),
         "a quantized weight needs every part; drop stray scales with `drop`")]


def test_a_quantized_statement_s_guard_that_fails_to_evaluate_is_reported(tmp_path):
    """The guard reads a config key that is missing: E211 at the guard, from the statement's binding."""
    found = _diagnostics(_fp8_checkpoint(tmp_path),
                         "quantized {P:path}.weight, {P}.weight_scale when config.m > 1 | fp8_tensor()\n")
    assert found == [("E211", "`config.m` is not in the config", ("t.remap", 2, 50, 2, 58),
                      "give a default with `??`, or fix config.json")]



def test_a_dequantize_statement_s_guard_that_fails_to_evaluate_is_reported(tmp_path):
    """The same for `dequantize`: E211 at its guard, not an exception from the compiler."""
    found = _diagnostics(_fp8_checkpoint(tmp_path), "dequantize {P:path}.weight, {P}.weight_scale -> {P}.weight "
                         "when config.m > 1 | fp8_tensor(to=bfloat16)\n")
    assert found == [("E211", "`config.m` is not in the config", ("t.remap", 2, 65, 2, 73),
                      "give a default with `??`, or fix config.json")]

# -- the other binding errors: their whole messages and hints --

def test_e202_counts_one_tensor_in_the_singular(checkpoint):
    found = _diagnostics(checkpoint, _REST + "a.{L}.w -> c.{L}\nb.0.w -> b\n", strict=True)
    assert [(code, message) for code, message, _, _ in found] == [
        ("E202", "1 checkpoint tensor taken by no rule: `b.1.w`")]


def test_e202_names_eight_tensors_and_counts_the_rest(checkpoint):
    found = _diagnostics(checkpoint, "drop n.0.*.*.*\n", strict=True)
    assert [(code, message) for code, message, _, _ in found] == [
        ("E202", "12 checkpoint tensors taken by no rule: `a.0.w`, `a.1.w`, `a.2.w`, `a.3.w`, `b.0.w`, `b.1.w`, "
         "`e.0.0.w`, `e.0.1.w` and 4 more")]


def test_an_incomplete_binding_counts_the_other_missing_keys(checkpoint):
    assert _e204(checkpoint, "m.{L}.{up,gate,down} -> c.{L}.{up,gate,down}") == [
        "incomplete binding (L=0): found `m.0.up` but not `m.0.down`",
        "incomplete binding (L=1): found `m.1.up` but not `m.1.gate` (and 1 more)"]


def test_a_runtime_tensor_made_twice_is_e203_naming_the_first_rule(checkpoint):
    assert _diagnostics(checkpoint, "a.{L}.w -> c.{L}\nb.{L}.w -> c.{L}\n") == [
        ("E203", f"runtime tensor `c.{n}` is produced twice", ("t.remap", 3, 1, 3, 17),
         "first by the rule at t.remap:2:1") for n in (0, 1)]


@pytest.mark.parametrize("source, message", [
    ("a", "one binding takes several checkpoint keys: `a.0.w` and `a.1.w` (and 2 more)"),
    ("b", "one binding takes several checkpoint keys: `b.0.w` and `b.1.w`")])
def test_a_wildcard_that_takes_several_keys_is_e208_in_key_order_and_alone(checkpoint, source, message):
    """The first two keys the wildcard took, in key order, and how many more; with strict, the keys
    are not reported again as taken by no rule (E202)."""
    found = _diagnostics(checkpoint, f"{source}.*.w -> x\n", strict=True)
    assert [(code, text) for code, text, _, _ in found if code != "E202" or f"`{source}." in text] == [
        ("E208", message)]
    assert found[0][2:] == (("t.remap", 2, 1, 2, 11), "a wildcard (`*`, `**`) in a rule's sources must not match "
                            "two keys for one target; capture the varying part instead")


def test_an_op_error_names_the_first_three_keys_bound(checkpoint):
    assert _diagnostics(checkpoint, "a.{L}.w -> s | stack(L, dim=0) | chunk(dim=0, n=config.z)\n", {"z": 0}) == [
        ("E207", "`chunk`: `n` must be at least 1, not 0", ("t.remap", 2, 34, 2, 58),
         "while binding `a.0.w`, `a.1.w`, `a.2.w` ...")]
    assert _diagnostics(checkpoint, "b.{L}.w -> s | stack(L, dim=0) | chunk(dim=0, n=config.z)\n", {"z": 0})[0][3] \
        == "while binding `b.0.w`, `b.1.w`"


def test_a_stack_whose_capture_has_a_gap_is_e205(checkpoint):
    assert _diagnostics(checkpoint, "a.{L}.w -> s | stack(L, dim=0, start=1)\n") == [
        ("E205", "`stack(L, ...)` needs L to run from 1 without a gap; found {0-3}", ("t.remap", 2, 16, 2, 40),
         "a checkpoint that holds a slice says `start=`; never re-slotted silently")]


def test_ops_that_leave_more_tensors_than_targets_are_e111(checkpoint):
    assert _diagnostics(checkpoint, "a.{L}.w -> p, q | stack(L, dim=0) | chunk(dim=0, n=config.n)\n", {"n": 4}) == [
        ("E111", "the ops leave 4 tensors for 2 targets", ("t.remap", 2, 1, 2, 61), None)]


# -- drop, keep and `cast DT`: what a Compiled records --

@pytest.fixture(scope="module")
def dtypes(tmp_path_factory) -> Path:
    """a.0.w .. a.2.w float32; n int32; f float8_e4m3fn; h float16; d float64 (each [2])."""
    return tiny_checkpoint(tmp_path_factory.mktemp("dtypes"), {
        "a.0.w": torch.zeros(2), "a.1.w": torch.zeros(2), "a.2.w": torch.zeros(2),
        "n": torch.zeros(2, dtype=torch.int32), "f": torch.zeros(2).to(torch.float8_e4m3fn),
        "h": torch.zeros(2, dtype=torch.float16), "d": torch.zeros(2, dtype=torch.float64)})


def _summary(compiled) -> tuple:
    return ([(t.runtime_key, t.dtype) for t in compiled.runtime_tensors], compiled.dropped,
            [tuple(s[:5]) for s in compiled.unused_drops], compiled.keep)


def test_a_drop_guard_decides_per_capture_value_and_a_drop_that_removes_nothing_is_recorded(dtypes):
    compiled = remapdsl.compile_rules(rules_from_text(
        "remap 1\ndrop a.{L}.w when L >= config.n\ndrop zz, a.0.x\ndrop n, zz\n"
        "a.{L}.w -> a.{L}\nf -> f\nh -> h\nd -> d\n", "t.remap"), dtypes, {"n": 2})
    assert _summary(compiled) == (
        [("a.0", "float32"), ("a.1", "float32"), ("d", "float64"), ("f", "float8_e4m3fn"), ("h", "float16")],
        ("a.2.w", "n"), [("t.remap", 3, 1, 3, 15)], ())


def test_cast_all_casts_floating_tensors_of_16_bits_and_more_unless_the_rule_casts(dtypes):
    """int32 and float8 stay as stored; `d`'s rule casts it itself; `keep` patterns become regexes."""
    compiled = remapdsl.compile_rules(rules_from_text(
        "remap 1\ncast bfloat16\nkeep x.*, y\na.{L}.w -> a.{L}\nn -> n\nf -> f\nh -> h\nd -> d | cast(float32)\n",
        "t.remap"), dtypes, {})
    assert _summary(compiled) == (
        [("a.0", "bfloat16"), ("a.1", "bfloat16"), ("a.2", "bfloat16"), ("d", "float32"), ("f", "float8_e4m3fn"),
         ("h", "bfloat16"), ("n", "int32")], (), [], (r"x\.[^.\n]+", "y"))


@pytest.mark.parametrize("guard", ["not (config.x > 1)", "not (config.x > 1) and config.on",
                                   "not (not (config.x < 1))"])
@pytest.mark.parametrize("ops", ["", " | scale(2)"])
def test_the_note_quotes_the_guard_as_written_and_nothing_after_it(checkpoint, guard, ops):
    """A `not (...)` node's span stops before its `)`: the note still quotes the whole guard, and
    not the ops that follow it on the line."""
    assert _e201(checkpoint, f"a.{{L}}.ww -> c.{{L}} when {guard}{ops}", {"x": 0, "on": True})[1] == (
        f"did you mean `w`? Its guard `{guard}` holds for this config" + _ON)


def test_a_guard_reading_a_capture_inside_a_list_filters_the_bindings(checkpoint):
    """`[L, 1]` reads L: the guard is decided per binding, not once for the config (where L is unknown)."""
    compiled = _compile(checkpoint, "a.{L}.w -> c.{L} when [L, 1] != [3, 1]\n")
    assert [t.runtime_key for t in compiled.runtime_tensors] == ["c.0", "c.1", "c.2"]


def test_each_group_of_alternatives_in_a_target_takes_its_own_choice(tmp_path):
    """Three groups of alternatives: s.a.d.f goes to t.A.D.F (the third group's choice is the
    third, not the second's again), for each of the 8 keys."""
    keys = [f"s.{x}.{y}.{z}" for x in "ab" for y in "cd" for z in "ef"]
    tiny_checkpoint(tmp_path, {k: torch.full((1,), float(i)) for i, k in enumerate(keys)})
    compiled = remapdsl.compile_rules(rules_from_text(
        "remap 1\ns.{a,b}.{c,d}.{e,f} -> t.{A,B}.{C,D}.{E,F}\n", "t.remap"), tmp_path, {})
    assert sorted((d.runtime_key, d.blocks[0].source_key) for d in compiled.runtime_tensors) == sorted(
        ("t." + k[2:].upper(), k) for k in keys)


def test_a_macros_arguments_see_the_config_and_the_lets(checkpoint):
    """`m(n=config.k * H)`: the argument is evaluated with the run's config and the file's lets
    (n = 1 * 2, so a.0.w [4, 2] is reshaped to [2, 4]); the binding keeps the rule's span."""
    text = "let H = 2\nmacro m(n) = reshape([n, -1])\na.0.w -> X | m(n=config.k * H)\n"
    compiled = _compile(checkpoint, text, {"k": 1})
    assert [(t.runtime_key, t.shape) for t in compiled.runtime_tensors] == [("X", (2, 4))]
    (bound,) = compiled.bindings
    assert (bound.rule.path, bound.rule.line, bound.runtime_keys, bound.ckpt_keys) == ("t.remap", 4, ("X",), ("a.0.w",))


def test_an_error_in_a_macros_argument_quotes_its_line(checkpoint):
    text = "let H = 2\nmacro m(n) = reshape([n, -1])\na.0.w -> X | m(n=config.nope * H)\n"
    with pytest.raises(remapdsl.RemapError) as caught:
        _compile(checkpoint, text)
    (d,) = caught.value.diagnostics
    assert (d.code, d.message) == ("E211", "`config.nope` is not in the config")
    assert d.span[1:3] == (4, 18) and d.line_text == "a.0.w -> X | m(n=config.nope * H)"


def test_a_rule_with_ops_groups_its_bindings_by_every_capture(checkpoint):
    """Two captures and an op: each (i, j) is its own group, so each key makes its own tensor;
    stacked over both (two reduced captures), the keys go in (i, j) order."""
    one = _compile(checkpoint, "e.{i}.{j}.w -> E.{i}.{j} | transpose(0, 1)\n")
    assert [(t.runtime_key, t.shape, t.ckpt_keys) for t in one.runtime_tensors] == [
        ("E.0.0", (2, 4), ("e.0.0.w",)), ("E.0.1", (2, 4), ("e.0.1.w",))]
    both = _compile(checkpoint, "{g:seg}.{i}.{j}.w -> S.{g} | stack(j, dim=0) | stack(i, dim=0)\n")
    assert [(t.runtime_key, t.shape, t.ckpt_keys) for t in both.runtime_tensors] == [
        ("S.e", (1, 2, 4, 2), ("e.0.0.w", "e.0.1.w")), ("S.f", (1, 1, 4, 2), ("f.0.0.w",))]


def test_e208_counts_the_keys_past_the_two_it_names(checkpoint):
    """`*.0.*.w` takes three keys for one target: the two first named, then `(and 1 more)`."""
    (found,) = _diagnostics(checkpoint, "*.0.*.w -> X\n")
    assert found[:2] == ("E208", "one binding takes several checkpoint keys: `e.0.0.w` and `e.0.1.w` (and 1 more)")


@pytest.mark.parametrize("guard, more", [("", ""), (" when L < 3", " and 1 more")])
def test_compile_rules_is_strict_by_default_and_e202_shows_eight_keys(checkpoint, guard, more):
    """Eight keys left (or nine: a.3.w too) when the compiler's own compile_rules is called without
    `strict`: E202 names the first eight, and counts only those past them."""
    from remapdsl.compile import compile_rules

    rules = rules_from_text(f"remap 1\ndrop n.**\na.{{L}}.w -> A.{{L}}{guard}\n", "t.remap")
    with pytest.raises(remapdsl.RemapError) as caught:
        compile_rules(rules, remapdsl.open_checkpoint(checkpoint), {})
    (d,) = caught.value.diagnostics
    shown = "`a.3.w`, `b.0.w`, `b.1.w`, `e.0.0.w`, `e.0.1.w`, `f.0.0.w`, `m.0.gate`, `m.0.up`" if guard else \
        "`b.0.w`, `b.1.w`, `e.0.0.w`, `e.0.1.w`, `f.0.0.w`, `m.0.gate`, `m.0.up`, `m.1.up`"
    assert (d.code, d.message) == ("E202", f"{9 if guard else 8} checkpoint tensors taken by no rule: {shown}{more}")


# -- sources: which checkpoint tensors a reshape may read as a flat view --

def test_a_tensor_in_chunks_flattened_keeps_a_block_a_row_and_loads(tmp_path):
    """`a` [6, 4] saved by torch.distributed.checkpoint in two chunks of 3 rows, one a file: its
    bytes are not one run, so a reshape to [24] reads it by its own dims (a block per row, no flat
    view) and loads its elements in order."""
    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    for name, part, offsets in (("shard-00001", a[:3], [0, 0]), ("shard-00002", a[3:].clone(), [3, 0])):
        dcp_chunk(tmp_path, f"{name}-model-00001-of-00001.safetensors", {"a": part}, {"a": offsets})
    inventory = remapdsl.open_checkpoint(tmp_path)
    assert set(inventory.chunks) == {"a"}
    rules = rules_from_text("remap 1\na -> s | reshape([24])\n", "t.remap")
    (s,) = remapdsl.compile_rules(rules, inventory, {}).runtime_tensors
    assert [(b.offsets, b.base, b.view) for b in s.blocks] == [((4 * r,), (r, 0), ()) for r in range(6)]
    state = {"s": torch.zeros(24)}
    remapdsl.load(state, tmp_path, rules, config={})
    assert torch.equal(state["s"], a.reshape(24))
