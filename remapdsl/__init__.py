"""remapdsl: one declarative rule file -> exact, sharded loads and saves of model checkpoints.

The public API. Today: the language front end (parse, check, format). Stages are plain functions
from frozen data to frozen data; see docs/architecture.md.
"""

from .errors import (
    BindError,
    CheckpointError,
    Diagnostic,
    RemapError,
    RuleCheckError,
    RuleSyntaxError,
    Span,
)
from .format import format_rules
from .parse import parse_file, parse_text
from .rules import RuleSet, load_rules, rules_from_text

__version__ = "0.1.0"

__all__ = [
    "BindError",
    "CheckpointError",
    "Diagnostic",
    "RemapError",
    "RuleCheckError",
    "RuleSet",
    "RuleSyntaxError",
    "Span",
    "format_rules",
    "load_rules",
    "parse_file",
    "parse_text",
    "rules_from_text",
]
