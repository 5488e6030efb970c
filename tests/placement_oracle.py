"""The global indices each rank holds of a placed tensor, worked out index by index as torch's
placement docs describe them (Shard: torch.chunk; _StridedShard: chunk, then chunk each piece):
the oracle the placements are checked against, in one process and against DTensor on gloo ranks."""

from __future__ import annotations

import torch

from remapdsl.sharding.placements import Replicate, Shard


def chunks(indices, n):
    """torch.chunk of an index list into exactly n pieces (trailing ones empty)."""
    pieces = [t.tolist() for t in torch.tensor(indices, dtype=torch.long).chunk(n)] if indices else []
    return pieces + [[]] * (n - len(pieces))


def oracle_indices(shape, mesh_shape, placements, coordinate):
    """Per tensor dim, the held global indices as a Python list (the recipe of torch's placement docs, index by index), and whether
    every _StridedShard split was even across its mesh dim (torch 2.13 asserts otherwise)."""
    held, even = [list(range(n)) for n in shape], True
    for p, n, c in zip(placements, mesh_shape, coordinate):
        if isinstance(p, Replicate):
            continue
        d = p.dim % len(shape)
        if isinstance(p, Shard):
            held[d] = chunks(held[d], n)[c]
        else:
            split = [chunks(piece, n) for piece in chunks(held[d], p.split_factor)]
            even &= len({sum(len(s[k]) for s in split) for k in range(n)}) == 1
            held[d] = [i for s in split for i in s[c]]
    return held, even
