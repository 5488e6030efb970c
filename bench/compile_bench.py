"""Compile rules/deepseek_v3.remap against a DeepSeek-V3-sized inventory; report time and peak memory.

Goal: `load_rules` + `compile_rules` under 3 s, and under 1 GiB of memory, on the 2-core dev machine.
The inventory is synthetic, built from shapes alone (`Inventory.from_shapes`, no files): the released
DeepSeek-V3 layout with BF16 weights (61 decoder layers, the first 3 dense, 256 routed experts and
1 shared expert per MoE layer, multi-head latent attention, the score-correction bias in F32) plus
the multi-token-prediction layer 61 that the rules drop. That is 46,183 tensors. The FP8 release has
about twice as many (a `weight_scale_inv` beside each quantized weight, ~91,000): `--fp8` builds that
layout (E4M3 weights of every linear projection, float32 scales per 128 x 128 block; the embedding,
lm_head, norms and router stay BF16/F32, as released) and compiles `rules/deepseek_v3_fp8.remap`,
which dequantizes on read. `--experts 512` gives a BF16 inventory of that size instead.

One process: the first call (cold: the parser is built) is reported on its own,
then the median of 5 further calls. Memory is measured on one more call under tracemalloc (Python
allocations made during the call, the result included) and as the process's peak RSS (ru_maxrss),
shown before and after the compile calls so that the inventory's own share is visible. A yardstick
for machine speed is printed beside it: the time to build the inventory itself.

    python bench/compile_bench.py [--experts 256] [--fp8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import time
import tracemalloc
from pathlib import Path

import remapdsl
from remapdsl.checkpoint.inventory import Inventory

RULES = Path(__file__).resolve().parent.parent / "rules" / "deepseek_v3.remap"
RULES_FP8 = RULES.with_name("deepseek_v3_fp8.remap")
FP8_BLOCK = [128, 128]
NOT_QUANTIZED = ("embed_tokens.weight", "lm_head.weight", "norm.weight", "mlp.gate.weight", "bias")
GIB = 1 << 30


def deepseek_v3_config(experts: int = 256) -> dict:
    """The released DeepSeek-V3 config.json, less its quantization_config (the weights are BF16 here)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": experts,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def deepseek_v3_shapes(config: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Checkpoint key -> (safetensors dtype, shape) of a BF16 DeepSeek-V3 release, MTP layers included."""
    H, V = config["hidden_size"], config["vocab_size"]
    nh, E = config["num_attention_heads"], config["n_routed_experts"]
    I, Im = config["intermediate_size"], config["moe_intermediate_size"]
    Is = config["n_shared_experts"] * Im
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, vh = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    layers, mtp = config["num_hidden_layers"], config.get("num_nextn_predict_layers", 0)
    bf16 = "BF16"
    out: dict[str, tuple[str, tuple[int, ...]]] = {
        "model.embed_tokens.weight": (bf16, (V, H)),
        "model.norm.weight": (bf16, (H,)),
        "lm_head.weight": (bf16, (V, H)),
    }
    for L in range(layers + mtp):
        p = f"model.layers.{L}."
        out[p + "input_layernorm.weight"] = (bf16, (H,))
        out[p + "post_attention_layernorm.weight"] = (bf16, (H,))
        a = p + "self_attn."
        out[a + "q_a_proj.weight"] = (bf16, (q_lora, H))
        out[a + "q_a_layernorm.weight"] = (bf16, (q_lora,))
        out[a + "q_b_proj.weight"] = (bf16, (nh * (nope + rope), q_lora))
        out[a + "kv_a_proj_with_mqa.weight"] = (bf16, (kv_lora + rope, H))
        out[a + "kv_a_layernorm.weight"] = (bf16, (kv_lora,))
        out[a + "kv_b_proj.weight"] = (bf16, (nh * (nope + vh), kv_lora))
        out[a + "o_proj.weight"] = (bf16, (H, nh * vh))
        m = p + "mlp."
        if L < config["first_k_dense_replace"]:
            out[m + "gate_proj.weight"] = (bf16, (I, H))
            out[m + "up_proj.weight"] = (bf16, (I, H))
            out[m + "down_proj.weight"] = (bf16, (H, I))
            continue
        out[m + "gate.weight"] = (bf16, (E, H))
        out[m + "gate.e_score_correction_bias"] = ("F32", (E,))
        for e in range(E):
            out[f"{m}experts.{e}.gate_proj.weight"] = (bf16, (Im, H))
            out[f"{m}experts.{e}.up_proj.weight"] = (bf16, (Im, H))
            out[f"{m}experts.{e}.down_proj.weight"] = (bf16, (H, Im))
        out[m + "shared_experts.gate_proj.weight"] = (bf16, (Is, H))
        out[m + "shared_experts.up_proj.weight"] = (bf16, (Is, H))
        out[m + "shared_experts.down_proj.weight"] = (bf16, (H, Is))
        if L >= layers:  # the multi-token-prediction block's own parts
            out[p + "enorm.weight"] = (bf16, (H,))
            out[p + "hnorm.weight"] = (bf16, (H,))
            out[p + "eh_proj.weight"] = (bf16, (H, 2 * H))
            out[p + "embed_tokens.weight"] = (bf16, (V, H))
            out[p + "shared_head.norm.weight"] = (bf16, (H,))
            out[p + "shared_head.head.weight"] = (bf16, (V, H))
    return out


def fp8_release(config: dict, shapes: dict) -> tuple[dict, dict]:
    """The FP8 release of a BF16 layout: each linear projection's weight in E4M3 beside its
    float32 `weight_scale_inv` of one scale per 128 x 128 block, and the config's
    `quantization_config` saying so."""
    out = {}
    for key, (dtype, shape) in shapes.items():
        if dtype != "BF16" or len(shape) != 2 or key.endswith(NOT_QUANTIZED):
            out[key] = (dtype, shape)
            continue
        out[key] = ("F8_E4M3", shape)
        out[key + "_scale_inv"] = ("F32", tuple(-(-n // b) for n, b in zip(shape, FP8_BLOCK)))
    quantized = dict(config, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                  "activation_scheme": "dynamic",
                                                  "weight_block_size": FP8_BLOCK})
    return quantized, out


def compile_once(inventory: Inventory, config: dict):
    rules = remapdsl.load_rules(RULES_FP8 if "quantization_config" in config else RULES)
    return remapdsl.compile_rules(rules, inventory, config)


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256, help="routed experts per MoE layer (256)")
    parser.add_argument("--fp8", action="store_true", help="the FP8 release layout and its rules")
    parser.add_argument("--repeat", type=int, default=5, help="warm calls for the median (5)")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    config = deepseek_v3_config(args.experts)
    shapes = deepseek_v3_shapes(config)
    if args.fp8:
        config, shapes = fp8_release(config, shapes)
    inventory_s, inventory = timed(lambda: Inventory.from_shapes(shapes))
    payload = sum(t.nbytes for t in inventory.tensors.values())
    rss_before = maxrss_bytes()
    if not hasattr(remapdsl, "compile_rules"):
        print(f"{len(inventory.tensors)} tensors; remapdsl.compile_rules is not available yet")
        raise SystemExit(2)

    cold, compiled = timed(lambda: compile_once(inventory, config))
    destinations = len(compiled.runtime_tensors)
    digest = compiled.digest()
    del compiled
    warm = []
    for _ in range(args.repeat):
        gc.collect()
        seconds, compiled = timed(lambda: compile_once(inventory, config))
        warm.append(seconds)
        if compiled.digest() != digest:
            raise SystemExit("compile is not deterministic: digests differ between calls")
        del compiled
    median = statistics.median(warm)

    gc.collect()
    tracemalloc.start()
    compiled = compile_once(inventory, config)
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del compiled
    rss_after = maxrss_bytes()

    print(f"DeepSeek-V3 {'FP8' if args.fp8 else 'BF16'} inventory: {len(inventory.tensors)} tensors "
          f"({args.experts} routed experts), {payload / 1e9:.0f} GB of weights, "
          f"{destinations} destinations; digest {str(digest)[:16]}")
    print(f"  load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
          f"on {os.cpu_count()} CPUs")
    print(f"  yardstick: Inventory.from_shapes   {inventory_s * 1e3:8.0f} ms")
    print(f"  load_rules + compile_rules, cold   {cold * 1e3:8.0f} ms  "
          f"({cold / inventory_s:.2f}x the yardstick)")
    print(f"  load_rules + compile_rules, median {median * 1e3:8.0f} ms  "
          f"({median / inventory_s:.2f}x the yardstick; "
          f"{args.repeat} runs {min(warm) * 1e3:.0f}-{max(warm) * 1e3:.0f} ms)")
    print(f"  tracemalloc peak during a compile  {traced_peak / 2**20:8.0f} MiB")
    print(f"  process peak RSS                   {rss_after / 2**20:8.0f} MiB "
          f"({rss_before / 2**20:.0f} MiB before compiling: imports and the inventory)")
    worst = max(cold, median)
    time_ok = worst < 3.0
    mem_ok = traced_peak < GIB and rss_after < GIB
    print(f"  goal: compile under 3 s -> {'meets' if time_ok else 'MISSES'} "
          f"(cold {cold:.2f} s, median {median:.2f} s)")
    print(f"  goal: memory under 1 GiB -> {'meets' if mem_ok else 'MISSES'} "
          f"(tracemalloc {traced_peak / GIB:.2f} GiB, peak RSS {rss_after / GIB:.2f} GiB)")


if __name__ == "__main__":
    main()
