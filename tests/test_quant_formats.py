"""The quantized formats (remapdsl/quant/) on their own: what each format says when parts do not fit
(the whole message: it reaches the user as the E-code's text), covers and value grids, encode and
requantize against decode, the E8M0 edge codes, kernels over more than one chunk and into outputs
that are not one block of memory, and the registry's refusals. Tiny tensors, no checkpoint."""

from __future__ import annotations

import pytest
import torch

from remapdsl.quant import (
    FormatError,
    Part,
    QuantFormat,
    format_names,
    get_format,
    kernels,
    register_format,
    unregister_format,
)
from remapdsl.quant.builtin import _scale_f32

E4M3 = "float8_e4m3fn"
TO = {"to": "float32"}


def _shape_error(name: str, parts, params) -> str:
    with pytest.raises(FormatError) as info:
        get_format(name).logical_shape(parts, params)
    return str(info.value)


BLOCK = {"block": [2, 2], "to": "bfloat16"}
SHAPE_ERRORS = [
    ("fp8_block", [Part("v", "bfloat16", (4, 4)), Part("s", "float32", (2, 2))], BLOCK,
     "values `v` are bfloat16, expected float8_e4m3fn"),
    ("fp8_block", [Part("v", E4M3, (4, 4)), Part("s", "float32", (2, 2))], {"block": [2, 2], "to": "int8"},
     "`to=int8`: a dequantized tensor is one of float32, bfloat16, float16, float64"),
    ("fp8_block", [Part("v", E4M3, (4, 4)), Part("s", "float16", (2, 2))], BLOCK,
     "scales `s` are float16, expected float32"),
    ("fp8_block", [Part("v", E4M3, (4, 4)), Part("s", "float32", (2, 2))], BLOCK | {"scale": "e8m0"},
     "e8m0 scales `s` are float32, expected float8_e8m0fnu or uint8"),
    ("fp8_block", [Part("v", E4M3, (4,)), Part("s", "float32", (2,))], BLOCK,
     "values `v` are [4]: block scaling needs [rows, cols]"),
    ("fp8_block", [Part("v", E4M3, (5, 4)), Part("s", "float32", (2, 2))], BLOCK,
     "scales `s` are [2, 2], but values [5, 4] in blocks of [2, 2] need a grid of [3, 2]"),
    ("fp8_block", [Part("v", E4M3, (5, 4)), Part("s", "float32", (3, 2))], {"block": [0, 2], "to": "float32"},
     "`block=[0, 2]`: give [rows, cols], both at least 1"),
    ("fp8_block", [Part("v", E4M3, (5, 4)), Part("s", "float32", (3, 2))], {"block": [2, 2, 2], "to": "float32"},
     "`block=[2, 2, 2]`: give [rows, cols], both at least 1"),
    ("fp8_tensor", [Part("v", E4M3, (4, 4)), Part("s", "float32", (2,))], TO,
     "scale `s` is [2], expected one value ([] or [1])"),
    ("fp8_tensor", [Part("v", E4M3, (4, 4)), Part("s", "float16", ())], TO, "scale `s` are float16, expected float32"),
    ("fp8_tensor", [Part("v", "uint8", (4, 4)), Part("s", "float32", ())], TO,
     "values `v` are uint8, expected float8_e4m3fn"),
    ("fp8_channel", [Part("v", E4M3, (4,)), Part("s", "float32", (4,))], TO,
     "values `v` are [4]: per-channel scales need [out channels, in]"),
    ("fp8_channel", [Part("v", E4M3, (4, 3)), Part("s", "float32", (3,))], TO,
     "scales `s` are [3], but values [4, 3] need one per output channel: [4] or [4, 1]"),
    ("fp8_channel", [Part("v", E4M3, (4, 3)), Part("s", "float16", (4,))], TO, "scales `s` are float16, expected float32"),
    ("fp8_channel", [Part("v", "int8", (4, 3)), Part("s", "float32", (4,))], TO,
     "values `v` are int8, expected float8_e4m3fn"),
    ("mxfp4", [Part("b", "uint8", (4, 2, 15)), Part("s", "uint8", (4, 2))], TO,
     "blocks `b` are [4, 2, 15], expected [..., groups, 16] (32 four-bit values per group)"),
    ("mxfp4", [Part("b", "uint8", (16,)), Part("s", "uint8", ())], TO,
     "blocks `b` are [16], expected [..., groups, 16] (32 four-bit values per group)"),
    ("mxfp4", [Part("b", "uint8", (4, 2, 16)), Part("s", "uint8", (4, 3))], TO,
     "scales `s` are [4, 3], but blocks [4, 2, 16] need one per group: [4, 2]"),
    ("mxfp4", [Part("b", "uint8", (4, 2, 16)), Part("s", "float32", (4, 2))], TO,
     "scales `s` are float32, expected uint8 or float8_e8m0fnu"),
    ("mxfp4", [Part("b", "int8", (4, 2, 16)), Part("s", "uint8", (4, 2))], TO, "blocks `b` are int8, expected uint8"),
    ("nvfp4", [Part("v", "uint8", ()), Part("s", E4M3, (1,)), Part("g", "float32", ())], TO,
     "packed values `v` are a scalar"),
    ("nvfp4", [Part("v", "uint8", (4, 12)), Part("s", E4M3, (4, 1)), Part("g", "float32", ())], TO,
     "block scales `s` are [4, 1], but packed values [4, 12] (24 four-bit values a row) need one per 16: [4, 2]"),
    ("nvfp4", [Part("v", "uint8", (4, 12)), Part("s", E4M3, (4, 2)), Part("g", "float32", (2,))], TO,
     "global scale `g` is [2], expected one value ([] or [1])"),
    ("nvfp4", [Part("v", "uint8", (4, 12)), Part("s", E4M3, (4, 2)), Part("g", "float16", ())], TO,
     "global scale `g` are float16, expected float32"),
    ("nvfp4", [Part("v", "uint8", (4, 12)), Part("s", "float32", (4, 2)), Part("g", "float32", ())], TO,
     "block scales `s` are float32, expected float8_e4m3fn"),
    ("nvfp4", [Part("v", "int8", (4, 12)), Part("s", E4M3, (4, 2)), Part("g", "float32", ())], TO,
     "packed values `v` are int8, expected uint8"),
]


@pytest.mark.parametrize("name, parts, params, message", SHAPE_ERRORS)
def test_parts_that_do_not_fit_say_exactly_how(name, parts, params, message):
    assert _shape_error(name, parts, params) == message


@pytest.mark.parametrize("name, parts, params, shape, views, grid", [
    ("fp8_block", [Part("v", E4M3, (3, 5, 4)), Part("s", "float32", (3, 3, 2))], BLOCK, (3, 5, 4),
     ((3, 5, 4), (3, 3, 2)), (1, 2, 2)),
    ("fp8_block", [Part("v", E4M3, (5, 4)), Part("s", "uint8", (3, 2))], BLOCK | {"scale": "e8m0"}, (5, 4),
     ((5, 4), (3, 2)), (2, 2)),
    ("fp8_tensor", [Part("v", E4M3, (4, 4)), Part("s", "float32", (1,))], TO, (4, 4), ((4, 4), (1,)), (1, 1)),
    ("fp8_tensor", [Part("v", E4M3, (4,)), Part("s", "float32", ())], TO, (4,), ((4,), ()), (1,)),
    ("fp8_channel", [Part("v", E4M3, (4, 3)), Part("s", "float32", (4, 1))], TO, (4, 3), ((4, 3), (4, 1)), (1, 1)),
    ("fp8_channel", [Part("v", E4M3, (2, 4, 3)), Part("s", "float32", (2, 4))], TO, (2, 4, 3),
     ((2, 4, 3), (2, 4)), (1, 1, 1)),
    ("mxfp4", [Part("b", "uint8", (4, 2, 16)), Part("s", "float8_e8m0fnu", (4, 2))], TO, (4, 64), ((4, 32), (4, 2)),
     (1, 1, 16)),
    ("nvfp4", [Part("v", "uint8", (4, 12)), Part("s", E4M3, (4, 2)), Part("g", "float32", (1,))], TO, (4, 24),
     ((4, 12), (4, 2), (1,)), (1, 8)),
])
def test_each_format_gives_its_logical_shape_part_views_and_value_grid(name, parts, params, shape, views, grid):
    fmt = get_format(name)
    assert fmt.logical_shape(parts, params) == shape
    assert fmt.views(parts, params) == views
    assert fmt.value_grid(parts, params) == grid


def test_covers_are_the_tightest_boxes_of_each_part():
    block, mx, nv = get_format("fp8_block"), get_format("mxfp4"), get_format("nvfp4")
    parts = [Part("v", E4M3, (2, 9, 7)), Part("s", "float32", (2, 3, 3))]
    params = {"block": [4, 3], "to": "float32"}
    box = ((1, 3, 2), (1, 6, 5))
    assert block.cover(box, parts, params) == (box, ((1, 0, 0), (1, 3, 3)))
    assert block.cover(((0, 4, 3), (2, 4, 3)), parts, params) == (((0, 4, 3), (2, 4, 3)), ((0, 1, 1), (2, 1, 1)))
    channel, tensor = get_format("fp8_channel"), get_format("fp8_tensor")
    assert channel.cover(((1, 2), (2, 3)), [Part("v", E4M3, (4, 6)), Part("s", "float32", (4, 1))], TO) == (
        ((1, 2), (2, 3)), ((1, 0), (2, 1)))
    assert channel.cover(((1, 2), (2, 3)), [Part("v", E4M3, (4, 6)), Part("s", "float32", (4,))], TO) == (
        ((1, 2), (2, 3)), ((1,), (2,)))
    assert tensor.cover(((1, 2), (2, 3)), [Part("v", E4M3, (4, 6)), Part("s", "float32", (1,))], TO) == (
        ((1, 2), (2, 3)), ((0,), (1,)))
    mx_parts = [Part("b", "uint8", (3, 4, 16)), Part("s", "uint8", (3, 4))]
    assert mx.cover(((1, 31), (2, 34)), mx_parts, TO) == (((1, 15), (2, 18)), ((1, 0), (2, 3)))
    assert mx.cover(((0, 64), (1, 64)), mx_parts, TO) == (((0, 32), (1, 32)), ((0, 2), (1, 2)))
    nv_parts = [Part("v", "uint8", (3, 20)), Part("s", E4M3, (3, 3)), Part("g", "float32", ())]
    assert nv.cover(((0, 15), (3, 3)), nv_parts, TO) == (((0, 7), (3, 2)), ((0, 0), (3, 2)), ((), ()))


def test_e8m0_scales_are_powers_of_two_with_the_edge_codes():
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = _scale_f32(codes, "e8m0")
    assert got.dtype == torch.float32
    assert got[:-1].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127] and torch.isnan(got[-1])
    assert _scale_f32(codes.view(torch.float8_e8m0fnu), "e8m0")[:-1].tolist() == got[:-1].tolist()
    assert _scale_f32(torch.tensor([1.5], dtype=torch.float64), "float32").dtype == torch.float32


def _codes(n: int, seed: int) -> torch.Tensor:
    """Finite E4M3 codes: every byte but the NaNs 0x7F and 0xFF."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n,), generator=g, dtype=torch.int64)
    return torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)


def _decode(fmt: QuantFormat, tensors, box, params, out_dtype=torch.float32):
    parts = [Part(f"p{i}", str(t.dtype).removeprefix("torch."), tuple(t.shape)) for i, t in enumerate(tensors)]
    covers = fmt.cover(box, parts, params)
    views = fmt.views(parts, params)
    cut = [t.reshape(v)[tuple(slice(o, o + n) for o, n in zip(*c))].contiguous()
           for t, v, c in zip(tensors, views, covers)]
    out = torch.empty(box[1], dtype=out_dtype)
    fmt.decode(cut, box, covers, params, out)
    return out, cut, covers


@pytest.mark.parametrize("name", ["fp8_block", "fp8_tensor", "fp8_channel", "fp8_block_e8m0"])
def test_fp8_encode_with_the_stored_scales_gives_back_the_stored_codes(name):
    params = {"block": [2, 3], "to": "float32"} | ({"scale": "e8m0"} if name.endswith("e8m0") else {})
    name = name.removesuffix("_e8m0")
    values = _codes(6 * 7, 1).view(torch.float8_e4m3fn).reshape(6, 7)
    scales = {"fp8_block": torch.tensor([[2.0, 0.5, 4.0], [1.0, 8.0, 0.25], [0.125, 2.0, 1.0]]),
              "fp8_tensor": torch.tensor([4.0]), "fp8_channel": torch.tensor([[2.0], [1], [0.5], [4], [8], [0.25]])}[name]
    if params.get("scale") == "e8m0":
        scales = (torch.log2(scales).to(torch.int64) + 127).to(torch.uint8)
    fmt = get_format(name)
    box = ((1, 2), (4, 5))
    out, cut, covers = _decode(fmt, [values, scales], box, params)
    codes = fmt.encode(out, box, covers, cut[1:], params)
    assert codes.dtype == torch.uint8 and torch.equal(codes, cut[0].view(torch.uint8))


def test_fp8_encode_refuses_a_value_its_stored_scale_cannot_reach():
    fmt = get_format("fp8_tensor")
    box = ((0,), (2,))
    covers = fmt.cover(box, [Part("v", E4M3, (2,)), Part("s", "float32", ())], TO)
    assert fmt.encode(torch.tensor([928.0, -896.0]), box, covers, [torch.tensor(2.0)], TO).tolist() == [
        0x7E, 0xFE]  # 464 rounds to 448, the largest code
    with pytest.raises(FormatError, match=r"^fp8_tensor: a value is beyond 448 times its stored scale; it cannot be "
                                          r"written with the checkpoint's scales$"):
        fmt.encode(torch.tensor([1.0, 930.0]), box, covers, [torch.tensor(2.0)], TO)
    assert fmt.encode(torch.tensor([float("nan"), 1.0]), box, covers, [torch.tensor(1.0)], TO).tolist() == [0x7F, 0x38]
    for infinite in (float("inf"), -float("inf")):  # no E4M3 code: torch's conversion would write +-448
        with pytest.raises(FormatError, match=r"^fp8_tensor: a value is beyond 448 times its stored scale"):
            fmt.encode(torch.tensor([1.0, infinite]), box, covers, [torch.tensor(1.0)], TO)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_fp4_encode_with_the_stored_scales_gives_back_the_stored_bytes(name):
    g = torch.Generator().manual_seed(3)
    fmt = get_format(name)
    if name == "mxfp4":
        tensors = [torch.randint(0, 256, (3, 2, 16), generator=g, dtype=torch.uint8),
                   torch.tensor([[126, 127], [128, 130], [120, 127]], dtype=torch.uint8)]
        box = ((1, 30), (2, 34))
    else:
        tensors = [torch.randint(0, 256, (3, 12), generator=g, dtype=torch.uint8),
                   torch.tensor([[1.0, 2.0], [0.5, 4.0], [8.0, 0.25]]).to(torch.float8_e4m3fn), torch.tensor(0.5)]
        box = ((0, 14), (3, 6))
    out, cut, covers = _decode(fmt, tensors, box, TO)
    got = fmt.encode(out, box, covers, cut[1:], TO)
    # -0 encodes as +0's code, the only byte that does not come back: compare the values it means
    want = cut[0].view(torch.uint8)
    same_value = (got == want) | (((got ^ want) & 0x88) == (got ^ want)) & ((got & 0x77) == 0) & ((want & 0x77) == 0)
    assert bool(same_value.all()) and bool((got == want).float().mean() > 0.8)


def test_fp4_encode_refuses_half_bytes_and_values_out_of_reach():
    fmt = get_format("nvfp4")
    parts = [Part("v", "uint8", (1, 8)), Part("s", E4M3, (1, 1)), Part("g", "float32", ())]
    scales = [torch.ones(1, 1).to(torch.float8_e4m3fn), torch.tensor(1.0)]
    box = ((0, 1), (1, 4))
    with pytest.raises(FormatError, match=r"^nvfp4: columns 1:5 split a byte of two values; write whole bytes "
                                          r"\(an even shard of the last dim\)$"):
        fmt.encode(torch.zeros(1, 4), box, fmt.cover(box, parts, TO), scales, TO)
    box = ((0, 2), (1, 3))
    with pytest.raises(FormatError, match="^nvfp4: columns 2:5 split a byte"):
        fmt.encode(torch.zeros(1, 3), box, fmt.cover(box, parts, TO), scales, TO)
    box = ((0, 2), (1, 4))
    for bad in (7.5, float("inf")):
        with pytest.raises(FormatError, match=r"^nvfp4: a value is not finite or beyond 6 times its stored scale$"):
            fmt.encode(torch.tensor([[0.0, 1.0, bad, 2.0]]), box, fmt.cover(box, parts, TO), scales, TO)
    # the nearest code (0.5, 1, 4, 6), the sign in bit 3, the even element in the low nibble
    got = fmt.encode(torch.tensor([[0.3, -0.8, 4.9, -6.9]]), box, fmt.cover(box, parts, TO), scales, TO)
    assert got.tolist() == [[0x1 | (0x8 | 0x2) << 4, 0x6 | (0x8 | 0x7) << 4]]


def test_fp8_block_requantizes_with_amax_over_448_a_block():
    fmt = get_format("fp8_block")
    params = {"block": [2, 2], "to": "float32"}
    parts = [Part("v", E4M3, (3, 4)), Part("s", "float32", (2, 2))]
    values = torch.tensor([[896.0, 1.0, 0.0, 0.0], [-2.0, 3.0, 0.0, 0.0], [448.0, 0.5, 0.0, 0.0]])
    codes, scales = fmt.requantize(values, ((0, 0), (3, 4)), parts, params)
    assert scales.tolist() == [[2.0, 1.0], [1.0, 1.0]] and scales.is_contiguous()
    assert torch.equal(codes.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(2, 0)[:3].repeat_interleave(
        2, 1), values)
    assert fmt.requantize(values[:2], ((0, 0), (2, 4)), parts, params)[1].tolist() == [[2.0, 1.0]]
    for box, what in ((((1, 0), (2, 4)), "rows 1:3 do not hold whole blocks of 2"),
                      (((0, 0), (2, 3)), "cols 0:3 do not hold whole blocks of 2"),
                      (((0, 2), (1, 2)), "rows 0:1 do not hold whole blocks of 2")):
        with pytest.raises(FormatError, match=f"^{what}: new scales need every value of a block on the rank that "
                                              "writes it$"):
            fmt.requantize(torch.zeros(box[1]), box, parts, params)
    with pytest.raises(FormatError, match="^re-quantizing writes float32 scales; this format stores e8m0 scales$"):
        fmt.requantize(values, ((0, 0), (3, 4)), parts, params | {"scale": "e8m0"})


def test_the_flags_say_which_formats_write_back():
    flags = {n: (get_format(n).encodes, get_format(n).requantizes, get_format(n).one_scale)
             for n in ("fp8_block", "fp8_tensor", "fp8_channel", "mxfp4", "nvfp4")}
    assert flags == {"fp8_block": (True, True, False), "fp8_tensor": (True, False, True),
                     "fp8_channel": (True, False, False), "mxfp4": (True, False, False), "nvfp4": (True, False, False)}
    assert [p.name for p in get_format("fp8_block").params] == ["block", "scale", "to"]
    assert get_format("nvfp4").parts == ("values", "scales", "global_scale")


def test_kernels_decode_across_chunks_and_into_strided_outputs(monkeypatch):
    """Many rows in small chunks (the chunk size set low, as a big tensor would use it), and an
    output that is a transposed view, which the kernels cannot address as rows."""
    monkeypatch.setattr(kernels, "CHUNK", 16)
    codes = _codes(9 * 5, 7)
    codes[3] = 0x7F
    values = codes.view(torch.float8_e4m3fn).reshape(9, 5)
    scales = torch.arange(1, 10, dtype=torch.float32).reshape(9, 1)
    fmt = get_format("fp8_channel")
    out, _, _ = _decode(fmt, [values, scales], ((0, 0), (9, 5)), TO)
    want = values.float() * scales
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out.view(-1)[3])
    assert torch.equal(out.nan_to_num(), want.nan_to_num())
    strided = torch.empty(5, 9).t()
    fmt.decode([values, scales.reshape(9)], ((0, 0), (9, 5)), fmt.cover(((0, 0), (9, 5)), [
        Part("v", E4M3, (9, 5)), Part("s", "float32", (9,))], TO), TO, strided)
    assert torch.equal(strided.nan_to_num(), want.nan_to_num())
    packed = torch.randint(0, 256, (6, 8), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    nv = [packed, torch.full((6, 1), 2.0).to(torch.float8_e4m3fn), torch.tensor(0.5)]
    whole, _, _ = _decode(get_format("nvfp4"), nv, ((0, 0), (6, 16)), TO)
    monkeypatch.setattr(kernels, "CHUNK", 1 << 18)
    again, _, _ = _decode(get_format("nvfp4"), nv, ((0, 0), (6, 16)), TO)
    assert torch.equal(whole, again)
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    pairs = torch.stack((table[packed.long() & 0xF], table[packed.long() >> 4]), dim=-1).reshape(6, 16)
    assert torch.equal(whole, pairs)  # 2 (block scale) times 0.5 (global): each value as its code says


def test_a_decode_into_bfloat16_rounds_the_float32_product_once():
    fmt = get_format("fp8_tensor")
    values = torch.tensor([0x3F, 0x40], dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1.875, 2.0
    out, _, _ = _decode(fmt, [values, torch.tensor([1.0 + 2 ** -10])], ((0,), (2,)), TO, torch.bfloat16)
    want = (values.float() * torch.tensor(1.0 + 2 ** -10)).to(torch.bfloat16)
    assert torch.equal(out, want)


class _Int8Row(QuantFormat):
    name = "int8_row_registered"
    parts = ("values", "scales")
    params = ()


def test_the_registry_refuses_what_is_no_format_and_replaces_only_when_asked():
    from remapdsl.params import Param

    with pytest.raises(TypeError, match="^register a QuantFormat instance, not str$"):
        register_format("fp8_block")
    bad_name = type("Bad", (_Int8Row,), {"name": "int8 row", "params": (Param("to", "dtype", False),)})()
    with pytest.raises(ValueError, match="^a format name is an identifier, not 'int8 row'$"):
        register_format(bad_name)
    with pytest.raises(ValueError, match=r"^format `int8_row_registered` must declare `to` \(the logical dtype\) among "
                                         r"its params$"):
        register_format(_Int8Row())
    fmt = type("Good", (_Int8Row,), {"params": (Param("to", "dtype", False),)})()
    try:
        assert register_format(fmt) is fmt and get_format("int8_row_registered") is fmt
        assert "int8_row_registered" in format_names() and format_names() == sorted(format_names())
        with pytest.raises(ValueError, match=r"^format `int8_row_registered` is already registered \(pass replace=True "
                                             r"to replace it\)$"):
            register_format(type("Other", (type(fmt),), {})())
        other = type("Other", (type(fmt),), {})()
        assert register_format(other, replace=True) is other and get_format("int8_row_registered") is other
    finally:
        unregister_format("int8_row_registered")
    unregister_format("int8_row_registered")  # nothing registered: nothing happens
    assert "int8_row_registered" not in format_names()
    with pytest.raises(KeyError):
        get_format("int8_row_registered")
    assert {"fp8_block", "fp8_channel", "fp8_tensor", "mxfp4", "nvfp4"} <= set(format_names())


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_fp4_encode_rounds_exact_halves_to_the_even_code(name):
    """A value halfway between two E2M1 magnitudes takes the one whose mantissa bit is 0 (IEEE 754
    roundTiesToEven): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; and
    just off a midpoint, the nearer code."""
    fmt = get_format(name)
    per = 16 if name == "nvfp4" else 32
    if name == "nvfp4":
        parts = [Part("v", "uint8", (1, per // 2)), Part("s", E4M3, (1, 1)), Part("g", "float32", ())]
        scales = [torch.ones(1, 1).to(torch.float8_e4m3fn), torch.tensor(1.0)]
    else:
        parts = [Part("v", "uint8", (1, 1, per // 2)), Part("s", "uint8", (1, 1))]
        scales = [torch.full((1, 1), 127, dtype=torch.uint8)]  # E8M0 127: a scale of 1
    halves = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -1.75, -3.5, 0.76, 1.74, 3.49, 3.51, 0.0, 6.0]
    values = torch.tensor([halves + [0.0] * (per - len(halves))])
    if name == "mxfp4":
        values = values.reshape(1, 1, per)
    box = ((0,) * values.dim(), tuple(values.shape))
    got = fmt.encode(values, box, fmt.cover(box, parts, TO), scales, TO).reshape(-1)
    codes = [int(b) >> shift & 0xF for b in got.tolist() for shift in (0, 4)][: len(halves)]
    magnitude = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    decoded = [(-1 if c & 0x8 else 1) * magnitude[c & 0x7] for c in codes]
    assert decoded == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -2.0, -4.0, 1.0, 1.5, 3.0, 4.0, 0.0, 6.0]


def test_e4m3_decode_over_several_row_chunks_equals_torchs_conversion(monkeypatch):
    """Rows are decoded in chunks of CHUNK elements; with a tiny CHUNK a 5-row box takes chunks of
    2, 2 and 1 rows, and each must come out as torch's own E4M3 -> float32 conversion times its
    rows' scales (NaN codes included)."""
    from remapdsl.quant import kernels

    monkeypatch.setattr(kernels, "CHUNK", 12)  # 12 // 6 columns: 2 rows a chunk
    codes = torch.arange(30, dtype=torch.uint8).mul_(37).reshape(5, 6)
    codes[4, 5] = 0x7F  # NaN
    scales = torch.tensor([[1.0], [2.0], [0.5], [4.0], [0.25]])
    out = torch.empty(5, 6)
    kernels.e4m3_scaled(codes, lambda a, b: scales[a:b], out)
    want = codes.view(torch.float8_e4m3fn).float() * scales
    assert torch.equal(out.isnan(), want.isnan()) and bool(out.isnan()[4, 5])
    assert torch.equal(out.nan_to_num(), want.nan_to_num())


def test_fp8_block_requantizes_a_box_of_stacked_experts_not_at_the_origin():
    """Values [experts, rows, cols]: a box of whole blocks that starts past block 0 on both dims gets
    amax / 448 per (expert, block), small blocks included (amax under 1), and the codes of each value
    divided by its block's scale."""
    fmt = get_format("fp8_block")
    params = {"block": [2, 3], "to": "float32"}
    parts = [Part("v", E4M3, (2, 4, 6)), Part("s", "float32", (2, 2, 2))]
    g = torch.Generator().manual_seed(5)
    values = torch.randn(2, 2, 3, generator=g) * torch.tensor([40.0, 0.01]).reshape(2, 1, 1)
    codes, scales = fmt.requantize(values, ((0, 2, 3), (2, 2, 3)), parts, params)
    amax = values.abs().amax(dim=(1, 2))
    assert scales.shape == (2, 1, 1) and torch.equal(scales.reshape(2), amax / 448.0) and bool(amax[1] < 1)
    want = (values / scales).to(torch.float8_e4m3fn).view(torch.uint8)
    assert codes.shape == (2, 2, 3) and torch.equal(codes, want)


def test_fp8_channel_encodes_stacked_experts_and_names_itself_when_out_of_reach():
    fmt = get_format("fp8_channel")
    values = _codes(2 * 3 * 4, 7).view(torch.float8_e4m3fn).reshape(2, 3, 4)
    scales = torch.tensor([[2.0, 0.5, 4.0], [1.0, 8.0, 0.25]])
    box = ((1, 0, 1), (1, 3, 3))
    out, cut, covers = _decode(fmt, [values, scales], box, TO)
    assert torch.equal(fmt.encode(out, box, covers, cut[1:], TO), cut[0].view(torch.uint8))
    with pytest.raises(FormatError, match=r"^fp8_channel: a value is beyond 448 times its stored scale"):
        fmt.encode(out * 1000, box, covers, cut[1:], TO)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_fp4_encode_of_a_stacked_box_past_the_first_group_gives_back_its_bytes(name):
    """Packed values of [experts, rows, 2 groups] with a scale a group: a box of the second group
    (first row, or second row alone) reads its own group's scales back."""
    g = torch.Generator().manual_seed(11)
    fmt = get_format(name)
    per = 32 if name == "mxfp4" else 16
    shape = (2, 2, 2, 16) if name == "mxfp4" else (2, 2, 16)  # gpt-oss keeps a group's 16 bytes apart
    packed = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)  # 2 * per values a row
    if name == "mxfp4":
        tensors = [packed, torch.tensor([[[126, 127], [128, 129]], [[125, 130], [127, 124]]], dtype=torch.uint8)]
    else:
        block = torch.tensor([[[1.0, 2.0], [0.5, 4.0]], [[8.0, 0.25], [2.0, 1.0]]]).to(torch.float8_e4m3fn)
        tensors = [packed, block, torch.tensor(0.5)]
    for box in (((1, 0, per), (1, 2, per)), ((1, 1, per), (1, 1, per))):
        out, cut, covers = _decode(fmt, tensors, box, TO)
        got = fmt.encode(out, box, covers, cut[1:], TO)
        want = cut[0].view(torch.uint8)
        # -0 encodes as +0 (the one byte that does not come back): compare the values they stand for
        zero = lambda b: ((b & 0x77) == 0)
        same = (got == want) | ((((got ^ want) & 0x88) == (got ^ want)) & zero(got) & zero(want))
        assert got.shape == want.shape and bool(same.all()), box


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_fp4_encode_takes_seven_times_the_scale_and_names_itself_beyond(name):
    """Up to 7 (halfway from 6 to the next power-of-two step) a value saturates to 6; past it, the
    format's own name leads the error."""
    fmt = get_format(name)
    if name == "nvfp4":
        parts = [Part("v", "uint8", (1, 8)), Part("s", E4M3, (1, 1)), Part("g", "float32", ())]
        scales = [torch.ones(1, 1).to(torch.float8_e4m3fn), torch.tensor(1.0)]
        box = ((0, 0), (1, 16))
    else:
        parts = [Part("v", "uint8", (1, 16)), Part("s", "uint8", (1, 1))]
        scales = [torch.full((1, 1), 127, dtype=torch.uint8)]
        box = ((0, 0), (1, 32))
    covers = fmt.cover(box, parts, TO)
    values = torch.zeros(box[1])
    values[0, :2] = torch.tensor([7.0, -7.0])
    assert fmt.encode(values, box, covers, scales, TO).reshape(-1)[0].item() == 0x7 | (0x8 | 0x7) << 4
    values[0, 0] = 7.01
    with pytest.raises(FormatError, match=rf"^{name}: a value is not finite or beyond 6 times its stored scale$"):
        fmt.encode(values, box, covers, scales, TO)


@pytest.mark.parametrize("name, parts, box, want", [
    ("nvfp4", [Part("v", "uint8", (2, 32)), Part("s", E4M3, (2, 4)), Part("g", "float32", ())],
     ((1, 32), (1, 24)), (((1, 16), (1, 12)), ((1, 2), (1, 2)), ((), ()))),
    ("nvfp4", [Part("v", "uint8", (2, 32)), Part("s", E4M3, (2, 4)), Part("g", "float32", ())],
     ((0, 16), (2, 16)), (((0, 8), (2, 8)), ((0, 1), (2, 1)), ((), ()))),
    ("mxfp4", [Part("v", "uint8", (2, 2, 16)), Part("s", "uint8", (2, 2))],
     ((0, 32), (2, 32)), (((0, 16), (2, 16)), ((0, 1), (2, 1)))),
])
def test_fp4_covers_are_the_bytes_and_the_scale_groups_of_the_box(name, parts, box, want):
    """Columns 32:56 of NVFP4 are bytes 16:28 and groups 2:4 (16 values a group); MXFP4's columns
    32:64 are bytes 16:32 and group 1 (32 a group); the global scale is whole."""
    assert get_format(name).cover(box, parts, TO) == want


def test_mxfp4_blocks_of_one_row_are_a_vector():
    """Blocks [groups, 16] with scales [groups] are a 1-d tensor of 32 values a group; blocks with no
    groups dim are refused."""
    fmt = get_format("mxfp4")
    assert fmt.logical_shape([Part("v", "uint8", (2, 16)), Part("s", "uint8", (2,))], TO) == (64,)
    assert _shape_error("mxfp4", [Part("v", "uint8", (16,)), Part("s", "uint8", ())], TO) == (
        "blocks `v` are [16], expected [..., groups, 16] (32 four-bit values per group)")


def test_fp8_block_names_itself_when_a_value_is_out_of_its_block_s_reach():
    fmt = get_format("fp8_block")
    params = {"block": [2, 2], "to": "float32"}
    box = ((0, 0), (2, 4))
    covers = fmt.cover(box, [Part("v", E4M3, (2, 4)), Part("s", "float32", (1, 2))], params)
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.25, 930.0, 0.0]])  # 930 / 2 is past 464
    with pytest.raises(FormatError, match=r"^fp8_block: a value is beyond 448 times its stored scale"):
        fmt.encode(values, box, covers, [torch.tensor([[1.0, 2.0]])], params)
    values[1, 2] = 928.0  # 464: rounds to 448, the largest code
    assert fmt.encode(values, box, covers, [torch.tensor([[1.0, 2.0]])], params)[1, 2].item() == 0x7E


def test_fp8_block_encodes_a_stacked_box_whose_scales_start_past_the_first_block():
    """Values [experts, rows, cols], blocks [2, 3]: a box at expert 1, rows 4:6, cols 3:6 reads
    scales from grid row 2 and grid col 1 (not the same number), and its codes come back."""
    fmt = get_format("fp8_block")
    params = {"block": [2, 3], "to": "float32"}
    values = _codes(2 * 6 * 6, 9).view(torch.float8_e4m3fn).reshape(2, 6, 6)
    scales = torch.tensor([2.0, 0.5, 4.0, 1.0, 8.0, 0.25, 0.125, 2.0, 1.0, 16.0, 0.5, 4.0]).reshape(2, 3, 2)
    box = ((1, 4, 3), (1, 2, 3))
    out, cut, covers = _decode(fmt, [values, scales], box, params)
    assert covers[1] == ((1, 2, 1), (1, 1, 1))
    assert torch.equal(out, values[1:, 4:, 3:].float() * scales[1, 2, 1])
    assert torch.equal(fmt.encode(out, box, covers, cut[1:], params), cut[0].view(torch.uint8))


@pytest.mark.parametrize("chunk", [1 << 18, 12])
def test_fp8_block_decodes_rows_of_one_block_and_several_experts_with_their_own_scales(monkeypatch, chunk):
    """A box inside one block row (one scale row for the chunk) takes that row's scale alone; a box
    over two experts takes each expert's scales; with chunks of two rows (12 elements), each chunk
    inside one block row takes that row's scale, not the next's too."""
    monkeypatch.setattr(kernels, "CHUNK", chunk)
    fmt = get_format("fp8_block")
    params = {"block": [2, 3], "to": "float32"}
    values = _codes(2 * 6 * 6, 13).view(torch.float8_e4m3fn).reshape(2, 6, 6)
    scales = torch.tensor([2.0, 0.5, 4.0, 1.0, 8.0, 0.25, 0.125, 2.0, 1.0, 16.0, 0.5, 4.0]).reshape(2, 3, 2)
    full = values.float() * scales.repeat_interleave(2, 1).repeat_interleave(3, 2)
    for box in (((0, 0, 0), (1, 2, 6)), ((0, 0, 0), (1, 4, 6)), ((0, 2, 3), (2, 2, 3)), ((0, 1, 0), (2, 4, 6))):
        out, _, _ = _decode(fmt, [values, scales], box, params)
        want = full[tuple(slice(o, o + n) for o, n in zip(*box))]
        assert torch.equal(out, want), box


def test_a_decode_into_memory_that_is_not_rows_goes_through_a_scratch_copy():
    """An output whose strides forbid a [rows, cols] view (leading dims swapped) is filled through a
    scratch tensor, with the same values as a contiguous one."""
    fmt = get_format("fp8_tensor")
    values = _codes(24, 17).view(torch.float8_e4m3fn).reshape(2, 4, 3)
    parts = [Part("v", E4M3, (2, 4, 3)), Part("s", "float32", ())]
    box = ((0, 0, 0), (2, 4, 3))
    covers = fmt.cover(box, parts, TO)
    out = torch.zeros(4, 2, 3, dtype=torch.bfloat16).transpose(0, 1)  # dims 0 and 1 cannot merge
    assert kernels.rows_of(out) is None
    fmt.decode([values, torch.tensor(0.5)], box, covers, TO, out)
    assert torch.equal(out, (values.float() * 0.5).to(torch.bfloat16))


def test_e8m0_255_is_the_canonical_quiet_nan():
    assert _scale_f32(torch.tensor([255, 0], dtype=torch.uint8), "e8m0").view(torch.int32).tolist() == [
        0x7FC00000, 0x00400000]
