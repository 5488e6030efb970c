"""The rule language: text -> frozen IR (lexer, builder, IR, checks, formatter, comments, includes).

Entry points: `load_rules(path)` and `rules_from_text(text)` (a rule file and its includes, checked:
a RuleSet), `parse_file` / `parse_text` (one file's IR, includes not followed), `format_rules`
(IR -> canonical text). Text in, IR out: nothing here knows checkpoints or tensors.
"""

from .formatter import format_rules
from .includes import RuleSet, load_rules, rules_from_text
from .parser import parse_file, parse_text

__all__ = ["RuleSet", "format_rules", "load_rules", "parse_file", "parse_text", "rules_from_text"]
