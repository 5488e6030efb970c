"""The shipped rule library (`remapdsl/rules/*.remap` in the wheel, `rules/` in the source tree): names ->
rule files, a checkpoint's config.json -> the one file that fits (`auto`), and each file's leading comment
block -> what it converts (free text), then the `# key: value` lines that `remapdsl rules` and `auto` read:

    # model_type: llama, mistral      config.json model_types it loads (what `auto` matches)
    # architectures: LlamaForCausalLM config.json architectures it loads (also matched)
    # quantization: fp8               the config's quantization_config.quant_method it expects
    # auto: no                        never chosen by `auto` (a second layout: name it)
    # verified: tests/test_x.py (...)  a test that proves it right (a line each)
"""

from __future__ import annotations

import difflib
import itertools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..errors import Diagnostic, RemapError

AUTO = "auto"  # the rules name that picks a shipped file from the checkpoint's config.json
SUFFIX = ".remap"
_FIELDS = ("model_type", "architectures", "quantization", "auto", "verified")

_LIBRARY_LOCATIONS = (
    Path(__file__).parent.parent / "rules",  # installed wheel (force-included by pyproject.toml)
    Path(__file__).parent.parent.parent / "rules",  # source tree, editable install
)


class ShippedRules(BaseModel):
    """One shipped rule file and what its header says about it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    path: str  # relative to the working folder when inside it
    converts: str  # the header's prose, lines kept
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    quantization: str | None = None
    auto: bool = True
    verified: tuple[str, ...] = ()  # `path` or `path::test`, then what it checks

    @property
    def summary(self) -> str:
        """The header's first sentence, on one line (its diagrams left out)."""
        lines = itertools.takewhile(lambda line: line and not line.startswith(" "), self.converts.splitlines())
        return re.split(r"(?<=\.)\s", " ".join(lines), maxsplit=1)[0].rstrip(":")


def library_folder() -> Path | None:
    """The folder of the shipped rule files (None if the installation has lost it)."""
    for location in _LIBRARY_LOCATIONS:
        if location.is_dir():
            return location.resolve()
    return None


def shipped_rules() -> tuple[ShippedRules, ...]:
    """Every shipped rule file, by name."""
    folder = library_folder()
    if folder is None:
        return ()
    return tuple(_describe(path) for path in sorted(folder.glob(f"*{SUFFIX}")))


def shipped_names() -> tuple[str, ...]:
    return tuple(entry.name for entry in shipped_rules())


def is_name(text: str) -> bool:
    """A bare name (`qwen3_moe`), not a path: no folder, no `.remap` suffix."""
    return bool(text) and "/" not in text and os.sep not in text and not text.endswith(SUFFIX) and text != "."


def shipped_path(name: str) -> Path | None:
    """The shipped file a bare name names, or None."""
    folder = library_folder()
    if folder is None or not is_name(name):
        return None
    path = folder / f"{name}{SUFFIX}"
    return Path(display_path(path)) if path.is_file() else None


def shipped_layout_path(name: str) -> Path | None:
    """The shipped layout plan (`layouts/NAME.json` beside the rule files) a bare name names, or None."""
    folder = library_folder()
    if folder is None or not is_name(name):
        return None
    path = folder / "layouts" / f"{name}.json"
    return path if path.is_file() else None


def names_hint(name: str) -> str:
    """`did you mean ...?` (when one is close) and the shipped names, for a name that is none."""
    names = shipped_names()
    close = difflib.get_close_matches(name, names, n=1)
    listed = ", ".join(names) if names else "none (the installation has no rules folder)"
    return (f"did you mean `{close[0]}`? " if close else "") + f"shipped rule files: {listed}"


def resolve_rules_path(rules: str | os.PathLike) -> str | os.PathLike:
    """A rules argument -> the file to read: an existing path as given, else the shipped file of a
    bare name; anything else is an error (E146) that lists the shipped names."""
    text = os.fspath(rules)
    if text == AUTO and not Path(text).is_file():
        raise RemapError(Diagnostic(
            code="E148", message="`auto` picks the rule file from a checkpoint's config.json, and there "
            "is no checkpoint here", hint="pass a checkpoint (`--checkpoint DIR`), or name the rules: "
            + names_hint(text)))
    if Path(text).is_file() or not is_name(text):
        return rules
    found = shipped_path(text)
    if found is None:
        raise RemapError(Diagnostic(
            code="E146", message=f"`{text}` is neither a rule file nor the name of a shipped one",
            hint=names_hint(text)))
    return found


def choose_rules(config: Mapping[str, Any]) -> tuple[ShippedRules, str]:
    """The one shipped file that fits a model config (by `model_type`, else `architectures`, then
    the quantization method), and why, in words; E147 listing the candidates when none or several fit."""
    model_type = config.get("model_type")
    architectures = tuple(a for a in config.get("architectures") or () if isinstance(a, str))
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    library = [entry for entry in shipped_rules() if entry.auto]
    by_type = [e for e in library if model_type in e.model_types]
    by_arch = [e for e in library if set(architectures) & set(e.architectures)]
    matched, how = (by_type, f"model_type `{model_type}`") if by_type else (
        by_arch, f"architectures {', '.join(architectures)}")
    fits = [e for e in matched if e.quantization == method]
    quantization = f", quantization `{method}`" if method else ""
    described = (f"model_type `{model_type}`" + (f", architectures {', '.join(architectures)}" if architectures
                                                 else "") + quantization)
    if len(fits) == 1:
        return fits[0], how + quantization
    candidates = "; ".join(f"{e.name} ({', '.join(e.model_types) or '-'}"
                           + (f", {e.quantization}" if e.quantization else "") + ")" for e in library)
    if fits:
        message = f"several shipped rule files fit {described}: {', '.join(e.name for e in fits)}"
        hint = "name one of them instead of `auto`"
    else:
        message = f"no shipped rule file fits {described}"
        known = sorted({t for e in library for t in e.model_types})
        close = difflib.get_close_matches(str(model_type), known, n=1)
        hint = ((f"did you mean model_type `{close[0]}`? " if close and close[0] != model_type else "")
                + f"candidates: {candidates}; or write a rule file and pass its path")
    raise RemapError(Diagnostic(code="E147", message=message, hint=hint))


def display_path(path: Path) -> str:
    """A path as people read it in messages: relative to the working folder when inside it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return str(path)
    return relative if not relative.startswith("..") else str(path)


def _describe(path: Path) -> ShippedRules:
    """A shipped file's leading comment block -> its description and fields."""
    prose: list[str] = []
    fields: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line[2:] if line.startswith("# ") else line[1:]
        key, _, value = text.partition(":")
        if key in _FIELDS and value.strip():  # a repeated field adds to the list
            fields[key] = f"{fields[key]}; {value.strip()}" if key in fields else value.strip()
        else:
            prose.append(text.rstrip())

    def listed(key: str, separator: str = ",") -> tuple[str, ...]:
        return tuple(v.strip() for v in fields.get(key, "").split(separator) if v.strip())

    return ShippedRules(name=path.stem, path=display_path(path), converts="\n".join(prose).strip("\n"),
                        model_types=listed("model_type"), architectures=listed("architectures"),
                        quantization=fields.get("quantization"), auto=fields.get("auto", "yes") != "no",
                        verified=listed("verified", "; "))
