"""The package's layers stay true: every module imports only from its own layer or the ones below it,
nothing imports the command line, and no module grows past the size the style allows.

Read from the source with `ast` (every import, lazy ones inside functions included), so a layer
violation fails here even when no test happens to execute the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "remapdsl"

# Lowest first. A module may import from its own layer and from the layers before it.
LAYERS = (
    ("base", ("remapdsl.errors", "remapdsl.dtypes", "remapdsl.params", "remapdsl.gcpause", "remapdsl.indexmap", "remapdsl.sizes",
              "remapdsl.records")),
    ("quant", ("remapdsl.quant",)),
    ("language", ("remapdsl.language",)),
    ("checkpoint", ("remapdsl.checkpoint",)),
    ("compile", ("remapdsl.compile",)),
    ("sharding", ("remapdsl.sharding",)),
    ("runtime", ("remapdsl.runtime",)),
    ("drivers", ("remapdsl.drivers",)),
    ("api", ("remapdsl",)),
    ("integrations", ("remapdsl.dcp", "remapdsl.torchtitan")),
    ("testing", ("remapdsl.testing",)),
    ("cli", ("remapdsl.cli", "remapdsl.__main__")),
)
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _layer(module: str) -> int:
    """The index of the layer a module belongs to: the longest prefix that names it."""
    best, found = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    assert found is not None, f"{module} belongs to no layer: add it to LAYERS"
    return found


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """Every remapdsl module this module imports, with the line: absolute, relative, `from x import y`
    where y is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    known = _modules()
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "remapdsl"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "remapdsl":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            found += [(t, node.lineno) for t in subs] or [(target, node.lineno)]
    return found


def test_every_import_flows_down_the_layers():
    problems = []
    for module, path in _modules().items():
        mine = _layer(module)
        for target, line in _imports(module, path):
            theirs = _layer(target)
            if theirs > mine:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} ({LAYERS[mine][0]}) "
                                f"imports {target} ({LAYERS[theirs][0]}), a layer above it")
    assert not problems, "\n".join(problems)


def test_no_private_name_is_imported_across_packages():
    """`from remapdsl.x import _name` is a module's own business within its package only."""
    problems = []
    for module, path in _modules().items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "remapdsl" or target.split(".")[:2] == module.split(".")[:2]:
                continue
            problems += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {module} imports {target}.{a.name}"
                         for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not problems, "\n".join(problems)


def test_only_compile_and_above_read_the_format_registry():
    """Formats registered from Python are looked up when rules meet a checkpoint (compile), never while
    they are parsed and checked: below compile, only the built-in formats' fixed names may be read."""
    compile_layer = next(i for i, (name, _) in enumerate(LAYERS) if name == "compile")
    readers = [f"{module} imports {target}" for module, path in _modules().items()
               if _layer(module) < compile_layer and not module.startswith("remapdsl.quant")
               for target, _ in _imports(module, path)
               if target.startswith("remapdsl.quant") and target != "remapdsl.quant.builtin"]
    assert readers == []


def test_nothing_imports_the_command_line():
    users = [f"{module} imports {target}" for module, path in _modules().items()
             if _layer(module) != len(LAYERS) - 1
             for target, _ in _imports(module, path) if _layer(target) == len(LAYERS) - 1]
    assert not users


def test_the_command_line_uses_the_public_api_only():
    """The CLI is a view of `remapdsl`'s public functions (and the testing kit's, for `verify`)."""
    used = sorted({target for target, _ in _imports("remapdsl.cli", _modules()["remapdsl.cli"])})
    assert [t for t in used if t != "remapdsl" and not t.startswith("remapdsl.testing")] == []


def test_the_checker_sees_a_violation(tmp_path):
    """The walk above reads relative imports the way Python resolves them (so it can fail)."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from ..runtime import dist\n    from . import ir\n", encoding="utf-8")
    found = dict(_imports("remapdsl.language.probe", path))
    assert "remapdsl.runtime.dist" in found and "remapdsl.language.ir" in found
    assert _layer("remapdsl.runtime.dist") > _layer("remapdsl.language.probe")


@pytest.mark.parametrize("module", sorted(_modules()))
def test_modules_stay_small(module):
    path = _modules()[module]
    text = path.read_text(encoding="utf-8")
    if "__mutmut_orig" in text:  # mutation/run's copy: the module with its mutants written in
        pytest.skip("a module mutmut rewrote with its mutants")
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines: split it by job"
