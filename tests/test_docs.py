"""The docs stay true: every `remap` example parses and checks, every error code is documented."""

import re
from pathlib import Path

import pytest

from remapdsl.language import rules_from_text

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def remap_blocks():
    for path in DOCS:
        for number, block in enumerate(re.findall(r"```remap\n(.*?)```", path.read_text(), re.S)):
            yield pytest.param(block, id=f"{path.name}#{number}")


@pytest.mark.parametrize("block", list(remap_blocks()))
def test_every_remap_example_parses_and_checks(block):
    rules_from_text(block, "example.remap")


def test_the_language_reference_has_examples():
    assert len([b for b in remap_blocks() if "language.md" in b.id]) >= 8


def test_every_error_code_in_the_source_is_documented():
    used = set()
    for source in (ROOT / "remapdsl").rglob("*.py"):
        used |= set(re.findall(r'"(E\d{3})"', source.read_text()))
    documented = set()
    for doc in DOCS:
        documented |= set(re.findall(r"^\| (E\d{3}) \|", doc.read_text(), re.M))
    assert used, "no codes found"
    assert sorted(used - documented) == []
    assert sorted(documented - used) == []


def test_every_op_is_in_the_reference():
    from remapdsl.language.ir import OPS_BY_NAME

    reference = (ROOT / "docs" / "language.md").read_text()
    missing = [name for name in OPS_BY_NAME if f"| `{name}` |" not in reference]
    assert missing == []


def test_the_reference_lists_exactly_the_dtypes_a_rule_may_name():
    from remapdsl.dtypes import RULE_DTYPE_NAMES

    reference = (ROOT / "docs" / "language.md").read_text()
    paragraph = reference[reference.index("Dtype names are torch's:"):].split("\n\n")[0]
    assert re.findall(r"`([a-z0-9_]+)`", paragraph) == list(RULE_DTYPE_NAMES)


def test_the_python_format_example_registers_and_loads(tmp_path):
    """docs/quantized.md's format written in Python, run as printed, then used by a rule."""
    import torch
    from checkpoints import tiny_checkpoint

    import remapdsl
    from remapdsl.quant import unregister_format

    (code,) = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "quantized.md").read_text(), re.S)
    try:
        exec(compile(code, "docs/quantized.md", "exec"), {})
        values, scales = torch.randint(-128, 128, (4, 6), dtype=torch.int8), torch.rand(4)
        tiny_checkpoint(tmp_path, {"a.qweight": values, "a.scales": scales}, {})
        rules = rules_from_text("remap 1\ndequantize {P:path}.qweight, {P}.scales -> {P}.weight"
                                " | int8_row(to=bfloat16)\na.weight -> a\n", "t.remap")
        target = {"a": torch.empty(4, 6, dtype=torch.bfloat16)}
        remapdsl.load(target, str(tmp_path), rules)
        assert torch.equal(target["a"], (values.float() * scales[:, None]).to(torch.bfloat16))
    finally:
        unregister_format("int8_row")


@pytest.mark.distributed
def test_the_testing_guide_runs_as_printed(tmp_path):
    """docs/testing.md's pytest file, next to the rules and a snapshot it names, run by pytest with
    the CI profile it recommends: every test in it passes (the remapdsl plugin gives its fixtures)."""
    import subprocess
    import sys

    import remapdsl

    text = (ROOT / "docs" / "testing.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    assert "--hypothesis-profile=remapdsl-ci" in text
    (tmp_path / "test_mymodel_rules.py").write_text(code)
    (tmp_path / "qwen3_moe.remap").write_text((ROOT / "rules" / "qwen3_moe.remap").read_text())
    remapdsl.write_snapshot(ROOT / "examples" / "tiny-qwen3-moe", tmp_path / "model.headers.json")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-profile=remapdsl-ci",
                          "test_mymodel_rules.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "4 passed" in run.stdout


def _sh_blocks(path: Path) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", path.read_text(), re.DOTALL)


def _remapdsl_tail(command: str) -> str:
    """The part of a one-line setup-and-run command from its first `remapdsl` on (the setup before
    it, a venv and pip, is this suite's own environment)."""
    return command[command.index("remapdsl "):].strip()


def _run_in(folder: Path, command: str):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(command, shell=True, cwd=folder, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.distributed
def test_the_quick_start_main_job_verifies_the_bundled_example_on_two_ranks():
    """README's first command, from a fresh clone's point of view: one line that sets up and runs
    `remapdsl verify` on the bundled checkpoint with a real 2-rank mesh; its remapdsl part passes."""
    quick_start = (ROOT / "README.md").read_text().split("## Quick start", 1)[1]
    main_job = re.findall(r"```sh\n(.*?)```", quick_start, re.DOTALL)[0]
    assert main_job.count("\n") == 1  # exactly one command
    assert main_job.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && ")
    tail = _remapdsl_tail(main_job)
    assert "remapdsl verify " in tail and "--mesh tp=2" in tail and "examples/tiny-qwen3-moe" in tail
    run = _run_in(ROOT, tail)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "sharded load  tp=2  pass" in run.stdout and run.stdout.rstrip().endswith("ok: 4 of 4 checks hold")


@pytest.mark.distributed
def test_the_testing_guide_verify_step_runs_as_printed(tmp_path):
    """docs/testing.md's `remapdsl verify` command, next to the rules, snapshot and layout it names."""
    import remapdsl

    pytest.importorskip("transformers")
    (command,) = [b for b in _sh_blocks(ROOT / "docs" / "testing.md") if "remapdsl verify" in b]
    (tmp_path / "qwen3_moe.remap").write_text((ROOT / "rules" / "qwen3_moe.remap").read_text())
    (tmp_path / "tp2_layout.json").write_text((ROOT / "examples" / "tp2_layout.json").read_text())
    remapdsl.write_snapshot(ROOT / "examples" / "tiny-qwen3-moe", tmp_path / "model.headers.json")
    run = _run_in(tmp_path, command.strip())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "(a snapshot: random values in its layout)" in run.stdout
    assert "transformers  -     pass" in run.stdout and "ok: 5 of 5 checks hold" in run.stdout
