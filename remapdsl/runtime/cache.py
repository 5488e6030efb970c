"""What a load keeps for the next process: each checkpoint's inventory, each compiled program and
each rank's load plan, read back when a later process is given the same inputs.

Everything a load does before its first byte (reading and checking the headers, compiling, planning)
is a pure function of its inputs, and a job restarted from the same checkpoint with the same rules
does it all again: for a small model that is most of a load's fixed cost, for DeepSeek-V3 about a
second a rank. Each result is kept under a key that holds every input it was made from:

- an inventory: the path given and, for every `*.safetensors` and `*.safetensors.index.json` entry
  of its folder, the name, size, inode, and modification and change times (a file written,
  replaced, renamed or touched since is another key; the change time cannot be set back). Files
  changed in the last two seconds are not kept at all: their times could still be those of a
  rewrite in the same clock tick;
- a compiled program: the inventory's key, each rule file's path and text, the config, strictness;
- a load plan: the compiled program's key, what this rank holds of each runtime tensor, its rank;

and each also by remapdsl's own code (`language.cache.code_version`: every source file, by size
and modification time, as Python's bytecode cache checks them, and its dependencies' versions). Nothing is kept
when a `dequantize` names a format registered by the program (its code is not remapdsl's), when a
config value is not plain JSON, or when the checkpoint is an Inventory object rather than files.
Errors are never kept: a compile that fails runs, and fails, again.

The entries are pickles, so they live only in the user's private cache folder (the parser's:
`language/cache.cache_folder`), never in a shared one; `REMAPDSL_CACHE=0` turns every cache off.
Each kind keeps its newest entries (`ENTRIES`); deleting the folder is always safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..checkpoint import Inventory, open_inventory
from ..checkpoint.inventory import INDEX_SUFFIX, SUFFIX
from ..language.cache import cache_folder, code_version

T = TypeVar("T")

SETTLED_SECONDS = 2.0  # files changed more recently than this are not kept (see _files_signature)
ENTRIES = 64  # entries kept of each kind (inventories, compiled programs, plans); the oldest go first
_log = logging.getLogger("remapdsl")


def _key(*parts: Any) -> str:
    digest = hashlib.sha256(code_version().encode())
    for part in parts:
        digest.update(b"\0" + (part if isinstance(part, bytes) else str(part).encode()))
    return digest.hexdigest()


def _folder(kind: str) -> Path | None:
    folder = cache_folder()
    return None if folder is None else folder / "loads" / kind


def _get(kind: str, key: str | None) -> Any:
    """The value kept under `key`, or None (none kept, unreadable, or not that key's)."""
    folder = None if key is None else _folder(kind)
    if folder is None:
        return None
    try:
        kept_key, value = pickle.loads((folder / f"{key[:40]}.pickle").read_bytes())
    except Exception:  # noqa: BLE001 - none yet, or a damaged entry (an interrupted writer, another version)
        return None
    if kept_key != key:
        return None
    _log.debug("remapdsl: %s read back from the cache (%s)", kind, folder)
    return value


def _put(kind: str, key: str | None, value: Any) -> None:
    """Keep `value` under `key` (best effort: a cache that cannot be written is no cache)."""
    folder = None if key is None else _folder(kind)
    if folder is None:
        return
    entry = folder / f"{key[:40]}.pickle"
    partial = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial.write_bytes(pickle.dumps((key, value), protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(partial, entry)  # readers see the whole entry or none
        _trim(folder)
    except Exception:  # noqa: BLE001 - unwritable folder, a value that does not pickle: no entry
        partial.unlink(missing_ok=True)


def _trim(folder: Path) -> None:
    """Past twice ENTRIES entries, keep the newest ENTRIES (so the folder is listed in full only
    once in that many writes)."""
    entries = list(folder.glob("*.pickle"))
    if len(entries) <= 2 * ENTRIES:
        return
    by_age = sorted(entries, key=lambda p: p.stat().st_mtime_ns)
    for old in by_age[: len(entries) - ENTRIES]:
        old.unlink(missing_ok=True)


def _cached(kind: str, key: str | None, make: Callable[[], T]) -> T:
    value = _get(kind, key)
    if value is None:
        value = make()
        _put(kind, key, value)
    return value


def _files_signature(path: str) -> str | None:
    """What identifies the files `open_inventory(path)` may read, without reading them; None where
    the folder cannot be listed (opening it reports why), or where a file changed in the last
    SETTLED_SECONDS: a file's times move in clock ticks, so a file rewritten within the tick of an
    earlier look could keep every number of it (git's "racy" entries); such files are not kept."""
    root = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with os.scandir(root) as entries:
            stats = sorted((e.name, e.stat()) for e in entries if e.name.endswith((SUFFIX, INDEX_SUFFIX)))
    except OSError:
        return None
    newest = max((max(s.st_mtime_ns, s.st_ctime_ns) for _, s in stats), default=0)
    if time.time_ns() - newest < SETTLED_SECONDS * 1e9:
        return None
    return repr([path] + [(name, s.st_size, s.st_ino, s.st_mtime_ns, s.st_ctime_ns) for name, s in stats])


def open_checkpoint(checkpoint) -> tuple[Inventory, str | None]:
    """A checkpoint's Inventory (`open_inventory`) and its key: read back when none of its files
    changed since it was kept. An Inventory given stays as it is, without a key."""
    if isinstance(checkpoint, Inventory):
        return checkpoint, None
    path = os.path.abspath(os.fspath(checkpoint))
    before = _files_signature(path) if _folder("inventories") is not None else None
    key = None if before is None else _key("inventory", before)
    inventory = _get("inventories", key)
    if inventory is None:
        inventory = open_inventory(path)
        if key is not None and _files_signature(path) != before:  # changed while it was read
            key = None
        _put("inventories", key, inventory)
    return inventory, key


def compiled(inventory_key: str | None, rule_files: list[tuple[str, str]], config: Mapping[str, Any],
             strict: bool, make: Callable[[], T]) -> tuple[T, str | None]:
    """`make()` (compiling the rules against the inventory), or what it gave before for the same
    inventory, rule files, config and strictness; with the key it is kept under."""
    key = None
    if inventory_key is not None and _builtin_formats_only():
        try:
            config_text = json.dumps(config, sort_keys=True)
        except (TypeError, ValueError):  # not plain JSON: no text that stands for it
            config_text = None
        if config_text is not None:
            key = _key("compiled", inventory_key, json.dumps(rule_files), config_text, strict)
    return _cached("compiled", key, make), key


def load_plan(compiled_key: str | None, held: Mapping[str, Any], rank: int, make: Callable[[], T]) -> T:
    """`make()` (this rank's load plan), or what it gave before for the same compiled program, the
    same holdings and rank."""
    key = None
    if compiled_key is not None and _folder("plans") is not None:
        key = _key("plan", compiled_key, rank, pickle.dumps(dict(held), protocol=pickle.HIGHEST_PROTOCOL))
    return _cached("plans", key, make)


def _builtin_formats_only() -> bool:
    """True when every registered quantized format is one of remapdsl's own, as it ships them."""
    from ..quant import get_format
    from ..quant.builtin import BUILTIN_FORMATS
    from ..quant.registry import format_names

    builtin = {f.name: f for f in BUILTIN_FORMATS}
    return all(builtin.get(name) is get_format(name) for name in format_names())
