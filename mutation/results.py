"""mutmut's results kept in the repository (mutation/results/): mutation/run restores them into its
scratch copy before a run, so a fresh checkout goes on where the last run stopped, and saves them
back after one. mutmut keeps a mutant's result only while its function's source is unchanged (it
hashes each function), so a result restored for code changed since is run again.

    python mutation/results.py restore WORK   # before a run: each module's results WORK lacks
    python mutation/results.py save WORK      # after a run: WORK's results, compacted
"""

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def restore(work: Path) -> None:
    """Copy the kept results of each module into WORK/mutants, unless WORK has its own (newer)."""
    for kept in sorted(RESULTS.rglob("*.py.meta")):
        target = work / "mutants" / kept.relative_to(RESULTS)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(kept.read_text())


def save(work: Path) -> None:
    """Write WORK's results, one compact JSON file a module (durations to 0.01 s), keeping each kept
    result WORK lacks for a function whose source is the same in both: two scratch copies (say, runs
    with different test selections) save in either order without losing each other's results."""
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        target = RESULTS / meta.relative_to(work / "mutants")
        if target.exists():
            _keep_results(data, json.loads(target.read_text()))
        for key in ("durations_by_key", "estimated_durations_by_key"):
            data[key] = {name: round(seconds, 2) for name, seconds in data.get(key, {}).items()}
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n")


def _keep_results(data: dict, kept: dict) -> None:
    """Into `data` (a module's results), the results of `kept` for mutants `data` has not run, where
    the mutant's function has the same hash in both (so the same mutants)."""
    same = {f for f, h in data["hash_by_function_name"].items() if kept["hash_by_function_name"].get(f) == h}
    for name, code in kept["exit_code_by_key"].items():
        function = name.rpartition(".")[2].split("__mutmut_")[0]
        if code is not None and data["exit_code_by_key"].get(name, 0) is None and function in same:
            data["exit_code_by_key"][name] = code
            if name in kept.get("durations_by_key", {}):
                data.setdefault("durations_by_key", {})[name] = kept["durations_by_key"][name]


if __name__ == "__main__":
    {"restore": restore, "save": save}[sys.argv[1]](Path(sys.argv[2]))
