"""The built-in formats fp8_block, fp8_tensor, fp8_channel, mxfp4, nvfp4: parts -> logical shape, covers, values.

Each class is the one definition of its format. What the codes mean, from the public specs:
- F8_E4M3 (OCP's 8-bit float, also an MX element type): 4 exponent bits with bias 7, subnormals,
  no infinities, NaN at 0x7F and 0xFF; every value is exact in any float of 16 bits or more.
- E8M0 (the OCP Microscaling (MX) Formats Specification v1.0, its shared scale): a byte b is
  2^(b-127), and 255 is NaN.
- E2M1 (the same MX spec, the FP4 element): codes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives,
  bit 3 the sign; checkpoints pack two a byte, the element with the even index in the low nibble.
  MXFP4 gives 32 of them one E8M0 scale; NVIDIA's NVFP4 gives 16 of them one F8_E4M3 scale and
  the tensor one F32.
- Block FP8 as the DeepSeek-V3 release stores it: F8_E4M3 values and one F32 scale per block of
  `weight_block_size` (its quantization config, [128, 128]), multiplied despite the name
  `weight_scale_inv`.
Every product is computed in float32 and rounded once to `to` (as transformers' Fp8Dequantize
does); NVFP4 multiplies value by block scale (exact), then by the global scale. Shapes and covers
are integer arithmetic; only `decode` and `encode` import torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..params import Param
from .format import Box, FormatError, Part, QuantFormat

FLOAT_TARGETS = ("float32", "bfloat16", "float16", "float64")  # every decoded value is exact in these
_TO = Param("to", "dtype", False)  # required in a `dequantize` (E036), not in `quantized`


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _dtype(part: Part, allowed: Sequence[str], role: str) -> None:
    if part.dtype not in allowed:
        raise FormatError(f"{role} `{part.key}` are {part.dtype}, expected {' or '.join(allowed)}")


def _target(params: Mapping[str, Any]) -> None:
    if "to" in params and params["to"] not in FLOAT_TARGETS:
        raise FormatError(f"`to={params['to']}`: a dequantized tensor is one of {', '.join(FLOAT_TARGETS)}")


def _scalar(part: Part, role: str) -> None:
    if part.shape not in ((), (1,)):
        raise FormatError(f"{role} `{part.key}` is {list(part.shape)}, expected one value ([] or [1])")


def _whole(view: tuple[int, ...]) -> Box:
    return (0,) * len(view), tuple(view)


def _last_dim_cover(box: Box, per: int) -> tuple[int, int]:
    """The first and count of the units of `per` elements that the box's last dim touches."""
    start, size = box[0][-1], box[1][-1]
    first = start // per
    return first, _ceil(start + size, per) - first


def _packed_cover(box: Box, per: int) -> tuple[Box, Box]:
    """The covers of packed E2M1 pairs (two a byte) and of their scales (one per `per` values)."""
    offsets, sizes = box
    return tuple((offsets[:-1] + (first,), sizes[:-1] + (count,))
                 for first, count in (_last_dim_cover(box, 2), _last_dim_cover(box, per)))


class Fp8Block(QuantFormat):
    name = "fp8_block"
    parts = ("values", "scales")
    params = (Param("block", "ints", sizes=("rows", "cols")), Param("scale", "scale_dtype", False), _TO)
    summary = "F8_E4M3 values times a scale per [rows, cols] block (DeepSeek-V3)"

    @staticmethod
    def block(params) -> tuple[int, int]:
        block = tuple(params["block"])
        if len(block) != 2 or min(block) < 1:
            raise FormatError(f"`block={list(block)}`: give [rows, cols], both at least 1")
        return block

    def logical_shape(self, parts, params):
        values, scales = parts
        _target(params)
        _dtype(values, ("float8_e4m3fn",), "values")
        if params.get("scale", "float32") == "e8m0":
            _dtype(scales, ("float8_e8m0fnu", "uint8"), "e8m0 scales")
        else:
            _dtype(scales, ("float32",), "scales")
        rows_block, cols_block = self.block(params)
        if len(values.shape) < 2:
            raise FormatError(f"values `{values.key}` are {list(values.shape)}: block scaling needs [rows, cols]")
        *lead, rows, cols = values.shape
        grid = (*lead, _ceil(rows, rows_block), _ceil(cols, cols_block))
        if tuple(scales.shape) != grid:
            raise FormatError(f"scales `{scales.key}` are {list(scales.shape)}, but values {list(values.shape)} "
                              f"in blocks of [{rows_block}, {cols_block}] need a grid of {list(grid)}")
        return tuple(values.shape)

    def cover(self, box, parts, params):
        rows_block, cols_block = self.block(params)
        offsets, sizes = box
        (r0, c0), (h, w) = offsets[-2:], sizes[-2:]
        g0, k0 = r0 // rows_block, c0 // cols_block
        grid = (offsets[:-2] + (g0, k0),
                sizes[:-2] + (_ceil(r0 + h, rows_block) - g0, _ceil(c0 + w, cols_block) - k0))
        return box, grid

    def value_grid(self, parts, params):
        return (1,) * (len(parts[0].shape) - 2) + self.block(params)

    def decode(self, tensors, box, covers, params, out):
        import torch

        from .kernels import e4m3_scaled

        values, scales = tensors
        rows_block, cols_block = self.block(params)
        (r0, c0), (h, w) = box[0][-2:], box[1][-2:]
        g0, k0 = covers[1][0][-2], covers[1][0][-1]
        grid_rows = covers[1][1][-2]
        scale = _scale_f32(scales, params.get("scale", "float32"))
        # per column of the box: [lead..., grid rows, w], then one row of scales per grid row
        at = c0 - k0 * cols_block
        scale = scale.repeat_interleave(cols_block, dim=-1)[..., at:at + w].reshape(-1, w)
        # the scale row of each row of the box, leading dims flattened into rows
        lead = values.numel() // max(1, h * w)
        block_of_row = (torch.arange(r0, r0 + h) // rows_block - g0).repeat(lead)
        block_of_row += torch.arange(lead).repeat_interleave(h) * grid_rows

        def scale_rows(a: int, b: int):
            first, last = int(block_of_row[a]), int(block_of_row[b - 1])
            return scale[first:first + 1] if first == last else scale.index_select(0, block_of_row[a:b])

        _into(out, lambda flat: e4m3_scaled(values.reshape(-1, w), scale_rows, flat))

    encodes = True
    requantizes = True

    def encode(self, values, box, covers, scales, params):
        return _e4m3_codes(values / _block_scales(scales[0], box, covers, params, self.block(params)), self.name)

    def requantize(self, values, box, parts, params):
        """Scales amax / 448 per block (1 for an all-zero block), as DeepSeek-V3's release is made."""
        import torch

        if params.get("scale", "float32") != "float32":
            raise FormatError("re-quantizing writes float32 scales; this format stores e8m0 scales")
        rows_block, cols_block = self.block(params)
        (r0, c0), (h, w) = box[0][-2:], box[1][-2:]
        rows, cols = parts[0].shape[-2:]
        for start, size, step, extent, what in ((r0, h, rows_block, rows, "rows"), (c0, w, cols_block, cols, "cols")):
            if start % step or ((start + size) % step and start + size != extent):
                raise FormatError(f"{what} {start}:{start + size} do not hold whole blocks of {step}: new scales "
                                  "need every value of a block on the rank that writes it")
        grid_rows, grid_cols = _ceil(h, rows_block), _ceil(w, cols_block)
        padded = torch.zeros(*values.shape[:-2], grid_rows * rows_block, grid_cols * cols_block)
        padded[..., :h, :w] = values
        tiles = padded.unflatten(-1, (grid_cols, cols_block)).unflatten(-3, (grid_rows, rows_block))
        amax = tiles.abs().amax(dim=(-3, -1))
        scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        scaled = (tiles / scales[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :h, :w]
        return _e4m3_codes(scaled, self.name), scales.contiguous()


def _e4m3_codes(scaled, what: str):
    """float32 values already divided by their scales -> E4M3 codes (round to nearest even)."""
    import torch

    # 448 and half a step: beyond the largest code. An infinity is beyond it too (torch would write
    # it as 448, silently); NaN compares false here and keeps E4M3's NaN code
    if bool((scaled.abs() > 464).any()):
        raise FormatError(f"{what}: a value is beyond 448 times its stored scale; it cannot be written "
                          "with the checkpoint's scales")
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def _into(out, fill) -> None:
    """Run `fill(flat)` on out viewed as [rows, cols], or on a scratch tensor copied into out."""
    import torch

    from .kernels import rows_of

    flat = rows_of(out)
    if flat is not None:
        fill(flat)
        return
    scratch = torch.empty(out.shape, dtype=out.dtype)
    fill(scratch.view(-1, out.shape[-1]))
    out.copy_(scratch)


def _block_scales(scales, box, covers, params, block):
    """The scale of every element of the box: [..., rows, cols] float32."""
    import torch

    rows_block, cols_block = block
    (r0, c0), (h, w) = box[0][-2:], box[1][-2:]
    g0, k0 = covers[1][0][-2], covers[1][0][-1]
    scale = _scale_f32(scales, params.get("scale", "float32"))
    rows = torch.arange(r0, r0 + h) // rows_block - g0
    cols = torch.arange(c0, c0 + w) // cols_block - k0
    return scale.index_select(-2, rows).index_select(-1, cols)


def _scale_f32(scales, kind: str):
    """Scales as float32: float32 as they are; E8M0 bytes b as 2^(b-127), built from the bits
    (b=0 is the subnormal 2^-127, b=255 NaN), so no rounding can enter."""
    import torch

    if kind != "e8m0":
        return scales.to(torch.float32)
    code = scales.view(torch.uint8).to(torch.int32)
    bits = torch.where(code == 0, torch.tensor(0x00400000, dtype=torch.int32), code << 23)
    bits = torch.where(code == 255, torch.tensor(0x7FC00000, dtype=torch.int32), bits)
    return bits.view(torch.float32)


class Fp8Tensor(QuantFormat):
    name = "fp8_tensor"
    parts = ("values", "scale")
    one_scale = True
    params = (_TO,)
    summary = "F8_E4M3 values times one scalar scale"

    def logical_shape(self, parts, params):
        values, scale = parts
        _target(params)
        _dtype(values, ("float8_e4m3fn",), "values")
        _dtype(scale, ("float32",), "scale")
        _scalar(scale, "scale")
        return tuple(values.shape)

    def cover(self, box, parts, params):
        return box, _whole(parts[1].shape)

    def decode(self, tensors, box, covers, params, out):
        import torch

        from .kernels import e4m3_scaled

        values, scale = tensors
        one = scale.to(torch.float32).reshape(1, 1)
        _into(out, lambda flat: e4m3_scaled(values.reshape(-1, values.shape[-1]), lambda a, b: one, flat))

    encodes = True

    def encode(self, values, box, covers, scales, params):
        import torch

        return _e4m3_codes(values / scales[0].to(torch.float32).reshape(-1)[0], self.name)


class Fp8Channel(QuantFormat):
    name = "fp8_channel"
    parts = ("values", "scales")
    params = (_TO,)
    summary = "F8_E4M3 values times a scale per output row"

    def logical_shape(self, parts, params):
        values, scales = parts
        _target(params)
        _dtype(values, ("float8_e4m3fn",), "values")
        _dtype(scales, ("float32",), "scales")
        if len(values.shape) < 2:
            raise FormatError(f"values `{values.key}` are {list(values.shape)}: per-channel scales need "
                              "[out channels, in]")
        rows = tuple(values.shape[:-1])
        if tuple(scales.shape) not in (rows, rows + (1,)):
            raise FormatError(f"scales `{scales.key}` are {list(scales.shape)}, but values "
                              f"{list(values.shape)} need one per output channel: {list(rows)} or "
                              f"{list(rows + (1,))}")
        return tuple(values.shape)

    def cover(self, box, parts, params):
        offsets, sizes = box
        rows = (offsets[:-1], sizes[:-1])
        if len(parts[1].shape) == len(parts[0].shape):
            rows = (rows[0] + (0,), rows[1] + (1,))
        return box, rows

    def decode(self, tensors, box, covers, params, out):
        import torch

        from .kernels import e4m3_scaled

        values, scales = tensors
        rows = scales.to(torch.float32).reshape(-1, 1)
        _into(out, lambda flat: e4m3_scaled(values.reshape(-1, values.shape[-1]), lambda a, b: rows[a:b], flat))

    encodes = True

    def encode(self, values, box, covers, scales, params):
        import torch

        return _e4m3_codes(values / scales[0].to(torch.float32).reshape(*values.shape[:-1], 1), self.name)


def _group_scales(scales, box, cover, per: int):
    """The scale of every element of the box, from a per-group scale cover: [..., width] float32."""
    import torch

    start, width = box[0][-1], box[1][-1]
    index = torch.arange(start, start + width) // per - cover[0][-1]
    return scales.index_select(-1, index)


_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between the magnitudes 0, 0.5, 1, ... 6


def _e2m1_bytes(scaled, box, what: str):
    """float32 values already divided by their scales -> packed E2M1 bytes (the even element in the
    low nibble), nearest code, ties to even. The box's last dim must start and end on whole bytes."""
    import torch

    start, width = box[0][-1], box[1][-1]
    if start % 2 or width % 2:
        raise FormatError(f"{what}: columns {start}:{start + width} split a byte of two values; write whole "
                          "bytes (an even shard of the last dim)")
    if not bool(torch.isfinite(scaled).all()) or bool((scaled.abs() > 7).any()):
        raise FormatError(f"{what}: a value is not finite or beyond 6 times its stored scale")
    # nearest code, ties to the even one (IEEE 754 roundTiesToEven, as OCP MX conversions round):
    # the two bucketings differ only on a midpoint, where the lower code is odd or the upper one is
    magnitude, midpoints = scaled.abs(), torch.tensor(_E2M1_MIDPOINTS)
    lower = torch.bucketize(magnitude, midpoints)
    codes = torch.where((lower & 1).bool(), torch.bucketize(magnitude, midpoints, right=True), lower)
    codes = (codes | (torch.signbit(scaled).to(torch.int64) << 3)).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


class Mxfp4(QuantFormat):
    name = "mxfp4"
    parts = ("blocks", "scales")
    params = (_TO,)
    summary = "packed E2M1 pairs with an E8M0 scale per 32 values (gpt-oss)"

    def logical_shape(self, parts, params):
        blocks, scales = parts
        _target(params)
        _dtype(blocks, ("uint8",), "blocks")
        _dtype(scales, ("uint8", "float8_e8m0fnu"), "scales")
        if len(blocks.shape) < 2 or blocks.shape[-1] != 16:
            raise FormatError(f"blocks `{blocks.key}` are {list(blocks.shape)}, expected [..., groups, 16] "
                              "(32 four-bit values per group)")
        if tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise FormatError(f"scales `{scales.key}` are {list(scales.shape)}, but blocks "
                              f"{list(blocks.shape)} need one per group: {list(blocks.shape[:-1])}")
        return (*blocks.shape[:-2], blocks.shape[-2] * 32)

    def views(self, parts, params):
        blocks, scales = parts
        return (*blocks.shape[:-2], blocks.shape[-2] * 16), tuple(scales.shape)

    def cover(self, box, parts, params):
        return _packed_cover(box, 32)

    def value_grid(self, parts, params):  # the 16 bytes of a group stay together
        return (1,) * (len(parts[0].shape) - 1) + (16,)

    def decode(self, tensors, box, covers, params, out):
        from .kernels import fp4_scaled

        blocks, scales = tensors
        scales = _scale_f32(scales, "e8m0")
        _into(out, lambda flat: fp4_scaled(blocks, covers[0][0][-1], box[0][-1], scales, covers[1][0][-1], 32,
                                           None, flat))

    encodes = True

    def encode(self, values, box, covers, scales, params):
        per_value = _group_scales(_scale_f32(scales[0], "e8m0"), box, covers[1], 32)
        return _e2m1_bytes(values / per_value, box, self.name)


class Nvfp4(QuantFormat):
    name = "nvfp4"
    parts = ("values", "scales", "global_scale")
    params = (_TO,)
    summary = "packed E2M1 pairs, an F8_E4M3 scale per 16 values and a global F32 scale"

    def logical_shape(self, parts, params):
        values, scales, global_scale = parts
        _target(params)
        _dtype(values, ("uint8",), "packed values")
        _dtype(scales, ("float8_e4m3fn",), "block scales")
        _dtype(global_scale, ("float32",), "global scale")
        _scalar(global_scale, "global scale")
        if not values.shape:
            raise FormatError(f"packed values `{values.key}` are a scalar")
        *lead, half = values.shape
        grid = (*lead, _ceil(2 * half, 16))
        if tuple(scales.shape) != grid:
            raise FormatError(f"block scales `{scales.key}` are {list(scales.shape)}, but packed values "
                              f"{list(values.shape)} ({2 * half} four-bit values a row) need one per 16: "
                              f"{list(grid)}")
        return (*lead, 2 * half)

    def cover(self, box, parts, params):
        return (*_packed_cover(box, 16), _whole(parts[2].shape))

    def value_grid(self, parts, params):  # 16 values (8 bytes) share a scale
        return (1,) * (len(parts[0].shape) - 1) + (8,)

    def decode(self, tensors, box, covers, params, out):
        import torch

        from .kernels import fp4_scaled

        values, scales, global_scale = tensors
        scales, global_scale = scales.to(torch.float32), global_scale.to(torch.float32).reshape(1, 1)
        _into(out, lambda flat: fp4_scaled(values, covers[0][0][-1], box[0][-1], scales, covers[1][0][-1], 16,
                                           global_scale, flat))

    encodes = True

    def encode(self, values, box, covers, scales, params):
        import torch

        per_value = _group_scales(scales[0].to(torch.float32), box, covers[1], 16)
        return _e2m1_bytes(values / scales[1].to(torch.float32).reshape(-1)[0] / per_value, box, self.name)


BUILTIN_FORMATS: tuple[QuantFormat, ...] = (Fp8Block(), Fp8Tensor(), Fp8Channel(), Mxfp4(), Nvfp4())
