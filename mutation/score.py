"""The mutation score from mutmut's results, per module and in all: killed (timeouts count as killed)
over the mutants checked, and over those less the survivors mutation/survivors.md lists as equivalent
(the issue's measure); then every survivor that is neither, the ones to look at. A survivor of a
narrowed run, or a mutant no run reached, that mutation/killed.txt names (a test outside the run's
selection, or one written since, killed it under `mutation/try`) counts as killed elsewhere. Run by
mutation/run in its scratch copy, with the mutant-name patterns it ran."""

import collections
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

SURVIVORS = Path(__file__).resolve().parent / "survivors.md"
KILLED = Path(__file__).resolve().parent / "killed.txt"
SHOWN = ("survived", "no tests", "suspicious", "segfault", "skipped", "not checked", "killed elsewhere")


def equivalent_mutants(text: str) -> set[str]:
    """Full mutant names from survivors.md: `## remapdsl/x/y.py` headings, then table rows whose
    first cell is a backticked mutant name within that module."""
    found, module = set(), None
    for line in text.splitlines():
        heading = re.match(r"^## (remapdsl/\S+)\.py\s*$", line)
        if heading:
            module = heading.group(1).replace("/", ".")
        row = re.match(r"^\| `([^`]+__mutmut_\d+)` \|", line)
        if row and module:
            found.add(f"{module}.{row.group(1)}")
    return found


def killed_elsewhere(text: str) -> set[str]:
    """Mutant names from killed.txt: the first word of each line that is not blank or a # comment."""
    return {line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")}


def main(patterns: list[str]) -> None:
    patterns = patterns or ["*"]
    lines = subprocess.run(["mutmut", "results", "--all", "true"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    equivalent = equivalent_mutants(SURVIVORS.read_text()) if SURVIVORS.exists() else set()
    elsewhere = killed_elsewhere(KILLED.read_text()) if KILLED.exists() else set()
    by_module: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unexplained = []
    for line in lines:
        name, _, status = line.strip().rpartition(": ")
        if not name or not any(fnmatch.fnmatch(name, p) for p in patterns):
            continue
        counts = by_module[name.split(".x_")[0].split(".x\u01c1")[0]]
        if status in ("survived", "no tests", "segfault", "not checked") and name in elsewhere:
            status = "killed elsewhere"
        counts[status] += 1
        if status == "survived" and name in equivalent:
            counts["equivalent"] += 1
        elif status in ("survived", "no tests"):
            unexplained.append(f"{status}: {name}")
    total: collections.Counter = collections.Counter()
    for module, counts in sorted(by_module.items()):
        total.update(counts)
        print(_line(module, counts))
    print(_line("all", total))
    print("score: killed / (mutants checked); score less equivalent: killed / (checked - the survivors "
          "mutation/survivors.md lists as equivalent), the issue's measure")
    if patterns == ["*"]:  # the package's modules that have no kept results: no mutant of them was run
        modules = (".".join(p.with_suffix("").parts) for p in sorted(Path("remapdsl").rglob("*.py")))
        never = [m for m in modules if m not in by_module and not m.endswith("__init__")]
        if never:
            print(f"{len(never)} modules not run yet: {', '.join(never)}")
    if unexplained:
        print(f"{len(unexplained)} survivors neither killed nor listed as equivalent:")
        print("\n".join(f"  {u}" for u in unexplained))


def _line(module: str, counts: collections.Counter) -> str:
    checked = sum(counts[s] for s in counts if s != "equivalent") - counts["not checked"]
    killed = counts["killed"] + counts["timeout"] + counts["killed elsewhere"]
    rest = "  ".join(f"{s} {counts[s]}" for s in SHOWN if counts[s])
    return (f"{module:34s} mutants {checked + counts['not checked']:5d}  killed {killed:5d}  {rest}"
            f"  equivalent {counts['equivalent']:3d}  score {100 * killed / max(checked, 1):5.1f}%"
            f"  less equivalent {100 * killed / max(checked - counts['equivalent'], 1):5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
