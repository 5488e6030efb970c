"""Quantized formats decoded with numpy, written from the formats' public definitions, independently
of remapdsl/quant: the oracle of tests/test_quantized.py.

The definitions: E4M3 as OCP's 8-bit floating point gives it; E8M0 scales and E2M1 elements as the
OCP Microscaling (MX) Formats Specification v1.0 gives them (MXFP4: 32 elements a scale); NVFP4 as
NVIDIA describes it (16 E2M1 elements an E4M3 scale, one F32 scale a tensor); block FP8 as the
DeepSeek-V3 release stores it (an F32 scale per `weight_block_size` block, multiplied).

Products are taken in float64 (exact for every format here: at most 4 + 4 + 24 significant bits),
rounded once to float32, then cast to the logical dtype by torch (round to nearest even). Random
packed tensors draw every byte value, so NaN codes, subnormals and overflow to infinity all occur.
"""

from __future__ import annotations

import numpy as np
import torch


def e4m3(codes: np.ndarray) -> np.ndarray:
    """F8_E4M3 (fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7F and 0xFF are NaN."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    return np.where((exponent == 15) & (mantissa == 7), np.nan, sign * value)


def e8m0(codes: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes: 2^(b-127); 255 is NaN."""
    codes = codes.astype(np.int64)
    return np.where(codes == 255, np.nan, np.ldexp(1.0, codes - 127))


def e2m1(codes: np.ndarray) -> np.ndarray:
    """E2M1 (FP4): bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 0x8, -1.0, 1.0)
    exponent, mantissa = (codes >> 1) & 0x3, codes & 0x1
    return sign * np.where(exponent == 0, mantissa * 0.5, (1 + mantissa / 2.0) * 2.0 ** (exponent - 1.0))


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Two E2M1 codes a byte, the even element in the low nibble."""
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.float64)
    out[..., 0::2] = e2m1(packed & 0xF)
    out[..., 1::2] = e2m1(packed >> 4)
    return out


def _codes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _to(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    with np.errstate(over="ignore", invalid="ignore"):
        return torch.from_numpy(values.astype(np.float32)).to(dtype)


def fp8_block(values: torch.Tensor, scales: torch.Tensor, block, dtype, scale="float32") -> torch.Tensor:
    q = e4m3(_codes(values))
    s = e8m0(_codes(scales)) if scale == "e8m0" else scales.numpy().astype(np.float64)
    rows, cols = q.shape[-2:]
    s = np.repeat(np.repeat(s, block[0], axis=-2), block[1], axis=-1)[..., :rows, :cols]
    return _to(q * s, dtype)


def fp8_tensor(values: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return _to(e4m3(_codes(values)) * float(scale.reshape(-1)[0]), dtype)


def fp8_channel(values: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    s = scales.numpy().astype(np.float64).reshape(values.shape[:-1] + (1,))
    return _to(e4m3(_codes(values)) * s, dtype)


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    values = unpack_fp4(_codes(blocks))  # [..., G, 32]
    scaled = values * e8m0(_codes(scales))[..., None]
    return _to(scaled.reshape(scaled.shape[:-2] + (-1,)), dtype)


def nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, dtype) -> torch.Tensor:
    values = unpack_fp4(_codes(packed))
    s = np.repeat(e4m3(_codes(scales)), 16, axis=-1)[..., :values.shape[-1]]
    return _to(values * s * float(global_scale.reshape(-1)[0]), dtype)


def random_codes(generator: torch.Generator, shape, special=()) -> torch.Tensor:
    """uint8 codes over all 256 values, with `special` codes planted at the first positions."""
    codes = torch.randint(0, 256, tuple(shape), generator=generator, dtype=torch.uint8)
    flat = codes.view(-1)
    for i, code in enumerate(special[:flat.numel()]):
        flat[i] = code
    return codes


def quantize_fp8_block(weight: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight as E4M3 values and float32 block scales (amax / 448 per block), the way
    DeepSeek-V3's release is made; edge blocks are partial."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid[0], block[0], grid[1], block[1])
    scales = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    values = (tiles / scales[:, None, :, None]).view(padded.shape)[:rows, :cols]
    return values.to(torch.float8_e4m3fn).contiguous(), scales.contiguous()


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., K] (K a multiple of 32) as MXFP4 `blocks` [..., K/32, 16] and E8M0
    `scales` [..., K/32]: each group's scale is the smallest power of two that brings its largest
    magnitude within 6, each value the nearest E2M1 code (ties to the lower code)."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - table).abs().argmin(dim=-1)
    codes = (magnitude | (scaled < 0).to(torch.int64) << 3).to(torch.uint8)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).contiguous()
    return blocks, (exponent + 127).to(torch.uint8).contiguous()
