"""Expressions of a rule program -> values, against the model config and a binding's captures.

Values are ints, floats, bools, lists of values, and dtype names (str). `a ?? b` is b when a reads
a config key that is missing or null. Every failure is a BindError at the expression's span.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any

from ..language import ir
from ..language.formatter import format_expr as _text
from ..dtypes import RULE_DTYPE_NAMES
from ..errors import BindError, Diagnostic, Span
from ..language.limits import MAX_INT, MIN_INT

Value = Any  # int | float | bool | str (a dtype) | list[Value]


class _Missing(Exception):
    """A config read found no value: caught by `??`, otherwise reported."""

    def __init__(self, expr: ir.Config, why: str):
        self.expr = expr
        self.why = why


class Evaluator:
    """Evaluates expressions with the program's lets, the config and one binding's captures."""

    def __init__(self, config: Mapping[str, Any], lets: Mapping[str, Value], line_text):
        self.config = config
        self.lets = lets
        self.line_text = line_text

    def fail(self, message: str, span: Span | None, hint: str | None = None, code: str = "E210") -> BindError:
        return BindError(Diagnostic(code=code, message=message, span=span, hint=hint,
                                    line_text=self.line_text(span) if span else None))

    def key_part(self, expr: ir.Node, captures: Mapping[str, Value]) -> str:
        """The text a target pattern's `{expr}` stands for: never a negative index (E213)."""
        value = self.value(expr, captures)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            shown = ", ".join(f"{k}={v}" for k, v in captures.items() if k in _names(expr))
            raise self.fail(f"a target key with a negative index: `{{{_text(expr)}}}` is {value}"
                            + (f" for {shown}" if shown else ""), expr.span,
                            "keys count from 0; guard the rule so that it binds only where the index "
                            "is 0 or more (`when ...`)", code="E213")
        return str(value)

    def value(self, expr: ir.Node, captures: Mapping[str, Value] | None = None) -> Value:
        try:
            return self._eval(expr, captures or {})
        except _Missing as missing:
            raise BindError(Diagnostic(
                code="E211", message=f"`config.{'.'.join(missing.expr.path)}` {missing.why}",
                span=missing.expr.span, line_text=self.line_text(missing.expr.span),
                hint="give a default with `??`, or fix config.json")) from None

    def integer(self, expr: ir.Node, what: str, captures: Mapping[str, Value] | None = None) -> int:
        value = self.value(expr, captures)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"`{what}` must be an integer, got {value!r}", expr.span)
        return value

    def integers(self, expr: ir.Node, what: str) -> tuple[int, ...]:
        value = self.value(expr)
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                              for v in value):
            raise self.fail(f"`{what}` must be a list of integers, got {value!r}", expr.span)
        return tuple(value)

    def number(self, expr: ir.Node, what: str) -> float:
        value = self.value(expr)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(f"`{what}` must be a number, got {value!r}", expr.span)
        return value

    def boolean(self, expr: ir.Node, captures: Mapping[str, Value]) -> bool:
        value = self.value(expr, captures)
        if not isinstance(value, bool):
            raise self.fail(f"a `when` guard must be true or false, got {value!r}", expr.span,
                            "compare it, e.g. `when L < config.num_hidden_layers`")
        return value

    def dtype(self, expr: ir.Node) -> str:
        if isinstance(expr, ir.Name) and expr.id not in self.lets:
            return expr.id  # a dtype name, checked statically
        value = self.value(expr)
        if value not in RULE_DTYPE_NAMES:
            raise self.fail(f"expected a dtype name, got {value!r}", expr.span)
        return value

    def namer(self, pattern: ir.Pattern) -> Callable[[dict], str]:
        """The function from a binding's captures to the key a target pattern names: each part's
        text, or `str` of its value (a capture's own value read directly)."""
        key_part = self.key_part
        pieces = [(part.text if isinstance(part, ir.Text) else None,
                   part.expr.id if isinstance(part, ir.Subst) and isinstance(part.expr, ir.Name) else None,
                   part) for part in pattern.parts]

        def name(captures: dict) -> str:
            return "".join([text if text is not None
                            else str(captures[capture]) if capture is not None and capture in captures
                            else key_part(part.expr, captures) for text, capture, part in pieces])
        wanted = [capture for text, capture, _ in pieces if text is None]
        if not wanted or None in wanted:
            return name
        # text and captures alone: one `%` format (`%s` is `str`), `name` when a capture is missing
        template = "".join("%s" if text is None else text.replace("%", "%%") for text, _, _ in pieces)
        get = itemgetter(*wanted)

        def formatted(captures: dict) -> str:
            try:
                found = get(captures)
            except KeyError:
                return name(captures)
            return template % (found if len(wanted) > 1 else (found,))
        return formatted

    def _eval(self, expr: ir.Node, captures: Mapping[str, Value]) -> Value:
        if isinstance(expr, (ir.Int, ir.Float, ir.Bool)):
            return expr.value
        if isinstance(expr, ir.Name):
            if expr.id in captures:
                return captures[expr.id]
            if expr.id in self.lets:
                return self.lets[expr.id]
            if expr.id in RULE_DTYPE_NAMES:
                return expr.id
            raise self.fail(f"unknown name `{expr.id}`", expr.span)
        if isinstance(expr, ir.Config):
            node: Any = self.config
            for key in expr.path:
                if not isinstance(node, Mapping) or key not in node:
                    raise _Missing(expr, "is not in the config")
                node = node[key]
            if node is None:
                raise _Missing(expr, "is null in the config")
            if isinstance(node, str) and node in RULE_DTYPE_NAMES:  # `"dtype": "bfloat16"`
                return node
            if isinstance(node, (Mapping, str)):
                raise self.fail(f"`config.{'.'.join(expr.path)}` is {type(node).__name__}, not a "
                                "number, a boolean, a list or a dtype name", expr.span)
            if type(node) is int and not MIN_INT <= node <= MAX_INT:
                raise self.fail(f"`config.{'.'.join(expr.path)}` is {_digits(node)}, outside the 64-bit "
                                "integer range", expr.span, _INT_HINT, code="E209")
            return list(node) if isinstance(node, (list, tuple)) else node
        if isinstance(expr, ir.List):
            return [self._eval(item, captures) for item in expr.items]
        if isinstance(expr, ir.Coalesce):
            try:
                return self._eval(expr.left, captures)
            except _Missing:
                return self._eval(expr.right, captures)
        if isinstance(expr, ir.Neg):
            return -self._number(expr.operand, captures)
        if isinstance(expr, ir.Not):
            return not self._bool(expr.operand, captures)
        if isinstance(expr, ir.BoolOp):
            left = self._bool(expr.left, captures)
            if expr.op == "and":
                return left and self._bool(expr.right, captures)
            return left or self._bool(expr.right, captures)
        if isinstance(expr, ir.Compare):
            left, right = self._eval(expr.left, captures), self._eval(expr.right, captures)
            if expr.op in ("==", "!="):
                return (left == right) == (expr.op == "==")
            left, right = self._number(expr.left, captures, left), self._number(expr.right, captures, right)
            return {"<": left < right, "<=": left <= right, ">": left > right, ">=": left >= right}[expr.op]
        if isinstance(expr, ir.BinOp):
            left = self._number(expr.left, captures)
            right = self._number(expr.right, captures)
            if expr.op in ("//", "%") and right == 0:
                raise self.fail("division by zero", expr.span)
            result = {"+": lambda: left + right, "-": lambda: left - right, "*": lambda: left * right,
                      "//": lambda: left // right, "%": lambda: left % right}[expr.op]()
            if type(result) is int and not MIN_INT <= result <= MAX_INT:
                raise self.fail(f"`{_text(expr)}` is {_digits(result)}, outside the 64-bit integer range",
                                expr.span, _INT_HINT, code="E209")
            return result
        raise TypeError(f"not an expression: {expr!r}")

    def _number(self, expr: ir.Node, captures, value: Value = None) -> int | float:
        value = self._eval(expr, captures) if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(f"expected a number, got {value!r}", expr.span)
        return value

    def _bool(self, expr: ir.Node, captures) -> bool:
        value = self._eval(expr, captures)
        if not isinstance(value, bool):
            raise self.fail(f"expected true or false, got {value!r}", expr.span)
        return value


_INT_HINT = "integers are 64-bit, from -2^63 to 2^63 - 1; check the config values it reads"


def _digits(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:8]}\u2026 ({len(text)} digits)"


def _names(expr: ir.Node) -> set[str]:
    """The names an expression reads."""
    found, stack = set(), [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, ir.Name):
            found.add(node.id)
        for field in node._compared:
            child = getattr(node, field)
            stack.extend(c for c in (child if isinstance(child, tuple) else (child,)) if isinstance(c, ir.Node))
    return found


def evaluate_lets(statements, config: Mapping[str, Any], line_text) -> dict[str, Value]:
    """The value of every `let`, in program order."""
    lets: dict[str, Value] = {}
    evaluator = Evaluator(config, lets, line_text)
    for statement in statements:
        if isinstance(statement, ir.Let):
            lets[statement.name] = evaluator.value(statement.value)
    return lets
