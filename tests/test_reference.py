"""The oracle checked by hand: remapdsl.testing.reference on tiny tensors whose answers are written out."""

from __future__ import annotations

import pytest
import torch

from remapdsl.language import ir
from remapdsl.language.parser import parse_text
from remapdsl.testing.reference import apply_ops, literal


def ops(text: str) -> list[ir.Op]:
    """The ops of `a -> b | <text>`, parsed (not checked)."""
    return list(parse_text(f"a -> b | {text}").statements[0].ops)


def rows(*values) -> torch.Tensor:
    """A column of the given values: row i holds values[i]."""
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1)


def flat(ts: list[torch.Tensor]) -> list[list[float]]:
    return [t.flatten().tolist() for t in ts]


def test_interleave_groups_q_and_k():
    q, k = rows(0, 1), rows(10, 11)  # [q0 q1 | k0 k1]
    assert flat(apply_ops(ops("interleave(dim=0, groups=2)"), [q, k])) == [[0, 10, 1, 11]]


def test_interleave_unequal_sources_gqa():
    q, k, v = rows(0, 1, 2, 3), rows(10, 11), rows(20, 21)
    out = apply_ops(ops("interleave(dim=0, groups=2)"), [q, k, v])
    assert flat(out) == [[0, 1, 10, 20, 2, 3, 11, 21]]


def test_deinterleave_undoes_interleave():
    fused = rows(0, 10, 1, 11, 2, 12)
    out = apply_ops(ops("deinterleave(dim=0, groups=3)"), [fused], targets=2)
    assert flat(out) == [[0, 1, 2], [10, 11, 12]]


def test_rope_permute_two_heads_of_eight_rows():
    # per head of 4 rows: pairs (r0 r1)(r2 r3) -> rotate-half order r0 r2 | r1 r3
    w = torch.arange(8.0).reshape(8, 1).repeat(1, 3)
    (out,) = apply_ops(ops("rope_permute(heads=2)"), [w])
    assert out[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert torch.equal(out[:, 1], out[:, 0]) and out.shape == (8, 3)


def test_rope_permute_one_head():
    (out,) = apply_ops(ops("rope_permute(heads=1)"), [torch.arange(8.0)])
    assert out.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_rope_unpermute_is_the_inverse_of_rope_permute():
    # per head of 4 rows in rotate-half order r0 r2 | r1 r3 -> pairs (r0 r1)(r2 r3) again
    w = torch.tensor([0.0, 2, 1, 3, 4, 6, 5, 7]).reshape(8, 1)
    (out,) = apply_ops(ops("rope_unpermute(heads=2)"), [w])
    assert out[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    x = torch.randn(24, 5)
    for heads in (1, 2, 3, 6):
        (back,) = apply_ops(ops(f"rope_permute(heads={heads}) | rope_unpermute(heads={heads})"), [x])
        assert torch.equal(back, x)


def test_concat_and_stack_of_the_list_axis():
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])
    assert apply_ops(ops("concat(dim=1)"), [a, b])[0].tolist() == [[1, 2, 3, 4]]
    assert apply_ops(ops("concat(dim=0)"), [a, b])[0].tolist() == [[1, 2], [3, 4]]
    assert apply_ops(ops("stack(dim=2)"), [a, b])[0].tolist() == [[[1, 3], [2, 4]]]


def test_stack_of_a_capture_is_numeric_order():
    by_e = {e: [torch.tensor([float(e)])] for e in (10, 2, 0, 9, 1, 3, 4, 5, 6, 7, 8)}
    (out,) = apply_ops(ops("stack(E, dim=0)"), by_e)
    assert out.flatten().tolist() == list(range(11))
    (out,) = apply_ops(ops("concat(E, dim=0, start=3)"), {4: [rows(4)], 3: [rows(3)]})
    assert out.flatten().tolist() == [3, 4]
    with pytest.raises(AssertionError):
        apply_ops(ops("stack(E, dim=0)"), {0: [rows(0)], 2: [rows(2)]})


def test_capture_then_list_axis():
    # e.{E}.{gate,up} -> w13 | stack(E, dim=0) | concat(dim=1)
    by_e = {e: [rows(e), rows(10 + e)] for e in range(2)}
    (out,) = apply_ops(ops("stack(E, dim=0) | concat(dim=1)"), by_e)
    assert out.shape == (2, 2, 1)
    assert out.flatten().tolist() == [0, 10, 1, 11]


def test_unstack():
    out = apply_ops(ops("unstack(X, dim=1, start=5)"), [torch.tensor([[1.0, 2.0], [3.0, 4.0]])])
    assert {k: flat(v) for k, v in out.items()} == {5: [[1, 3]], 6: [[2, 4]]}


def test_split_chunk_slice():
    t = rows(0, 1, 2, 3, 4, 5)
    assert flat(apply_ops(ops("split(dim=0, sizes=[1, 3, 2])"), [t])) == [[0], [1, 2, 3], [4, 5]]
    assert flat(apply_ops(ops("chunk(dim=0, n=3)"), [t])) == [[0, 1], [2, 3], [4, 5]]
    assert flat(apply_ops(ops("slice(dim=0, start=2, stop=4)"), [t])) == [[2, 3]]
    assert flat(apply_ops(ops("slice(dim=-2, start=4)"), [t])) == [[4, 5]]
    assert flat(apply_ops(ops("slice(dim=0, stop=1)"), [t])) == [[0]]
    with pytest.raises(AssertionError):
        apply_ops(ops("chunk(dim=0, n=4)"), [t])


def test_pad_and_repeat():
    t = torch.tensor([[1.0, 2.0]])
    assert apply_ops(ops("pad(dim=1, to=4)"), [t])[0].tolist() == [[1, 2, 0, 0]]
    assert apply_ops(ops("pad(dim=0, to=2, value=-1.5)"), [t])[0].tolist() == [[1, 2], [-1.5, -1.5]]
    assert apply_ops(ops("repeat(dim=0, times=3)"), [t])[0].tolist() == [[1, 2]] * 3
    # repeat copies the whole tensor (torch.cat), not each element (repeat_interleave)
    assert apply_ops(ops("repeat(dim=1, times=2)"), [t])[0].tolist() == [[1, 2, 1, 2]]


def test_transpose_permute_reshape():
    t = torch.arange(6.0).reshape(1, 2, 3)
    assert apply_ops(ops("transpose(-1, 0)"), [t])[0].shape == (3, 2, 1)
    assert apply_ops(ops("permute([2, 0, 1])"), [t])[0].tolist() == [[[0, 3]], [[1, 4]], [[2, 5]]]
    assert apply_ops(ops("reshape([3, -1])"), [t])[0].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert apply_ops(ops("transpose(1, 2) | reshape([-1])"), [t])[0].tolist() == [0, 3, 1, 4, 2, 5]


def test_value_ops_compute_in_float32_and_keep_the_dtype():
    t = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    (out,) = apply_ops(ops("scale(0.5) | add(1)"), [t])
    assert out.dtype == torch.bfloat16 and out.tolist() == [1.5, 2.5]
    (out,) = apply_ops(ops("cast(float32) | scale(-2)"), [t])
    assert out.dtype == torch.float32 and out.tolist() == [-2.0, -6.0]
    # float32 arithmetic, then one rounding to bfloat16: 257 is not a bfloat16, 256 + 1 rounds
    (out,) = apply_ops(ops("add(1)"), [torch.tensor([256.0], dtype=torch.bfloat16)])
    assert out.item() == 256.0


def test_value_ops_apply_to_a_padded_region():
    # `scale` multiplies every element, the fill of an earlier `pad` included
    (out,) = apply_ops(ops("pad(dim=0, to=3, value=1) | scale(2) | add(1)"), [torch.tensor([5.0])])
    assert out.tolist() == [11.0, 3.0, 3.0]


def test_literal_arguments():
    assert literal(ir.List(items=(ir.Int(value=-1), ir.Int(value=4)))) == [-1, 4]
    assert literal(ir.Name(id="bfloat16")) == "bfloat16"
    with pytest.raises(ValueError):
        literal(ir.Config(path=("hidden_size",)))
    evaluate = lambda e: 2 if isinstance(e, ir.Config) else literal(e)  # noqa: E731
    op = parse_text("a -> b | chunk(dim=0, n=config.n)").statements[0].ops
    assert flat(apply_ops(list(op), [rows(0, 1)], evaluate)) == [[0], [1]]
