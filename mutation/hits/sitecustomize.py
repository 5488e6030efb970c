"""Imported by every interpreter that mutation/run starts (this folder is on PYTHONPATH there): in a
process spawned during mutmut's stats step (a gloo rank, a CLI run), write the package functions it
reached to $MUTATION_HITS at exit, for mutation_hits.py to credit to the test that spawned it."""

import atexit
import json
import os
import sys


def _write_hits() -> None:
    state = sys.modules.get("mutmut.state")
    hits = sorted(state.state()._stats) if state is not None else []
    if hits:
        path = os.path.join(os.environ["MUTATION_HITS"], f"{os.getpid()}.json")
        with open(path + ".part", "w") as f:
            json.dump(hits, f)
        os.replace(path + ".part", path)


if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("MUTATION_HITS"):
    atexit.register(_write_hits)
