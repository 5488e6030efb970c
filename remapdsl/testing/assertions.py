"""Properties of a rule file on a real checkpoint, asserted in this process: save(load(x)) is x byte for
byte, and a load equals a reference loader's state dict (the sharded ones: testing/ranks.py)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import remapdsl
from remapdsl.checkpoint.snapshot import require_data
from remapdsl.testing.compare import (MAX_LISTED, _listed, _state, assert_state_dicts_equal, fail_on,
                                      file_differences, key_differences)


def load_whole(rules, checkpoint, *, config: Mapping[str, Any] | None = None) -> dict:
    """The runtime state dict the rules make of a checkpoint, every tensor whole (one process)."""
    compiled = remapdsl.compile_rules(rules, checkpoint, config)
    state = compiled.empty_state_dict()
    remapdsl.load(state, checkpoint, rules, config=config)
    return state


def assert_round_trip(rules, checkpoint, *, config: Mapping[str, Any] | None = None, **save_options) -> None:
    """Assert that saving the load of a checkpoint folder gives it back: the same files, byte for byte, and
    the same index (else an AssertionError naming what differs); `save_options` go to `remapdsl.save`."""
    require_data(checkpoint, "a round trip")
    inventory = remapdsl.open_checkpoint(checkpoint)
    state = load_whole(rules, checkpoint, config=config)
    with tempfile.TemporaryDirectory(prefix="remapdsl-round-trip-") as tmp:
        out = Path(tmp) / "copy"
        remapdsl.save(state, out, rules, like=checkpoint, config=config, **save_options)
        found = round_trip_differences(inventory, out)
    fail_on(found, f"save(load(checkpoint)) differs from {os.fspath(checkpoint)}")


def round_trip_differences(inventory, out: Path) -> list[str]:
    """How a saved folder differs from the checkpoint it should reproduce: files, then the index."""
    found = file_differences(inventory, out)
    if inventory.index_file is not None:
        found.extend(_index_differences(Path(inventory.path(inventory.index_file)), out / inventory.index_file))
    return found


def _index_differences(original: Path, written: Path) -> list[str]:
    if not written.is_file():
        return [f"index `{original.name}` not written"]
    want, got = json.loads(original.read_text()), json.loads(written.read_text())
    if want == got:
        return []
    a, b = want.get("weight_map", {}), got.get("weight_map", {})
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    shown = [f"index `{original.name}`: `{k}` in {b.get(k)} (written) vs {a.get(k)} (original)" for k in keys[:MAX_LISTED]]
    return shown or [f"index `{original.name}`: metadata {got.get('metadata')} (written) vs {want.get('metadata')}"]


def transformers_state_dict(checkpoint, *, dtype: Any = "auto") -> dict:
    """The state dict transformers' `from_pretrained` makes of a checkpoint folder (on the CPU); an
    AssertionError when it reports keys missing, unexpected or mismatched."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    model, info = AutoModelForCausalLM.from_pretrained(os.fspath(checkpoint), dtype=dtype, output_loading_info=True)
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise AssertionError(f"transformers could not load {os.fspath(checkpoint)} cleanly: "
                             + "; ".join(f"{k}: {_listed(map(str, v))}" for k, v in problems.items()))
    return model.state_dict()


def assert_matches_reference(rules, checkpoint, reference: Callable[[Any], Mapping] | str, *,
                             config: Mapping[str, Any] | None = None) -> None:
    """Assert that the rules load a checkpoint into exactly what a reference loader makes of it, the catch for
    a rule that is wrong but consistent (gate and up swapped round-trips fine). `reference`: `"transformers"`
    (`from_pretrained` on the folder) or a callable taking the checkpoint and returning the state dict (or
    module) it must equal."""
    require_data(checkpoint, "a comparison with a reference")
    if reference == "transformers":
        expected = transformers_state_dict(checkpoint)
        names = ("remapdsl", "transformers")
    elif callable(reference):
        expected = _state(reference(checkpoint))
        names = ("remapdsl", "reference")
    else:
        raise TypeError(f"reference must be a callable or 'transformers', not {reference!r}")
    compiled = remapdsl.compile_rules(rules, checkpoint, config)
    made = {t.runtime_key: t for t in compiled.runtime_tensors}
    found = key_differences(made, expected, names)
    for key in sorted(set(made) & set(expected)):
        t, want = made[key], expected[key]
        if tuple(t.shape) != tuple(want.shape) or t.dtype != str(want.dtype).removeprefix("torch."):
            found.append(f"`{key}`: the rules make {t.dtype} {list(t.shape)}, {names[1]} has "
                         f"{str(want.dtype).removeprefix('torch.')} {list(want.shape)}")
    fail_on(found[:2 * MAX_LISTED], f"state dicts differ ({names[0]} vs {names[1]})")
    import torch

    target = {key: torch.empty_like(value, device="cpu") for key, value in expected.items()}
    remapdsl.load(target, checkpoint, rules, config=config)
    assert_state_dicts_equal(target, expected, names=names)
