"""Key patterns x checkpoint keys -> bindings: which keys each statement takes, with which captures.

A pattern compiles to an anchored regular expression (captures typed: `{L}` a canonical decimal
integer, `{m:seg}` one segment, `{P:path}` dotted text; alternatives remember their position).
A binding is one assignment of a statement's captures for which every source of its list axis
exists; a partial binding (some sources present, others missing) is an error, never skipped.
"""

from __future__ import annotations

import re
from operator import itemgetter
from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

from ..language import ir

_INT = r"(?:0|[1-9][0-9]*)"
_SEG = r"[^.\n]+"  # keys are matched as lines of one text (see match_keys)
_PATH = r"[^.\n]+(?:\.[^.\n]+)*"


class PatternRegex(NamedTuple):
    """A source pattern as a regex, with the names of its groups."""

    regex: re.Pattern
    captures: tuple[tuple[str, str], ...]  # (name, type) in group order
    alternatives: tuple[tuple[str, ...], ...]  # options of each alternatives part


def compile_pattern(pattern: ir.Pattern) -> PatternRegex:
    out, captures, alternatives = [], [], []
    seen: dict[str, int] = {}
    for part in pattern.parts:
        if isinstance(part, ir.Text):
            out.append(re.escape(part.text))
        elif isinstance(part, ir.Capture):
            if part.name in seen:  # a second use in one pattern: must be equal
                out.append(f"(?P=c{seen[part.name]})")
                continue
            seen[part.name] = len(captures)
            body = {"int": _INT, "seg": _SEG, "path": _PATH}[part.type]
            out.append(f"(?P<c{len(captures)}>{body})")
            captures.append((part.name, part.type))
        elif isinstance(part, ir.Alternatives):
            options = sorted(part.options, key=len, reverse=True)  # longest first
            out.append(f"(?P<a{len(alternatives)}>{'|'.join(re.escape(o) for o in options)})")
            alternatives.append(part.options)
        elif isinstance(part, ir.Star):
            out.append(_SEG)
        else:
            out.append(_PATH)
    return PatternRegex(re.compile("".join(out)), tuple(captures), tuple(alternatives))


def match_keys(compiled: PatternRegex, keys: Iterable[str]) -> list[tuple]:
    """Every key the pattern matches whole, as (key, capture values, alternative choices).

    The keys are joined into one text, one key per line, and the pattern runs over it in a single
    `finditer`: the scan stays in the regex engine instead of a Python loop over 10^5 keys.
    """
    text = "\n".join(keys)
    # one outer group for the whole key; findall then yields (key, *groups) tuples from C
    line = re.compile(f"^({compiled.regex.pattern})$", re.MULTILINE)
    order = sorted(line.groupindex.items(), key=lambda kv: kv[1])
    captures = [(group - 1, kind == "int") for name, group in order if name[0] == "c"
                for kind in [compiled.captures[int(name[1:])][1]]]
    choices = [(group - 1, {o: k for k, o in enumerate(compiled.alternatives[int(name[1:])])})
               for name, group in order if name[0] == "a"]
    rows = line.findall(text)
    if not captures and not choices:
        return [(row if isinstance(row, str) else row[0], (), ()) for row in rows]
    if choices or not all(is_int for _, is_int in captures):
        found = []
        for g in rows:
            values = tuple(int(g[i]) if is_int else g[i] for i, is_int in captures)
            choice = tuple(index[g[i]] for i, index in choices)
            found.append((g[0], values, choice))
        return found
    # the common case, integer captures only: extract and convert in C
    get = itemgetter(*(i for i, _ in captures))
    if len(captures) == 1:
        return [(g[0], (int(get(g)),), ()) for g in rows]
    return [(g[0], tuple(map(int, get(g))), ()) for g in rows]


def list_axis(patterns: tuple[ir.Pattern, ...]) -> list[tuple[int, tuple[int, ...]]]:
    """The list axis of a statement: (pattern index, choice of each alternatives part) in order."""
    axis = []
    for index, pattern in enumerate(patterns):
        sizes = [len(p.options) for p in pattern.parts if isinstance(p, ir.Alternatives)]
        combos: list[tuple[int, ...]] = [()]
        for size in sizes:
            combos = [c + (k,) for c in combos for k in range(size)]
        axis.extend((index, combo) for combo in combos)
    return axis


class Binding(NamedTuple):
    captures: dict  # name -> value
    keys: tuple[str, ...]  # one checkpoint key per list-axis entry


class Partial(NamedTuple):
    """A binding with some list-axis entries present and others missing."""

    captures: dict
    present: tuple[str, ...]
    missing: tuple[int, ...]  # list-axis positions without a key


class Bound(NamedTuple):
    """What binding a statement's source patterns found."""

    bindings: list[Binding]
    partial: list[Partial]  # some list-axis sources present, others missing
    unmatched: list[int]  # indexes of patterns that match no key
    ambiguous: list[tuple[str, str]]  # two keys for one binding and one source (wildcards)


def bind(patterns: tuple[ir.Pattern, ...], keys: Iterable[str]) -> Bound:
    """Bindings of a statement's source patterns against checkpoint keys."""
    keys = list(keys)
    compiled = [compile_pattern(p) for p in patterns]
    axis = list_axis(patterns)
    position = {entry: i for i, entry in enumerate(axis)}
    names: list[str] = []
    for c in compiled:
        for name, _ in c.captures:
            if name not in names:
                names.append(name)
    slots: dict[tuple, list[str | None]] = defaultdict(lambda: [None] * len(axis))
    unmatched, ambiguous = [], []
    for index, c in enumerate(compiled):
        matches = match_keys(c, keys)
        if not matches:
            unmatched.append(index)
        own = tuple(n for n, _ in c.captures)
        same = own == tuple(names)
        for ckpt_key, captured, choice in matches:
            if same:
                key = captured
            else:  # a pattern lacking some captures of the statement fills every binding that agrees
                values = dict(zip(own, captured))
                key = tuple(values.get(n, _ANY) for n in names)
            row, at = slots[key], position[(index, choice)]
            if row[at] is not None and row[at] != ckpt_key:
                ambiguous.append((row[at], ckpt_key))
            row[at] = ckpt_key
    bindings, partial = [], []
    complete_keys = _join(slots, len(axis))
    new = tuple.__new__  # named tuples without their Python-level argument handling
    for values, entries in complete_keys:
        captures = dict(zip(names, values))
        if None not in entries:
            bindings.append(new(Binding, (captures, tuple(entries))))
        else:
            partial.append(Partial(captures, tuple(e for e in entries if e is not None),
                                   tuple(i for i, e in enumerate(entries) if e is None)))
    return Bound(bindings, partial, unmatched, ambiguous)


class _AnyValue:
    def __repr__(self) -> str:
        return "*"


_ANY = _AnyValue()


def _join(slots: dict[tuple, list], width: int) -> list[tuple[tuple, list]]:
    """Merge slot rows where some patterns bind fewer captures (their `_ANY` values)."""
    full = {k: v for k, v in slots.items() if _ANY not in k}
    loose = {k: v for k, v in slots.items() if _ANY in k}
    if not loose:  # each position holds one type (ints, or text): tuples sort directly
        return sorted(full.items(), key=itemgetter(0))
    if not full:  # no pattern binds every capture: not a sensible statement, keep as is
        return sorted(((tuple(None if v is _ANY else v for v in k), e) for k, e in loose.items()),
                      key=lambda kv: _order(kv[0]))
    out = []
    for k, entries in full.items():
        merged = list(entries)
        for lk, lentries in loose.items():
            if all(a is _ANY or a == b for a, b in zip(lk, k)):
                for i, e in enumerate(lentries):
                    if e is not None:
                        merged[i] = e
        out.append((k, merged))
    return sorted(out, key=lambda kv: _order(kv[0]))


def _order(values: tuple) -> tuple:
    return tuple((0, v, "") if isinstance(v, int) else (1, 0, str(v)) for v in values)
