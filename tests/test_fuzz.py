"""Fuzzing the front end: whatever the text, the only error that escapes is a RemapError.

Three sources of text: arbitrary strings (unicode, control characters, CR, tabs); realistic rule
files (inline samples, rules/, tests/corpus/) broken by random edits (characters and tokens
inserted, deleted, replaced, runs duplicated, lines swapped); and well-formed generated files
(tests/strategies.py), as they are and mutated. All go through parse_text and through
rules_from_text (parse + includes + static checks). Every RemapError must
render, every diagnostic with a span must point at a real line and column (1-based), and every
message stays under a size bound however long the input (lines of a million characters, names of
thousands): a window of a long line, shortened quotes, at most MAX_SHOWN diagnostics shown.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest
from depth import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remapdsl.errors import MAX_SHOWN, MAX_TEXT, MAX_WINDOW, RemapError
from remapdsl.language.formatter import format_rules
from remapdsl.language.includes import rules_from_text
from remapdsl.language.parser import parse_text

try:
    from tests import strategies as S
except ImportError:  # tests/ on sys.path (rootdir-relative import mode)
    import strategies as S

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

# An empty folder as the include root, so a fuzzed `include` never reads a real file.
_EMPTY_ROOT = Path(tempfile.mkdtemp(prefix="remap-fuzz-"))
atexit.register(shutil.rmtree, _EMPTY_ROOT, True)  # no empty folder left behind per test run

SAMPLES = [
    # the language brief's Qwen3-MoE example
    (Path(__file__).parent / "corpus" / "language_brief.remap").read_text(),
    # quantized checkpoint, guards, optional, otherwise, macros, includes
    """\
remap 1
include "common.remap"

let N = config.num_hidden_layers
let E0 = config.first_expert ?? 0
macro rope(heads) = reshape([heads, -1, 2, 128]) | transpose(1, 2) | reshape([-1, 128])

dequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight | fp8_block(block=[128, 128], to=bfloat16)
optional dequantize {P:path}_blocks, {P}_scales -> {P} | mxfp4(to=bfloat16)

drop model.layers.{L}.** when L >= N
model.layers.{L}.self_attn.q_proj.weight -> layers.{L - 1}.wq when L >= 1 and L < 46
    | rope(heads=config.num_attention_heads)  # Meta order to HF order
optional model.layers.{L}.self_attn.{q,k,v}_proj.bias -> layers.{L}.{wq,wk,wv}.bias
model.layers.{L}.mlp.experts.{E}.w -> moe.{L}.w | stack(E, dim=0, start=E0) | cast(float32)
model.layers.{L}.{input,post_attention}_layernorm.weight -> layers.{L}.{attn,mlp}_norm.weight
    | add(1)
    | scale(0.5)
fused.{L}.qkv -> layers.{L}.{q,k,v} | split(dim=0, sizes=[4096, 1024, 1024])
experts.{L}.w -> layers.{L}.experts.{E}.w | unstack(E, dim=0)
x.{m:seg}_proj.* -> y.{m} | pad(dim=0, to=128, value=-1.5e-3) | slice(dim=1, start=0, stop=64)
keep layers.{L}.rotary.inv_freq
otherwise {P:path} -> {P}
""",
    # odd but legal layout
    "\ufeff# BOM, CRLF and tabs\r\nremap 1\r\n\r\nlet\tA = [1, -2, 3.5e2]\r\na.b -> c.d\r\n\t|\tpermute([1, 0])\r\n",
]


def _corpus_samples() -> list[str]:
    """Rule files of the repository as extra seeds: rules/, the valid corpus, some error files."""
    corpus = ROOT / "tests" / "corpus"
    files = (sorted((ROOT / "rules").glob("*.remap")) + sorted((corpus / "ok").glob("**/*.remap"))
             + sorted((corpus / "errors").glob("**/*.remap"))[:40])
    out = []
    for path in files:
        try:
            data = path.read_bytes()
            if len(data) <= 20_000:  # keep each example fast
                out.append(data.decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return out


ALL_SAMPLES = SAMPLES + _corpus_samples()

TOKENS = [
    "{", "}", "|", "->", ",", "(", ")", "[", "]", "\n", "\r", "\r\n", "\t", " ", "#", '"', ".", "*",
    "**", ":", "=", "==", "??", "-", "+", "//", "%", "<", ">=", "!=", "{L}", "{P:path}", "{m:seg}",
    "{x:bogus}", "{a,b}", "{1}", "{L - 1}", "remap ", "remap 2", "let ", "drop ", "keep ",
    "dequantize ", "include ", 'include "../x.remap"', "macro ", "optional ", "otherwise ", "when ",
    " and ", " or ", "not ", "true", "false", "config.", "config.a", "stack(E, dim=0)", "cast(",
    "fp8_block(", "concat(dim=1)", "0", "-1", "1e999", "1.5", "99999999999999999999", "_", "é",
    "\u3042", "\ufeff", "\x00", "\x0b", "\x85", "\u2028", "\U0001f600", "\\",
]

_any_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=120)
_token_text = st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=3)), max_size=30).map("".join)
_piece = st.one_of(st.sampled_from(TOKENS), st.characters(blacklist_categories=("Cs",)))


@st.composite
def mutate(draw, text: str) -> str:
    """1..6 random edits: insert, delete or replace a run, duplicate a run, swap two lines."""
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(text)))
        stop = min(len(text), at + draw(st.integers(1, 8)))
        kind = draw(st.sampled_from(["insert", "delete", "replace", "duplicate", "swap_lines"]))
        if kind == "insert":
            text = text[:at] + draw(_piece) + text[at:]
        elif kind == "delete":
            text = text[:at] + text[stop:]
        elif kind == "replace":
            text = text[:at] + draw(_piece) + text[stop:]
        elif kind == "duplicate":
            text = text[:stop] + text[at:stop] + text[stop:]
        else:
            lines = text.split("\n")
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
    return text


mutated_samples = st.sampled_from(ALL_SAMPLES).flatmap(mutate)


# One rendered diagnostic: its first line (a path, the code, a message of at most MAX_TEXT), the
# source window (at most MAX_WINDOW characters, each at most 4 columns wide: a tab) and its carets,
# and a hint of at most MAX_TEXT. A whole error shows at most MAX_SHOWN of them and a count.
DIAGNOSTIC_BOUND = 2 * MAX_TEXT + 8 * MAX_WINDOW + 400
ERROR_BOUND = MAX_SHOWN * (DIAGNOSTIC_BOUND + 2) + 100


def check_error(exc: RemapError, text: str) -> None:
    """A RemapError renders within the size bound, and each located diagnostic points at a real
    place of the text."""
    rendered = str(exc)
    assert rendered
    assert len(rendered) <= ERROR_BOUND, (len(rendered), rendered[:2000])
    assert exc.diagnostics
    lines = text.removeprefix("\ufeff").replace("\r\n", "\n").split("\n")
    for diagnostic in exc.diagnostics:
        assert len(diagnostic.render()) <= DIAGNOSTIC_BOUND, diagnostic.render()[:2000]
        span = diagnostic.span
        if span is None:
            continue
        assert span.line >= 1 and span.column >= 1, (span, rendered)
        assert (span.end_line, span.end_column) >= (span.line, span.column), (span, rendered)
        if span.path == "<fuzz>":  # a span in the fuzzed text itself
            assert span.line <= len(lines), (span, rendered)
            assert span.column <= len(lines[span.line - 1]) + 1, (span, rendered)


def front_end(text: str) -> None:
    """Run the text through both entry points; only RemapError may escape (and is checked)."""
    try:
        parse_text(text, "<fuzz>")
    except RemapError as exc:
        check_error(exc, text)
    try:
        rules_from_text(text, "<fuzz>", root=_EMPTY_ROOT)
    except RemapError as exc:
        check_error(exc, text)


_FUZZ = settings(max_examples=1000, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@settings(_FUZZ, max_examples=scaled(500))
@given(st.one_of(_any_text, _token_text))
def test_arbitrary_text_raises_only_remap_errors(text):
    front_end(text)


@settings(_FUZZ, max_examples=scaled(400))
@given(mutated_samples)
def test_mutated_rule_files_raise_only_remap_errors(text):
    front_end(text)


@settings(_FUZZ, max_examples=scaled(50))
@given(S.rule_files(path="<fuzz>").map(format_rules).flatmap(mutate))
def test_mutated_generated_files_raise_only_remap_errors(text):
    front_end(text)


@settings(_FUZZ, max_examples=scaled(40))
@given(S.rule_files(path="<fuzz>"))
def test_generated_files_pass_or_fail_static_checks_cleanly(rules):
    """Well-formed IR with unbound names, odd op arguments...: the static checks report, never crash."""
    front_end(format_rules(rules))


@st.composite
def inflate(draw, text: str) -> str:
    """A run of the text repeated thousands of times: huge lines, names, patterns and lists."""
    at = draw(st.integers(0, len(text)))
    stop = min(len(text), at + draw(st.integers(1, 12)))
    times = draw(st.sampled_from([500, 5_000, 50_000]))
    return text[:at] + text[at:stop] * times + text[stop:]


@settings(_FUZZ, max_examples=scaled(20))
@given(st.sampled_from(ALL_SAMPLES).flatmap(inflate))
def test_inflated_rule_files_raise_bounded_remap_errors(text):
    front_end(text)


@pytest.mark.parametrize("text", [
    "let A = " + "x" * 1_000_000 + "\n",
    "a." * 500_000 + "w -> b.{L}\n",
    "".join(f"let A{i} = B{i} + " + "C" * 5_000 + "\n" for i in range(200)),
    "x -> y | pad(dim=0, to=" + "9" * 29 + ")\n" + "\t" * 10_000 + "| bogus(" + "1, " * 10_000 + ")\n",
], ids=["huge_name", "huge_pattern", "many_long_errors", "tabs_and_args"])
def test_huge_inputs_give_bounded_messages(text):
    front_end(text)


@pytest.mark.parametrize("text", SAMPLES, ids=["qwen3_moe", "quantized", "bom_crlf_tabs"])
def test_samples_parse(text):
    """The seeds are valid syntax, so mutations start from deep inside the grammar."""
    parse_text(text, "<fuzz>")


@pytest.mark.parametrize("path", ['a\x00b.remap', "a" * 300 + ".remap", "../x.remap", "/etc/passwd",
                                  ".", "", " ", "a/" * 2000 + "x"])
def test_odd_include_paths_are_remap_errors(path):
    with pytest.raises(RemapError) as info:
        rules_from_text(f'include "{path}"\n', "<fuzz>", root=_EMPTY_ROOT)
    check_error(info.value, f'include "{path}"\n')
