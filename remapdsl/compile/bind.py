"""Key patterns x checkpoint keys -> bindings: the captures of a statement for which every source of its
list axis exists; a partial binding (some sources present, others missing) is an error, never skipped."""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import chain, compress, product, repeat
from operator import itemgetter, methodcaller
from typing import NamedTuple

from ..language import ir

_INT = r"(?:0|[1-9][0-9]*)"
_SEG = r"[^.\n]+"  # keys are matched as lines of one text (see scan)
_PATH = r"[^.\n]+(?:\.[^.\n]+)*"
# _PATH where the line ends after it: the same lines, told by single-character repeats alone (no leading
# or trailing dot, no two dots together), which the engine runs ~1.7x faster (`{P:path}` over 46k keys)
_PATH_TO_END = r"(?!\.)(?![^\n]*\.\.)[^\n]*[^.\n]"
_MAX_TAILS = 64  # literal endings a pattern's trailing alternatives may expand to


class PatternRegex(NamedTuple):
    """A source pattern as a regex, with the names of its groups."""

    source: str  # the regex, as text
    captures: tuple[tuple[str, str], ...]  # (name, type) in group order
    alternatives: tuple[tuple[str, ...], ...]  # options of each alternatives part
    tails: tuple[str, ...]  # literal endings, one of which every matching key has; () if none

    @property
    def regex(self) -> re.Pattern:
        return re.compile(self.source)

    @property
    def line(self) -> re.Pattern:
        """The regex with one outer group, matching whole lines of a text; a path that ends the line
        (a last `**` or `{P:path}`) as _PATH_TO_END."""
        source = self.source
        for end in (_PATH, _PATH + ")"):
            if source.endswith(end):
                source = source[: -len(end)] + _PATH_TO_END + end[len(_PATH):]
                break
        return re.compile(f"^({source})$", re.MULTILINE)


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
    return PatternRegex("".join(out), tuple(captures), tuple(alternatives), _tails(pattern))


def _tails(pattern: ir.Pattern) -> tuple[str, ...]:
    """The literal text a matching key ends with: the pattern's trailing text and alternatives."""
    tails = ("",)
    for part in reversed(pattern.parts):
        if isinstance(part, ir.Text):
            tails = tuple(part.text + t for t in tails)
        elif isinstance(part, ir.Alternatives) and len(tails) * len(part.options) <= _MAX_TAILS:
            tails = tuple(o + t for o in part.options for t in tails)
        else:
            break
    return () if tails == ("",) else tails


class KeyPool:
    """Checkpoint keys as the lines of one text, which the patterns' regexes scan. A pattern ending
    in literal text reads only the lines that end in it; `indexed` (a pool many patterns read) finds
    those by the lines' last two segments. Matches keep the lines' order; the keys must not change."""

    def __init__(self, keys: Iterable[str], indexed: bool = False):
        lines = list(keys)
        self.text = "\n".join(lines)
        split = self.text.count("\n") != max(len(lines) - 1, 0)  # a key holding a newline
        self.lines = self.text.split("\n") if split else lines
        self.indexed = indexed
        self._groups: dict[str, list[int]] | None = None

    def ending(self, tails: tuple[str, ...]) -> Iterable[str]:
        """The lines that end in one of `tails`, in their order."""
        lines = self.lines
        if not self.indexed:
            return filter(methodcaller("endswith", tails), lines)
        if self._groups is None:  # line positions by the last two segments (the whole line if fewer)
            self._groups = {}
            for i, k in enumerate(lines):
                self._groups.setdefault(k[k.rfind(".", 0, k.rfind(".")) + 1:], []).append(i)
        hits: list[list[int]] = []
        for end, group in self._groups.items():
            if end.endswith(tails):  # every line of the group ends so
                hits.append(group)
            elif any(t.endswith("." + end) for t in tails):  # a longer tail: some lines may
                ends = map(methodcaller("endswith", tails), map(lines.__getitem__, group))
                hits.append(list(compress(group, ends)))
        return [lines[i] for i in (hits[0] if len(hits) == 1 else sorted(chain.from_iterable(hits)))]


def scan(compiled: PatternRegex, pool: KeyPool, scalar: bool = False) -> tuple[list, list, list | None]:
    """The keys the pattern matches whole, in the pool's order, with their capture values (the value
    alone with `scalar`: one capture) and their choice of each alternatives part (None without any)."""
    # one `findall` over the pool's text; one outer group for the whole key: (key, *groups) tuples
    line = compiled.line
    order = sorted(line.groupindex.items(), key=lambda kv: kv[1])
    captures = [(group - 1, kind == "int") for name, group in order if name[0] == "c"
                for kind in [compiled.captures[int(name[1:])][1]]]
    choices = [(group - 1, {o: k for k, o in enumerate(compiled.alternatives[int(name[1:])])})
               for name, group in order if name[0] == "a"]
    rows = line.findall("\n".join(pool.ending(compiled.tails)) if compiled.tails else pool.text)
    if not captures and not choices:
        return rows, [()] * len(rows), None
    if not rows:
        return [], [], [] if choices else None
    # column by column, in C: the keys, the captures (ints converted), the choices' positions
    columns = list(zip(*rows))
    values = [map(int, columns[i]) if is_int else columns[i] for i, is_int in captures]
    values = (list(values[0]) if scalar else list(zip(*values))) if values else [()] * len(rows)
    chosen = list(zip(*[map(index.__getitem__, columns[i]) for i, index in choices])) if choices else None
    return list(columns[0]), values, chosen


def list_axis(patterns: tuple[ir.Pattern, ...]) -> list[tuple[int, tuple[int, ...]]]:
    """The list axis of a statement: (pattern index, choice of each alternatives part) in order."""
    return [(index, choice) for index, pattern in enumerate(patterns) for choice in
            product(*(range(len(p.options)) for p in pattern.parts if isinstance(p, ir.Alternatives)))]


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


def bind(patterns: tuple[ir.Pattern, ...], keys: Iterable[str] | KeyPool) -> Bound:
    """Bindings of a statement's source patterns against checkpoint keys."""
    pool = keys if isinstance(keys, KeyPool) else KeyPool(keys)
    compiled = [compile_pattern(p) for p in patterns]
    axis = list_axis(patterns)
    names = list(dict.fromkeys(name for c in compiled for name, _ in c.captures))
    every = all(len(c.captures) == len(names) for c in compiled)  # no pattern lacks a capture
    scalar = every and len(names) == 1  # bindings keyed by the one capture's value, not a 1-tuple
    taken: list[tuple[dict, bool]] = []  # per pattern: capture values (and choice) -> key; has alternatives
    seen: dict[tuple, None] = {}  # capture values in the order first found, where some lack a capture
    everything: list[Iterable] = []  # per pattern, its capture values, where none lacks a capture
    unmatched, ambiguous = [], []
    for index, c in enumerate(compiled):
        matched, values, choices = scan(c, pool, scalar)
        if not matched:
            unmatched.append(index)
        own = tuple(n for n, _ in c.captures)
        same = own == tuple(names)
        found: dict = {}
        if same:  # filled in C, unless two keys share a binding and a source
            found.update(zip(values if choices is None else zip(values, choices), matched))
        if len(found) != len(matched):
            found.clear()
            for ckpt_key, captured, choice in zip(matched, values, choices or repeat(())):
                if same:
                    key = captured
                else:  # a pattern lacking some captures of the statement fills every binding that agrees
                    given = dict(zip(own, captured))
                    key = tuple(given.get(n, _ANY) for n in names)
                slot = key if choices is None else (key, choice)
                old = found.get(slot)
                if old is not None and old != ckpt_key:
                    ambiguous.append((old, ckpt_key))
                found[slot] = ckpt_key
        bare = found if choices is None else map(itemgetter(0), found)  # the capture values alone
        if every:
            everything.append(bare)
        else:
            seen.update(dict.fromkeys(bare))
        taken.append((found, choices is not None))
    if every:  # each position holds one type (ints, or text): values sort directly
        ordered = sorted(set().union(*everything))
        joined = zip(ordered, zip(*[_entries(*taken[p], choice, ordered) for p, choice in axis]))
    else:
        ordered = list(seen)
        joined = [(k, tuple(e)) for k, e in
                  _join(dict(zip(ordered, zip(*[_entries(*taken[p], choice, ordered) for p, choice in axis]))))]
    values, entries = rows if (rows := list(zip(*joined))) else ((), ())
    # the captures of each binding, made in C: {name: value}, or a dict of the names and values
    captures = list(map(dict.fromkeys, repeat(names), values) if scalar else
                    map(dict, map(zip, repeat(names), values)))
    bindings, partial = [], []
    for found, row in zip(captures, entries):
        if None not in row:
            bindings.append(Binding(found, row))
        else:
            partial.append(Partial(found, tuple(e for e in row if e is not None),
                                   tuple(i for i, e in enumerate(row) if e is None)))
    return Bound(bindings, partial, unmatched, ambiguous)


def _entries(found: dict, alternatives: bool, choice: tuple, values: list) -> Iterable[str | None]:
    """The key a pattern found for each of `values` at one list-axis entry (None where none)."""
    return map(found.get, zip(values, repeat(choice)) if alternatives else values)


_ANY = object()  # the value of a capture the pattern lacks


def _join(slots: dict[tuple, list]) -> list[tuple[tuple, list]]:
    """Merge slot rows where some patterns bind fewer captures (their `_ANY` values)."""
    full = {k: v for k, v in slots.items() if _ANY not in k}
    loose = {k: v for k, v in slots.items() if _ANY in k}
    if not full:  # no pattern binds every capture: not a sensible statement, keep as is
        return sorted(((tuple(None if v is _ANY else v for v in k), e) for k, e in loose.items()),
                      key=lambda kv: _order(kv[0]))
    out = []
    for k, entries in full.items():
        merged = list(entries)
        for lk, lentries in loose.items():
            if all(a is _ANY or a == b for a, b in zip(lk, k)):
                merged = [e if e is not None else m for e, m in zip(lentries, merged)]
        out.append((k, merged))
    return sorted(out, key=lambda kv: _order(kv[0]))


def _order(values: tuple) -> tuple:
    return tuple((0, v, "") if isinstance(v, int) else (1, 0, str(v)) for v in values)
