"""`remapdsl verify`: passes on the shipped rules and the bundled checkpoint (and on a snapshot of it),
fails with exit status 1 and the tensor named on deliberately wrong rule files, exits 2 with one
located message on user errors, and prints the same as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_models import wrong_rules

import remapdsl
from remapdsl.cli import main
from remapdsl.testing.verify import verify

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-qwen3-moe"
TP2_LAYOUT = ROOT / "examples" / "tp2_layout.json"
QWEN3_RULES = ROOT / "rules" / "qwen3_moe.remap"
LLAMA_RULES = ROOT / "rules" / "llama.remap"
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 48, "max_position_embeddings": 64}



def _statuses(result) -> list[tuple[str, str | None, str]]:
    return [(c.property, c.mesh, c.status) for c in result.checks]


# -- passing ---------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_the_shipped_rules_pass_on_the_bundled_checkpoint_on_two_real_ranks(capsys):
    status = main(["verify", str(QWEN3_RULES), "--checkpoint", str(TINY), "--layout", str(TP2_LAYOUT)])
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line.split() for line in out.splitlines()]
    sharded = next(r for r in rows if r[:2] == ["sharded", "load"])
    assert sharded[2:4] == ["tp=2", "pass"]
    assert sharded[4:6] == sharded[6:8]  # bytes read == bytes owned, summed over the ranks
    assert "2 gloo ranks: every shard equals the whole load; each rank read exactly the bytes it owns" in out
    assert [r[:3] for r in rows if r and r[0] in ("compile", "round")] == [["compile", "-", "pass"],
                                                                          ["round", "trip", "-"]]
    save = next(r for r in rows if r[:2] == ["sharded", "save"])
    assert save[2:4] == ["tp=2", "pass"]
    assert "each wrote the bytes it owns" in out and "none gathered: the checkpoint back byte for byte" in out
    assert out.rstrip().endswith("ok: 4 of 4 checks hold")


@pytest.mark.distributed
def test_a_snapshot_is_verified_on_random_values_in_its_layout_as_json(tmp_path, capsys):
    snapshot = tmp_path / "model.headers.json"
    remapdsl.write_snapshot(TINY, snapshot)
    status = main(["verify", str(QWEN3_RULES), "--checkpoint", str(snapshot), "--json"])  # default mesh tp=2
    report = json.loads(capsys.readouterr().out)
    assert status == 0, report
    assert report["ok"] is True and report["synthesized"] is True
    assert [(c["property"], c["mesh"], c["status"]) for c in report["checks"]] == [
        ("compile", None, "pass"), ("sharded load", "tp=2", "pass"), ("sharded save", "tp=2", "pass"),
        ("round trip", None, "pass")]
    sharded = report["checks"][1]
    assert sharded["bytes_read"] == sharded["bytes_owned"] > 0


# -- wrong rules fail, naming the tensor ---------------------------------------------------------------


@pytest.mark.distributed
def test_gate_and_up_swapped_fail_only_against_transformers(tmp_path, capsys):
    pytest.importorskip("transformers")
    swapped = wrong_rules(tmp_path, QWEN3_RULES, "experts.{E}.{gate,up}_proj.weight", "experts.{E}.{up,gate}_proj.weight")
    status = main(["verify", str(swapped), "--checkpoint", str(TINY), "--against", "transformers"])
    out = capsys.readouterr().out
    assert status == 1, out
    statuses = {tuple(line.split()[:3]) for line in out.splitlines() if line.split()}
    # consistent, so the sharded load and the round trips cannot see it; the reference does
    assert {("sharded", "load", "tp=2"), ("sharded", "save", "tp=2"), ("round", "trip", "-"),
            ("transformers", "-", "fail")} <= statuses
    assert "FAIL transformers:" in out
    assert "`model.layers.0.mlp.experts.gate_up_proj`: " in out and "first at [0, 0, 0]" in out
    assert out.rstrip().endswith("FAILED: 4 of 5 checks hold")


def test_experts_stacked_in_the_wrong_order_fail_against_transformers(tmp_path):
    pytest.importorskip("transformers")
    wrong = wrong_rules(tmp_path, QWEN3_RULES, "model.layers.{L}.mlp.experts.{E}.down_proj.weight -> "
                   "model.layers.{L}.mlp.experts.down_proj\n    | stack(E, dim=0)",
                   "model.layers.{L}.mlp.experts.{1,0,2,3}.down_proj.weight -> "
                   "model.layers.{L}.mlp.experts.down_proj\n    | stack(dim=0)")
    result = verify(wrong, TINY, meshes=(), against="transformers")
    assert not result.ok
    assert _statuses(result) == [("compile", None, "pass"), ("round trip", None, "pass"),
                                 ("transformers", None, "fail")]
    assert "`model.layers.0.mlp.experts.down_proj`: " in result.checks[-1].detail
    assert "elements differ; first at [0, 0, 0]" in result.checks[-1].detail


def test_qkv_split_at_the_wrong_sizes_fails_on_the_shapes(remapdsl_checkpoint, tmp_path):
    pytest.importorskip("transformers")
    folder = remapdsl_checkpoint(LLAMA)
    old = "model.layers.{L}.self_attn.{q,k,v,o}_proj.weight -> model.layers.{L}.self_attn.{q,k,v,o}_proj.weight"
    fused = ("model.layers.{L}.self_attn.{q,k,v}_proj.weight -> model.layers.{L}.self_attn.{q,k,v}_proj.weight\n"
             "    | concat(dim=0)\n    | split(dim=0, sizes=[%s])\n"
             "model.layers.{L}.self_attn.o_proj.weight -> model.layers.{L}.self_attn.o_proj.weight")
    right = verify(wrong_rules(tmp_path, LLAMA_RULES, old, fused % "32, 16, 16"), folder, meshes=(), against="transformers")
    assert right.ok, right.checks
    wrong = verify(wrong_rules(tmp_path, LLAMA_RULES, old, fused % "16, 16, 32"), folder, meshes=(), against="transformers")
    assert _statuses(wrong)[-1] == ("transformers", None, "fail")
    assert ("`model.layers.0.self_attn.q_proj.weight`: the rules make float32 [16, 32], transformers has "
            "float32 [32, 32]") in wrong.checks[-1].detail


def test_rules_that_do_not_cover_the_checkpoint_fail_the_compile_check(tmp_path, capsys):
    wrong = wrong_rules(tmp_path, QWEN3_RULES, "model.norm.weight -> model.norm.weight\n", "")
    status = main(["verify", str(wrong), "--checkpoint", str(TINY)])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "error[E202]" in out and "`model.norm.weight`" in out
    rows = [line.split()[:4] for line in out.splitlines() if line.split()]
    assert ["compile", "-", "fail", "-"] in rows and ["sharded", "load", "tp=2", "skipped"] in rows


# -- user errors: exit 2, one message, no traceback -----------------------------------------------------


@pytest.mark.parametrize("case", ["no rules", "broken rules", "no checkpoint", "bad mesh", "layout off the mesh"])
def test_user_errors_exit_2_with_one_message(case, tmp_path, capsys):
    rules, checkpoint, extra = str(QWEN3_RULES), str(TINY), []
    if case == "no rules":
        rules = str(tmp_path / "missing.remap")
    elif case == "broken rules":
        (tmp_path / "broken.remap").write_text("remap 1\nmodel.norm.weight model.norm.weight\n")
        rules = str(tmp_path / "broken.remap")
    elif case == "no checkpoint":
        checkpoint = str(tmp_path / "nowhere")
    elif case == "bad mesh":
        extra = ["--mesh", "tp=two"]
    else:
        extra = ["--mesh", "ep=2", "--layout", str(TP2_LAYOUT)]  # the layout's mesh dim is tp
    status = main(["verify", rules, "--checkpoint", checkpoint, *extra])
    captured = capsys.readouterr()
    assert status == 2, captured
    assert captured.out == ""
    assert "error[E" in captured.err and "Traceback" not in captured.err
    code = {"no rules": "E009", "broken rules": "E002", "no checkpoint": "E301", "bad mesh": "E409"}.get(case)
    if code:
        assert f"error[{code}]" in captured.err


@pytest.mark.distributed
def test_a_cast_that_loses_values_fails_both_saves_naming_the_tensor(tmp_path):
    """A rule whose load cannot be undone (bfloat16 read into float16 loses range): the loads
    pass, the sharded save and the one-process round trip fail, each naming the tensor (E502)."""
    wrong = wrong_rules(tmp_path, QWEN3_RULES, "model.norm.weight -> model.norm.weight",
                        "model.norm.weight -> model.norm.weight | cast(float16)")
    result = verify(wrong, TINY, layout=TP2_LAYOUT)
    statuses = {(c.property, c.mesh): c for c in result.checks}
    assert statuses[("sharded load", "tp=2")].status == "pass"
    for key in (("sharded save", "tp=2"), ("round trip", None)):
        assert statuses[key].status == "fail" and "E502" in statuses[key].detail, statuses[key]
        assert "model.norm.weight" in statuses[key].detail
    assert not result.ok
