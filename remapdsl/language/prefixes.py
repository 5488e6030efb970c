"""`prefix @name = SOURCE -> TARGET [when GUARD]` and the statements that use `@name` -> plain statements,
one per definition (E150-E152): `@name` read as SOURCE on the checkpoint side, TARGET on the runtime side
(rule targets, `keep`), the guards joined with `and`. The checks and the compiler see the expansion."""

from __future__ import annotations

from collections import defaultdict

from pydantic import ValidationError

from . import ir
from ..errors import Diagnostic, Span, suggest
from .formatter import format_pattern

MAX_DEFINITIONS = 16  # definitions of one prefix: each repeats every statement that uses it


def expand_prefixes(statements: tuple, line_text) -> tuple[tuple, list[Diagnostic]]:
    """The program with every `@name` statement repeated per definition, and the problems found."""
    definitions: dict[str, list[ir.Prefix]] = defaultdict(list)
    for s in statements:
        if isinstance(s, ir.Prefix):
            definitions[s.name].append(s)
    problems: list[Diagnostic] = []

    def error(code: str, message: str, span: Span | None, hint: str | None = None) -> None:
        problems.append(Diagnostic(code=code, message=message, span=span, hint=hint,
                                   line_text=line_text(span) if span else None))

    for name, defined in definitions.items():
        if len(defined) > MAX_DEFINITIONS:
            error("E152", f"`@{name}` has {len(defined)} definitions, more than {MAX_DEFINITIONS}",
                  defined[MAX_DEFINITIONS].span, "each definition repeats every statement that uses it")
    out = []
    for s in statements:
        used = _used(s)
        if not used:
            out.append(s)
        elif len(used) > 1:
            second = sorted(used)[1]
            error("E151", "a statement uses one prefix, not " + " and ".join(f"`@{n}`" for n in sorted(used)),
                  _ref(s, second), "write the rule once per pair of prefixes, or define one prefix for the pair")
        elif (name := used.pop()) not in definitions:
            close = suggest(name, list(definitions))
            error("E150", f"`@{name}` is no prefix: no `prefix @{name} = ...` defines it", _ref(s, name),
                  f"did you mean `@{close}`?" if close else "define it: `prefix @layer = model.layers.{L} -> layers.{L}`")
        else:
            for d in definitions[name][:MAX_DEFINITIONS]:
                if isinstance(s, ir.Keep) and _matching(d.target.parts) is None:
                    error("E151", f"a `keep` matches runtime keys, and `@{name}` names them by arithmetic "
                          f"(`{format_pattern(d.target)}`)", s.span,
                          "write this `keep` without the prefix, with a capture where the arithmetic is")
                else:
                    try:
                        out.append(_instance(s, d))
                    except ValidationError as exc:  # the statement validators, on what it stands for
                        error("E151", f"with `@{name}` read as `{format_pattern(d.source)}` -> "
                              f"`{format_pattern(d.target)}`, {_reason(exc)}", _ref(s, name),
                              "name the statement's captures apart from the prefix's")
    return tuple(out), problems


def _reason(exc: ValidationError) -> str:
    """What a validator said, without pydantic's own wording around it."""
    return exc.errors()[0]["msg"].removeprefix("Value error, ")


def _ref(s, name: str) -> Span | None:
    """Where a statement first writes `@name` (the statement where no span is known)."""
    return next((part.span for p in s.patterns_of() for part in p.parts
                 if isinstance(part, ir.PrefixRef) and part.name == name and part.span), s.span)


def _used(s) -> set[str]:
    return {part.name for p in s.patterns_of() for part in p.parts if isinstance(part, ir.PrefixRef)}


def _matching(parts: tuple) -> tuple | None:
    """Runtime-side parts as a pattern that matches keys (`{L}` binds L), None where one computes."""
    if any(isinstance(p, ir.Subst) and not isinstance(p.expr, ir.Name) for p in parts):
        return None
    return tuple(ir.Capture(name=p.expr.id, type="int", span=p.span)
                 if isinstance(p, ir.Subst) else p for p in parts)


def _instance(s, d: ir.Prefix):
    """Statement `s` with `@name` read through definition `d`."""
    source, target = d.source.parts, d.target.parts
    as_target = tuple(ir.Subst(expr=ir.Name(id=p.name, span=p.span), span=p.span)
                      if isinstance(p, ir.Capture) else p for p in source)  # a logical key names a key

    def on(pattern: ir.Pattern, parts: tuple) -> ir.Pattern:
        if not pattern.parts or not isinstance(pattern.parts[0], ir.PrefixRef):
            return pattern
        rest = pattern.parts[1:]
        if rest and isinstance(parts[-1], ir.Text):  # `model.layers` + `.x`: one literal part
            joined = ir.Text(text=parts[-1].text + rest[0].text, span=parts[-1].span)
            merged = (*parts[:-1], joined, *rest[1:])
        else:
            merged = (*parts, *rest)
        return ir.Pattern(parts=merged, span=pattern.span)

    # two guards joined: the `and` is written nowhere, so it has no span and is quoted whole, in
    # canonical form (each part keeps its own span for the errors evaluating it raises)
    guard = d.guard if s.guard is None else s.guard if d.guard is None else \
        ir.BoolOp(op="and", left=d.guard, right=s.guard, span=None)
    if isinstance(s, ir.Rule):
        update = {"sources": tuple(on(p, source) for p in s.sources),
                  "targets": tuple(on(p, target) for p in s.targets)}
    elif isinstance(s, (ir.Drop, ir.Keep)):
        parts = source if isinstance(s, ir.Drop) else _matching(target)
        update = {"patterns": tuple(on(p, parts) for p in s.patterns)}
    elif isinstance(s, ir.Dequantize):
        update = {"sources": tuple(on(p, source) for p in s.sources), "target": on(s.target, as_target)}
    else:
        update = {"sources": tuple(on(p, source) for p in s.sources)}
    fields = {name: getattr(s, name) for name in type(s).model_fields}
    return type(s)(**(fields | update | {"guard": guard}))  # a statement of its own, validated as one
