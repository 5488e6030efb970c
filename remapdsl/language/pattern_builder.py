"""Pattern tokens and braces -> key patterns (ir.Pattern): parts merged, capture types resolved (declared
once per statement, on the source side), structure checked; white space inside a pattern is E010."""

from __future__ import annotations

from typing import Any, NamedTuple

from lark import Token
from pydantic import ValidationError

from . import ir
from ..errors import Span, did_you_mean
from .context import CONTEXT, error, identifier, new, span_of


class Brace(NamedTuple):
    """One `{...}` of a pattern, read: an expression, a typed capture, or alternatives."""

    kind: str  # "expr", "typed", "alternatives", "bad" (reported)
    value: Any
    start: int
    end: int
    span: Span


class RawPattern(NamedTuple):
    """A pattern's tokens and braces as the grammar reduced them, before they become parts."""

    items: tuple
    span: Span


def patterns(raws: list[RawPattern], side: str, types: dict[str, str]) -> tuple:
    """The Pattern of each raw pattern of one side, None where one was reported wrong."""
    return tuple(_pattern(raw, side, types) for raw in raws)


def _brace_token(token: Token) -> Brace:
    """A CAPTURE or ALTERNATIVES token as the brace it abbreviates."""
    inner = str(token)[1:-1]
    span = span_of(token)
    if token.type == "ALTERNATIVES":
        for option in inner.split(","):
            if not ir.OPTION_TEXT.fullmatch(option):
                error("E016", f"alternative `{option}` has an empty segment", span)
        return Brace("alternatives", tuple(inner.split(",")), token.start_pos, token.end_pos, span)
    if ":" in inner:
        name, kind = inner.split(":")
        at = token.column + 1
        name_span = Span(span.path, span.line, at, span.line, at + len(name))
        kind_span = Span(span.path, span.line, at + len(name) + 1, span.line, span.end_column - 1)
        return Brace("typed", (_Word(name, name_span), _Word(kind, kind_span)),
                     token.start_pos, token.end_pos, span)
    inner_span = Span(span.path, span.line, span.column + 1, span.line, span.end_column - 1)
    if identifier(_Word(inner, inner_span), "capture name") is None:  # a keyword (`{when}`)
        return Brace("bad", None, token.start_pos, token.end_pos, span)
    return Brace("expr", new(ir.Name, id=inner, span=inner_span), token.start_pos, token.end_pos, span)


def prefix_name(token: Token) -> str | None:
    """The name of a `@name` token, or None (reported) when it cannot be one (`@when`: a keyword)."""
    problem = ir.identifier_problem(str(token)[1:])
    if problem:
        error("E017", f"`{token}` is not a valid prefix name: {problem}", span_of(token))
        return None
    return str(token)[1:]


class _Word(str):
    """Text with a span, standing in for a token inside a CAPTURE token."""

    def __new__(cls, text: str, span: Span):
        word = super().__new__(cls, text)
        word.span = span
        return word


def capture_types(raws: list[RawPattern]) -> dict[str, str]:
    """Declared type of each capture in a statement's sources; `int` where none is written."""
    types: dict[str, str] = {}
    declared_at: dict[str, Span] = {}
    for raw in raws:
        for item in raw.items:
            if isinstance(item, Token) and item.type == "CAPTURE" and ":" in item:
                item = _brace_token(item)
            if isinstance(item, Brace) and item.kind == "typed":
                name, kind = item.value
                if str(kind) not in ir.CAPTURE_TYPES:
                    error("E012", f"unknown capture type `{kind}`", span_of(kind),
                          did_you_mean(str(kind), ir.CAPTURE_TYPES)
                          or "capture types: int (default), seg, path")
                    continue
                if str(name) in types and types[str(name)] != str(kind):
                    first = declared_at[str(name)]
                    error("E018", f"capture `{name}` is declared as `{types[str(name)]}` at "
                          f"column {first.column} and as `{kind}` here", item.span)
                    continue
                types[str(name)] = str(kind)
                declared_at[str(name)] = item.span
    return types


def _pattern(raw: RawPattern, side: str, types: dict[str, str]) -> ir.Pattern | None:
    """One raw pattern as a Pattern, or None when something in it was reported wrong."""
    ctx = CONTEXT.get()
    before = len(ctx.diagnostics)
    items = raw.items
    for a, b in zip(items, items[1:]):
        if (a.end_pos if isinstance(a, Token) else a.end) != (
                b.start_pos if isinstance(b, Token) else b.start):
            left, right = span_of(a), span_of(b)
            gap = Span(ctx.path, left.end_line, left.end_column, right.line, right.column)
            error("E010", "white space inside a key pattern", gap,
                  "separate patterns with `,`, and sources from targets with `->`")
    parts: list[ir.Node] = []
    for item in items:
        part = _part(item, side, types)
        if part is None:
            return None
        parts.append(part)
    if len(ctx.diagnostics) > before:
        return None
    try:  # the Pattern validator checks the structure (ir.pattern_problems)
        return ir.Pattern(parts=tuple(parts), span=raw.span)
    except ValidationError:
        problems = ir.pattern_problems(tuple(parts))
        if not problems:
            raise
    for index, message in problems:  # each where it is
        error("E016", message, _narrow(parts[min(index, len(parts) - 1)], message))
    return None


def _narrow(part: ir.Node, message: str) -> Span:
    """For an empty segment in literal text, the span of the offending dots alone."""
    span = part.span
    if not isinstance(part, ir.Text) or not message.startswith("empty segment"):
        return span
    text = part.text
    at = text.find("..")
    if at < 0:
        at = 0 if text.startswith(".") else len(text) - 1
        width = 1
    else:
        width = len(text[at:]) - len(text[at:].lstrip("."))
    return Span(span.path, span.line, span.column + at, span.line, span.column + at + width)


def _part(item: Any, side: str, types: dict[str, str]) -> ir.Node | None:
    """One token or brace of a pattern as a part for its side, or None (reported)."""
    if isinstance(item, Token):
        kind = item.type
        span = span_of(item)
        if kind == "WORD":
            return new(ir.Text, text=str(item), span=span)
        if kind == "PREFIX_NAME":
            name = prefix_name(item)
            return None if name is None else new(ir.PrefixRef, name=name, span=span)
        if kind in ("CAPTURE", "ALTERNATIVES"):
            return _part(_brace_token(item), side, types)
        if side == "target":
            error("E015", f"`{item}` matches keys, but a target names one key", span,
                  "capture the varying part in the source (`{L}` rather than `*`) and write "
                  "`{L}` here")
            return None
        return new(ir.Star if item.type == "STAR" else ir.DoubleStar, span=span)
    if item.kind == "bad":
        return None
    if item.kind == "alternatives":
        options = tuple(str(o) for o in item.value)
        repeated = sorted({o for o in options if options.count(o) > 1})
        if repeated:
            error("E014", f"`{repeated[0]}` appears twice in the alternatives", item.span)
            return None
        return new(ir.Alternatives, options=options, span=item.span)
    if item.kind == "typed":
        name, _kind = item.value
        if side == "target":
            error("E013", "capture types are declared on the source side", item.span,
                  f"write `{{{name}}}` here")
            return None
        capture = identifier(name, "capture name")
        if capture is not None and capture in types:
            return new(ir.Capture, name=capture, type=types[capture], span=item.span)
        return None  # a bad name or an unknown type: already reported
    expr = item.value
    if side == "target":
        return new(ir.Subst, expr=expr, span=item.span)
    if isinstance(expr, ir.Name):
        return new(ir.Capture, name=expr.id, type=types.get(expr.id, "int"), span=item.span)
    if isinstance(expr, ir.Int) and (expr.span.line, expr.span.column) in CONTEXT.get().reported:
        return None
    if isinstance(expr, (ir.Int, ir.Float)):
        error("E017", f"`{{{expr.value}}}` is not a capture: capture names start with a letter "
              "or `_`", item.span)
    else:
        error("E011", "arithmetic on captures belongs in targets; a source pattern only binds "
              "names", item.span)
    return None
