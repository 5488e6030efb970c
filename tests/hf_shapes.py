"""Tiny Hugging Face checkpoints from a config and integer arithmetic alone, for the oracles' goldens.

`checkpoint_shapes(config)` gives the keys, shapes and dtypes transformers' `save_pretrained` writes
(oracles/*/generate.py check them against transformers' own models); `tensor_values` makes every value
a function of the key and the element's index, so the bytes are the same on any machine, torch version
and process, with no random generator. tests/megatron_checkpoints.py and tests/vllm_checkpoints.py name
the configs each oracle reads. Needs torch and safetensors only: the oracles' own venvs import it.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch


def checkpoint_shapes(c: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The keys, in sorted order, with their shapes and dtypes, that transformers' `save_pretrained` writes
    for config `c` (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3 with its MTP layers, gpt-oss)."""
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

    for L in range(c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0)):  # MTP layers last
        p = f"model.layers.{L}."
        out.update({p + "input_layernorm.weight": ((H,), bf16), p + "post_attention_layernorm.weight": ((H,), bf16)})
        if L >= c["num_hidden_layers"]:  # DeepSeek-V3's multi-token prediction layer
            out.update({p + "enorm.weight": ((H,), bf16), p + "hnorm.weight": ((H,), bf16),
                        p + "eh_proj.weight": ((H, 2 * H), bf16), p + "shared_head.norm.weight": ((H,), bf16),
                        p + "shared_head.head.weight": ((V, H), bf16), p + "embed_tokens.weight": ((V, H), bf16)})
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


def write_checkpoint(folder, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """`model.safetensors` of `tensors` and `config.json` of `config` in `folder` (created)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder
