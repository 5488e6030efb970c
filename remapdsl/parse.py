"""Rule-file text -> IR (remapdsl.ir) with source spans, comments kept as trivia.

The Lark grammar gives the shape; this module gives it meaning: it merges pattern tokens into
parts (checking that nothing but `,` and `->` separates patterns), resolves capture types, maps op
arguments onto each op's declared parameters, and reports every problem it finds in one error.
Checks that need the whole program (names, captures, includes) live in remapdsl/static.py.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, NamedTuple

from lark import Lark, Token, Transformer, UnexpectedInput, v_args
from lark.exceptions import VisitError

from . import ir
from .errors import Diagnostic, RemapError, RuleSyntaxError, Span, did_you_mean, suggest
from .syntax import syntax_diagnostic
from .trivia import attach_trivia

_DECIMAL = re.compile(r"[0-9]+\.[0-9]+")
_FORMAT_NAMES = sorted(cls.op_name() for cls in ir.BUILTIN_OPS if cls.role == "format")
_GRAMMAR_LOCATIONS = (
    Path(__file__).parent / "grammars" / "remap.lark",  # installed wheel
    Path(__file__).parent.parent / "grammars" / "remap.lark",  # source tree, editable install
)


@functools.cache
def lark_parser() -> Lark:
    """The LALR parser for the grammar, built once (the only module-level state: immutable)."""
    for location in _GRAMMAR_LOCATIONS:
        if location.is_file():
            return Lark(
                location.read_text(encoding="utf-8"),
                parser="lalr",
                lexer="contextual",
                propagate_positions=True,
                maybe_placeholders=True,
            )
    raise FileNotFoundError(f"remap.lark not found in {[str(p) for p in _GRAMMAR_LOCATIONS]}")


def parse_text(text: str, path: str = "<text>") -> ir.RuleFile:
    """Parse the text of one rule file; includes are kept as Include statements, not followed."""
    text = _normalize(text, path)
    try:
        tree = lark_parser().parse(text)
    except UnexpectedInput as exc:
        raise RuleSyntaxError(syntax_diagnostic(exc, text, path, lark_parser())) from None
    builder = _Builder(path, text)
    try:
        statements = builder.transform(tree)
    except VisitError as exc:
        if not builder.diagnostics:  # a node the builder did not expect to fail: our bug
            raise exc.orig_exc from exc
        statements = ()  # a follow-on failure of an error already reported
    if builder.diagnostics:
        raise RuleSyntaxError(builder.diagnostics)
    statements, trailing = attach_trivia(statements, text)
    return ir.RuleFile(path=path, statements=statements, trailing=trailing, source=text)


def parse_file(path: str | Path) -> ir.RuleFile:
    """Read and parse one rule file (UTF-8)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise RemapError(Diagnostic(code="E009", message=f"cannot read rule file: {exc.strerror}",
                                    path=str(path))) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RuleSyntaxError(Diagnostic(
            code="E008", path=str(path),
            message=f"rule files are UTF-8 text; byte {exc.start} is not ({data[exc.start]:#04x})",
        )) from None
    return parse_text(text, str(path))


def _normalize(text: str, path: str) -> str:
    """Drop a byte-order mark and turn CRLF into LF; a lone CR is an error, not a line break."""
    text = text.removeprefix("\ufeff").replace("\r\n", "\n")
    cr = text.find("\r")
    if cr >= 0:
        line = text.count("\n", 0, cr) + 1
        column = cr - (text.rfind("\n", 0, cr) + 1) + 1
        raise RuleSyntaxError(Diagnostic(
            code="E001", message="stray carriage return: lines end with LF or CRLF",
            span=Span(path=path, line=line, column=column, end_line=line, end_column=column + 1),
            line_text=text.split("\n")[line - 1].replace("\r", " "),
        ))
    return text


# ---- intermediate values the builder passes upward -----------------------------------------


class _Brace(NamedTuple):
    kind: str  # "expr", "typed", "alternatives"
    value: Any  # Expr, (name, type) tokens, or option strings
    start: int
    end: int
    span: Span


class _RawPattern(NamedTuple):
    items: tuple[Token | _Brace, ...]
    span: Span


class _Arg(NamedTuple):
    name: Token | None
    value: ir.Node
    span: Span


class _Guard(NamedTuple):
    expr: ir.Node


def _start(item: Token | _Brace) -> int:
    return item.start_pos if isinstance(item, Token) else item.start


def _end(item: Token | _Brace) -> int:
    return item.end_pos if isinstance(item, Token) else item.end


@v_args(meta=True, inline=True)
class _Builder(Transformer):
    """Lark tree -> IR nodes. Collects diagnostics instead of stopping at the first."""

    def __init__(self, path: str, text: str):
        super().__init__()
        self.path = path
        self.lines = text.split("\n")
        self.diagnostics: list[Diagnostic] = []
        self.bad_words: set[tuple[int, int]] = set()  # (line, column) of words already reported

    # -- helpers --

    def _span(self, meta: Any) -> Span:
        return Span(path=self.path, line=meta.line, column=meta.column,
                    end_line=meta.end_line, end_column=meta.end_column)

    def _error(self, code: str, message: str, span: Span, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(code=code, message=message, span=span,
                                           line_text=self.lines[span.line - 1], hint=hint))

    def _identifier(self, token: Token, what: str) -> str | None:
        """The token as a name, or None (reported) when it cannot be one."""
        problem = ir.identifier_problem(str(token))
        if problem:
            self._error("E017", f"`{token}` is not a valid {what}: {problem}", self._span(token))
            return None
        return str(token)

    # -- file and statements --

    def start(self, meta: Any, *statements: ir.Statement | None) -> tuple[ir.Statement, ...]:
        found = tuple(s for s in statements if s is not None)
        for s in found[1:]:
            if isinstance(s, ir.Version):
                self._error("E032", "the `remap` version line must be the first statement", s.span)
        return found

    def version(self, meta: Any, _keyword: Token, number: Token) -> ir.Version | None:
        span = self._span(meta)
        if not number.isdigit():
            self._error("E030", f"`remap` takes a version number, not `{number}`", self._span(number),
                       "write `remap 1`")
            return None
        if int(number) not in ir.LANGUAGE_VERSIONS:
            known = ", ".join(str(v) for v in ir.LANGUAGE_VERSIONS)
            self._error("E031", f"this file is written for language version {int(number)}, but this "
                       f"remapdsl reads version {known}", self._span(number),
                       "upgrade remapdsl, or write the file for a version it knows")
            return None
        return ir.Version(number=int(number), span=span)

    def let(self, meta: Any, _keyword: Token, name: Token, value: ir.Node) -> ir.Let | None:
        if self._identifier(name, "let name") is None:
            return None
        return ir.Let(name=str(name), value=value, span=self._span(meta))

    def rule(self, meta: Any, optional: Token | None, otherwise: Token | None, sources: list,
             targets: list, guard: _Guard | None, *ops: ir.Op) -> ir.Rule | None:
        types = self._capture_types(sources)
        built_sources = self._build_patterns(sources, "source", types)
        built_targets = self._build_patterns(targets, "target", types)
        for op in ops:
            if op.role == "format":
                self._error("E037", f"`{op.op_name()}` is a quantized format: it belongs in a "
                           "`dequantize` statement", op.span)
        if None in built_sources or None in built_targets:
            return None
        return ir.Rule(sources=built_sources, targets=built_targets,
                       guard=guard.expr if guard else None, ops=ops, optional=optional is not None,
                       otherwise=otherwise is not None, span=self._span(meta))

    def drop(self, meta: Any, _keyword: Token, patterns: list, guard: _Guard | None) -> ir.Drop | None:
        built = self._build_patterns(patterns, "source", self._capture_types(patterns))
        if None in built:
            return None
        return ir.Drop(patterns=built, guard=guard.expr if guard else None, span=self._span(meta))

    def keep(self, meta: Any, _keyword: Token, patterns: list, guard: _Guard | None) -> ir.Keep | None:
        built = self._build_patterns(patterns, "source", self._capture_types(patterns))
        if None in built:
            return None
        return ir.Keep(patterns=built, guard=guard.expr if guard else None, span=self._span(meta))

    def dequantize(self, meta: Any, optional: Token | None, keyword: Token, sources: list,
                   target: _RawPattern, guard: _Guard | None, *ops: ir.Op) -> ir.Dequantize | None:
        types = self._capture_types(sources)
        built_sources = self._build_patterns(sources, "source", types)
        (built_target,) = self._build_patterns([target], "target", types)
        formats = _FORMAT_NAMES
        if len(ops) != 1:
            where = ops[1].span if len(ops) > 1 else self._span(meta)
            self._error("E034", "a `dequantize` statement names exactly one format after `|`, "
                       f"found {len(ops)}", where, f"formats: {', '.join(formats)}")
            return None
        (fmt,) = ops
        if fmt.role != "format":
            name = fmt.name if isinstance(fmt, ir.MacroCall) else fmt.op_name()
            self._error("E035", f"`{name}` is not a quantized format", fmt.span,
                       did_you_mean(name, formats) or f"formats: {', '.join(formats)}")
            return None
        if None in built_sources or built_target is None:
            return None
        return ir.Dequantize(sources=built_sources, target=built_target,
                             guard=guard.expr if guard else None, format=fmt,
                             optional=optional is not None, span=self._span(meta))

    def include(self, meta: Any, _keyword: Token, path: Token) -> ir.Include | None:
        value = str(path)[1:-1]
        if not value.strip():
            self._error("E033", "`include` needs a file path", self._span(path))
            return None
        return ir.Include(path=value, span=self._span(meta))

    def macro(self, meta: Any, _keyword: Token, name: Token, *rest: Any) -> ir.Macro | None:
        params = [p for p in rest if isinstance(p, Token)]
        ops = tuple(op for op in rest if isinstance(op, ir.Op))
        ok = True
        if str(name) in ir.OPS_BY_NAME:
            self._error("E033", f"`{name}` is a built-in op; a macro needs another name",
                       self._span(name))
            ok = False
        seen: set[str] = set()
        for p in params:
            self._identifier(p, "macro parameter")
            if str(p) in seen:
                self._error("E033", f"macro parameter `{p}` is declared twice", self._span(p))
                ok = False
            seen.add(str(p))
        if not ok or ir.identifier_problem(str(name)) or any(ir.identifier_problem(str(p)) for p in params):
            self._identifier(name, "macro name")
            return None
        return ir.Macro(name=str(name), params=tuple(str(p) for p in params), ops=ops,
                        span=self._span(meta))

    def guard(self, meta: Any, expr: ir.Node) -> _Guard:
        return _Guard(expr)

    def pipe(self, meta: Any, op: ir.Op) -> ir.Op:
        return op

    # -- ops --

    def keyword_arg(self, meta: Any, name: Token, value: ir.Node) -> _Arg:
        return _Arg(name, value, self._span(meta))

    def positional_arg(self, meta: Any, value: ir.Node) -> _Arg:
        return _Arg(None, value, self._span(meta))

    def op(self, meta: Any, name: Token, *args: _Arg | None) -> ir.Op:
        given = [a for a in args if a is not None]
        cls = ir.OPS_BY_NAME.get(str(name))
        span = self._span(meta)
        if cls is None:
            if self._identifier(name, "op name") is None:
                return ir.MacroCall(name="invalid_op", span=span)
            return ir.MacroCall(name=str(name),
                                args=tuple(ir.Arg(name=str(a.name) if a.name else None,
                                                  value=a.value, span=a.span) for a in given),
                                span=span)
        fields = self._bind_args(cls, name, given, span)
        try:
            return cls(span=span, **fields)
        except (TypeError, ValueError):  # a required field was missing: already reported
            return ir.MacroCall(name="invalid_op", span=span)

    def _bind_args(self, cls: type[ir.Op], name: Token, args: list[_Arg], span: Span) -> dict:
        """Map written arguments onto the op's declared parameters, reporting arity errors."""
        params = cls.params
        names = [p.name for p in params]
        signature = f"`{name}({', '.join(names)})`"
        fields: dict[str, Any] = {}
        seen_keyword = False
        for position, arg in enumerate(args):
            if arg.name is None:
                if seen_keyword:
                    self._error("E023", "a positional argument cannot follow a keyword argument",
                               arg.span, f"the op is {signature}")
                    continue
                if position >= len(params):
                    self._error("E020", f"`{name}` takes at most {len(params)} argument"
                               f"{'s' if len(params) != 1 else ''}, got {len(args)}", arg.span,
                               f"the op is {signature}")
                    continue
                param = params[position]
            else:
                seen_keyword = True
                matches = [p for p in params if p.name == str(arg.name)]
                if not matches:
                    hint = did_you_mean(str(arg.name), names) or f"the op is {signature}"
                    self._error("E021", f"`{name}` has no argument `{arg.name}`", self._span(arg.name),
                               hint)
                    continue
                param = matches[0]
            if param.name in fields:
                self._error("E022", f"argument `{param.name}` of `{name}` is given twice", arg.span)
                continue
            fields[param.name] = self._arg_value(param, arg)
        for param in params:
            if param.required and param.name not in fields:
                self._error("E020", f"`{name}` needs argument `{param.name}`", span,
                           f"the op is {signature}")
        return {k: v for k, v in fields.items() if v is not None}

    def _arg_value(self, param: ir.Param, arg: _Arg) -> Any:
        if param.kind != "capture":
            return arg.value
        if isinstance(arg.value, ir.Name):
            return arg.value.id
        self._error("E024", f"argument `{param.name}` takes a capture name such as `E`", arg.span)
        return None

    # -- patterns --

    def _build_patterns(self, raws: list[_RawPattern], side: str, types: dict[str, str]) -> tuple:
        return tuple(self._pattern_ir(raw, side, types) for raw in raws)

    def _capture_types(self, raws: list[_RawPattern]) -> dict[str, str]:
        """Declared type of each capture in a statement's sources; `int` where none is written."""
        types: dict[str, str] = {}
        declared_at: dict[str, Span] = {}
        for raw in raws:
            for item in raw.items:
                if isinstance(item, _Brace) and item.kind == "typed":
                    name, kind = item.value
                    if str(kind) not in ir.CAPTURE_TYPES:
                        self._error("E012", f"unknown capture type `{kind}`", self._span(kind),
                                   did_you_mean(str(kind), ir.CAPTURE_TYPES)
                                   or "capture types: int (default), seg, path")
                        continue
                    if str(name) in types and types[str(name)] != str(kind):
                        self._error("E018", f"capture `{name}` is declared as `{types[str(name)]}` "
                                   f"at {declared_at[str(name)]} and as `{kind}` here", item.span)
                        continue
                    types[str(name)] = str(kind)
                    declared_at[str(name)] = item.span
        return types

    def _pattern_ir(self, raw: _RawPattern, side: str, types: dict[str, str]) -> ir.Pattern | None:
        items = raw.items
        before = len(self.diagnostics)
        for a, b in zip(items, items[1:]):
            if _end(a) != _start(b):
                gap = Span(path=self.path, line=raw.span.line, column=_column_of(a, "end", raw),
                           end_line=raw.span.line, end_column=_column_of(b, "start", raw))
                self._error("E010", "white space inside a key pattern", gap,
                           "separate patterns with `,`, and sources from targets with `->`")
        parts: list[ir.Node] = []
        spans: list[Span] = []
        text, text_span = "", None
        for item in items:
            if isinstance(item, Token) and item.type == "WORD":
                if not text:
                    text_span = self._span(item)
                text += str(item)
                text_span = text_span.model_copy(update={"end_column": item.end_column})
                continue
            if text:
                parts.append(ir.Text(text=text, span=text_span))
                spans.append(text_span)
                text = ""
            part = self._part(item, side, types)
            if part is None:
                return None
            parts.append(part)
            spans.append(part.span)
        if text:
            parts.append(ir.Text(text=text, span=text_span))
            spans.append(text_span)
        if len(self.diagnostics) > before:
            return None
        for index, message in ir.pattern_problems(tuple(parts)):
            self._error("E016", message, spans[min(index, len(spans) - 1)])
        if len(self.diagnostics) > before:
            return None
        return ir.Pattern(parts=tuple(parts), span=raw.span)

    def _part(self, item: Token | _Brace, side: str, types: dict[str, str]) -> ir.Node | None:
        if isinstance(item, Token):
            span = self._span(item)
            if side == "target":
                self._error("E015", f"`{item}` matches keys, but a target names one key",
                           span, "use a capture from the sources, such as `{L}`")
                return None
            return ir.Star(span=span) if item.type == "STAR" else ir.DoubleStar(span=span)
        if item.kind == "alternatives":
            if len(set(item.value)) != len(item.value):
                self._error("E014", "alternatives repeat a choice", item.span)
                return None
            return ir.Alternatives(options=item.value, span=item.span)
        if item.kind == "typed":
            name, _kind = item.value
            if side == "target":
                self._error("E013", "capture types are declared on the source side",
                           item.span, f"write `{{{name}}}` here")
                return None
            capture = self._identifier(name, "capture name")
            if capture is not None and capture in types:
                return ir.Capture(name=capture, type=types[capture], span=item.span)
            return None  # unknown type, already reported
        expr = item.value
        if side == "target":
            return ir.Subst(expr=expr, span=item.span)
        if isinstance(expr, ir.Name):
            return ir.Capture(name=expr.id, type=types.get(expr.id, "int"), span=item.span)
        if isinstance(expr, ir.Int) and (expr.span.line, expr.span.column) not in self.bad_words:
            self._error("E017", f"`{{{expr.value}}}` is not a capture: capture names start with a "
                       "letter or `_`", item.span)
        elif not isinstance(expr, ir.Int):
            self._error("E011", "arithmetic on captures belongs in targets; a source pattern only "
                       "binds names", item.span)
        return None

    def pattern(self, meta: Any, *items: Token | _Brace) -> _RawPattern:
        return _RawPattern(items, self._span(meta))

    def brace(self, meta: Any, body: tuple[str, Any]) -> _Brace:
        kind, value = body
        return _Brace(kind, value, meta.start_pos, meta.end_pos, self._span(meta))

    def brace_expr(self, meta: Any, expr: ir.Node) -> tuple[str, Any]:
        return ("expr", expr)

    def brace_typed(self, meta: Any, name: Token, kind: Token) -> tuple[str, Any]:
        return ("typed", (name, kind))

    def brace_alternatives(self, meta: Any, *options: Token) -> tuple[str, Any]:
        for option in options:
            if not ir.OPTION_TEXT.fullmatch(option):
                self._error("E016", f"alternative `{option}` has an empty segment", self._span(option))
        return ("alternatives", tuple(str(o) for o in options))

    def patterns(self, meta: Any, *raws: _RawPattern) -> list[_RawPattern]:
        return list(raws)

    # -- expressions --

    def word(self, meta: Any, token: Token) -> ir.Node:
        """A WORD in an expression: an integer, a number, a name, or a `config.a.b` read."""
        span = self._span(meta)
        text = str(token)
        if text.isdigit():
            return ir.Int(value=int(text), span=span)
        if _DECIMAL.fullmatch(text):
            return ir.Float(value=float(text), span=span)
        if text.startswith("config."):
            path = tuple(text[len("config."):].split("."))
            if all(path):
                return ir.Config(path=path, span=span)
        elif not ir.identifier_problem(text):
            return ir.Name(id=text, span=span)
        head = text.split(".")[0]
        if text == "config":
            message, hint = "`config` needs a key", "read a value as `config.hidden_size`"
        elif "." in text and head != "config":
            message = f"`{text}` is not a name: names have no dots"
            hint = (f"did you mean `config.{text.split('.', 1)[1]}`?" if suggest(head, ["config"])
                    else "config values are read as `config.KEY`")
        else:
            message, hint = f"`{text}` is neither a number nor a name", ir.identifier_problem(text)
        self._error("E038", message, span, hint)
        self.bad_words.add((span.line, span.column))
        return ir.Int(value=0, span=span)

    def float(self, meta: Any, token: Token) -> ir.Node:
        value = float(token)
        if value != value or value in (float("inf"), float("-inf")):
            self._error("E038", f"`{token}` is too large a number", self._span(meta))
            value = 0.0
        return ir.Float(value=value, span=self._span(meta))

    def true(self, meta: Any) -> ir.Bool:
        return ir.Bool(value=True, span=self._span(meta))

    def false(self, meta: Any) -> ir.Bool:
        return ir.Bool(value=False, span=self._span(meta))

    def list(self, meta: Any, *items: ir.Node | None) -> ir.List:
        return ir.List(items=tuple(i for i in items if i is not None), span=self._span(meta))

    def neg(self, meta: Any, operand: ir.Node) -> ir.Node:
        span = self._span(meta)
        if isinstance(operand, ir.Int):
            return ir.Int(value=-operand.value, span=span)
        if isinstance(operand, ir.Float):
            return ir.Float(value=-operand.value, span=span)
        return ir.Neg(operand=operand, span=span)

    def not_op(self, meta: Any, operand: ir.Node) -> ir.Not:
        return ir.Not(operand=operand, span=self._span(meta))

    def compare(self, meta: Any, left: ir.Node, op: Token, right: ir.Node) -> ir.Compare:
        return ir.Compare(op=str(op), left=left, right=right, span=self._span(meta))

    def coalesce(self, meta: Any, left: ir.Node, right: ir.Node) -> ir.Coalesce:
        return ir.Coalesce(left=left, right=right, span=self._span(meta))

    def or_op(self, meta: Any, left: ir.Node, right: ir.Node) -> ir.BoolOp:
        return ir.BoolOp(op="or", left=left, right=right, span=self._span(meta))

    def and_op(self, meta: Any, left: ir.Node, right: ir.Node) -> ir.BoolOp:
        return ir.BoolOp(op="and", left=left, right=right, span=self._span(meta))

    def _binop(op: str):  # noqa: N805 - builds methods below
        def method(self: _Builder, meta: Any, left: ir.Node, *rest: Any) -> ir.BinOp:
            right = rest[-1]
            return ir.BinOp(op=op, left=left, right=right, span=self._span(meta))
        return method

    add = _binop("+")
    sub = _binop("-")
    mul = _binop("*")
    floordiv = _binop("//")
    mod = _binop("%")


def _column_of(item: Token | _Brace, which: str, raw: _RawPattern) -> int:
    if isinstance(item, Token):
        return item.end_column if which == "end" else item.column
    return item.span.end_column if which == "end" else item.span.column
