"""Source spans, diagnostics and the RemapError family: every user error, rendered for a person
(file:line:column, the source line with carets, a hint). Errors are collected per pass and raised once.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from collections.abc import Iterable, Sequence
from itertools import groupby
from typing import Annotated, NamedTuple

from pydantic import BaseModel, ConfigDict, GetPydanticSchema, PlainSerializer, field_validator

from .records import record_schema

# What one error may show, so a hostile file or checkpoint cannot make a message unreadable (docs/errors.md)
MAX_SHOWN = 20  # diagnostics of one error
MAX_TEXT = 2000  # characters of a message or hint
MAX_QUOTED = 200  # characters of a quoted `...` key, name or value
MAX_WINDOW = 240  # characters of a long source line shown around the span
ELLIPSIS = "\u2026"


class Span(NamedTuple):
    """A region of a source file: 1-based line and column, end exclusive, columns in characters. A
    named tuple (the parser makes one per token-sized node), in JSON an object (SpanField)."""

    path: str
    line: int
    column: int
    end_line: int
    end_column: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}"


# A span as a pydantic field: a Span taken as it is (a record: one per IR node), one given as an
# object (JSON) or a list validated as pydantic validates a named tuple; written as an object.
SpanField = Annotated[
    Span,
    GetPydanticSchema(lambda source, handler: record_schema(Span, source, handler)),
    PlainSerializer(lambda span: span._asdict(), return_type=dict),
]


class Diagnostic(BaseModel):
    """One error: a stable code (documented in docs/errors.md), a message, where, and a hint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    code: str
    message: str
    span: SpanField | None = None
    line_text: str | None = None
    hint: str | None = None
    path: str | None = None  # for errors about a file or key that have no line (a checkpoint)

    @field_validator("message", "hint")
    @classmethod
    def _bounded(cls, text: str | None) -> str | None:
        return None if text is None else bound_text(text)

    @field_validator("path")
    @classmethod
    def _bounded_path(cls, path: str | None) -> str | None:
        return None if path is None else shorten(path, MAX_QUOTED)

    def render(self) -> str:
        where = str(self.span) if self.span else (self.path or "remapdsl")
        out = [f"{where}: error[{self.code}]: {self.message}"]
        if self.span is not None and self.line_text is not None:
            out.extend(_excerpt(self.span, self.line_text))
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)


class RemapError(Exception):
    """Base of every user-facing error: one or more diagnostics, rendered by str()."""

    def __init__(self, diagnostics: Diagnostic | Sequence[Diagnostic]):
        self.diagnostics: tuple[Diagnostic, ...] = (
            (diagnostics,) if isinstance(diagnostics, Diagnostic) else tuple(diagnostics))
        if not self.diagnostics:
            raise ValueError("RemapError needs at least one diagnostic")
        super().__init__(self.render())

    @property
    def diagnostic(self) -> Diagnostic:
        """The first diagnostic, for callers and tests that expect exactly one."""
        return self.diagnostics[0]

    def __reduce__(self):
        """Rebuilt from its diagnostics and attributes (`failed_ranks`), not the rendered text: DCP
        pickles what a rank raised to send it to the others."""
        return type(self), (self.diagnostics,), self.__dict__ or None

    def render(self) -> str:
        shown = [d.render() for d in self.diagnostics[:MAX_SHOWN]]
        rest = len(self.diagnostics) - MAX_SHOWN
        if rest > 0:
            shown.append(f"{ELLIPSIS} and {rest} more error{'s' if rest > 1 else ''}")
        return "\n\n".join(shown)


class RuleSyntaxError(RemapError):
    """The text of a rule file is not in the language (codes E0xx)."""


class RuleCheckError(RemapError):
    """The rule file parses but says something inconsistent, found without a checkpoint (E1xx)."""


class BindError(RemapError):
    """Rules do not fit the checkpoint or the config (E2xx)."""


class CheckpointError(RemapError):
    """A checkpoint folder, index or safetensors header is malformed (E3xx)."""


def shorten(text: str, limit: int) -> str:
    """Text of at most `limit` characters: its head and tail around an ellipsis when longer."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + ELLIPSIS + text[len(text) - (limit - 1 - head):]


_QUOTED = re.compile(r"`([^`]*)`")


def bound_text(text: str) -> str:
    """A message or hint with each quoted run (`...`) and the whole text within their limits."""
    if len(text) > MAX_QUOTED + 2:
        text = _QUOTED.sub(lambda m: f"`{shorten(m.group(1), MAX_QUOTED)}`", text)
    return shorten(text, MAX_TEXT)


def runs_text(values: Iterable[int]) -> str:
    """Sorted integers without repeats as `0-2, 5`: each run of consecutive ones collapsed."""
    runs = [[v for _, v in run] for _, run in groupby(enumerate(values), lambda iv: iv[1] - iv[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def suggest(word: str, choices: Iterable[str]) -> str | None:
    """The closest of choices to a misspelled word, or None when nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return match[0] if match else None


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """A 'did you mean' hint, or None."""
    best = suggest(word, choices)
    return f"did you mean `{best}`?" if best else None


def _width(text: str) -> int:
    """Display width of text in a terminal: tabs expand to 4, wide characters take two cells."""
    width = 0
    for ch in text:
        if ch == "\t":
            width += 4 - width % 4
        elif not unicodedata.combining(ch):
            width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def _excerpt(span: Span, line_text: str) -> list[str]:
    """The numbered source line and carets under the span (to the line's end if it spans lines); of a
    longer line than MAX_WINDOW, a window around the span's start."""
    text = line_text.rstrip("\r\n")
    number = str(span.line)
    pad = " " * len(number)
    start = max(span.column - 1, 0)
    stop = max(span.end_column - 1 if span.end_line == span.line else len(text), start + 1)
    if len(text) > MAX_WINDOW:
        text, start, stop = _window(text, start, stop)
    lead = _width(text[:start])
    carets = max(_width(text[start:stop]), 1)
    return [f"  {number} | {text.expandtabs(4)}", f"  {pad} | {' ' * lead}{'^' * carets}"]


def _window(text: str, start: int, stop: int) -> tuple[str, int, int]:
    """At most MAX_WINDOW characters of a long line from a little before the span, an ellipsis at each
    cut end; and the span's start and stop within it."""
    first = min(max(start - MAX_WINDOW // 3, 0), max(len(text) - MAX_WINDOW, 0))
    last = min(first + MAX_WINDOW, len(text))
    left = ELLIPSIS if first > 0 else ""
    right = ELLIPSIS if last < len(text) else ""
    shift = len(left) - first
    start = min(start, len(text)) + shift
    stop = min(stop, last) + shift
    return left + text[first:last] + right, start, max(stop, start + 1)
