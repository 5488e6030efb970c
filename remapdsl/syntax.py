"""Lark's parse failures -> diagnostics in words: what was found, what was expected, a likely fix.

Lark reports terminal names (`__ANON_0`, `_NL`); a model author should read "expected `->`".
The common mistakes get their own codes and messages: a missing arrow, an unclosed bracket, a `|`
that continues nothing, an op missing after `|`, a misspelled statement keyword.
"""

from __future__ import annotations

from lark import Lark, UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from .errors import Diagnostic, Span, did_you_mean

STATEMENT_KEYWORDS = ("remap", "let", "drop", "keep", "dequantize", "include", "macro",
                      "optional", "otherwise")
_NAMED = {
    "WORD": "a name",
    "FLOAT": "a number",
    "STRING": 'a quoted path such as "common.remap"',
    "COMPARE": "a comparison",
    "_NL": "end of line",
    "_CONT": "a `|` line",
    "$END": "end of file",
}
_EXPRESSION_START = {"FLOAT", "LPAR", "LSQB", "NOT", "TRUE", "FALSE"}
_OPERATORS = {"PLUS", "MINUS", "STAR", "PERCENT", "COMPARE", "OR", "AND", "__ANON_1", "__ANON_2"}
_PATTERN_PARTS = {"LBRACE", "STAR", "DOUBLE_STAR"}
_BRACKETS = {"(": ")", "[": "]", "{": "}"}


def syntax_diagnostic(exc: UnexpectedInput, text: str, path: str, parser: Lark) -> Diagnostic:
    """The one diagnostic for a parse failure."""
    lines = text.split("\n")
    shown = _terminal_words(parser)
    if isinstance(exc, UnexpectedToken) and exc.token.type == "$END":
        line = len(lines)
        column = len(lines[-1]) + 1
        found, width, kind = "end of file", 1, "$END"
    else:
        line, column = exc.line, exc.column
        if isinstance(exc, UnexpectedToken):
            kind = exc.token.type
            value = str(exc.token)
            if kind in ("_NL", "_CONT"):
                found, width = ("end of line", 1) if kind == "_NL" else ("a `|` line", 1)
                if kind == "_CONT":
                    line, column = _cont_position(text, exc.token.start_pos)
                    found, kind = "`|`", "VBAR"
            else:
                found, width = f"`{value}`", max(len(value.split("\n")[0]), 1)
        else:
            kind = "CHAR"
            char = text[exc.pos_in_stream]
            found, width = _describe_char(char), 1
    line_text = lines[line - 1] if 0 < line <= len(lines) else ""
    span = Span(path=path, line=line, column=column, end_line=line, end_column=column + width)
    before = line_text[: column - 1]
    expected = set(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())

    def diag(code: str, message: str, hint: str | None = None, at: Span | None = None) -> Diagnostic:
        return Diagnostic(code=code, message=message, span=at or span, line_text=line_text, hint=hint)

    opener = _unclosed(line_text)
    if opener is not None and opener[0] < column:
        bracket_column, bracket = opener
        closer = _BRACKETS[bracket]
        at = Span(path=path, line=line, column=bracket_column, end_line=line,
                  end_column=bracket_column + 1)
        what = {"{": "a capture or alternatives", "(": "the argument list", "[": "the list"}[bracket]
        return diag("E003", f"unclosed `{bracket}`: {what} opened here has no `{closer}` on this line",
                    f"close it with `{closer}`", at)
    if kind == "CHAR":
        hint = None
        if not text[exc.pos_in_stream].isascii():
            hint = "key patterns and names use ASCII letters, digits, `_` and `.`"
        elif text[exc.pos_in_stream] in "=-" and "->" in line_text[column - 1:column + 2]:
            hint = "write the arrow as `->`"
        return diag("E001", f"unexpected character {found}", hint)
    if kind == "VBAR" and before.strip() == "":
        if not _code_above(lines, line):
            return diag("E004", "a `|` line continues the statement above it, but there is none",
                        "start the rule on the line above, or remove the `|`")
        return diag("E004", "a `|` line continues the statement above it, but only a mapping "
                    "rule, a `dequantize` or a `macro` takes ops")
    if kind == "VBAR":
        return diag("E004", "only a mapping rule, a `dequantize` or a `macro` takes `| op`")
    if before.rstrip().endswith("|") and kind in ("_NL", "$END"):
        return diag("E005", "expected an op after `|`", "for example `| cast(bfloat16)`")
    if "__ANON_0" in expected and not expected & {"EQUAL"}:
        first_word = before.split()[0] if before.split() else ""
        hint = did_you_mean(first_word, STATEMENT_KEYWORDS) if "->" not in line_text else None
        if hint:
            hint += " (a statement keyword)"
        elif kind == "EQUAL" or (kind == "MINUS" and line_text[column:column + 1] in (">", " ")):
            hint = "write the arrow as `->`"
        return diag("E002", f"expected `->` between the source and target patterns, found {found}",
                    hint or "a rule reads `SOURCES -> TARGETS`; separate several patterns with `,`")
    words = _expected_words(expected, shown)
    message = f"unexpected {found}"
    if words:
        message += f"; expected {words}"
    hint = None
    if kind == "WORD" and "LET" in expected:
        hint = did_you_mean(str(exc.token), STATEMENT_KEYWORDS)
    return diag("E006", message, hint)


def _terminal_words(parser: Lark) -> dict[str, str]:
    words = dict(_NAMED)
    for terminal in parser.terminals:
        if terminal.name in words:
            continue
        if terminal.pattern.type == "str":
            words[terminal.name] = f"`{terminal.pattern.value}`"
        else:  # statement keywords: `let(?=[ \t])`
            words[terminal.name] = f"`{terminal.name.lower()}`"
    return words


def _terminal_for(parser: Lark, value: str) -> str | None:
    for terminal in parser.terminals:
        if terminal.pattern.type == "str" and terminal.pattern.value == value:
            return terminal.name
    return None


def _expected_words(expected: set[str], shown: dict[str, str]) -> str:
    names = set(expected) - {"WS", "COMMENT"}
    groups: list[str] = []
    if "LET" in names:
        groups.append("a statement (a rule, `let`, `drop`, `keep`, `dequantize`, `include` or `macro`)")
        names -= {"LET", "REMAP", "DROP", "KEEP", "DEQUANTIZE", "INCLUDE", "MACRO", "OPTIONAL",
                  "OTHERWISE", "WORD", "LBRACE", "STAR", "DOUBLE_STAR"}
    if {"WORD", "LPAR", "LSQB"} <= names:
        groups.append("an expression")
        names -= _EXPRESSION_START | {"WORD", "MINUS"}
    if len(names & _OPERATORS) >= 3:
        groups.append("an operator")
        names -= _OPERATORS
    if len(names & _PATTERN_PARTS) >= 2 and "WORD" in names:
        groups.append("more of the key pattern")
        names -= _PATTERN_PARTS | {"WORD"}
    rest = sorted(shown.get(n, n) for n in names)
    items = groups + rest
    if len(items) > 6:
        items = items[:6] + ["..."]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]


def _describe_char(char: str) -> str:
    if char == "\t":
        return "tab"
    if not char.isprintable() or not char.isascii():
        return f"`{char}` (U+{ord(char):04X})" if char.isprintable() else f"U+{ord(char):04X}"
    return f"`{char}`"


def _unclosed(line: str) -> tuple[int, str] | None:
    """The 1-based column and kind of the first bracket of a line that is never closed on it."""
    stack: list[tuple[int, str]] = []
    quoted = False
    for i, ch in enumerate(line):
        if ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch == "#":
            break
        elif ch in _BRACKETS:
            stack.append((i + 1, ch))
        elif ch in _BRACKETS.values():
            if stack and _BRACKETS[stack[-1][1]] == ch:
                stack.pop()
            else:
                return None
    return stack[0] if stack else None


def _cont_position(text: str, start: int) -> tuple[int, int]:
    """Line and column of the `|` that ends a continuation token starting at `start`."""
    bar = text.index("|", start)
    line = text.count("\n", 0, bar) + 1
    return line, bar - (text.rfind("\n", 0, bar) + 1) + 1


def _code_above(lines: list[str], line: int) -> bool:
    for previous in reversed(lines[: line - 1]):
        code = previous.split("#", 1)[0].strip()
        if code:
            return True
    return False
