"""The error corpus: every malformed rule file in tests/corpus/errors/ against its exact message.

Each `NN_name.remap` is one realistic mistake; `NN_name.err` holds what `str(RemapError)` renders
when the file is loaded by its path relative to the repository root, plus one final newline. The
first comment line of each case states the codes it must raise (`# expect: E002`, or
`# expect: E101, E102` for several, in order of first appearance), so a reader sees the intent at
the top of the file. A follow-on error that should not be there is listed apart, as a known defect:
`# expect: E134; cascade: E111`; once the cascade is fixed the test fails until the line and the
.err file are updated. The files under tests/corpus/ok/ (and a 5,000-line file generated at run
time by tests/corpus/make_big.py) must load clean.

Absolute paths in messages are written as `<repo>` so the .err files do not depend on the checkout.

To regenerate the .err files after a deliberate change of wording:

    REMAPDSL_REGEN=1 PYTHONPATH=. python -m pytest tests/test_error_corpus.py

then read every changed message in `git diff tests/corpus/errors` before committing: these
messages are what a model author sees.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from remapdsl import load_rules
from remapdsl.errors import RemapError

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "corpus"
ERRORS = CORPUS / "errors"
OK = CORPUS / "ok"
REGEN = os.environ.get("REMAPDSL_REGEN") == "1"
_CODES = r"E\d{3}(?:\s*,\s*E\d{3})*"
EXPECT = re.compile(rf"#\s*expect:\s*({_CODES})(?:\s*;\s*cascade:\s*({_CODES}))?\s*$")

CASES = sorted(ERRORS.glob("*.remap"))


def _relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _expected_codes(case: Path) -> list[str]:
    """The codes named on the first line that holds a comment (the BOM case has it after code)."""
    text = case.read_bytes().decode("utf-8", errors="replace").lstrip("\ufeff")
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if "#" in line:
            match = EXPECT.search(line)
            assert match, f"{case.name}: the first comment line must be `# expect: E...`, not {line!r}"
            return [code.strip() for group in match.groups() if group for code in group.split(",")]
    raise AssertionError(f"{case.name}: no `# expect: E...` comment line")


def _rendered(exc: RemapError) -> str:
    return str(exc).replace(str(REPO), "<repo>") + "\n"


def test_corpus_is_large_enough():
    assert len(CASES) >= 45
    names = [c.name for c in CASES]
    assert len({n.split("_", 1)[0] for n in names}) == len(names), "case numbers repeat"
    assert (ERRORS / ".gitattributes").read_text().split() == ["*", "-text"]


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_error_case(case: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO)
    expected_codes = _expected_codes(case)
    with pytest.raises(RemapError) as info:
        load_rules(_relative(case))
    exc = info.value

    codes = [d.code for d in exc.diagnostics]
    assert all(re.fullmatch(r"E\d{3}", code) for code in codes), codes
    assert list(dict.fromkeys(codes)) == expected_codes, (
        f"{case.name} raised {codes}, its `# expect:` line says {expected_codes}\n\n{exc}")

    err = case.with_suffix(".err")
    actual = _rendered(exc)
    if REGEN:
        err.write_text(actual, encoding="utf-8", newline="")
    assert err.is_file(), f"{err.name} is missing; run with REMAPDSL_REGEN=1 and review it"
    with err.open(encoding="utf-8", newline="") as f:  # no newline translation
        assert actual == f.read(), f"{case.name}: message changed"


def test_every_err_file_has_a_case():
    orphans = [e.name for e in ERRORS.glob("*.err") if not e.with_suffix(".remap").is_file()]
    assert not orphans


@pytest.mark.parametrize("case", sorted(OK.glob("*.remap")), ids=lambda p: p.stem)
def test_ok_case(case: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO)
    rules = load_rules(_relative(case))
    assert rules.statements == ()


def test_big_file_loads_clean(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("make_big", CORPUS / "make_big.py")
    make_big = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_big)
    text = make_big.big_rules(5000)
    assert text.count("\n") == 5000
    path = tmp_path / "big.remap"
    path.write_text(text, encoding="utf-8")
    rules = load_rules(path)
    assert len(rules.statements) > 2500
