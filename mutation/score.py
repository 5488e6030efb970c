"""The mutation score from mutmut's results: killed (and timed out) over the mutants checked, per module
and in all; run by mutation/run in its scratch copy, with the mutant-name patterns it ran."""

import collections
import fnmatch
import subprocess
import sys

STATUSES = ("killed", "timeout", "survived", "no tests", "suspicious", "segfault", "skipped", "not checked")


def main(patterns: list[str]) -> None:
    patterns = patterns or ["*"]
    lines = subprocess.run(["mutmut", "results", "--all", "true"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    by_module: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        name, _, status = line.strip().rpartition(": ")
        if name and any(fnmatch.fnmatch(name, p) for p in patterns):
            by_module[name.split(".x_")[0].split(".x\u01c1")[0]][status] += 1
    total: collections.Counter = collections.Counter()
    for module, counts in sorted(by_module.items()):
        total.update(counts)
        print(_line(module, counts))
    print(_line("all", total))
    print("score: killed / (mutants - not checked); survivors judged equivalent are listed in "
          "mutation/survivors.md and left out of the issue's 90%")


def _line(module: str, counts: collections.Counter) -> str:
    checked = sum(counts.values()) - counts["not checked"]
    killed = counts["killed"] + counts["timeout"]
    rest = "  ".join(f"{s} {counts[s]}" for s in STATUSES[2:] if counts[s])
    return (f"{module:40s} mutants {sum(counts.values()):5d}  killed {killed:5d}  {rest}"
            f"  score {100 * killed / max(checked, 1):5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
