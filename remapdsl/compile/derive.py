"""Runtime shapes + rules + config -> the checkpoint tensors they determine (a save without `like`): each
rule run backwards on shapes alone; what shapes do not determine is E520, and the result must compile
forward back to every runtime tensor."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from ..checkpoint import Inventory
from ..errors import BindError, Diagnostic, RemapError, Span
from ..language import ir
from ..language.includes import RuleSet
from .apply import by_capture, expand_macros
from .bind import KeyPool, bind, compile_pattern, list_axis
from .compiler import captures_read, compile_rules, drops, guard_off, names_in, target_key
from .evaluate import Evaluator, evaluate_lets

_log = logging.getLogger("remapdsl")

Shape = tuple[int, ...]
Entry = tuple[Shape, str]  # (shape, dtype name)


class _Undetermined(Exception):
    """A size or key the rule does not determine; `span` is the op's or the rule's."""

    def __init__(self, message: str, span: Span | None = None):
        super().__init__(message)
        self.span = span


def derive_checkpoint(rules: RuleSet, runtime: Mapping[str, Entry], config: Mapping[str, Any] | None = None
                      ) -> dict[str, tuple[str, Shape]]:
    """The checkpoint tensors (key -> (dtype, shape)) whose load gives exactly `runtime` (key ->
    (shape, dtype)); E520 names the rule and the size when the rules do not determine them."""
    config = dict(config or {})
    derived = _Deriver(rules, config).run(runtime)
    _check_forward(rules, config, runtime, derived)
    return derived


def _error(rules: RuleSet, message: str, span: Span | None, hint: str | None = None) -> RemapError:
    return RemapError(Diagnostic(code="E520", message=message, span=span, line_text=rules.line_text(span),
                                 hint=hint or "give the rule the size it lacks (docs/saving.md#without-like), "
                                 "or save with `like`"))


class _Deriver:
    def __init__(self, rules: RuleSet, config: dict):
        self.rules = rules
        self.lets = evaluate_lets(rules.statements, config, rules.line_text)
        self.evaluator = Evaluator(config, self.lets, rules.line_text)
        self.macros = {s.name: s for s in rules.statements if isinstance(s, ir.Macro)}
        self.namers: dict[int, list] = {}  # id(rule) -> its source_namers

    def run(self, runtime: Mapping[str, Entry]) -> dict[str, tuple[str, Shape]]:
        statements = self.rules.statements
        cast_all = next((s for s in statements if isinstance(s, ir.CastAll)), None)
        if cast_all is not None:
            raise _error(self.rules, "`cast` sets the runtime dtype, so the dtype each checkpoint tensor "
                         "was stored in is not determined by the runtime tensors", cast_all.span,
                         "save with `like`")
        keep = [compile_pattern(p).regex for s in statements if isinstance(s, ir.Keep) for p in s.patterns]
        keys = [k for k in runtime if not any(r.fullmatch(k) for r in keep)]
        pool = KeyPool(keys, indexed=True)
        made: dict[str, list[tuple[bool, ir.Rule, dict]]] = defaultdict(list)  # runtime key -> candidates
        failures: dict[str, _Undetermined] = {}
        groups = [(rule, group) for rule in statements if isinstance(rule, ir.Rule)
                  for group in self.rule(rule, pool, runtime, failures)]
        # a group whose sources a `drop` removes is not what made its runtime tensors: the forward
        # compile never binds a dropped key (a tied output head is the embedding's, not its own)
        named = set().union(*(sources for _, (sources, _) in groups))
        dropped = drops(statements, named, self.evaluator)[0]
        for rule, (sources, runtime_keys) in groups:
            if dropped.isdisjoint(sources):
                for key in runtime_keys:
                    made[key].append((rule.otherwise, rule, sources))
        out: dict[str, tuple[str, Shape]] = {}
        for key in keys:
            candidates = made.get(key, [])
            if not candidates:
                if key in failures:
                    raise _error(self.rules, f"runtime tensor `{key}`: {failures[key]}",
                                 failures[key].span)
                raise RemapError(Diagnostic(code="E520", message=f"model tensor `{key}` is made by no rule (and "
                                            "no `keep` names it), so no checkpoint tensor follows from it",
                                            path=self.rules.path, hint="map it with a rule whose target names "
                                            "it, or name it in a `keep`"))
            first = [c for c in candidates if not c[0]] or candidates
            if any(c[2] != first[0][2] for c in first[1:]):
                raise _error(self.rules, f"runtime tensor `{key}` could come from the rule at {first[0][1].span} "
                             f"or the one at {first[1][1].span}", first[1][1].span,
                             "guard one of the rules so that one checkpoint layout follows")
            for ckpt_key, entry in first[0][2].items():
                old = out.get(ckpt_key)
                new = (entry[1], entry[0])
                if old is not None and old != new:
                    raise _error(self.rules, f"checkpoint tensor `{ckpt_key}` would be {list(old[1])} {old[0]} "
                                 f"for one runtime tensor and {list(new[1])} {new[0]} for `{key}`",
                                 first[0][1].span, "the runtime tensors that share it must agree")
                out[ckpt_key] = new
        self.note_dequantized(out)
        return out

    def rule(self, rule: ir.Rule, pool: KeyPool, runtime: Mapping[str, Entry], failures: dict) -> list:
        """The groups this rule derives: (checkpoint key -> entry, the runtime keys it makes)."""
        guard = rule.guard
        if guard is not None and guard_off(guard, rule, self.evaluator):
            return []
        ops = expand_macros(rule.ops, self.macros, self.evaluator.config, self.lets, self.rules.line_text)
        unstacked = [op.capture for op, _ in ops if isinstance(op, ir.Unstack)]
        types = {part.name: part.type for p in rule.sources for part in p.parts if isinstance(part, ir.Capture)}
        types |= dict.fromkeys(unstacked, "int")  # an index the op makes: the target's, read back
        try:
            targets, solvers = self.readable_targets(rule, types)
        except _Undetermined as exc:
            raise _error(self.rules, str(exc), exc.span) from None
        bound = bind(targets, pool)
        if not ops and not bound.partial:  # renamed alone: each binding's sources are its targets' shapes
            out = []
            for binding in bound.bindings:
                try:
                    self.source_namers(rule)  # a wildcard source is reported whatever the guard says
                    captures = self.solve(binding.captures, solvers, types, rule)
                    if captures is not None:
                        out.append((self.name_sources(rule, captures, [runtime[k] for k in binding.keys]),
                                    binding.keys))
                except _Undetermined as exc:
                    raise _error(self.rules, f"runtime tensor `{binding.keys[0]}`: {exc}", exc.span) from None
            return out
        groups: dict[tuple, dict[tuple, list[Entry]]] = defaultdict(dict)
        made: dict[tuple, list[str]] = defaultdict(list)
        for binding in bound.bindings:
            captures = self.solve(binding.captures, solvers, types, rule)
            if captures is None:
                continue
            outer = tuple(sorted((k, v) for k, v in captures.items() if k not in unstacked))
            inner = tuple(sorted((k, v) for k, v in captures.items() if k in unstacked))
            groups[outer][inner] = [runtime[k] for k in binding.keys]
            made[outer].extend(binding.keys)
        for p in bound.partial:
            captures = self.solve(p.captures, solvers, types, rule)
            if captures is not None:
                index, choice = list_axis(rule.targets)[p.missing[0]]
                missing = target_key(rule.targets[index], choice, captures, self.evaluator)
                raise _error(self.rules, f"the model has `{p.present[0]}` but not `{missing}`, which this rule "
                             "makes with it", rule.span, "a save writes every tensor a rule's targets name")
        steps = [(op, Evaluator(self.evaluator.config, self.lets | env, self.rules.line_text))
                 for op, env in ops]
        widths = [len(list_axis(rule.sources))]
        for op, ev in steps:
            widths.append(_width_after(op, widths[-1], len(list_axis(rule.targets)), ev))
        out = []
        for outer, state in groups.items():
            try:
                sources = self.undo(rule, steps, widths, dict(outer), state)
            except _Undetermined as exc:
                for key in made[outer]:
                    failures.setdefault(key, exc)
                continue
            except BindError as exc:  # an op argument that does not evaluate: the compile's own error
                raise RemapError(exc.diagnostics[0]) from None
            if sources is not None:
                out.append((sources, made[outer]))
        return out

    def readable_targets(self, rule: ir.Rule, types: dict[str, str]) -> tuple[tuple[ir.Pattern, ...], dict]:
        """The rule's targets as patterns that match runtime keys: `{L}` a capture of L's type, a
        constant `{N}` its text, `{L - N}` a capture solved for L afterwards."""
        solvers: dict[str, tuple[str, ir.Node]] = {}
        patterns = []
        for pattern in rule.targets:
            parts: list[ir.Node] = []
            try:
                for part in pattern.parts:
                    if isinstance(part, ir.Subst):
                        part = self.readable(part, types, solvers, rule)
                    if isinstance(part, ir.Text) and parts and isinstance(parts[-1], ir.Text):
                        part = ir.Text(text=parts.pop().text + part.text)  # a constant next to text: one part
                    parts.append(part)
                patterns.append(ir.Pattern(parts=tuple(parts)))
            except ValidationError as exc:
                raise _Undetermined(f"the target at {pattern.span} does not read back as a key pattern: "
                                    f"{exc.errors()[0]['msg']}", pattern.span or rule.span) from None
        return tuple(patterns), solvers

    def readable(self, part: ir.Subst, types: dict[str, str], solvers: dict, rule: ir.Rule) -> ir.Node:
        """One substitution of a target as the part that matches what it wrote: the capture it names,
        its constant text, or a capture solved for afterwards (`solvers`)."""
        names = sorted({n.id for n in names_in(part.expr) if n.id in types})
        if isinstance(part.expr, ir.Name) and names:
            return ir.Capture(name=part.expr.id, type=types[part.expr.id])
        if not names:
            return ir.Text(text=self.evaluator.key_part(part.expr, {}))
        if len(names) == 1 and types[names[0]] == "int":
            slot = f"_solve{len(solvers)}"
            solvers[slot] = (names[0], part.expr)
            return ir.Capture(name=slot, type="int")
        raise _Undetermined(f"the target's `{{...}}` at {part.span} reads {', '.join(names)}: "
                            "its value does not give back the captures", part.span or rule.span)

    def solve(self, found: dict, solvers: dict, types: dict, rule: ir.Rule) -> dict | None:
        """The source captures behind a target match: solved substitutions checked by evaluating
        them again; None where they have no integer solution (the key is not this rule's)."""
        captures = {k: v for k, v in found.items() if k not in solvers} if solvers else found
        for slot, (name, expr) in solvers.items():
            value = found[slot]
            f0 = self.evaluator.integer(expr, "index", captures | {name: 0})
            slope = self.evaluator.integer(expr, "index", captures | {name: 1}) - f0
            if slope == 0 or (value - f0) % slope:
                return None
            x = (value - f0) // slope
            if x < 0 or captures.get(name, x) != x or self.evaluator.integer(expr, "index", captures | {name: x}) != value:
                return None
            captures[name] = x
        guard = rule.guard
        if guard is not None and captures_read(guard, rule) and {n.id for n in names_in(guard)} \
                .isdisjoint(set(types) - set(captures)) and not self.evaluator.boolean(guard, captures):
            return None  # a guard over a capture still reduced (`stack(E)`) is read once E is known
        return captures

    def undo(self, rule: ir.Rule, steps: list, widths: list[int], outer: dict, state: dict
             ) -> dict[str, Entry] | None:
        """One group's state undone op by op (the last first), then its sources named; None where
        the rule's guard does not hold for them. `widths`: the list axis's length before each op."""
        for (op, ev), width in reversed(list(zip(steps, widths))):
            state = _undo_op(op, ev, state, width, rule)
        out: dict[str, Entry] = {}
        guarded = rule.guard is not None and captures_read(rule.guard, rule)
        for inner, entries in state.items():
            captures = outer | dict(inner) if inner else outer
            if guarded and not self.evaluator.boolean(rule.guard, captures):
                return None
            out.update(self.name_sources(rule, captures, entries))
        return out

    def name_sources(self, rule: ir.Rule, captures: dict, entries: list[Entry]) -> dict[str, Entry]:
        """Each list-axis entry under the checkpoint key the rule's sources give it."""
        out = {}
        for (template, names, pattern), entry in zip(self.source_namers(rule), entries):
            try:
                out[template % tuple([captures[n] for n in names])] = entry
            except KeyError as missing:
                raise _Undetermined(f"the source pattern's `{{{missing.args[0]}}}` appears in no target, so "
                                    "the checkpoint key is not determined", pattern.span or rule.span
                                    ) from None
        return out

    def source_namers(self, rule: ir.Rule) -> list[tuple[str, tuple[str, ...], ir.Pattern]]:
        """Per list-axis entry of the sources: a `%` template of the key and the captures it takes."""
        if id(rule) in self.namers:
            return self.namers[id(rule)]
        namers = []
        for index, choice in list_axis(rule.sources):
            pattern, text, names, alt = rule.sources[index], [], [], 0
            for part in pattern.parts:
                if isinstance(part, ir.Text):
                    text.append(part.text.replace("%", "%%"))
                elif isinstance(part, ir.Alternatives):
                    text.append(part.options[choice[alt]].replace("%", "%%"))
                    alt += 1
                elif isinstance(part, ir.Capture):
                    text.append("%s")
                    names.append(part.name)
                else:
                    raise _Undetermined("the source pattern's wildcard appears in no target, so the checkpoint "
                                        "key is not determined", pattern.span or rule.span)
            namers.append(("".join(text), tuple(names), pattern))
        self.namers[id(rule)] = namers
        return namers

    def note_dequantized(self, out: dict) -> None:
        """Log the tensors a `dequantize` would decode, derived plain: which tensors a release stores
        quantized, and in what blocks, does not follow from the runtime tensors."""
        for s in self.rules.statements:
            if isinstance(s, ir.Dequantize):
                regex = compile_pattern(s.target).regex
                plain = sum(1 for k in out if regex.fullmatch(k))
                if plain:
                    _log.info("%s: %d tensor(s) the `dequantize` statement at %s would decode are derived "
                              "unquantized (no stored scales); save with `like` for the stored format",
                              self.rules.path, plain, s.span)

def _undo_op(op: ir.Op, ev: Evaluator, state: dict, width: int, rule: ir.Rule) -> dict:
    """The state before `op` from the state after it (shapes only); `width` is the list axis's
    length before the op."""
    span = op.span or rule.span
    if isinstance(op, ir.Unstack):
        start = ev.integer(op.start, "start") if op.start is not None else 0
        out = {}
        for rest, by_value in by_capture(state, op.capture).items():
            values = sorted(by_value)
            if values != list(range(start, start + len(values))):
                raise _Undetermined(f"`unstack({op.capture}, ...)` needs {op.capture} from {start} without a "
                                    f"gap in the model's keys; found {values[:8]}", span)
            dim = _dim(ev.integer(op.dim, "dim"), len(by_value[start][0][0]) + 1)
            out[rest] = [(shape[:dim] + (len(values),) + shape[dim:], dtype)
                         for shape, dtype in by_value[start]]
        return out
    if isinstance(op, (ir.Stack, ir.Concat)) and op.capture is not None:
        start = ev.integer(op.start, "start") if op.start is not None else 0
        out = {}
        for key, entries in state.items():
            pieces = [_cut(op, ev, shape, dtype, None, span) for shape, dtype in entries]
            for i in range(len(pieces[0])):
                out[tuple(sorted(key + ((op.capture, start + i),)))] = [p[i] for p in pieces]
        return out
    return {key: _undo_list(op, ev, entries, width, span) for key, entries in state.items()}


def _undo_list(op: ir.Op, ev: Evaluator, entries: list[Entry], width: int, span) -> list[Entry]:
    if isinstance(op, (ir.Stack, ir.Concat, ir.Interleave)):
        (shape, dtype), = entries
        return _cut(op, ev, shape, dtype, width, span)
    if isinstance(op, (ir.Split, ir.Chunk, ir.Deinterleave)):
        dim = _dim(ev.integer(op.dim, "dim"), len(entries[0][0]))
        return [(_replace(entries[0][0], dim, sum(s[dim] for s, _ in entries)), entries[0][1])]
    if isinstance(op, ir.Transpose):
        a, b = ev.integer(op.a, "a"), ev.integer(op.b, "b")
        out = []
        for shape, dtype in entries:
            s = list(shape)
            i, j = _dim(a, len(s)), _dim(b, len(s))
            s[i], s[j] = s[j], s[i]
            out.append((tuple(s), dtype))
        return out
    if isinstance(op, ir.Permute):
        dims = ev.integers(op.dims, "dims")
        out = []
        for shape, dtype in entries:
            s = [0] * len(shape)
            for i, d in enumerate(dims):
                s[_dim(d, len(shape))] = shape[i]
            out.append((tuple(s), dtype))
        return out
    if isinstance(op, ir.Repeat):
        dim, times = ev.integer(op.dim, "dim"), ev.integer(op.times, "times")
        return [(_replace(shape, _dim(dim, len(shape)), shape[_dim(dim, len(shape))] // max(times, 1)), dtype)
                for shape, dtype in entries]
    if isinstance(op, (ir.RopePermute, ir.RopeUnpermute, ir.Scale, ir.Add)):
        return entries
    if isinstance(op, ir.Pad) and op.size is not None:  # `size=` states what it padded from
        dim, to, size = ev.integer(op.dim, "dim"), ev.integer(op.to, "to"), ev.integer(op.size, "size")
        out = []
        for shape, dtype in entries:
            d = _dim(dim, len(shape))
            if shape[d] != to:
                raise _Undetermined(f"`pad` pads dim {dim} to {to}, but the model's has {shape[d]}", span)
            out.append((_replace(shape, d, size), dtype))
        return out
    name = op.op_name()
    why = {"reshape": "a reshape's input shape is not given by its output",
           "slice": "a slice leaves out rows whose number it does not state",
           "pad": "a pad's input size is not given by the padded size: add `size=`",
           "cast": "the dtype before a cast is not given by the dtype after it"}.get(name, "it cannot be undone")
    raise _Undetermined(f"`{name}`: {why}", span)


def _cut(op, ev: Evaluator, shape: Shape, dtype: str, width: int | None, span) -> list[Entry]:
    """The parts a stack, concat or interleave made `shape` of: a stack's from its stacked dim, a
    concat's or an interleave's from its `sizes=` (or the one part)."""
    dim = _dim(ev.integer(op.dim, "dim"), len(shape))
    if isinstance(op, ir.Stack):
        n = shape[dim]
        if width is not None and n != width:
            raise _Undetermined(f"`stack` stacks {width} sources, but the model's dim {dim} has {n}", span)
        return [(shape[:dim] + shape[dim + 1:], dtype)] * n
    if op.sizes is None:
        if width == 1:
            return [(shape, dtype)]
        parts = f"{width} sources" if width is not None else f"the {op.capture} sources"
        raise _Undetermined(f"`{op.op_name()}` joins {parts} into dim {dim} of size {shape[dim]}, and how it "
                            "divides among them is not given: add `sizes=[...]`", span)
    sizes = ev.integers(op.sizes, "sizes")
    if sum(sizes) != shape[dim] or (width is not None and len(sizes) != width):
        raise _Undetermined(f"`{op.op_name()}`'s sizes {list(sizes)} do not fit the model's dim {dim} of size "
                            f"{shape[dim]}" + (f" in {width} parts" if width is not None else ""), span)
    return [(_replace(shape, dim, size), dtype) for size in sizes]


def _width_after(op: ir.Op, width: int, targets: int, ev: Evaluator) -> int:
    """The list axis's length after `op` (the forward direction's, from the op alone)."""
    if isinstance(op, ir.Interleave) or isinstance(op, (ir.Stack, ir.Concat)) and op.capture is None:
        return 1
    if isinstance(op, ir.Split):
        return len(ev.integers(op.sizes, "sizes"))
    if isinstance(op, ir.Chunk):
        return ev.integer(op.n, "n")
    if isinstance(op, ir.Deinterleave):
        return targets
    return width


def _check_forward(rules: RuleSet, config: dict, runtime: Mapping[str, Entry], derived: dict) -> None:
    """The derived checkpoint, compiled forward, gives every runtime tensor it derives from."""
    try:
        compiled = compile_rules(rules, Inventory.from_shapes(derived), config, strict=True)
    except BindError as exc:
        d = exc.diagnostics[0]
        raise _error(rules, f"the checkpoint layout derived from the model's tensors does not load back: "
                     f"{d.message}", d.span, "save with `like`") from None
    for t in compiled.runtime_tensors:
        entry = runtime.get(t.runtime_key)
        if entry is None or (tuple(entry[0]), entry[1]) != (t.shape, t.dtype):
            held = "has no such tensor" if entry is None else f"holds {list(entry[0])} {entry[1]}"
            raise _error(rules, f"the checkpoint layout derived from the model's tensors loads "
                         f"`{t.runtime_key}` as {list(t.shape)} {t.dtype}, but the model {held}", t.rule,
                         "save with `like`")


def _dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _replace(shape: Shape, dim: int, n: int) -> Shape:
    return shape[:dim] + (n,) + shape[dim + 1:]
