"""The suite keeps its caches (the parser's, the load cache) in a folder of its own, made for the
session and removed after it: a test never reads what the user's processes kept, nor leaves
anything in ~/.cache. Ranks and commands the tests start inherit it."""

from __future__ import annotations

import os
import shutil
import tempfile

_FOLDER: list[str] = []


def pytest_configure(config) -> None:
    folder = tempfile.mkdtemp(prefix="remapdsl-test-cache-")
    _FOLDER.append(folder)
    os.environ["XDG_CACHE_HOME"] = folder


def pytest_unconfigure(config) -> None:
    while _FOLDER:
        shutil.rmtree(_FOLDER.pop(), ignore_errors=True)
