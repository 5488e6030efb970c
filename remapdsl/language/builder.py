"""Lark parser callbacks -> IR nodes (remapdsl.language.ir), called while parsing, without a parse tree.

The grammar gives the shape; the callbacks give it meaning: merge pattern tokens into parts
(checking that nothing but `,` and `->` separates patterns), resolve capture types, apply the
precedence of the flat expression runs, and map op arguments onto each op's declared parameters.
Problems go to the per-parse Context and are raised together once parsing ends.

Nodes are built with `ir.construct`: the callbacks check every invariant the IR validators
check (names, pattern structure, literal folding) with the same functions, and skipping the
second validation keeps a 5,000-statement file well under a second.
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lark import Token, Transformer

from . import ir
from ..dtypes import RULE_DTYPE_NAMES
from ..errors import Diagnostic, Span, did_you_mean, suggest
from ..quant import format_names

MAX_DEPTH = 64  # expression nesting; deeper is refused rather than recursed into
_DECIMAL = re.compile(r"[0-9]+\.[0-9]+")

# Binding strength of binary operators (loosest first) and whether they chain to the left.
_BINARY = {"or": 1, "and": 2, "==": 4, "!=": 4, "<": 4, "<=": 4, ">": 4, ">=": 4, "??": 5,
           "+": 6, "-": 6, "*": 7, "//": 7, "%": 7}
_COMPARE_LEVEL = 4


@dataclass
class Context:
    """What one parse call collects; set around `Lark.parse` through a context variable."""

    path: str
    lines: list[str]
    diagnostics: list[Diagnostic] = field(default_factory=list)
    reported: set[tuple[int, int]] = field(default_factory=set)  # (line, column) already reported


CONTEXT: contextvars.ContextVar[Context] = contextvars.ContextVar("remapdsl_parse_context")


_new = ir.construct
_tuple_new = tuple.__new__  # Span(...) without the named tuple's argument handling


def span_of(first: Any, last: Any = None) -> Span:
    """The span from the start of `first` to the end of `last` (tokens or nodes with spans)."""
    last = first if last is None else last
    a = first.span if not isinstance(first, Token) else first
    b = last.span if not isinstance(last, Token) else last
    return _tuple_new(Span, (CONTEXT.get().path, a.line, a.column, b.end_line, b.end_column))


def error(code: str, message: str, span: Span, hint: str | None = None) -> None:
    ctx = CONTEXT.get()
    ctx.diagnostics.append(Diagnostic(code=code, message=message, span=span, hint=hint,
                                      line_text=ctx.lines[span.line - 1]))


def _identifier(token: Token, what: str) -> str | None:
    """The token as a name, or None (reported) when it cannot be one."""
    problem = ir.identifier_problem(str(token))
    if problem:
        error("E017", f"`{token}` is not a valid {what}: {problem}", span_of(token))
        return None
    return str(token)


class _Brace(NamedTuple):
    kind: str  # "expr", "typed", "alternatives"
    value: Any
    start: int
    end: int
    span: Span


class _RawPattern(NamedTuple):
    items: tuple
    span: Span


class _Arg(NamedTuple):
    name: Token | None
    value: ir.Node
    span: Span


class _Guard(NamedTuple):
    expr: ir.Node


class _End(NamedTuple):
    """A closing token's position, for statements that end in `)`."""

    span: Span


class Builder(Transformer):
    """The callbacks Lark calls on each reduction, each with the list of its children.

    Stateless: state lives in the Context. (No `v_args`: its wrappers cost a tenth of the parse.)
    """

    # -- file and statements --

    def start(self, children: list) -> tuple[ir.Statement, ...]:
        statements = tuple(children)
        found = tuple(s for s in statements if s is not None)
        for s in found[1:]:
            if isinstance(s, ir.Version):
                error("E032", "the `remap` version line must be the first statement", s.span)
        return found

    def version(self, children: list) -> ir.Version | None:
        keyword, number = children
        if not number.isdigit():
            error("E030", f"`remap` takes a version number, not `{number}`", span_of(number),
                  "write `remap 1`")
            return None
        if len(number) > 6 or int(number) not in ir.LANGUAGE_VERSIONS:
            known = ", ".join(str(v) for v in ir.LANGUAGE_VERSIONS)
            error("E031", f"this file is written for language version {number}, but this "
                  f"remapdsl reads version {known}", span_of(number),
                  "upgrade remapdsl, or write the file for a version it knows")
            return None
        return _new(ir.Version, number=int(number), span=span_of(keyword, number))

    def let(self, children: list) -> ir.Let | None:
        keyword, name, value = children
        value = _value(value)
        if _identifier(name, "let name") is None:
            return None
        return _new(ir.Let, name=str(name), value=value, span=span_of(keyword, value))

    def rule(self, children: list) -> ir.Rule | None:
        optional, otherwise, sources, targets, guard, *ops = children
        ops = tuple(ops)
        first = optional or otherwise or sources[0]
        span = span_of(first, _last(targets[-1], guard, ops))
        types = _capture_types(sources)
        built_sources = _patterns(sources, "source", types)
        built_targets = _patterns(targets, "target", types)
        for op in ops:
            if op.role == "format":
                error("E037", f"`{op.op_name()}` is a quantized format: it belongs in a "
                      "`dequantize` statement", op.span)
        if None in built_sources or None in built_targets:
            return None
        return _new(ir.Rule, sources=built_sources, targets=built_targets,
                    guard=guard.expr if guard else None, ops=ops, optional=optional is not None,
                    otherwise=otherwise is not None, span=span)

    def drop(self, children: list) -> ir.Drop | None:
        keyword, patterns, guard = children
        return self._drop_or_keep(ir.Drop, keyword, patterns, guard)

    def keep(self, children: list) -> ir.Keep | None:
        keyword, patterns, guard = children
        return self._drop_or_keep(ir.Keep, keyword, patterns, guard)

    @staticmethod
    def _drop_or_keep(cls, keyword, patterns, guard):
        built = _patterns(patterns, "source", _capture_types(patterns))
        if None in built:
            return None
        return _new(cls, patterns=built, guard=guard.expr if guard else None,
                    span=span_of(keyword, _last(patterns[-1], guard, ())))

    def quantized(self, children: list) -> ir.Quantized | None:
        keyword, sources, guard, *ops = children
        span = span_of(keyword, _last(sources[-1], guard, tuple(ops)))
        built = _patterns(sources, "source", _capture_types(sources))
        fmt = _format(tuple(ops), span, "quantized")
        if fmt is None or None in built:
            return None
        return _new(ir.Quantized, sources=built, guard=guard.expr if guard else None, format=fmt, span=span)

    def dequantize(self, children: list) -> ir.Dequantize | None:
        optional, keyword, sources, target, guard, *ops = children
        ops = tuple(ops)
        span = span_of(optional or keyword, _last(target, guard, ops))
        types = _capture_types(sources)
        built_sources = _patterns(sources, "source", types)
        (built_target,) = _patterns([target], "target", types)
        fmt = _format(ops, span, "dequantize")
        if fmt is None:
            return None
        if _format_arg(fmt, "to") is None:
            error("E036", f"`{_op_name(fmt)}` in a `dequantize` needs `to=`, the dtype of the logical tensor",
                  fmt.span, f"for example `| {_op_name(fmt)}(..., to=bfloat16)`")
            return None
        if None in built_sources or built_target is None:
            return None
        return _new(ir.Dequantize, sources=built_sources, target=built_target,
                    guard=guard.expr if guard else None, format=fmt,
                    optional=optional is not None, span=span)

    def include(self, children: list) -> ir.Include | None:
        keyword, path = children
        value = str(path)[1:-1]
        if not value.strip():
            error("E033", "`include` needs a file path", span_of(path))
            return None
        return _new(ir.Include, path=value, span=span_of(keyword, path))

    def macro(self, children: list) -> ir.Macro | None:
        keyword, name, *rest = children
        rest = tuple(rest)
        params = [p for p in rest if isinstance(p, Token)]
        ops = tuple(op for op in rest if isinstance(op, ir.Op))
        ok = _identifier(name, "macro name") is not None
        if str(name) in ir.OPS_BY_NAME:
            error("E033", f"`{name}` is a built-in op; a macro needs another name", span_of(name))
            ok = False
        seen: set[str] = set()
        for p in params:
            ok = _identifier(p, "macro parameter") is not None and ok
            if str(p) in seen:
                error("E033", f"macro parameter `{p}` is declared twice", span_of(p))
                ok = False
            seen.add(str(p))
        if not ok:
            return None
        return _new(ir.Macro, name=str(name), params=tuple(str(p) for p in params), ops=ops,
                    span=span_of(keyword, ops[-1]))

    def guard(self, children: list) -> _Guard:
        (expr,) = children
        return _Guard(_value(expr))

    # -- ops --

    def keyword_arg(self, children: list) -> _Arg:
        name, value = children
        value = _value(value)
        return _Arg(name, value, span_of(name, value))

    def positional_arg(self, children: list) -> _Arg:
        (value,) = children
        value = _value(value)
        return _Arg(None, value, value.span)

    def op(self, children: list) -> ir.Op:
        name, *rest = children
        rest = tuple(rest)
        *args, close = rest
        given = [a for a in args if a is not None]
        span = span_of(name, close)
        cls = ir.OPS_BY_NAME.get(str(name))
        if cls is None:
            if _identifier(name, "op name") is None:
                return _new(ir.MacroCall, name="invalid_op", span=span)
            return _new(ir.MacroCall, name=str(name), span=span, args=tuple(
                _new(ir.Arg, name=str(a.name) if a.name else None, value=a.value, span=a.span)
                for a in given))
        fields = _bind_args(cls, name, given, span)
        missing = [p.name for p in cls.params if p.required and p.name not in fields]
        if missing:
            return _new(ir.MacroCall, name="invalid_op", span=span)
        return _new(cls, span=span, **fields)

    # -- patterns --

    def patterns(self, children: list) -> list[_RawPattern]:
        raws = tuple(children)
        return list(raws)

    def pattern(self, children: list) -> _RawPattern:
        items = tuple(children)
        return _RawPattern(items, span_of(items[0], items[-1]))

    def brace(self, children: list) -> _Brace:
        open_, body, close = children
        kind, value = body
        return _Brace(kind, value, open_.start_pos, close.end_pos, span_of(open_, close))

    def brace_expr(self, children: list) -> tuple[str, Any]:
        (expr,) = children
        if isinstance(expr, Token) and expr.type == "WORD" and not expr.isdigit() \
                and ir.identifier_problem(str(expr)) and "." not in expr:
            span = span_of(expr)
            error("E017", f"`{expr}` is not a valid capture name: {ir.identifier_problem(str(expr))}",
                  span)
            CONTEXT.get().reported.add((span.line, span.column))
            return ("bad", None)
        return ("expr", _value(expr))

    def brace_typed(self, children: list) -> tuple[str, Any]:
        name, kind = children
        return ("typed", (name, kind))

    def brace_alternatives(self, children: list) -> tuple[str, Any]:
        options = tuple(children)
        for option in options:
            if not ir.OPTION_TEXT.fullmatch(option):
                error("E016", f"alternative `{option}` has an empty segment", span_of(option))
        return ("alternatives", options)

    # -- expressions --

    def expr(self, children: list) -> ir.Node:
        """A flat run `[prefix...] operand (operator [prefix...] operand)*`, by precedence."""
        items = tuple(children)
        return _Precedence(items).parse()

    def paren(self, children: list) -> ir.Node:
        (expr,) = children
        return _value(expr)

    def list(self, children: list) -> ir.List:
        open_, *rest = children
        rest = tuple(rest)
        *items, close = rest
        values = tuple(_value(i) for i in items if i is not None)
        return _new(ir.List, items=values, span=span_of(open_, close))


# ---- helpers of the callbacks --------------------------------------------------------------



def _op_name(op: ir.Op) -> str:
    return op.name if isinstance(op, (ir.MacroCall, ir.FormatCall)) else op.op_name()


def _format_arg(op: ir.Op, name: str):
    if isinstance(op, ir.FormatCall):
        return next((a.value for a in op.args if a.name == name), None)
    return getattr(op, name, None)


def _format(ops: tuple, span, statement: str) -> ir.Op | None:
    """The one format op of a `dequantize` or `quantized` statement (a format registered from Python
    becomes a FormatCall), or None after reporting what is wrong."""
    if len(ops) != 1:
        where = ops[1].span if len(ops) > 1 else span
        error("E034", f"a `{statement}` statement names exactly one format after `|`, found {len(ops)}",
              where, "the format's `to=` sets the dtype, for example `| fp8_block(block=[128, 128], to=bfloat16)`"
              if statement == "dequantize" else "for example `| fp8_block(block=[128, 128])`")
        return None
    (fmt,) = ops
    if isinstance(fmt, ir.MacroCall) and fmt.name in format_names():  # registered from Python
        fmt = _new(ir.FormatCall, name=fmt.name, args=fmt.args, span=fmt.span)
    if fmt.role != "format":
        name = _op_name(fmt)
        known = format_names()
        error("E035", f"`{name}` is not a quantized format", fmt.span,
              did_you_mean(name, known) or f"formats: {', '.join(known)}")
        return None
    return fmt

def _last(last_pattern, guard, ops):
    if ops:
        return ops[-1]
    if guard is not None:
        return guard.expr
    return last_pattern


def _value(item: Any) -> ir.Node:
    """A token standing for an operand (WORD, FLOAT, true, false) as an IR node."""
    if not isinstance(item, Token):
        return item
    span = span_of(item)
    if item.type == "TRUE":
        return _new(ir.Bool, value=True, span=span)
    if item.type == "FALSE":
        return _new(ir.Bool, value=False, span=span)
    text = str(item)
    if item.type == "FLOAT" or _DECIMAL.fullmatch(text):
        value = float(text)
        if value in (float("inf"), float("-inf")):
            return _bad_word(item, f"`{text}` is too large a number", None)
        return _new(ir.Float, value=value, span=span)
    if text.isdigit():
        if len(text) > 30:
            return _bad_word(item, f"`{text[:12]}...` is too large a number", None)
        return _new(ir.Int, value=int(text), span=span)
    if text.startswith("config."):
        path = tuple(text[len("config."):].split("."))
        if all(path):
            return _new(ir.Config, path=path, span=span)
    elif not ir.identifier_problem(text):
        return _new(ir.Name, id=text, span=span)
    head = text.split(".")[0]
    if text == "config":
        return _bad_word(item, "`config` needs a key", "read a value as `config.hidden_size`")
    if head == "torch" and text.split(".", 1)[1] in RULE_DTYPE_NAMES:
        return _bad_word(item, f"`{text}` is not a name: dtype names are written without `torch.`",
                         f"write `{text.split('.', 1)[1]}`")
    if "." in text and head != "config":
        hint = (f"did you mean `config.{text.split('.', 1)[1]}`?" if suggest(head, ["config"])
                else "config values are read as `config.KEY`")
        return _bad_word(item, f"`{text}` is not a name: names have no dots", hint)
    if "." in text:
        return _bad_word(item, f"`{text}` has an empty key segment", "read a value as `config.a.b`")
    return _bad_word(item, f"`{text}` is neither a number nor a name", ir.identifier_problem(text))


def _bad_word(item: Token, message: str, hint: str | None) -> ir.Int:
    span = span_of(item)
    error("E038", message, span, hint)
    CONTEXT.get().reported.add((span.line, span.column))
    return _new(ir.Int, value=0, span=span)


class _Precedence:
    """Precedence climbing over the flat children of an `expr` reduction."""

    def __init__(self, items: tuple):
        self.items = items
        self.at = 0

    def parse(self) -> ir.Node:
        return self.binary(1)

    def peek_operator(self) -> str | None:
        if self.at < len(self.items):
            item = self.items[self.at]
            if isinstance(item, Token) and item.type in ("BINARY", "MINUS", "STAR", "AND", "OR"):
                return str(item)
        return None

    def binary(self, level: int, depth: int = 0) -> ir.Node:
        if depth > MAX_DEPTH:
            raise TooDeep(self.items[0])
        left = self.prefixed(level, depth)
        compared = False  # whether `left` is a comparison made in this run (not parenthesized)
        while (op := self.peek_operator()) is not None and _BINARY[op] >= level:
            strength = _BINARY[op]
            token = self.items[self.at]
            self.at += 1
            if op == "??":  # right-associative
                right = self.binary(strength, depth + 1)
                left = _new(ir.Coalesce, left=left, right=right, span=span_of(left, right))
                continue
            right = self.binary(strength + 1, depth + 1)
            span = span_of(left, right)
            if strength == _COMPARE_LEVEL:
                if compared:
                    error("E039", "comparisons do not chain", span_of(token),
                          "join two comparisons with `and`")
                left = _new(ir.Compare, op=op, left=left, right=right, span=span)
                compared = True
            elif op in ("and", "or"):
                left = _new(ir.BoolOp, op=op, left=left, right=right, span=span)
            else:
                left = _new(ir.BinOp, op=op, left=left, right=right, span=span)
        return left

    def prefixed(self, level: int, depth: int) -> ir.Node:
        """An operand with its prefix operators; `not` takes a whole comparison as operand."""
        if depth > MAX_DEPTH:
            raise TooDeep(self.items[0])
        item = self.items[self.at]
        if isinstance(item, Token) and item.type in ("MINUS", "NOT"):
            self.at += 1
            if item.type == "NOT":  # its operand is a whole comparison, as in Python
                operand = self.binary(_COMPARE_LEVEL, depth + 1)
                return _new(ir.Not, operand=operand, span=span_of(item, operand))
            operand = self.prefixed(level, depth + 1)
            span = span_of(item, operand)
            if isinstance(operand, ir.Int):
                return _new(ir.Int, value=-operand.value, span=span)
            if isinstance(operand, ir.Float):
                return _new(ir.Float, value=-operand.value, span=span)
            return _new(ir.Neg, operand=operand, span=span)
        self.at += 1
        return _value(item)


class TooDeep(Exception):
    """An expression nested deeper than MAX_DEPTH; reported, never recursed into."""

    def __init__(self, at: Any):
        self.at = at


def _bind_args(cls: type[ir.Op], name: Token, args: list[_Arg], span: Span) -> dict:
    """Map written arguments onto the op's declared parameters, reporting arity errors."""
    params = cls.params
    names = [p.name for p in params]
    usage = cls.example
    fields: dict[str, Any] = {}
    suggested: set[str] = set()
    seen_keyword = False
    for position, arg in enumerate(args):
        if arg.name is None:
            if seen_keyword:
                error("E023", "a positional argument cannot follow a keyword argument", arg.span,
                      f"for example `{usage}`")
                continue
            if position >= len(params):
                error("E020", f"`{name}` takes at most {len(params)} argument"
                      f"{'s' if len(params) != 1 else ''}, got {len(args)}", arg.span,
                      f"for example `{usage}`")
                continue
            param = params[position]
        else:
            seen_keyword = True
            matches = [p for p in params if p.name == str(arg.name)]
            if not matches:
                close = suggest(str(arg.name), names)
                if close:
                    suggested.add(close)
                error("E021", f"`{name}` has no argument `{arg.name}`", span_of(arg.name),
                      f"did you mean `{close}`?" if close else f"for example `{usage}`")
                continue
            param = matches[0]
        if param.name in fields:
            error("E022", f"argument `{param.name}` of `{name}` is given twice", arg.span)
            continue
        value = _arg_value(param, arg)
        if value is not None:
            fields[param.name] = value
    for param in params:
        if param.required and param.name not in fields and param.name not in suggested:
            error("E020", f"`{name}` needs argument `{param.name}`", span, f"for example `{usage}`")
    return fields


def _arg_value(param: ir.Param, arg: _Arg) -> Any:
    if param.kind != "capture":
        return arg.value
    if isinstance(arg.value, ir.Name):
        return arg.value.id
    error("E024", f"argument `{param.name}` takes a capture name such as `E`", arg.span)
    return None


# ---- patterns ------------------------------------------------------------------------------


def _patterns(raws: list[_RawPattern], side: str, types: dict[str, str]) -> tuple:
    return tuple(_pattern(raw, side, types) for raw in raws)


def _brace_token(token: Token) -> _Brace:
    """A CAPTURE or ALTERNATIVES token as the brace it abbreviates."""
    inner = str(token)[1:-1]
    span = span_of(token)
    if token.type == "ALTERNATIVES":
        for option in inner.split(","):
            if not ir.OPTION_TEXT.fullmatch(option):
                error("E016", f"alternative `{option}` has an empty segment", span)
        return _Brace("alternatives", tuple(inner.split(",")), token.start_pos, token.end_pos, span)
    if ":" in inner:
        name, kind = inner.split(":")
        at = token.column + 1
        name_span = Span(span.path, span.line, at, span.line, at + len(name))
        kind_span = Span(span.path, span.line, at + len(name) + 1, span.line, span.end_column - 1)
        return _Brace("typed", (_Word(name, name_span), _Word(kind, kind_span)),
                      token.start_pos, token.end_pos, span)
    inner_span = Span(span.path, span.line, span.column + 1, span.line, span.end_column - 1)
    if ir.identifier_problem(inner):
        error("E017", f"`{inner}` is not a valid capture name: {ir.identifier_problem(inner)}",
              inner_span)
        return _Brace("bad", None, token.start_pos, token.end_pos, span)
    return _Brace("expr", _new(ir.Name, id=inner, span=inner_span), token.start_pos, token.end_pos,
                  span)


class _Word(str):
    """Text with a span, standing in for a token inside a CAPTURE token."""

    def __new__(cls, text: str, span: Span):
        word = super().__new__(cls, text)
        word.span = span
        return word


def _capture_types(raws: list[_RawPattern]) -> dict[str, str]:
    """Declared type of each capture in a statement's sources; `int` where none is written."""
    types: dict[str, str] = {}
    declared_at: dict[str, Span] = {}
    for raw in raws:
        for item in raw.items:
            if isinstance(item, Token) and item.type == "CAPTURE" and ":" in item:
                item = _brace_token(item)
            if isinstance(item, _Brace) and item.kind == "typed":
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


def _pattern(raw: _RawPattern, side: str, types: dict[str, str]) -> ir.Pattern | None:
    ctx = CONTEXT.get()
    before = len(ctx.diagnostics)
    items = raw.items
    for a, b in zip(items, items[1:]):
        if (a.end_pos if isinstance(a, Token) else a.end) != (
                b.start_pos if isinstance(b, Token) else b.start):
            gap = Span(path=ctx.path, line=a.end_line if isinstance(a, Token) else
                                       a.span.end_line,
                                       column=a.end_column if isinstance(a, Token) else
                                       a.span.end_column,
                                       end_line=b.line if isinstance(b, Token) else b.span.line,
                                       end_column=b.column if isinstance(b, Token) else
                                       b.span.column)
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
    for index, message in ir.pattern_problems(tuple(parts)):
        error("E016", message, _narrow(parts[min(index, len(parts) - 1)], message))
    if len(ctx.diagnostics) > before:
        return None
    return _new(ir.Pattern, parts=tuple(parts), span=raw.span)


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
    if isinstance(item, Token):
        kind = item.type
        span = span_of(item)
        if kind == "WORD":
            return _new(ir.Text, text=str(item), span=span)
        if kind == "CAPTURE" and ":" not in item:  # the common `{L}`, without an intermediate
            name = str(item)[1:-1]
            if not ir.identifier_problem(name):
                if side == "source":
                    return _new(ir.Capture, name=name, type=types.get(name, "int"), span=span)
                inner = _tuple_new(Span, (span.path, span.line, span.column + 1, span.line,
                                          span.end_column - 1))
                return _new(ir.Subst, expr=_new(ir.Name, id=name, span=inner), span=span)
        if kind in ("CAPTURE", "ALTERNATIVES"):
            return _part(_brace_token(item), side, types)
        if side == "target":
            error("E015", f"`{item}` matches keys, but a target names one key", span,
                  "capture the varying part in the source (`{L}` rather than `*`) and write "
                  "`{L}` here")
            return None
        return _new(ir.Star if item.type == "STAR" else ir.DoubleStar, span=span)
    if item.kind == "bad":
        return None
    if item.kind == "alternatives":
        options = tuple(str(o) for o in item.value)
        repeated = sorted({o for o in options if options.count(o) > 1})
        if repeated:
            error("E014", f"`{repeated[0]}` appears twice in the alternatives", item.span)
            return None
        return _new(ir.Alternatives, options=options, span=item.span)
    if item.kind == "typed":
        name, _kind = item.value
        if side == "target":
            error("E013", "capture types are declared on the source side", item.span,
                  f"write `{{{name}}}` here")
            return None
        capture = _identifier(name, "capture name")
        if capture is not None and capture in types:
            return _new(ir.Capture, name=capture, type=types[capture], span=item.span)
        return None  # a bad name or an unknown type: already reported
    expr = item.value
    if side == "target":
        return _new(ir.Subst, expr=expr, span=item.span)
    if isinstance(expr, ir.Name):
        return _new(ir.Capture, name=expr.id, type=types.get(expr.id, "int"), span=item.span)
    if isinstance(expr, ir.Int) and (expr.span.line, expr.span.column) in CONTEXT.get().reported:
        return None
    if isinstance(expr, (ir.Int, ir.Float)):
        error("E017", f"`{{{expr.value}}}` is not a capture: capture names start with a letter "
              "or `_`", item.span)
    else:
        error("E011", "arithmetic on captures belongs in targets; a source pattern only binds "
              "names", item.span)
    return None


def depth_problem(statement: ir.Statement) -> Span | None:
    """The span of an expression nested deeper than MAX_DEPTH in a statement, if any.

    Only expressions can nest (patterns are flat), so only they are walked, without recursion.
    """
    roots = [getattr(statement, name) for name in ("value", "guard") if hasattr(statement, name)]
    ops = getattr(statement, "ops", ()) or ((statement.format,) if hasattr(statement, "format") else ())
    for op in ops:
        roots.extend(getattr(op, p.name) for p in op.params if p.kind != "capture")
        roots.extend(arg.value for arg in getattr(op, "args", ()))
    stack = [(root, 0) for root in roots if isinstance(root, ir.Node)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return node.span
        for name in node._compared:
            value = getattr(node, name)
            for child in value if isinstance(value, tuple) else (value,):
                if isinstance(child, ir.Node):
                    stack.append((child, depth + 1))
    return None
