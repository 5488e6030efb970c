"""Decoding kernels: torch ops over row chunks small enough to stay in cache.

E4M3 to float32 without torch's slow element-wise conversion: a code's low seven bits at bit 20 of an
int32, its sign at bit 31, are the float32 of the E4M3 value times 2^-120, subnormals included.
Multiplying by 2^120 is exact, by the scale then rounds once, as `float(q) * s` does. The NaN codes
(0x7F, 0xFF) come out as ±480 * 2^-120, beyond every finite code (at most 448), and are made NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK = 1 << 18  # float32 elements of one chunk's work (1 MiB)
_SIGN_AND_LOW7 = 0x87F00000 - (1 << 32)  # bit 31 and bits 20-26, as a signed int32
_NAN = 480.0 * 2.0 ** -120  # |bits| of codes 0x7F and 0xFF
_UNBIAS = 2.0 ** 120


def e4m3_scaled(values: torch.Tensor, scale_rows: Callable[[int, int], torch.Tensor], out: torch.Tensor) -> None:
    """`out = float32(values) * scales`, rounded once to out's dtype.

    values: E4M3 codes [rows, cols] (float8_e4m3fn or uint8); out: [rows, cols], any float dtype,
    any strides; scale_rows(a, b): float32 scales of rows [a, b), broadcastable to [b - a, cols].
    """
    rows, cols = values.shape
    step = max(1, CHUNK // max(1, cols))
    work = torch.empty(min(rows, step) * cols, dtype=torch.int32)
    codes = values.view(torch.uint8).view(torch.int8)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        bits = work[: (b - a) * cols].view(b - a, cols)
        bits.copy_(codes[a:b])  # sign-extends: bits 8-31 copy the sign
        bits.bitwise_left_shift_(20).bitwise_and_(_SIGN_AND_LOW7)
        real = bits.view(torch.float32)
        low, high = torch.aminmax(real)
        if high >= _NAN or low <= -_NAN:
            real.masked_fill_(real.abs() == _NAN, float("nan"))
        real.mul_(_UNBIAS).mul_(scale_rows(a, b))
        out[a:b].copy_(real)


def rows_of(tensor: torch.Tensor) -> torch.Tensor:
    """A [..., rows, cols] tensor as [rows', cols] without copying, or None if its strides forbid."""
    try:
        return tensor.view(-1, tensor.shape[-1])
    except RuntimeError:
        return None


_PAIRS: list[torch.Tensor] = []


def _pairs() -> torch.Tensor:
    """Each byte's two E2M1 values, the low nibble first: a [256, 2] float32 table."""
    if not _PAIRS:
        table = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0))
        codes = torch.arange(256)
        _PAIRS.append(torch.stack((table[codes & 0xF], table[codes >> 4]), dim=-1))
    return _PAIRS[0]


def fp4_scaled(packed: torch.Tensor, byte0: int, start: int, scales: torch.Tensor, group0: int, per: int,
               then: torch.Tensor | None, out: torch.Tensor) -> None:
    """`out = e2m1 * scale [* then]` for packed E2M1 pairs (low nibble first).

    packed: bytes [..., nbytes], beginning at byte `byte0` of their rows; out: [rows, width], the
    elements from `start`; scales: float32 [..., groups] of `per` elements each, beginning at group
    `group0`; then: an optional [1, 1] factor applied after (a global scale: one rounding).
    """
    rows, width = out.shape
    packed = packed.reshape(rows, -1).view(torch.uint8)
    scales = scales.reshape(rows, -1)
    at = start - 2 * byte0
    group = torch.arange(start, start + width) // per - group0
    step = max(1, CHUNK // max(1, 2 * packed.shape[1]))
    pairs = _pairs()
    for a in range(0, rows, step):
        b = min(rows, a + step)
        values = pairs[packed[a:b].to(torch.int64)].flatten(-2)[:, at:at + width]
        values = values.mul_(scales[a:b].index_select(-1, group))  # exact: a power of two or an E4M3
        if then is not None:
            values.mul_(then)
        out[a:b].copy_(values)
