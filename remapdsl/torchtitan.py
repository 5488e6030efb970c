"""torchtitan's state-dict adapter protocol, driven by a rule file (docs/torchtitan.md). The storage reader
does the whole conversion, so `to_hf` and `from_hf` pass the runtime tensors through; saving is `save_hf`."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from . import save
from .dcp import RuleStorageReader
from .errors import Diagnostic, RemapError
from .language import RuleSet
from .runtime import bounds, dist

_log = logging.getLogger("remapdsl")


class AdapterError(RemapError):
    """A torchtitan checkpointer call the rules cannot serve (E610-E619)."""


def _fail(code: str, message: str, hint: str | None = None, path: str | None = None) -> AdapterError:
    return AdapterError(Diagnostic(code=code, message=message, hint=hint, path=path))


class Match(NamedTuple):
    """How a state dict met the rules at the last `to_hf`: what is loaded and what is not."""

    loaded: tuple[str, ...]  # state-dict keys the rules make: these dcp.load fills
    not_in_rules: tuple[str, ...]  # state-dict keys the rules do not make (buffers such as expert biases)
    not_in_state_dict: tuple[str, ...]  # tensors the rules make that this state dict lacks (other PP stages)


class RuleStateDictAdapter(BaseStateDictAdapter):
    """A torchtitan `BaseStateDictAdapter` whose conversion is a rule file. torchtitan makes it as
    `cls(model_config, hf_assets_path)`, so a model spec names a class with its rules bound:
    `RuleStateDictAdapter.with_rules("m.remap")`. `rules`, `config`, `strict` and `timeout` are as for
    `remapdsl.load` (rules by default the class's own); `to_hf` is a collective (it compiles the rules)."""

    default_rules: str | os.PathLike | RuleSet | None = None
    default_config: Mapping[str, Any] | None = None
    default_strict: bool = True

    def __init__(self, model_config: Any, hf_assets_path: str | os.PathLike | None, *,
                 rules: str | os.PathLike | RuleSet | None = None, config: Mapping[str, Any] | None = None,
                 strict: bool | None = None, timeout=None):
        rules = type(self).default_rules if rules is None else rules
        if rules is None:
            raise _fail("E610", "RuleStateDictAdapter was made without a rule file",
                        hint='pass rules="model.remap", or name RuleStateDictAdapter.with_rules("model.remap") '
                             "in the model spec")
        self.model_config = model_config
        self.hf_assets_path = None if hf_assets_path is None else os.fspath(hf_assets_path)
        self.rules = rules
        self.config = type(self).default_config if config is None else config
        self.strict = type(self).default_strict if strict is None else strict
        self.timeout = bounds.seconds(timeout)
        self.match: Match | None = None
        self._reader: RuleStorageReader | None = None

    @classmethod
    def with_rules(cls, rules: str | os.PathLike | RuleSet, *, config: Mapping[str, Any] | None = None,
                   strict: bool = True) -> type[RuleStateDictAdapter]:
        """A subclass with `rules` bound, to name as a torchtitan ModelSpec's `state_dict_adapter`."""
        named = rules.path if isinstance(rules, RuleSet) else os.path.basename(os.fspath(rules))
        return type(f"RuleStateDictAdapter[{named}]", (cls,),
                    {"default_rules": rules, "default_config": config, "default_strict": strict,
                     "__module__": cls.__module__})

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The tensors of `state_dict` the rules make, as they are; every rank calls it (it opens the
        reader). A tensor the rules neither make nor `keep` is E613 unless `strict=False`, one of
        another shape E614; tensors this state dict lacks are not (a pipeline stage has its layers only)."""
        entries = self._open(self.hf_assets_path).read_metadata().state_dict_metadata
        made = {k: tuple(v.size) for k, v in entries.items()}  # items(): no E600 lookups
        loaded = tuple(k for k in state_dict if k in made)
        not_in_rules = tuple(k for k in state_dict if k not in made)
        self.match = Match(loaded, not_in_rules, tuple(sorted(made.keys() - state_dict.keys())))
        with bounds.bounded(self.timeout):
            dist.together(lambda: self._check(state_dict, made, not_in_rules),
                          phase="checking the state dict against the rules")
        _log.info("torchtitan adapter: %d tensors from the rules, %d state-dict keys not made by them, "
                  "%d made but not in this state dict", len(loaded), len(not_in_rules),
                  len(self.match.not_in_state_dict))
        return {k: state_dict[k] for k in loaded}

    def _check(self, state_dict: Mapping[str, Any], made: Mapping[str, tuple[int, ...]],
               not_in_rules: tuple[str, ...]) -> None:
        """E613 / E614 for this rank's state dict (run on every rank together: one stage failing fails
        all)."""
        keep = [re.compile(p) for p in self._open(self.hf_assets_path).compiled.keep]
        unknown = [k for k in not_in_rules if not any(r.fullmatch(k) for r in keep)]
        if unknown and self.strict:
            shown = ", ".join(f"`{k}`" for k in unknown[:5])
            shown += f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise _fail("E613", f"{len(unknown)} of the state dict's {len(state_dict)} tensors are made by no rule "
                                f"and named by no `keep`: {shown}", path=self.hf_assets_path,
                        hint="is this the rule file for this model? Tensors that take nothing from the "
                             "checkpoint (buffers) belong in a `keep` statement; or pass strict=False")
        wrong = [f"`{k}` is {tuple(state_dict[k].shape)} in the model, {made[k]} from the rules"
                 for k in state_dict if k in made and tuple(state_dict[k].shape) != made[k]]
        if wrong:
            raise _fail("E614", f"{len(wrong)} tensors differ in shape between the model and the rules: "
                                + "; ".join(wrong[:5]), path=self.hf_assets_path,
                        hint="the model config and the checkpoint's config.json describe different sizes")

    def get_hf_storage_reader(self, path: str | os.PathLike, from_quantized: bool = False) -> RuleStorageReader:
        """The rule reader of `path` (`to_hf`'s for the same folder); `from_quantized` changes nothing:
        the rules' `dequantize` statements say how to read a quantized checkpoint."""
        return self._open(path)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """The tensors dcp.load filled, as they are: they are already in the runtime layout."""
        return dict(hf_state_dict)

    @property
    def fqn_to_index_mapping(self) -> dict[Any, int] | None:
        """Read by torchtitan's checkpointer only to save in the HF layout: refused (E612), use `save_hf`."""
        raise _fail("E612", "torchtitan's checkpointer cannot save through RuleStateDictAdapter in the Hugging "
                            "Face layout (last_save_in_hf): to_hf keeps the runtime layout, so its files would "
                            "hold torchtitan's tensors under Hugging Face file names",
                    path=self.hf_assets_path,
                    hint="turn off checkpoint.last_save_in_hf and, on every rank, call "
                         "adapter.save_hf(model.state_dict(), folder): the rules write the original layout, "
                         "each rank its own bytes")

    def save_hf(self, state_dict: Mapping[str, Any], folder: str | os.PathLike, **kwargs: Any):
        """Write the model back to the layout of `hf_assets_path` (remapdsl.save with `like=` and
        `kwargs`), every rank its state dict (a pipeline stage: its own layers); keys the rules do not make
        are left out."""
        made = self._open(self.hf_assets_path).read_metadata().state_dict_metadata.keys()
        runtime = {k: v for k, v in state_dict.items() if k in made}
        return save(runtime, folder, self.rules, like=self.hf_assets_path, config=self.config,
                    **{"timeout": self.timeout, **kwargs})

    def _open(self, path: str | os.PathLike | None) -> RuleStorageReader:
        """The reader of `path`, opened once per folder (every rank together)."""
        if path is None:
            raise _fail("E611", "RuleStateDictAdapter has no checkpoint folder to compile its rules against "
                                "(hf_assets_path is None)",
                        hint="set hf_assets_path in the trainer config to the Hugging Face checkpoint folder")
        path = os.fspath(path)
        reader = self._reader
        if reader is None or os.path.abspath(os.fspath(reader.checkpoint_id)) != os.path.abspath(path):
            reader = self._reader = RuleStorageReader(path, self.rules, config=self.config, strict=self.strict,
                                                      timeout=self.timeout)
        return reader
