"""The shipped rule library: names resolve everywhere rules are taken, `auto` picks from config.json,
shipped files include each other by name, each file says what it converts and which test verifies
it, and the wheel carries them."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

import remapdsl
from remapdsl import RemapError, load_rules
from remapdsl.cli import main
from remapdsl.language.library import choose_rules, library_folder, shipped_names

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "tiny-qwen3-moe"
FILES = sorted((REPO / "rules").glob("*.remap"))


def diagnostic(info):
    return info.value.diagnostics[0]


# -- the library and what each file says about itself --------------------------------------------


def test_every_file_in_rules_is_shipped_by_its_name():
    assert library_folder() == (REPO / "rules").resolve()
    assert shipped_names() == tuple(p.stem for p in FILES)


@pytest.mark.parametrize("entry", remapdsl.shipped_rules(), ids=lambda e: e.name)
def test_each_file_says_what_it_converts_and_which_existing_test_verifies_it(entry):
    assert entry.summary and entry.summary in " ".join(entry.converts.split())
    assert entry.model_types, "every shipped file names the model types it loads"
    assert entry.verified
    for line in entry.verified:
        for ref in re.findall(r"tests/[\w/]+\.py(?:::\w+)?", line):
            path, _, test = ref.partition("::")
            assert (REPO / path).is_file(), ref
            assert not test or f"def {test}(" in (REPO / path).read_text(), ref


def test_every_oracle_case_is_listed_by_the_file_it_verifies():
    from hf_models import CASES

    by_path = {e.path: e for e in remapdsl.shipped_rules()}
    for case in CASES.values():
        entry = by_path[case.rules]
        assert any("test_transformers_oracle.py" in v and re.search(rf"\b{case.name}\b", v)
                   for v in entry.verified), (case.name, entry.name)


def test_a_name_loads_the_same_program_as_the_path():
    assert load_rules("qwen3_moe") == load_rules("rules/qwen3_moe.remap")
    assert load_rules("qwen3_moe").path == "rules/qwen3_moe.remap"


def test_an_unknown_name_lists_the_shipped_ones_and_the_closest():
    with pytest.raises(RemapError) as info:
        load_rules("qwen3_mo")
    d = diagnostic(info)
    assert d.code == "E146" and "`qwen3_mo`" in d.message
    assert d.hint.startswith("did you mean `qwen3_moe`?") and all(n in d.hint for n in shipped_names())


def test_a_path_that_is_no_file_is_still_a_read_error():
    with pytest.raises(RemapError) as info:
        load_rules("rules/qwen3_mo.remap")
    assert diagnostic(info).code == "E009"


def test_a_local_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").write_text("remap 1\nmodel.norm.weight -> norm.weight\n")
    assert load_rules("llama").path == "llama"


# -- includes by name -------------------------------------------------------------------------------


def test_a_shipped_file_includes_another_by_name():
    rules = load_rules("deepseek_v3_fp8")
    assert 'include "deepseek_v3"' in rules.files[0].source
    assert [Path(f.path).name for f in rules.files] == ["deepseek_v3_fp8.remap", "deepseek_v3.remap"]


def test_a_user_file_extends_a_shipped_one_outside_its_root(tmp_path):
    top = tmp_path / "mine.remap"
    top.write_text('remap 1\ninclude "qwen3_moe"\n')
    rules = load_rules(top)
    assert rules.statements[1:] == load_rules("qwen3_moe").statements[1:]
    compiled = remapdsl.compile_rules(rules, TINY)
    assert len(compiled.runtime_tensors) == 25


def test_including_an_unknown_name_suggests_the_shipped_one(tmp_path):
    top = tmp_path / "mine.remap"
    top.write_text('remap 1\ninclude "mixtrl"\n')
    with pytest.raises(RemapError) as info:
        load_rules(top)
    d = diagnostic(info)
    assert d.code == "E141" and d.span.line == 2 and d.hint.startswith("did you mean `mixtral`?")


# -- auto ---------------------------------------------------------------------------------------------


def test_auto_picks_each_oracle_cases_file_from_its_transformers_config():
    """The config.json that save_pretrained writes for each case (its to_dict) picks the case's file."""
    pytest.importorskip("transformers")
    from hf_models import CASES
    from transformers import AutoConfig

    for case in CASES.values():
        config = AutoConfig.for_model(case.model_type, **case.config).to_dict()
        chosen, reason = choose_rules(config)
        assert chosen.path == case.rules, case.name
        assert reason == f"model_type `{case.model_type}`"


@pytest.mark.parametrize("config, name", [
    ({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}}, "deepseek_v3_fp8"),
    ({"model_type": "deepseek_v3"}, "deepseek_v3"),
    ({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}, "gpt_oss"),
    ({"architectures": ["MixtralForCausalLM"]}, "mixtral"),
    ({"model_type": "llama"}, "llama"),  # not llama_fused: that one is taken by name only
    ({"model_type": "qwen3"}, "llama"),
])
def test_auto_matches_model_type_architectures_and_quantization(config, name):
    assert choose_rules(config)[0].name == name


def test_auto_with_no_fit_lists_the_candidates():
    with pytest.raises(RemapError) as info:
        choose_rules({"model_type": "qwen3moe"})
    d = diagnostic(info)
    assert d.code == "E147" and "model_type `qwen3moe`" in d.message
    assert d.hint.startswith("did you mean model_type `qwen3_moe`?")
    assert "qwen3_moe (qwen3_moe)" in d.hint and "deepseek_v3_fp8 (deepseek_v3, fp8)" in d.hint
    with pytest.raises(RemapError) as info:  # a quantization no file reads
        choose_rules({"model_type": "qwen3_moe", "quantization_config": {"quant_method": "awq"}})
    assert diagnostic(info).code == "E147" and "quantization `awq`" in diagnostic(info).message


def test_auto_without_a_checkpoint_says_so():
    with pytest.raises(RemapError) as info:
        load_rules("auto")
    assert diagnostic(info).code == "E148"


def test_load_save_and_compile_take_a_name_and_auto(tmp_path, caplog):
    compiled = remapdsl.compile_rules("auto", str(TINY))
    state = compiled.empty_state_dict()
    with caplog.at_level(logging.INFO, logger="remapdsl"):
        report = remapdsl.load(state, str(TINY), "auto")
    assert "rules auto: chose qwen3_moe (model_type `qwen3_moe`)" in caplog.text
    shipped = next(Path(e.path).resolve() for e in remapdsl.shipped_rules() if e.name == "qwen3_moe")
    assert Path(report.rules).resolve() == shipped  # the report says which file `auto` chose
    want = compiled.empty_state_dict()
    assert Path(remapdsl.load(want, str(TINY), "qwen3_moe").rules).resolve() == shipped
    assert len(report.loaded) == 25 and all(state[k].equal(want[k]) for k in want)
    remapdsl.save(state, tmp_path / "copy", "qwen3_moe", like=str(TINY))
    for name in ("model.safetensors",):
        assert (tmp_path / "copy" / name).read_bytes() == (TINY / name).read_bytes()


def test_auto_on_a_save_pretrained_checkpoint(tmp_path):
    """A real transformers checkpoint (config.json with architectures): auto loads it bit for bit."""
    pytest.importorskip("transformers")
    import torch
    from hf_models import CASES, build

    built = build(CASES["llama"], tmp_path / "llama")
    assert json.loads((built.folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    target = {k: torch.full_like(v, float("nan")) for k, v in built.state_dict.items()}
    remapdsl.load(target, str(built.folder), "auto")
    assert all(target[k].equal(v) for k, v in built.state_dict.items())


# -- the command line -----------------------------------------------------------------------------


def test_rules_command_lists_names_what_and_how_verified(capsys):
    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    for name in shipped_names():
        assert re.search(rf"^{name}  \[", out, re.MULTILINE)
    assert "verified: tests/test_transformers_oracle.py (qwen3_moe, qwen3_moe_dense0" in out
    assert "llama_fused  [by name only" in out
    assert main(["rules", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(shipped_names())
    row = next(r for r in rows if r["name"] == "qwen3_moe")  # not rows[-1]: names sort after it
    assert row["model_types"] == ["qwen3_moe"] and row["summary"].startswith("Qwen3-MoE:")


def test_every_command_takes_a_name(capsys, tmp_path):
    ckpt = ["--checkpoint", str(TINY)]
    assert main(["check", "qwen3_moe", *ckpt]) == 0
    assert main(["fmt", "--check", "qwen3_moe", "deepseek_v3_fp8"]) == 0
    assert main(["ir", "llama"]) == 0
    assert main(["explain", "qwen3_moe", *ckpt, "--key", "lm_head.weight"]) == 0
    assert main(["plan", "qwen3_moe", *ckpt, "--mesh", "tp=2", "--layout", "examples/tp2_layout.json"]) == 0
    assert main(["convert", str(TINY), str(tmp_path / "out"), "--rules", "qwen3_moe"]) == 0
    capsys.readouterr()


def test_auto_on_the_command_line_says_which_it_chose(capsys, tmp_path):
    assert main(["explain", "auto", "--checkpoint", str(TINY), "--key", "lm_head.weight"]) == 0
    err = capsys.readouterr().err
    assert err == "rules: auto chose qwen3_moe (model_type `qwen3_moe`): rules/qwen3_moe.remap\n"
    assert main(["convert", str(TINY), str(tmp_path / "fused"), "--rules", "auto"]) == 0
    assert "auto chose qwen3_moe" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "fused"), str(tmp_path / "back"), "--rules", "auto", "--reverse",
                 "--like", str(TINY)]) == 0
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (TINY / "model.safetensors").read_bytes()


def test_command_line_errors_for_names_and_auto(capsys):
    assert main(["explain", "qwen3moe", "--checkpoint", str(TINY)]) == 2
    assert "error[E146]" in capsys.readouterr().err
    assert main(["check", "auto"]) == 2
    assert "error[E148]" in capsys.readouterr().err


# -- packaging ------------------------------------------------------------------------------------------


def test_the_wheel_force_includes_the_rules_folder_as_package_data():
    tomllib = pytest.importorskip("tomllib")
    wheel = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["packages"] == ["remapdsl"]
    assert wheel["force-include"]["rules"] == "remapdsl/rules"


def test_an_installed_layout_finds_its_rules_from_anywhere(tmp_path):
    """The wheel's layout (remapdsl/, remapdsl/grammars/, remapdsl/rules/ side by side, no clone)
    resolves shipped names and `auto` from an unrelated working folder."""
    import shutil

    site = tmp_path / "site"
    shutil.copytree(REPO / "remapdsl", site / "remapdsl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "grammars", site / "remapdsl" / "grammars")
    shutil.copytree(REPO / "rules", site / "remapdsl" / "rules")
    (tmp_path / "work").mkdir()
    script = ("import remapdsl, sys; r = remapdsl.load_rules('deepseek_v3_fp8'); print(r.files[1].path); "
              f"print(remapdsl.choose_rules({str(TINY)!r})[0].path)")
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path / "work", capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, check=False)
    assert out.returncode == 0, out.stderr
    included, chosen = out.stdout.split()
    assert included == str(site / "remapdsl" / "rules" / "deepseek_v3.remap")
    assert chosen == str(site / "remapdsl" / "rules" / "qwen3_moe.remap")
