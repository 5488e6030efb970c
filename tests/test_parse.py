"""Parsing: the IR a rule file becomes, with spans, capture types, op arguments and trivia."""

import pytest

from remapdsl.language import ir
from remapdsl.errors import RemapError
from remapdsl.language.parser import parse_text


def one(text: str) -> ir.Statement:
    (statement,) = parse_text(text, "t.remap").statements
    return statement


def test_rule_with_captures_alternatives_and_ops():
    rule = one(
        "model.layers.{L}.mlp.experts.{E}.{gate,up}_proj.weight -> layers.{L}.moe.w13\n"
        "    | stack(E, dim=0)\n"
        "    | concat(dim=1)\n"
    )
    assert isinstance(rule, ir.Rule)
    (source,) = rule.sources
    assert source.parts == (
        ir.Text(text="model.layers."),
        ir.Capture(name="L"),
        ir.Text(text=".mlp.experts."),
        ir.Capture(name="E"),
        ir.Text(text="."),
        ir.Alternatives(options=("gate", "up")),
        ir.Text(text="_proj.weight"),
    )
    assert rule.targets[0].parts[1] == ir.Subst(expr=ir.Name(id="L"))
    assert rule.ops == (
        ir.Stack(capture="E", dim=ir.Int(value=0)),
        ir.Concat(dim=ir.Int(value=1)),
    )


def test_spans_point_at_the_source_text():
    rule = one("a.{L}.b -> c.{L}\n    | transpose(0, 1)\n")
    assert (rule.span.line, rule.span.column) == (1, 1)
    capture = rule.sources[0].parts[1]
    assert (capture.span.line, capture.span.column, capture.span.end_column) == (1, 3, 6)
    op = rule.ops[0]
    assert (op.span.line, op.span.column, op.span.end_column) == (2, 7, 22)


def test_capture_type_declared_once_applies_to_every_use():
    deq = one("dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight"
              " | fp8_block(block=[128, 128], to=bfloat16)\n")
    assert isinstance(deq, ir.Dequantize)
    assert [p.parts[0] for p in deq.sources] == [ir.Capture(name="P", type="path")] * 2
    assert deq.format == ir.FormatCall(name="fp8_block", args=(
        ir.Arg(name="block", value=ir.List(items=(ir.Int(value=128), ir.Int(value=128)))),
        ir.Arg(name="to", value=ir.Name(id="bfloat16"))))


def test_path_capture_may_end_inside_a_segment():
    deq = one("dequantize {P:path}_blocks, {P}_scales -> {P} | mxfp4(to=bfloat16)\n")
    assert deq.sources[0].parts == (ir.Capture(name="P", type="path"), ir.Text(text="_blocks"))


def test_expression_precedence():
    let = one("let D = config.head_dim ?? H // NH + 1\n")
    assert let.value == ir.Coalesce(
        left=ir.Config(path=("head_dim",)),
        right=ir.BinOp(op="+", left=ir.BinOp(op="//", left=ir.Name(id="H"), right=ir.Name(id="NH")),
                       right=ir.Int(value=1)),
    )
    guard = one("a -> b when not config.tie ?? false and L >= 2\n").guard
    assert guard == ir.BoolOp(
        op="and",
        left=ir.Not(operand=ir.Coalesce(left=ir.Config(path=("tie",)), right=ir.Bool(value=False))),
        right=ir.Compare(op=">=", left=ir.Name(id="L"), right=ir.Int(value=2)),
    )


def test_negative_literals_fold_and_negated_names_do_not():
    reshape = one("a -> b | reshape([-1, -H, 2])\n").ops[0]
    assert reshape.shape.items == (ir.Int(value=-1), ir.Neg(operand=ir.Name(id="H")), ir.Int(value=2))


def test_optional_otherwise_drop_keep_include_macro_version():
    statements = parse_text(
        'remap 1\noptional otherwise {P:path} -> {P}\ndrop a.*, b.**.c when 1 < 2\nkeep x.y\n'
        'include "common.remap"\nmacro m(n) = reshape([n, -1]) | transpose(0, 1)\n',
        "t.remap",
    ).statements
    kinds = [type(s).__name__ for s in statements]
    assert kinds == ["Version", "Rule", "Drop", "Keep", "Include", "Macro"]
    assert statements[1].optional and statements[1].otherwise
    assert statements[2].patterns[0].parts == (ir.Text(text="a."), ir.Star())
    assert statements[5].params == ("n",) and len(statements[5].ops) == 2


def test_keywords_followed_by_a_dot_are_key_text():
    rule = one("drop.weight -> keep.weight\n")
    assert isinstance(rule, ir.Rule)
    assert rule.sources[0].parts == (ir.Text(text="drop.weight"),)


def test_unknown_op_becomes_a_macro_call_for_the_static_checks():
    op = one("a -> b | my_macro(3, n=4)\n").ops[0]
    assert op == ir.MacroCall(name="my_macro", args=(ir.Arg(value=ir.Int(value=3)),
                                                     ir.Arg(name="n", value=ir.Int(value=4))))


def test_comments_and_blank_lines_become_trivia():
    rules = parse_text(
        "# header\n\n\n# about a\na -> b  # inline\n    # about the op\n    | cast(bfloat16)  # op note\n"
        "\n# the end\n",
        "t.remap",
    )
    (rule,) = rules.statements
    assert rule.trivia.leading == ("# header", "", "# about a")
    assert rule.trivia.trailing == "# inline"
    assert rule.ops[0].trivia.leading == ("# about the op",)
    assert rule.ops[0].trivia.trailing == "# op note"
    assert rules.trailing == ("", "# the end")


def test_crlf_and_bom_are_accepted():
    rules = parse_text("\ufeffremap 1\r\na -> b\r\n", "t.remap")
    assert len(rules.statements) == 2


def test_empty_and_comment_only_files():
    assert parse_text("", "t.remap").statements == ()
    only = parse_text("# nothing here\n# at all\n", "t.remap")
    assert only.statements == () and only.trailing == ("# nothing here", "# at all")


def test_ir_equality_ignores_spans_and_trivia():
    a = parse_text("a -> b  # one\n", "x.remap")
    b = parse_text("\n\n   a   ->   b\n", "y.remap")
    assert a.statements == b.statements
    assert hash(a.statements[0]) == hash(b.statements[0])


def test_ir_round_trips_through_json():
    rules = parse_text("a.{L} -> b.{L - 1} | cast(bfloat16)\nlet X = [1, 2.5, true]\n", "t.remap")
    again = ir.RuleFile.model_validate_json(rules.model_dump_json())
    assert again == rules



@pytest.mark.parametrize("text", ["a b", "model.layers.0 ", "a\nb", "a/b", ""])
def test_key_text_in_the_ir_is_all_key_characters(text):
    """IR read from JSON (or built by hand) is validated whole: key text is only [A-Za-z0-9_.]."""
    with pytest.raises(ValueError):
        ir.Text(text=text)
    assert ir.Text(text="model.layers_0.").text == "model.layers_0."

@pytest.mark.parametrize("text, code", [
    ("a.b c.d\n", "E002"),
    ("a.{L.b -> c\n", "E003"),
    ("| cast(x)\n", "E004"),
    ("a -> b |\n", "E005"),
    ("a b -> c\n", "E010"),
    ("a.{L + 1} -> c\n", "E011"),
    ("a.{L:pth} -> c.{L}\n", "E012"),
    ("a.{L} -> c.{L:int}\n", "E013"),
    ("a.{q,q} -> c\n", "E014"),
    ("a -> c.*\n", "E015"),
    ("a..b -> c\n", "E016"),
    ("a.x**.b -> c\n", "E016"),
    ("a.{A}{B} -> c.{A}.{B}\n", "E016"),
    ("let 1x = 2\n", "E017"),
    ("a -> b | m(config=1)\n", "E017"),  # a macro's or a format's argument name
    ("dequantize a, s -> b | fp8_tensor(1x=1, to=bfloat16)\n", "E017"),
    ("prefix @not = a -> b\n", "E017"),
    ("a.{P:path}, b.{P:seg} -> c.{P}\n", "E018"),
    ("a -> b | transpose(0)\n", "E020"),
    ("a -> b | transpose(0, 1, 2)\n", "E020"),
    ("a -> b | cast(dtyp=bfloat16)\n", "E021"),
    ("a -> b | transpose(0, a=1)\n", "E022"),
    ("a -> b | transpose(a=0, 1)\n", "E023"),
    ("a -> b | stack(1, dim=0)\n", "E024"),
    ("remap one\n", "E030"),
    ("remap 2\n", "E031"),
    ("a -> b\nremap 1\n", "E032"),
    ("macro concat(n) = transpose(0, 1)\n", "E033"),
    ("dequantize a -> b\n", "E034"),
    ("dequantize a -> b | concat(dim=0)\n", "E035"),
    ("a -> b | fp8_tensor(to=bfloat16)\n", "E037"),
    ("macro m() = fp8_tensor(to=bfloat16)\n", "E037"),
    ("macro mxfp4() = transpose(0, 1)\n", "E033"),
    ("dequantize a, s -> b | fp8_tensor(bfloat16)\n", "E036"),
    ("let X = 12abc\n", "E038"),
])
def test_syntax_errors_have_codes_and_locations(text, code):
    with pytest.raises(RemapError) as info:
        parse_text(text, "t.remap")
    diagnostic = info.value.diagnostic
    assert diagnostic.code == code
    assert diagnostic.span is not None and diagnostic.span.path == "t.remap"
    assert diagnostic.line_text is not None
    assert str(info.value).startswith(f"t.remap:{diagnostic.span.line}:{diagnostic.span.column}: error[{code}]")


def test_misspelled_op_argument_gets_a_suggestion():
    with pytest.raises(RemapError) as info:
        parse_text("a.{q,k} -> b | interleave(dim=0, grups=2)\n", "t.remap")
    assert info.value.diagnostic.hint == "did you mean `groups`?"


def test_all_errors_of_a_pass_are_reported_together():
    with pytest.raises(RemapError) as info:
        parse_text("a -> b | transpose(0)\nc -> d | cast(dim=1)\n", "t.remap")
    assert [d.code for d in info.value.diagnostics] == ["E020", "E021", "E020"]


def test_a_format_is_parsed_by_name_without_asking_the_registry():
    """Which formats exist is the static checks' question: any name that is not a built-in op
    parses as a FormatCall, its arguments as written."""
    deq = one("dequantize a, s -> b | no_such_format([1, 2], x=1, to=bfloat16)\n")
    assert deq.format == ir.FormatCall(name="no_such_format", args=(
        ir.Arg(value=ir.List(items=(ir.Int(value=1), ir.Int(value=2)))),
        ir.Arg(name="x", value=ir.Int(value=1)), ir.Arg(name="to", value=ir.Name(id="bfloat16"))))
    quantized = one("quantized a, s | fp8_block([128, 128])\n")
    assert quantized.format.args == (ir.Arg(value=ir.List(items=(ir.Int(value=128), ir.Int(value=128)))),)


def test_a_bad_op_as_a_format_is_reported_once():
    with pytest.raises(RemapError) as info:
        parse_text("dequantize a -> b | transpose(0)\n", "t.remap")
    assert [d.code for d in info.value.diagnostics] == ["E020"]


def test_an_expression_nested_too_deeply_is_reported_and_parsing_goes_on():
    with pytest.raises(RemapError) as info:
        parse_text("let x = " + "not " * 100 + "a\nlet y = 1x\n", "t.remap")
    assert [(d.code, d.span.line, d.span.column) for d in info.value.diagnostics] == [
        ("E039", 1, 9), ("E038", 2, 9)]
    assert info.value.diagnostic.message == "expression nested too deeply"
    with pytest.raises(RemapError) as info:  # through parentheses: found in the built statement
        parse_text("let x = " + "(" * 100 + "a" + " + 1)" * 100 + "\n", "t.remap")
    assert [d.code for d in info.value.diagnostics] == ["E039"]
    parse_text("let x = " + "not " * 60 + "a\n", "t.remap")  # within the limit


def test_every_terminal_has_a_name_of_the_grammar():
    """syntax.py tells errors apart by terminal names: none may be one Lark generates (`__ANON_n`),
    which would change with the order of the strings in grammars/remap.lark."""
    from remapdsl.language.parser import lark_parser

    names = {t.name for t in lark_parser().terminals}
    assert not {n for n in names if n.startswith("__")}
    assert {"ARROW", "EQUAL", "COMMA", "WHEN"} <= names


def test_parser_from_built_tables_parses_every_shipped_rule_file_as_the_grammar_does(monkeypatch):
    """The tables built with the package (language/tables.py) stand in for building the parser
    from the grammar: the same IR for every shipped rule file, the same syntax error."""
    from pathlib import Path

    from lark import Lark

    from remapdsl.language import parser, tables
    from remapdsl.language.builder import Builder
    from remapdsl.language.lexer import RuleLexer

    grammar = parser.grammar_text()
    built = tables.parser_from_tables(tables.tables_json(grammar), grammar, RuleLexer, Builder())
    from_grammar = Lark(grammar, lexer=RuleLexer, transformer=Builder(), **tables.OPTIONS)
    root = Path(__file__).parent.parent
    files = sorted(root.glob("rules/*.remap")) + sorted(root.glob("examples/**/*.remap"))
    outcomes = []
    for lark_parser in (built, from_grammar):
        monkeypatch.setattr(parser, "lark_parser", lambda: lark_parser)
        rule_files = [parse_text(path.read_text(), str(path)) for path in files]
        with pytest.raises(RemapError) as info:
            parse_text("a.{L}.b -> c.{L}\n    | concat(dim=\nx -> y\n", "t.remap")
        outcomes.append((rule_files, str(info.value)))
    assert built is not from_grammar and len(files) > 15
    assert outcomes[0] == outcomes[1] and "E0" in outcomes[0][1]


def test_tables_of_another_grammar_or_another_lark_are_not_used():
    import json

    from remapdsl.language import tables
    from remapdsl.language.builder import Builder
    from remapdsl.language.lexer import RuleLexer
    from remapdsl.language.parser import grammar_text

    grammar = grammar_text()
    text = tables.tables_json(grammar)
    assert tables.parser_from_tables(text, grammar + "\n// edited\n", RuleLexer, Builder()) is None
    other_lark = json.loads(text)
    other_lark["key"][1] = "0.0.1"
    assert tables.parser_from_tables(json.dumps(other_lark), grammar, RuleLexer, Builder()) is None


def test_the_install_built_this_grammars_tables():
    """`pip install` runs hatch_build.py, which writes them beside the grammar: a process then reads
    them instead of building the tables at its first parse (0.08 s)."""
    import json

    from remapdsl.language import parser, tables

    text = parser._shipped(tables.FILE_NAME)
    assert text is not None, "no parser tables beside the grammar: install with pip (hatch_build.py)"
    assert json.loads(text)["key"] == tables._key(parser.grammar_text())
