"""Lark's parse failures -> diagnostics in words ("expected `->`", not `ARROW`), with their own codes for
the common mistakes, keyed on the grammar's terminal names (stable when the grammar changes)."""

from __future__ import annotations

import re

from lark import Lark, UnexpectedInput, UnexpectedToken

from ..errors import Diagnostic, Span, suggest
from .nodes import STATEMENT_KEYWORDS

_NAMED = {
    "WORD": "a name",
    "FLOAT": "a number",
    "STRING": 'a quoted path such as "common.remap"',
    "PREFIX_NAME": "a prefix such as `@layer`",
    "BINARY": "an operator",
    "CAPTURE": "a capture such as `{L}`",
    "ALTERNATIVES": "alternatives such as `{q,k,v}`",
    "_NL": "end of line",
    "_CONT": "a `|` line",
    "$END": "end of file",
}
_EXPRESSION_START = {"FLOAT", "LPAR", "LSQB", "NOT", "TRUE", "FALSE"}
_OPERATORS = {"BINARY", "MINUS", "STAR", "OR", "AND"}
_PATTERN_PARTS = {"LBRACE", "STAR", "DOUBLE_STAR", "CAPTURE", "ALTERNATIVES", "PREFIX_NAME"}
_BRACKETS = {"(": ")", "[": "]", "{": "}"}


def syntax_diagnostic(exc: UnexpectedInput, text: str, path: str, parser: Lark) -> Diagnostic:
    """The one diagnostic for a parse failure."""
    lines = text.split("\n")
    if isinstance(exc, UnexpectedToken) and exc.token.type == "$END":
        line = len(lines)
        column = len(lines[-1]) + 1
        found, width, kind = "end of file", 1, "$END"
    else:
        line, column = exc.line, exc.column
        if isinstance(exc, UnexpectedToken):
            kind = exc.token.type
            if kind == "_NL":
                found, width = "end of line", 1
            elif kind == "_CONT":  # the `|` that ends the token
                bar = char_span(text, exc.token.end_pos - 1, path)
                line, column = bar.line, bar.column
                found, width, kind = "`|`", 1, "VBAR"
            else:
                found, width = f"`{exc.token}`", max(len(exc.token.split("\n")[0]), 1)
        else:
            kind = "CHAR"
            char = text[exc.pos_in_stream]
            found, width = _describe_char(char), 1
    line_text = lines[line - 1] if 0 < line <= len(lines) else ""
    before = line_text[: column - 1]
    expected = set(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())

    def diag(code: str, message: str, hint: str | None = None, at: tuple[int, int] | None = None) -> Diagnostic:
        """`at`: the columns it covers on the line, where not the token's."""
        start, end = at or (column, column + width)
        return Diagnostic(code=code, message=message, span=Span(path, line, start, line, end),
                          line_text=line_text, hint=hint)

    opener = _unclosed(line_text)
    if opener is not None and opener[0] < column:
        bracket_column, bracket = opener
        closer = _BRACKETS[bracket]
        what = {"{": "a capture or alternatives", "(": "the argument list", "[": "the list"}[bracket]
        return diag("E003", f"unclosed `{bracket}`: {what} opened here has no `{closer}` on this line",
                    f"close it with `{closer}`", (bracket_column, bracket_column + 1))
    statement = before.strip()
    first_word = statement.split()[0] if statement else ""
    if kind == "CHAR":
        hint = None
        if char == '"':
            return diag("E001", 'unterminated path: this `"` has no closing `"` on the line')
        if char == "'" and first_word == "include":
            hint = 'paths are in double quotes: `include "common.remap"`'
        elif not char.isascii():
            hint = "key patterns and names use ASCII letters, digits, `_` and `.`"
        return diag("E001", f"unexpected character {found}", hint)
    if kind == "VBAR" and statement == "":
        above = _statement_above(lines, line)
        if above is None:
            return diag("E004", "a `|` line continues the statement above it, but there is none",
                        "start the rule on the line above, or remove the `|`")
        return diag("E004", f"a `|` line continues the statement above it, but that is a `{above}`, "
                    "which takes no ops", "only mapping rules, `dequantize`, `quantized` and `macro` take `| op`")
    if kind == "VBAR":
        return diag("E004", "only mapping rules, `dequantize`, `quantized` and `macro` take `| op`")
    if statement.endswith("|") and kind in ("_NL", "$END"):
        return diag("E005", "expected an op after `|`", "for example `| cast(bfloat16)`")
    if statement in _EXAMPLES and kind in ("_NL", "$END"):
        return diag("E006", f"`{statement}` needs {_EXAMPLES[statement][0]}",
                    f"for example `{_EXAMPLES[statement][1]}`")
    if kind == "ARROW" and first_word in ("drop", "keep"):
        return diag("E006", f"`{first_word}` takes key patterns only, no target",
                    f"to rename, write a rule without `{first_word}`")
    if kind == "ARROW" and statement == "":
        return diag("E006", "a rule needs source patterns before `->`")
    if kind == "BINARY" and found == "`//`" and statement == "":
        return diag("E006", "unexpected `//`", "comments start with `#`")
    if kind == "OPTIONAL" and first_word == "otherwise":
        return diag("E006", "`optional` comes before `otherwise`", "write `optional otherwise ...`")
    if kind == "WHEN" and first_word == "let":
        return diag("E006", "a `let` takes no `when` guard", "for a default, write `config.KEY ?? VALUE`")
    if kind == "EQUAL" and " when " in f" {before} ":
        return diag("E006", "`=` is not a comparison", "compare with `==`")
    if kind == "LPAR" and statement == "cast":
        return diag("E006", "the `cast` statement takes a dtype without parentheses",
                    "write `cast bfloat16` for every rule; `| cast(bfloat16)` casts in one rule's pipe")
    if kind == "STRING" and first_word == "include":
        return diag("E006", "unexpected second path", "one `include` per line")
    if "ARROW" in expected and "->" not in line_text:
        keyword = suggest(first_word, STATEMENT_KEYWORDS)
        if keyword and first_word != keyword and "." not in first_word:
            start = len(before) - len(before.lstrip()) + 1
            return diag("E007", f"unknown statement `{first_word}`", f"did you mean `{keyword}`?",
                        (start, start + len(first_word)))
    if "ARROW" in expected and not expected & {"EQUAL"}:
        if kind == "EQUAL" and line_text[column:column + 1] == ">":
            return diag("E002", "expected `->` between the source and target patterns, found `=>`",
                        "write the arrow as `->`", (column, column + 2))
        gap = _gap(before)
        if kind in ("_NL", "$END") and gap is not None:
            return diag("E002", "expected `->` between the source and target patterns", None, gap)
        return diag("E002", f"expected `->` between the source and target patterns, found {found}",
                    "a rule reads `SOURCES -> TARGETS`; separate several patterns with `,`")
    words = _expected_words(expected, _terminal_words(parser))
    return diag("E006", f"unexpected {found}" + (f"; expected {words}" if words else ""))


_EXAMPLES = {
    "remap": ("a version number", "remap 1"),
    "let": ("a name and a value", "let H = config.hidden_size"),
    "drop": ("a key pattern", "drop model.rotary_emb.inv_freq"),
    "keep": ("a key pattern", "keep layers.{L}.attn.kv_cache"),
    "include": ("a quoted path", 'include "common.remap"'),
    "cast": ("a dtype", "cast bfloat16"),
    "prefix": ("a name and a pair of patterns", "prefix @layer = model.layers.{L} -> layers.{L}"),
    "dequantize": ("sources, a logical key and a format",
                   "dequantize {P:path}.weight, {P}.weight_scale -> {P}.weight | fp8_tensor(to=bfloat16)"),
    "quantized": ("source patterns and a format",
                  "quantized {P:path}.weight, {P}.weight_scale_inv | fp8_block(block=[128, 128])"),
    "macro": ("a name, parameters and ops", "macro swap() = transpose(0, 1)"),
    "optional": ("a rule", "optional {P:path}.bias -> {P}.bias"),
    "otherwise": ("a rule", "otherwise {P:path} -> {P}"),
}


def _gap(before: str) -> tuple[int, int] | None:
    """Columns of the first run of blanks inside the text before the error, if any."""
    stripped = before.rstrip()
    start = len(before) - len(before.lstrip())
    match = re.search(r"[ \t]+", stripped[start:])
    if match is None:
        return None
    return start + match.start() + 1, start + match.end() + 1


def _terminal_words(parser: Lark) -> dict[str, str]:
    words = {t.name: f"`{t.pattern.value}`" if t.pattern.type == "str" else f"`{t.name.lower()}`"
             for t in parser.terminals}  # a pattern's name: the statement keywords (`let(?![...])`)
    return words | _NAMED


def _expected_words(expected: set[str], shown: dict[str, str]) -> str:
    names = set(expected) - {"WS", "COMMENT"}
    groups: list[str] = []
    if "LET" in names:
        groups.append("a statement (a rule, `let`, `drop`, `keep`, `dequantize`, `quantized`, `include`, "
                      "`macro`, `cast` or `prefix`)")
        names -= {"LET", "REMAP", "DROP", "KEEP", "DEQUANTIZE", "QUANTIZED", "INCLUDE", "MACRO", "CAST", "PREFIX",
                  "OPTIONAL", "OTHERWISE", "WORD", "LBRACE", "STAR", "DOUBLE_STAR", "PREFIX_NAME"}
    if {"WORD", "LPAR", "LSQB"} <= names:
        groups.append("an expression")
        names -= _EXPRESSION_START | {"WORD", "MINUS"}
    if "BINARY" in names:
        groups.append("an operator")
        names -= _OPERATORS
    if len(names & _PATTERN_PARTS) >= 2 and "WORD" in names:
        groups.append("a key pattern")
        names -= _PATTERN_PARTS | {"WORD"}
    items = groups + sorted(shown.get(n, n) for n in names)
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
            else:  # `[1, 2)`: the innermost open bracket is the one left unclosed
                return stack[-1] if stack else None
    return stack[0] if stack else None


def char_span(text: str, at: int, path: str) -> Span:
    """The span of the character at index `at` of `text` (or of the end of the text)."""
    line = text.count("\n", 0, at) + 1
    column = at - text.rfind("\n", 0, at)
    return Span(path=path, line=line, column=column, end_line=line, end_column=column + 1)


def _statement_above(lines: list[str], line: int) -> str | None:
    """The keyword of the statement above a line (`rule` for a mapping rule), or None."""
    for previous in reversed(lines[: line - 1]):
        code = previous.split("#", 1)[0].strip()
        if code and not code.startswith("|"):
            word = code.split()[0]
            return word if word in STATEMENT_KEYWORDS else "rule"
    return None
