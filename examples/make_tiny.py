"""Writes examples/tiny-qwen3-moe/: a tiny random Qwen3-MoE checkpoint in the Hugging Face layout.

Two layers, four experts per layer, one tensor per expert (the published layout), float32, about
60 kB, with its config.json. The bundled copy was written by this script; run it to write it again.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

H, I, E, HEADS, KV, D, VOCAB, LAYERS = 16, 8, 4, 4, 2, 4, 64, 2


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g),
           "model.norm.weight": torch.randn(H, generator=g),
           "lm_head.weight": torch.randn(VOCAB, H, generator=g)}
    for L in range(LAYERS):
        p = f"model.layers.{L}."
        out[p + "input_layernorm.weight"] = torch.randn(H, generator=g)
        out[p + "post_attention_layernorm.weight"] = torch.randn(H, generator=g)
        for name, rows, cols in [("q", HEADS * D, H), ("k", KV * D, H), ("v", KV * D, H), ("o", H, HEADS * D)]:
            out[p + f"self_attn.{name}_proj.weight"] = torch.randn(rows, cols, generator=g)
        out[p + "self_attn.q_norm.weight"] = torch.randn(D, generator=g)
        out[p + "self_attn.k_norm.weight"] = torch.randn(D, generator=g)
        out[p + "mlp.gate.weight"] = torch.randn(E, H, generator=g)
        for e in range(E):
            for name, rows, cols in [("gate", I, H), ("up", I, H), ("down", H, I)]:
                out[p + f"mlp.experts.{e}.{name}_proj.weight"] = torch.randn(rows, cols, generator=g)
    return out


def main() -> None:
    folder = Path(__file__).resolve().parent / "tiny-qwen3-moe"
    folder.mkdir(exist_ok=True)
    save_file(tensors(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "qwen3_moe", "hidden_size": H, "moe_intermediate_size": I, "num_experts": E,
              "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D,
              "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
