"""RuleSet + checkpoint inventory + model config -> Compiled (blocks for every runtime tensor).

Order: lets are evaluated; `drop` removes keys; each mapping rule binds against what is left
(fan-out allowed); `otherwise` binds what no rule consumed; anything still unconsumed is an error.
Each binding's ops run on symbolic tensors (remapdsl/compile/symbolic.py). Every problem is a
located BindError pointing at the statement, raised before any tensor byte is read.
"""

from __future__ import annotations

import re
from collections import defaultdict
from operator import attrgetter, itemgetter
from collections.abc import Callable, Mapping
from dataclasses import replace
from itertools import chain, compress
from typing import Any

from ..language import ir
from ..checkpoint import Inventory
from ..dtypes import DTYPES
from ..errors import BindError, Diagnostic, Span, suggest
from ..gcpause import paused_gc
from ..language.formatter import format_expr
from ..language.includes import RuleSet
from ..indexmap import volume
from . import symbolic as sym
from .apply import GapError, apply_op, expand_macros
from .bind import Binding, KeyPool, bind, compile_pattern, list_axis, scan
from .evaluate import Evaluator, evaluate_lets
from .quantized import bind_dequantize, bind_quantized, check_cuts, check_formats
from .model import BoundRule, Compiled, RuntimeTensor, LogicalTensor, CkptTensor, StoredQuantized


def compile_rules(rules: RuleSet, inventory: Inventory, config: Mapping[str, Any] | None = None,
                  *, strict: bool = True) -> Compiled:
    """Compile rules against a checkpoint's inventory and its model config.

    Args:
        rules: a checked RuleSet (`remapdsl.load_rules`).
        inventory: the checkpoint's tensors (`remapdsl.checkpoint.open_inventory`).
        config: the model config (config.json as a dict).
        strict: when True (the default), a checkpoint key that no rule consumes and no `drop`
            names is an error; when False it is left out of the load.
    """
    check_formats(rules)
    with paused_gc():
        return _Compiler(rules, inventory, dict(config or {}), strict).run()


class _Compiler:
    def __init__(self, rules: RuleSet, inventory: Inventory, config: dict, strict: bool):
        self.rules = rules
        self.inventory = inventory
        self.strict = strict
        self.lets = evaluate_lets(rules.statements, config, rules.line_text)
        self.evaluator = Evaluator(config, self.lets, rules.line_text)
        self.macros = {s.name: s for s in rules.statements if isinstance(s, ir.Macro)}
        # `cast DT`: the dtype every rule's floating outputs end in, unless the rule casts (`casting`)
        self.cast_all = next((self.evaluator.dtype(s.dtype) for s in rules.statements
                              if isinstance(s, ir.CastAll)), None)
        self.casting = False
        self.errors: list[Diagnostic] = []
        self.runtime_tensors: dict[str, RuntimeTensor] = {}
        self.bindings: list[BoundRule] = []
        self.logical: dict[str, LogicalTensor] = {}
        self.stored: dict[str, StoredQuantized] = {}

    def error(self, code: str, message: str, span: Span | None, hint: str | None = None) -> None:
        self.errors.append(Diagnostic(code=code, message=message, span=span, hint=hint,
                                      line_text=self.rules.line_text(span)))

    def run(self) -> Compiled:
        statements = self.rules.statements
        available = set(self.inventory.tensors)
        for s in statements:
            if isinstance(s, ir.Quantized):
                self.quantized(s, available)
            elif isinstance(s, ir.Dequantize):
                self.dequantize(s, available)
        dropped, unused = self.drops(statements, available)
        available -= dropped
        consumed: set[str] = set()
        rules = [s for s in statements if isinstance(s, ir.Rule)]
        shared = KeyPool(available, indexed=True)  # what every rule but `otherwise` binds against
        for rule in [r for r in rules if not r.otherwise] + [r for r in rules if r.otherwise]:
            pool = available - consumed if rule.otherwise else available
            consumed |= self.rule(rule, pool, KeyPool(pool) if rule.otherwise else shared)
        leftover = sorted(available - consumed)
        if leftover and self.strict:
            shown = ", ".join(f"`{k}`" for k in leftover[:8])
            more = f" and {len(leftover) - 8} more" if len(leftover) > 8 else ""
            self.error("E202", f"{len(leftover)} checkpoint tensor{'s' if len(leftover) > 1 else ''} "
                       f"taken by no rule: {shown}{more}", None,
                       "map them with a rule, name them in a `drop`, or compile with strict=False")
        if self.stored:
            self.check_cuts()
        if self.errors:
            raise BindError(self.errors)
        self.check_tiling()
        keep = tuple(_regex(p).pattern for s in statements if isinstance(s, ir.Keep)
                     for p in s.patterns)
        keys = sorted(self.inventory.tensors)
        infos = list(map(self.inventory.tensors.__getitem__, keys))
        fields = zip(keys, map(attrgetter("file"), infos), map(attrgetter("dtype"), infos),
                     map(tuple, map(_SHAPE, infos)))
        ckpt_tensors = tuple(map(CkptTensor._make, fields))
        return Compiled.model_construct(  # records the compiler made: see Compiled
            runtime_tensors=tuple(self.runtime_tensors[k] for k in sorted(self.runtime_tensors)),
            ckpt_tensors=ckpt_tensors, logical=tuple(map(self.logical.__getitem__, sorted(self.logical))),
            quantized=tuple(self.stored[k] for k in sorted(self.stored)), bindings=tuple(self.bindings),
            dropped=tuple(sorted(dropped)), unused_drops=unused, keep=keep)

    # -- statements --

    def dequantize(self, s: ir.Dequantize, available: set[str]) -> None:
        try:
            bind_dequantize(s, available, self.inventory.tensors, self.evaluator,
                            self.error, self.logical)
        except BindError as exc:
            self.errors.extend(exc.diagnostics)

    def quantized(self, s: ir.Quantized, available: set[str]) -> None:
        try:
            bind_quantized(s, available, self.inventory.tensors, self.evaluator, self.error, self.stored)
        except BindError as exc:
            self.errors.extend(exc.diagnostics)

    def check_cuts(self) -> None:
        """Stored quantized values: no cut inside a block; each runtime tensor learns its grid."""
        def shape_of(key: str) -> tuple[int, ...]:
            return tuple(self.inventory.tensors[key].shape)

        for name, d in list(self.runtime_tensors.items()):
            if not any(k in self.stored for k in d.ckpt_keys):
                continue
            grid = check_cuts(d, self.stored, shape_of, self.error)
            if grid:
                self.runtime_tensors[name] = replace(d, grid=grid)

    def drops(self, statements, available: set[str]) -> tuple[set[str], tuple[Span, ...]]:
        return drops(statements, available, self.evaluator)

    def rule(self, rule: ir.Rule, pool: set[str], keys: KeyPool) -> set[str]:
        """Bind one rule against `keys` (the pool's), build its runtime tensors; return the
        checkpoint keys it consumed.

        A guard that reads no capture, or an `and` term of it that reads none, is evaluated once:
        false switches the rule off (its patterns need not match). A guard over captures filters the bindings, complete or partial; where a
        pattern matched nothing, the rule is off when no binding the others found satisfies it."""
        guard, note = rule.guard, None
        if guard is not None and guard_off(guard, rule, self.evaluator):
            return set()
        if guard is not None and not captures_read(guard, rule):
            guard, note = None, f"its guard `{self.source_text(guard)}` holds for this config"
        bindings, partial, unmatched, ambiguous = bind(rule.sources, keys)
        if ambiguous:  # named in key order, whatever order the keys were scanned in
            clashing = sorted({key for pair in ambiguous for key in pair})
            self.error("E208", f"one binding takes several checkpoint keys: `{clashing[0]}` and `{clashing[1]}`"
                       + (f" (and {len(clashing) - 2} more)" if len(clashing) > 2 else ""),
                       rule.span, "a wildcard (`*`, `**`) in a rule's sources must not match two keys "
                       "for one target; capture the varying part instead")
            return _taken(bindings, partial) | set(clashing)
        if guard is not None and (partial or unmatched):
            candidates = bool(bindings or partial)
            partial = [p for p in partial if self.may_hold(guard, p.captures)]
            if unmatched:  # a pattern found no key, so no binding is complete: the partial ones decide
                holding = partial[0].captures if partial else None
                if holding is None and candidates:
                    return set()  # no binding the other patterns found satisfies the guard: off
                note = (f"its guard `{self.source_text(guard)}` holds for {_captures(holding)}" if holding
                        else f"no key matched to decide its guard `{self.source_text(guard)}`")
        if unmatched and not rule.optional:
            for index in unmatched:
                self.no_match(rule, rule.sources[index], pool, note)
            return _taken(bindings, partial)
        for p in partial[:5]:
            axis = list_axis(rule.sources)
            missing = [self.name_of(rule.sources[axis[i][0]], axis[i][1], p.captures) for i in p.missing]
            self.error("E204", f"incomplete binding{_captures(p.captures, ' ')}: found `{p.present[0]}` but "
                       f"not `{missing[0]}`" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                       rule.span, "every source of a rule must exist for each binding; mark the rule "
                       "`optional` only if the whole binding may be absent")
        if partial:
            return _taken(bindings, partial)
        if guard is not None:
            bindings = [b for b in bindings if self.evaluator.boolean(guard, b.captures)]
        consumed = set(chain.from_iterable(map(attrgetter("keys"), bindings)))
        try:
            self.build(rule, bindings)
        except _RuleFailed:
            pass
        return consumed

    def source_text(self, expr: ir.Node) -> str:
        """An expression as the file writes it (canonical form where it spans lines)."""
        span, line = expr.span, self.rules.line_text(expr.span)
        if span is None or line is None or span.end_line != span.line:
            return format_expr(expr)
        text, rest = line[span.column - 1:span.end_column - 1], line[span.end_column - 1:]
        while text.count("(") > text.count(")") and ")" in rest:  # a span ends inside `not (...)`
            cut = rest.index(")") + 1
            text, rest = text + rest[:cut], rest[cut:]
        return text

    def may_hold(self, guard: ir.Node, captures: dict) -> bool:
        """Whether a guard holds for a binding; True where a capture has no value (it may)."""
        if None in captures.values():
            return True
        return self.evaluator.boolean(guard, captures)

    def no_match(self, rule: ir.Rule, pattern: ir.Pattern, pool: set[str], note: str | None) -> None:
        literal = "".join(p.text for p in pattern.parts if isinstance(p, ir.Text))
        hint = None
        prefix = ""
        for part in pattern.parts:
            if not isinstance(part, ir.Text):
                break
            prefix += part.text
        segments = [seg for seg in literal.split(".") if seg]
        known = {seg for k in pool for seg in k.split(".")}
        for seg in segments:
            if seg not in known:
                close = suggest(seg, known)
                hint = f"did you mean `{close}`?" if close else f"no checkpoint key has a segment `{seg}`"
                break
        if hint is None and prefix:
            similar = sorted(k for k in pool if k.startswith(prefix))[:3]
            if similar:
                hint = "checkpoint keys that start like this: " + ", ".join(f"`{k}`" for k in similar)
        if note is not None:  # a guard was involved: say why the pattern still had to match
            note += ", so the rule is on; mark it `optional` if this key may be absent"
            sentence = note[0].upper() + note[1:]
            hint = sentence if not hint else f"{hint} {sentence}" if hint.endswith("?") else f"{hint}; {note}"
        self.error("E201", "pattern matches no checkpoint key", pattern.span or rule.span, hint)

    def name_of(self, pattern: ir.Pattern, choice: tuple[int, ...], captures: dict) -> str:
        """The key a source pattern names for given captures and alternative choices."""
        out, alt = [], 0
        for part in pattern.parts:
            if isinstance(part, ir.Text):
                out.append(part.text)
            elif isinstance(part, ir.Capture):
                value = captures.get(part.name)  # None: no key gave it a value
                out.append(f"{{{part.name}}}" if value is None else str(value))
            elif isinstance(part, ir.Alternatives):
                out.append(part.options[choice[alt]])
                alt += 1
            else:
                out.append("*")
        return "".join(out)

    # -- building runtime tensors --

    def build(self, rule: ir.Rule, bindings: list[Binding]) -> None:
        ops = expand_macros(rule.ops, self.macros, self.evaluator.config, self.lets, self.rules.line_text)
        self.casting = self.cast_all is not None and not any(isinstance(op, ir.Cast) for op, _ in ops)
        reduced = sorted({op.capture for op, _ in ops if isinstance(op, (ir.Stack, ir.Concat))
                          and op.capture is not None})
        groups: dict[tuple, dict[tuple, list]] = defaultdict(dict)
        names = sorted(bindings[0].captures) if bindings else []
        outer_names = [n for n in names if n not in reduced]
        inner_names = [n for n in names if n in reduced]
        outer_of, inner_of, source = _pairs(outer_names), _pairs(inner_names), self.sources()
        namers = None if any(isinstance(part, ir.Alternatives) for p in rule.targets for part in p.parts) \
            else [self.evaluator.namer(p) for p in rule.targets]  # one name a pattern: made once a rule
        if not ops and namers is not None:  # keys renamed, one binding a group: no op state to carry
            for captures, keys in bindings:
                self.produce(rule, [name(captures) for name in namers], list(map(source, keys)), captures, keys)
            return
        for captures, keys in bindings:
            groups[outer_of(captures)][inner_of(captures)] = (list(map(source, keys)), keys)
        for outer, items in groups.items():
            state = {inner: tensors for inner, (tensors, _) in items.items()}
            keys = tuple(chain.from_iterable(map(itemgetter(1), items.values())))
            for op, env in ops:
                state = self.apply(rule, op, env, state, keys)
            for produced, tensors in state.items():
                captures = dict(outer) | dict(produced)
                names = [name(captures) for name in namers] if namers is not None \
                    else self.targets(rule, captures)
                self.produce(rule, names, tensors, captures, keys)

    def produce(self, rule: ir.Rule, names: list[str], tensors: list, captures: dict, keys: tuple) -> None:
        """The runtime tensors one binding's ops leave, named, and the binding recorded."""
        if len(names) != len(tensors):
            self.error("E111", f"the ops leave {len(tensors)} tensors for {len(names)} targets", rule.span)
            raise _RuleFailed
        for name, tensor in zip(names, tensors):
            if self.casting and tensor.dtype in _FLOATING and tensor.dtype != self.cast_all:
                tensor = sym.value_step(tensor, ("cast", self.cast_all))
            self.runtime_tensor(rule, name, tensor)
        self.bindings.append(BoundRule(rule=rule.span, captures=tuple(sorted(captures.items())),
                                       ckpt_keys=keys, runtime_keys=tuple(names)))

    def sources(self) -> Callable[[str], sym.Sym]:
        """The function from a key (a logical tensor's or a checkpoint tensor's) to its symbolic tensor."""
        logical, stored, make = self.logical.get, self.inventory.tensors, sym.source
        kept = self.stored.keys() | self.inventory.chunks.keys()  # read by their dims: no flat view

        def source(ckpt_key: str) -> sym.Sym:
            info = logical(ckpt_key)
            if info is not None:
                return make(ckpt_key, tuple(info.shape), info.dtype)
            info = stored[ckpt_key]
            return make(ckpt_key, tuple(info.shape), info.dtype, ckpt_key not in kept)
        return source

    def apply(self, rule: ir.Rule, op: ir.Op, env: dict, state: dict, keys: tuple) -> dict:
        ev = Evaluator(self.evaluator.config, self.lets | env, self.rules.line_text)
        try:
            return apply_op(op, ev, state, self.target_count(rule))
        except sym.LimitError as exc:
            self.error("E209", f"`{op.op_name()}`: {exc}", op.span or rule.span,
                       "sizes and counts this large cannot be a model's tensors (limits: docs/errors.md)")
            raise _RuleFailed from None
        except sym.OpError as exc:
            self.error("E207", f"`{op.op_name()}`: {exc}", op.span or rule.span,
                       f"while binding {', '.join(f'`{k}`' for k in keys[:3])}"
                       + (" ..." if len(keys) > 3 else ""))
            raise _RuleFailed from None
        except GapError as exc:
            self.error("E205", str(exc), op.span or rule.span,
                       "a checkpoint that holds a slice says `start=`; never re-slotted silently")
            raise _RuleFailed from None

    def target_count(self, rule: ir.Rule) -> int:
        return sum(len(list_axis((p,))) for p in rule.targets)

    def targets(self, rule: ir.Rule, captures: dict) -> list[str]:
        """The keys of one binding's tensors where the targets hold alternatives: one a choice."""
        return [target_key(pattern, choice, captures, self.evaluator)
                for pattern in rule.targets for _, choice in list_axis((pattern,))]

    def runtime_tensor(self, rule: ir.Rule, name: str, tensor: sym.Sym) -> None:
        if name in self.runtime_tensors:
            first = self.runtime_tensors[name].rule
            self.error("E203", f"runtime tensor `{name}` is produced twice", rule.span,
                       f"first by the rule at {first}" if first else None)
            return
        blocks = tensor.blocks
        self.runtime_tensors[name] = RuntimeTensor(
            runtime_key=name, shape=tensor.shape, dtype=tensor.dtype, blocks=blocks,
            rule=rule.span, ckpt_keys=tuple(dict.fromkeys(filter(None, map(_SOURCE_KEY, tensor.blocks)))))

    def check_tiling(self) -> None:
        """Every runtime tensor is covered exactly once (an invariant of the construction)."""
        for d in self.runtime_tensors.values():
            total = volume(d.shape)
            covered = sum(map(volume, map(_SIZES, d.blocks)))
            if covered != total or not sym.tiles(d.blocks, d.shape):
                raise BindError(Diagnostic(
                    code="E206", message=f"blocks of `{d.runtime_key}` do not tile it exactly once "
                    f"({covered} of {total} elements)", span=d.rule,
                    line_text=self.rules.line_text(d.rule),
                    hint="this is a bug in remapdsl; please report it with the rule file"))


_SOURCE_KEY, _SIZES, _SHAPE = attrgetter("source_key"), attrgetter("sizes"), attrgetter("shape")
# what `cast DT` casts: floating dtypes of 16 bits and more, never stored 8-, 6- or 4-bit values
_FLOATING = frozenset(d.name for d in DTYPES if d.kind == "float" and d.bits >= 16)


def drops(statements, available: set[str], evaluator: Evaluator) -> tuple[set[str], tuple[Span, ...]]:
    """The keys of `available` the `drop` statements remove, and the spans of those that remove none."""
    dropped: set[str] = set()
    unused: list[Span] = []
    pool = KeyPool(available)
    for s in statements:
        if not isinstance(s, ir.Drop):
            continue
        hit = False
        for pattern in s.patterns:
            regex = compile_pattern(pattern)
            names = [name for name, _ in regex.captures]
            taken, captured, _ = scan(regex, pool)
            if s.guard is not None:  # the guard per capture values (in the order first met), not per key
                verdicts = {values: evaluator.boolean(s.guard, dict(zip(names, values)))
                            for values in dict.fromkeys(captured)}
                taken = list(compress(taken, map(verdicts.__getitem__, captured)))
            dropped.update(taken)
            hit = hit or bool(taken)
        if not hit and s.span is not None:
            unused.append(s.span)
    return dropped, tuple(unused)


def drop_test(rules: RuleSet, config: Mapping[str, Any]) -> Callable[[str], bool]:
    """Whether the rules' `drop` statements remove a key under `config`: for keys no inventory lists (the
    pairs of an ingest into a layout derived from the runtime tensors)."""
    evaluator = Evaluator(config, evaluate_lets(rules.statements, config, rules.line_text), rules.line_text)
    return lambda key: bool(drops(rules.statements, {key}, evaluator)[0])


def target_key(pattern: ir.Pattern, choice: tuple[int, ...], captures: dict, evaluator: Evaluator) -> str:
    """The key a target pattern names for one choice of its alternatives and a binding's captures."""
    out, alt = [], 0
    for part in pattern.parts:
        if isinstance(part, ir.Text):
            out.append(part.text)
        elif isinstance(part, ir.Alternatives):
            out.append(part.options[choice[alt]])
            alt += 1
        else:
            out.append(evaluator.key_part(part.expr, captures))
    return "".join(out)


def _pairs(names: list[str]) -> Callable[[dict], tuple]:
    """The function from captures to their ((name, value), ...) for `names`, in that order."""
    if not names:
        return lambda captures: ()
    if len(names) == 1:
        (only,) = names
        return lambda captures: ((only, captures[only]),)
    get = itemgetter(*names)
    return lambda captures: tuple(zip(names, get(captures)))


def captures_read(guard: ir.Node, rule: ir.Rule) -> bool:
    """Whether a guard reads a capture of the rule's sources."""
    bound = {part.name for p in rule.sources for part in p.parts if isinstance(part, ir.Capture)}
    return any(name.id in bound for name in names_in(guard))


def guard_off(guard: ir.Node, rule: ir.Rule, evaluator: Evaluator, alone: bool = True) -> bool:
    """Whether a guard is false for every binding: it reads no capture and is false for this config,
    or an `and` term of it is (a prefix's capture guard joined with a rule's config guard). A term
    that fails to evaluate alone decides nothing: the bindings evaluate it in the whole guard."""
    if not captures_read(guard, rule):
        try:
            return not evaluator.boolean(guard, {})
        except BindError:
            if alone:
                raise
            return False
    return isinstance(guard, ir.BoolOp) and guard.op == "and" and (
        guard_off(guard.left, rule, evaluator, False) or guard_off(guard.right, rule, evaluator, False))


def _taken(bindings, partial) -> set[str]:
    """The keys a failed rule matched: counted as taken, so its error is not repeated as E202."""
    return {k for b in bindings for k in b.keys} | {k for p in partial for k in p.present}


class _RuleFailed(Exception):
    """A rule's error was recorded; skip the rest of that rule."""


def names_in(expr: ir.Node):
    """Every name an expression reads, in order."""
    if isinstance(expr, ir.Name):
        yield expr
    for field in expr._compared:
        value = getattr(expr, field)
        for child in value if isinstance(value, tuple) else (value,):
            if isinstance(child, ir.Node):
                yield from names_in(child)


def _regex(pattern: ir.Pattern) -> re.Pattern:
    return compile_pattern(pattern).regex


def _captures(captures: dict, before: str = "") -> str:
    """`(L=0, E=3)`, after `before`; captures no key gave a value (None) are left out; "" if none has."""
    known = [f"{k}={v}" for k, v in captures.items() if v is not None]
    return f"{before}({', '.join(known)})" if known else ""
