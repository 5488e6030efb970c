"""Placements and meshes -> the boxes a rank holds; compiled blocks + boxes -> frozen per-rank plans.
No process group is needed for any of it."""

from .layouts import LayoutPlan, layout_for, parse_mesh, read_layout
from .placements import (FirstOnly, LayoutError, Mesh, PackedShard, Replicate, Shard, StridedShard, local_shard,
                         placements_from_dtensor)

__all__ = ["FirstOnly", "LayoutError", "LayoutPlan", "Mesh", "PackedShard", "Replicate", "Shard", "StridedShard",
           "layout_for", "local_shard", "parse_mesh", "placements_from_dtensor", "read_layout"]
