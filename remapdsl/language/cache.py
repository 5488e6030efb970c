"""The parser's private cache folder: Lark's tables, the IR of rule files parsed before, and the
files a checked rule program was read from.

A process's first parse would otherwise build Lark's parser (its tables unpickled, its lexer's
pattern compiled) and run it: about 15 ms, the largest fixed cost of a small load. A rule file
parsed once is read back as its IR in well under a millisecond; a load whose compiled program is
kept needs only the text of the files a program was read from, not the program (`sources`). These
caches are pickles, so they live only in a folder this user alone can write; an entry is keyed by
the file's path and text and by remapdsl's own code, so an edited file or another remapdsl version
never reads a stale one. The load cache (remapdsl/runtime/cache.py) keeps its entries in the same
folder, under the same code version.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_PARSED_ENTRIES = 256  # rule files kept; the oldest go first (and as many programs' sources)


def cache_folder() -> Path | None:
    """$XDG_CACHE_HOME/remapdsl or ~/.cache/remapdsl, made with mode 0700; None where it cannot be
    made, or is someone else's or writable by others (what it holds is unpickled), or where
    `REMAPDSL_CACHE=0` turns caching off."""
    if os.environ.get("REMAPDSL_CACHE", "").strip().lower() in ("0", "off", "no", "false"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(base) / "remapdsl"
    return folder if private(folder, make=True, parents=True) else None


def private(folder: Path, make: bool = False, parents: bool = False) -> bool:
    """Whether `folder` is there (made with mode 0700 if `make`), this user's, and writable by no one
    else: the only kind of folder whose files may be unpickled."""
    try:
        if make:
            folder.mkdir(mode=0o700, parents=parents, exist_ok=True)
        mode = folder.stat()
    except OSError:
        return False
    return not (hasattr(os, "getuid") and (mode.st_uid != os.getuid() or mode.st_mode & 0o022))


@functools.cache
def code_version() -> str:
    """A digest of the code a cached result came from: every source file of the package and its
    grammar (by size and modification time, as Python's own bytecode cache checks them), and
    Lark's, pydantic's, numpy's and Python's versions."""
    import lark
    import numpy
    import pydantic

    digest = hashlib.sha256(f"{lark.__version__} {pydantic.VERSION} {numpy.__version__} {sys.version}".encode())
    package = Path(__file__).resolve().parent.parent
    folders, grammars = [package], [package / "grammars", package.parent / "grammars"]
    while folders:
        for entry in sorted(os.scandir(folders.pop()), key=lambda e: e.name):
            if entry.name.endswith(".py"):
                _add_file(digest, entry)
            elif entry.is_dir() and entry.name != "__pycache__" and not entry.name.startswith("."):
                folders.append(Path(entry.path))
    for folder in grammars:  # the grammar: beside the package in a checkout, inside it when installed
        if folder.is_dir():
            for entry in sorted(os.scandir(folder), key=lambda e: e.name):
                if entry.name.endswith(".lark"):
                    _add_file(digest, entry)
    return digest.hexdigest()


def _add_file(digest, entry: os.DirEntry) -> None:
    stat = entry.stat()
    digest.update(f"\0{entry.path} {stat.st_size} {stat.st_mtime_ns}".encode())


def parsed(path: str, text: str):
    """The IR cached for this file's path and text, or None (not cached, unreadable, or not what
    was asked for)."""
    entry = _entry(path, text)
    if entry is None:
        return None
    try:
        rule_file = pickle.loads(entry.read_bytes())
    except Exception:  # none yet, or a damaged one (an interrupted writer, another version): parse again
        return None
    from .ir import RuleFile

    if not isinstance(rule_file, RuleFile) or rule_file.path != path or rule_file.source != text:
        return None
    return rule_file


def keep(rule_file) -> None:
    """Store a parsed file's IR (best effort: a cache that cannot be written is no cache)."""
    entry = _entry(rule_file.path, rule_file.source)
    if entry is not None and private(entry.parent, make=True):
        write_entry(entry, pickle.dumps(rule_file, protocol=pickle.HIGHEST_PROTOCOL), _PARSED_ENTRIES)


def sources(path: str, text: str, root: str):
    """What `keep_sources` kept for a top-level rule file of this path, text and include root (read
    from the working folder it is read from now), or None."""
    entry = _sources_entry(path, text, root)
    try:
        kept = pickle.loads(entry.read_bytes()) if entry is not None else None
    except Exception:  # noqa: BLE001 - none yet, or a damaged one: the program is loaded again
        return None
    return kept[1] if isinstance(kept, tuple) and len(kept) == 2 and kept[0] == entry.name else None


def keep_sources(path: str, text: str, root: str, make: Callable[[], Any]) -> None:
    """Keep what a top-level rule file's program was read from, `make()` (best effort; made only
    while caching is on), in place of what was kept for the same top-level file before (its
    includes lead elsewhere now)."""
    entry = _sources_entry(path, text, root)
    if entry is None:
        return
    value = make()
    if sources(path, text, root) != value and private(entry.parent, make=True):
        write_entry(entry, pickle.dumps((entry.name, value), protocol=pickle.HIGHEST_PROTOCOL), _PARSED_ENTRIES)


def _sources_entry(path: str, text: str, root: str) -> Path | None:
    folder = cache_folder()
    if folder is None:
        return None
    try:
        here = os.getcwd()
    except OSError:  # the working folder is gone
        return None
    key = hashlib.sha256(f"{code_version()}\0{here}\0{path}\0{root}\0".encode() + text.encode())
    return folder / "sources" / f"{key.hexdigest()[:32]}.pickle"


def write_entry(entry: Path, data: bytes, kept: int) -> bool:
    """Write one cache entry whole (through a temporary file of this writer's own, renamed: readers
    see the whole entry or none), then trim its folder; False where it could not be written."""
    partial = None
    try:
        fd, partial = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(partial, entry)
    except OSError:
        if partial is not None:
            Path(partial).unlink(missing_ok=True)
        return False
    _trim(entry.parent, kept)
    return True


def _entry(path: str, text: str) -> Path | None:
    folder = cache_folder()
    if folder is None:
        return None
    key = hashlib.sha256(f"{code_version()}\0{path}\0".encode() + text.encode()).hexdigest()
    return folder / "parsed" / f"{key[:32]}.pickle"


def _trim(folder: Path, kept: int) -> None:
    """Past twice `kept` entries, keep the `kept` used or written last (so the folder is listed in
    full only once in that many writes), and drop what writers that died left behind."""
    try:
        entries = list(folder.glob("*.pickle"))
        if len(entries) <= 2 * kept:
            return
        by_use = sorted(entries, key=lambda p: p.stat().st_mtime_ns)
        for old in by_use[: len(entries) - kept]:
            old.unlink(missing_ok=True)
        for partial in folder.glob("*.tmp"):
            if time.time() - partial.stat().st_mtime > 3600:
                partial.unlink(missing_ok=True)
    except OSError:  # another process trimming at the same time
        pass
