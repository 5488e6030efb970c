"""Parse and check a 5,000-statement rule file; report the time and how it splits by stage.

Goal (issue #2): parse + static checks of 5,000 statements under 1 s on the 2-core dev machine.
The stages are timed side by side in one process: Lark's LALR pass alone (the floor any
Lark-based front end pays), building the IR, and the static checks. Median of 5 runs.

    python bench/parse_bench.py [--statements 5000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from remapdsl.parse import lark_parser, parse_text
from remapdsl.rules import rules_from_text

STATEMENTS = (
    "model.layers.{L}.self_attn.{q,k,v}_proj.weight -> layers.{L}.attn.wqkv.weight"
    " | interleave(dim=0, groups=KV)",
    "model.layers.{L}.mlp.experts.{E}.{gate,up}_proj.weight -> layers.{L}.moe.w13\n"
    "    | stack(E, dim=0)\n    | concat(dim=1)",
    "model.layers.{L}.input_layernorm.weight -> layers.{L}.attn_norm.weight when L < config.num_hidden_layers",
    "model.layers.{L}.self_attn.o_proj.weight -> layers.{L}.attn.wo.weight | cast(bfloat16)  # comment",
    "drop model.layers.{L}.** when L >= config.num_hidden_layers + 1",
    "model.layers.{L}.mlp.down_proj.weight -> layers.{L}.mlp.w2.weight | transpose(0, 1) | scale(0.5)",
)


def make_rules(count: int) -> str:
    """A realistic file: lets first, then rules over distinct prefixes so nothing collides."""
    lines = ["# synthetic benchmark rules", "remap 1", "let KV = config.num_key_value_heads ?? 8"]
    for i in range(count - 2):
        template = STATEMENTS[i % len(STATEMENTS)]
        lines.append(template.replace("model.", f"m{i}.").replace("layers.", f"l{i}."))
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
    lark = lark_parser()  # built once, outside the timing, as in a long-lived process
    lines = text.count("\n")

    lalr = median_seconds(lambda: lark.parse(text))
    parse = median_seconds(lambda: parse_text(text, "bench.remap"))
    total = median_seconds(lambda: rules_from_text(text, "bench.remap"))
    print(f"{args.statements} statements, {lines} lines, {len(text) / 1e3:.0f} kB")
    print(f"  Lark LALR alone           {lalr * 1e3:8.1f} ms")
    print(f"  parse to IR               {parse * 1e3:8.1f} ms  ({parse / lalr:.2f}x the LALR pass)")
    print(f"  parse + static checks     {total * 1e3:8.1f} ms  ({total / lalr:.2f}x the LALR pass)")
    verdict = "meets" if total < 1.0 else "MISSES"
    print(f"  goal: under 1 s -> {verdict} ({total:.3f} s)")


if __name__ == "__main__":
    main()
