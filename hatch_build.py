"""Build hook: Lark's parser tables for grammars/remap.lark, built when the package is built
(remapdsl/language/tables.py), written beside the grammar and shipped in the wheel beside it."""

import importlib.util
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ParserTablesHook(BuildHookInterface):
    def initialize(self, version, build_data):
        root = Path(self.root)
        spec = importlib.util.spec_from_file_location("remapdsl_tables", root / "remapdsl/language/tables.py")
        tables = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tables)
        grammar = (root / "grammars/remap.lark").read_text(encoding="utf-8")
        built = root / "grammars" / tables.FILE_NAME
        built.write_text(tables.tables_json(grammar), encoding="utf-8")
        build_data["force_include"][str(built)] = f"remapdsl/grammars/{tables.FILE_NAME}"
