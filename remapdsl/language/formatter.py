"""IR -> canonical rule-file text (docs/language.md, "Canonical form"), with comments kept;
`parse(format(ir)) == ir`. A capture's type is written at its first use only."""

from __future__ import annotations

from . import ir
from .nodes import ATOM, BINARY_LEVELS, COALESCE, COMPARE, NOT, SUM, UNARY

WIDTH = 100
INDENT = "    "


def format_rules(rules: ir.RuleFile) -> str:
    """The canonical text of a rule file, ending in one newline (empty for an empty file)."""
    out: list[str] = []
    for statement in rules.statements:
        out.extend(statement.trivia.leading)
        out.extend(format_statement(statement))
    out.extend(rules.trailing)
    return "\n".join(out) + "\n" if out else ""


def format_statement(statement: ir.Statement) -> list[str]:
    """The lines of one statement, with its comments."""
    head, ops = _head(statement, set())
    trailing = f"  {statement.trivia.trailing}" if statement.trivia.trailing else ""
    op_texts = [format_op(op) for op in ops]
    inline = f"{head} | {op_texts[0]}" if len(ops) == 1 else ""
    if not ops or (len(ops) == 1 and ops[0].trivia == ir.NO_TRIVIA
                   and len(inline) + len(trailing) <= WIDTH):
        return [(inline or head) + trailing]
    lines = [head + trailing]
    for op, text in zip(ops, op_texts):
        lines.extend(INDENT + comment for comment in op.trivia.leading)
        comment = f"  {op.trivia.trailing}" if op.trivia.trailing else ""
        lines.append(f"{INDENT}| {text}{comment}")
    return lines


def _head(statement: ir.Statement, seen: set[str]) -> tuple[str, tuple[ir.Op, ...]]:
    """The statement's first line without ops, and its ops."""
    if isinstance(statement, ir.Version):
        return f"remap {statement.number}", ()
    if isinstance(statement, ir.Let):
        return f"let {statement.name} = {format_expr(statement.value)}", ()
    if isinstance(statement, ir.Include):
        return f'include "{statement.path}"', ()
    if isinstance(statement, ir.CastAll):
        return f"cast {format_expr(statement.dtype)}", ()
    if isinstance(statement, ir.Prefix):
        source, target = format_pattern(statement.source, seen), format_pattern(statement.target, seen)
        return f"prefix @{statement.name} = {source} -> {target}{_guard(statement.guard)}", ()
    if isinstance(statement, (ir.Drop, ir.Keep)):
        word = "drop" if isinstance(statement, ir.Drop) else "keep"
        return f"{word} {_patterns(statement.patterns, seen)}{_guard(statement.guard)}", ()
    if isinstance(statement, ir.Rule):
        prefix = ("optional " if statement.optional else "") + ("otherwise " if statement.otherwise else "")
        sources = _patterns(statement.sources, seen)
        targets = _patterns(statement.targets, seen)
        return f"{prefix}{sources} -> {targets}{_guard(statement.guard)}", statement.ops
    if isinstance(statement, ir.Dequantize):
        prefix = "optional " if statement.optional else ""
        sources = _patterns(statement.sources, seen)
        target = format_pattern(statement.target, seen)
        return f"{prefix}dequantize {sources} -> {target}{_guard(statement.guard)}", (statement.format,)
    if isinstance(statement, ir.Quantized):
        return f"quantized {_patterns(statement.sources, seen)}{_guard(statement.guard)}", (statement.format,)
    if isinstance(statement, ir.Macro):
        head = f"macro {statement.name}({', '.join(statement.params)}) ="
        first, *rest = statement.ops
        return f"{head} {format_op(first)}", tuple(rest)
    raise TypeError(f"not a statement: {statement!r}")


def _guard(guard: ir.Node | None) -> str:
    return f" when {format_expr(guard)}" if guard is not None else ""


def _patterns(patterns: tuple[ir.Pattern, ...], seen: set[str]) -> str:
    return ", ".join(format_pattern(p, seen) for p in patterns)


def format_pattern(pattern: ir.Pattern, seen: set[str] | None = None) -> str:
    """A key pattern; `seen` holds captures already written in this statement (typed once)."""
    seen = set() if seen is None else seen
    out = []
    for part in pattern.parts:
        if isinstance(part, ir.Text):
            out.append(part.text)
        elif isinstance(part, ir.Capture):
            typed = part.type != "int" and part.name not in seen
            seen.add(part.name)
            out.append(f"{{{part.name}:{part.type}}}" if typed else f"{{{part.name}}}")
        elif isinstance(part, ir.Subst):
            out.append(f"{{{format_expr(part.expr)}}}")
        elif isinstance(part, ir.Alternatives):
            out.append("{" + ",".join(part.options) + "}")
        elif isinstance(part, ir.Star):
            out.append("*")
        elif isinstance(part, ir.PrefixRef):
            out.append(f"@{part.name}")
        else:
            out.append("**")
    return "".join(out)


def format_op(op: ir.Op) -> str:
    """`name(args)` in canonical argument order."""
    if isinstance(op, (ir.MacroCall, ir.FormatCall)):
        args = [f"{a.name}={format_expr(a.value)}" if a.name else format_expr(a.value) for a in op.args]
        return f"{op.name}({', '.join(args)})"
    args = []
    positional = True
    for param in op.params:
        value = getattr(op, param.name)
        if value is None:
            positional = False
            continue
        text = value if isinstance(value, str) else format_expr(value)
        if param.positional and positional:
            args.append(text)
        else:
            positional = False
            args.append(f"{param.name}={text}")
    return f"{op.op_name()}({', '.join(args)})"


def format_expr(expr: ir.Node, slot: int = 0) -> str:
    """An expression, parenthesized only where a weaker operand sits in a stronger slot."""
    text, level = _expr(expr)
    return f"({text})" if level < slot else text


def _expr(expr: ir.Node) -> tuple[str, int]:
    if isinstance(expr, (ir.Int, ir.Float)):  # a negative literal (-0.0 too) binds as a unary minus
        text = repr(expr.value)
        return text, (UNARY if text.startswith("-") else ATOM)
    if isinstance(expr, ir.Bool):
        return ("true" if expr.value else "false"), ATOM
    if isinstance(expr, ir.Name):
        return expr.id, ATOM
    if isinstance(expr, ir.Config):
        return "config." + ".".join(expr.path), ATOM
    if isinstance(expr, ir.List):
        return "[" + ", ".join(format_expr(i) for i in expr.items) + "]", ATOM
    if isinstance(expr, ir.Neg):  # its operand is no literal (ir.Neg); a nested minus in parentheses: `-(-x)`
        return "-" + format_expr(expr.operand, UNARY + 1 if isinstance(expr.operand, ir.Neg) else UNARY), UNARY
    if isinstance(expr, ir.Not):
        return "not " + format_expr(expr.operand, NOT), NOT
    if isinstance(expr, (ir.BinOp, ir.BoolOp)):
        level = BINARY_LEVELS[expr.op]
        return f"{format_expr(expr.left, level)} {expr.op} {format_expr(expr.right, level + 1)}", level
    if isinstance(expr, ir.Compare):
        return (f"{format_expr(expr.left, COALESCE)} {expr.op} "
                f"{format_expr(expr.right, COALESCE)}"), COMPARE
    if isinstance(expr, ir.Coalesce):
        return f"{format_expr(expr.left, SUM)} ?? {format_expr(expr.right, COALESCE)}", COALESCE
    raise TypeError(f"not an expression: {expr!r}")
