"""Tiny Hugging Face checkpoints for the Megatron-Bridge oracle, written from integer arithmetic alone.

`write_checkpoint(name, folder)` writes `config.json` and `model.safetensors` for one of `MODELS`: the
keys and shapes a transformers `save_pretrained` of that config writes (oracles/megatron_bridge/
generate.py checks them against transformers' own model), every value a function of the key and the
element's index, so the bytes are the same on any machine, torch version and process, with no random
generator involved. The oracle feeds these folders to Megatron-Bridge and keeps what it made as goldens
(tests/goldens/megatron_bridge/); tests/test_megatron_bridge.py writes them again and loads them
through the rule files. Needs torch and safetensors only.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from quant_reference import quantize_fp8_block

_COMMON = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "dtype": "bfloat16"}

# name -> config.json (what save_pretrained writes is a superset; transformers fills the rest).
MODELS: dict[str, dict] = {
    # Llama-family dense with grouped-query attention (2 query heads per KV head).
    "llama": dict(_COMMON, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=2,
                  intermediate_size=32, head_dim=16),
    # Qwen3 dense: q/k norms, a head_dim that is not hidden_size / heads.
    "qwen3": dict(_COMMON, model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_hidden_layers=2,
                  intermediate_size=32, head_dim=32),
    # Qwen3-MoE: every layer MoE, 4 experts.
    "qwen3_moe": dict(_COMMON, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=2,
                      intermediate_size=32, moe_intermediate_size=16, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # DeepSeek-V3: MLA, layer 0 dense, layer 1 MoE with a shared expert, and one MTP layer (layer 2).
    "deepseek_v3": dict(_COMMON, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                        num_hidden_layers=2, num_key_value_heads=4, intermediate_size=32, moe_intermediate_size=16,
                        first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, num_nextn_predict_layers=1, routed_scaling_factor=2.5,
                        norm_topk_prob=True),
}
# The FP8 release of a model: every projection as E4M3 values plus float32 scales per block.
FP8_RELEASES: dict[str, tuple[str, tuple[int, int]]] = {"deepseek_v3_fp8": ("deepseek_v3", (128, 128))}


def checkpoint_shapes(name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint's keys, in sorted order, with their shapes and dtypes."""
    c = MODELS[name]
    V, H, NH, KV, I = (c[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "intermediate_size"))
    bf16 = torch.bfloat16
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((V, H), bf16), "model.norm.weight": ((H,), bf16),
        "lm_head.weight": ((V, H), bf16)}

    def dense_mlp(p: str, inter: int) -> None:
        out.update({f"{p}gate_proj.weight": ((inter, H), bf16), f"{p}up_proj.weight": ((inter, H), bf16),
                    f"{p}down_proj.weight": ((H, inter), bf16)})

    if c["model_type"] == "deepseek_v3":
        layers = c["num_hidden_layers"] + c["num_nextn_predict_layers"]
        QL, KL, NOPE, ROPE, VD = (c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                 "qk_rope_head_dim", "v_head_dim"))
        for L in range(layers):
            p = f"model.layers.{L}."
            out.update({
                p + "input_layernorm.weight": ((H,), bf16), p + "post_attention_layernorm.weight": ((H,), bf16),
                p + "self_attn.q_a_proj.weight": ((QL, H), bf16), p + "self_attn.q_a_layernorm.weight": ((QL,), bf16),
                p + "self_attn.q_b_proj.weight": ((NH * (NOPE + ROPE), QL), bf16),
                p + "self_attn.kv_a_proj_with_mqa.weight": ((KL + ROPE, H), bf16),
                p + "self_attn.kv_a_layernorm.weight": ((KL,), bf16),
                p + "self_attn.kv_b_proj.weight": ((NH * (NOPE + VD), KL), bf16),
                p + "self_attn.o_proj.weight": ((H, NH * VD), bf16)})
            if L < c["first_k_dense_replace"]:
                dense_mlp(p + "mlp.", I)
                continue
            E, MI = c["n_routed_experts"], c["moe_intermediate_size"]
            out.update({p + "mlp.gate.weight": ((E, H), bf16),
                        p + "mlp.gate.e_score_correction_bias": ((E,), torch.float32)})
            for e in range(E):
                dense_mlp(f"{p}mlp.experts.{e}.", MI)
            dense_mlp(p + "mlp.shared_experts.", MI * c["n_shared_experts"])
            if L >= c["num_hidden_layers"]:  # the MTP layer
                out.update({p + "enorm.weight": ((H,), bf16), p + "hnorm.weight": ((H,), bf16),
                            p + "eh_proj.weight": ((H, 2 * H), bf16), p + "shared_head.norm.weight": ((H,), bf16),
                            p + "shared_head.head.weight": ((V, H), bf16), p + "embed_tokens.weight": ((V, H), bf16)})
        return dict(sorted(out.items()))

    D = c["head_dim"]
    for L in range(c["num_hidden_layers"]):
        p = f"model.layers.{L}."
        out.update({
            p + "input_layernorm.weight": ((H,), bf16), p + "post_attention_layernorm.weight": ((H,), bf16),
            p + "self_attn.q_proj.weight": ((NH * D, H), bf16), p + "self_attn.k_proj.weight": ((KV * D, H), bf16),
            p + "self_attn.v_proj.weight": ((KV * D, H), bf16), p + "self_attn.o_proj.weight": ((H, NH * D), bf16)})
        if c["model_type"] in ("qwen3", "qwen3_moe"):
            out.update({p + "self_attn.q_norm.weight": ((D,), bf16), p + "self_attn.k_norm.weight": ((D,), bf16)})
        if c["model_type"] == "qwen3_moe":
            out[p + "mlp.gate.weight"] = ((c["num_experts"], H), bf16)
            for e in range(c["num_experts"]):
                dense_mlp(f"{p}mlp.experts.{e}.", c["moe_intermediate_size"])
        else:
            dense_mlp(p + "mlp.", I)
    return dict(sorted(out.items()))


def tensor_values(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Distinct values in [-2, 2) from the key's CRC-32 and each element's index (integer arithmetic,
    then one float64 -> dtype rounding): the same bytes everywhere."""
    n = 1
    for s in shape:
        n *= s
    seed = zlib.crc32(key.encode())
    i = torch.arange(n, dtype=torch.int64)
    x = (i * 2654435761 + seed * 40503 + 12345) % 1000003
    return ((x.to(torch.float64) / 1000003.0 - 0.5) * 4.0).to(dtype).reshape(shape)


def is_fp8_quantized(key: str) -> bool:
    """The weights DeepSeek-V3's release stores in FP8: every linear projection (not the embedding, norms,
    router, eh_proj or the heads)."""
    return key.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight"))


def checkpoint_tensors(name: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by key (an FP8 release: values and `weight_scale_inv` scales)."""
    if name in FP8_RELEASES:
        base, block = FP8_RELEASES[name]
        out = {}
        for key, value in checkpoint_tensors(base).items():
            if is_fp8_quantized(key) and ".eh_proj." not in key:
                out[key], out[key.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8_block(value, block)
            else:
                out[key] = value
        return dict(sorted(out.items()))
    return {k: tensor_values(k, shape, dtype) for k, (shape, dtype) in checkpoint_shapes(name).items()}


def checkpoint_config(name: str) -> dict:
    if name in FP8_RELEASES:
        base, block = FP8_RELEASES[name]
        return dict(MODELS[base], quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                                       "dynamic", "weight_block_size": list(block)})
    return dict(MODELS[name])


def write_checkpoint(name: str, folder) -> Path:
    """`config.json` and `model.safetensors` of checkpoint `name` in `folder` (created)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(name), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(checkpoint_config(name), indent=2, sort_keys=True) + "\n")
    return folder
