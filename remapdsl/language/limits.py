"""Bounds on what a rule file from strangers may ask for (docs/errors.md, "Limits"), and the static pass
that holds a program to them before any checkpoint is read (E126, E127, E129, E136), evaluating constant
expressions as compile/evaluate.py would; the compiler holds what only the config tells to them (E209)."""

from __future__ import annotations

import math

from . import ir
from ..dtypes import RULE_DTYPE_NAMES
from ..errors import Span
from .formatter import format_expr

MIN_INT, MAX_INT = -(2**63), 2**63 - 1  # every integer a program computes
MAX_SIZE = 2**48  # a dim's size, an element count, a size or offset argument
MAX_PIECES = 2**16  # what one op cuts a tensor into or copies it to (`times`, `groups`, `n`, `heads`)
MAX_BLOCKS = 2**20  # the pieces (blocks) one runtime tensor is described by, after any op
MAX_OPS = 256  # ops one rule (or macro) expands to through its macros
MAX_INCLUDE_DEPTH = 16  # files nested by `include` below the top-level one

_COUNT_ARGS = frozenset({"times", "groups", "n", "heads"})
_SIZE_ARGS = frozenset({"to", "start", "stop", "sizes", "shape", "size"})

Problem = tuple[str, str, Span | None, str | None]  # code, message, span, hint
_INT_HINT = "integers are 64-bit, from -2^63 to 2^63 - 1"
_NOT_CONSTANT = object()  # the value of an expression that reads the config, a capture or a parameter


def limit_problems(statements: tuple[ir.Statement, ...]) -> list[Problem]:
    """The problems of a flattened (and otherwise checked) program against the limits, in order."""
    return _Pass().run(statements)


def _arg_problem(name: str, value: int) -> str | None:
    """Why an integer given to an op parameter is beyond the limits, or None."""
    if name in _COUNT_ARGS and value > MAX_PIECES:
        return f"`{name}={_short(value)}` is more than 2^16 = {MAX_PIECES}, the most pieces one op makes"
    if name in _SIZE_ARGS and abs(value) > MAX_SIZE:
        return f"`{name}` of {_short(value)} is beyond 2^48 = {MAX_SIZE}, the largest size"
    return None


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:8]}\u2026 ({len(text)} digits)"


class _Problem(Exception):
    """A problem found while folding an expression; its args are (code, message, span[, hint])."""


class _Pass:
    """One walk of the program in order: constant lets, macro sizes, each rule's expanded ops."""

    def __init__(self):
        self.lets: dict[str, object] = {}  # name -> constant value (only constant lets)
        self.macros: dict[str, ir.Macro] = {}
        self.sizes: dict[str, int] = {}  # macro -> ops it expands to
        self.callees: dict[str, dict[str, ir.Macro]] = {}  # macro -> the macros its body calls
        self.too_big: set[str] = set()  # macros already reported as too large
        self.problems: list[Problem] = []

    def run(self, statements) -> list[Problem]:
        for s in statements:
            if isinstance(s, ir.Let):
                value = self.fold(s.value, {})
                if value is not _NOT_CONSTANT and s.name not in self.lets:
                    self.lets[s.name] = value
            elif isinstance(s, ir.Macro):
                self.macro(s)
            elif isinstance(s, ir.Rule):
                self.pipe(s.ops, s.span, "this rule")
                self.fold(s.guard, {})
                for pattern in s.targets:
                    for part in pattern.parts:
                        if isinstance(part, ir.Subst):
                            self.fold(part.expr, {})
            elif isinstance(s, (ir.Dequantize, ir.Quantized)):
                self.fold(s.guard, {})
                for arg in s.format.args:
                    self.fold(arg.value, {})
            elif isinstance(s, (ir.Drop, ir.Keep)):
                self.fold(s.guard, {})
        return self.problems

    # -- ops and macros --

    def size(self, ops) -> int:
        """How many built-in ops a pipe expands to through the macros defined so far."""
        return sum(self.sizes.get(op.name, 1) if isinstance(op, ir.MacroCall) else 1 for op in ops)

    def macro(self, s: ir.Macro) -> None:
        if s.name in self.macros:
            return  # defined twice: reported by the checks (E133)
        size = self.size(s.ops)
        calls = {op.name for op in s.ops if isinstance(op, ir.MacroCall)}
        if size > MAX_OPS and not calls & self.too_big:
            self.too_big.add(s.name)
            self.at(None, "E136", f"macro `{s.name}` expands to {size:,} ops, more than {MAX_OPS}",
                    s.span, "each call of a macro copies its ops; call the macros it uses fewer times")
        elif calls & self.too_big:
            self.too_big.add(s.name)
        # the macros its body calls, as defined above it (a macro defined later is not the one called)
        self.callees[s.name] = {name: self.macros[name] for name in calls if name in self.macros}
        if s.name not in self.too_big:  # as for a pipe: past the limit, its ops are not expanded (2^40 of them)
            self.expand(s.ops, {p: _NOT_CONSTANT for p in s.params}, None, self.callees[s.name])
        self.macros[s.name], self.sizes[s.name] = s, size  # after: a macro cannot call itself

    def pipe(self, ops, span: Span | None, what: str) -> None:
        size = self.size(ops)
        if size > MAX_OPS:
            if not any(isinstance(op, ir.MacroCall) and op.name in self.too_big for op in ops):
                self.at(None, "E136", f"{what} expands to {size:,} ops through its macros, more than "
                        f"{MAX_OPS}", span, "split the work into several rules or smaller macros")
            return
        self.expand(ops, {}, None, self.macros)

    def expand(self, ops, env: dict, call: ir.MacroCall | None, scope: dict[str, ir.Macro]) -> None:
        """Fold the arguments of each op of a pipe, macros with their arguments' values (a problem inside
        a macro's body reported at the outermost call); `scope`: the macros the pipe's calls name."""
        for op in ops:
            if isinstance(op, ir.MacroCall):
                macro = scope.get(op.name)
                if macro is None:
                    continue  # unknown: E134
                args = {p: _NOT_CONSTANT for p in macro.params}
                for position, arg in enumerate(op.args):
                    name = arg.name or (macro.params[position] if position < len(macro.params) else None)
                    if name in args:
                        args[name] = self.fold(arg.value, env, call)
                if call is not None or self.sizes.get(op.name, 1) <= MAX_OPS:
                    self.expand(macro.ops, args, call or op, self.callees[macro.name])
                continue
            for param in op.params:
                value = getattr(op, param.name, None)
                if value is None or param.kind in ("capture", "dtype"):
                    continue
                folded = self.fold(value, env, call)
                items = folded if isinstance(folded, list) else [folded]
                nodes = value.items if isinstance(value, ir.List) and isinstance(folded, list) else [value]
                for item, node in zip(items, nodes):
                    if isinstance(item, int) and not isinstance(item, bool):
                        problem = _arg_problem(param.name, item)
                        if problem:
                            self.at(call, "E129", problem, node.span,
                                    "sizes and counts this large cannot be a model's tensors")

    def at(self, call: ir.MacroCall | None, code: str, message: str, span, hint=None) -> None:
        """Report a problem; one inside a macro's body at the call that expands it."""
        if call is not None:
            message, span = f"{message} (in macro `{call.name}`)", call.span
        self.problems.append((code, message, span, hint))

    # -- constant expressions --

    def fold(self, expr: ir.Node | None, env: dict, call: ir.MacroCall | None = None) -> object:
        """The constant value of an expression (or none), or _NOT_CONSTANT; its problems are reported."""
        try:
            return self.value(expr, env)
        except _Problem as exc:
            self.at(call, *exc.args)
            return _NOT_CONSTANT

    def value(self, expr: ir.Node, env: dict) -> object:
        """As the compiler's evaluator, over constants; raises _Problem where it would fail."""
        if isinstance(expr, ir.Int):
            if not MIN_INT <= expr.value <= MAX_INT:
                raise _Problem("E129", f"the integer {_short(expr.value)} is outside the 64-bit integer "
                               "range", expr.span, _INT_HINT)
            return expr.value
        if isinstance(expr, (ir.Float, ir.Bool)):
            return expr.value
        if isinstance(expr, ir.Name):
            if expr.id in env:
                return env[expr.id]
            if expr.id in self.lets:
                return self.lets[expr.id]
            return expr.id if expr.id in RULE_DTYPE_NAMES else _NOT_CONSTANT
        if isinstance(expr, ir.List):
            items = [self.value(item, env) for item in expr.items]
            return _NOT_CONSTANT if _NOT_CONSTANT in items else items
        if isinstance(expr, ir.Coalesce):  # a constant is never missing: the right side is a default
            left = self.value(expr.left, env)
            return left if left is not _NOT_CONSTANT else self.quiet(expr.right, env)
        if isinstance(expr, ir.Neg):
            operand = self.value(expr.operand, env)
            if operand is _NOT_CONSTANT:
                return operand
            return _checked(-_number(operand, expr.operand, "`-`"), expr)
        if isinstance(expr, ir.Not):
            operand = self.value(expr.operand, env)
            return operand if operand is _NOT_CONSTANT else not _boolean(operand, expr.operand, "`not`")
        if isinstance(expr, ir.BoolOp):
            left = self.value(expr.left, env)
            if left is _NOT_CONSTANT:  # the right side is evaluated only for some values of the left
                self.quiet(expr.right, env)
                return left
            if _boolean(left, expr.left, f"`{expr.op}`") == (expr.op == "or"):
                return left
            right = self.value(expr.right, env)
            return right if right is _NOT_CONSTANT else _boolean(right, expr.right, f"`{expr.op}`")
        if isinstance(expr, ir.Compare):
            left, right = self.value(expr.left, env), self.value(expr.right, env)
            if _NOT_CONSTANT in (left, right):
                return _NOT_CONSTANT
            if expr.op in ("==", "!="):
                return (left == right) == (expr.op == "==")
            a = _number(left, expr.left, f"`{expr.op}`")
            b = _number(right, expr.right, f"`{expr.op}`")
            return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[expr.op]
        if isinstance(expr, ir.BinOp):
            return self.binop(expr, env)
        return _NOT_CONSTANT  # a config read

    def binop(self, expr: ir.BinOp, env: dict) -> object:
        left, right = self.value(expr.left, env), self.value(expr.right, env)
        if _NOT_CONSTANT in (left, right) or not (_is_number(left) and _is_number(right)):
            return _NOT_CONSTANT  # a boolean, list or dtype operand: reported by the checks (E126)
        if expr.op in ("//", "%") and right == 0:
            if isinstance(expr.right, ir.Int):
                return _NOT_CONSTANT  # a literal zero: reported by the checks (E127)
            raise _Problem("E127", f"division by zero: the divisor is {right}", expr.right.span,
                           "the divisor is a constant expression that is zero")
        result = {"+": lambda: left + right, "-": lambda: left - right, "*": lambda: left * right,
                  "//": lambda: left // right, "%": lambda: left % right}[expr.op]()
        return _checked(result, expr)

    def quiet(self, expr: ir.Node, env: dict) -> object:
        """A conditionally evaluated expression: its problems are not certain, so not reported."""
        try:
            self.value(expr, env)
        except _Problem:
            pass
        return _NOT_CONSTANT


def _checked(result, expr: ir.Node):
    if isinstance(result, int):
        if not MIN_INT <= result <= MAX_INT:
            raise _Problem("E129", f"`{format_expr(expr)}` is {_short(result)}, outside the 64-bit integer "
                           "range", expr.span, _INT_HINT)
    elif isinstance(result, float) and not math.isfinite(result):
        raise _Problem("E129", f"`{format_expr(expr)}` is beyond the range of a 64-bit float", expr.span)
    return result


def _number(value, expr: ir.Node, what: str):
    if not _is_number(value):
        raise _Problem("E126", f"{what} needs a number, not {_kind(value)}", expr.span)
    return value


def _boolean(value, expr: ir.Node, what: str) -> bool:
    if not isinstance(value, bool):
        raise _Problem("E126", f"{what} needs true or false, not {_kind(value)}", expr.span)
    return value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value) -> str:
    return {bool: "a boolean", list: "a list", str: "a dtype", float: "a number with a fraction",
            int: "an integer"}[type(value)]
