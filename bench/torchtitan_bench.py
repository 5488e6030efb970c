"""torchtitan benchmark: a legacy per-expert Qwen3-MoE checkpoint into torchtitan's grouped experts, 2 ranks.

The checkpoint (written once, cached under bench/out/torchtitan_qwen3_moe/, git-ignored): Qwen3-MoE
Hugging Face keys, one tensor per expert and projection, bf16 random values under a fixed seed, tiny
hidden sizes but many experts and layers (default 12 layers x 128 experts, hidden 256, expert
intermediate 128: 4,716 tensors, ~0.31 GB, ~50 MB files with `model.safetensors.index.json`).

Two gloo ranks on a 1-D mesh of 2 hold DTensors shaped as torchtitan's Qwen3Model state dict: the
grouped experts `moe.routed_experts.inner_experts.{w1_EFD,w3_EFD,w2_EDF}` Shard(0) (whole experts,
expert parallel), the other matrices Shard(0), norms replicated; allocated and zeroed before each
timing. Both modes run the steps torchtitan's CheckpointManager.dcp_load runs before
`model.load_state_dict`, timed between two barriers, each rank one intra-op thread (as torchrun):

    rules       RuleStateDictAdapter.with_rules("torchtitan_qwen3"): to_hf (compiles the rules),
                dcp.load(storage_reader=adapter.get_hf_storage_reader(folder)) (a RuleStorageReader:
                each rank reads its experts' bytes straight into its DTensor shards), from_hf.
    torchtitan  torchtitan 0.3.0's Qwen3StateDictAdapter: to_hf (splits the grouped DTensors into
                per-expert local tensors), dcp.load(storage_reader=HuggingFaceStorageReader(folder)),
                from_hf (stacks the experts back into DTensors).

One untimed call of each first (one-off costs: the rule grammar's parser, torch's lazy imports),
then `--repeats` rounds alternating which mode goes first; medians. The first round checks that both
leave every rank with the same local shards, bit for bit. Goal: torchtitan median / rules median >= 3.
Rank 0 warms the files (reads them through) before each timing: both modes read from the page cache.
Each round's figure is the slower rank's; the rules mode also prints where its time goes.

    python bench/torchtitan_bench.py [--layers 12] [--experts 128] [--repeats 3] [--rebuild]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "out"
SEED = 0
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MOE_INTER, VOCAB, TOP_K = 256, 4, 2, 64, 128, 4096, 8
FILE_BYTES = 50 * 2**20
GOAL = 3.0
MODES = ("rules", "torchtitan")


def hf_config(layers: int, experts: int) -> dict:
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": HIDDEN,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "num_hidden_layers": layers, "num_experts": experts, "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": MOE_INTER, "intermediate_size": 4 * HIDDEN, "vocab_size": VOCAB,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "dtype": "bfloat16"}


def hf_shapes(layers: int, experts: int) -> dict[str, tuple[int, ...]]:
    """Every key of the checkpoint and its shape, in the order a transformers save writes them."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for L in range(layers):
        p = f"model.layers.{L}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                       p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
                       p + "mlp.gate.weight": (experts, HIDDEN)})
        for e in range(experts):
            shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (MOE_INTER, HIDDEN),
                           p + f"mlp.experts.{e}.up_proj.weight": (MOE_INTER, HIDDEN),
                           p + f"mlp.experts.{e}.down_proj.weight": (HIDDEN, MOE_INTER)})
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def write_checkpoint(folder: Path, layers: int, experts: int) -> None:
    """The checkpoint, in files of about FILE_BYTES with an index, and its config.json."""
    from safetensors.torch import save_file

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(SEED)
    groups, current, size = [], {}, 0
    for key, shape in hf_shapes(layers, experts).items():
        current[key] = torch.randn(shape, generator=gen).to(torch.bfloat16)
        size += current[key].numel() * 2
        if size >= FILE_BYTES:
            groups.append(current)
            current, size = {}, 0
    groups += [current] if current else []
    weight_map, total = {}, 0
    for i, tensors in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * 2 for t in tensors.values())
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(hf_config(layers, experts), indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def titan_config(hf: dict):
    """torchtitan's Qwen3Model config of the checkpoint's sizes (what its adapter reads)."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm

    layers = qwen3._build_qwen3_moe_layers(
        n_layers=hf["num_hidden_layers"], dim=HIDDEN, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        moe_hidden_dim=MOE_INTER, num_experts=hf["num_experts"], top_k=TOP_K, attn_backend="flex",
        moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=4096, theta=1e6))
    return qwen3.Qwen3Model.Config(dim=HIDDEN, vocab_size=VOCAB, layers=layers, norm=RMSNorm.Config(normalized_shape=HIDDEN),
                                   tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN),
                                   lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB))


def titan_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """torchtitan's state-dict keys and shapes of the checkpoint (what the model holds and loads)."""
    experts, shapes = hf["num_experts"], {}
    for key, shape in hf_shapes(hf["num_hidden_layers"], experts).items():
        parts = key.split(".")
        if "experts" in parts:
            if parts[5] == "0":
                name = {"gate_proj": "w1_EFD", "up_proj": "w3_EFD", "down_proj": "w2_EDF"}[parts[6]]
                shapes[f"layers.{parts[2]}.moe.routed_experts.inner_experts.{name}"] = (experts, *shape)
            continue
        shapes[_titan_key(key)] = shape
    return shapes


def _titan_key(key: str) -> str:
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "lm_head.weight"}
    if key in top:
        return top[key]
    _, _, layer, rest = key.split(".", 3)
    rest = {"input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
            "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
            "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
            "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
            "self_attn.q_norm.weight": "attention.q_norm.weight", "self_attn.k_norm.weight": "attention.k_norm.weight",
            "mlp.gate.weight": "moe.router.gate.weight"}[rest]
    return f"layers.{layer}.{rest}"


# -- on the ranks ----------------------------------------------------------------------------------------


def _destinations(shapes: dict, mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def placement(shape):
        return Replicate() if len(shape) == 1 else Shard(0)

    return {k: distribute_tensor(torch.zeros(s, dtype=torch.bfloat16), mesh, [placement(s)]) for k, s in shapes.items()}


def _load_rules(folder: str, state: dict, phases: list) -> dict:
    """The rules' load; appends (seconds in to_hf, which opens the reader and compiles the rules;
    seconds of the reader's read_data) to `phases`."""
    import torch.distributed.checkpoint as dcp

    from remapdsl.torchtitan import RuleStateDictAdapter

    start = time.perf_counter()
    adapter = RuleStateDictAdapter.with_rules("torchtitan_qwen3")(None, folder)
    hf_state = adapter.to_hf(state)
    opened = time.perf_counter() - start
    reader = adapter.get_hf_storage_reader(folder)
    dcp.load(hf_state, storage_reader=reader)
    phases.append((opened, reader.report.seconds))
    return adapter.from_hf(hf_state)


def _load_torchtitan(folder: str, state: dict, config) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    adapter = Qwen3StateDictAdapter(config, folder)
    hf_state = adapter.to_hf(state)
    dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(folder))
    return adapter.from_hf(hf_state)


def _warm(folder: str) -> None:
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def ranks_main(rank: int, world: int, folder: str, repeats: int) -> dict:
    """On each rank: one untimed call of each mode, then `repeats` timed rounds, alternating."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    hf = json.loads((Path(folder) / "config.json").read_text())
    config, shapes = titan_config(hf), titan_shapes(hf)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    phases: list = []
    run = {"rules": lambda s: _load_rules(folder, s, phases), "torchtitan": lambda s: _load_torchtitan(folder, s, config)}
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    mismatched = None
    for round_ in range(repeats + 1):
        order = MODES if round_ % 2 == 0 else MODES[::-1]
        results = {}
        for mode in order:
            state = _destinations(shapes, mesh)
            if rank == 0:
                _warm(folder)
            dist.barrier()
            start = time.perf_counter()
            results[mode] = run[mode](state)
            dist.barrier()
            if round_:  # round 0 is the untimed first call
                seconds[mode].append(time.perf_counter() - start)
        if round_ == 1:
            a, b = results["rules"], results["torchtitan"]
            mismatched = sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(
                a[k].to_local(), b[k].to_local() if hasattr(b[k], "to_local") else b[k])]
    return {"seconds": seconds, "mismatched": mismatched, "phases": phases[1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT.parent))
    from remapdsl.testing.ranks import run_ranks

    folder = OUT / f"torchtitan_qwen3_moe_{args.layers}x{args.experts}"
    if args.rebuild or not (folder / "config.json").exists():
        start = time.perf_counter()
        write_checkpoint(folder, args.layers, args.experts)
        print(f"wrote {folder} in {time.perf_counter() - start:.1f} s")
    files = sorted(folder.glob("*.safetensors"))
    nbytes = sum(p.stat().st_size for p in files)
    count = len(hf_shapes(args.layers, args.experts))
    print(f"checkpoint: {count:,} tensors, {nbytes / 1e9:.3f} GB in {len(files)} files; 2 gloo ranks, "
          f"{args.repeats} rounds after an untimed call of each mode")
    results = run_ranks(ranks_main, 2, str(folder), args.repeats, timeout=3600)
    for rank, result in enumerate(results):
        assert result["mismatched"] == [], f"rank {rank}: the two loads differ: {result['mismatched'][:5]}"
    print("round 1: both modes leave every rank with the same local shards, bit for bit")
    medians = {}
    for mode in MODES:
        per_round = [max(r["seconds"][mode][i] for r in results) for i in range(args.repeats)]
        medians[mode] = statistics.median(per_round)
        print(f"  {mode:<11} median {medians[mode]:.3f} s  rounds {', '.join(f'{s:.3f}' for s in per_round)}")
    opened = statistics.median(p[0] for r in results for p in r["phases"])
    read = statistics.median(p[1] for r in results for p in r["phases"])
    print(f"  rules, median over ranks and rounds: {opened:.3f} s in to_hf (opening the reader: the rules "
          f"compiled, headers shared), {read:.3f} s in the reader's read_data")
    ratio = medians["torchtitan"] / medians["rules"]
    print(f"speed-up (torchtitan median / rules median): {ratio:.2f}x  goal >= {GOAL:.0f}x: "
          f"{'met' if ratio >= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
