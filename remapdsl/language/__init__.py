"""The rule language: text -> frozen IR; nothing here knows checkpoints or tensors.

Entry points: `load_rules` / `rules_from_text` (a file and its includes, checked: a RuleSet),
`parse_file` / `parse_text` (one file, includes not followed), `format_rules` (IR -> canonical text),
`resolve_rules_path` / `shipped_rules` (the shipped rule library).
"""

from .formatter import format_rules
from .includes import RuleSet, load_rules, rules_from_text
from .library import resolve_rules_path, shipped_rules
from .parser import parse_file, parse_text

__all__ = ["RuleSet", "format_rules", "load_rules", "parse_file", "parse_text", "resolve_rules_path",
           "rules_from_text", "shipped_rules"]
