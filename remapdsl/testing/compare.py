"""State dicts and checkpoint files compared exactly -> messages a user can act on: the keys that
differ first, then per tensor the shape or dtype, then the first differing index and both values."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

MAX_LISTED = 10  # keys or tensors named per kind of difference; the rest counted


def _listed(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(f"`{k}`" for k in keys[:MAX_LISTED])
    return shown + (f" and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else "")


def fail_on(found: list[str], headline: str) -> None:
    """Raise an AssertionError of `headline` and the differences found, one a line, if there are any."""
    if found:
        raise AssertionError(f"{headline}:\n  " + "\n  ".join(found))


def _capped(found: list[str], prefix: str = "") -> list[str]:
    """The first MAX_LISTED differences found, the rest counted."""
    more = len(found) - MAX_LISTED
    return found[:MAX_LISTED] + ([f"{prefix}and {more} more tensors differ"] if more > 0 else [])


def key_differences(a, b, names: tuple[str, str]) -> list[str]:
    """`only in ...` for the keys of each side the other lacks."""
    return [f"only in {name}: {_listed(set(x) - set(y))}" for name, x, y in ((names[0], a, b), (names[1], b, a))
            if set(x) - set(y)]


def _state(value) -> Mapping:
    return value.state_dict() if hasattr(value, "state_dict") and callable(value.state_dict) else value


def _plain(t):
    """A tensor on the CPU, whole (a DTensor's full tensor), detached."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().cpu().contiguous()


def _bits(t):
    """`t` viewed as integers of its element size: equality of bits (NaN equals itself, -0 != 0)."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width) if t.dtype != width else t


def _show(t, index) -> str:
    value = t[index] if index else t
    try:
        return repr(value.item())
    except (RuntimeError, TypeError):  # dtypes without a Python scalar (FP4 pairs): the raw code
        return f"code 0x{_bits(value).item() & 0xFF:02x}"


def tensor_difference(actual, expected, names: tuple[str, str] = ("actual", "expected")) -> str | None:
    """Why two tensors are not bit for bit equal (dtype, shape, or how many elements and the first
    differing one), or None."""
    a, b = _plain(actual), _plain(expected)
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return (f"{names[0]} is {str(a.dtype).removeprefix('torch.')} {list(a.shape)}, "
                f"{names[1]} {str(b.dtype).removeprefix('torch.')} {list(b.shape)}")
    differs = _bits(a) != _bits(b)
    count = int(differs.sum())
    if count == 0:
        return None
    index = tuple(int(i) for i in differs.nonzero()[0]) if a.dim() else ()
    where = f"[{', '.join(map(str, index))}]" if index else "(the scalar)"
    return (f"{count} of {math.prod(a.shape)} elements differ; first at {where}: {names[0]} "
            f"{_show(a, index)}, {names[1]} {_show(b, index)}")


def state_dict_differences(actual, expected, names: tuple[str, str] = ("actual", "expected")) -> list[str]:
    """The differences between two state dicts (or modules), keys first: empty when equal."""
    a, b = _state(actual), _state(expected)
    found = [f"`{k}`: {why}" for k in sorted(set(a) & set(b))
             if (why := tensor_difference(a[k], b[k], names))]
    return key_differences(a, b, names) + _capped(found)


def assert_state_dicts_equal(actual, expected, *, names: tuple[str, str] = ("actual", "expected")) -> None:
    """Assert two state dicts (or modules; DTensors compared whole) hold the same keys and exactly the same
    tensors, every bit (else an AssertionError: `state_dict_differences`); `names` name the two in it."""
    fail_on(state_dict_differences(actual, expected, names), f"state dicts differ ({names[0]} vs {names[1]})")


def file_differences(inventory, produced: Path) -> list[str]:
    """How the safetensors files in `produced` differ from `inventory`'s: files missing or extra, then
    per file the header, or the tensors whose bytes differ."""
    import torch

    from remapdsl.dtypes import BY_NAME

    out = []
    wanted = set(inventory.files)
    made = {p.relative_to(produced).as_posix() for p in produced.rglob("*.safetensors")}
    if wanted - made:
        out.append(f"files not written: {_listed(wanted - made)}")
    if made - wanted:
        out.append(f"files written that the original has not: {_listed(made - wanted)}")
    by_file: dict[str, list] = {}
    for t in inventory.tensors.values():
        for c in inventory.stored(t.ckpt_key):  # a DCP-sharded tensor: each chunk where it is, of its sizes
            by_file.setdefault(c.file, []).append(t._replace(
                file=c.file, shape=c.sizes, byte_offset=c.byte_offset, nbytes=c.nbytes(t.dtype)))
    for name in sorted(wanted & made):
        original = Path(inventory.path(name)).read_bytes()
        copy = (produced / name).read_bytes()
        if original == copy:
            continue
        info = inventory.files[name]
        if original[:info.data_offset] != copy[:info.data_offset] or len(original) != len(copy):
            out.append(f"{name}: the header or the file size differs ({len(copy)} B vs {len(original)} B)")
            continue
        differing = []
        for t in sorted(by_file.get(name, []), key=lambda t: t.byte_offset):
            got, want = copy[t.byte_offset:t.byte_end], original[t.byte_offset:t.byte_end]
            if got == want:
                continue
            dtype = BY_NAME[t.dtype]
            if dtype.in_torch and dtype.bits >= 8:
                written, original_tensor = (torch.frombuffer(bytearray(raw), dtype=getattr(torch, t.dtype))
                                            .reshape(list(t.shape)) for raw in (got, want))
                why = tensor_difference(written, original_tensor, ("written", "original"))
            else:
                at = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
                why = f"byte {at} of the tensor differs: written 0x{got[at]:02x}, original 0x{want[at]:02x}"
            differing.append(f"{name}: tensor `{t.ckpt_key}`: {why}")
        out += _capped(differing, f"{name}: ")
    return out
