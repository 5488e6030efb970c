"""Lark parser callbacks -> IR nodes (remapdsl.language.ir), called while parsing, without a parse tree:
statements and ops here, key patterns in pattern_builder.py, expressions in expr_builder.py. The callbacks
check what the IR validators check first, to report it as located errors, all at the end of the parse."""

from __future__ import annotations

from typing import Any, NamedTuple

from lark import Token, Transformer

from . import ir
from ..errors import Span, did_you_mean, suggest
from .context import error, identifier, new, span_of
from .expr_builder import atom, flat_expression, too_deep
from .pattern_builder import Brace, RawPattern, capture_types, patterns as build_patterns, prefix_name

_INVALID = "<invalid op>"  # stands for a call already reported; never a name, so never looked up


class _Arg(NamedTuple):
    name: Token | None
    value: ir.Node
    span: Span


class Builder(Transformer):
    """The callbacks Lark calls on each reduction, with the list of its children; stateless (the
    parse's state is in the Context). No `v_args`: its wrappers cost a tenth of the parse."""

    # -- file and statements --

    def start(self, children: list) -> tuple[ir.Statement, ...]:
        found = tuple(s for s in children if s is not None)
        for s in found[1:]:
            if isinstance(s, ir.Version):
                error("E032", "the `remap` version line must be the first statement", s.span)
        too_deep(found)
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
        return new(ir.Version, number=int(number), span=span_of(keyword, number))

    def let(self, children: list) -> ir.Let | None:
        keyword, name, value = children
        value = atom(value)
        if identifier(name, "let name") is None:
            return None
        return new(ir.Let, name=str(name), value=value, span=span_of(keyword, value))

    def rule(self, children: list) -> ir.Rule | None:
        optional, otherwise, sources, targets, guard, *ops = children
        first = optional or otherwise or sources[0]
        span = span_of(first, _last(targets[-1], guard, ops))
        types = capture_types(sources)
        built_sources = build_patterns(sources, "source", types)
        built_targets = build_patterns(targets, "target", types)
        _no_formats(ops)
        if None in built_sources or None in built_targets:
            return None
        return new(ir.Rule, sources=built_sources, targets=built_targets,
                   guard=guard, ops=tuple(ops), optional=optional is not None,
                   otherwise=otherwise is not None, span=span)

    def drop(self, children: list) -> ir.Drop | None:
        return _drop_or_keep(ir.Drop, *children)

    def keep(self, children: list) -> ir.Keep | None:
        return _drop_or_keep(ir.Keep, *children)

    def quantized(self, children: list) -> ir.Quantized | None:
        keyword, sources, guard, *ops = children
        span = span_of(keyword, _last(sources[-1], guard, ops))
        built = build_patterns(sources, "source", capture_types(sources))
        fmt = _format(ops, span, "quantized")
        if fmt is None or None in built:
            return None
        return new(ir.Quantized, sources=built, guard=guard, format=fmt, span=span)

    def dequantize(self, children: list) -> ir.Dequantize | None:
        optional, keyword, sources, target, guard, *ops = children
        span = span_of(optional or keyword, _last(target, guard, ops))
        types = capture_types(sources)
        built_sources = build_patterns(sources, "source", types)
        (built_target,) = build_patterns([target], "target", types)
        fmt = _format(ops, span, "dequantize")
        if fmt is None:
            return None
        if not any(arg.name == "to" for arg in fmt.args):
            error("E036", f"`{fmt.name}` in a `dequantize` needs `to=`, the dtype of the logical tensor",
                  fmt.span, f"for example `| {fmt.name}(..., to=bfloat16)`")
            return None
        if None in built_sources or built_target is None:
            return None
        return new(ir.Dequantize, sources=built_sources, target=built_target,
                   guard=guard, format=fmt,
                   optional=optional is not None, span=span)

    def include(self, children: list) -> ir.Include | None:
        keyword, path = children
        value = str(path)[1:-1]
        if not value.strip():
            error("E033", "`include` needs a file path", span_of(path))
            return None
        return new(ir.Include, path=value, span=span_of(keyword, path))

    def cast_all(self, children: list) -> ir.CastAll | None:
        keyword, word = children
        value = atom(word)
        if not isinstance(value, ir.Name):
            error("E121", f"`cast` takes a dtype name or a `let` name, not `{word}`", span_of(word),
                  "for the config's dtype: `let DT = config.torch_dtype ?? bfloat16`, then `cast DT`")
            return None
        return new(ir.CastAll, dtype=value, span=span_of(keyword, value))

    def prefix(self, children: list) -> ir.Prefix | None:
        keyword, name, source, target, guard = children
        if prefix_name(name) is None:
            return None
        types = capture_types([source])
        (built_source,) = build_patterns([source], "source", types)
        (built_target,) = build_patterns([target], "target", types)
        if built_source is None or built_target is None:
            return None
        for pattern in (built_source, built_target):
            if any(isinstance(part, ir.PrefixRef) for part in pattern.parts):
                error("E151", "a prefix is defined by plain patterns, not by another prefix", pattern.span)
                return None
            if any(isinstance(part, ir.Alternatives) for part in pattern.parts):
                error("E151", "a prefix holds no `{a,b}` alternatives", pattern.span,
                      "define the prefix once per choice: each definition repeats the statements that use it")
                return None
        return new(ir.Prefix, name=str(name)[1:], source=built_source, target=built_target,
                   guard=guard, span=span_of(keyword, _last(target, guard, ())))

    def macro(self, children: list) -> ir.Macro | None:
        keyword, name, *rest = children
        params = [p for p in rest if isinstance(p, Token)]
        ops = tuple(op for op in rest if isinstance(op, ir.Op))
        ok = identifier(name, "macro name") is not None
        if str(name) in ir.RESERVED_NAMES:
            error("E033", f"`{name}` is a built-in op; a macro needs another name", span_of(name))
            ok = False
        seen: set[str] = set()
        for p in params:
            ok = identifier(p, "macro parameter") is not None and ok
            if str(p) in seen:
                error("E033", f"macro parameter `{p}` is declared twice", span_of(p))
                ok = False
            seen.add(str(p))
        _no_formats(ops)
        if not ok:
            return None
        return new(ir.Macro, name=str(name), params=tuple(str(p) for p in params), ops=ops,
                   span=span_of(keyword, ops[-1]))

    def guard(self, children: list) -> ir.Node:
        (expr,) = children
        return atom(expr)

    # -- ops --

    def keyword_arg(self, children: list) -> _Arg:
        name, value = children
        value = atom(value)
        return _Arg(name, value, span_of(name, value))

    def positional_arg(self, children: list) -> _Arg:
        (value,) = children
        value = atom(value)
        return _Arg(None, value, value.span)

    def op(self, children: list) -> ir.Op:
        name, *args, close = children
        given = [a for a in args if a is not None]
        span = span_of(name, close)
        cls = ir.OPS_BY_NAME.get(str(name))
        if cls is None:  # a macro's or a format's: a built-in format's name makes a FormatCall
            if identifier(name, "op name") is None:
                return new(ir.MacroCall, name=_INVALID, span=span)
            for a in given:
                if a.name is not None:
                    identifier(a.name, "argument name")
            call = ir.FormatCall if str(name) in ir.BUILTIN_FORMAT_NAMES else ir.MacroCall
            return new(call, name=str(name), span=span, args=tuple(
                new(ir.Arg, name=str(a.name) if a.name else None, value=a.value, span=a.span)
                for a in given))
        fields = _bind_args(cls, name, given, span)
        if any(p.required and p.name not in fields for p in cls.params):  # reported
            return new(ir.MacroCall, name=_INVALID, span=span)
        return new(cls, span=span, **fields)

    # -- patterns --

    def patterns(self, children: list) -> list[RawPattern]:
        return children

    def pattern(self, children: list) -> RawPattern:
        items = tuple(children)
        return RawPattern(items, span_of(items[0], items[-1]))

    def brace(self, children: list) -> Brace:
        open_, body, close = children
        kind, value = body
        return Brace(kind, value, open_.start_pos, close.end_pos, span_of(open_, close))

    def brace_expr(self, children: list) -> tuple[str, Any]:
        (expr,) = children
        if isinstance(expr, Token) and expr.type == "WORD" and not expr.isdigit() and "." not in expr \
                and identifier(expr, "capture name") is None:
            return ("bad", None)
        return ("expr", atom(expr))

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
        return flat_expression(tuple(children))

    def paren(self, children: list) -> ir.Node:
        (expr,) = children
        return atom(expr)

    def list(self, children: list) -> ir.List:
        open_, *items, close = children
        values = tuple(atom(i) for i in items if i is not None)
        return new(ir.List, items=values, span=span_of(open_, close))


# ---- helpers of the callbacks --------------------------------------------------------------


def _no_formats(ops: tuple) -> None:
    """A built-in quantized format called in a pipe (a rule's or a macro's) is an error (E037)."""
    for op in ops:
        if isinstance(op, ir.FormatCall):
            error("E037", f"`{op.name}` is a quantized format: it belongs in a `dequantize` statement",
                  op.span)


def _drop_or_keep(statement: type[ir.Drop | ir.Keep], keyword, patterns, guard) -> ir.Drop | ir.Keep | None:
    built = build_patterns(patterns, "source", capture_types(patterns))
    if None in built:
        return None
    return new(statement, patterns=built, guard=guard, span=span_of(keyword, _last(patterns[-1], guard, ())))


def _format(ops: tuple, span, statement: str) -> ir.FormatCall | None:
    """The one format of a `dequantize` or `quantized` statement, or None (reported); any call that is not
    a built-in op is a FormatCall, its name looked up by the static checks."""
    if len(ops) != 1:
        where = ops[1].span if len(ops) > 1 else span
        error("E034", f"a `{statement}` statement names exactly one format after `|`, found {len(ops)}",
              where, "the format's `to=` sets the dtype, for example `| fp8_block(block=[128, 128], to=bfloat16)`"
              if statement == "dequantize" else "for example `| fp8_block(block=[128, 128])`")
        return None
    (fmt,) = ops
    if isinstance(fmt, ir.FormatCall):  # a built-in format
        return fmt
    if not isinstance(fmt, ir.MacroCall):  # a built-in layout or value op
        known = ir.BUILTIN_FORMAT_NAMES
        error("E035", f"`{fmt.op_name()}` is not a quantized format", fmt.span,
              did_you_mean(fmt.op_name(), known) or f"formats: {', '.join(known)}")
        return None
    if fmt.name == _INVALID:  # a call already reported
        return None
    return new(ir.FormatCall, name=fmt.name, args=fmt.args, span=fmt.span)


def _last(last_pattern, guard, ops):
    """What a statement's span ends on: its last op, else its guard, else its last pattern."""
    if ops:
        return ops[-1]
    return guard if guard is not None else last_pattern


def _bind_args(cls: type[ir.Op], name: Token, args: list[_Arg], span: Span) -> dict:
    """Map written arguments onto the op's declared parameters, reporting arity errors."""
    params = cls.params
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
            param = next((p for p in params if p.name == str(arg.name)), None)
            if param is None:
                close = suggest(str(arg.name), [p.name for p in params])
                if close:
                    suggested.add(close)
                error("E021", f"`{name}` has no argument `{arg.name}`", span_of(arg.name),
                      f"did you mean `{close}`?" if close else f"for example `{usage}`")
                continue
        if param.name in fields:
            error("E022", f"argument `{param.name}` of `{name}` is given twice", arg.span)
            continue
        if param.kind != "capture":
            fields[param.name] = arg.value
        elif isinstance(arg.value, ir.Name):
            fields[param.name] = arg.value.id
        else:
            error("E024", f"argument `{param.name}` takes a capture name such as `E`", arg.span)
    for param in params:
        if param.required and param.name not in fields and param.name not in suggested:
            error("E020", f"`{name}` needs argument `{param.name}`", span, f"for example `{usage}`")
    return fields
