"""Parse and check a 5,000-statement rule file; report the time and how it splits by stage.

Goal (issue #2): parse + static checks of 5,000 statements under 1 s on the 2-core dev machine.
The statements are those of the shipped rule files (rules/*.remap), repeated under distinct
prefixes: the mix of renames, fused and stacked experts, guards and drops that real files have.
Timed side by side in one process, median of 5 runs each: the baseline is a plain Lark parser
of the same grammar building a parse tree with Lark's own contextual lexer and positions (what a
straightforward Lark front end pays before it has built any IR); then remapdsl's parse to IR
(its one-pattern lexer, IR built during parsing) and parse plus the static checks.

    python bench/parse_bench.py [--statements 5000]
"""

from __future__ import annotations

import argparse
from pathlib import Path
import statistics
import time

from lark import Lark

from remapdsl.language import ir
from remapdsl.language.formatter import format_statement
from remapdsl.language.parser import grammar_text, lark_parser, parse_file, parse_text
from remapdsl.language.includes import rules_from_text

RULES = Path(__file__).resolve().parent.parent / "rules"


def make_rules(count: int) -> str:
    """A file of `count` statements with the statement mix of the shipped rule files.

    Their statements (lets, renames, fused and stacked experts, guards, drops) are repeated
    under distinct prefixes so that no two statements collide; version lines and includes are
    dropped (the included files are in the mix themselves), and so are `otherwise` catch-alls and
    `prefix` definitions with the statements that use them (repeated, a prefix passes its limit of
    definitions, E152).
    """
    statements, lets = [], {}
    for path in sorted(RULES.glob("*.remap")):
        for statement in parse_file(path).statements:
            if isinstance(statement, ir.Let):
                lets.setdefault(statement.name, "\n".join(format_statement(statement)))
            elif not isinstance(statement, (ir.Version, ir.Include)):
                text = "\n".join(format_statement(statement))
                if not text.startswith(("otherwise", "prefix")) and "@" not in text:
                    statements.append(text)  # a file has one catch-all: repeated, it is E107
    lines = ["# synthetic benchmark rules", "remap 1", *lets.values()]
    for i in range(count - 1 - len(lets)):
        text = statements[i % len(statements)]
        lines.append(text.replace("model.", f"m{i}.").replace("lm_head.", f"h{i}."))
    return "\n".join(lines) + "\n"


def median_seconds(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--statements", type=int, default=5000)
    args = parser.parse_args()
    text = make_rules(args.statements)
    lark_parser()  # built once, outside the timing, as in a long-lived process
    tree_parser = Lark(grammar_text(), parser="lalr", lexer="contextual", propagate_positions=True,
                       maybe_placeholders=True)
    lines = text.count("\n")

    baseline = median_seconds(lambda: tree_parser.parse(text))
    parse = median_seconds(lambda: parse_text(text, "bench.remap"))
    total = median_seconds(lambda: rules_from_text(text, "bench.remap"))
    print(f"{args.statements} statements, {lines} lines, {len(text) / 1e3:.0f} kB")
    print(f"  baseline: Lark parse tree {baseline * 1e3:8.1f} ms")
    print(f"  parse to IR               {parse * 1e3:8.1f} ms  ({parse / baseline:.2f}x the baseline)")
    print(f"  parse + static checks     {total * 1e3:8.1f} ms  ({total / baseline:.2f}x the baseline)")
    verdict = "meets" if total < 1.0 else "MISSES"
    print(f"  goal: under 1 s -> {verdict} ({total:.3f} s)")


if __name__ == "__main__":
    main()
