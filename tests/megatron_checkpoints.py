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

from pathlib import Path

import hf_shapes
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
    return hf_shapes.checkpoint_shapes(MODELS[name])


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
    return {k: hf_shapes.tensor_values(k, shape, dtype) for k, (shape, dtype) in checkpoint_shapes(name).items()}


def checkpoint_config(name: str) -> dict:
    if name in FP8_RELEASES:
        base, block = FP8_RELEASES[name]
        return dict(MODELS[base], quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                                       "dynamic", "weight_block_size": list(block)})
    return dict(MODELS[name])


def write_checkpoint(name: str, folder) -> Path:
    """`config.json` and `model.safetensors` of checkpoint `name` in `folder` (created)."""
    return hf_shapes.write_checkpoint(folder, checkpoint_tensors(name), checkpoint_config(name))
