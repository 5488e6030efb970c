"""Operand tokens and flat operator runs -> expression nodes (precedence climbing), and the nesting
limit: a run, or a statement's parenthesized expressions, nested deeper than MAX_DEPTH is reported
(E039) rather than recursed into."""

from __future__ import annotations

import re
from typing import Any

from lark import Token

from . import ir
from ..dtypes import RULE_DTYPE_NAMES
from ..errors import Span, suggest
from .context import CONTEXT, error, new as _new, span_of
from .nodes import BINARY_LEVELS, COMPARE

MAX_DEPTH = 64  # expression nesting; deeper is refused rather than recursed into
_DECIMAL = re.compile(r"[0-9]+\.[0-9]+")


def flat_expression(items: tuple) -> ir.Node:
    """The node of one flat run, by precedence; a run nested too deeply is reported (E039) and
    stands as a placeholder, so the parse goes on to report what else is wrong."""
    try:
        return _Precedence(items).binary(1)
    except _TooDeep:
        return _too_deep(span_of(items[0]))


def too_deep(statements: tuple[ir.Statement, ...]) -> None:
    """Report every statement holding an expression nested deeper than MAX_DEPTH (E039): parentheses
    nest without recursion in the parser, so the built expressions are walked, without recursion."""
    for statement in statements:
        span = _deep_span(statement)
        if span is not None:
            _too_deep(span)


def _too_deep(span: Span) -> ir.Int:
    return _placeholder("E039", "expression nested too deeply", span, "split it into several `let` statements")


def _deep_span(statement: ir.Statement) -> Span | None:
    """The span of an expression nested deeper than MAX_DEPTH in a statement, if any."""
    roots = [getattr(statement, name) for name in ("value", "guard") if hasattr(statement, name)]
    for op in statement.ops_of():
        roots.extend(getattr(op, p.name) for p in op.params if p.kind != "capture")
        roots.extend(arg.value for arg in getattr(op, "args", ()))
    stack = [(root, 0) for root in roots if isinstance(root, ir.Node)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return node.span
        stack.extend((child, depth + 1) for child in node.children())
    return None


def atom(item: Any) -> ir.Node:
    """A token standing for an operand (WORD, FLOAT, true, false) as an IR node."""
    if not isinstance(item, Token):
        return item
    span = span_of(item)
    if item.type in ("TRUE", "FALSE"):
        return _new(ir.Bool, value=item.type == "TRUE", span=span)
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
    return _placeholder("E038", message, span_of(item), hint)


def _placeholder(code: str, message: str, span: Span, hint: str | None) -> ir.Int:
    """Report a problem; the 0 that stands for what is not built (its place marked as reported)."""
    error(code, message, span, hint)
    CONTEXT.get().reported.add((span.line, span.column))
    return _new(ir.Int, value=0, span=span)


class _TooDeep(Exception):
    """A run nested deeper than MAX_DEPTH: unwinds the precedence climbing to `flat_expression`."""


class _Precedence:
    """Precedence climbing over the flat children of an `expr` reduction."""

    def __init__(self, items: tuple):
        self.items = items
        self.at = 0

    def peek_operator(self) -> str | None:
        if self.at < len(self.items):
            item = self.items[self.at]
            if isinstance(item, Token) and item.type in ("BINARY", "MINUS", "STAR", "AND", "OR"):
                return str(item)
        return None

    def binary(self, level: int, depth: int = 0) -> ir.Node:
        """Operands joined by the operators binding at least as tightly as `level`."""
        left = self.prefixed(depth)  # raises _TooDeep past MAX_DEPTH
        compared = False  # whether `left` is a comparison made in this run (not parenthesized)
        while (op := self.peek_operator()) is not None and BINARY_LEVELS[op] >= level:
            strength = BINARY_LEVELS[op]
            token = self.items[self.at]
            self.at += 1
            if op == "??":  # right-associative
                right = self.binary(strength, depth + 1)
                left = _new(ir.Coalesce, left=left, right=right, span=span_of(left, right))
                continue
            right = self.binary(strength + 1, depth + 1)
            span = span_of(left, right)
            if strength == COMPARE:
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

    def prefixed(self, depth: int) -> ir.Node:
        """An operand with its prefix operators; `not` takes a whole comparison as operand."""
        if depth > MAX_DEPTH:
            raise _TooDeep
        item = self.items[self.at]
        if isinstance(item, Token) and item.type in ("MINUS", "NOT"):
            self.at += 1
            if item.type == "NOT":  # its operand is a whole comparison, as in Python
                operand = self.binary(COMPARE, depth + 1)
                return _new(ir.Not, operand=operand, span=span_of(item, operand))
            operand = self.prefixed(depth + 1)
            span = span_of(item, operand)
            if isinstance(operand, (ir.Int, ir.Float)):  # `-3` is the literal -3
                return _new(type(operand), value=-operand.value, span=span)
            return _new(ir.Neg, operand=operand, span=span)
        self.at += 1
        return atom(item)

