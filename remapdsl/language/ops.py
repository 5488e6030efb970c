"""The ops of a rule file (IR nodes): built-in layout and value ops, each made from its declared
parameters (`_op`), macro calls, and format calls (a format declares its own parameters, in quant/)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, create_model, field_validator

from ..params import Param
from ..quant.builtin import BUILTIN_FORMATS
from .nodes import NO_TRIVIA, Expr, Identifier, Node, Trivia, checked_identifier


class Op(Node):
    """Base of every op. `role` says where it may stand: in a mapping pipe (layout, value, macro) or
    as the format of a `dequantize` or `quantized` statement (format)."""

    role: ClassVar[Literal["layout", "value", "format", "macro"]] = "layout"
    params: ClassVar[tuple[Param, ...]] = ()
    example: ClassVar[str] = ""  # a typical call, shown in hints
    trivia: Trivia = Field(default=NO_TRIVIA, repr=False)

    @classmethod
    def op_name(cls) -> str:
        """The name a rule file calls the op by (its `kind`)."""
        return cls.model_fields["kind"].default


def _op(cls_name: str, example: str, doc: str, *params: Param, role: str = "layout") -> type[Op]:
    """A built-in op class: `kind` is the example's name, and each parameter a field (a capture's
    name or an expression), None when it is optional."""
    fields: dict = {"kind": (Literal[example.split("(")[0]], example.split("(")[0])}
    for p in params:
        kind = Identifier if p.kind == "capture" else Expr
        fields[p.name] = (kind, ...) if p.required else (kind | None, None)
    cls = create_model(cls_name, __base__=Op, __module__=__name__, __doc__=doc, **fields)
    cls.role, cls.params, cls.example = role, params, example
    return cls


_DIM = Param("dim", "int")
_START = Param("start", "int", False)
_CAPTURE = Param("capture", "capture", False, True)

Concat = _op("Concat", "concat(dim=0)",
             "concatenate the list axis (or a capture, ascending) along dim; `sizes=` states each part's "
             "size (checked on load, what a save without `like` needs)",
             _CAPTURE, _DIM, _START, Param("sizes", "ints", False))
Stack = _op("Stack", "stack(E, dim=0)", "stack a capture (ascending, no gaps) or the list axis as a new dim",
            _CAPTURE, _DIM, _START)
Unstack = _op("Unstack", "unstack(E, dim=0)", "one target per index of dim, bound to a capture used in the targets",
              Param("capture", "capture", True, True), _DIM, _START)
Interleave = _op("Interleave", "interleave(dim=0, groups=KV)",
                 "cut each source into groups along dim; emit group 0 of every source, then 1, ...; "
                 "`sizes=` as concat's", _DIM, Param("groups", "int"), Param("sizes", "ints", False))
Deinterleave = _op("Deinterleave", "deinterleave(dim=0, groups=KV)",
                   "the inverse of interleave: one source to the targets' list axis", _DIM, Param("groups", "int"))
Split = _op("Split", "split(dim=0, sizes=[4096, 1024, 1024])",
            "cut one source along dim into the given sizes, one per target", _DIM, Param("sizes", "ints"))
Chunk = _op("Chunk", "chunk(dim=0, n=2)", "cut one source along dim into n equal parts, one per target",
            _DIM, Param("n", "int"))
Transpose = _op("Transpose", "transpose(0, 1)", "swap two dims (negative dims count from the end)",
                Param("a", "int", True, True), Param("b", "int", True, True))
Permute = _op("Permute", "permute([1, 0, 2])", "reorder dims", Param("dims", "ints", True, True))
Reshape = _op("Reshape", "reshape([-1, 128])", "reshape a contiguous tensor; one -1 allowed",
              Param("shape", "ints", True, True))
Slice = _op("Slice", "slice(dim=0, start=0, stop=1024)", "keep the range [start, stop) of dim",
            _DIM, _START, Param("stop", "int", False))
Pad = _op("Pad", "pad(dim=0, to=32000)",
          "grow dim to a size; the new region is filled with value (default 0), never read; `size=` states "
          "the size it grows from (checked on load, what a save without `like` needs)",
          _DIM, Param("to", "int"), Param("value", "number", False), Param("size", "int", False))
Repeat = _op("Repeat", "repeat(dim=0, times=2)", "repeat the tensor along dim", _DIM, Param("times", "int"))
RopePermute = _op("RopePermute", "rope_permute(heads=NH)",
                  "Meta's pair-interleaved rotary rows to rotate-half order, per head", Param("heads", "int"))
RopeUnpermute = _op("RopeUnpermute", "rope_unpermute(heads=NH)",
                    "rotate-half rotary rows back to Meta's pair-interleaved order, per head", Param("heads", "int"))
Cast = _op("Cast", "cast(bfloat16)", "convert the element type", Param("dtype", "dtype", True, True), role="value")
Scale = _op("Scale", "scale(0.5)", "multiply every element", Param("factor", "number", True, True), role="value")
Add = _op("Add", "add(1)", "add to every element (zero-centred norms: add(1))",
          Param("value", "number", True, True), role="value")


class Arg(Node):
    """One argument of a macro or format call, as written."""

    name: Identifier | None = None
    value: Expr


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
    """The format of a `dequantize` or `quantized` statement, built in or registered from Python
    (`remapdsl.quant.register_format`); the static checks look its name and arguments up."""

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

AnyOp = Annotated[Union[BUILTIN_OPS + (MacroCall, FormatCall)], Field(discriminator="kind")]
