"""The command line, in-process through cli.main and once as real processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from depth import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remapdsl.cli import main

GOOD = "remap 1\nmodel.norm.weight -> norm.weight\n"


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.remap"
    path.write_text(GOOD)
    return path


def test_check_clean_file(good, capsys):
    assert main(["check", str(good)]) == 0
    assert capsys.readouterr().out == f"ok: {good} (2 statements)\n"


def test_check_reports_located_errors_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.remap"
    bad.write_text("remap 1\nmodel.layers.{L}.w -> x.w\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:2:14: error[E102]:")
    assert "Traceback" not in err


def test_check_several_files_reports_every_bad_one(good, tmp_path, capsys):
    bad = tmp_path / "bad.remap"
    bad.write_text("a -> b |\n")
    assert main(["check", str(good), str(bad), str(tmp_path / "missing.remap")]) == 2
    captured = capsys.readouterr()
    assert "ok: " in captured.out
    assert "error[E005]" in captured.err and "error[E009]" in captured.err


def test_fmt_check_and_rewrite(tmp_path, capsys):
    path = tmp_path / "messy.remap"
    path.write_text("remap 1\n\n\n   a.{L}   ->  b.{L}|cast( bfloat16 )  # keep me\n")
    assert main(["fmt", "--check", str(path)]) == 1
    assert "would reformat" in capsys.readouterr().err
    assert main(["fmt", str(path)]) == 0
    assert path.read_text() == "remap 1\n\na.{L} -> b.{L} | cast(bfloat16)  # keep me\n"
    assert main(["fmt", "--check", str(path)]) == 0


def test_fmt_diff_changes_nothing(tmp_path, capsys):
    path = tmp_path / "messy.remap"
    path.write_text("a->b\n")
    assert main(["fmt", "--diff", str(path)]) == 1
    assert "+a -> b" in capsys.readouterr().out
    assert path.read_text() == "a->b\n"


def test_ir_json(good, capsys):
    assert main(["ir", str(good), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rule = data["statements"][1]
    assert rule["kind"] == "rule"
    assert rule["span"] == {"path": str(good), "line": 2, "column": 1, "end_line": 2, "end_column": 33}


def test_ir_resolved_json(good, capsys):
    assert main(["ir", str(good), "--json", "--resolved"]) == 0
    assert len(json.loads(capsys.readouterr().out)["statements"]) == 2


def test_help_for_every_command(capsys):
    for command in ([], ["check"], ["fmt"], ["ir"]):
        with pytest.raises(SystemExit) as info:
            main([*command, "--help"])
        assert info.value.code == 0
        assert "usage: remapdsl" in capsys.readouterr().out


def test_bug_is_reported_as_a_bug(good, capsys, monkeypatch):
    import remapdsl

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(remapdsl, "load_rules", broken)
    assert main(["check", str(good)]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "please report" in err


@pytest.mark.parametrize("launcher", [[sys.executable, "-m", "remapdsl"],
                                      [str(Path(sys.executable).parent / "remapdsl")]])
def test_real_processes(launcher, good, tmp_path):
    bad = tmp_path / "bad.remap"
    bad.write_text("a -> b | concatt(dim=0)\n")
    ok = subprocess.run([*launcher, "check", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    failed = subprocess.run([*launcher, "check", str(bad)], capture_output=True, text=True)
    assert failed.returncode == 2
    assert "did you mean `concat`?" in failed.stderr and "Traceback" not in failed.stderr


def test_plan_command_reads_exactly_what_each_rank_owns(capsys):
    assert main(["plan", "rules/qwen3_moe.remap", "--checkpoint", "examples/tiny-qwen3-moe",
                 "--mesh", "tp=2", "--layout", "examples/tp2_layout.json"]) == 0
    out = capsys.readouterr().out
    assert out.count("rank ") == 2 and "(1.00x owned) over 2 ranks" in out


def test_plan_command_summarizes_first_and_last_rank_of_a_large_mesh(capsys):
    """Past 16 ranks the summary shows ranks first and last unless asked; `--tensors` adds one line per
    runtime tensor, with its placements; each run set prints as one phrase, never one line per run."""
    args = ["plan", "rules/qwen3_moe.remap", "--checkpoint", "examples/tiny-qwen3-moe", "--mesh", "dp=16,tp=2",
            "--layout", "examples/tp2_layout.json"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert [line.split(" {")[0] for line in out.splitlines() if line.startswith("rank ")] == ["rank 0", "rank 31"]
    assert out.rstrip().endswith("over 2 ranks of 32 (--ranks all for every rank)")
    assert main([*args, "--ranks", "1,last,1", "--tensors"]) == 0
    out = capsys.readouterr().out
    assert [line.split(" {")[0] for line in out.splitlines() if line.startswith("rank ")] == ["rank 1", "rank 31"]
    assert "    model.layers.0.mlp.experts.down_proj [R, S(2)]: 4 pieces, 64 runs, " in out
    assert main([*args, "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "<- model.layers.0.mlp.experts.0.down_proj.weight (16 runs of 16 B, 32 B apart)" in out
    assert main([*args, "--ranks", "32"]) == 2
    assert "error[E409]: `--ranks 32`: `32` is not a rank of a mesh of 32" in capsys.readouterr().err


def test_plan_command_bad_mesh_is_a_user_error(capsys):
    assert main(["plan", "rules/qwen3_moe.remap", "--checkpoint", "examples/tiny-qwen3-moe",
                 "--mesh", "tp:2", "--layout", "examples/tp2_layout.json"]) == 2
    assert "error[E409]" in capsys.readouterr().err


def test_check_against_a_checkpoint_reports_unused_drops(tmp_path, capsys):
    rules = tmp_path / "r.remap"
    rules.write_text(Path("rules/qwen3_moe.remap").read_text() + "drop model.rotary_emb.inv_freq\n")
    assert main(["check", str(rules), "--checkpoint", "examples/tiny-qwen3-moe"]) == 0
    out = capsys.readouterr().out
    assert "note: this `drop` removes no checkpoint tensor" in out
    assert "runtime tensors from 45 checkpoint tensors" in out


def test_check_against_the_wrong_checkpoint_is_a_located_error(capsys):
    assert main(["check", "rules/mixtral.remap", "--checkpoint", "examples/tiny-qwen3-moe"]) == 2
    assert "rules/mixtral.remap:19:1: error[E201]" in capsys.readouterr().err


def test_plan_and_explain_show_dequantized_tensors(tmp_path, capsys):
    """A block-FP8 checkpoint: `plan` counts the dequantized pieces and their scale bytes, and the
    total read is the owned values plus the covering scales; `explain` names the format and parts."""
    import json

    import torch
    from checkpoints import tiny_checkpoint

    tiny_checkpoint(tmp_path, {"a.weight": torch.zeros(256, 64).to(torch.float8_e4m3fn),
                               "a.weight_scale_inv": torch.ones(2, 1)}, {})
    rules = tmp_path / "r.remap"
    rules.write_text("remap 1\ndequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight"
                     " | fp8_block(block=[128, 128], to=bfloat16)\na.weight -> a\n")
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"mesh_dim": "tp", "plan": {"a": "colwise"}}))
    assert main(["plan", str(rules), "--checkpoint", str(tmp_path), "--mesh", "tp=2", "--layout", str(layout),
                 "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "(1 dequantized, 0.00 MB of scales)" in out and "fp8_block a.weight[128:256, 0:64]" in out
    assert "1.00x owned values + covering scales" in out
    assert main(["explain", str(rules), "--checkpoint", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "a.weight  [256, 64] bfloat16 = fp8_block(block=[128, 128], to=bfloat16) of `a.weight`, " \
           "`a.weight_scale_inv`" in out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Arguments of every kind a user may pass, fitting or not: rule files, checkpoints, meshes, layouts,
    sizes and ranks."""
    root = tmp_path_factory.mktemp("inputs")
    example = Path(__file__).resolve().parent.parent / "examples"
    files = {"syntax.remap": "remap 1\na -> \n", "empty.remap": "", "config.json": "{\"a\": ", "data.bin": None,
             "bad.safetensors": None, "stray.remap": "remap 1\nno.such.key -> x\n", "layout.json": "[1, 2]"}
    for name, text in files.items():
        if text is None:
            (root / name).write_bytes(b"\xff\xfe\x00garbage" * 8)
        else:
            (root / name).write_text(text)
    (root / "empty").mkdir()
    (root / "truncated").mkdir()
    (root / "truncated" / "model.safetensors").write_bytes((example / "tiny-qwen3-moe" / "model.safetensors")
                                                           .read_bytes()[:300])
    main(["snapshot", "-o", str(root / "snap.json"), str(example / "tiny-qwen3-moe")])
    rules = [str(Path(__file__).resolve().parent.parent / "rules" / "qwen3_moe.remap"), "qwen3_moe", "no_such_rules",
             *(str(root / n) for n in ("syntax.remap", "empty.remap", "stray.remap", "data.bin", "empty"))]
    return {
        "rules": dict.fromkeys(rules, ""),
        "checkpoint": dict.fromkeys([str(example / "tiny-qwen3-moe"), str(root / "snap.json"), str(root / "empty"),
                                     str(root / "truncated"), str(root / "bad.safetensors"), str(root / "no_such"),
                                     str(root / "config.json"), str(root / "syntax.remap")], ""),
        "mesh": dict.fromkeys(["tp=2", "tp=1", "tp=0", "tp", "tp=2,tp=2", "dp=2,tp=2", "", "tp=-1"], ""),
        "layout": dict.fromkeys([str(example / "tp2_layout.json"), str(root / "layout.json"), str(root / "config.json"),
                                 str(root / "no_such.json"), str(root / "data.bin")], ""),
        "size": dict.fromkeys(["5GB", "1", "abc", "-1", "0"], ""),
        "ranks": dict.fromkeys(["0", "1", "5", "a", "0,1", "-1"], ""),
    }


@settings(max_examples=scaled(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_argument_of_any_command_ends_in_a_bug_report(inputs, tmp_path_factory, data, capsys):
    """Every command (but `verify`, which starts processes), given arguments drawn from files that fit and
    files that do not (a folder for a file, bytes that are not UTF-8, a truncated safetensors file, a
    JSON file cut short...), meshes, layouts, sizes and ranks of every sort: exit 0, 1 (`fmt --check`)
    or 2 with one located message on stderr, never 3 (a bug) and never a traceback."""
    pick = {kind: (lambda kind=kind: data.draw(st.sampled_from(sorted(inputs[kind])), label=kind)) for kind in inputs}
    out = tmp_path_factory.mktemp("out")
    argv = data.draw(st.sampled_from([
        lambda: ["check", pick["rules"]()] + (["--checkpoint", pick["checkpoint"]()] if data.draw(st.booleans()) else []),
        lambda: ["fmt", "--check", pick["rules"]()],
        lambda: ["ir", "--json", pick["rules"]()],
        lambda: ["explain", "--checkpoint", pick["checkpoint"](), pick["rules"]()],
        lambda: ["plan", "--checkpoint", pick["checkpoint"](), "--mesh", pick["mesh"](), "--layout", pick["layout"](),
                 "--ranks", pick["ranks"](), pick["rules"]()],
        lambda: ["convert", "--rules", pick["rules"](), "--max-shard-size", pick["size"](), pick["checkpoint"](),
                 str(out / "converted")],
        lambda: ["snapshot", "-o", str(out / "s.json"), pick["checkpoint"]()],
    ]), label="command")()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: a usage error
        code = exc.code
    err = capsys.readouterr().err
    assert code in (0, 1, 2), (argv, err)
    assert "Traceback" not in err and "this is a bug" not in err, (argv, err)
    if code == 2:
        assert "error" in err, (argv, err)
