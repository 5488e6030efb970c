"""Placements and meshes -> the boxes a rank holds; compiled blocks + boxes -> frozen per-rank plans.

`placements` (torch DTensor's Shard, Replicate, _StridedShard, meshes, the boxes a rank holds),
`layouts` (tp_plan-style layout plans), `holdings` (a state dict's tensors -> what this rank holds
and writes), `plans` (frozen LoadPlan and WritePlan). No process group is needed for any of it.
"""

from .layouts import LayoutPlan, layout_for, parse_mesh, read_layout
from .placements import LayoutError, Mesh, Replicate, Shard, StridedShard, local_shard, placements_from_dtensor

__all__ = ["LayoutError", "LayoutPlan", "Mesh", "Replicate", "Shard", "StridedShard", "layout_for", "local_shard",
           "parse_mesh", "placements_from_dtensor", "read_layout"]
