"""A rule file and its includes -> one checked RuleSet: the flat program the compiler reads. Includes
resolve relative to the including file, inside the root folder (a hostile file cannot pull arbitrary files
into error messages), else name a shipped file; each once, at most MAX_INCLUDE_DEPTH deep, without cycles."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from . import ir
from ..errors import Diagnostic, RemapError, RuleCheckError, Span
from .parser import parse_file, parse_text
from .check import check_program
from .library import display_path, is_name, names_hint, resolve_rules_path, shipped_path
from .limits import MAX_INCLUDE_DEPTH
from .prefixes import expand_prefixes


class RuleSet(BaseModel):
    """A checked rule program: every file read (top-level first) and the flattened statements."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    files: tuple[ir.RuleFile, ...]
    statements: tuple[ir.AnyStatement, ...] = Field(repr=False)

    @property
    def path(self) -> str:
        return self.files[0].path

    def line_text(self, span: Span | None) -> str | None:
        """The source line a span points at, for diagnostics raised by later stages."""
        file = next((f for f in self.files if span is not None and f.path == span.path), None)
        return file.line_text(span.line) if file else None


def load_rules(path: str | os.PathLike, root: str | os.PathLike | None = None) -> RuleSet:
    """Read, parse and statically check a rule file and everything it includes.

    Args:
        path: a .remap file, or the name of a shipped one (`qwen3_moe`; `remapdsl rules` lists them).
        root: the folder includes may not leave (default: the file's folder).
    """
    path = resolve_rules_path(path)  # a shipped name: its file
    top = parse_file(path)
    return _resolve(top, Path(root) if root is not None else Path(path).resolve().parent)


def rule_texts(ruleset: RuleSet) -> list[tuple[str, str]]:
    """(path, text) of every file of a rule program, the top-level one first: all it was made from."""
    return [(f.path, f.source) for f in ruleset.files]


def rules_from_text(text: str, path: str = "<text>", root: str | os.PathLike | None = None) -> RuleSet:
    """Parse and check rules given as text; includes resolve against `root` (default: cwd)."""
    return _resolve(parse_text(text, path), Path(root) if root is not None else Path.cwd())


def _resolve(top: ir.RuleFile, root: Path) -> RuleSet:
    loader = _Includes(root.resolve())
    location = Path(top.path).resolve() if not top.path.startswith("<") else None
    statements = tuple(loader.flatten(top, location, ()))
    files = (top, *loader.files)
    line_text = RuleSet(files=files, statements=()).line_text
    statements, problems = expand_prefixes(statements, line_text)
    if loader.diagnostics or problems:
        raise RuleCheckError(loader.diagnostics + problems)
    check_program(statements, line_text)
    return RuleSet(files=files, statements=statements)


class _Includes:
    """Follows include statements depth-first, in file order."""

    def __init__(self, root: Path):
        self.root = root
        self.files: list[ir.RuleFile] = []
        self.seen: dict[Path, Span | None] = {}
        self.diagnostics: list[Diagnostic] = []

    def error(self, code: str, message: str, statement: ir.Statement, file: ir.RuleFile,
              hint: str | None = None) -> None:
        span = statement.span
        self.diagnostics.append(Diagnostic(code=code, message=message, span=span, hint=hint,
                                           line_text=file.line_text(span.line) if span else None))

    def flatten(self, file: ir.RuleFile, location: Path | None, chain: tuple[Path, ...], depth: int = 0):
        if location is not None:
            self.seen.setdefault(location, None)
        base = location.parent if location is not None else self.root
        for statement in file.statements:
            if isinstance(statement, ir.Version) and chain:
                continue  # an included file's version was checked against the top's below
            if not isinstance(statement, ir.Include):
                yield statement
                continue
            try:
                target = (base / statement.path).resolve()
                exists = target.is_file()
                shipped = shipped_path(statement.path) if not exists else None
            except (OSError, ValueError, RuntimeError) as exc:  # NUL byte, name too long, link loop
                self.error("E141", f"cannot resolve included path `{statement.path}`: {exc}",
                           statement, file)
                continue
            if shipped is not None:  # package data: outside any user's root, and trusted
                target, exists = shipped.resolve(), True
            elif not target.is_relative_to(self.root):
                self.error("E142", f"`{statement.path}` is outside the rules folder "
                           f"{display_path(self.root)}", statement, file,
                           "to allow it, name a wider root: `remapdsl check --root DIR`, or "
                           "`load_rules(path, root=DIR)`")
                continue
            if target in chain or target == location:
                names = " -> ".join(p.name for p in (*chain, location, target) if p is not None)
                self.error("E140", f"include cycle: {names}", statement, file)
                continue
            if depth + 1 > MAX_INCLUDE_DEPTH:
                self.error("E145", f"`{statement.path}` would be included {depth + 1} files deep; includes "
                           f"nest at most {MAX_INCLUDE_DEPTH} deep below the top-level file", statement,
                           file, "include the files from fewer levels")
                continue
            if target in self.seen:
                first = self.seen[target]
                self.error("E143", f"`{statement.path}` is included twice"
                           + (f"; first at {first}" if first else " (it is the top-level file)"),
                           statement, file, "each file is included once; remove one of the includes")
                continue
            if not exists:
                self.error("E141", f"included file `{statement.path}` not found (looked at "
                           f"{display_path(target)})", statement, file,
                           names_hint(statement.path) if is_name(statement.path) else None)
                continue
            self.seen[target] = statement.span
            try:
                included = parse_file(display_path(target))
            except RemapError as exc:  # reported with the other problems of the program
                self.diagnostics.extend(exc.diagnostics)
                continue
            self.files.append(included)
            if None not in (included.version, file.version) and included.version != file.version:
                self.error("E144", f"`{statement.path}` is written for version {included.version}, "
                           f"this file for version {file.version}", statement, file)
            yield from self.flatten(included, target, (*chain, location) if location else chain, depth + 1)
