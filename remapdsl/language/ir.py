"""The typed IR of a rule file: statements and RuleFile (frozen pydantic models), re-exporting the
nodes of nodes.py and the ops of ops.py, so `ir.Concat`, `ir.Pattern` and `ir.Name` all read from here."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, field_validator, model_validator

from .nodes import (
    LANGUAGE_VERSIONS, CAPTURE_TYPES, OPTION_TEXT, identifier_problem, Identifier, Node, Trivia,
    NO_TRIVIA, Int, Float, Bool, Name, Config, List, Neg, Not, BinOp, Compare, BoolOp, Coalesce, Expr,
    Text, Capture, Subst, Alternatives, Star, DoubleStar, PrefixRef, pattern_problems, Pattern,
)
from .ops import (
    Op, Concat, Stack, Unstack, Interleave, Deinterleave, Split, Chunk, Transpose, Permute,
    Reshape, Slice, Pad, Repeat, RopePermute, RopeUnpermute, Cast, Scale, Add, Arg, MacroCall, FormatCall,
    BUILTIN_OPS, OPS_BY_NAME, BUILTIN_FORMAT_NAMES, RESERVED_NAMES, AnyOp,
)

__all__ = [
    "LANGUAGE_VERSIONS", "CAPTURE_TYPES", "OPTION_TEXT", "identifier_problem", "Node", "Trivia", "NO_TRIVIA",
    "Int", "Float", "Bool", "Name", "Config", "List", "Neg", "Not", "BinOp", "Compare", "BoolOp", "Coalesce",
    "Text", "Capture", "Subst", "Alternatives", "Star", "DoubleStar", "PrefixRef", "pattern_problems",
    "Pattern", "Op", "Concat", "Stack", "Unstack", "Interleave", "Deinterleave", "Split", "Chunk",
    "Transpose", "Permute", "Reshape", "Slice", "Pad", "Repeat", "RopePermute", "RopeUnpermute", "Cast",
    "Scale", "Add", "Arg", "MacroCall", "FormatCall", "BUILTIN_OPS", "OPS_BY_NAME", "BUILTIN_FORMAT_NAMES",
    "RESERVED_NAMES", "Statement", "Version", "Let", "Rule", "Drop", "Keep", "Dequantize", "Quantized",
    "Include", "Macro", "CastAll", "Prefix", "AnyStatement", "RuleFile",
]


_PIPE = ("layout", "value", "macro")  # the roles of the ops of a mapping rule or a macro


class Statement(Node):
    """Base of every statement: a node with the comments and blank lines around it. `sides` names its
    pattern fields with their side, `roles` its op field, the roles allowed there and what it is."""

    trivia: Trivia = Field(default=NO_TRIVIA, repr=False)
    sides: ClassVar[tuple[tuple[str, str], ...]] = ()
    roles: ClassVar[tuple[str, tuple[str, ...], str] | None] = None

    @model_validator(mode="after")
    def _sided(self) -> Statement:
        """Sources match keys (captures, wildcards), targets name keys (substitutions); each op's
        role is allowed where it stands."""
        for field, side in self.sides:
            wrong = (Subst,) if side == "source" else (Capture, Star, DoubleStar)
            types: dict[str, str] = {}
            for pattern in _tuple(getattr(self, field)):
                for part in pattern.parts:
                    if isinstance(part, wrong):
                        raise ValueError(f"a {type(part).__name__} cannot stand in a {side} pattern")
                    if isinstance(part, Capture) and types.setdefault(part.name, part.type) != part.type:
                        raise ValueError(f"capture `{part.name}` has two types in one statement")
        for op in self.ops_of():
            if op.role not in self.roles[1]:
                name = getattr(op, "name", None) or op.op_name()
                raise ValueError(f"`{name}` cannot stand in {self.roles[2]}")
        return self

    def patterns_of(self) -> tuple[Pattern, ...]:
        """Every key pattern of the statement, in field order."""
        return tuple(p for field, _ in self.sides for p in _tuple(getattr(self, field)))

    def ops_of(self) -> tuple[AnyOp, ...]:
        """The ops of its pipe (the format of a `dequantize` or `quantized`), () where it has none."""
        return () if self.roles is None else _tuple(getattr(self, self.roles[0]))


def _tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


class Version(Statement):
    """`remap 1`: the language version the file is written in."""

    kind: Literal["version"] = "version"
    number: int

    @field_validator("number")
    @classmethod
    def _known(cls, number: int) -> int:
        if number not in LANGUAGE_VERSIONS:
            raise ValueError(f"unknown language version {number}")
        return number


class Let(Statement):
    kind: Literal["let"] = "let"
    name: Identifier
    value: Expr


class Rule(Statement):
    """`SOURCES -> TARGETS [when GUARD] | op | ...`, optionally `optional` or `otherwise`."""

    kind: Literal["rule"] = "rule"
    sources: tuple[Pattern, ...]
    targets: tuple[Pattern, ...]
    guard: Expr | None = None
    ops: tuple[AnyOp, ...] = ()
    optional: bool = False
    otherwise: bool = False
    sides = (("sources", "source"), ("targets", "target"))
    roles = ("ops", _PIPE, "a mapping rule")


class _Patterns(Statement):
    """`drop` and `keep`: source patterns and a guard."""

    patterns: tuple[Pattern, ...]
    guard: Expr | None = None
    sides = (("patterns", "source"),)


class Drop(_Patterns):
    kind: Literal["drop"] = "drop"


class Keep(_Patterns):
    kind: Literal["keep"] = "keep"


class Dequantize(Statement):
    """`dequantize SOURCES -> LOGICAL | format(...)`: a logical tensor from packed parts."""

    kind: Literal["dequantize"] = "dequantize"
    sources: tuple[Pattern, ...]
    target: Pattern
    guard: Expr | None = None
    format: AnyOp
    optional: bool = False
    sides = (("sources", "source"), ("target", "target"))
    roles = ("format", ("format",), "a dequantize statement")

    @model_validator(mode="after")
    def _needs_to(self) -> Dequantize:
        if not any(a.name == "to" for a in self.format.args):
            raise ValueError("a dequantize statement's format needs `to=`")
        return self


class Quantized(Statement):
    """`quantized SOURCES | format(...)`: these tensors are the parts of quantized weights that the
    rules move as they are (no dequantizing); every cut through the values must fall on a block."""

    kind: Literal["quantized"] = "quantized"
    sources: tuple[Pattern, ...]
    guard: Expr | None = None
    format: AnyOp
    sides = (("sources", "source"),)
    roles = ("format", ("format",), "a quantized statement")


class Include(Statement):
    kind: Literal["include"] = "include"
    path: str

    @field_validator("path")
    @classmethod
    def _quotable(cls, path: str) -> str:
        if not path.strip() or '"' in path or "\n" in path:
            raise ValueError("an include path is non-blank, on one line, without `\"`")
        return path


class Macro(Statement):
    """`macro NAME(params) = op | op ...`: a named op chain with integer parameters."""

    kind: Literal["macro"] = "macro"
    name: Identifier
    params: tuple[Identifier, ...] = ()
    ops: tuple[AnyOp, ...] = Field(min_length=1)
    roles = ("ops", _PIPE, "a macro")

    @field_validator("name")
    @classmethod
    def _not_builtin(cls, name: str) -> str:
        if name in RESERVED_NAMES:
            raise ValueError(f"`{name}` is a built-in op")
        return name

    @field_validator("params")
    @classmethod
    def _once_each(cls, params: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(params)) != len(params):
            raise ValueError(f"parameters repeat a name: {params}")
        return params


class CastAll(Statement):
    """`cast DT`: every floating runtime tensor a mapping rule makes is cast to DT, unless the rule
    casts it itself (one per program)."""

    kind: Literal["cast_all"] = "cast_all"
    dtype: Name  # a dtype or a `let` name


class Prefix(Statement):
    """`prefix @name = SOURCE -> TARGET [when GUARD]`: one definition of `@name`. A statement whose
    patterns start with `@name` stands for itself once per definition, `@name` read as SOURCE on
    the checkpoint side and TARGET on the runtime side, the guards joined (language/prefixes.py)."""

    kind: Literal["prefix"] = "prefix"
    name: Identifier
    source: Pattern
    target: Pattern
    guard: Expr | None = None
    sides = (("source", "source"), ("target", "target"))

    @model_validator(mode="after")
    def _plain(self) -> Prefix:
        if any(isinstance(part, (PrefixRef, Alternatives)) for p in (self.source, self.target) for part in p.parts):
            raise ValueError("a prefix is defined by plain patterns, without another prefix or alternatives")
        return self


AnyStatement = Annotated[
    Union[Version, Let, Rule, Drop, Keep, Dequantize, Quantized, Include, Macro, CastAll, Prefix],
    Field(discriminator="kind"),
]


class RuleFile(Node):
    """One parsed file: its statements in order, and comments after the last one."""

    path: str
    statements: tuple[AnyStatement, ...] = ()
    trailing: tuple[str, ...] = Field(default=(), repr=False)
    source: str = Field(default="", repr=False, exclude=True)

    @model_validator(mode="after")
    def _version_first(self) -> RuleFile:
        if any(isinstance(s, Version) for s in self.statements[1:]):
            raise ValueError("the `remap` version line can only be the first statement")
        return self

    @property
    def version(self) -> int | None:
        first = self.statements[0] if self.statements else None
        return first.number if isinstance(first, Version) else None

    def line_text(self, line: int) -> str | None:
        """The text of a 1-based source line, for diagnostics."""
        lines = self.source.split("\n")
        return lines[line - 1] if 0 < line <= len(lines) else None

