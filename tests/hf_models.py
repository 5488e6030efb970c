"""Tiny random Hugging Face models, saved as checkpoints: the oracle for remapdsl's loader.

Each case builds a model with ``AutoModelForCausalLM.from_config`` under a fixed seed, overwrites every
floating parameter and persistent buffer with distinct random values (from_config leaves norms at 1
and biases at 0, which would let a wrong mapping pass an equality check), and saves it with
``save_pretrained`` (default settings: the original per-expert layout, safetensors). The model's
``state_dict()`` is the in-memory layout a rule file must reproduce bit for bit.

Layouts and the config keys used here are recorded in the research notes (transformers 5.23.0):
saved keys equal state-dict keys except that MoE experts are one tensor per expert on disk and
stacked (gate/up fused) in memory, Mixtral renames ``block_sparse_moe.`` to ``mlp.``, and a tied
``lm_head.weight`` is in the state dict but not in the checkpoint.

transformers is imported lazily so that importing this module costs nothing; callers skip when it
is absent (``pytest.importorskip("transformers")``).
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
_DSV3 = dict(
    _COMMON,
    num_hidden_layers=3,
    num_key_value_heads=4,
    intermediate_size=32,
    moe_intermediate_size=24,
    first_k_dense_replace=1,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
)
_QWEN3_MOE = dict(
    _COMMON,
    num_hidden_layers=2,
    head_dim=16,
    intermediate_size=32,
    moe_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
)


@dataclass(frozen=True)
class Case:
    """One checkpoint to build: a model type, its config, the rule file that loads it."""

    name: str
    model_type: str
    config: dict
    rules: str  # path relative to the repository root
    dtype: torch.dtype = torch.float32
    max_shard_size: str | None = None  # None: save_pretrained's default (one file, no index)
    fp32_keys: tuple[str, ...] = field(default=())  # buffer names kept in float32 (mixed-dtype checkpoints)

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))


CASES: dict[str, Case] = {
    c.name: c
    for c in [
        Case("llama", "llama", dict(_COMMON, num_hidden_layers=2, intermediate_size=32), "rules/llama.remap"),
        Case(
            "llama_tied",
            "llama",
            dict(_COMMON, num_hidden_layers=2, intermediate_size=32, tie_word_embeddings=True),
            "rules/llama.remap",
        ),
        Case("qwen3_moe", "qwen3_moe", dict(_QWEN3_MOE), "rules/qwen3_moe.remap"),
        # Layer 0 dense (mlp.{gate,up,down}_proj), layer 1 MoE: exercises the optional dense rule.
        Case(
            "qwen3_moe_dense0",
            "qwen3_moe",
            dict(_QWEN3_MOE, mlp_only_layers=[0]),
            "rules/qwen3_moe.remap",
        ),
        # 12 experts (experts.10 must follow experts.9, not experts.1) saved in ~40 KB shards with an
        # index, so one layer's experts are spread over several files.
        Case(
            "qwen3_moe_12e_sharded",
            "qwen3_moe",
            dict(_QWEN3_MOE, num_experts=12),
            "rules/qwen3_moe.remap",
            max_shard_size="40KB",
        ),
        Case(
            "mixtral",
            "mixtral",
            dict(_COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
            "rules/mixtral.remap",
        ),
        Case(
            "qwen2_moe",
            "qwen2_moe",
            dict(
                _COMMON,
                num_hidden_layers=2,
                intermediate_size=32,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
            ),
            "rules/qwen2_moe.remap",
        ),
        Case("deepseek_v3", "deepseek_v3", dict(_DSV3), "rules/deepseek_v3.remap"),
        Case("deepseek_v3_no_q_lora", "deepseek_v3", dict(_DSV3, q_lora_rank=None), "rules/deepseek_v3.remap"),
        # bfloat16, with the router's score-correction bias kept in float32 as a real release re-saved
        # by transformers has it (_keep_in_fp32_modules_strict): a mixed BF16 + F32 checkpoint.
        Case(
            "deepseek_v3_bf16",
            "deepseek_v3",
            dict(_DSV3),
            "rules/deepseek_v3.remap",
            dtype=torch.bfloat16,
            fp32_keys=("e_score_correction_bias",),
        ),
    ]
}


@dataclass(frozen=True)
class Built:
    """A saved checkpoint and the in-memory state dict it must load into."""

    case: Case
    folder: Path
    state_dict: Mapping[str, torch.Tensor]


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def build(case: Case, folder: Path, seed: int = 0) -> Built:
    """Build ``case``'s model, randomize it, save it to ``folder``; returns the folder and state dict.

    The global torch RNG is left as it was (fork_rng), so building does not perturb other tests.
    """
    _quiet_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    # A fresh config every time: from_config(cfg, dtype=...) mutates cfg.dtype.
    cfg = AutoConfig.for_model(case.model_type, **copy.deepcopy(case.config))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=case.dtype)
    model.eval()

    # Keep the named buffers in float32 (assigning to a registered buffer name keeps it persistent).
    for module in model.modules():
        for name in case.fp32_keys:
            buf = module._buffers.get(name)
            if buf is not None:
                setattr(module, name, buf.to(torch.float32))

    # Distinct random values everywhere (each tensor gets its own draw from one generator).
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for value in model.state_dict(keep_vars=True).values():
            if value.is_floating_point():
                value.copy_(torch.randn(value.shape, generator=gen, dtype=torch.float32).to(value.dtype))

    folder = Path(folder)
    kwargs = {} if case.max_shard_size is None else {"max_shard_size": case.max_shard_size}
    # transformers 5 writes safetensors only (there is no safe_serialization switch any more).
    model.save_pretrained(folder, **kwargs)
    assert safetensors_files(folder), f"save_pretrained wrote no .safetensors in {folder}"
    return Built(case, folder, model.state_dict())


class ModelFactory:
    """Builds each case at most once, under ``root`` (a pytest session-scoped tmp folder)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._built: dict[str, Built] = {}

    def __call__(self, name: str) -> Built:
        if name not in self._built:
            self._built[name] = build(CASES[name], self.root / name)
        return self._built[name]


# -- reading checkpoints back (for byte accounting and negative tests) ------------------------------


def safetensors_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def safetensors_header(path: Path) -> dict:
    """The JSON header of one .safetensors file (key -> dtype, shape, data_offsets; plus __metadata__)."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


def checkpoint_tensor_bytes(folder: Path) -> dict[str, int]:
    """Byte size of every tensor stored in the checkpoint folder, by key."""
    sizes: dict[str, int] = {}
    for path in safetensors_files(folder):
        for key, info in safetensors_header(path).items():
            if key == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            assert key not in sizes, f"{key} stored twice"
            sizes[key] = end - begin
    return sizes


def copy_checkpoint(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint to ``dst``, passing its tensors through ``edit(dict) -> dict``."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    files = safetensors_files(src)
    assert [f.name for f in files] == ["model.safetensors"], files
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    tensors = edit(load_file(files[0]))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# -- quantized releases made from the tiny models ----------------------------------------------------


def is_fp8_quantized(key: str) -> bool:
    """The weights DeepSeek-V3's release stores in FP8: every linear projection (not the embedding,
    norms, router or lm_head)."""
    return key.endswith("_proj.weight") or key.endswith("kv_a_proj_with_mqa.weight")


def fp8_release(src: Path, dst: Path, block: tuple[int, int]) -> Path:
    """A copy of a single-file checkpoint as a DeepSeek-style FP8 release: each projection as E4M3
    values plus float32 `weight_scale_inv` per block, and `quantization_config` in config.json."""
    from quant_reference import quantize_fp8_block

    def edit(tensors):
        out = {}
        for key, value in tensors.items():
            if is_fp8_quantized(key):
                out[key], out[key.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8_block(value, block)
            else:
                out[key] = value
        return out

    copy_checkpoint(src, dst, edit)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                     "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


GPT_OSS = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=128)


def gpt_oss_mxfp4_release(folder: Path, seed: int = 0) -> Path:
    """A tiny random gpt-oss saved as the MXFP4 release is: experts as `*_blocks` / `*_scales`,
    output dim first; everything else bf16 in the in-memory layout."""
    from quant_reference import quantize_mxfp4
    from safetensors.torch import save_file

    _quiet_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", **GPT_OSS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1000 + seed)
    tensors = {}
    for key, value in model.state_dict().items():
        value = torch.randn(value.shape, generator=gen).to(torch.bfloat16)
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[key + "_blocks"], tensors[key + "_scales"] = quantize_mxfp4(value.transpose(1, 2))
        else:
            tensors[key] = value
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict()
    saved.update(dtype="bfloat16", quantization_config={"quant_method": "mxfp4"})
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    return folder


def transformers_state_dict(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What transformers' own loader makes of a (quantized) checkpoint on CPU: it dequantizes."""
    _quiet_transformers()
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.state_dict()


def wrong_rules(tmp_path, source, old: str, new: str):
    """A copy of rule file `source` under tmp_path with `old` (which it must contain) made `new`:
    a deliberately wrong rule file for tests that must see it fail."""
    text = source.read_text()
    assert old in text
    out = tmp_path / f"wrong_{source.name}"
    out.write_text(text.replace(old, new))
    return out


# -- more model families (tests/test_families.py) ----------------------------------------------------

_DENSE = dict(_COMMON, num_hidden_layers=2, intermediate_size=32)
# intermediate_size 24: the experts' gate_up_proj [E, H, 2I] is not square, so a transpose would show.
_LLAMA4 = dict(_DENSE, head_dim=16, intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4,
               num_experts_per_tok=1)

# Checkpoints of the families that tests/test_families.py verifies, keyed by case name; kept apart
# from CASES because some are loaded by several rule files (a plain layout and a `*_split` one).
FAMILY_CASES: dict[str, Case] = {
    c.name: c
    for c in [
        Case("qwen3", "qwen3", dict(_DENSE, head_dim=16), "rules/llama.remap"),
        Case("qwen3_tied", "qwen3", dict(_DENSE, head_dim=16, tie_word_embeddings=True), "rules/llama.remap"),
        Case("qwen2", "qwen2", dict(_DENSE), "rules/llama.remap"),  # q/k/v biases
        Case("mistral", "mistral", dict(_DENSE), "rules/llama.remap"),
        # Gemma ties lm_head to the embedding (the default, said here so that Case.tied knows).
        Case("gemma2", "gemma2", dict(_DENSE, head_dim=16, tie_word_embeddings=True), "rules/gemma2.remap"),
        Case("gemma3_text", "gemma3_text", dict(_DENSE, head_dim=16, tie_word_embeddings=True),
             "rules/gemma2.remap"),
        Case("phi3", "phi3", dict(_DENSE, pad_token_id=0), "rules/phi3.remap"),  # fused qkv_proj, gate_up_proj
        Case("gpt_neox", "gpt_neox", dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                          intermediate_size=32, max_position_embeddings=128), "rules/gpt_neox.remap"),
        Case("llama4_text", "llama4_text", dict(_LLAMA4), "rules/llama4_text.remap"),  # every layer MoE
        # interleave_moe_layer_step=2: layer 0 dense (feed_forward.{gate,up,down}_proj), layer 1 MoE.
        Case("llama4_text_interleaved", "llama4_text", dict(_LLAMA4, interleave_moe_layer_step=2),
             "rules/llama4_text.remap"),
    ]
}
