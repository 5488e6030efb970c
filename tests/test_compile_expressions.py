"""Guards and expressions (remapdsl/compile/evaluate.py): each error's whole diagnostic (message,
span, source line, hint), guards on both sides of their limits, integer arithmetic up to the 64-bit
limits, and values that only a `let` or a capture gives. Rules are compiled against a real
four-layer checkpoint, as a user's would be."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint

import remapdsl
from remapdsl.language import rules_from_text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Layers a.0.w .. a.3.w, each float32 [4, 2], with an empty config."""
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), {f"a.{n}.w": torch.zeros(4, 2) for n in range(4)},
                           {})


def _compile(checkpoint: Path, text: str, config: dict | None = None, strict: bool = True):
    return remapdsl.compile_rules(rules_from_text("remap 1\n" + text, "t.remap"), checkpoint, config or {},
                                  strict=strict)


def _diagnostic(checkpoint: Path, text: str, config: dict | None = None):
    with pytest.raises(remapdsl.RemapError) as info:
        _compile(checkpoint, text, config)
    (d,) = info.value.diagnostics
    return d.code, d.message, tuple(d.span[:5]), d.line_text, d.hint


def _keys(compiled) -> list[str]:
    return [t.runtime_key for t in compiled.runtime_tensors]


def test_a_negative_target_index_names_the_captures_it_reads_and_hints_a_guard(checkpoint):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L - 1}\n") == (
        "E213", "a target key with a negative index: `{L - 1}` is -1 for L=0", ("t.remap", 2, 15, 2, 20),
        "a.{L}.w -> b.{L - 1}",
        "keys count from 0; guard the rule so that it binds only where the index is 0 or more (`when ...`)")


def test_a_negative_constant_index_names_no_captures(checkpoint):
    """`{0 - 1}` reads no capture: the message has no `for ...` part."""
    code, message, *_ = _diagnostic(checkpoint, "a.{L}.w -> b.{L}.{0 - 1}\n")
    assert (code, message) == ("E213", "a target key with a negative index: `{0 - 1}` is -1")


def test_a_missing_nested_config_key_is_e211_with_its_dotted_path_line_and_hint(checkpoint):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L}\n    | scale(config.a.b)\n", {"a": {}}) == (
        "E211", "`config.a.b` is not in the config", ("t.remap", 3, 13, 3, 23), "    | scale(config.a.b)",
        "give a default with `??`, or fix config.json")


def test_a_guard_that_is_no_boolean_shows_its_line_and_a_hint(checkpoint):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L} when config.n\n", {"n": 3}) == (
        "E210", "a `when` guard must be true or false, got 3", ("t.remap", 2, 23, 2, 31),
        "a.{L}.w -> b.{L} when config.n", "compare it, e.g. `when L < config.num_hidden_layers`")


@pytest.mark.parametrize("value, shown", [(True, "True"), ([1, 2], "[1, 2]")])
def test_a_scale_factor_that_is_no_number_is_e210(checkpoint, value, shown):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L}\n    | scale(config.s)\n", {"s": value}) == (
        "E210", f"`factor` must be a number, got {shown}", ("t.remap", 3, 13, 3, 21), "    | scale(config.s)", None)


def test_a_let_that_is_no_dtype_name_is_e210_at_the_cast(checkpoint):
    assert _diagnostic(checkpoint, "let D = config.d\na.{L}.w -> b.{L}\n    | cast(D)\n", {"d": 3}) == (
        "E210", "expected a dtype name, got 3", ("t.remap", 4, 12, 4, 13), "    | cast(D)", None)


@pytest.mark.parametrize("let", ["bfloat16", "config.d"])
def test_a_let_that_names_a_dtype_casts_to_it(checkpoint, let):
    compiled = _compile(checkpoint, f"let D = {let}\na.{{L}}.w -> b.{{L}}\n    | cast(D)\n", {"d": "bfloat16"})
    assert [(t.runtime_key, t.dtype) for t in compiled.runtime_tensors] == [
        (f"b.{n}", "bfloat16") for n in range(4)]


def test_an_ordering_of_a_boolean_is_e210(checkpoint):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L} when config.t < 1\n", {"t": True}) == (
        "E210", "expected a number, got True", ("t.remap", 2, 23, 2, 31), "a.{L}.w -> b.{L} when config.t < 1", None)


def test_not_of_a_number_is_e210(checkpoint):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L} when not config.n\n", {"n": 3}) == (
        "E210", "expected true or false, got 3", ("t.remap", 2, 27, 2, 35), "a.{L}.w -> b.{L} when not config.n",
        None)


def test_not_and_or_read_the_bindings_captures(checkpoint):
    compiled = _compile(checkpoint, "a.{L}.w -> b.{L} when not L == 0 and not L < 2\n"
                                    "a.{L}.w -> c.{L} when L == 0 or L == 1\n")
    assert _keys(compiled) == ["b.2", "b.3", "c.0", "c.1"]


@pytest.mark.parametrize("op, taken", [("<", [0, 1]), ("<=", [0, 1, 2]), (">", [3]), (">=", [2, 3]),
                                       ("==", [2]), ("!=", [0, 1, 3])])
def test_a_guard_binds_exactly_the_layers_on_its_side_of_the_limit(checkpoint, op, taken):
    """The limit is a config value, as in `when L < config.first_k_dense_replace`."""
    compiled = _compile(checkpoint, f"a.{{L}}.w -> b.{{L}} when L {op} config.k\n", {"k": 2}, strict=False)
    assert _keys(compiled) == [f"b.{n}" for n in taken]


@pytest.mark.parametrize("expr, value", [("L + 2", [2, 3, 4, 5]), ("7 - L", [7, 6, 5, 4]), ("L * 3", [0, 3, 6, 9]),
                                         ("L // 2", None), ("L % 3", None)])
def test_integer_arithmetic_in_a_target_key(checkpoint, expr, value):
    if value is None:  # several layers land on one key: name them apart with a second part
        compiled = _compile(checkpoint, f"a.{{L}}.w -> b.{{{expr}}}.{{L}}\n")
        python = {"L // 2": lambda n: n // 2, "L % 3": lambda n: n % 3}[expr]
        assert sorted(_keys(compiled)) == sorted(f"b.{python(n)}.{n}" for n in range(4))
    else:
        assert sorted(_keys(_compile(checkpoint, f"a.{{L}}.w -> b.{{{expr}}}\n"))) == sorted(f"b.{v}" for v in value)


@pytest.mark.parametrize("n, shown", [(10**23, "100000000000000000000000"), (10**24, "10000000\u2026 (25 digits)")])
def test_a_config_integer_past_64_bits_is_e209_shown_whole_up_to_24_digits(checkpoint, n, shown):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L}\n    | scale(config.n)\n", {"n": n}) == (
        "E209", f"`config.n` is {shown}, outside the 64-bit integer range", ("t.remap", 3, 13, 3, 21),
        "    | scale(config.n)", "integers are 64-bit, from -2^63 to 2^63 - 1; check the config values it reads")


def test_an_integer_argument_that_is_a_boolean_is_e210(checkpoint):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L}\n    | pad(dim=0, to=config.n)\n", {"n": True}) == (
        "E210", "`to` must be an integer, got True", ("t.remap", 3, 21, 3, 29), "    | pad(dim=0, to=config.n)", None)


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Path:
    """x.I.J.w for I, J in 0..1, each float32 [4, 2]: keys with two captures."""
    return tiny_checkpoint(tmp_path_factory.mktemp("grid"),
                           {f"x.{i}.{j}.w": torch.zeros(4, 2) for i in range(2) for j in range(2)}, {})


def test_a_negative_target_index_lists_every_capture_it_reads(grid):
    code, message, span, *_ = _diagnostic(grid, "x.{I}.{J}.w -> y.{I - J - 1}.{J}.{I}\n")
    assert (code, message, span) == ("E213", "a target key with a negative index: `{I - J - 1}` is -1 for I=0, J=0",
                                     ("t.remap", 2, 19, 2, 28))


@pytest.mark.parametrize("value, shown", [(8, "8"), ([8, True], "[8, True]"), ([8, 1.0], "[8, 1.0]")])
def test_a_shape_that_is_no_list_of_integers_is_e210(grid, value, shown):
    assert _diagnostic(grid, "x.{I}.{J}.w -> y.{I}.{J}\n    | reshape(config.s)\n", {"s": value}) == (
        "E210", f"`shape` must be a list of integers, got {shown}", ("t.remap", 3, 15, 3, 23),
        "    | reshape(config.s)", None)


def test_a_shape_from_the_config_reshapes(grid):
    compiled = _compile(grid, "x.{I}.{J}.w -> y.{I}.{J}\n    | reshape(config.s)\n", {"s": [8]})
    assert [(t.runtime_key, t.shape) for t in compiled.runtime_tensors] == [
        (f"y.{i}.{j}", (8,)) for i in range(2) for j in range(2)]


def test_a_null_config_key_is_e211_saying_it_is_null(checkpoint):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L}\n    | scale(config.a.b)\n", {"a": {"b": None}}) == (
        "E211", "`config.a.b` is null in the config", ("t.remap", 3, 13, 3, 23), "    | scale(config.a.b)",
        "give a default with `??`, or fix config.json")


@pytest.mark.parametrize("value, kind", [("big", "str"), ({"x": 1}, "dict")])
def test_a_config_value_of_no_rule_kind_is_e210_naming_its_type(checkpoint, value, kind):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L}\n    | scale(config.a.b)\n", {"a": {"b": value}}) == (
        "E210", f"`config.a.b` is {kind}, not a number, a boolean, a list or a dtype name", ("t.remap", 3, 13, 3, 23),
        "    | scale(config.a.b)", None)


@pytest.mark.parametrize("expr, config, keys", [
    ("(config.off ?? 0) + L", {}, [0, 1, 2, 3]), ("(config.off ?? 0) + L", {"off": 5}, [5, 6, 7, 8]),
    ("config.off ?? L", {}, [0, 1, 2, 3]), ("L ?? 9", {}, [0, 1, 2, 3]), ("-L + 3", {}, [3, 2, 1, 0]),
])
def test_coalesce_and_negation_read_the_bindings_captures(checkpoint, expr, config, keys):
    compiled = _compile(checkpoint, f"a.{{L}}.w -> b.{{{expr}}}\n", config)
    assert sorted(_keys(compiled)) == sorted(f"b.{k}" for k in keys)


def test_a_comparison_reads_captures_on_its_right_side_too(checkpoint):
    compiled = _compile(checkpoint, "a.{L}.w -> b.{L} when 1 <= L\na.{L}.w -> c.{L} when 1 > L\n")
    assert _keys(compiled) == ["b.1", "b.2", "b.3", "c.0"]


def test_an_ordering_with_a_boolean_on_the_right_points_at_it(checkpoint):
    assert _diagnostic(checkpoint, "a.{L}.w -> b.{L} when 1 < config.t\n", {"t": True}) == (
        "E210", "expected a number, got True", ("t.remap", 2, 27, 2, 35), "a.{L}.w -> b.{L} when 1 < config.t", None)


@pytest.mark.parametrize("n", [2**63 - 1, -2**63])
def test_the_64_bit_limits_themselves_are_in_range(checkpoint, n):
    compiled = _compile(checkpoint, "a.{L}.w -> b.{L}\n    | scale(config.n)\n", {"n": n})
    assert [s for b in compiled.runtime_tensor("b.0").blocks for s in b.steps] == [("scale", float(n))]


@pytest.mark.parametrize("n", [2**63, -2**63 - 1])
def test_one_past_the_64_bit_limits_is_e209_naming_the_dotted_key(checkpoint, n):
    code, message, *_ = _diagnostic(checkpoint, "a.{L}.w -> b.{L}\n    | scale(config.a.n)\n", {"a": {"n": n}})
    assert (code, message) == ("E209", f"`config.a.n` is {n}, outside the 64-bit integer range")


def test_a_tuple_in_a_python_config_is_a_list(checkpoint):
    compiled = _compile(checkpoint, "a.{L}.w -> b.{L}\n    | reshape(config.s)\n", {"s": (8,)})
    assert compiled.runtime_tensor("b.0").shape == (8,)


@pytest.mark.parametrize("op", ["//", "%"])
def test_integer_division_by_a_config_zero_is_e210_at_the_operation(checkpoint, op):
    text = f"a.{{L}}.w -> b.{{L {op} config.d}}.{{L}}\n"
    code, message, span, line, hint = _diagnostic(checkpoint, text, {"d": 0})
    assert (code, message, span[1:3], line, hint) == ("E210", "division by zero", (2, 15), text.rstrip("\n"), None)
    assert sorted(_keys(_compile(checkpoint, text, {"d": 1}))) == [f"b.{0 if op == '%' else n}.{n}" for n in range(4)]


@pytest.mark.parametrize("expr, n, fits", [("config.n + 1", 2**63 - 2, True), ("config.n + 1", 2**63 - 1, False),
                                           ("config.n - 1", -2**63 + 1, True), ("config.n - 1", -2**63, False)])
def test_arithmetic_may_reach_the_64_bit_limits_but_not_pass_them(checkpoint, expr, n, fits):
    text = f"a.{{L}}.w -> b.{{L}}\n    | scale({expr})\n"
    if fits:
        steps = [s for b in _compile(checkpoint, text, {"n": n}).runtime_tensor("b.0").blocks for s in b.steps]
        assert steps == [("scale", float(n + (1 if "+" in expr else -1)))]
    else:
        code, message, *_ = _diagnostic(checkpoint, text, {"n": n})
        result = n + 1 if "+" in expr else n - 1
        assert (code, message) == ("E209", f"`{expr}` is {result}, outside the 64-bit integer range")
