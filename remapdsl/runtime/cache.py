"""What a load keeps for the next process: each checkpoint's inventory, each compiled program and
each rank's load plan, read back when a later process is given the same inputs.

Everything a load does before its first byte (reading and checking the headers, compiling, planning)
is a pure function of its inputs, and a job restarted from the same checkpoint with the same rules
does it all again: for a small model that is most of a load's fixed cost, for DeepSeek-V3 about a
second a rank. Each result is kept under a key that holds every input it was made from:

- an inventory: the path given and, for every `*.safetensors` and `*.safetensors.index.json` file
  of its folder, the name, size, device, inode, and modification and change times (a file written,
  replaced, renamed or touched since is another key; the change time cannot be set back); an entry
  also holds the same of every file the inventory was read from (shards an index names in
  subfolders too), checked again when it is read back. Files changed in the last two seconds are
  not kept at all: their times could still be those of a rewrite in the same clock tick;
- a compiled program: the inventory's key, each rule file's path and text, the config (plain JSON
  only), strictness, the names of the registered quantized formats;
- a load plan: the compiled program's key, what this rank holds of each runtime tensor, its rank;

and each also by remapdsl's own code (`language.cache.code_version`: every source file, by size and
modification time, as Python's bytecode cache checks them, and its dependencies' versions). No
compiled program or plan is kept while the program has registered a quantized format of its own
(its code is not remapdsl's), nor anything for a checkpoint given as an Inventory object. Errors are
never kept: a compile that fails runs, and fails, again.

The entries are pickles, so they live only in the user's private cache folder (the parser's:
`language/cache.cache_folder`), each folder on the way checked to be this user's alone; plans in a
folder per host. `REMAPDSL_CACHE=0` turns every cache off. Each kind keeps the entries used last
(`ENTRIES`); deleting the folder is always safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..checkpoint import Inventory, open_inventory
from ..checkpoint.inventory import INDEX_SUFFIX, SUFFIX
from ..language.cache import cache_folder, code_version, private, write_entry

T = TypeVar("T")

SETTLED_SECONDS = 2.0  # files changed more recently than this are not kept (see _files_signature)
ENTRIES = 64  # entries kept of each kind (inventories, compiled programs, plans); the oldest go first
_log = logging.getLogger("remapdsl")


def _key(*parts: Any) -> str | None:
    """sha256 of remapdsl's code version and the parts; None when it cannot be made (a source file
    that cannot be looked at): no key, no cache, never a failed load."""
    try:
        digest = hashlib.sha256(code_version().encode())
    except OSError:
        return None
    for part in parts:
        digest.update(b"\0" + (part if isinstance(part, bytes) else str(part).encode()))
    return digest.hexdigest()


def _folder(kind: str, make: bool = False) -> Path | None:
    """The folder of one kind of entry, inside the private cache folder, or None: caching off, or a
    folder on the way that is not this user's alone (its entries are unpickled). Plans are kept per
    host: the ranks of a job on a shared home folder would otherwise push each other's out."""
    base = cache_folder()
    if base is None:
        return None
    parts = ["loads", kind] + ([_host()] if kind == "plans" else [])
    folder = base
    for part in parts:
        folder = folder / part
        if not private(folder, make):
            return None
    return folder


def _host() -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "host"


def _get(kind: str, key: str | None) -> tuple[bool, Any]:
    """Whether an entry is there for `key`, and its value (None: none kept, unreadable, or not that
    key's)."""
    folder = None if key is None else _folder(kind)
    if folder is None:
        return False, None
    entry = folder / f"{key[:40]}.pickle"
    try:
        data = entry.read_bytes()
    except OSError:
        return False, None
    try:
        kept_key, value = pickle.loads(data)
    except Exception:  # noqa: BLE001 - a damaged entry (an interrupted writer, another version)
        return True, None
    if kept_key != key:
        return True, None
    try:
        os.utime(entry)  # used: the trimming keeps the entries used last
    except OSError:
        pass
    _log.debug("remapdsl: %s read back from the cache (%s)", kind, folder)
    return True, value


def _put(kind: str, key: str | None, value: Any, replace: bool = False) -> None:
    """Keep `value` under `key` (best effort: a cache that cannot be written is no cache). An entry
    another process kept under the same key meanwhile (the ranks of a node) is left as it is,
    unless `replace` (the one there could not be read)."""
    folder = None if key is None else _folder(kind, make=True)
    if folder is None:
        return
    entry = folder / f"{key[:40]}.pickle"
    if entry.exists() and not replace:
        return
    try:
        data = pickle.dumps((key, value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - a value that does not pickle: no entry
        return
    write_entry(entry, data, ENTRIES)


def _cached(kind: str, key: str | None, make: Callable[[], T]) -> T:
    there, value = _get(kind, key)
    if value is None:
        value = make()
        _put(kind, key, value, replace=there)
    return value


def _stats(paths: list[tuple[str, str]]) -> str | None:
    """(name, path) of files -> what identifies each without reading it: size, device, inode,
    modification and change times; None where one cannot be looked at, or changed in the last
    SETTLED_SECONDS: a file's times move in clock ticks, so a file rewritten within the tick of an
    earlier look could keep every number of it (git's "racy" entries); such files are not kept."""
    seen = []
    now = time.time_ns()
    for name, path in paths:
        try:
            s = os.stat(path)
        except OSError:
            return None
        if now - max(s.st_mtime_ns, s.st_ctime_ns) < SETTLED_SECONDS * 1e9:
            return None
        seen.append((name, s.st_size, s.st_dev, s.st_ino, s.st_mtime_ns, s.st_ctime_ns))
    return repr(seen)


def _folder_signature(path: str) -> str | None:
    """The files `open_inventory(path)` may look at in its folder, identified without reading them."""
    root = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with os.scandir(root) as entries:
            names = sorted(e.name for e in entries if e.name.endswith((SUFFIX, INDEX_SUFFIX)))
    except OSError:
        return None
    listed = _stats([(name, os.path.join(root, name)) for name in names])
    return None if listed is None else repr([path, listed])


def _read_signature(inventory: Inventory) -> str | None:
    """Every file an inventory was read from (its index and the files it names, in subfolders too),
    identified without reading them."""
    names = sorted({*inventory.files, *inventory.ignored_files, *filter(None, [inventory.index_file])})
    return _stats([(name, inventory.path(name)) for name in names])


def open_checkpoint(checkpoint) -> tuple[Inventory, str | None]:
    """A checkpoint's Inventory (`open_inventory`) and its key: read back when none of the files it
    was read from changed since it was kept. An Inventory given stays as it is, without a key. The
    key stands for the folder's listing and every file read, so what is kept under it (compiled
    programs, plans) is made anew when any of them changes."""
    if isinstance(checkpoint, Inventory):
        return checkpoint, None
    path = os.path.abspath(os.fspath(checkpoint))
    listed = _folder_signature(path) if cache_folder() is not None else None
    entry = None if listed is None else _key("inventory", listed)
    there, kept = _get("inventories", entry)
    if kept is not None:
        inventory, read_from = kept
        if _read_signature(inventory) == read_from:
            return inventory, _key("files", entry, read_from)
    inventory = open_inventory(path)
    if entry is None:
        return inventory, None
    read_from = _read_signature(inventory)
    if read_from is None or _folder_signature(path) != listed:  # too new, or changed while read
        return inventory, None
    _put("inventories", entry, (inventory, read_from), replace=there)
    return inventory, _key("files", entry, read_from)


def compiled_key(inventory_key: str | None, rule_files: list[tuple[str, str]], config: Mapping[str, Any],
                 strict: bool) -> str | None:
    """The key of the program compiled from these rule files ((path, text) each), config and
    strictness against the inventory of `inventory_key`; None where it is not kept (an inventory
    without a key, a config that is not plain JSON, a quantized format of the program's own)."""
    if inventory_key is None or not _builtin_formats_only():
        return None
    try:
        config_text = json.dumps(config, sort_keys=True)
        plain = json.loads(config_text) == dict(config)  # no tuple, int key or other look-alike
    except (TypeError, ValueError):  # not plain JSON: no text that stands for it
        return None
    if not plain:
        return None
    from ..quant.registry import format_names

    return _key("compiled", inventory_key, json.dumps(rule_files), config_text, strict, format_names())


def kept_compiled(key: str | None) -> tuple[bool, Any]:
    """Whether an entry is there for `key`, and the compiled program kept under it (None: none kept
    or unreadable)."""
    return _get("compiled", key)


def keep_compiled(key: str | None, compiled: Any, replace: bool) -> None:
    """Keep a compiled program under `key`; `replace`: the entry there could not be read."""
    _put("compiled", key, compiled, replace=replace)


def load_plan(compiled_key: str | None, held: Mapping[str, Any], rank: int, make: Callable[[], T]) -> T:
    """`make()` (this rank's load plan), or what it gave before for the same compiled program, the
    same holdings and rank."""
    key = None
    if compiled_key is not None and cache_folder() is not None:
        try:
            key = _key("plan", compiled_key, rank, pickle.dumps(dict(held), protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # noqa: BLE001 - holdings that do not pickle: no key, no cache
            key = None
    return _cached("plans", key, make)


def _builtin_formats_only() -> bool:
    """True when every registered quantized format is one of remapdsl's own, as it ships them."""
    from ..quant import get_format
    from ..quant.builtin import BUILTIN_FORMATS
    from ..quant.registry import format_names

    builtin = {f.name: f for f in BUILTIN_FORMATS}
    return all(builtin.get(name) is get_format(name) for name in format_names())
