"""The state of one parse (Context: path, lines, diagnostics), set around `Lark.parse` through a
context variable, and the helpers the builder callbacks share: spans, nodes, located problems."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from lark import Token
from pydantic import ValidationError

from . import ir
from ..errors import Diagnostic, Span


@dataclass
class Context:
    """What one parse call collects; set around `Lark.parse` through a context variable."""

    path: str
    lines: list[str]
    diagnostics: list[Diagnostic] = field(default_factory=list)
    reported: set[tuple[int, int]] = field(default_factory=set)  # (line, column) already reported


CONTEXT: contextvars.ContextVar[Context] = contextvars.ContextVar("remapdsl_parse_context")


def span_of(first: Any, last: Any = None) -> Span:
    """The span from the start of `first` to the end of `last` (tokens or nodes with spans)."""
    last = first if last is None else last
    a = first.span if not isinstance(first, Token) else first
    b = last.span if not isinstance(last, Token) else last
    return Span(CONTEXT.get().path, a.line, a.column, b.end_line, b.end_column)


def new(cls: type[ir.Node], **values: Any) -> Any:
    """A node made by its class's constructor, so the IR's validators check it; one they refuse stands in
    unvalidated once this parse has reported an error (without one, it is a bug in the callbacks)."""
    try:
        return cls(**values)
    except ValidationError:
        if not CONTEXT.get().diagnostics:
            raise
        return cls.model_construct(**values)


def error(code: str, message: str, span: Span, hint: str | None = None) -> None:
    """Record a located problem of this parse; all of them are raised together when it ends."""
    ctx = CONTEXT.get()
    ctx.diagnostics.append(Diagnostic(code=code, message=message, span=span, hint=hint,
                                      line_text=ctx.lines[span.line - 1]))


def identifier(token: Token, what: str) -> str | None:
    """The token as a name, or None (reported) when it cannot be one."""
    problem = ir.identifier_problem(str(token))
    if problem:
        error("E017", f"`{token}` is not a valid {what}: {problem}", span_of(token))
        return None
    return str(token)
