"""The binding corpus: rule files in tests/corpus/bind/ compiled against a checkpoint and a config,
each against its exact outcome.

Each `NN_name.remap` comes with `NN_name.json`: `{"config": {...}, "tensors": {key: shape}}`, from
which the test writes a real safetensors checkpoint (float32 zeros) and its config.json. The first
comment line states the outcome: `# expect: ok` (compiles clean, strict) or `# expect: E201` (the
codes raised, in order of first appearance), and then `NN_name.err` holds what `str(RemapError)`
renders, plus one final newline. Regenerate the .err files after a deliberate change of wording
with `REMAPDSL_REGEN=1`, then read every changed message before committing.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint

import remapdsl
from remapdsl.errors import RemapError

REPO = Path(__file__).resolve().parent.parent
BIND = REPO / "tests" / "corpus" / "bind"
REGEN = os.environ.get("REMAPDSL_REGEN") == "1"
EXPECT = re.compile(r"#\s*expect:\s*(ok|E\d{3}(?:\s*,\s*E\d{3})*)\s*$")
CASES = sorted(BIND.glob("*.remap"))


def _expected(case: Path) -> list[str]:
    first = case.read_text(encoding="utf-8").split("\n", 1)[0]
    match = EXPECT.fullmatch(first)
    assert match, f"{case.name}: the first line must be `# expect: ok` or `# expect: E...`"
    return [] if match.group(1) == "ok" else [c.strip() for c in match.group(1).split(",")]


def _checkpoint(spec: dict, folder: Path) -> Path:
    tensors = {key: torch.zeros(shape) for key, shape in spec["tensors"].items()}
    return tiny_checkpoint(folder, tensors, spec["config"])


def test_corpus_covers_each_outcome():
    outcomes = [_expected(c) for c in CASES]
    assert len(CASES) >= 10 and [] in outcomes
    assert {"E201", "E209", "E213"} <= {code for codes in outcomes for code in codes}
    assert len({c.name.split("_", 1)[0] for c in CASES}) == len(CASES), "case numbers repeat"


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_bind_case(case: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO)
    expected = _expected(case)
    spec = json.loads(case.with_suffix(".json").read_text())
    folder = _checkpoint(spec, tmp_path)
    rules = remapdsl.load_rules(case.relative_to(REPO).as_posix())
    err = case.with_suffix(".err")
    if not expected:
        compiled = remapdsl.compile_rules(rules, remapdsl.open_checkpoint(folder), spec["config"])
        assert compiled.runtime_tensors
        assert not err.exists(), f"{err.name}: a case that compiles clean has no .err file"
        return
    with pytest.raises(RemapError) as info:
        remapdsl.compile_rules(rules, remapdsl.open_checkpoint(folder), spec["config"])
    codes = list(dict.fromkeys(d.code for d in info.value.diagnostics))
    assert codes == expected, f"{case.name} raised {codes}\n\n{info.value}"
    actual = str(info.value).replace(str(tmp_path), "<checkpoint>") + "\n"
    if REGEN:
        err.write_text(actual, encoding="utf-8", newline="")
    assert err.is_file(), f"{err.name} is missing; run with REMAPDSL_REGEN=1 and review it"
    with err.open(encoding="utf-8", newline="") as f:
        assert actual == f.read(), f"{case.name}: message changed"


def test_every_file_has_a_case():
    for suffix in (".json", ".err"):
        orphans = [f.name for f in BIND.glob(f"*{suffix}") if not f.with_suffix(".remap").is_file()]
        assert not orphans
    assert all(c.with_suffix(".json").is_file() for c in CASES)
