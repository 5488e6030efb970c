"""`remapdsl.prepare`: a checkpoint's headers, its rules compiled and this rank's plans, kept in memory by the
caller for the next load, save, export or ingest (the one-shot entry points make one for the call)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from ..checkpoint import Inventory
from ..language import RuleSet
from ..language.includes import rule_texts
from ..language.parser import read_rule_text
from ..errors import RemapError
from .prepare import Ready, prepare_everywhere

T = TypeVar("T")
KEPT = 4  # plans kept of each kind: the last holdings seen (a trainer alternates few)


class Prepared:
    """Rank 0's headers of a checkpoint, the rules compiled against them and this rank's plans for each
    holding seen (from `remapdsl.prepare`); every rank calls each method, as for the one-shot functions."""

    def __init__(self, rules, checkpoint, config, strict: bool, ready: Ready, watched: bool = True):
        self._rules, self._checkpoint, self._config, self._strict = rules, checkpoint, config, strict
        self._watched = watched  # False: made for one call (or a derived layout): never looked at again
        self._ready, self._files = ready, self._look(ready)[1] if watched else None
        self._kept: dict[str, list[tuple[Any, Any]]] = {}

    @property
    def inventory(self) -> Inventory:
        """The checkpoint's headers (rank 0's, with this rank's own files' modification times)."""
        return self._ready.inventory

    @property
    def compiled(self):
        """The compiled program (`remapdsl.compile.Compiled`)."""
        return self._ready.compiled

    @property
    def rules_path(self) -> str:
        """The top-level rule file compiled."""
        return self._ready.rules.files[0].path if self._ready.rules.files else ""

    def current(self) -> Ready:
        """The headers and compiled program, prepared again on every rank when any rank sees a rule file or a
        checkpoint file changed since (one exchange of a flag each call)."""
        if not self._watched:
            return self._ready
        from ..runtime import dist

        same, files = self._look(self._ready)
        changed = not same or files != self._files
        if dist.active():
            changed = any(dist.gather_all(changed, "checking the prepared rules and checkpoint"))
        if changed:
            self._kept.clear()
            ready = prepare_everywhere(self._rules, self._checkpoint, self._config, self._strict)
            self._ready, self._files = ready, self._look(ready)[1]
        return self._ready

    def kept(self, kind: str, key: Any, make: Callable[[], T]) -> T:
        """`make()`, or what it gave before for a key equal to `key` (the last KEPT of `kind`)."""
        entries = self._kept.setdefault(kind, [])
        for i, (seen, value) in enumerate(entries):
            if seen == key:
                entries.append(entries.pop(i))
                return value
        value = make()
        entries.append((key, value))
        del entries[:-KEPT]
        return value

    def _look(self, ready: Ready) -> tuple[bool, tuple]:
        """What identifies the inputs now, without parsing them: whether each rule file still holds the
        text compiled, and each checkpoint file's size, inode and times (a RuleSet, Inventory: unchanging)."""
        same = isinstance(self._rules, RuleSet) or all(_text(path) == text for path, text in rule_texts(ready.rules))
        if isinstance(self._checkpoint, Inventory):
            return same, ()
        inventory = ready.inventory
        paths = [inventory.path(name) for name in [*inventory.files, *filter(None, [inventory.index_file])]]
        if self._config is None:
            paths.append(os.path.join(inventory.root, "config.json"))
        return same, tuple(_stat(path) for path in paths)

    def load(self, state_dict, *, layout=None, mesh=None, read_replicated_once: bool = False, timeout=None,
             staging_bytes: int | None = None, local=None):
        """Fill existing tensors in place from the checkpoint; the arguments are `remapdsl.load`'s."""
        from .load import load

        return load(self, state_dict, layout=layout, mesh=mesh, read_replicated_once=read_replicated_once,
                    timeout=timeout, staging_bytes=staging_bytes, local=local)

    def save(self, state_dict, folder, *, layout=None, mesh=None, overwrite: bool = False,
             allow_lossy: bool = False, requantize: bool = False, dropped: str = "error", timeout=None, local=None):
        """Write runtime tensors back to the checkpoint's layout (it is `like`); as `remapdsl.save`."""
        from .save import save

        return save(self, state_dict, folder, layout=layout, mesh=mesh, overwrite=overwrite, allow_lossy=allow_lossy,
                    requantize=requantize, dropped=dropped, timeout=timeout, local=local)

    def export(self, state_dict, *, gather=(), bucket_bytes: int = 256 << 20, layout=None, mesh=None,
               allow_lossy: bool = False, regions: bool = False, by_round: bool = False, timeout=None,
               local=None):
        """The checkpoint's layout of a runtime state dict, in memory (it is `like`); as `remapdsl.export`."""
        from .export import export

        return export(self, state_dict, gather=gather, bucket_bytes=bucket_bytes, layout=layout, mesh=mesh,
                      allow_lossy=allow_lossy, regions=regions, by_round=by_round, timeout=timeout,
                      local=local)

    def ingest(self, state_dict, pairs, *, layout=None, mesh=None, timeout=None, staging_bytes: int | None = None,
               local=None):
        """Fill a runtime state dict from (checkpoint key, tensor) pairs in the checkpoint's layout (it is
        `like`); as `remapdsl.ingest`."""
        from .ingest import ingest

        return ingest(self, state_dict, pairs, layout=layout, mesh=mesh, timeout=timeout, staging_bytes=staging_bytes,
                      local=local)


def prepare(rules, checkpoint, *, config=None, strict: bool = True, timeout=None, watched: bool = True) -> Prepared:
    """Every rank: rank 0's headers of `checkpoint` shared and the rules compiled, the ranks agreeing, kept in
    a Prepared; `watched=False` for one call's (its inputs are never looked at again)."""
    from ..gcpause import frozen_heap
    from ..runtime import bounds

    with bounds.bounded(timeout), frozen_heap():
        ready = prepare_everywhere(rules, checkpoint, config, strict)
        return Prepared(rules, checkpoint, config, strict, ready, watched)


def _text(path: str) -> str | None:
    try:
        return read_rule_text(path)
    except RemapError:  # gone or unreadable: a change; preparing again says what is wrong
        return None


def _stat(path: str) -> tuple | None:
    try:
        s = os.stat(path)
    except OSError:
        return None
    return s.st_size, s.st_dev, s.st_ino, s.st_mtime_ns, s.st_ctime_ns
