"""Compiled rules -> the DCP `Metadata` of the checkpoint as the runtime sees it: each runtime tensor
one whole chunk, so DCP's default planner asks exactly the box each destination shard holds."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                  TensorStorageMetadata)

from ..compile.model import Compiled
from ..errors import did_you_mean
from .errors import fail


class RuntimeTensors(dict):
    """runtime key -> TensorStorageMetadata; `in` with a key the rules do not make is E600 (DCP's
    default planner asks it of every state-dict key, and would say only "Missing key ...")."""

    def __init__(self, entries, checkpoint: str, rules: str):
        super().__init__(entries)
        self.checkpoint, self.rules = checkpoint, rules

    def __contains__(self, runtime_key) -> bool:
        self.require(runtime_key)
        return True

    def require(self, runtime_key) -> None:
        """Nothing if the rules make `runtime_key`, else E600 with the closest runtime key."""
        if dict.__contains__(self, runtime_key):
            return
        raise fail("E600", f"the state dict asks for `{runtime_key}`, but {self.rules} make no such tensor "
                   "from this checkpoint", path=self.checkpoint, hint=did_you_mean(str(runtime_key), self.keys())
                   or "add a rule that makes it, or leave it out of the state dict given to dcp.load")


def runtime_metadata(compiled: Compiled, checkpoint: str, rules: str) -> Metadata:
    """The Metadata of every runtime tensor of `compiled`, each one whole chunk (`checkpoint`, `rules`: for messages)."""
    entries = {}
    for d in compiled.runtime_tensors:
        dtype = getattr(torch, d.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise fail("E602", f"`{d.runtime_key}` is made as {d.dtype}, which torch has no dtype for",
                       path=checkpoint, hint="add `| cast(...)` to the rule that makes it")
        entries[d.runtime_key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype), size=torch.Size(d.shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size((0,) * len(d.shape)), sizes=torch.Size(d.shape))])
    return Metadata(state_dict_metadata=RuntimeTensors(entries, checkpoint, rules))
