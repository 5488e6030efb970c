"""The rule language: text -> frozen IR (lexer, builder, IR, checks, formatter, comments, includes).

The IR is ir.py (statements, re-exporting nodes.py and ops.py); the parser (parser.py) runs the
builder's callbacks (builder.py, pattern_builder.py, expr_builder.py, context.py); the static
checks are check.py and literals.py. Quantized formats are named here, defined in quant/.

Entry points: `load_rules(path)` and `rules_from_text(text)` (a rule file and its includes, checked:
a RuleSet), `parse_file` / `parse_text` (one file's IR, includes not followed), `format_rules`
(IR -> canonical text), `resolve_rules_path` / `shipped_rules` (the shipped rule library, by name:
library.py). Text in, IR out: nothing here knows checkpoints or tensors.
"""

from .formatter import format_rules
from .includes import RuleSet, load_rules, rules_from_text
from .library import resolve_rules_path, shipped_rules
from .parser import parse_file, parse_text

__all__ = ["RuleSet", "format_rules", "load_rules", "parse_file", "parse_text", "resolve_rules_path",
           "rules_from_text", "shipped_rules"]
