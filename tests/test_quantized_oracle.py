"""transformers as the dequantization oracle: DeepSeek-V3-style block FP8 (its `Fp8Dequantize`) and
gpt-oss MXFP4 (its `convert_moe_packed_tensors`), loaded by transformers on CPU and by the shipped
rule files, bit for bit. Skipped where transformers is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import quant_reference as ref  # noqa: E402
import torch  # noqa: E402
from hf_models import ModelFactory, fp8_release, gpt_oss_mxfp4_release, transformers_state_dict  # noqa: E402

import remapdsl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> ModelFactory:
    return ModelFactory(tmp_path_factory.mktemp("hf_models"))


def load_like(state: dict, folder: Path, rules: str) -> tuple[dict, object]:
    target = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    report = remapdsl.load(target, str(folder), str(REPO / rules))
    return target, report


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v3_bf16"])
def test_deepseek_v3_fp8_equals_transformers(hf_models, tmp_path, case):
    """Block-FP8 dense and MoE layers (4x4 blocks: transformers infers the block from the grid, so
    only shapes that divide are fair to it) into float32 and bfloat16 models."""
    built = hf_models(case)
    folder = fp8_release(built.folder, tmp_path / "fp8", (4, 4))
    want = transformers_state_dict(folder, built.case.dtype)
    got, report = load_like(want, folder, "rules/deepseek_v3_fp8.remap")
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    remapdsl.save(got, tmp_path / "saved", str(REPO / "rules/deepseek_v3_fp8.remap"), like=str(folder))  # and back
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    stored = sum(t.nbytes for t in remapdsl.open_checkpoint(folder).tensors.values())
    assert report.bytes_read == stored  # every value and scale read once
    assert report.scale_bytes_read > 0


def test_deepseek_v3_fp8_is_the_dequantized_original(hf_models, tmp_path):
    """The same load against the quantizer's own inverse: value x scale of each block."""
    built = hf_models("deepseek_v3")
    folder = fp8_release(built.folder, tmp_path / "fp8", (16, 16))  # partial blocks: 20 and 24 rows
    got, _ = load_like(built.state_dict, folder, "rules/deepseek_v3_fp8.remap")
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    q, s = ref.quantize_fp8_block(built.state_dict[key], (16, 16))
    assert torch.equal(got[key], ref.fp8_block(q, s, (16, 16), torch.float32))
    close = torch.allclose(got[key], built.state_dict[key], rtol=0.07, atol=1e-3)
    assert close, "dequantized values are far from the weights they quantize"


def test_gpt_oss_mxfp4_equals_transformers(tmp_path):
    folder = gpt_oss_mxfp4_release(tmp_path / "gpt_oss")
    want = transformers_state_dict(folder, torch.bfloat16)
    got, report = load_like(want, folder, "rules/gpt_oss.remap")
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert report.bytes_read == sum(t.nbytes for t in remapdsl.open_checkpoint(folder).tensors.values())
    remapdsl.save(got, tmp_path / "saved", str(REPO / "rules/gpt_oss.remap"), like=str(folder))  # and back
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_mxfp4_decode_equals_convert_moe_packed_tensors(tmp_path):
    """Every byte code, scales from 2^-127 to 2^127 (255, NaN by the spec, is left out: transformers
    computes 2^128 = inf there), against transformers' decoder, with its transpose."""
    from checkpoints import tiny_checkpoint
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(5)
    blocks = ref.random_codes(g, (3, 40, 4, 16))
    scales = ref.random_codes(g, (3, 40, 4)) % 255
    scales.view(-1)[:3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    tiny_checkpoint(tmp_path, {"w_blocks": blocks, "w_scales": scales}, {})
    rules = remapdsl.language.rules_from_text("remap 1\ndequantize {P:path}_blocks, {P}_scales -> {P} | mxfp4(to=bfloat16)\n"
                                     "w -> w | transpose(1, 2)\n", "t.remap")
    target = {"w": torch.empty(3, 128, 40, dtype=torch.bfloat16)}
    remapdsl.load(target, str(tmp_path), rules)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(target["w"], want)
