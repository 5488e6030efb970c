"""IR building blocks: Node, Trivia, names, expressions and key patterns (the ops are in ops.py, the
statements in ir.py). Equality and hashing ignore spans and trivia, so `parse(format(ir)) == ir`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal, Union

import functools
import re

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ..errors import SpanField

LANGUAGE_VERSIONS = (1,)
CAPTURE_TYPES = ("int", "seg", "path")
STATEMENT_KEYWORDS = frozenset({"remap", "let", "drop", "keep", "dequantize", "quantized", "include",
                                "macro", "cast", "prefix", "optional", "otherwise"})
KEYWORDS = frozenset({"when", "and", "or", "not", "true", "false", "config"}) | STATEMENT_KEYWORDS
_LEXER_KEYWORDS = frozenset({"when", "and", "or", "not", "true", "false"})  # read as such anywhere
_NUMBER_LIKE = re.compile(r"[0-9]+(\.[0-9]+)?[eE][+-]?[0-9]+")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KEY_TEXT = re.compile(r"[A-Za-z0-9_.]+")
OPTION_TEXT = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


@functools.lru_cache(maxsize=4096)  # a pure function, called for every name the parser meets
def identifier_problem(name: str) -> str | None:
    """Why a name cannot be a let name, capture or macro parameter, or None when it can."""
    if not IDENTIFIER.fullmatch(name):
        return "names start with a letter or `_` and hold only letters, digits and `_`"
    if name in KEYWORDS:
        return f"`{name}` is a keyword"
    return None


def checked_identifier(name: str) -> str:
    """The name itself, or ValueError when it cannot be one (a pydantic validator of names)."""
    problem = identifier_problem(name)
    if problem:
        raise ValueError(f"{name!r}: {problem}")
    return name


Identifier = Annotated[str, AfterValidator(checked_identifier)]  # a let, capture, macro or prefix name


_NOT_COMPARED = frozenset({"span", "trivia", "source"})


class Node(BaseModel):
    """Base of all IR nodes: frozen, strict, compared without spans and trivia."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    span: SpanField | None = Field(default=None, repr=False)
    _compared: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._compared = tuple(f for f in cls.model_fields if f not in _NOT_COMPARED)

    def children(self) -> Iterator[Node]:
        """The nodes this one holds (an expression's operands), in field order."""
        for name in self._compared:
            value = getattr(self, name)
            yield from (v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, Node))

    def _semantic(self) -> tuple:
        return tuple(getattr(self, f) for f in self._compared)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._semantic() == other._semantic()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._semantic()))


class Trivia(BaseModel):
    """Comments and blank lines around a statement or op line, kept so `fmt` never drops them:
    `leading` holds the lines above, each a comment (starting with `#`) or "" for a blank line."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    leading: tuple[str, ...] = ()
    trailing: str | None = None


NO_TRIVIA = Trivia()

# ---- expressions ---------------------------------------------------------------------------

# Binding strength, loosest first (docs/language.md): the parser groups by it, the formatter parenthesizes.
OR, AND, NOT, COMPARE, COALESCE, SUM, PRODUCT, UNARY, ATOM = range(1, 10)
BINARY_LEVELS = {"or": OR, "and": AND, "==": COMPARE, "!=": COMPARE, "<": COMPARE, "<=": COMPARE, ">": COMPARE,
                 ">=": COMPARE, "??": COALESCE, "+": SUM, "-": SUM, "*": PRODUCT, "//": PRODUCT, "%": PRODUCT}


class Int(Node):
    kind: Literal["int"] = "int"
    value: int


class Float(Node):
    kind: Literal["float"] = "float"
    value: float = Field(allow_inf_nan=False)  # a number in a rule file is finite


class Bool(Node):
    kind: Literal["bool"] = "bool"
    value: bool


class Name(Node):
    """A `let` name, a capture, a macro parameter or a dtype, resolved by the static checks."""

    kind: Literal["name"] = "name"
    id: Identifier


class Config(Node):
    """`config.a.b`: a value read from the model config (config.json)."""

    kind: Literal["config"] = "config"
    path: tuple[Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+$")], ...] = Field(min_length=1)


class List(Node):
    kind: Literal["list"] = "list"
    items: tuple[Expr, ...]


class Neg(Node):
    """Unary minus of a non-literal; `-3` is the literal Int(-3), never Neg(Int(3))."""

    kind: Literal["neg"] = "neg"
    operand: Expr

    @field_validator("operand")
    @classmethod
    def _not_literal(cls, operand: Node) -> Node:
        if isinstance(operand, (Int, Float)):
            raise ValueError("write a negative number as a literal, not Neg(literal)")
        return operand


class Not(Node):
    kind: Literal["not"] = "not"
    operand: Expr


class BinOp(Node):
    kind: Literal["binop"] = "binop"
    op: Literal["+", "-", "*", "//", "%"]
    left: Expr
    right: Expr


class Compare(Node):
    kind: Literal["compare"] = "compare"
    op: Literal["==", "!=", "<", "<=", ">", ">="]
    left: Expr
    right: Expr


class BoolOp(Node):
    kind: Literal["boolop"] = "boolop"
    op: Literal["and", "or"]
    left: Expr
    right: Expr


class Coalesce(Node):
    """`a ?? b`: b when a reads a config key that is missing or null."""

    kind: Literal["coalesce"] = "coalesce"
    left: Expr
    right: Expr


Expr = Annotated[
    Union[Int, Float, Bool, Name, Config, List, Neg, Not, BinOp, Compare, BoolOp, Coalesce],
    Field(discriminator="kind"),
]

# ---- key patterns --------------------------------------------------------------------------


class Text(Node):
    """Literal key text, dots included (`model.layers.`)."""

    kind: Literal["text"] = "text"
    text: str = Field(pattern=f"^{KEY_TEXT.pattern}$")  # pydantic searches: anchored, the whole text


class Capture(Node):
    """`{L}`, `{m:seg}`, `{P:path}` on the matching side: binds a name to part of a key."""

    kind: Literal["capture"] = "capture"
    name: Identifier
    type: Literal["int", "seg", "path"] = "int"


class Subst(Node):
    """`{L}`, `{L - 1}` on the producing side: the value of a capture expression."""

    kind: Literal["subst"] = "subst"
    expr: Expr


class Alternatives(Node):
    """`{q,k,v}`: an ordered list of literal choices; the rule's list axis."""

    kind: Literal["alternatives"] = "alternatives"
    options: tuple[str, ...] = Field(min_length=2)

    @field_validator("options")
    @classmethod
    def _options(cls, options: tuple[str, ...]) -> tuple[str, ...]:
        for option in options:
            if not OPTION_TEXT.fullmatch(option):
                raise ValueError(f"alternative {option!r} is not key text")
        if len(set(options)) != len(options):
            raise ValueError(f"alternatives repeat a choice: {options}")
        return options


class Star(Node):
    """`*`: one or more characters inside one segment."""

    kind: Literal["star"] = "star"


class DoubleStar(Node):
    """`**`: one or more whole segments."""

    kind: Literal["double_star"] = "double_star"


class PrefixRef(Node):
    """`@name` at the start of a pattern: each definition's pattern in turn (`prefix @name = ...`)."""

    kind: Literal["prefix_ref"] = "prefix_ref"
    name: Identifier


PatternPart = Annotated[Union[Text, Capture, Subst, Alternatives, Star, DoubleStar, PrefixRef],
                        Field(discriminator="kind")]


_MATCHERS = (Capture, Star, DoubleStar)


def pattern_problems(parts: tuple[Node, ...]) -> list[tuple[int, str]]:
    """Structural problems of a pattern as (index of the part, message); empty when well formed.
    Shared by the Pattern validator and the parser, which turns each into a located error."""
    if not parts:
        return [(0, "a key pattern cannot be empty")]
    problems: list[tuple[int, str]] = []
    for i, part in enumerate(parts):
        if isinstance(part, PrefixRef) and (i or len(parts) > 1 and not (
                isinstance(parts[1], Text) and parts[1].text.startswith("."))):
            problems.append((i, f"`@{part.name}` stands first in a pattern, then `.` and the rest of the key"))
        if isinstance(part, Text) and (part.text in _LEXER_KEYWORDS or _NUMBER_LIKE.fullmatch(part.text)
                                       or part.text in STATEMENT_KEYWORDS and i == len(parts) - 1):
            problems.append((i, f"`{part.text}` cannot stand alone as key text: it reads as a "
                                + ("number" if part.text[0].isdigit() else "keyword")))
        if isinstance(part, Subst) and isinstance(part.expr, (Bool, List, Float)):
            problems.append((i, "a key part is an integer or text, not a boolean, list or fraction"))
    for i in range(1, len(parts)):
        a, b = parts[i - 1], parts[i]
        if isinstance(a, Text) and isinstance(b, Text):
            problems.append((i, "two literal parts side by side; merge them"))
        elif isinstance(a, _MATCHERS) and isinstance(b, _MATCHERS):
            problems.append((i, "two wildcards or captures side by side cannot be told apart; "
                                "put literal text between them"))
    # Segment structure: one character for each non-literal part ("#": whole segments), split on dots.
    pieces = [part.text if isinstance(part, Text) else
              "#" if isinstance(part, (DoubleStar, PrefixRef)) else "x" for part in parts]
    flat = "".join(pieces)
    index_of_char = [i for i, piece in enumerate(pieces) for _ in piece]
    position = 0
    for segment in flat.split("."):
        owner = index_of_char[min(position, len(flat) - 1)] if flat else 0
        if not segment:
            problems.append((owner, "empty segment: a key has no `..` and no dot at either end"))
        elif "#" in segment and segment != "#":
            owner = index_of_char[position + segment.index("#")]
            if isinstance(parts[owner], DoubleStar):  # a misplaced prefix has its own message, above
                problems.append((owner, "`**` stands for whole segments: put dots around it"))
        position += len(segment) + 1
    return problems


class Pattern(Node):
    parts: tuple[PatternPart, ...]

    @field_validator("parts")
    @classmethod
    def _well_formed(cls, parts: tuple[Node, ...]) -> tuple[Node, ...]:
        # a field validator: not run again each time a statement that holds the pattern is made
        problems = pattern_problems(parts)
        if problems:
            raise ValueError("; ".join(message for _, message in problems))
        return parts


for _model in (List, Neg, Not, BinOp, Compare, BoolOp, Coalesce, Subst, Pattern):
    _model.model_rebuild()
