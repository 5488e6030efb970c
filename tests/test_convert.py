"""`remapdsl convert`: forward to the runtime layout (new safetensors shards, laid out exactly as
safetensors lays them out), reverse back to the original layout byte for byte; in one process, from
the command line, and on 2 gloo ranks sharing the work."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint
from depth import scaled
from gloo import BACKENDS, each_backend
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import remapdsl
from remapdsl.cli import main
from remapdsl.drivers.convert import convert
from remapdsl.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe"
RULES = str(ROOT / "rules" / "qwen3_moe.remap")


def runtime_state() -> dict[str, torch.Tensor]:
    inventory = remapdsl.open_checkpoint(EXAMPLE)
    compiled = remapdsl.compile_rules(remapdsl.load_rules(RULES), inventory)
    state = compiled.empty_state_dict()
    remapdsl.load(state, str(EXAMPLE), RULES)
    return state


def test_forward_writes_the_runtime_layout_as_safetensors_would(tmp_path):
    report = convert(EXAMPLE, tmp_path / "fused", RULES, budget_bytes=3000)  # many small batches
    state = runtime_state()
    save_file(state, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    assert filecmp.cmp(tmp_path / "fused" / "model.safetensors", tmp_path / "reference.safetensors", shallow=False)
    assert filecmp.cmp(EXAMPLE / "config.json", tmp_path / "fused" / "config.json", shallow=False)
    assert report.tensors == len(state) and report.bytes_written == sum(t.nbytes for t in state.values())


def test_forward_shards_and_indexes_like_hugging_face(tmp_path):
    convert(EXAMPLE, tmp_path / "fused", RULES, max_shard_bytes=10_000)
    index = json.loads((tmp_path / "fused" / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    state = runtime_state()
    loaded = {}
    for file in files:
        loaded.update(load_file(str(tmp_path / "fused" / file)))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())


def test_reverse_writes_the_original_back_byte_for_byte(tmp_path):
    convert(EXAMPLE, tmp_path / "fused", RULES, max_shard_bytes=10_000)
    convert(tmp_path / "fused", tmp_path / "back", RULES, reverse=True, like=EXAMPLE, budget_bytes=5000)
    for file in ("model.safetensors", "config.json"):
        assert filecmp.cmp(EXAMPLE / file, tmp_path / "back" / file, shallow=False), file


def test_the_command_line(tmp_path, capsys):
    fused, back = str(tmp_path / "fused"), str(tmp_path / "back")
    assert main(["convert", str(EXAMPLE), fused, "--rules", RULES, "--max-shard-size", "10KB"]) == 0
    assert "converted" in capsys.readouterr().out
    derived = str(tmp_path / "derived")  # without --like: the layout derived from the rules and the shapes
    assert main(["convert", fused, derived, "--rules", RULES, "--reverse", "--max-shard-size", "8KB"]) == 0
    capsys.readouterr()
    original, files = load_file(str(EXAMPLE / "model.safetensors")), sorted(Path(derived).glob("*.safetensors"))
    assert len(files) > 1 and (Path(derived) / "model.safetensors.index.json").is_file()
    again = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert again.keys() == original.keys() and all(torch.equal(again[k], original[k]) for k in original)
    assert filecmp.cmp(EXAMPLE / "config.json", Path(derived) / "config.json", shallow=False)
    assert main(["convert", fused, back, "--rules", RULES, "--reverse", "--like", str(EXAMPLE)]) == 0
    assert filecmp.cmp(EXAMPLE / "model.safetensors", Path(back) / "model.safetensors", shallow=False)
    assert main(["convert", fused, back, "--rules", RULES, "--reverse", "--like", str(EXAMPLE)]) == 2
    assert "error[E510]" in capsys.readouterr().err
    assert main(["convert", str(EXAMPLE), str(tmp_path / "x"), "--rules", RULES, "--memory", "lots"]) == 2
    assert "error[E522]" in capsys.readouterr().err


def test_reverse_refuses_a_source_in_another_layout(tmp_path):
    import pytest

    with pytest.raises(remapdsl.RemapError) as info:
        convert(EXAMPLE, tmp_path / "back", RULES, reverse=True, like=EXAMPLE)
    assert info.value.diagnostics[0].code == "E521"
    assert not (tmp_path / "back").exists()


def _on_ranks(rank: int, world: int, out: str) -> list[str]:
    """Forward and back under each default group in turn (plain gloo, then `cuda:gloo`: NCCL's
    device contract), each into a folder of its own; the bytes each rank wrote go to a file."""

    def forward_and_back(backend: str) -> None:
        folder = Path(out, backend.replace(":", "-"))
        folder.mkdir(exist_ok=True)
        forward = convert(EXAMPLE, folder / "fused", RULES, max_shard_bytes=10_000, budget_bytes=4000)
        back = convert(folder / "fused", folder / "back", RULES, reverse=True, like=EXAMPLE)
        Path(out, f"{folder.name}-rank{rank}.json").write_text(json.dumps([forward.bytes_written,
                                                                          back.bytes_written]))

    return each_backend(rank, world, out, forward_and_back)


@pytest.mark.distributed
def test_two_ranks_share_the_work_and_write_the_same_files(tmp_path):
    assert run_ranks(_on_ranks, 2, str(tmp_path)) == [[], []]
    convert(EXAMPLE, tmp_path / "single", RULES, max_shard_bytes=10_000)
    total = sum(t.nbytes for t in runtime_state().values())
    for backend in BACKENDS:
        folder = tmp_path / backend.replace(":", "-")
        for file in (tmp_path / "single").iterdir():
            assert filecmp.cmp(file, folder / "fused" / file.name, shallow=False), (backend, file.name)
        assert filecmp.cmp(EXAMPLE / "model.safetensors", folder / "back" / "model.safetensors", shallow=False)
        shares = [json.loads(Path(tmp_path, f"{folder.name}-rank{r}.json").read_text()) for r in range(2)]
        assert sum(s[0] for s in shares) == total and all(s[0] > 0 for s in shares), backend
        assert sum(s[1] for s in shares) == total, backend


def test_a_quantized_checkpoint_converts_there_and_back(tmp_path):
    """Block FP8 dequantized to bfloat16 by the forward conversion, encoded again with the stored
    scales by the reverse one: the original FP8 file, byte for byte."""
    import quant_reference as ref

    g = torch.Generator().manual_seed(0)
    tensors = {"norm.weight": torch.randn(64, generator=g).to(torch.bfloat16)}
    for name, rows in (("a", 200), ("b", 64)):
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = ref.quantize_fp8_block(
            torch.randn(rows, 64, generator=g), (128, 128))
    source = tiny_checkpoint(tmp_path / "fp8", tensors, {})
    rules = tmp_path / "fp8.remap"
    rules.write_text("remap 1\ndequantize {P:path}.weight, {P}.weight_scale_inv -> {P}.weight"
                     " | fp8_block(block=[128, 128], to=bfloat16)\n{x:seg}.weight -> {x}\n")
    convert(source, tmp_path / "bf16", rules)
    assert load_file(str(tmp_path / "bf16" / "model.safetensors"))["a"].dtype == torch.bfloat16
    convert(tmp_path / "bf16", tmp_path / "back", rules, reverse=True, like=source)
    assert filecmp.cmp(source / "model.safetensors", tmp_path / "back" / "model.safetensors", shallow=False)


@settings(max_examples=scaled(25), deadline=None)
@given(st.data())
def test_a_conversion_with_any_keywords_writes_each_tensor_once_with_its_value(tmp_path_factory, data):
    """Forward, then reverse (with `like`, whose tensor the rules drop copied or left out, or without it),
    each keyword drawn or left at its default (shard and batch sizes from a tensor at a time to all at
    once, `overwrite` onto a folder that exists, `progress`): the files hold each tensor once with the
    value the load gives (forward) or the checkpoint's own (reverse); progress rises to the bytes in all;
    a tensor `like` has that the rules drop is E501 unless `dropped` says what becomes of it, and a
    destination that exists without `overwrite` E510, left as it was."""
    w, v, x = torch.randn(6, 4), torch.randn(5), torch.randn(3)
    src = tiny_checkpoint(tmp_path_factory.mktemp("src"), {"a.w": w, "b.w": w * 2, "v": v, "x": x})
    rules = tmp_path_factory.mktemp("rules") / "r.remap"
    rules.write_text("remap 1\n{a,b}.w -> ab | stack(dim=0)\nv -> v\ndrop x\n")
    want_forward = {"ab": torch.stack([w, w * 2]), "v": v}
    out = tmp_path_factory.mktemp("out")
    for step, (reverse, source, want) in enumerate([(False, src, want_forward), (True, None, None)]):
        like = data.draw(st.sampled_from([None, src]), label="like") if reverse else None
        dropped = data.draw(st.sampled_from(["error", "copy", "omit"]), label="dropped") if like else "error"
        if reverse:
            source = out / "forward"
            want = {"a.w": w, "b.w": w * 2, "v": v} | ({"x": x} if dropped == "copy" else {})
        keywords = data.draw(st.fixed_dictionaries({}, optional={
            "max_shard_bytes": st.sampled_from([1, 100, 5 * 10**9]), "budget_bytes": st.sampled_from([1, 100, 1 << 30]),
            "overwrite": st.booleans()}), label=f"keywords {step}")
        dst = out / ("reverse" if reverse else "forward")
        exists = data.draw(st.booleans(), label="the destination exists")
        if exists:
            dst.mkdir()
            (dst / "stray.txt").write_text("kept unless overwritten")
        seen = []
        kw = dict(keywords, reverse=reverse, like=like, dropped=dropped, progress=lambda *step, seen=seen: seen.append(step))
        refused = {"E501"} if like is not None and dropped == "error" else \
            {"E510"} if exists and not keywords.get("overwrite") else set()
        if refused:
            with pytest.raises(remapdsl.RemapError) as caught:
                remapdsl.convert(source, dst, rules, **kw)
            assert {d.code for d in caught.value.diagnostics} == refused, str(caught.value)
            if exists:
                assert sorted(p.name for p in dst.iterdir()) == ["stray.txt"]
            if not reverse:
                return
            continue
        report = remapdsl.convert(source, dst, rules, **kw)
        got = {}
        for file in dst.glob("*.safetensors"):
            got |= load_file(str(file))
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), step
        assert seen and seen[-1][0] == seen[-1][1] and [d for d, _ in seen] == sorted(d for d, _ in seen)
        assert report.bytes_written == sum(t.nbytes for t in want.values())  # a copied tensor's too


_SIZES = "for example 500MB, 5GB or 2GiB"


@pytest.mark.parametrize("keyword, value, says, hint", [
    ("budget_bytes", 0, "`budget_bytes=0` must be positive", None),
    ("budget_bytes", -1, "`budget_bytes=-1` must be positive", None),
    ("budget_bytes", "0.5B", "`budget_bytes='0.5B'` must be positive", None),
    ("budget_bytes", "lots", "`budget_bytes='lots'` is not a size", _SIZES),
    ("budget_bytes", "GB", "`budget_bytes='GB'` is not a size", _SIZES),
    ("budget_bytes", True, "`budget_bytes=True` is not a size", _SIZES),
    ("max_shard_bytes", 0, "`max_shard_bytes=0` must be positive", None),
    ("max_shard_bytes", "5 XB", "`max_shard_bytes='5 XB'` is not a size", _SIZES),
    ("max_shard_bytes", [5], "`max_shard_bytes=[5]` is not a size", _SIZES)])
def test_a_size_that_is_none_is_e522_before_anything_is_written(keyword, value, says, hint, tmp_path):
    """A batch or shard size of no bytes, or one that is no size (a flag, a unit alone), is named (E522);
    one written as save's `max_shard_size` takes it ("5GB") is taken."""
    with pytest.raises(remapdsl.RemapError) as info:
        convert(EXAMPLE, tmp_path / "out", RULES, **{keyword: value})
    d = info.value.diagnostic
    assert (d.code, d.message, d.hint) == ("E522", says, hint)
    assert not (tmp_path / "out").exists()
    report = convert(EXAMPLE, tmp_path / "sized", RULES, **{keyword: "5GB"})
    assert report.files == 1


def test_a_progress_that_is_no_function_is_e416_before_anything_is_written(tmp_path):
    with pytest.raises(remapdsl.RemapError) as info:
        convert(EXAMPLE, tmp_path / "out", RULES, progress=5)
    assert (info.value.diagnostic.code, info.value.diagnostic.message) == (
        "E416", "progress= is an int, not a function of (bytes done, bytes in all)")
    assert not (tmp_path / "out").exists()
