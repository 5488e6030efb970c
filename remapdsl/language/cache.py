"""The parser's private cache folder: Lark's tables, and the IR of rule files parsed before.

A process's first parse would otherwise build Lark's parser (its tables unpickled, its lexer's
pattern compiled) and run it: about 15 ms, the largest fixed cost of a small load. A rule file
parsed once is read back as its IR in well under a millisecond. Both caches are pickles, so they
live only in a folder this user alone can write; an entry is keyed by the file's path and text and
by the parser's own code, so an edited file or another remapdsl version never reads a stale one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
from pathlib import Path

_PARSED_ENTRIES = 256  # rule files kept; the oldest go first


def cache_folder() -> Path | None:
    """$XDG_CACHE_HOME/remapdsl or ~/.cache/remapdsl, made with mode 0700; None where it cannot be
    made, or is someone else's or writable by others (what it holds is unpickled)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(base) / "remapdsl"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        mode = folder.stat()
    except OSError:
        return None
    if hasattr(os, "getuid") and (mode.st_uid != os.getuid() or mode.st_mode & 0o022):
        return None
    return folder


@functools.cache
def code_version() -> str:
    """A digest of what a parse depends on: the grammar, the language package's and the base
    modules' sources (by size and modification time, as Python's own bytecode cache checks them),
    and Lark's, pydantic's and Python's versions."""
    import lark
    import pydantic

    here = Path(__file__).parent
    digest = hashlib.sha256(f"{lark.__version__} {pydantic.VERSION} {sys.version_info[:2]}".encode())
    base = [here.parent / name for name in ("errors.py", "params.py", "dtypes.py", "trusted.py")]
    grammars = [p for folder in (here.parent, here.parent.parent) for p in folder.glob("grammars/*.lark")]
    for source in sorted(here.glob("*.py")) + base + grammars:
        stat = source.stat()
        digest.update(f"\0{source.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    return digest.hexdigest()


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
    if entry is None:
        return
    try:
        entry.parent.mkdir(mode=0o700, exist_ok=True)
        partial = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        partial.write_bytes(pickle.dumps(rule_file, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(partial, entry)  # readers see the whole entry or none
        _trim(entry.parent)
    except OSError:
        pass


def _entry(path: str, text: str) -> Path | None:
    folder = cache_folder()
    if folder is None:
        return None
    key = hashlib.sha256(f"{code_version()}\0{path}\0".encode() + text.encode()).hexdigest()
    return folder / "parsed" / f"{key[:32]}.pickle"


def _trim(folder: Path) -> None:
    """Past twice _PARSED_ENTRIES entries, keep the newest _PARSED_ENTRIES (stat-ing them all only
    once in that many writes)."""
    entries = list(folder.glob("*.pickle"))
    if len(entries) <= 2 * _PARSED_ENTRIES:
        return
    by_age = sorted(entries, key=lambda p: p.stat().st_mtime)
    for old in by_age[: len(entries) - _PARSED_ENTRIES]:
        old.unlink(missing_ok=True)
