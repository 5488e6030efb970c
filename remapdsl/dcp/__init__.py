"""remapdsl for torch.distributed.checkpoint: `dcp.load` through a rule file, the checkpoint presented in
the runtime layout its rules make (docs/dcp.md). Importing this package imports torch."""

from __future__ import annotations

from .errors import ReaderError, remap_errors
from .reader import ReadReport, RuleStorageReader

__all__ = ["ReadReport", "ReaderError", "RuleStorageReader", "remap_errors"]
