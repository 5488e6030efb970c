"""The rule files in rules/ check clean and are in canonical form."""

from pathlib import Path

import pytest

from remapdsl import load_rules
from remapdsl.language import format_rules, parse_file

RULES = sorted((Path(__file__).resolve().parent.parent / "rules").glob("*.remap"))


def test_the_required_models_are_shipped():
    names = {p.stem for p in RULES}
    assert {"llama", "qwen3_moe", "mixtral"} <= names


@pytest.mark.parametrize("path", RULES, ids=lambda p: p.name)
def test_shipped_rules_check_clean(path):
    rules = load_rules(path)
    assert rules.statements


@pytest.mark.parametrize("path", RULES, ids=lambda p: p.name)
def test_shipped_rules_are_formatted(path):
    parsed = parse_file(path)
    assert format_rules(parsed) == parsed.source


# -- `remapdsl check --checkpoint` for every shipped file, on a checkpoint of the kind it loads ------------
# Files the transformers oracle (CASES) and the family tests (test_families.CHECKED, the FP8 releases)
# check already are checked there; the others here. The last test keeps the union complete.

CHECKED_HERE = {  # file -> (the CASES checkpoint, made into a release: None, "fp8" or "mxfp4")
    "llama_fused": ("llama", None),
    "deepseek_v3_fp8": ("deepseek_v3", "fp8"),
    "gpt_oss": (None, "mxfp4"),
    "identity": ("qwen3_moe", None),
    "torchtitan_llama3": ("llama", None),
    "torchtitan_qwen3": ("qwen3_moe", None),
    "torchtitan_deepseek_v3": ("deepseek_v3", None),
}


@pytest.mark.parametrize("name", sorted(CHECKED_HERE))
def test_check_passes_on_a_checkpoint_it_loads(name, tmp_path, capsys):
    from hf_models import CASES, build, fp8_release, gpt_oss_mxfp4_release

    from remapdsl.cli import main

    case, release = CHECKED_HERE[name]
    if release == "mxfp4":
        folder = gpt_oss_mxfp4_release(tmp_path / "gpt_oss")
    else:
        folder = build(CASES[case], tmp_path / case).folder
        if release == "fp8":
            folder = fp8_release(folder, tmp_path / "fp8", (4, 4))
    assert main(["check", name, "--checkpoint", str(folder)]) == 0, capsys.readouterr().err


def test_every_shipped_file_is_checked_against_a_checkpoint():
    from hf_models import CASES
    from test_families import CHECKED
    from test_megatron_bridge import (
        RULES as MEGATRON,  # test_megatron_bridge.test_check_passes_on_each_megatron_file
    )
    from test_vllm import RULES as VLLM  # test_vllm.test_check_passes_on_each_vllm_file

    from remapdsl.language.library import shipped_names

    checked = {Path(c.rules).stem for c in CASES.values()} | {rules for rules, _ in CHECKED} \
        | {"qwen3_moe_fp8", "llama_fp8"} | set(CHECKED_HERE) | set(MEGATRON.values()) | set(VLLM.values())  # the FP8 pair: test_families.test_check_passes_on_the_fp8_release
    assert sorted(set(shipped_names()) - checked) == []
