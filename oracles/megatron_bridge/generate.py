"""Megatron-Bridge's own conversion as goldens: HF checkpoint -> the tensors each Megatron-Core rank holds.

For each case (a tiny checkpoint of tests/megatron_checkpoints.py and a tp / pp / ep placement), spawns
gloo ranks on the CPU, initializes Megatron-Core's model parallel state
(`parallel_state.initialize_model_parallel`), builds the model that Megatron-Bridge's provider builds
for the checkpoint (Transformer Engine's modules replaced by CPU stand-ins with TE's class and
parameter names: cpu_te.py), runs `AutoBridge.from_hf_pretrained(folder).load_hf_weights(model)`
unmodified, and writes what each rank's parameters and buffers then hold, keyed by Megatron's
rank-local names, to tests/goldens/megatron_bridge/CASE/rank{R}.safetensors, with a manifest.json
(versions, model config, tp / pp / ep, each rank's coordinates, and how `export_hf_weights` of that
model compares with the checkpoint, key by key).

Run with Python 3.12 in its own venv (megatron-bridge needs Python >= 3.12):

    /root/.pyenv/versions/3.12.1/bin/python -m venv /work/venvs/megatron
    /work/venvs/megatron/bin/pip install torch==2.13.0
    /work/venvs/megatron/bin/pip install --no-deps megatron-bridge==0.6.2 megatron-core==0.19.2
    /work/venvs/megatron/bin/pip install transformers==5.12.1 safetensors omegaconf einops
    /work/venvs/megatron/bin/python oracles/megatron_bridge/generate.py          # every case
    /work/venvs/megatron/bin/python oracles/megatron_bridge/generate.py llama_tp2  # some

from the repository root. Rerun it when a version changes; the goldens are rewritten in place.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GOLDENS = REPO / "tests" / "goldens" / "megatron_bridge"
sys.path[:0] = [str(HERE), str(REPO / "tests")]


@dataclass(frozen=True)
class Case:
    name: str
    checkpoint: str  # a name of tests/megatron_checkpoints.py
    tp: int = 1
    pp: int = 1
    ep: int = 1
    experts: str = "grouped"  # MoE: "grouped" (TEGroupedMLP, weight{i}) or "sequential" (local_experts.{i})
    export: bool = True  # compare export_hf_weights with the checkpoint

    @property
    def world(self) -> int:
        return self.tp * self.pp * max(1, self.ep // self.tp) if self.ep > 1 else self.tp * self.pp


CASES = {c.name: c for c in [
    Case("llama_tp1", "llama"),
    Case("llama_tp2", "llama", tp=2),
    Case("llama_pp2", "llama", pp=2),
    Case("qwen3_tp1", "qwen3"),
    Case("qwen3_tp2", "qwen3", tp=2),
    Case("qwen3_moe_tp1", "qwen3_moe"),
    Case("qwen3_moe_tp2", "qwen3_moe", tp=2),
    Case("qwen3_moe_ep2", "qwen3_moe", ep=2),
    Case("qwen3_moe_seq_tp1", "qwen3_moe", experts="sequential"),
    Case("qwen3_moe_seq_ep2", "qwen3_moe", ep=2, experts="sequential"),
    Case("deepseek_v3_tp1", "deepseek_v3"),
    Case("deepseek_v3_tp2", "deepseek_v3", tp=2),
    Case("deepseek_v3_ep2", "deepseek_v3", ep=2),
    Case("deepseek_v3_fp8_tp1", "deepseek_v3_fp8"),
]}


# ------------------------------------------------------------------------------------------- ranks


def _rank_main(rank: int, case: Case, folder: str, out: str, rendezvous: str) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(case.world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=case.world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        result = _convert(rank, case, folder)
    except BaseException:  # noqa: BLE001 - reported by the parent
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _convert(rank: int, case: Case, folder: str) -> dict:
    import cpu_te
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    AutoBridge = cpu_te.import_bridge()
    cpu_te.install()
    # The bridge moves replicated tensors to `torch.cuda.current_device()` before broadcasting them over
    # the TP group; here the device is the CPU (gloo carries CPU tensors).
    torch.cuda.current_device = lambda: torch.device("cpu")
    import transformers
    from megatron.core import parallel_state

    transformers.logging.set_verbosity_error()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=case.tp,
                                             pipeline_model_parallel_size=case.pp,
                                             expert_model_parallel_size=case.ep)
    bridge = AutoBridge.from_hf_pretrained(folder, torch_dtype=torch.bfloat16)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = case.tp
    provider.pipeline_model_parallel_size = case.pp
    provider.expert_model_parallel_size = case.ep
    provider.expert_tensor_parallel_size = case.tp if case.ep == 1 else 1
    provider.sequence_parallel = False
    provider.params_dtype = torch.bfloat16
    provider.bf16 = True
    provider.perform_initialization = False
    # Kernel fusions of the forward pass need TE or CUDA; they change no parameter.
    for fusion in ("gradient_accumulation_fusion", "moe_permute_fusion", "apply_rope_fusion", "bias_activation_fusion",
                   "masked_softmax_fusion", "persist_layer_norm", "bias_dropout_fusion", "cross_entropy_loss_fusion"):
        setattr(provider, fusion, False)
    if getattr(provider, "num_moe_experts", None):
        provider.moe_grouped_gemm = case.experts == "grouped"
        # alltoall makes a CUDA stream, and so does overlapping the shared experts; neither holds parameters.
        provider.moe_token_dispatcher_type = "allgather"
        provider.moe_shared_expert_overlap = False
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True, bf16=True,
                                               mixed_precision_wrapper=None)
    bridge.load_hf_weights(model)

    held = {}
    for chunk in model:
        for name, tensor in chunk.state_dict(keep_vars=False).items():
            if tensor is None or not isinstance(tensor, torch.Tensor) or name.endswith("._extra_state"):
                continue
            held[name] = tensor.detach().contiguous().clone()
    nan = sorted(k for k, v in held.items() if v.is_floating_point() and bool(v.isnan().any()))
    coords = {"tp": parallel_state.get_tensor_model_parallel_rank(),
              "pp": parallel_state.get_pipeline_model_parallel_rank(),
              "ep": parallel_state.get_expert_model_parallel_rank(),
              "etp": parallel_state.get_expert_tensor_parallel_rank(),
              "dp": parallel_state.get_data_parallel_rank()}
    result = {"rank": rank, "coordinates": coords, "keys": sorted(held), "unwritten": nan,
              "tensors": {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in sorted(held.items())}}
    save_file(held, os.path.join(folder, f"rank{rank}.safetensors"))

    if case.export:
        exported = {}
        for name, tensor in bridge.export_hf_weights(model, cpu=True, show_progress=False):
            exported[name] = tensor.detach().clone()
        if rank == 0:
            original = load_file(os.path.join(folder, "model.safetensors"))
            compare = {}
            for key in sorted(set(original) | set(exported)):
                if key not in exported:
                    compare[key] = "not exported"
                elif key not in original:
                    compare[key] = "exported, not in the checkpoint"
                elif exported[key].dtype != original[key].dtype or exported[key].shape != original[key].shape:
                    compare[key] = (f"exported as {exported[key].dtype} {list(exported[key].shape)}, stored "
                                    f"{original[key].dtype} {list(original[key].shape)}")
                else:
                    compare[key] = "equal" if torch.equal(exported[key], original[key]) else "values differ"
            result["export"] = compare
    dist.barrier()
    return result


# ------------------------------------------------------------------------------------------ parent


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("megatron-bridge", "megatron-core", "transformers", "torch", "safetensors")}


def check_layout_against_transformers(name: str, folder: Path) -> None:
    """The checkpoint's keys and shapes are those transformers' model has (its MTP layer aside)."""
    import torch
    from megatron_checkpoints import checkpoint_shapes
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = {k: shape for k, (shape, _) in checkpoint_shapes(name).items()}
    n = getattr(config, "num_hidden_layers", 0)
    ours = {k: s for k, s in ours.items() if not k.startswith(f"model.layers.{n}.")}  # the MTP layer
    # transformers 5 holds experts stacked in memory; save_pretrained writes them per expert again.
    want = {k: s for k, s in want.items() if ".mlp.experts." not in k}
    ours_cmp = {k: s for k, s in ours.items() if ".mlp.experts." not in k}
    if want != ours_cmp:
        raise SystemExit(f"{name}: keys or shapes differ from transformers': only ours "
                         f"{sorted(set(ours_cmp) - set(want))[:8]}, only theirs {sorted(set(want) - set(ours_cmp))[:8]}, "
                         f"shapes {[(k, ours_cmp[k], want[k]) for k in want if k in ours_cmp and ours_cmp[k] != want[k]][:8]}")


def run_case(case: Case) -> dict:
    import torch.multiprocessing as mp
    from megatron_checkpoints import checkpoint_config, write_checkpoint

    with tempfile.TemporaryDirectory(prefix=f"mb-{case.name}-") as tmp:
        folder = Path(tmp) / "hf"
        write_checkpoint(case.checkpoint, folder)
        base = case.checkpoint.removesuffix("_fp8")
        check_layout_against_transformers(base, folder if base == case.checkpoint else
                                          write_checkpoint(base, Path(tmp) / "base"))
        mp.start_processes(_rank_main, args=(case, str(folder), tmp, str(Path(tmp) / "rendezvous")),
                           nprocs=case.world, join=True, start_method="spawn")
        results = [json.loads((Path(tmp) / f"result{r}.json").read_text()) for r in range(case.world)]
        errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
        if errors:
            raise SystemExit(f"{case.name} failed\n" + "\n".join(errors))
        target = GOLDENS / case.name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for r in range(case.world):
            shutil.copy(folder / f"rank{r}.safetensors", target / f"rank{r}.safetensors")
    manifest = {
        "case": case.name, "checkpoint": case.checkpoint, "config": checkpoint_config(case.checkpoint),
        "versions": versions(), "world": case.world, "tp": case.tp, "pp": case.pp, "ep": case.ep,
        "experts": case.experts,
        "ranks": [{k: res[k] for k in ("rank", "coordinates", "tensors", "unwritten")} for res in results],
        "export": results[0].get("export"),
    }
    (target / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"case names (default: all): {', '.join(CASES)}")
    args = parser.parse_args(argv)
    for name in args.cases or list(CASES):
        manifest = run_case(CASES[name])
        unwritten = sorted({k for r in manifest["ranks"] for k in r["unwritten"]})
        export = manifest["export"] or {}
        kinds: dict[str, int] = {}
        for verdict in export.values():
            kind = "exported in another dtype or shape" if verdict.startswith("exported as") else verdict
            kinds[kind] = kinds.get(kind, 0) + 1
        print(f"{name}: {manifest['world']} ranks, {len(manifest['ranks'][0]['tensors'])} tensors on rank 0; "
              f"unwritten {unwritten}; export: {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
