"""The typed IR of a rule file: frozen pydantic models for statements, patterns, ops and expressions.

Every node carries the span it was parsed from (None for IR built in code). Equality and hashing
ignore spans and trivia (comments, blank lines): two IRs are equal when they say the same thing,
so `parse(format(ir)) == ir` holds. Ops are a closed set of classes; each declares its parameters
once (`params`), and the parser, the static checks and the formatter all read that declaration.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Union

import functools
import math
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import SpanField

LANGUAGE_VERSIONS = (1,)
CAPTURE_TYPES = ("int", "seg", "path")
STATEMENT_KEYWORDS = frozenset({"remap", "let", "drop", "keep", "dequantize", "quantized", "include",
                                "macro", "optional", "otherwise"})
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


def _identifier(name: str) -> str:
    problem = identifier_problem(name)
    if problem:
        raise ValueError(f"{name!r}: {problem}")
    return name

_NOT_COMPARED = frozenset({"span", "trivia", "source"})


@functools.cache
def _field_defaults(cls: type[BaseModel]) -> dict[str, Any]:
    return {name: info.default for name, info in cls.model_fields.items()}


def construct(cls: type[BaseModel], **values: Any) -> Any:
    """Build a frozen model without validating it, for the parser, which has already checked
    every invariant the validators check (with the same functions). Defaults here are immutable,
    so they are shared rather than deep-copied as pydantic's model_construct does."""
    obj = cls.__new__(cls)
    data = _field_defaults(cls).copy()
    data.update(values)
    object.__setattr__(obj, "__dict__", data)
    object.__setattr__(obj, "__pydantic_fields_set__", set(values))
    object.__setattr__(obj, "__pydantic_extra__", None)
    object.__setattr__(obj, "__pydantic_private__", None)
    return obj


class Node(BaseModel):
    """Base of all IR nodes: frozen, strict, compared without spans and trivia."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    span: SpanField | None = Field(default=None, repr=False)
    _compared: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._compared = tuple(f for f in cls.model_fields if f not in _NOT_COMPARED)

    def _semantic(self) -> tuple:
        return tuple(getattr(self, f) for f in self._compared)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._semantic() == other._semantic()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._semantic()))


class Trivia(BaseModel):
    """Comments and blank lines around a statement or op line, kept so `fmt` never drops them.

    `leading` holds the lines above, each a comment (starting with `#`) or "" for a blank line.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    leading: tuple[str, ...] = ()
    trailing: str | None = None


NO_TRIVIA = Trivia()

# ---- expressions ---------------------------------------------------------------------------


class Int(Node):
    kind: Literal["int"] = "int"
    value: int


class Float(Node):
    kind: Literal["float"] = "float"
    value: float

    @field_validator("value")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("a number in a rule file is finite")
        return value


class Bool(Node):
    kind: Literal["bool"] = "bool"
    value: bool


class Name(Node):
    """A `let` name, a capture, a macro parameter or a dtype, resolved by the static checks."""

    kind: Literal["name"] = "name"
    id: str

    _check_id = field_validator("id")(_identifier)


class Config(Node):
    """`config.a.b`: a value read from the model config (config.json)."""

    kind: Literal["config"] = "config"
    path: tuple[str, ...] = Field(min_length=1)

    @field_validator("path")
    @classmethod
    def _segments(cls, path: tuple[str, ...]) -> tuple[str, ...]:
        for segment in path:
            if not re.fullmatch(r"[A-Za-z0-9_]+", segment):
                raise ValueError(f"config key segment {segment!r}")
        return path


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
    text: str = Field(pattern=KEY_TEXT.pattern)


class Capture(Node):
    """`{L}`, `{m:seg}`, `{P:path}` on the matching side: binds a name to part of a key."""

    kind: Literal["capture"] = "capture"
    name: str
    type: Literal["int", "seg", "path"] = "int"

    _check_name = field_validator("name")(_identifier)


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


Part = Annotated[Union[Text, Capture, Subst, Alternatives, Star, DoubleStar], Field(discriminator="kind")]


_MATCHERS = (Capture, Star, DoubleStar)


def pattern_problems(parts: tuple[Node, ...]) -> list[tuple[int, str]]:
    """Structural problems of a pattern as (index of the part, message); empty when well formed.

    Shared by the Pattern validator and the parser, which turns each into a located error.
    """
    if not parts:
        return [(0, "a key pattern cannot be empty")]
    problems: list[tuple[int, str]] = []
    for i, part in enumerate(parts):
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
    # Segment structure: stand-ins for non-literal parts, then split on dots.
    index_of_char: list[int] = []
    flat = ""
    for i, part in enumerate(parts):
        if isinstance(part, Text):
            piece = part.text
        elif isinstance(part, DoubleStar):
            piece = "#"
        else:
            piece = "x"
        flat += piece
        index_of_char.extend([i] * len(piece))
    position = 0
    for segment in flat.split("."):
        owner = index_of_char[min(position, len(flat) - 1)] if flat else 0
        if not segment:
            problems.append((owner, "empty segment: a key has no `..` and no dot at either end"))
        elif "#" in segment and segment != "#":
            problems.append((index_of_char[position + segment.index("#")],
                             "`**` stands for whole segments: put dots around it"))
        position += len(segment) + 1
    return problems


class Pattern(Node):
    parts: tuple[Part, ...]

    @model_validator(mode="after")
    def _well_formed(self) -> Pattern:
        problems = pattern_problems(self.parts)
        if problems:
            raise ValueError("; ".join(message for _, message in problems))
        return self


# ---- ops -----------------------------------------------------------------------------------

ArgKind = Literal["capture", "int", "ints", "dtype", "number", "scale_dtype"]


class Param(NamedTuple):
    """One parameter of an op: its name, what it takes, and how the formatter prints it."""

    name: str
    kind: ArgKind
    required: bool = True
    positional: bool = False  # printed without `name=` in canonical form


class Op(Node):
    """Base of every op. `role` says where it may stand: a mapping pipe or a dequantize format."""

    role: ClassVar[Literal["layout", "value", "format", "macro"]] = "layout"
    params: ClassVar[tuple[Param, ...]] = ()
    summary: ClassVar[str] = ""
    example: ClassVar[str] = ""  # a typical call, shown in hints
    trivia: Trivia = Field(default=NO_TRIVIA, repr=False)

    @classmethod
    def op_name(cls) -> str:
        return cls.model_fields["kind"].default


_DIM = Param("dim", "int")


def _capture_name(name: str | None) -> str | None:
    return None if name is None else _identifier(name)


class Concat(Op):
    kind: Literal["concat"] = "concat"
    example = "concat(dim=0)"
    params = (Param("capture", "capture", False, True), _DIM, Param("start", "int", False))
    summary = "concatenate the list axis (or a capture, ascending) along dim"
    capture: str | None = None
    dim: Expr
    start: Expr | None = None

    _check_capture = field_validator("capture")(_capture_name)


class Stack(Op):
    kind: Literal["stack"] = "stack"
    example = "stack(E, dim=0)"
    params = (Param("capture", "capture", False, True), _DIM, Param("start", "int", False))
    summary = "stack a capture (ascending, no gaps) or the list axis as a new dim"
    capture: str | None = None
    dim: Expr
    start: Expr | None = None

    _check_capture = field_validator("capture")(_capture_name)


class Unstack(Op):
    kind: Literal["unstack"] = "unstack"
    example = "unstack(E, dim=0)"
    params = (Param("capture", "capture", True, True), _DIM, Param("start", "int", False))
    summary = "one target per index of dim, bound to a capture used in the targets"
    capture: str
    dim: Expr
    start: Expr | None = None

    _check_capture = field_validator("capture")(_capture_name)


class Interleave(Op):
    kind: Literal["interleave"] = "interleave"
    example = "interleave(dim=0, groups=KV)"
    params = (_DIM, Param("groups", "int"))
    summary = "cut each source into groups along dim; emit group 0 of every source, then 1, ..."
    dim: Expr
    groups: Expr


class Deinterleave(Op):
    kind: Literal["deinterleave"] = "deinterleave"
    example = "deinterleave(dim=0, groups=KV)"
    params = (_DIM, Param("groups", "int"))
    summary = "the inverse of interleave: one source to the targets' list axis"
    dim: Expr
    groups: Expr


class Split(Op):
    kind: Literal["split"] = "split"
    example = "split(dim=0, sizes=[4096, 1024, 1024])"
    params = (_DIM, Param("sizes", "ints"))
    summary = "cut one source along dim into the given sizes, one per target"
    dim: Expr
    sizes: Expr


class Chunk(Op):
    kind: Literal["chunk"] = "chunk"
    example = "chunk(dim=0, n=2)"
    params = (_DIM, Param("n", "int"))
    summary = "cut one source along dim into n equal parts, one per target"
    dim: Expr
    n: Expr


class Transpose(Op):
    kind: Literal["transpose"] = "transpose"
    example = "transpose(0, 1)"
    params = (Param("a", "int", True, True), Param("b", "int", True, True))
    summary = "swap two dims (negative dims count from the end)"
    a: Expr
    b: Expr


class Permute(Op):
    kind: Literal["permute"] = "permute"
    example = "permute([1, 0, 2])"
    params = (Param("dims", "ints", True, True),)
    summary = "reorder dims"
    dims: Expr


class Reshape(Op):
    kind: Literal["reshape"] = "reshape"
    example = "reshape([-1, 128])"
    params = (Param("shape", "ints", True, True),)
    summary = "reshape a contiguous tensor; one -1 allowed"
    shape: Expr


class Slice(Op):
    kind: Literal["slice"] = "slice"
    example = "slice(dim=0, start=0, stop=1024)"
    params = (_DIM, Param("start", "int", False), Param("stop", "int", False))
    summary = "keep the range [start, stop) of dim"
    dim: Expr
    start: Expr | None = None
    stop: Expr | None = None


class Pad(Op):
    kind: Literal["pad"] = "pad"
    example = "pad(dim=0, to=32000)"
    params = (_DIM, Param("to", "int"), Param("value", "number", False))
    summary = "grow dim to a size; the new region is filled with value (default 0), never read"
    dim: Expr
    to: Expr
    value: Expr | None = None


class Repeat(Op):
    kind: Literal["repeat"] = "repeat"
    example = "repeat(dim=0, times=2)"
    params = (_DIM, Param("times", "int"))
    summary = "repeat the tensor along dim"
    dim: Expr
    times: Expr


class RopePermute(Op):
    kind: Literal["rope_permute"] = "rope_permute"
    example = "rope_permute(heads=NH)"
    params = (Param("heads", "int"),)
    summary = "Meta's pair-interleaved rotary rows to rotate-half order, per head"
    heads: Expr


class Cast(Op):
    kind: Literal["cast"] = "cast"
    example = "cast(bfloat16)"
    role = "value"
    params = (Param("dtype", "dtype", True, True),)
    summary = "convert the element type"
    dtype: Expr


class Scale(Op):
    kind: Literal["scale"] = "scale"
    example = "scale(0.5)"
    role = "value"
    params = (Param("factor", "number", True, True),)
    summary = "multiply every element"
    factor: Expr


class Add(Op):
    kind: Literal["add"] = "add"
    example = "add(1)"
    role = "value"
    params = (Param("value", "number", True, True),)
    summary = "add to every element (zero-centred norms: add(1))"
    value: Expr


_TO = Param("to", "dtype", False)  # required in a `dequantize` (E036), not in `quantized`


class Fp8Block(Op):
    kind: Literal["fp8_block"] = "fp8_block"
    example = "fp8_block(block=[128, 128], to=bfloat16)"
    role = "format"
    params = (Param("block", "ints"), Param("scale", "scale_dtype", False), _TO)
    summary = "F8_E4M3 values times a scale per [rows, cols] block (DeepSeek-V3)"
    block: Expr
    scale: Expr | None = None
    to: Expr | None = None


class Fp8Tensor(Op):
    kind: Literal["fp8_tensor"] = "fp8_tensor"
    example = "fp8_tensor(to=bfloat16)"
    role = "format"
    params = (_TO,)
    summary = "F8_E4M3 values times one scalar scale"
    to: Expr | None = None


class Fp8Channel(Op):
    kind: Literal["fp8_channel"] = "fp8_channel"
    example = "fp8_channel(to=bfloat16)"
    role = "format"
    params = (_TO,)
    summary = "F8_E4M3 values times a scale per output row"
    to: Expr | None = None


class Mxfp4(Op):
    kind: Literal["mxfp4"] = "mxfp4"
    example = "mxfp4(to=bfloat16)"
    role = "format"
    params = (_TO,)
    summary = "packed E2M1 pairs with an E8M0 scale per 32 values (gpt-oss)"
    to: Expr | None = None


class Nvfp4(Op):
    kind: Literal["nvfp4"] = "nvfp4"
    example = "nvfp4(to=bfloat16)"
    role = "format"
    params = (_TO,)
    summary = "packed E2M1 pairs, an F8_E4M3 scale per 16 values and a global F32 scale"
    to: Expr | None = None


class Arg(Node):
    """One argument of a macro call, as written."""

    name: str | None = None
    value: Expr

    _check_name = field_validator("name")(_capture_name)


class _NamedCall(Op):
    """An op named by the program, not by the language: a macro call, or a registered format."""

    name: str
    args: tuple[Arg, ...] = ()

    @field_validator("name")
    @classmethod
    def _not_builtin(cls, name: str) -> str:
        if name in OPS_BY_NAME:
            raise ValueError(f"`{name}` is a built-in op, not a macro or a registered format")
        return _identifier(name)


class MacroCall(_NamedCall):
    """A call of a `macro` statement's op chain; resolved by name in the static checks."""

    kind: Literal["macro_call"] = "macro_call"
    role = "macro"


class FormatCall(_NamedCall):
    """A quantized format registered from Python (`remapdsl.quant.register_format`), named in a
    `dequantize` or `quantized` statement; its arguments are checked against its parameters."""

    kind: Literal["format_call"] = "format_call"
    role = "format"


BUILTIN_OPS: tuple[type[Op], ...] = (
    Concat, Stack, Unstack, Interleave, Deinterleave, Split, Chunk, Transpose, Permute, Reshape,
    Slice, Pad, Repeat, RopePermute, Cast, Scale, Add,
    Fp8Block, Fp8Tensor, Fp8Channel, Mxfp4, Nvfp4,
)  # fmt: skip
OPS_BY_NAME: dict[str, type[Op]] = {cls.op_name(): cls for cls in BUILTIN_OPS}

AnyOp = Annotated[
    Union[
        Concat, Stack, Unstack, Interleave, Deinterleave, Split, Chunk, Transpose, Permute,
        Reshape, Slice, Pad, Repeat, RopePermute, Cast, Scale, Add,
        Fp8Block, Fp8Tensor, Fp8Channel, Mxfp4, Nvfp4, MacroCall, FormatCall,
    ],
    Field(discriminator="kind"),
]  # fmt: skip

# ---- statements ----------------------------------------------------------------------------


class Statement(Node):
    trivia: Trivia = Field(default=NO_TRIVIA, repr=False)


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


def _sided(patterns: tuple[Pattern, ...], side: str) -> None:
    """Sources match keys (captures, wildcards); targets name keys (substitutions)."""
    wrong = (Subst,) if side == "source" else (Capture, Star, DoubleStar)
    types: dict[str, str] = {}
    for pattern in patterns:
        for part in pattern.parts:
            if isinstance(part, wrong):
                raise ValueError(f"a {type(part).__name__} cannot stand in a {side} pattern")
            if isinstance(part, Capture) and types.setdefault(part.name, part.type) != part.type:
                raise ValueError(f"capture `{part.name}` has two types in one statement")


def _roles(ops: tuple, allowed: tuple[str, ...], where: str) -> None:
    for op in ops:
        if op.role not in allowed:
            raise ValueError(f"`{op.op_name()}` cannot stand in {where}")


class Let(Statement):
    kind: Literal["let"] = "let"
    name: str
    value: Expr

    _check_name = field_validator("name")(_identifier)


class Rule(Statement):
    """`SOURCES -> TARGETS [when GUARD] | op | ...`, optionally `optional` or `otherwise`."""

    kind: Literal["rule"] = "rule"
    sources: tuple[Pattern, ...]
    targets: tuple[Pattern, ...]
    guard: Expr | None = None
    ops: tuple[AnyOp, ...] = ()
    optional: bool = False
    otherwise: bool = False

    @model_validator(mode="after")
    def _valid(self) -> Rule:
        _sided(self.sources, "source")
        _sided(self.targets, "target")
        _roles(self.ops, ("layout", "value", "macro"), "a mapping rule")
        return self


class Drop(Statement):
    kind: Literal["drop"] = "drop"
    patterns: tuple[Pattern, ...]
    guard: Expr | None = None

    @model_validator(mode="after")
    def _valid(self) -> Drop:
        _sided(self.patterns, "source")
        return self


class Keep(Statement):
    kind: Literal["keep"] = "keep"
    patterns: tuple[Pattern, ...]
    guard: Expr | None = None

    @model_validator(mode="after")
    def _valid(self) -> Keep:
        _sided(self.patterns, "source")
        return self


class Dequantize(Statement):
    """`dequantize SOURCES -> LOGICAL | format(...)`: a logical tensor from packed parts."""

    kind: Literal["dequantize"] = "dequantize"
    sources: tuple[Pattern, ...]
    target: Pattern
    guard: Expr | None = None
    format: AnyOp
    optional: bool = False

    @model_validator(mode="after")
    def _valid(self) -> Dequantize:
        _sided(self.sources, "source")
        _sided((self.target,), "target")
        _roles((self.format,), ("format",), "a dequantize statement")
        given = ({a.name for a in self.format.args} if isinstance(self.format, FormatCall)
                 else {"to"} if getattr(self.format, "to", None) is not None else set())
        if "to" not in given:
            raise ValueError("a dequantize statement's format needs `to=`")
        return self


class Quantized(Statement):
    """`quantized SOURCES | format(...)`: these tensors are the parts of quantized weights that the
    rules move as they are (no dequantizing); every cut through the values must fall on a block."""

    kind: Literal["quantized"] = "quantized"
    sources: tuple[Pattern, ...]
    guard: Expr | None = None
    format: AnyOp

    @model_validator(mode="after")
    def _valid(self) -> Quantized:
        _sided(self.sources, "source")
        _roles((self.format,), ("format",), "a quantized statement")
        return self


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
    name: str
    params: tuple[str, ...] = ()
    ops: tuple[AnyOp, ...] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if name in OPS_BY_NAME:
            raise ValueError(f"`{name}` is a built-in op")
        return _identifier(name)

    @field_validator("params")
    @classmethod
    def _check_params(cls, params: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(params)) != len(params):
            raise ValueError(f"parameters repeat a name: {params}")
        return tuple(_identifier(p) for p in params)


AnyStatement = Annotated[
    Union[Version, Let, Rule, Drop, Keep, Dequantize, Quantized, Include, Macro], Field(discriminator="kind")
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


for _model in (List, Neg, Not, BinOp, Compare, BoolOp, Coalesce, Subst, Pattern, Arg):
    _model.model_rebuild()
for _model in BUILTIN_OPS + (MacroCall, FormatCall, Rule, Dequantize, Quantized, Macro, Let, Drop, Keep, RuleFile):
    _model.model_rebuild()
