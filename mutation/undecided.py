"""`mutmut run` that checks only the mutants without a result yet (new, or of a function changed since),
those that no test reached (another selection may reach them) and those named exactly, so a run stopped
part way goes on where it stopped (mutmut re-checks every mutant a pattern matches). A file, not stdin:
processes the tests spawn re-import the main module."""

import sys

import mutmut.__main__ as mutmut_main

NO_TESTS = 33  # mutmut's exit code for a mutant whose function no test reached


def main() -> int:
    collect = mutmut_main.collect_source_file_mutation_data
    exact = {name for name in sys.argv[3:] if not any(c in name for c in "*?[")}

    def undecided(*, mutant_names):
        mutants, by_path = collect(mutant_names=mutant_names)
        return [(m, key, result) for m, key, result in mutants
                if result in (None, NO_TESTS) or key in exact], by_path

    mutmut_main.collect_source_file_mutation_data = undecided
    sys.argv[0] = "mutmut"
    return mutmut_main.cli(["run", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
