"""Hypothesis strategies for a rule file's properties: random checkpoints in a snapshot's layout, meshes,
valid placements, and valid op chains (`op_chains`). The one module of remapdsl.testing that needs hypothesis."""

from __future__ import annotations

import atexit
import glob
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise, product
from pathlib import Path

import torch
from hypothesis import strategies as st

from remapdsl import open_checkpoint
from remapdsl.language.parser import parse_text
from remapdsl.sharding import LayoutError, LayoutPlan, Mesh, Replicate, Shard, StridedShard, local_shard
from remapdsl.testing.data import write_checkpoint, write_pretrained
from remapdsl.testing.reference import apply_ops

MESH_NAMES = ("dp", "tp", "ep")
MAX_DIM = 12  # no dim of a drawn op chain grows past this, so every example stays tiny
DTYPES = ("float32", "bfloat16", "float16", "float64")


def _strategy(value) -> st.SearchStrategy:
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


def checkpoints(source, *, root: str | os.PathLike | None = None, layers=None, experts=None,
                seeds: st.SearchStrategy[int] = st.integers(0, 2**31 - 1)) -> st.SearchStrategy[Path]:
    """Checkpoint folders in the layout of `source` (a snapshot, checkpoint folder or Inventory) with random
    values from `seeds`, or, for a transformers config dict, a tiny model of it (`write_pretrained`); each a
    new folder under `root` (default: a temporary one). `layers`, `experts`: keep the first N (an int or a
    strategy; `scale_down`), not with a config, which says its own."""
    pretrained = isinstance(source, Mapping)
    if pretrained and (layers is not None or experts is not None):
        raise ValueError("a config says its own numbers of layers and experts: set them in it")
    inventory = None if pretrained else open_checkpoint(source)  # read once; every example reuses it
    if root is None:
        base = Path(tempfile.mkdtemp(prefix="remapdsl-checkpoints-"))
        atexit.register(shutil.rmtree, base, ignore_errors=True)
    else:
        base = Path(root)

    @st.composite
    def build(draw) -> Path:
        seed = draw(seeds)
        n_layers, n_experts = draw(_strategy(layers)), draw(_strategy(experts))
        folder = Path(tempfile.mkdtemp(prefix=f"seed{seed}-", dir=base))
        if pretrained:
            return write_pretrained(source, folder, seed)
        return write_checkpoint(inventory, folder, seed=seed, layers=n_layers, experts=n_experts)

    return build()


@st.composite
def meshes(draw, max_ranks: int = 8, max_dims: int = 3, names: Sequence[str] = MESH_NAMES) -> Mesh:
    """Device meshes of 1 to `max_dims` dims (named from `names`, outermost first) and at most
    `max_ranks` ranks; dims of size 1 included."""
    count = draw(st.integers(1, min(max_dims, len(names))))
    dims, left = {}, max_ranks
    for name in draw(st.permutations(list(names)))[:count]:
        size = draw(st.integers(1, max(1, left)))
        dims[name] = size
        left //= size
    return Mesh.of(dims)


def _valid(shape: Sequence[int], mesh: Mesh, chosen: tuple) -> bool:
    try:
        for rank in range(mesh.size):
            local_shard(shape, mesh.sizes, chosen, mesh.coordinate(rank))
    except LayoutError:
        return False
    return True


def placements(shape: Sequence[int], mesh: Mesh) -> st.SearchStrategy[tuple]:
    """Placements of a tensor of `shape` on `mesh` (one per mesh dim) that every rank can hold:
    `Replicate`, `Shard(d)` (uneven and empty shards included) and `StridedShard(d, k)`."""
    ndim = len(shape)
    one = [st.just(Replicate())]
    if ndim:
        dims = st.integers(0, ndim - 1)
        one += [st.builds(Shard, dim=dims), st.builds(StridedShard, dim=dims, split_factor=st.integers(1, 4))]
    chosen = st.tuples(*[st.one_of(one) for _ in mesh.sizes])
    return chosen.filter(lambda c: _valid(shape, mesh, c))


@st.composite
def layouts(draw, compiled, mesh: Mesh) -> LayoutPlan:
    """A layout plan giving each runtime tensor of `compiled` its own valid placements on `mesh`
    (rules that move stored quantized values may still refuse a shard edge inside a block, E412)."""
    plan = {glob.escape(t.runtime_key): list(draw(placements(t.shape, mesh))) for t in compiled.runtime_tensors}
    return LayoutPlan.from_mapping(plan, mesh_dim=mesh.names[0])


@dataclass
class Chain:
    """An op chain being drawn, with the shapes of its list axis so far (`ops`: the ops' text)."""

    shapes: list[tuple[int, ...]]
    combined: bool = False  # a combining op has run (list axis -> one tensor)
    cut: int | None = None  # the pieces of a cutting op, when one has run
    ops: list[str] = field(default_factory=list)

    def push(self, text: str, targets: int | None = None) -> None:
        ops = list(parse_text(f"a -> b | {text}").statements[0].ops)
        out = apply_ops(ops, [torch.zeros(s) for s in self.shapes], targets=targets)
        self.shapes = [tuple(t.shape) for t in out]
        self.ops.append(text)


def _dim(draw, ndim: int, d: int | None = None) -> int:
    """Dim `d` (default: drawn) of `ndim`, sometimes written negative."""
    d = draw(st.integers(0, ndim - 1)) if d is None else d
    return d - ndim if draw(st.booleans()) and draw(st.booleans()) else d


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _factorization(draw, numel: int) -> list[int]:
    ndim = draw(st.integers(1, 4))
    sizes, left = [], numel
    for _ in range(ndim - 1):
        k = draw(st.sampled_from(_divisors(left)))
        sizes.append(k)
        left //= k
    sizes.append(left)
    sizes = draw(st.permutations(sizes))
    if draw(st.booleans()):
        sizes[draw(st.integers(0, len(sizes) - 1))] = -1
    return sizes


def _combine(draw, chain: Chain) -> str | None:
    shapes = chain.shapes
    ndim = len(shapes[0])
    kinds = ["stack"] if all(s == shapes[0] for s in shapes) else []
    along = [d for d in range(ndim) if all(s[:d] + s[d + 1:] == shapes[0][:d] + shapes[0][d + 1:]
                                           for s in shapes)]
    kinds += ["concat", "interleave"] if along else []
    if not kinds:
        return None
    kind = draw(st.sampled_from(kinds))
    if kind == "stack":
        return f"stack(dim={draw(st.integers(0, ndim))})"
    d = draw(st.sampled_from(along))
    dim = _dim(draw, ndim, d)
    if kind == "concat":
        return f"concat(dim={dim})"
    groups = draw(st.sampled_from(_divisors(math.gcd(*(s[d] for s in shapes)))))
    return f"interleave(dim={dim}, groups={groups})"


def _cut(draw, shape: tuple[int, ...]) -> tuple[str, int] | None:
    d = draw(st.integers(0, len(shape) - 1))
    size = shape[d]
    kind = draw(st.sampled_from(["split", "chunk", "deinterleave"]))
    if kind == "split":
        if size < 2:
            return None
        cuts = sorted(draw(st.sets(st.integers(1, size - 1), min_size=1, max_size=min(2, size - 1))))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [size])]
        return f"split(dim={d}, sizes={sizes})", len(sizes)
    if kind == "chunk":
        n = draw(st.sampled_from([k for k in _divisors(size) if 2 <= k <= 3] or [1]))
        return f"chunk(dim={d}, n={n})", n
    pairs = [(g, p) for g in _divisors(size) for p in (2, 3) if size % (g * p) == 0]
    if not pairs:
        return None
    groups, parts = draw(st.sampled_from(pairs))
    return f"deinterleave(dim={d}, groups={groups})", parts


def _per_tensor(draw, shapes: list[tuple[int, ...]]) -> str | None:
    ndim = len(shapes[0])
    kind = draw(st.sampled_from(["transpose", "permute", "reshape", "slice", "pad", "repeat",
                                 "rope_permute", "rope_unpermute", "cast", "scale", "add"]))
    if kind == "transpose":
        return f"transpose({_dim(draw, ndim)}, {_dim(draw, ndim)})"
    if kind == "permute":
        return f"permute({draw(st.permutations(range(ndim)))})"
    if kind == "reshape":
        if any(s != shapes[0] for s in shapes):
            return None
        return f"reshape({_factorization(draw, math.prod(shapes[0]))})"
    if kind in ("slice", "pad", "repeat"):
        d = _dim(draw, ndim)
        low, high = min(s[d] for s in shapes), max(s[d] for s in shapes)
        if kind == "slice":
            start = draw(st.integers(0, low - 1))
            stop = draw(st.integers(start + 1, low))
            args = f"dim={d}" + (f", start={start}" if start or draw(st.booleans()) else "")
            return f"slice({args}" + (f", stop={stop})" if stop < low or draw(st.booleans()) else ")")
        if kind == "pad":
            if high >= MAX_DIM:
                return None
            to = draw(st.integers(high, min(MAX_DIM, high + 3)))
            value = draw(st.sampled_from(["", ", value=0", ", value=1.5", ", value=-2"]))
            return f"pad(dim={d}, to={to}{value})"
        times = draw(st.integers(1, max(1, MAX_DIM // high)))
        return f"repeat(dim={d}, times={times})"
    if kind in ("rope_permute", "rope_unpermute"):
        heads = [h for h in range(1, 5) if all(s[0] % (2 * h) == 0 for s in shapes)]
        return f"{kind}(heads={draw(st.sampled_from(heads))})" if heads else None
    if kind == "cast":
        return f"cast({draw(st.sampled_from(DTYPES))})"
    if kind == "scale":
        return f"scale({draw(st.sampled_from(['2', '0.5', '-1', '-0.25', '3']))})"
    return f"add({draw(st.sampled_from(['1', '-0.5', '0.25', '-3']))})"


def draw_ops(draw, chain: Chain, count: int, *, may_cut: bool = True) -> Chain:
    """Add up to `count` ops valid for the chain's shapes (a combine when several sources)."""
    def may_combine() -> bool:  # a combine after a cut would leave too few targets (E111)
        return len(chain.shapes) > 1 and not chain.combined and chain.cut is None

    while len(chain.ops) < count or (may_combine() and draw(st.booleans())):
        choice = draw(st.integers(0, 9))
        if may_combine() and choice < 4:
            text = _combine(draw, chain)
            if text is None:
                break  # no combine fits: the sources pair with the targets by position
            chain.combined = True
            chain.push(text)
        elif may_cut and len(chain.shapes) == 1 and chain.cut is None and choice == 9:
            cut = _cut(draw, chain.shapes[0])
            if cut is not None:
                chain.cut = cut[1]
                chain.push(cut[0], targets=cut[1])
        else:
            text = _per_tensor(draw, chain.shapes)
            if text is not None:
                chain.push(text)
        if len(chain.ops) > count + 2:
            break
    return chain


@st.composite
def op_chains(draw, shapes: Sequence[Sequence[int]], max_ops: int = 4, cuts: bool = True) -> Chain:
    """A valid chain of up to `max_ops` ops (a few more where a combine is drawn) for sources of
    `shapes`: layout ops, cuts (with `cuts`), pads, casts and value ops. `.ops` is its text, `.shapes`
    the targets'; `remapdsl.testing.reference.apply_ops` gives the expected tensors."""
    return draw_ops(draw, Chain([tuple(s) for s in shapes]), draw(st.integers(1, max_ops)), may_cut=cuts)


@dataclass(frozen=True)
class Held:
    """A tensor as a caller may hold it: `tensor` (what is passed to remapdsl) is a view into `base`
    (all the memory behind it); `how` says its layout in words (for a failing example's note)."""

    tensor: torch.Tensor
    base: torch.Tensor
    how: str

    def outside(self) -> torch.Tensor:
        """The elements of `base` that `tensor` does not cover (what a fill of `tensor` must leave alone)."""
        mask = torch.ones(self.base.shape, dtype=torch.bool)
        marks = mask.view(-1).as_strided(self.tensor.shape, self.tensor.stride(),
                                          self.tensor.storage_offset() - self.base.storage_offset())
        marks.fill_(False)
        return self.base[mask]


@st.composite
def memory_layouts(draw, shape: Sequence[int], dtype: torch.dtype = torch.float32, *, fill: float = float("nan"),
                   expanded: bool = False) -> Held:
    """A tensor of `shape` and `dtype` in a memory layout of its own, every element `fill`: contiguous,
    or a view with other strides: dims permuted (a transposed weight), a slice of a larger tensor (margins
    on any dim, a storage offset), every k-th element of a dim, or all of those at once. With `expanded`,
    some dims of more than one element may have stride 0 (`expand`: several elements share memory), which
    no load can fill."""
    shape = tuple(int(n) for n in shape)
    ndim = len(shape)
    order = draw(st.permutations(range(ndim))) if ndim > 1 else list(range(ndim))
    wide = [n > 1 for n in shape]
    shared = [expanded and wide[d] and draw(st.booleans()) for d in range(ndim)]
    if expanded and any(wide) and not any(shared):
        shared[draw(st.sampled_from([d for d in range(ndim) if wide[d]]))] = True
    stored, cuts, how = [], [], []
    for d in order:  # the base holds the dims in this order, outermost first
        n = 1 if shared[d] else shape[d]
        step = draw(st.integers(1, 3)) if n > 1 else 1
        low, high = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        stored.append(low + (n - 1) * step + 1 + high if n else low + high)
        cuts.append(slice(low, low + (n - 1) * step + 1 if n else low, step))
        if low or high:
            how.append(f"dim {d} a slice {low}:{low + max(0, n - 1) * step + 1} of {stored[-1]}")
        if step > 1:
            how.append(f"dim {d} every {step}th")
    base = torch.full(stored, fill, dtype=dtype)
    view = base[tuple(cuts)].permute([order.index(d) for d in range(ndim)]) if ndim else base
    if any(shared):
        view = view.expand(shape)
        how.append("dims " + ", ".join(str(d) for d in range(ndim) if shared[d]) + " expanded (stride 0)")
    if list(order) != list(range(ndim)):
        how.append(f"stored in dim order {list(order)}")
    return Held(view, base, "; ".join(how) or "contiguous")


def laid_out(values: torch.Tensor) -> st.SearchStrategy[torch.Tensor]:
    """`values` copied into a tensor of a drawn memory layout (`memory_layouts`, nothing expanded): the
    same shape, dtype and values, other strides."""
    return memory_layouts(tuple(values.shape), values.dtype, fill=0).map(
        lambda held: held.tensor.copy_(values))


@dataclass(frozen=True)
class Affine:
    """An index map `slope * L + offset` (`name`: the capture) as a target's `{...}` writes it, and the
    source indices drawn with it (`indices`: each non-negative, as is its image)."""

    slope: int
    offset: int
    indices: tuple[int, ...]
    name: str = "L"

    def __call__(self, index: int) -> int:
        return self.slope * index + self.offset

    @property
    def text(self) -> str:
        """The substitution: `{2 * L + 1}`, `{L - 3}`, `{7 - 2 * L}`, `{L}`."""
        a, b, n = self.slope, self.offset, self.name
        term = n if abs(a) == 1 else f"{abs(a)} * {n}"
        if a < 0:
            return f"{{{b} - {term}}}"
        return f"{{{term}{f' + {b}' if b > 0 else f' - {-b}' if b < 0 else ''}}}"


@st.composite
def affine_indices(draw, count: int | st.SearchStrategy[int] = st.integers(1, 4), name: str = "L",
                   max_slope: int = 3, max_offset: int = 6) -> Affine:
    """An affine index map `a * L + b` (a != 0, of either sign; b of either sign) with `count`
    consecutive source indices from a drawn start, all of them and their images non-negative and the
    images distinct: what a target's `{2 * L + 1}`, `{L - 2}` or `{7 - L}` maps a checkpoint's layers by."""
    count = draw(_strategy(count))
    slope = draw(st.integers(-max_slope, max_slope).filter(bool))
    offset = draw(st.integers(-max_offset, max_offset))
    if slope > 0:  # from the least start whose image is >= 0
        start = max(0, -(offset // slope)) + draw(st.integers(0, 2))
    else:  # the images fall with L: the offset holds the last one >= 0, with room for a start up to 2
        start = draw(st.integers(0, 2))
        offset = max(offset, -slope * (count - 1)) - slope * 2
    return Affine(slope, offset, tuple(range(start, start + count)), name)


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)
TILINGS = ("grid", "staircase", "guillotine")


@dataclass(frozen=True)
class Tiling:
    """Chunk boxes `(offsets, sizes)` of a tensor of `shape`, as `write_dcp_sharded` writes them; `removed`:
    the boxes taken out of an exact tiling (`chunk_tilings(..., gaps=True)`)."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    kind: str
    removed: tuple[Box, ...] = ()


def _cuts(draw, n: int, most: int) -> list[int]:
    """Sorted edges 0 < ... < n of up to `most` parts of a dim of size `n`."""
    if n < 2 or most < 2:
        return [0, n]
    count = draw(st.integers(0, min(most, n) - 1))
    inner = sorted(draw(st.sets(st.integers(1, n - 1), min_size=count, max_size=count)))
    return [0, *inner, n]


@st.composite
def chunk_tilings(draw, shape: Sequence[int], max_chunks: int = 16, kinds: Sequence[str] = TILINGS,
                  empty: bool = True, gaps: bool = False) -> Tiling:
    """How the ranks of a DCP save may have cut a tensor of `shape`: chunks that tile it exactly once, of one
    of `kinds` (`grid`: cuts per dim, as DTensor placements give; `staircase`: bands along dim 0, each cut
    along dim 1 at its own places; `guillotine`: boxes split in two again and again). `empty`: zero-size
    chunks may be added, as DCP writes for a rank holding none; `gaps`: one or two taken out (`removed`)."""
    shape = tuple(int(n) for n in shape)
    ndim = len(shape)
    kinds = [k for k in kinds if k != "staircase" or ndim >= 2]
    kind = draw(st.sampled_from(kinds))
    if not ndim or not all(shape):
        boxes = [((0,) * ndim, shape)]
    elif kind == "grid":
        per = max(1, round(max_chunks ** (1 / ndim)))
        edges = [_cuts(draw, n, per) for n in shape]
        boxes = [(tuple(e[i] for e, i in zip(edges, at)), tuple(e[i + 1] - e[i] for e, i in zip(edges, at)))
                 for at in product(*[range(len(e) - 1) for e in edges])]
    elif kind == "staircase":
        rows = _cuts(draw, shape[0], max(1, max_chunks // 2))
        boxes = [((a, c) + (0,) * (ndim - 2), (b - a, d - c) + shape[2:]) for a, b in pairwise(rows)
                 for c, d in pairwise(_cuts(draw, shape[1], max(1, max_chunks // (len(rows) - 1))))]
    else:
        boxes = [((0,) * ndim, shape)]
        for _ in range(draw(st.integers(0, max_chunks - 1))):
            i = draw(st.integers(0, len(boxes) - 1))
            offsets, sizes = boxes[i]
            dims = [d for d in range(ndim) if sizes[d] > 1]
            if not dims:
                continue
            d = draw(st.sampled_from(dims))
            at = draw(st.integers(1, sizes[d] - 1))
            boxes[i:i + 1] = [(offsets, sizes[:d] + (at,) + sizes[d + 1:]),
                              (offsets[:d] + (offsets[d] + at,) + offsets[d + 1:],
                               sizes[:d] + (sizes[d] - at,) + sizes[d + 1:])]
    removed: list[Box] = []
    if gaps and len(boxes) > 1:
        removed = [boxes.pop(draw(st.integers(0, len(boxes) - 1)))
                   for _ in range(draw(st.integers(1, min(2, len(boxes) - 1))))]
    if empty and ndim and draw(st.booleans()):
        d = draw(st.integers(0, ndim - 1))
        at = draw(st.integers(0, shape[d]))
        boxes.append((tuple(at if k == d else 0 for k in range(ndim)),
                      tuple(0 if k == d else shape[k] for k in range(ndim))))
    boxes = draw(st.permutations(boxes))  # the ranks' order says nothing of where their chunks lie
    return Tiling(shape, tuple(boxes), kind, tuple(removed))
