"""`dcp.load` through `remapdsl.dcp.RuleStorageReader` on real gloo process groups.

Every case loads the same state dict twice, through DCP's default planner with the rule reader and
through `remapdsl.load`, and the two must agree bit for bit (DTensors sharded on several dims,
replicated, 2-D meshes, and plain tensors), with each rank reading exactly the bytes `remapdsl.load`
reads for the same shards. Identity rules must also agree with DCP's own HuggingFaceStorageReader.
Errors (a key the rules do not make, a rule error, a missing checkpoint, a file gone before the
reads) must reach every rank as RemapErrors. One spawn of ranks runs many checks.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import remapdsl
from remapdsl.testing.ranks import run_ranks

pytest.importorskip("transformers")
from hf_models import CASES, build, fp8_release

ROOT = Path(__file__).resolve().parent.parent
QWEN3_MOE = str(ROOT / "examples" / "tiny-qwen3-moe")
IDENTITY = "remap 1\n{P:path} -> {P}\n"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (checkpoint folder, rules): stacking and fusing (qwen3_moe), interleaving
    (llama_fused), dequantizing (deepseek_v3_fp8 on block-FP8 values)."""
    root = tmp_path_factory.mktemp("dcp")
    llama = build(CASES["llama"], root / "llama").folder
    deepseek = build(CASES["deepseek_v3"], root / "deepseek_v3").folder
    fp8 = fp8_release(deepseek, root / "deepseek_v3_fp8", (4, 4))
    return {"qwen3_moe": (QWEN3_MOE, str(ROOT / "rules" / "qwen3_moe.remap")),
            "llama_fused": (str(llama), str(ROOT / "rules" / "llama_fused.remap")),
            "deepseek_v3_fp8": (str(fp8), str(ROOT / "rules" / "deepseek_v3_fp8.remap"))}


# ------------------------------------------------------------------------------------ on the ranks


def _placements(index: int, ndim: int, mesh_ndim: int):
    """Varied placements: tensor `index` of `ndim` dims on a mesh of `mesh_ndim` dims."""
    from torch.distributed.tensor import Replicate, Shard

    choices = [Replicate()] + [Shard(d) for d in range(ndim)]
    return [choices[(index + 2 * m + 1) % len(choices)] for m in range(mesh_ndim)]


def _dtensors(like: dict, mesh) -> dict:
    from torch.distributed.tensor import distribute_tensor

    return {k: distribute_tensor(torch.zeros_like(v), mesh, _placements(i, v.dim(), mesh.ndim))
            for i, (k, v) in enumerate(sorted(like.items()))}


def _dcp_load(state_dict: dict, reader) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state_dict, storage_reader=reader)


def _differing(got: dict, want: dict) -> list[str]:
    """Keys whose local tensors differ in a bit (or in shape or dtype)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    return [k for k in want if local(got[k]).dtype != local(want[k]).dtype
            or local(got[k]).shape != local(want[k]).shape
            or not torch.equal(local(got[k]).contiguous().view(torch.uint8),
                               local(want[k]).contiguous().view(torch.uint8))]


def _agree(rank: int, world: int, cases: dict, mesh_shape: tuple[int, ...]) -> dict:
    """Per case: DTensors and plain tensors through the rule reader equal remapdsl.load's, and
    the reader read what remapdsl.load reads for the same shards."""
    from torch.distributed.device_mesh import init_device_mesh

    from remapdsl.dcp import RuleStorageReader

    mesh = init_device_mesh("cpu", mesh_shape)
    out = {}
    for name, (folder, rules) in cases.items():
        compiled = remapdsl.compile_rules(remapdsl.load_rules(rules), remapdsl.open_checkpoint(folder), None)
        whole = compiled.empty_state_dict()
        remapdsl.load(whole, folder, rules)
        reader = RuleStorageReader(folder, rules)

        plain = {k: torch.zeros_like(v) for k, v in whole.items()}
        _dcp_load(plain, reader)
        assert _differing(plain, whole) == [], f"{name}: plain tensors differ"

        by_dcp, by_remapdsl = _dtensors(whole, mesh), _dtensors(whole, mesh)
        _dcp_load(by_dcp, reader)
        report = remapdsl.load(by_remapdsl, folder, rules)
        assert _differing(by_dcp, by_remapdsl) == [], f"{name}: DTensors differ"
        assert reader.report.bytes_read == report.bytes_read, name
        assert reader.report.bytes_owned == report.bytes_owned, name
        held = sum(t.to_local().nbytes for t in by_dcp.values())
        out[name] = {"bytes_read": reader.report.bytes_read, "held": held, "requests": reader.report.requests}
    return out


def _identity_and_errors(rank: int, world: int, folder: str, broken: str) -> dict:
    """Identity rules against HuggingFaceStorageReader; then each error case, as codes per rank."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh

    from remapdsl.dcp import RuleStorageReader, remap_errors
    from remapdsl.language import rules_from_text

    mesh = init_device_mesh("cpu", (world,))
    identity = rules_from_text(IDENTITY, "identity.remap")
    inventory = remapdsl.open_checkpoint(folder)
    like = remapdsl.compile_rules(identity, inventory, None).empty_state_dict()
    ours, theirs = _dtensors(like, mesh), _dtensors(like, mesh)
    reader = RuleStorageReader(folder, identity)
    _dcp_load(ours, reader)
    _dcp_load(theirs, HuggingFaceStorageReader(folder))
    assert _differing(ours, theirs) == [], "identity rules differ from HuggingFaceStorageReader"
    assert reader.report.bytes_read == sum(t.to_local().nbytes for t in ours.values())

    seen = {}

    def record(name, call):
        try:
            with remap_errors():
                call()
            seen[name] = None
        except remapdsl.RemapError as exc:
            seen[name] = [d.code for d in exc.diagnostics]

    misspelled = dict(ours)
    misspelled["model.layers.0.self_attn.q_proj.weigth"] = misspelled.pop("model.layers.0.self_attn.q_proj.weight")
    record("wrong key", lambda: _dcp_load(misspelled, reader))
    try:
        _dcp_load(misspelled, reader)
    except BaseException as exc:  # noqa: BLE001 - DCP's own wrapper, shown to the user as is
        seen["wrong key text"] = str(exc)
    record("rule error", lambda: RuleStorageReader(folder, rules_from_text("remap 1\n{P:path} -> \n", "bad.remap")))
    record("missing checkpoint", lambda: RuleStorageReader(folder + "-missing", identity))
    gone = RuleStorageReader(broken, identity)
    if rank == 0:
        Path(broken, "model.safetensors").unlink()
    torch.distributed.barrier()
    record("file gone before the reads", lambda: _dcp_load(dict(ours), gone))
    return seen


# ------------------------------------------------------------------------------------------ tests


def test_two_ranks_equal_remapdsl_load(checkpoints):
    results = run_ranks(_agree, 2, checkpoints, (2,))
    for name in checkpoints:
        assert results[0][name]["requests"] > 0
    for name in ("qwen3_moe", "llama_fused"):  # no quantization scales: each rank reads what it holds
        assert [r[name]["bytes_read"] for r in results] == [r[name]["held"] for r in results]


def test_four_ranks_on_a_2d_mesh_equal_remapdsl_load(checkpoints):
    run_ranks(_agree, 4, {k: checkpoints[k] for k in ("qwen3_moe", "deepseek_v3_fp8")}, (2, 2))


def test_identity_rules_equal_hf_reader_and_errors_reach_every_rank(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(QWEN3_MOE, broken)
    seen = run_ranks(_identity_and_errors, 2, QWEN3_MOE, str(broken))
    for rank in seen:
        assert rank["wrong key"] == ["E600"]
        assert "did you mean `model.layers.0.self_attn.q_proj.weight`?" in rank["wrong key text"]
        assert rank["rule error"] and rank["rule error"][0].startswith("E0")
        assert rank["missing checkpoint"] and rank["missing checkpoint"][0].startswith("E3")
        assert rank["file gone before the reads"] and rank["file gone before the reads"][0].startswith("E3")
