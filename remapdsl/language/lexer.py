"""Rule-file text -> Lark tokens in one regular-expression pass over the grammar's own terminals, without
parser context (a keyword is a keyword wherever it stands as a whole word)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from lark.exceptions import UnexpectedCharacters
from lark.lexer import Lexer, LexerState, Token

# Expression keywords are plain strings in the grammar; a WORD equal to one of them is retyped.
_KEYWORDS = {"when": "WHEN", "and": "AND", "or": "OR", "not": "NOT", "true": "TRUE", "false": "FALSE"}


class RuleLexer(Lexer):
    """Lark lexer plug-in: one master pattern built from the grammar's terminals."""

    __future_interface__ = 1  # lex(lexer_state, parser_state)

    def __init__(self, lexer_conf):
        terminals = sorted(
            lexer_conf.terminals,
            key=lambda t: (-t.priority, -t.pattern.max_width, -len(t.pattern.value), t.name),
        )
        self.ignore = frozenset(lexer_conf.ignore)
        self.keywords = {word: name for word, name in _KEYWORDS.items()
                         if any(t.name == name for t in terminals)}
        self.pattern = re.compile("|".join(
            f"(?P<{t.name}>{t.pattern.to_regexp()})" for t in terminals
            if t.pattern.value not in _KEYWORDS  # matched as WORD, then retyped
        ))
        self.allowed = {t.name for t in terminals}

    def lex(self, lexer_state: LexerState, parser_state) -> Iterator[Token]:
        text = lexer_state.text
        if not isinstance(text, str):  # Lark >= 1.2 wraps the text
            text = text.text
        pos, line, line_start = 0, 1, 0
        while pos < len(text):
            m = self.pattern.match(text, pos)
            if m is None:
                raise UnexpectedCharacters(text, pos, line, pos - line_start + 1,
                                           allowed=self.allowed, state=parser_state)
            kind, value, stop = m.lastgroup, m.group(), m.end()
            newlines = value.count("\n")
            next_start = text.rindex("\n", pos, stop) + 1 if newlines else line_start  # of the last line
            if kind not in self.ignore:
                if kind == "WORD":
                    kind = self.keywords.get(value, kind)
                yield Token(kind, value, pos, line, pos - line_start + 1, line + newlines,
                            stop - next_start + 1, stop)
            pos, line, line_start = stop, line + newlines, next_start
