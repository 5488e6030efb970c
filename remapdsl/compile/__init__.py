"""Rules + checkpoint inventory + config -> Compiled: blocks that tile every runtime tensor.

Entry point: `compile_rules(rules, inventory, config)`. Shapes only; no tensor data is read.
"""

from .compiler import compile_rules
from .model import Compiled

__all__ = ["Compiled", "compile_rules"]
