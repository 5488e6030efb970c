"""Rule-file text -> IR (remapdsl.language.ir) with source spans, comments kept as trivia: Lark's LALR
parser with lexer.py's lexer and builder.py's callbacks (no parse tree), syntax errors worded by syntax.py."""

from __future__ import annotations

import functools
from pathlib import Path

from lark import Lark, UnexpectedInput

from . import ir
from ..errors import Diagnostic, RemapError, RuleSyntaxError
from .builder import Builder
from .comments import attach_trivia
from .context import CONTEXT, Context
from .lexer import RuleLexer
from .syntax import char_span, syntax_diagnostic
from .tables import FILE_NAME, OPTIONS, parser_from_tables

_GRAMMAR_FOLDERS = (
    Path(__file__).parent.parent / "grammars",  # installed wheel
    Path(__file__).parent.parent.parent / "grammars",  # source tree, editable install
)


def grammar_text() -> str:
    """The grammar shipped with the package."""
    text = _shipped("remap.lark")
    if text is None:
        raise FileNotFoundError(f"remap.lark not found in {[str(p) for p in _GRAMMAR_FOLDERS]}")
    return text


@functools.cache
def lark_parser() -> Lark:
    """The parser (immutable, its callbacks stateless), from the tables built with the package, or from
    the grammar where they are missing or not this grammar's and this Lark's."""
    grammar, tables = grammar_text(), _shipped(FILE_NAME)
    parser = tables and parser_from_tables(tables, grammar, RuleLexer, Builder())
    return parser or Lark(grammar, lexer=RuleLexer, transformer=Builder(), **OPTIONS)


def _shipped(name: str) -> str | None:
    for folder in _GRAMMAR_FOLDERS:
        if (folder / name).is_file():
            return (folder / name).read_text(encoding="utf-8")
    return None


def parse_text(text: str, path: str = "<text>") -> ir.RuleFile:
    """Parse the text of one rule file; includes are kept as Include statements, not followed."""
    text = _normalize(text, path)
    context = Context(path=path, lines=text.split("\n"))
    token = CONTEXT.set(context)
    try:
        statements = lark_parser().parse(text)
    except UnexpectedInput as exc:
        if context.diagnostics:  # an error the callbacks found first, on an earlier line
            raise RuleSyntaxError(context.diagnostics) from None
        raise RuleSyntaxError(syntax_diagnostic(exc, text, path, lark_parser())) from None
    finally:
        CONTEXT.reset(token)
    if context.diagnostics:
        raise RuleSyntaxError(context.diagnostics)
    statements, trailing = attach_trivia(statements, text)
    return ir.RuleFile(path=path, statements=statements, trailing=trailing, source=text)


def parse_file(path: str | Path) -> ir.RuleFile:
    """Read and parse one rule file (UTF-8)."""
    return parse_text(read_rule_text(path), str(path))


def read_rule_text(path: str | Path) -> str:
    """A rule file's text as the parser reads it: UTF-8, without a byte-order mark, LF line ends
    (E009 unreadable, E008 not UTF-8, E001 a stray carriage return)."""
    try:
        data = Path(path).read_bytes()
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise RemapError(Diagnostic(code="E009", message=f"cannot read rule file: {reason}",
                                    path=str(path))) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        good = data[: exc.start].decode("utf-8")
        span = char_span(good, len(good), str(path))
        raise RuleSyntaxError(Diagnostic(
            code="E008", message=f"not UTF-8 text: byte {data[exc.start]:#04x} cannot be decoded", span=span,
            line_text=data.split(b"\n")[span.line - 1].decode("utf-8", errors="replace"),
            hint="save the file as UTF-8",
        )) from None
    return _normalize(text, str(path))


def _normalize(text: str, path: str) -> str:
    """Drop a byte-order mark and turn CRLF into LF; a lone CR is an error, not a line break."""
    text = text.removeprefix("\ufeff").replace("\r\n", "\n")
    cr = text.find("\r")
    if cr >= 0:
        span = char_span(text, cr, path)
        raise RuleSyntaxError(Diagnostic(
            code="E001", message="stray carriage return: lines end with LF or CRLF", span=span,
            line_text=text.split("\n")[span.line - 1].replace("\r", " "),
        ))
    return text
