"""parse(format(ir)) == ir, format idempotence, and comments kept across `fmt`."""

from __future__ import annotations

from pathlib import Path

import pytest
from depth import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from remapdsl.errors import RemapError
from remapdsl.language import ir
from remapdsl.language.formatter import format_rules
from remapdsl.language.parser import parse_file, parse_text

try:
    from tests import strategies as S
except ImportError:  # tests/ on sys.path (rootdir-relative import mode)
    import strategies as S

# Hypothesis warns when a failing example's repr is huge; that is noise here, not a problem.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

ROOT = Path(__file__).resolve().parent.parent
PATH = "<generated>"

_SETTINGS = settings(max_examples=scaled(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def roundtrip(rules: ir.RuleFile) -> ir.RuleFile:
    return parse_text(format_rules(rules), rules.path)


def all_trivia(rules: ir.RuleFile) -> list:
    """Every comment and blank line of a file, in order, with the node kind that owns it."""
    out: list = []
    for statement in rules.statements:
        out.append((statement.kind, statement.trivia))
        ops = ((statement.format,) if isinstance(statement, (ir.Dequantize, ir.Quantized))
               else getattr(statement, "ops", ()))
        out.extend((op.kind, op.trivia) for op in ops)
    out.append(("file", rules.trailing))
    return out


# ---- properties on generated IR ------------------------------------------------------------


@_SETTINGS
@given(S.rule_files())
def test_parse_format_roundtrip(rules):
    text = format_rules(rules)
    assert parse_text(text, rules.path) == rules, text


@_SETTINGS
@given(S.rule_files())
def test_format_idempotent_and_keeps_trivia(rules):
    text = format_rules(rules)
    again = parse_text(text, rules.path)
    assert format_rules(again) == text
    assert all_trivia(again) == all_trivia(rules), text


@settings(max_examples=scaled(150), deadline=None)
@given(S.exprs)
def test_expression_roundtrip(expr):
    rules = ir.RuleFile(path=PATH, statements=(ir.Let(name="x", value=expr),))
    assert roundtrip(rules) == rules, format_rules(rules)


@pytest.mark.parametrize("cls", [*ir.BUILTIN_OPS, ir.MacroCall], ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_op_roundtrips(cls, data):
    op = data.draw(S.macro_calls() if cls is ir.MacroCall else S.builtin_ops(cls))
    source = ir.Pattern(parts=(ir.Text(text="a"),))
    statement = ir.Rule(sources=(source,), targets=(source,), ops=(op, op))
    macro = ir.Macro(name="m", ops=(op, op))
    rules = ir.RuleFile(path=PATH, statements=(statement, macro))
    assert roundtrip(rules) == rules, format_rules(rules)


@pytest.mark.parametrize("strategy", ["lets", "rules", "drops_and_keeps", "dequantizes", "quantizeds", "includes",
                                      "macros", "casts", "prefixes", "prefixed_rules",
                                      "versions"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_every_statement_kind_roundtrips(strategy, data):
    value = getattr(S, strategy)
    statement = data.draw(value if isinstance(value, st.SearchStrategy) else value())
    statement = statement.model_copy(update={"trivia": ir.NO_TRIVIA})
    rules = ir.RuleFile(path=PATH, statements=(statement,))
    assert roundtrip(rules) == rules, format_rules(rules)


# ---- known gaps: valid IR that the formatter cannot write back -------------------------------
# The concrete syntax cannot say everything a free-form tree could: names spelled like keywords,
# key text that reads as a keyword or a number. The IR refuses those at construction, so that
# every IR value is one `fmt` can write. Each case below either round-trips or is refused.


def _text(text: str) -> ir.Pattern:
    return ir.Pattern(parts=(ir.Text(text=text),))


def _rule(*, sources=None, targets=None, **fields) -> ir.Rule:
    return ir.Rule(sources=sources or (_text("a"),), targets=targets or (_text("b"),), **fields)


def _name(name: str) -> ir.Name:
    return ir.Name(id=name)


def assert_roundtrips(*statements: ir.Statement) -> None:
    rules = ir.RuleFile(path=PATH, statements=statements)
    text = format_rules(rules)
    try:
        again = parse_text(text, PATH)
    except RemapError as exc:
        pytest.fail(f"formatted IR does not parse:\n{text}\n{exc}")
    assert again == rules, text


def assert_refused(build) -> None:
    with pytest.raises(ValidationError):
        build()


@pytest.mark.parametrize("word", ["remap", "drop", "otherwise", "when", "true"])
@pytest.mark.parametrize("where", ["let name", "expression", "capture argument", "macro name",
                                   "macro parameter", "macro argument name"])
def test_name_spelled_like_a_keyword_is_refused(word, where):
    assert_refused({
        "let name": lambda: ir.Let(name=word, value=ir.Int(value=1)),
        "expression": lambda: ir.Let(name="x", value=_name(word)),
        "capture argument": lambda: _rule(ops=(ir.Concat(capture=word, dim=ir.Int(value=0)),)),
        "macro name": lambda: ir.Macro(name=word, ops=(ir.Cast(dtype=_name("x")),)),
        "macro parameter": lambda: ir.Macro(name="m", params=(word,), ops=(ir.Cast(dtype=_name("x")),)),
        "macro argument name": lambda: _rule(ops=(ir.MacroCall(
            name="m", args=(ir.Arg(name=word, value=ir.Int(value=1)),)),)),
    }[where])


@pytest.mark.parametrize("parts", [
    (ir.Text(text="when"),), (ir.Text(text="true"),), (ir.Text(text="drop"),),
    (ir.Subst(expr=_name("L")), ir.Text(text="drop")),
    (ir.Subst(expr=_name("L")), ir.Text(text="and")),
    (ir.Subst(expr=_name("L")), ir.Text(text="otherwise")),
    (ir.Text(text="1e5"),), (ir.Text(text="model."), ir.Subst(expr=_name("P")), ir.Text(text="2E3")),
    (ir.Subst(expr=ir.Bool(value=True)),),
], ids=["when", "true", "drop", "{L}drop", "{L}and", "{L}otherwise", "1e5", "model.{P}2E3", "{true}"])
def test_key_text_the_syntax_cannot_write_is_refused(parts):
    assert_refused(lambda: _rule(targets=(ir.Pattern(parts=parts),)))


@pytest.mark.parametrize("parts", [
    (ir.Text(text="1.5e3.x"),),
    (ir.Text(text="a."), ir.Capture(name="L"), ir.Text(text="2E3.w")),
    (ir.Text(text="model."), ir.Star(), ir.Text(text="1e5.x")),
], ids=["1.5e3.x", "a.{L}2E3.w", "model.*1e5.x"])
def test_key_text_starting_like_a_number_roundtrips(parts):
    assert_roundtrips(_rule(sources=(ir.Pattern(parts=parts),),
                            targets=(_text("b"),) if not any(isinstance(p, ir.Capture) for p in parts)
                            else (ir.Pattern(parts=(ir.Text(text="b."), ir.Subst(expr=_name("L")))),)))


def test_parenthesized_comparison_left_of_a_comparison():
    inner = ir.Compare(op="<", left=_name("a"), right=_name("b"))
    assert_roundtrips(ir.Let(name="x", value=ir.Compare(op="==", left=inner, right=_name("c"))))


def test_parenthesized_comparison_right_of_a_comparison():
    inner = ir.Compare(op="<", left=_name("b"), right=_name("c"))
    assert_roundtrips(ir.Let(name="x", value=ir.Compare(op="==", left=_name("a"), right=inner)))


def test_chained_comparison_without_parentheses_is_an_error():
    with pytest.raises(RemapError) as info:
        parse_text("let x = a < b < c\n")
    assert info.value.diagnostic.code == "E039"


@pytest.mark.parametrize("op", ["+", "*"])
def test_not_not_binds_looser_than_arithmetic(op):
    value = ir.Not(operand=ir.Not(operand=ir.BinOp(op=op, left=_name("a"), right=_name("b"))))
    assert_roundtrips(ir.Let(name="x", value=value))
    assert parse_text(f"let x = not not a {op} b").statements[0].value == value


@pytest.mark.parametrize("text", [
    "a.when -> x", "x -> a.when", "drop a.when", "{L}when.x -> y", "x -> a.and.not.true.config",
    "{true,x} -> y.{not,false}", "{config,x} -> y", "{1.5,x} -> y", "{1e5,x} -> y", "a.1.5.1e5 -> b",
    "drop.weight -> x", "remap.x, let.y -> y", "x -> {L}let.x", "x -> drop{L}", "x.*1.5 -> y",
    "let v = config.when.true.1.5", "let v = a == (b < c)", "let v = not not a and b",
    "x -> {not x}.{-1}", "a -> b | m(when_=1)",
])
def test_keyword_and_number_like_keys_that_do_roundtrip(text):
    """Neighbours of the gaps above that work, so that a fix does not break them."""
    rules = parse_text(text)
    assert format_rules(rules) == text + "\n"
    assert parse_text(format_rules(rules)) == rules


_UNWRITABLE = {
    "capture arg is a keyword": lambda: _rule(ops=(ir.Concat(capture="when", dim=ir.Int(value=0)),)),
    "capture arg is not a name": lambda: _rule(ops=(ir.Concat(capture="a b", dim=ir.Int(value=0)),)),
    "macro arg name is a keyword": lambda: _rule(ops=(ir.MacroCall(
        name="m", args=(ir.Arg(name="true", value=ir.Int(value=1)),)),)),
    "macro arg name is not a name": lambda: _rule(ops=(ir.MacroCall(
        name="m", args=(ir.Arg(name="a-b", value=ir.Int(value=1)),)),)),
    "macro call named like a built-in op": lambda: _rule(ops=(ir.MacroCall(
        name="cast", args=(ir.Arg(value=ir.Name(id="x")),)),)),
    "include path with a quote": lambda: ir.Include(path='a"b'),
    "include path with a newline": lambda: ir.Include(path="a\nb"),
    "blank include path": lambda: ir.Include(path=" "),
    "unknown version": lambda: ir.Version(number=2),
    "format op in a rule": lambda: _rule(ops=(ir.FormatCall(
        name="fp8_tensor", args=(ir.Arg(name="to", value=ir.Name(id="bfloat16")),)),)),
    "layout op as a dequantize format": lambda: ir.Dequantize(
        sources=(_text("a"),), target=_text("b"), format=ir.Cast(dtype=ir.Name(id="x"))),
    "subst in a source": lambda: _rule(sources=(ir.Pattern(parts=(ir.Subst(expr=ir.Name(id="L")),)),)),
    "capture in a target": lambda: _rule(targets=(ir.Pattern(parts=(ir.Capture(name="L"),)),)),
    "star in a target": lambda: _rule(targets=(ir.Pattern(parts=(ir.Star(),)),)),
    "one capture with two types": lambda: _rule(sources=(
        ir.Pattern(parts=(ir.Capture(name="L"), ir.Text(text=".x"))),
        ir.Pattern(parts=(ir.Capture(name="L", type="seg"), ir.Text(text=".y"))))),
    "version not first": lambda: (ir.Let(name="x", value=ir.Int(value=1)), ir.Version(number=1)),
}


@pytest.mark.parametrize("case", list(_UNWRITABLE))
def test_ir_that_fmt_cannot_write_is_refused(case):
    """Every IR value the validators accept is one `fmt` can write: parse(format(ir)) == ir."""
    def build():
        built = _UNWRITABLE[case]()
        statements = built if isinstance(built, tuple) else (built,)
        ir.RuleFile(path=PATH, statements=statements)
    assert_refused(build)


# ---- comments and layout on hand-written files -------------------------------------------------


def fmt(text: str) -> str:
    return format_rules(parse_text(text))


def test_comments_above_statements_are_kept():
    text = "# header\n# two lines\nremap 1\n# about H\nlet H = config.hidden_size\n"
    assert fmt(text) == text
    rules = parse_text(text)
    assert rules.statements[0].trivia.leading == ("# header", "# two lines")
    assert rules.statements[1].trivia.leading == ("# about H",)


def test_trailing_comments_are_kept():
    text = ('remap 1  # version\nlet H = 4  # hidden\ninclude "a#b.remap"  # not a comment: "#b"\n'
            "a -> b | cast(bfloat16)  # inline op\n")
    rules = parse_text(text)
    assert [s.trivia.trailing for s in rules.statements] == [
        "# version", "# hidden", '# not a comment: "#b"', "# inline op"]
    assert rules.statements[2].path == "a#b.remap"
    assert fmt(text) == text


def test_trailing_comment_spacing_is_canonical():
    assert fmt("let H = 4 # a   \nlet D = 2\t\t#b\n") == "let H = 4  # a\nlet D = 2  #b\n"


def test_comments_between_pipe_lines():
    text = ("a.{q,k,v}.w -> b.w  # fused\n"
            "    # cut per head\n"
            "    | interleave(dim=0, groups=KV)  # groups\n"
            "    # then cast\n"
            "    # really\n"
            "    | cast(bfloat16)\n")
    rules = parse_text(text)
    rule = rules.statements[0]
    assert rule.trivia.trailing == "# fused"
    assert rule.ops[0].trivia == ir.Trivia(leading=("# cut per head",), trailing="# groups")
    assert rule.ops[1].trivia == ir.Trivia(leading=("# then cast", "# really"))
    assert fmt(text) == text


def test_blank_and_comment_lines_between_pipe_lines_are_allowed():
    text = "a -> b\n\n  # c\n\n\t| cast(x)\n\n| add(1)\n"
    assert fmt(text) == "a -> b\n    # c\n    | cast(x)\n    | add(1)\n"


def test_single_commented_op_stays_on_its_own_line():
    text = "a -> b\n    | cast(x)  # why\n"
    assert fmt(text) == text
    assert fmt("dequantize a -> b\n    # fmt\n    | mxfp4(to=bfloat16)\n") == (
        "dequantize a -> b\n    # fmt\n    | mxfp4(to=bfloat16)\n")


def test_blank_lines_collapse():
    text = "\n\n\n# top\n\n\n\nlet a = 1\n\n\n\nlet b = 2\nlet c = 3\n\n\n# end\n\n\n"
    assert fmt(text) == "# top\n\nlet a = 1\n\nlet b = 2\nlet c = 3\n\n# end\n"
    assert fmt("\n\n\n") == ""
    assert fmt("") == ""
    assert fmt("\n\n# only\n\n") == "# only\n"


def test_comments_after_the_last_statement_belong_to_the_file():
    rules = parse_text("let a = 1\n# one\n\n# two\n")
    assert rules.trailing == ("# one", "", "# two")
    assert fmt("let a = 1\n# one\n\n# two\n") == "let a = 1\n# one\n\n# two\n"


def test_crlf_input_is_read_as_lf():
    lf = "# c\nremap 1\n\nlet H = 4  # h\na -> b\n    # op\n    | cast(x)\n"
    crlf = lf.replace("\n", "\r\n")
    assert parse_text(crlf) == parse_text(lf)
    assert all_trivia(parse_text(crlf)) == all_trivia(parse_text(lf))
    assert fmt(crlf) == lf


def test_lone_cr_is_an_error():
    with pytest.raises(RemapError) as info:
        parse_text("let a = 1\rlet b = 2\n")
    span = info.value.diagnostic.span
    assert (span.line, span.column) == (1, 10)


def test_byte_order_mark_is_dropped(tmp_path):
    text = "# c\nremap 1\n"
    assert fmt("\ufeff" + text) == text
    assert parse_text("\ufeff" + text) == parse_text(text)
    path = tmp_path / "bom.remap"
    path.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    assert format_rules(parse_file(path)) == text


def test_tabs_are_white_space():
    text = "let\tH\t=\t4\t#\ttab comment\n\tmodel.{L}.w\t->\tl.{L}.w\n\t|\tstack(L,\tdim=0)\n"
    rules = parse_text(text)
    assert rules.statements[0].trivia.trailing == "#\ttab comment"
    assert fmt(text) == "let H = 4  #\ttab comment\nmodel.{L}.w -> l.{L}.w | stack(L, dim=0)\n"


def test_long_single_op_rule_breaks_to_its_own_line():
    head = "model.layers.{L}.mlp.experts.{E}.gate_up_proj.weight -> layers.{L}.moe.w13"
    text = f"{head} | stack(E, dim=0)\n"
    assert len(text) <= 101 and fmt(text) == text
    long_head = head.replace("w13", "w13_with_a_much_longer_runtime_tensor_name")
    assert fmt(f"{long_head} | stack(E, dim=0)\n") == f"{long_head}\n    | stack(E, dim=0)\n"


def test_format_of_the_language_brief_example():
    text = QWEN3_MOE
    once = fmt(text)
    assert fmt(once) == once
    assert parse_text(once) == parse_text(text)
    # every comment of the original survives
    assert [line.strip() for line in text.splitlines() if line.strip().startswith("#")] == [
        line.strip() for line in once.splitlines() if line.strip().startswith("#")]


QWEN3_MOE = (Path(__file__).parent / "corpus" / "language_brief.remap").read_text()


# ---- every rule file in the repository -----------------------------------------------------


def _rule_files() -> list[Path]:
    found = sorted((ROOT / "rules").glob("*.remap")) + sorted((ROOT / "tests" / "corpus").glob("**/*.remap"))
    return found


@pytest.mark.parametrize("path", _rule_files() or [None],
                         ids=lambda p: str(p.relative_to(ROOT)) if p else "no-files")
def test_format_is_idempotent_on_repository_files(path):
    if path is None:
        pytest.skip("no rules/*.remap or tests/corpus/**/*.remap yet")
    try:
        rules = parse_file(path)
    except RemapError:
        pytest.skip("does not parse (an error-corpus file)")
    once = format_rules(rules)
    again = parse_text(once, str(path))
    assert again == rules
    assert format_rules(again) == once
    assert all_trivia(again) == all_trivia(rules)
