"""Tiny real checkpoints, written the one way the suite writes them: tensors in a safetensors file
of a folder, with a config.json when the test gives one."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path


def tiny_checkpoint(folder, tensors: Mapping, config: Mapping | None = None, *,
                    file: str = "model.safetensors", metadata: Mapping[str, str] | None = None) -> Path:
    """Save `tensors` as `folder/file` (safetensors, `metadata` in its header) and `config` as
    `folder/config.json` (none written without it); the folder is made if missing. Returns it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(folder / file), metadata=dict(metadata) if metadata is not None else None)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def dcp_chunk(folder, file: str, tensors: Mapping, offsets: Mapping[str, list[int]]) -> Path:
    """One file of chunks as torch's HuggingFaceStorageWriter(save_distributed=True) writes it: the
    tensors, each with the offset of its chunk in the whole tensor (`offsets`)."""
    info = json.dumps({k: {"saved_offsets": list(o)} for k, o in offsets.items()})
    return tiny_checkpoint(folder, tensors, file=file,
                           metadata={"DCP_SHARDING_INFO": info, "DCP_VERSION": "1.0", "format": "pt"})


def loaded_through(text: str, folder) -> tuple[dict, object]:
    """The runtime tensors rules given as text (`remap 1` prepended) make from the checkpoint in
    `folder`, filled by remapdsl.load (NaN where nothing was read), and the rules."""
    import torch

    import remapdsl
    from remapdsl.language import rules_from_text

    rules = rules_from_text("remap 1\n" + text, "t.remap")
    compiled = remapdsl.compile_rules(rules, folder, {})
    state = {d.runtime_key: torch.full(d.shape, float("nan"), dtype=getattr(torch, d.dtype))
             for d in compiled.runtime_tensors}
    remapdsl.load(state, folder, rules, config={})
    return state, rules
