"""Comments and blank lines of a rule file -> Trivia on the statements and op lines they belong to
(the line below a comment line, the line a trailing comment ends), so `remapdsl fmt` keeps them."""

from __future__ import annotations

from . import ir


def split_comment(line: str) -> tuple[bool, str | None]:
    """(whether the line has code, its comment or None). `#` inside a quoted path is not a comment."""
    quoted = False
    for i, ch in enumerate(line):
        if ch == '"':
            quoted = not quoted
        elif ch == "#" and not quoted:
            return bool(line[:i].strip()), line[i:].rstrip()
    return bool(line.strip()), None


def attach_trivia(
    statements: tuple[ir.Statement, ...], text: str
) -> tuple[tuple[ir.Statement, ...], tuple[str, ...]]:
    """Return the statements with their trivia filled in, and the file's trailing comments."""
    owners = _line_owners(statements)
    leading: dict[tuple[int, int], list[str]] = {}
    trailing: dict[tuple[int, int], str] = {}
    pending: list[str] = []
    for number, line in enumerate(text.split("\n"), start=1):
        has_code, comment = split_comment(line)
        owner = owners.get(number)
        if owner is None:
            if not has_code:
                pending.append(comment if comment is not None else "")
            continue
        if pending:
            leading[owner] = pending
            pending = []
        if comment is not None and has_code:
            trailing[owner] = comment
    result = []
    for s_index, statement in enumerate(statements):
        ops = tuple(_with_trivia(op, [c for c in leading.get((s_index, i), ()) if c], trailing.get((s_index, i)))
                    for i, op in enumerate(statement.ops_of(), start=1))  # blank lines between ops go
        if isinstance(statement, (ir.Dequantize, ir.Quantized)):
            statement = statement.model_copy(update={"format": ops[0]})
        elif ops:
            statement = statement.model_copy(update={"ops": ops})
        first = _collapse(leading.get((s_index, 0), ()), at_start=s_index == 0)
        result.append(_with_trivia(statement, first, trailing.get((s_index, 0))))
    return tuple(result), tuple(_collapse(pending, at_start=not statements, at_end=True))


def _line_owners(statements: tuple[ir.Statement, ...]) -> dict[int, tuple[int, int]]:
    """Line number -> (statement index, 0 for its first line or 1 + index of the op on that line)."""
    owners: dict[int, tuple[int, int]] = {}
    for s_index, statement in enumerate(statements):
        assert statement.span is not None
        owners[statement.span.line] = (s_index, 0)
        for o_index, op in enumerate(statement.ops_of()):
            if op.span is not None and op.span.line != statement.span.line:
                owners[op.span.line] = (s_index, o_index + 1)
    return owners


def _with_trivia(node, leading, trailing):
    if not leading and trailing is None:
        return node
    return node.model_copy(update={"trivia": ir.Trivia(leading=tuple(leading), trailing=trailing)})


def _collapse(lines, at_start: bool = False, at_end: bool = False) -> tuple[str, ...]:
    """Runs of blank lines become one; none at the start or the end of the file."""
    out: list[str] = []
    for line in lines:
        if line == "" and (not out and at_start or out and out[-1] == ""):
            continue
        out.append(line)
    if at_end:
        while out and out[-1] == "":
            out.pop()
    return tuple(out)
