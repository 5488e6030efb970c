"""The ops of a rule file: the built-in layout and value ops, macro calls and format calls (IR nodes).

Each built-in op declares its parameters once (`params`, remapdsl.params.Param), and the parser,
the static checks and the formatter all read that declaration. A quantized format is not an op
class: a `dequantize` or `quantized` statement names it in a FormatCall, and the format itself
(quant/) declares its parameters.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, field_validator

from ..params import Param
from ..quant.builtin import BUILTIN_FORMATS
from .nodes import NO_TRIVIA, Expr, Node, Trivia, checked_identifier


class Op(Node):
    """Base of every op. `role` says where it may stand: in a mapping pipe (layout, value, macro) or
    as the format of a `dequantize` or `quantized` statement (format)."""

    role: ClassVar[Literal["layout", "value", "format", "macro"]] = "layout"
    params: ClassVar[tuple[Param, ...]] = ()
    summary: ClassVar[str] = ""
    example: ClassVar[str] = ""  # a typical call, shown in hints
    trivia: Trivia = Field(default=NO_TRIVIA, repr=False)

    @classmethod
    def op_name(cls) -> str:
        """The name a rule file calls the op by (its `kind`)."""
        return cls.model_fields["kind"].default


_DIM = Param("dim", "int")


def _capture_name(name: str | None) -> str | None:
    return None if name is None else checked_identifier(name)


class Concat(Op):
    kind: Literal["concat"] = "concat"
    example = "concat(dim=0)"
    params = (Param("capture", "capture", False, True), _DIM, Param("start", "int", False),
              Param("sizes", "ints", False))
    summary = "concatenate the list axis (or a capture, ascending) along dim; `sizes=` states each part's"
    capture: str | None = None
    dim: Expr
    start: Expr | None = None
    sizes: Expr | None = None  # each part's size along dim: checked on load, what a save without `like` needs

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
    params = (_DIM, Param("groups", "int"), Param("sizes", "ints", False))
    summary = "cut each source into groups along dim; emit group 0 of every source, then 1, ..."
    dim: Expr
    groups: Expr
    sizes: Expr | None = None  # each source's size along dim, as concat's


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


class RopeUnpermute(Op):
    kind: Literal["rope_unpermute"] = "rope_unpermute"
    example = "rope_unpermute(heads=NH)"
    params = (Param("heads", "int"),)
    summary = "rotate-half rotary rows back to Meta's pair-interleaved order, per head"
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


class Arg(Node):
    """One argument of a macro or format call, as written."""

    name: str | None = None
    value: Expr

    _check_name = field_validator("name")(_capture_name)


class _NamedCall(Op):
    """An op named by the program, not by the language: a macro call or a format."""

    name: str
    args: tuple[Arg, ...] = ()


class MacroCall(_NamedCall):
    """A call of a `macro` statement's op chain; resolved by name in the static checks."""

    kind: Literal["macro_call"] = "macro_call"
    role = "macro"

    @field_validator("name")
    @classmethod
    def _not_builtin(cls, name: str) -> str:
        if name in RESERVED_NAMES:
            raise ValueError(f"`{name}` is a built-in op or format, not a macro")
        return checked_identifier(name)


class FormatCall(_NamedCall):
    """The quantized format of a `dequantize` or `quantized` statement, built in or registered from
    Python (`remapdsl.quant.register_format`): the parser takes any name, and the static checks
    look it up and hold its arguments to the format's declared parameters."""

    kind: Literal["format_call"] = "format_call"
    role = "format"

    @field_validator("name")
    @classmethod
    def _not_builtin(cls, name: str) -> str:
        if name in OPS_BY_NAME:
            raise ValueError(f"`{name}` is a built-in op, not a format")
        return checked_identifier(name)


BUILTIN_OPS: tuple[type[Op], ...] = (
    Concat, Stack, Unstack, Interleave, Deinterleave, Split, Chunk, Transpose, Permute, Reshape,
    Slice, Pad, Repeat, RopePermute, RopeUnpermute, Cast, Scale, Add,
)  # fmt: skip
OPS_BY_NAME: dict[str, type[Op]] = {cls.op_name(): cls for cls in BUILTIN_OPS}
# The formats every remapdsl has (quant/builtin.py): a rule's pipe or a macro cannot name them.
BUILTIN_FORMAT_NAMES: tuple[str, ...] = tuple(sorted(fmt.name for fmt in BUILTIN_FORMATS))
RESERVED_NAMES = frozenset(OPS_BY_NAME) | frozenset(BUILTIN_FORMAT_NAMES)  # no macro takes these

AnyOp = Annotated[
    Union[
        Concat, Stack, Unstack, Interleave, Deinterleave, Split, Chunk, Transpose, Permute,
        Reshape, Slice, Pad, Repeat, RopePermute, RopeUnpermute, Cast, Scale, Add, MacroCall,
        FormatCall,
    ],
    Field(discriminator="kind"),
]  # fmt: skip

for _model in BUILTIN_OPS + (Arg, MacroCall, FormatCall):
    _model.model_rebuild()
