"""Hypothesis strategies for arbitrary well-formed IR (remapdsl.language.ir).

Generated IR satisfies the IR validators and the parser's syntax-level rules, so that
`parse_text(format_rules(ir)) == ir` must hold for it. It need not pass the static checks: names
may be unbound, op arguments may have the wrong type, captures may be unconsumed.

A few constructs the IR accepts but the formatter cannot write back are left out on purpose; each
is listed in AVOIDED below and pinned by a strict-xfail test in tests/test_roundtrip.py, so that
when the source is fixed the test turns red and the avoidance can be dropped here.

Trivia (comments, blank lines) is generated in canonical form: the form the parser produces, so
that trivia also survives format -> parse unchanged.
"""

from __future__ import annotations

import re

from hypothesis import strategies as st

from remapdsl.language import ir
from remapdsl.quant.builtin import BUILTIN_FORMATS

STATEMENT_KEYWORDS = ("remap", "let", "drop", "keep", "dequantize", "include", "macro",
                      "optional", "otherwise")

# What the IR refuses because the concrete syntax cannot say it (see ir.identifier_problem and
# ir.pattern_problems): the generators avoid it; tests/test_roundtrip.py checks the refusal.
EXPRESSION_KEYWORDS = frozenset({"when", "and", "or", "not", "true", "false"})
AVOIDED = {
    # a name spelled like a statement keyword (`let remap = 1`): refused by the IR
    "statement_keyword_names": frozenset(STATEMENT_KEYWORDS),
    # key text that is exactly a keyword (`x -> when`): refused by the IR
    "text_keywords": EXPRESSION_KEYWORDS,
    # key text that is exactly a number with an exponent (`1e5`): refused by the IR
    "float_start": True,
    # `(a < b) == c` and `not not a + b` are written and read back exactly
    "compare_left_of_compare": False,
    # `x -> {true}`: a boolean substitution is refused by the IR
    "subst_bool": True,
    "not_not_binary": False,
}
_FLOAT_START = re.compile(r"[0-9]+(\.[0-9]+)?[eE][+-]?[0-9]+")

# ---- names ---------------------------------------------------------------------------------

_INTERESTING_NAMES = (
    "L", "E", "P", "H", "NH", "KV", "D", "x", "_", "_1", "a_b", "bfloat16", "float32", "e8m0",
    # op names are ordinary names; statement keywords would be too (AVOIDED for now)
    *STATEMENT_KEYWORDS, "cast", "concat", "stack", "fp8_block", "invalid_op",
    # prefixes of keywords are not keywords
    "whenever", "notx", "configs", "android", "order", "true_", "False", "TRUE", "inf", "nan", "e5",
)

identifiers = st.one_of(
    st.sampled_from(_INTERESTING_NAMES),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True),
).filter(lambda name: ir.identifier_problem(name) is None
         and name not in AVOIDED["statement_keyword_names"])

macro_names = identifiers.filter(lambda name: name not in ir.RESERVED_NAMES)
format_names = identifiers.filter(lambda name: name not in ir.OPS_BY_NAME)  # the parser takes any other

# One segment of key text: letters, digits, `_`.
_INTERESTING_WORDS = (
    "model", "layers", "weight", "bias", "self_attn", "q_proj", "experts", "0", "1", "10", "007",
    "1e5", "2E3", "inf", "nan", *STATEMENT_KEYWORDS, "and", "or", "not", "true", "false", "config",
    "when", "whenx", "xwhen", "_",
)
key_words = st.one_of(
    st.sampled_from(_INTERESTING_WORDS),
    st.from_regex(r"[A-Za-z0-9_]{1,6}", fullmatch=True),
)

config_segments = st.one_of(
    st.sampled_from(("hidden_size", "num_attention_heads", "when", "true", "config", "not", "1",
                     "1e5", "0", "drop", "remap")),
    st.from_regex(r"[A-Za-z0-9_]{1,6}", fullmatch=True),
)

# ---- expressions ---------------------------------------------------------------------------

ints = st.builds(ir.Int, value=st.one_of(st.integers(-10, 100),
                                         st.integers(-(2**70), 2**70)))
floats = st.builds(ir.Float, value=st.floats(allow_nan=False, allow_infinity=False))
bools = st.builds(ir.Bool, value=st.booleans())
names = st.builds(ir.Name, id=identifiers)
configs = st.builds(ir.Config, path=st.lists(config_segments, min_size=1, max_size=3).map(tuple))

expr_leaves = st.one_of(ints, floats, bools, names, configs)


def _compare_ok(expr: ir.Compare) -> bool:
    return not (AVOIDED["compare_left_of_compare"] and isinstance(expr.left, ir.Compare))


def _not_ok(expr: ir.Not) -> bool:
    inner = expr.operand
    return not (AVOIDED["not_not_binary"] and isinstance(inner, ir.Not)
                and isinstance(inner.operand, (ir.BinOp, ir.Compare, ir.Coalesce)))


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    non_literal = children.filter(lambda e: not isinstance(e, (ir.Int, ir.Float)))
    return st.one_of(
        st.builds(ir.List, items=st.lists(children, max_size=4).map(tuple)),
        st.builds(ir.Neg, operand=non_literal),
        st.builds(ir.Not, operand=children).filter(_not_ok),
        st.builds(ir.BinOp, op=st.sampled_from(["+", "-", "*", "//", "%"]), left=children,
                  right=children),
        st.builds(ir.Compare, op=st.sampled_from(["==", "!=", "<", "<=", ">", ">="]),
                  left=children, right=children).filter(_compare_ok),
        st.builds(ir.BoolOp, op=st.sampled_from(["and", "or"]), left=children, right=children),
        st.builds(ir.Coalesce, left=children, right=children),
    )


exprs = st.recursive(expr_leaves, _extend, max_leaves=10)
small_exprs = st.recursive(expr_leaves, _extend, max_leaves=4)

# ---- trivia --------------------------------------------------------------------------------

_comment_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r")
comments = st.text(_comment_chars, max_size=20).map(lambda body: ("#" + body).rstrip())
_leading_lines = st.lists(st.one_of(comments, st.just("")), max_size=4)


def _collapse(lines: list[str], at_start: bool = False, at_end: bool = False) -> tuple[str, ...]:
    """Blank-line runs as the parser leaves them: one at most, none at the file's start or end."""
    out: list[str] = []
    for line in lines:
        if line == "" and ((not out and at_start) or (out and out[-1] == "")):
            continue
        out.append(line)
    if at_end:
        while out and out[-1] == "":
            out.pop()
    return tuple(out)


statement_trivia = st.builds(
    lambda leading, trailing: ir.Trivia(leading=_collapse(leading), trailing=trailing),
    _leading_lines, st.none() | comments,
)
op_trivia = st.one_of(
    st.just(ir.NO_TRIVIA),
    st.builds(lambda leading, trailing: ir.Trivia(leading=tuple(leading), trailing=trailing),
              st.lists(comments, max_size=2), st.none() | comments),
)

# ---- key patterns --------------------------------------------------------------------------

_options = st.lists(key_words, min_size=1, max_size=2).map(".".join)
alternatives = st.lists(_options, min_size=2, max_size=4, unique=True).map(
    lambda opts: ir.Alternatives(options=tuple(opts)))


def _merge_texts(parts: list[ir.Node]) -> tuple[ir.Node, ...]:
    out: list[ir.Node] = []
    for part in parts:
        if out and isinstance(part, ir.Text) and isinstance(out[-1], ir.Text):
            out[-1] = ir.Text(text=out[-1].text + part.text)
        else:
            out.append(part)
    return tuple(out)


def _lexes_cleanly(parts: tuple[ir.Node, ...]) -> bool:
    """False for a pattern that hits one of the AVOIDED lexer gaps."""
    for i, part in enumerate(parts):
        if isinstance(part, ir.Subst) and AVOIDED["subst_bool"] and isinstance(part.expr, ir.Bool):
            return False
        if not isinstance(part, ir.Text):
            continue
        if part.text in AVOIDED["text_keywords"]:
            return False
        if part.text in AVOIDED["statement_keyword_names"] and i == len(parts) - 1:
            return False
        if AVOIDED["float_start"] and _FLOAT_START.fullmatch(part.text):
            return False
    return True


@st.composite
def _inline_segment(draw, holes: st.SearchStrategy) -> list[ir.Node]:
    """One segment: literal words and holes, alternating (no two words or holes side by side)."""
    length = draw(st.integers(1, 4))
    word_first = draw(st.booleans())
    pieces: list[ir.Node] = []
    for i in range(length):
        if (i % 2 == 0) == word_first:
            pieces.append(ir.Text(text=draw(key_words)))
        else:
            pieces.append(draw(holes))
    return pieces


@st.composite
def source_patterns(draw, captures: dict[str, str]) -> ir.Pattern:
    """A matching-side pattern; captures come from `captures` (name -> type) of the statement."""
    matchers = [st.just(ir.Star())]
    if captures:
        matchers.append(st.sampled_from(sorted(captures)).map(
            lambda name: ir.Capture(name=name, type=captures[name])))
    holes = st.one_of(alternatives, *matchers)
    whole = [st.just([ir.DoubleStar()])]
    path_names = sorted(name for name, kind in captures.items() if kind == "path")
    if path_names:
        whole.append(st.sampled_from(path_names).map(lambda n: [ir.Capture(name=n, type="path")]))
    segment = st.one_of(_inline_segment(holes), *whole)
    return _dotted(draw, draw(st.lists(segment, min_size=1, max_size=4)))


@st.composite
def target_patterns(draw) -> ir.Pattern:
    """A producing-side pattern: literal text, substitutions `{expr}` and alternatives."""
    holes = st.one_of(alternatives, st.builds(ir.Subst, expr=small_exprs),
                      names.map(lambda n: ir.Subst(expr=n)))
    return _dotted(draw, draw(st.lists(_inline_segment(holes), min_size=1, max_size=4)))


def _dotted(draw, segments: list[list[ir.Node]]) -> ir.Pattern:
    """Segments joined by dots into a pattern; rare combinations the IR refuses (or that would not
    lex back) are rejected."""
    parts: list[ir.Node] = []
    for i, pieces in enumerate(segments):
        if i:
            parts.append(ir.Text(text="."))
        parts.extend(pieces)
    merged = _merge_texts(parts)
    if ir.pattern_problems(merged) or not _lexes_cleanly(merged):
        draw(st.nothing())
    return ir.Pattern(parts=merged)


capture_types = st.dictionaries(
    st.one_of(st.sampled_from(("L", "E", "P", "m", "x")), identifiers),
    st.sampled_from(ir.CAPTURE_TYPES), max_size=3,
)

# ---- ops -----------------------------------------------------------------------------------


@st.composite
def builtin_ops(draw, cls: type[ir.Op], trivia: st.SearchStrategy = st.just(ir.NO_TRIVIA)) -> ir.Op:
    """An op of class `cls`, every declared parameter filled with a value of the right shape
    (optional ones sometimes left out)."""
    fields = {}
    for param in cls.params:
        value = identifiers if param.kind == "capture" else small_exprs
        if not param.required:
            value = st.none() | value
        fields[param.name] = draw(value)
    return cls(**{k: v for k, v in fields.items() if v is not None}, trivia=draw(trivia))


@st.composite
def macro_calls(draw, trivia: st.SearchStrategy = st.just(ir.NO_TRIVIA)) -> ir.MacroCall:
    args = draw(st.lists(st.builds(ir.Arg, name=st.none() | identifiers, value=small_exprs),
                         max_size=3))
    return ir.MacroCall(name=draw(macro_names), args=tuple(args), trivia=draw(trivia))


@st.composite
def format_calls(draw, trivia: st.SearchStrategy = st.just(ir.NO_TRIVIA), to: bool = False) -> ir.FormatCall:
    """A built-in format with its declared parameters filled (optional ones sometimes left out),
    or any other name with arbitrary arguments: the parser takes both alike. With `to`, the call
    has `to=` (a `dequantize` needs it)."""
    if draw(st.booleans()):
        fmt = draw(st.sampled_from(BUILTIN_FORMATS))
        name = fmt.name
        args = [ir.Arg(name=p.name, value=draw(small_exprs)) for p in fmt.params
                if p.required or draw(st.booleans()) or (to and p.name == "to")]
    else:
        name = draw(format_names)
        args = draw(st.lists(st.builds(ir.Arg, name=st.none() | identifiers, value=small_exprs), max_size=3))
        if to and not any(a.name == "to" for a in args):
            args.append(ir.Arg(name="to", value=draw(small_exprs)))
    return ir.FormatCall(name=name, args=tuple(args), trivia=draw(trivia))


def ops(roles: tuple[str, ...] = ("layout", "value"), macro: bool = True,
        trivia: st.SearchStrategy = st.just(ir.NO_TRIVIA)) -> st.SearchStrategy:
    choices = [builtin_ops(cls, trivia) for cls in ir.BUILTIN_OPS if cls.role in roles]
    if macro:
        choices.append(macro_calls(trivia))
    return st.one_of(choices)


pipe_ops = ops(("layout", "value"), trivia=op_trivia)  # what a mapping rule or a macro body may hold
format_ops = format_calls(op_trivia)  # what a `quantized` names
dequantize_formats = format_calls(op_trivia, to=True)  # `to=` required

# ---- statements ----------------------------------------------------------------------------

guards = st.none() | small_exprs
versions = st.builds(ir.Version, number=st.sampled_from(ir.LANGUAGE_VERSIONS), trivia=statement_trivia)
lets = st.builds(ir.Let, name=identifiers, value=exprs, trivia=statement_trivia)


@st.composite
def rules(draw) -> ir.Rule:
    captures = draw(capture_types)
    return ir.Rule(
        sources=tuple(draw(st.lists(source_patterns(captures), min_size=1, max_size=3))),
        targets=tuple(draw(st.lists(target_patterns(), min_size=1, max_size=3))),
        guard=draw(guards),
        ops=tuple(draw(st.lists(pipe_ops, max_size=4))),
        optional=draw(st.booleans()),
        otherwise=draw(st.booleans()),
        trivia=draw(statement_trivia),
    )


@st.composite
def drops_and_keeps(draw) -> ir.Drop | ir.Keep:
    captures = draw(capture_types)
    cls = draw(st.sampled_from([ir.Drop, ir.Keep]))
    return cls(patterns=tuple(draw(st.lists(source_patterns(captures), min_size=1, max_size=3))),
               guard=draw(guards), trivia=draw(statement_trivia))


@st.composite
def dequantizes(draw) -> ir.Dequantize:
    captures = draw(capture_types)
    return ir.Dequantize(
        sources=tuple(draw(st.lists(source_patterns(captures), min_size=1, max_size=3))),
        target=draw(target_patterns()),
        guard=draw(guards),
        format=draw(dequantize_formats),
        optional=draw(st.booleans()),
        trivia=draw(statement_trivia),
    )


@st.composite
def quantizeds(draw) -> ir.Quantized:
    captures = draw(capture_types)
    return ir.Quantized(
        sources=tuple(draw(st.lists(source_patterns(captures), min_size=1, max_size=3))),
        guard=draw(guards),
        format=draw(format_ops),
        trivia=draw(statement_trivia),
    )


include_paths = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters='"\n\r'), min_size=1, max_size=20,
).filter(lambda path: path.strip() != "")
includes = st.builds(ir.Include, path=include_paths, trivia=statement_trivia)


@st.composite
def macros(draw) -> ir.Macro:
    first = draw(ops())  # on the head line: it has no comments
    rest = draw(st.lists(pipe_ops, max_size=3))
    return ir.Macro(name=draw(macro_names),
                    params=tuple(draw(st.lists(identifiers, max_size=3, unique=True))),
                    ops=(first, *rest), trivia=draw(statement_trivia))


casts = st.builds(ir.CastAll, dtype=names, trivia=statement_trivia)


def _plain(pattern: ir.Pattern) -> bool:
    return not any(isinstance(part, ir.Alternatives) for part in pattern.parts)


@st.composite
def prefixes(draw) -> ir.Prefix:
    captures = draw(capture_types)
    return ir.Prefix(name=draw(identifiers), source=draw(source_patterns(captures).filter(_plain)),
                     target=draw(target_patterns().filter(_plain)), guard=draw(guards),
                     trivia=draw(statement_trivia))


def _under(name: str, pattern: ir.Pattern) -> ir.Pattern:
    """`@name.` + pattern."""
    first, *rest = pattern.parts
    head = [ir.Text(text="." + first.text)] if isinstance(first, ir.Text) else [ir.Text(text="."), first]
    return ir.Pattern(parts=(ir.PrefixRef(name=name), *head, *rest))


@st.composite
def prefixed_rules(draw) -> ir.Rule:
    """A rule whose every pattern starts with one `@name`."""
    rule, name = draw(rules()), draw(identifiers)
    return rule.model_copy(update={"sources": tuple(_under(name, p) for p in rule.sources),
                                   "targets": tuple(_under(name, p) for p in rule.targets)})

statements = st.one_of(lets, rules(), drops_and_keeps(), dequantizes(), quantizeds(), includes, macros(), casts,
                       prefixes(), prefixed_rules())


@st.composite
def rule_files(draw, path: str = "<generated>") -> ir.RuleFile:
    body = draw(st.lists(statements, max_size=8))
    if draw(st.booleans()):
        body.insert(0, draw(versions))
    if body:  # no blank line before the first statement
        first = body[0]
        leading = _collapse(list(first.trivia.leading), at_start=True)
        body[0] = first.model_copy(update={"trivia": first.trivia.model_copy(
            update={"leading": leading})})
    trailing = _collapse(draw(_leading_lines), at_start=not body, at_end=True)
    return ir.RuleFile(path=path, statements=tuple(body), trailing=trailing)
