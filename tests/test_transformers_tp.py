"""remapdsl against transformers' own tensor- and expert-parallel loader (2 gloo ranks, CPU).

In each rank transformers 5.23 loads a tiny legacy per-expert checkpoint with
``from_pretrained(folder, distributed_config=DistributedConfig(tp_size=2))`` (``ep_size=2`` added for
EP), so its parameters are DTensors on its own TP (or EP) mesh. remapdsl then fills zero DTensors with
the same mesh and placements through the shipped rule file, and every rank's local shard must equal
transformers' bit for bit. The same shards are also checked against the single-process state dict
sliced by torch's ``distribute_tensor``, so a disagreement says which side is wrong.

transformers is wrong for converters that split or permute a fused tensor along the sharded dim
(transformers' TP loading shards the fused checkpoint tensor, not each part), so the fused Llama layout (rules/llama_fused.remap: grouped qkv, gate/up block
interleave) is checked against expectations computed independently with torch ops instead.

One spawn runs every case (importing transformers in each rank is most of the cost); each case's
test reads its per-rank failures from what the ranks returned.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from gloo import CHECK_FAILURES
from hf_models import CASES as HF_CASES
from hf_models import ModelFactory

import remapdsl
from remapdsl.testing.ranks import run_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2

# case name -> (hf_models case, DistributedConfig kwargs); every case uses that model's shipped rules.
HF_TP_CASES = {
    "qwen3_moe_tp2": ("qwen3_moe", {"tp_size": 2}),
    "mixtral_tp2": ("mixtral", {"tp_size": 2}),
    "qwen3_moe_ep2": ("qwen3_moe", {"tp_size": 2, "ep_size": 2}),
    "mixtral_ep2": ("mixtral", {"tp_size": 2, "ep_size": 2}),
}
# Cases whose transformers TP load is known to fail on CPU: name -> reason (xfail, strict). None today.
KNOWN_BROKEN: dict[str, str] = {}
LLAMA_FUSED = "llama_fused_tp2"


# ------------------------------------------------------------------------------------------ worker


def _on_ranks(rank: int, world: int, jobs: dict) -> dict[str, str]:
    """Every case on this rank of the group run_ranks made (transformers joins it: the launcher's
    variables are set as torchrun sets them); case name -> its failure ("" when it holds)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.manual_seed(0)  # identical on every rank: each builds the same random model
    _allow_tp_without_accelerate()
    failures = {}
    for name, job in jobs.items():
        try:
            if name == LLAMA_FUSED:
                _llama_fused_case(job)
            else:
                _hf_case(job)
            failures[name] = ""
        except CHECK_FAILURES:  # reported by the parent, per case and rank
            failures[name] = traceback.format_exc()
        dist.barrier()  # a rank that failed early must not run ahead into the next case's collectives
    return failures


def _allow_tp_without_accelerate() -> None:
    """transformers 5.23 refuses any device map (TP sets one: cpu) unless `accelerate` is installed,
    though a single-device CPU map never calls it. Lift that gate in this worker process only."""
    import transformers
    import transformers.integrations.accelerate as hf_accelerate
    from transformers.utils import is_accelerate_available

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if not is_accelerate_available():
        hf_accelerate.is_accelerate_available = lambda: True


def _zeros_like(p: torch.Tensor) -> torch.Tensor:
    """A zero tensor placed exactly like `p` (a DTensor keeps p's mesh, placements, shape and stride)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return DTensor.from_local(torch.zeros_like(p.to_local()), p.device_mesh, p.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())
    return torch.zeros_like(p)


def _hf_case(job: dict) -> None:
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(**job["dist"])
    model = AutoModelForCausalLM.from_pretrained(job["folder"], distributed_config=config)
    params = dict(model.named_parameters())
    sharded = [k for k, p in params.items() if isinstance(p, DTensor)]
    experts = [params[k] for k in sharded if k.endswith("gate_up_proj")]
    assert experts, f"transformers sharded no experts: {sharded}"
    # TP: packed_colwise (_StridedShard(1, sf=2)); EP: grouped_gemm (whole experts, Shard(0))
    want = "Shard(dim=0)" if job["dist"].get("ep_size", 1) > 1 else "_StridedShard(dim=1, sf=2)"
    assert all(str(tuple(e.placements)) == f"({want},)" for e in experts), [e.placements for e in experts]

    zeros = {k: _zeros_like(p.detach()) for k, p in params.items()}
    remapdsl.load(zeros, job["folder"], job["rules"])

    full = load_file(job["expected"])  # the single-process in-memory state dict (built in the parent)
    wrong = []
    for k, p in params.items():
        got = zeros[k]
        if isinstance(p, DTensor):
            assert isinstance(got, DTensor) and got.device_mesh == p.device_mesh, k
            assert tuple(got.placements) == tuple(p.placements), (k, got.placements, p.placements)
            got_local, hf_local = got.to_local(), p.to_local()
            oracle = distribute_tensor(full[k], p.device_mesh, p.placements).to_local()
        else:
            got_local, hf_local, oracle = got, p.detach(), full[k]
        if not torch.equal(got_local, hf_local):
            wrong.append(f"{k}: remapdsl != transformers (remapdsl == sliced state dict: "
                         f"{torch.equal(got_local, oracle)}; "
                         f"transformers == it: {torch.equal(hf_local, oracle)})")
        elif not torch.equal(got_local, oracle):
            wrong.append(f"{k}: remapdsl == transformers, but both differ from the sliced state dict")
    assert not wrong, "\n".join(wrong)


def _llama_fused_case(job: dict) -> None:
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    src = load_file(job["checkpoint_file"])
    cfg = json.loads(Path(job["folder"], "config.json").read_text())
    nkv, inter, layers = cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    blocks = inter // 16  # BLOCK in rules/llama_fused.remap
    assert nkv == WORLD and blocks == WORLD, "each rank must own a whole group, else the case tests less"

    # The fused layout, computed independently with torch ops from the checkpoint tensors.
    expected = {"tok_embeddings.weight": src["model.embed_tokens.weight"],
                "norm.weight": src["model.norm.weight"], "output.weight": src["lm_head.weight"]}
    for L in range(layers):
        p = f"model.layers.{L}."
        q, k, v = (src[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        gate, up = src[p + "mlp.gate_proj.weight"], src[p + "mlp.up_proj.weight"]
        expected |= {
            f"layers.{L}.attn_norm.weight": src[p + "input_layernorm.weight"],
            f"layers.{L}.mlp_norm.weight": src[p + "post_attention_layernorm.weight"],
            # Megatron grouping: per KV head g, its query heads, then its k head, then its v head.
            f"layers.{L}.attn.wqkv.weight": torch.cat(
                [torch.cat([q.chunk(nkv)[g], k.chunk(nkv)[g], v.chunk(nkv)[g]]) for g in range(nkv)]),
            f"layers.{L}.attn.wo.weight": src[p + "self_attn.o_proj.weight"],
            f"layers.{L}.mlp.w13.weight": torch.cat(
                [torch.cat([gate.chunk(blocks)[i], up.chunk(blocks)[i]]) for i in range(blocks)]),
            f"layers.{L}.mlp.w2.weight": src[p + "mlp.down_proj.weight"],
        }

    def placement(key: str):
        if key.endswith("norm.weight"):
            return [Replicate()]
        if key.endswith(("attn.wo.weight", "mlp.w2.weight")):
            return [Shard(1)]  # rowwise
        return [Shard(0)]  # colwise: wqkv, w13, output; embedding_rowwise: tok_embeddings

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    targets = {k: distribute_tensor(torch.zeros_like(t), mesh, placement(k)) for k, t in expected.items()}
    remapdsl.load(targets, job["folder"], job["rules"])
    wrong = [k for k, t in expected.items()
             if not torch.equal(targets[k].to_local(), distribute_tensor(t, mesh, placement(k)).to_local())]
    assert not wrong, f"wrong local shards: {wrong}"

    # The split transformers gets wrong: a rank's wqkv rows are its own KV group (q heads, k, v), not
    # the first half of a plain cat(q, k, v), and its w13 rows are one gate block then one up block.
    rank = dist.get_rank()
    q, k, v = (src[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    naive = torch.cat([q, k, v]).chunk(WORLD)[rank]
    assert not torch.equal(targets["layers.0.attn.wqkv.weight"].to_local(), naive)


# ---------------------------------------------------------------------------------------- parent


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, str]]:
    """Build the checkpoints once, run every case in one 2-rank spawn; each rank's failures."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("hf_tp")
    factory = ModelFactory(root / "models")
    jobs: dict[str, dict] = {}
    for name, (model, dist_kwargs) in HF_TP_CASES.items():
        built = factory(model)
        expected = root / f"{model}.expected.safetensors"
        if not expected.exists():
            save_file({k: v.contiguous() for k, v in built.state_dict.items()}, expected)
        jobs[name] = {"folder": str(built.folder), "rules": str(ROOT / HF_CASES[model].rules),
                      "dist": dist_kwargs, "expected": str(expected)}
    llama = factory("llama")
    jobs[LLAMA_FUSED] = {"folder": str(llama.folder), "rules": str(ROOT / "rules" / "llama_fused.remap"),
                         "checkpoint_file": str(llama.folder / "model.safetensors")}
    return run_ranks(_on_ranks, WORLD, jobs, timeout=300)


def _failures(results: list[dict[str, str]], name: str) -> str:
    return "\n\n".join(f"rank {r}:\n{failures[name]}" for r, failures in enumerate(results) if failures[name])


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BROKEN[n])) if n in KNOWN_BROKEN else n
     for n in HF_TP_CASES],
)
def test_sharded_load_equals_transformers_parallel_load(results, name):
    failures = _failures(results, name)
    assert not failures, failures


def test_fused_llama_shards_equal_independent_expectation(results):
    failures = _failures(results, LLAMA_FUSED)
    assert not failures, failures
