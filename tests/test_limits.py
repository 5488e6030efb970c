"""Hostile rule files: what a file may ask for is bounded (docs/errors.md, "Limits"), constant
expressions are evaluated by the static checks, and every message stays readable however long
the input."""

import time

import pytest

from remapdsl import RemapError, RuleCheckError
from remapdsl.errors import MAX_QUOTED, MAX_SHOWN, MAX_TEXT, MAX_WINDOW, Diagnostic, Span
from remapdsl.language import rules_from_text
from remapdsl.language.limits import MAX_OPS, MAX_PIECES, MAX_SIZE


def check_error(text: str) -> RuleCheckError:
    with pytest.raises(RuleCheckError) as info:
        rules_from_text(text, "t.remap")
    return info.value


def codes(error: RemapError) -> list[tuple[str, int, int]]:
    return [(d.code, d.span.line, d.span.column) for d in error.diagnostics]


# -- class 2: bounds on what a file asks for --


def test_exponential_macros_are_refused_at_the_first_macro_past_the_limit_and_fast():
    lines = ["macro m0() = transpose(0, 1) | transpose(0, 1)"]
    lines += [f"macro m{i}() = m{i - 1}() | m{i - 1}()" for i in range(1, 40)]
    lines += ["a.w -> b.w | m39()"]
    started = time.perf_counter()
    error = check_error("\n".join(lines) + "\n")
    assert time.perf_counter() - started < 2
    assert codes(error) == [("E136", 9, 1)]  # m8 = 512 ops; the macros and the rule after it are not repeated
    assert "`m8` expands to 512 ops" in error.diagnostic.message


def test_a_macro_past_the_limit_through_many_calls_of_a_large_one_is_refused_unexpanded():
    """50,000 calls of a 200-op macro (10 million ops, a 1 MB file): E136 once, at the macro, without the
    body being expanded call by call (20 s before)."""
    body = " | ".join(["transpose(0, 1)"] * 200)
    text = f"macro a() = {body}\nmacro b() = " + " | ".join(["a()"] * 50_000) + "\nx -> y | b()\n"
    started = time.perf_counter()
    error = check_error(text)
    assert time.perf_counter() - started < 10
    assert codes(error) == [("E136", 2, 1)]
    assert "`b` expands to 10,000,000 ops" in error.diagnostic.message


def test_a_rule_past_the_limit_through_macros_that_are_each_within_it():
    half = " | ".join(["transpose(0, 1)"] * (MAX_OPS // 2))
    error = check_error(f"macro half() = {half}\na.w -> b.w | half() | half() | transpose(0, 1)\n")
    assert codes(error) == [("E136", 2, 1)]
    assert f"{MAX_OPS + 1} ops" in error.diagnostic.message
    rules_from_text(f"macro half() = {half}\na.w -> b.w | half() | half()\n")  # exactly the limit


@pytest.mark.parametrize("text, column", [
    ("a -> b | pad(dim=0, to=99999999999999999999999999)\n", 24),
    ("a -> b | pad(dim=0, to=300000000000000)\n", 24),
    ("a -> b | repeat(dim=0, times=65537)\n", 30),
    ("a -> b | reshape([-1, 300000000000000])\n", 23),
    ("a -> b.{x,y} | split(dim=0, sizes=[1, 300000000000000])\n", 39),
    ("let T = 65536 * 2\na.{q,k} -> b | interleave(dim=0, groups=T)\n", 41),
    ("let B = 9223372036854775807\nlet C = B + 1\n", 9),
])
def test_sizes_and_counts_beyond_the_limits_are_static_errors(text, column):
    error = check_error(text)
    assert [(d.code, d.span.column) for d in error.diagnostics] == [("E129", column)]


def test_a_macro_argument_beyond_the_limits_is_reported_at_the_call():
    error = check_error("macro grow(n) = pad(dim=0, to=n)\na -> b | grow(n=300000000000000)\n")
    assert codes(error) == [("E129", 2, 10)]
    assert error.diagnostic.message.endswith("(in macro `grow`)")


def test_the_largest_allowed_values_pass():
    rules = rules_from_text(f"a -> b | pad(dim=0, to={MAX_SIZE}) | repeat(dim=0, times={MAX_PIECES})\n"
                            "let M = -9223372036854775807 - 1\n")
    pad, repeat = rules.statements[0].ops
    assert (pad.to.value, repeat.times.value) == (MAX_SIZE, MAX_PIECES)
    with pytest.raises(RemapError) as info:  # and one more is refused
        rules_from_text(f"a -> b | pad(dim=0, to={MAX_SIZE + 1})\n")
    assert info.value.diagnostics[0].code == "E129"


# -- class 3: constant expressions --


@pytest.mark.parametrize("text, code, line, column", [
    ("let A = 4\nlet B = 8 // (A - 4)\n", "E127", 2, 15),
    ("let A = 4 % (2 * 0)\n", "E127", 1, 14),
    ("let A = [1, 2] < 3\n", "E126", 1, 9),
    ("let A = not 3\n", "E126", 1, 13),
    ("let A = true and 1\n", "E126", 1, 18),
    ("let A = -true\n", "E126", 1, 10),
    ("let A = 1e308 * 10.0\n", "E129", 1, 9),
    ("a -> b when 1 // (1 - 1) == 0\n", "E127", 1, 19),
    ("a -> b | pad(dim=0, to=4 // (2 - 2))\n", "E127", 1, 30),
])
def test_constant_expressions_that_fail_are_static_errors(text, code, line, column):
    assert codes(check_error(text)) == [(code, line, column)]


def test_conditional_parts_and_config_reads_are_not_constant():
    rules_from_text("let A = config.heads ?? 1 // 0 + 1\n".replace("1 // 0", "(1 // (1 - 1))"))
    rules_from_text("let A = config.flag and 1 // (1 - 1) == 0\nlet B = false and not 3\n")
    rules_from_text("let H = config.hidden_size\nlet D = H // (H - H)\n")  # depends on the config
    rules_from_text("let A = 0\nlet B = A == 0 or 1 // A == 0\n")  # short-circuit, as at load


def test_a_literal_zero_divisor_is_reported_once():
    assert codes(check_error("let A = 1 // 0\n")) == [("E127", 1, 14)]


# -- class 4: messages stay readable --


def test_a_huge_line_is_shown_as_a_window_around_the_span():
    text = "model." + "layers." * 150_000 + "w -> out.{L}\n"  # a 1,050,015-character line
    error = check_error(text)
    assert error.diagnostic.code == "E101"
    rendered = str(error)
    assert len(rendered) < 1000
    source, carets = rendered.split("\n")[1:3]
    assert source.startswith("  1 | \u2026") and source.endswith("out.{L}")
    assert carets.index("^") == source.index("L}") and carets.count("^") == 1


def test_a_window_keeps_carets_under_the_span_at_the_start_and_the_end():
    line = "x" * 1000
    start = Diagnostic(code="E001", message="m", span=Span("p", 1, 3, 1, 5), line_text=line)
    source, carets = start.render().split("\n")[1:3]
    assert source.endswith("\u2026") and len(source) == len("  1 | ") + MAX_WINDOW + 1
    assert carets == "    |   ^^"
    end = Diagnostic(code="E001", message="m", span=Span("p", 1, 999, 1, 1001), line_text=line)
    source, carets = end.render().split("\n")[1:3]
    assert source.startswith("  1 | \u2026") and not source.endswith("\u2026")
    assert carets.endswith("^^") and len(carets) == len(source)


def test_quoted_names_messages_and_hints_are_bounded():
    name = "n" * 100_000
    error = check_error(f"let A = {name}\n")
    message = error.diagnostic.message
    assert len(message) < MAX_QUOTED + 40 and "\u2026" in message
    long = Diagnostic(code="E001", message="x " * 10_000, hint="y" * 10_000, path="p" * 10_000)
    assert len(long.message) == len(long.hint) == MAX_TEXT and len(long.path) == MAX_QUOTED


def test_the_number_of_diagnostics_shown_is_capped():
    error = check_error("".join(f"let A{i} = B{i}\n" for i in range(500)))
    assert len(error.diagnostics) == 500
    assert str(error).count("error[E130]") == MAX_SHOWN
    assert str(error).endswith(f"\u2026 and {500 - MAX_SHOWN} more errors")


def test_a_macro_calls_the_macros_defined_above_it_even_when_a_later_one_takes_the_name():
    """`m30` names `m29` before it is defined (E134): a later `m29` of 2^29 ops is not what it calls,
    so the expansion stays bounded."""
    lines = ["macro m0() = transpose(0, 1) | transpose(0, 1)"]
    lines += [f"macro m{i}() = m{i - 1}() | m{i - 1}()" for i in range(1, 8)]
    lines += ["macro late() = big() | big()", "macro big() = m7() | m7() | m7()", "a -> b | late() | late()"]
    started = time.perf_counter()
    error = check_error("\n".join(lines) + "\n")
    assert time.perf_counter() - started < 2
    assert [d.code for d in error.diagnostics] == ["E134", "E134", "E136"]  # big() unknown in late; big is 768


def test_check_reports_the_limits_before_any_work(capsys, monkeypatch):
    """`remapdsl check` on the exponential macros and the int64 pad: located errors, exit 2, fast."""
    from pathlib import Path

    from remapdsl.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    started = time.perf_counter()
    assert main(["check", "tests/corpus/errors/100_macro_exponential.remap",
                 "tests/corpus/errors/101_pad_beyond_int64.remap"]) == 2
    assert time.perf_counter() - started < 5
    err = capsys.readouterr().err
    assert "100_macro_exponential.remap:14:1: error[E136]" in err
    assert "101_pad_beyond_int64.remap:6:21: error[E129]" in err


@pytest.mark.parametrize("ops, column, what", [
    ("repeat(dim=0, times=40000) | repeat(dim=1, times=40000)", 39, "repeat 40000 times"),
    ("transpose(0, 1) | reshape([2200000])", 28, "merging dims 0 and 1 (a piece per row)"),
])
def test_ops_that_would_describe_a_tensor_by_too_many_blocks_are_e209_and_fast(tmp_path, ops, column, what):
    """Each count is within 2^16 and each size within 2^48, but the blocks one tensor would need
    pass 2^20: refused before they are built (chained repeats used to take minutes and gigabytes)."""
    import torch
    from safetensors.torch import save_file

    import remapdsl

    wide = ops.startswith("transpose")  # 1.1 M rows once transposed, each a piece of the merge
    save_file({"w": torch.zeros((2, 1_100_000) if wide else (4, 2), dtype=torch.int8)}, str(tmp_path / "model.safetensors"))
    start = time.perf_counter()
    with pytest.raises(RemapError) as info:
        remapdsl.compile_rules(rules_from_text(f"remap 1\nw -> s | {ops}\n", "t.remap"), tmp_path, {})
    (d,) = info.value.diagnostics
    assert d.code == "E209" and (d.span.line, d.span.column) == (2, column) and time.perf_counter() - start < 5
    assert f"{what} would describe one tensor by " in d.message and "more than 2^20 = 1048576" in d.message
