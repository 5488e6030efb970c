"""Static checks of a whole rule program, before any checkpoint is seen (codes E1xx), all reported at
once: names resolve, captures are bound and consumed, list axes match, op arguments have the right
types, and format calls fit the formats' parameters the compile layer passes in."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from . import ir
from ..dtypes import RULE_DTYPE_NAMES as DTYPE_NAMES
from ..errors import Diagnostic, RuleCheckError, Span, did_you_mean, suggest
from ..params import Param
from .formatter import format_expr
from .limits import MAX_OPS, limit_problems
from .literals import op_problems, size_problems

SCALE_DTYPES = ("float32", "e8m0")
_COMBINE = (ir.Concat, ir.Interleave, ir.Stack)  # list axis -> one tensor (without a capture)


def check_program(statements: tuple[ir.Statement, ...], line_text,
                  formats: Mapping[str, tuple[Param, ...]] | None = None) -> None:
    """Raise RuleCheckError with every static problem of the flattened program; `line_text(span)` renders
    a span's line; without `formats` (name -> params), format calls are left unchecked."""
    checker = _Checker(line_text, formats)
    checker.all_lets = {s.name: s.span for s in statements if isinstance(s, ir.Let)}
    for statement in statements:
        checker.statement(statement)
    for problem in limit_problems(statements):  # constants, sizes, macro expansion (limits.py)
        checker.error(*problem)
    if checker.diagnostics:
        raise RuleCheckError(list(dict.fromkeys(checker.diagnostics)))  # a statement a prefix repeats: once


class _Checker:
    def __init__(self, line_text, formats):
        self.line_text = line_text
        self.formats = formats
        self.lets: dict[str, tuple[str, Span | None]] = {}  # defined so far: name -> (type, span)
        self.macros: dict[str, ir.Macro] = {}  # defined so far
        self.bodies: dict[str, tuple[ir.Op, ...]] = {}  # a macro's ops, the macros it calls flattened
        self.diagnostics: list[Diagnostic] = []
        self.firsts: dict[str, Span | None] = {}  # statements a program holds once: the first of each
        self.all_lets: dict[str, Span | None] = {}  # every let of the program, for "defined below"
        self.rule_captures: dict = {}  # captures of the rule being checked, for better messages
        self.unknown_op = False  # an op of the current rule could not be resolved

    def error(self, code: str, message: str, span: Span | None, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(code=code, message=message, span=span, hint=hint,
                                           line_text=self.line_text(span) if span else None))

    # -- statements --

    def statement(self, s: ir.Statement) -> None:
        if isinstance(s, ir.Let):
            self.let(s)
        elif isinstance(s, ir.Macro):
            self.macro(s)
        elif isinstance(s, ir.Rule):
            self.rule(s)
        elif isinstance(s, (ir.Dequantize, ir.Quantized)):
            self.quantized(s)
        elif isinstance(s, ir.CastAll):
            self.typed(s.dtype, "dtype", {}, "cast")
            self.only_one("`cast` statement", "E149", s.span)
        elif isinstance(s, (ir.Drop, ir.Keep)):
            captures = self.captures(s.patterns)
            if s.guard is not None:
                self.expr(s.guard, captures)

    def only_one(self, what: str, code: str, span: Span | None) -> None:
        first = self.firsts.setdefault(what, span)
        if first is not span:
            self.error(code, f"only one {what} is allowed; the first is" + _at(first, span), span)

    def let(self, s: ir.Let) -> None:
        kind = self.expr(s.value, {}, allow_dtype=True)
        if s.name in self.lets:
            _, first = self.lets[s.name]
            self.error("E131", f"`{s.name}` is already defined" + _at(first, s.span),
                       s.span, "give it another name, or remove one of the two")
            return
        self.lets[s.name] = (kind, s.span)

    def macro(self, s: ir.Macro) -> None:
        if s.name in self.macros:
            self.error("E133", f"macro `{s.name}` is already defined"
                       + _at(self.macros[s.name].span, s.span), s.span)
            return
        params = {p: ("int", None) for p in s.params}
        for op in s.ops:
            self.op(op, params)
        self.macros[s.name] = s
        # its ops with the macros it calls flattened (each checked where it was defined), unless past the
        # limit on ops (E136, limits.py): counted first, so no more than the limit is ever built
        parts = [self.bodies.get(op.name, (op,)) if isinstance(op, ir.MacroCall) else (op,) for op in s.ops]
        fits = sum(map(len, parts)) <= MAX_OPS
        self.bodies[s.name] = tuple(o for part in parts for o in part) if fits else s.ops

    def rule(self, s: ir.Rule) -> None:
        if s.otherwise:
            self.only_one("`otherwise` rule", "E107", s.span)
            if len(s.sources) != 1 or len(s.targets) != 1:
                self.error("E108", "an `otherwise` rule has one source pattern and one target", s.span)
        captures = self.captures(s.sources)
        self.rule_captures, self.unknown_op = captures, False
        ops = list(self.expand(s.ops, {}))
        self.rule_captures = {}
        consumed: dict[str, Span | None] = {}
        unstacked: dict[str, Span | None] = {}
        for op in ops:
            if isinstance(op, (ir.Stack, ir.Concat)) and op.capture is not None:
                self.consumed_capture(op, captures, consumed)
            elif isinstance(op, ir.Unstack):
                if op.capture in captures:
                    self.error("E105", f"`unstack({op.capture}, ...)` binds `{op.capture}` for the "
                               "targets, but the sources already bind it", op.span)
                unstacked[op.capture] = op.span
        targets = self.targets(s.targets, captures, unstacked)
        if s.guard is not None:
            self.expr(s.guard, captures)
        for name in unstacked:
            if name not in targets:
                self.error("E105", f"`unstack({name}, ...)` makes one target per `{name}`, so the "
                           f"targets must use `{{{name}}}`", unstacked[name])
        for name, (kind, span) in captures.items():
            if name in consumed and consumed[name] is None:
                continue  # suggested as the name a misspelled op argument meant: reported there
            if name in targets:
                if name in consumed:
                    self.error("E104", f"capture `{name}` is consumed by an op, so it cannot also "
                               "name the target", consumed[name])
            elif name not in consumed:
                self.error("E102", f"capture `{name}` appears only in the sources: every `{name}` "
                           "would write the same target",
                           span, f"consume it with `stack({name}, dim=0)` or `concat({name}, dim=0)`, "
                           f"or use `{{{name}}}` in the targets")
        if not self.unknown_op and not (s.otherwise and (len(s.sources) != 1 or len(s.targets) != 1)):
            self.list_axis(s, ops)

    def quantized(self, s: ir.Dequantize | ir.Quantized) -> None:
        """A `dequantize` (its logical key names every capture) or a `quantized` statement."""
        captures = self.captures(s.sources)
        logical = (s.target,) if isinstance(s, ir.Dequantize) else ()
        targets = self.targets(logical, captures, {})
        if s.guard is not None:
            self.expr(s.guard, captures)
        for name, (_, span) in captures.items() if logical else ():
            if name not in targets:
                self.error("E102", f"capture `{name}` appears only in the sources of a `dequantize`; "
                           "each logical tensor comes from one set of physical tensors", span,
                           f"use `{{{name}}}` in the logical key")
        if any(_list_length(p) != 1 for p in s.sources + logical):
            self.error("E111", f"a `{s.kind}` statement takes no `{{a,b}}` alternatives", s.span)
        self.op(s.format, {})

    # -- captures and targets --

    def captures(self, patterns: tuple[ir.Pattern, ...]) -> dict[str, tuple[str, Span | None]]:
        found: dict[str, tuple[str, Span | None]] = {}
        for pattern in patterns:
            in_pattern: set[str] = set()
            for part in pattern.parts:
                if isinstance(part, ir.Capture):
                    if part.name in in_pattern:
                        self.error("E109", f"capture `{part.name}` appears twice in one pattern",
                                   part.span, "use two names, or compare them in a `when` guard")
                    in_pattern.add(part.name)
                    if part.name in self.lets:
                        self.error("E132", f"capture `{part.name}` has the name of a `let`",
                                   part.span, "rename one of them")
                    found.setdefault(part.name, (part.type, part.span))
        return found

    def consumed_capture(self, op, captures, consumed) -> None:
        name = op.capture
        if name not in captures:
            close = _close_name(name, captures)
            self.error("E103", f"`{op.op_name()}({name}, ...)` names a capture that the sources do "
                       "not bind", op.span, f"did you mean `{close}`?" if close else
                       (f"captures of this rule: {', '.join(captures)}" if captures else None))
            if close:
                consumed[close] = None  # the misspelling is the error; do not report `close` too
            return
        elif captures[name][0] != "int":
            self.error("E103", f"`{op.op_name()}` orders by an integer capture; `{name}` is a "
                       f"{captures[name][0]} capture", op.span)
        elif name in consumed:
            self.error("E103", f"capture `{name}` is consumed twice", op.span)
        consumed[name] = op.span

    def targets(self, patterns, captures, unstacked) -> set[str]:
        """Check target substitutions; return the capture names the targets use."""
        used: set[str] = set()
        bound = captures | {name: ("int", span) for name, span in unstacked.items()}
        for pattern in patterns:
            for part in pattern.parts:
                if not isinstance(part, ir.Subst):
                    continue
                arithmetic = not isinstance(part.expr, ir.Name)
                for name in _names(part.expr):
                    if name.id in bound:
                        used.add(name.id)
                        if arithmetic and bound[name.id][0] != "int":
                            self.error("E106", f"arithmetic needs an integer capture; `{name.id}` is "
                                       f"a {bound[name.id][0]} capture", name.span)
                    elif name.id in self.lets and arithmetic:
                        continue
                    else:
                        close = _close_name(name.id, bound)
                        if close:
                            used.add(close)  # the misspelling is the error, not an unused `close`
                        self.error("E101", f"capture `{name.id}` is used in a target but the sources "
                                   "never bind it", name.span,
                                   f"did you mean `{close}`?" if close else
                                   (f"the sources bind: {', '.join(bound)}" if bound else
                                    "bind it in a source pattern, such as `layers.{L}.weight`"))
        return used

    def list_axis(self, s: ir.Rule, ops: list[ir.Op]) -> None:
        """The sources' list axis must end up as long as the targets' one."""
        length = sum(_list_length(p) for p in s.sources)
        wanted = sum(_list_length(p) for p in s.targets)
        for op in ops:
            if isinstance(op, _COMBINE) and getattr(op, "capture", None) is None:
                if length < 2:
                    self.error("E110", f"`{op.op_name()}` combines several sources, but there is "
                               "only one here", op.span, "list sources with `,` or `{a,b}`")
                length = 1
            elif isinstance(op, (ir.Split, ir.Chunk, ir.Deinterleave)):
                if length != 1:
                    self.error("E110", f"`{op.op_name()}` cuts one source, but there are {length}",
                               op.span, "combine the sources first, or cut each in its own rule")
                    return
                pieces = None
                if isinstance(op, ir.Split) and isinstance(op.sizes, ir.List):
                    pieces, what = len(op.sizes.items), "give `sizes` one entry per target"
                elif isinstance(op, ir.Chunk) and isinstance(op.n, ir.Int):
                    pieces, what = op.n.value, f"write `n={wanted}`"
                if pieces is not None and pieces != wanted:
                    self.error("E111", f"`{op.op_name()}` makes {pieces} piece{'s' if pieces != 1 else ''} "
                               f"but the rule has {wanted} target{'s' if wanted != 1 else ''}",
                               op.span, what)
                    return
                length = wanted
        if length != wanted:
            if wanted == 1:
                hint = "combine them with `concat(dim=...)`, `interleave(dim=..., groups=...)` or `stack(dim=...)`"
            elif length == 1:
                hint = "cut it with `split`, `chunk` or `deinterleave`"
            else:
                hint = "alternatives on both sides pair up by position, so their counts must match"
            many = "s" if length != 1 else ""
            self.error("E111", f"{length} source tensor{many} map{'' if many else 's'} to {wanted} "
                       f"target{'s' if wanted != 1 else ''}, and no op "
                       + ("combines them" if wanted == 1 else "cuts or pairs them"), s.span, hint)

    # -- ops and expressions --

    def expand(self, ops, params) -> Iterator[ir.Op]:
        """Ops with macro calls replaced by their bodies (macros may only use earlier macros)."""
        for op in ops:
            if not isinstance(op, ir.MacroCall):
                self.op(op, params)
                yield op
                continue
            macro = self.macros.get(op.name)
            if macro is None:
                self.unknown_op = True
                choices = list(ir.OPS_BY_NAME) + list(self.macros)
                self.error("E134", f"unknown op `{op.name}`", op.span,
                           did_you_mean(op.name, choices) or f"ops: {', '.join(sorted(ir.OPS_BY_NAME))}")
                continue
            self.macro_args(op, macro, params)
            yield from self.bodies[op.name]

    def macro_args(self, call: ir.MacroCall, macro: ir.Macro, params) -> None:
        given: set[str] = set()
        for position, arg in enumerate(call.args):
            name = arg.name or (macro.params[position] if position < len(macro.params) else None)
            if name is None:
                self.error("E135", f"macro `{macro.name}` takes {len(macro.params)} argument(s)",
                           arg.span, f"it is `{macro.name}({', '.join(macro.params)})`")
                continue
            if name not in macro.params:
                self.error("E135", f"macro `{macro.name}` has no parameter `{name}`", arg.span,
                           did_you_mean(name, macro.params)
                           or f"it is `{macro.name}({', '.join(macro.params)})`")
                continue
            if name in given:
                self.error("E135", f"argument `{name}` is given twice", arg.span)
            given.add(name)
            self.typed(arg.value, "int", params, arg.name or name)
        for missing in [p for p in macro.params if p not in given]:
            self.error("E135", f"macro `{macro.name}` needs argument `{missing}`", call.span)

    def format_call(self, call: ir.FormatCall, params) -> None:
        """A format of that name, its arguments known, each once, the required ones given, each of its kind."""
        if self.formats is None:
            return
        known = sorted(self.formats)
        if call.name not in known:
            self.error("E035", f"`{call.name}` is not a quantized format", call.span,
                       did_you_mean(call.name, known) or f"formats: {', '.join(known)}")
            return
        declared = self.formats[call.name]
        names = [p.name for p in declared]
        given: dict[str, ir.Node] = {}
        for position, arg in enumerate(call.args):
            if arg.name is None and any(a.name for a in call.args[:position]):
                self.error("E128", "a positional argument cannot follow a keyword argument", arg.span)
                continue
            name = arg.name or (names[position] if position < len(names) else None)
            if name is None or name not in names:
                self.error("E128", f"format `{call.name}` has no parameter `{arg.name or position + 1}`",
                           arg.span, did_you_mean(arg.name or "", names)
                           or f"it takes {', '.join(names)}")
                continue
            if name in given:
                self.error("E128", f"argument `{name}` is given twice", arg.span)
            given.setdefault(name, arg.value)
            kind = declared[names.index(name)].kind
            if kind != "capture":
                self.typed(arg.value, kind, params, name)
        for missing in [p.name for p in declared if p.required and p.name not in given and p.name != "to"]:
            self.error("E128", f"format `{call.name}` needs argument `{missing}`", call.span)
        for param in declared:
            if param.sizes and isinstance(given.get(param.name), ir.List):
                for problem in size_problems(param, given[param.name]):
                    self.error(*problem)

    def op(self, op: ir.Op, params) -> None:
        """One op's arguments: a macro call's, a format's, or a built-in op's declared ones."""
        if isinstance(op, ir.MacroCall):
            list(self.expand((op,), params))
            return
        if isinstance(op, ir.FormatCall):
            self.format_call(op, params)
            return
        for param in op.params:
            value = getattr(op, param.name)
            if value is None or param.kind == "capture":
                continue
            self.typed(value, param.kind, params, param.name)
        for problem in op_problems(op):
            self.error(*problem)

    def typed(self, value: ir.Node, kind: str, params, name: str) -> None:
        """Check one argument against the kind its parameter declares."""
        if kind in ("dtype", "scale_dtype"):
            choices, what, example = {"dtype": (DTYPE_NAMES, "dtype", "bfloat16"),
                                      "scale_dtype": (SCALE_DTYPES, "scale type", "float32")}[kind]
            if (kind == "dtype" and isinstance(value, ir.Name) and value.id in self.lets
                    and self.lets[value.id][0] in ("dtype", "unknown")):
                return
            if not isinstance(value, ir.Name) or value.id not in choices:
                if isinstance(value, ir.Name):
                    message = f"unknown {what} `{value.id}`"
                    hint = did_you_mean(value.id, choices)
                else:
                    message = (f"`{name}` takes a {what} name such as `{example}`, "
                               f"not `{format_expr(value)}`")
                    hint = None
                self.error("E121", message, value.span,
                           hint or f"{what}s: {', '.join(choices)} (docs/language.md)")
            return
        found = self.expr(value, params)
        ok, wanted = _ARG_KINDS[kind]
        if found not in ok:
            self.error("E120", f"`{name}` takes {wanted}, not {_A[found]}", value.span)
        elif kind == "ints" and isinstance(value, ir.List):
            for item in value.items:
                if self.expr(item, params) not in ("int", "unknown"):
                    self.error("E120", f"`{name}` takes a list of integers", item.span)

    def expr(self, expr: ir.Node, names, allow_dtype: bool = False) -> str:
        """Resolve the names of an expression and infer its type (or 'unknown' for config reads); `names`:
        what it may read besides the lets (a rule's captures, a macro's parameters), name -> (type, span)."""
        if isinstance(expr, (ir.Int, ir.Float, ir.Bool)):
            return expr.kind  # "int", "float", "bool"
        if isinstance(expr, ir.Config):
            return "unknown"
        if isinstance(expr, ir.Name):
            if expr.id in names:
                return "int" if names[expr.id][0] == "int" else "unknown"
            if expr.id in self.lets:
                return self.lets[expr.id][0]
            if allow_dtype and expr.id in DTYPE_NAMES:
                return "dtype"
            if expr.id in self.all_lets and self.all_lets[expr.id] is not None:
                below = self.all_lets[expr.id]
                where = f"line {below.line}" if below.path == expr.span.path else str(below)
                self.error("E130", f"`{expr.id}` is used before its `let` ({where})", expr.span,
                           "a `let` can only use names defined above it; move the `let` up")
                return "unknown"
            if expr.id in self.rule_captures:
                self.error("E130", f"`{expr.id}` is a capture of this rule; op arguments cannot use "
                           "captures", expr.span, "op arguments are integers: numbers, `let`s, "
                           "`config.KEY`")
                return "unknown"
            choices = list(self.lets) + list(names)
            hint = did_you_mean(expr.id, choices + (list(DTYPE_NAMES) if allow_dtype else []))
            self.error("E130", f"unknown name `{expr.id}`", expr.span,
                       hint or "names are `let`s defined above, this rule's captures, or `config.KEY`")
            return "unknown"
        if isinstance(expr, ir.List):
            for item in expr.items:
                self.expr(item, names, allow_dtype)
            return "list"
        if isinstance(expr, ir.Neg):
            return self.expr(expr.operand, names)
        if isinstance(expr, (ir.Not, ir.Compare, ir.BoolOp)):
            for child in expr.children():
                self.expr(child, names)
            return "bool"
        if isinstance(expr, ir.BinOp):
            left = self.expr(expr.left, names)
            right = self.expr(expr.right, names)
            for side, kind in ((expr.left, left), (expr.right, right)):
                if kind in ("bool", "list", "dtype"):
                    self.error("E126", f"`{expr.op}` needs numbers, not {_A[kind]}", side.span)
                    return "unknown"
            if expr.op in ("//", "%") and isinstance(expr.right, ir.Int) and expr.right.value == 0:
                self.error("E127", "division by zero", expr.right.span)
            if "float" in (left, right):
                return "float" if expr.op != "//" else "int"
            return "unknown" if "unknown" in (left, right) else "int"
        if isinstance(expr, ir.Coalesce):
            left = self.expr(expr.left, names, allow_dtype)
            right = self.expr(expr.right, names, allow_dtype)
            return right if left == "unknown" else left
        raise TypeError(f"not an expression: {expr!r}")


_ARG_KINDS = {  # a parameter's kind -> the types that fit it, and what it takes in words
    "int": (("int", "unknown"), "an integer"),
    "number": (("int", "float", "unknown"), "a number"),
    "ints": (("list", "unknown"), "a list of integers"),
}
_A = {"int": "an integer", "float": "a number with a fraction", "bool": "a boolean",
      "list": "a list", "dtype": "a dtype", "unknown": "an unknown value"}


def _names(expr: ir.Node) -> Iterator[ir.Name]:
    if isinstance(expr, ir.Name):
        yield expr
    for child in expr.children():
        yield from _names(child)


def _list_length(pattern: ir.Pattern) -> int:
    """How many keys one binding of a pattern names: the product of its alternatives."""
    return math.prod(len(part.options) for part in pattern.parts if isinstance(part, ir.Alternatives))


def _close_name(name: str, choices) -> str | None:
    """A capture the misspelled `name` most likely meant, ignoring case first."""
    return next((c for c in choices if c.lower() == name.lower()), None) or suggest(name, choices)


def _at(first: Span | None, here: Span | None) -> str:
    """` on line N` for the same file, ` at path:line:col` for another."""
    if first is None:
        return ""
    if here is not None and first.path == here.path:
        return f" on line {first.line}"
    return f" at {first}"
