"""A 5,000-line rule file, unrolled layer by layer, for the "large file loads clean" test.

The test writes it into a temporary folder at run time; run this script to look at it:
`python tests/corpus/make_big.py > /tmp/big.remap`.
"""

from __future__ import annotations

HEADER = """\
# Llama-style checkpoint, every layer written out (as a generator would emit it)
remap 1

let H  = config.hidden_size
let NH = config.num_attention_heads
let KV = config.num_key_value_heads
let D  = config.head_dim ?? H // NH

model.embed_tokens.weight -> embed.weight
model.norm.weight         -> norm.weight
lm_head.weight            -> output.weight when not config.tie_word_embeddings
drop model.rotary_emb.inv_freq
"""

LAYER = """\
# layer {i}
model.layers.{i}.input_layernorm.weight -> layers.{i}.attn_norm.weight
model.layers.{i}.self_attn.{{q,k,v}}_proj.weight -> layers.{i}.attn.wqkv.weight
    | interleave(dim=0, groups=KV)
model.layers.{i}.self_attn.o_proj.weight -> layers.{i}.attn.wo.weight
model.layers.{i}.post_attention_layernorm.weight -> layers.{i}.mlp_norm.weight
model.layers.{i}.mlp.{{gate,up}}_proj.weight -> layers.{i}.mlp.w13.weight
    | concat(dim=0)
model.layers.{i}.mlp.down_proj.weight -> layers.{i}.mlp.w2.weight  # row-parallel
    | cast(bfloat16)
"""


def big_rules(lines: int = 5000) -> str:
    """Rule text of exactly `lines` lines (each ending in a newline): a header, then layers."""
    out = HEADER.splitlines()
    i = 0
    while len(out) + LAYER.count("\n") <= lines:
        out.extend(LAYER.format(i=i).splitlines())
        i += 1
    while len(out) < lines:
        out.append("# end of layers")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(big_rules(), end="")
