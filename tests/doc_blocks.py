"""Running a documentation page's python block as a user would: a fresh process, offline, this checkout's
remapdsl first on the path, in a scratch folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_block(code: str, folder: Path, name: str) -> subprocess.CompletedProcess:
    """`code` written to `folder/name.py` and run there; stdout and stderr captured as text."""
    script = folder / f"{name}.py"
    script.write_text(code)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TMPDIR=str(folder),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if env.get("MUTANT_UNDER_TEST") == "stats":
        # mutation/run's first pass records, in its own process, which tests reach each function; a child
        # process cannot report to it (its mutmut finds no configuration there), so the child runs plain
        del env["MUTANT_UNDER_TEST"]
    return subprocess.run([sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


# torch 2.13's gloo teardown now and then aborts a spawned rank as its process exits, after all its work
# (reproduced without remapdsl: a DeviceMesh, one DTensor collective, then exit; 1 to 3 runs in 10)
TORCH_EXIT_ABORT = "terminate called without an active exception"


def ran(run: subprocess.CompletedProcess, printed: str) -> bool:
    """A block ran: exit 0, or that abort at exit once everything it prints was printed."""
    return run.returncode == 0 or (TORCH_EXIT_ABORT in run.stderr and "terminated with signal SIGABRT" in run.stderr
                                   and run.stdout == printed)
