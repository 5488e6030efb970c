"""remapdsl for torch.distributed.checkpoint: `dcp.load` through a rule file (docs/dcp.md).

`RuleStorageReader(path, rules)` presents a checkpoint folder in the runtime layout its rules make.
Importing this package imports torch.
"""

from __future__ import annotations

from .errors import ReaderError, remap_errors
from .reader import ReadReport, RuleStorageReader

__all__ = ["ReadReport", "ReaderError", "RuleStorageReader", "remap_errors"]
