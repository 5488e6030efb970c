"""How many examples a property test draws: the count given, sized to run on every commit, or ten
times as many under `--hypothesis-profile=thorough` (registered in tests/conftest.py) for a deeper
look, as before a release or after changing the parser."""

from __future__ import annotations

from hypothesis import settings

BASE = 100  # hypothesis' own default max_examples: the profile's count over it is the scale


def scaled(n: int) -> int:
    """`n` scaled by the loaded profile (`thorough`: max_examples 1000, ten times `n`)."""
    return max(1, n * settings.default.max_examples // BASE)
