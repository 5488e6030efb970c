"""Lark's LALR tables for the grammar as JSON: built when the package is built (hatch_build.py),
read at the first parse of a process instead of building them (0.08 s of every process's first load).

Tables carry the grammar's SHA-256 and Lark's version; tables of another grammar or another Lark
are not used (the parser is then built from the grammar). Imports only lark and the standard
library: the build hook loads this file by its path, before the package is installed.
"""

from __future__ import annotations

import hashlib
import json

import lark
from lark import Lark
from lark.grammar import Rule
from lark.lexer import TerminalDef

OPTIONS = {"parser": "lalr", "maybe_placeholders": True}  # every parser of the grammar is built with these
FILE_NAME = "remap.tables.json"


def tables_json(grammar: str) -> str:
    """The grammar's tables (Lark's own serialization) as JSON; the lexer and the callbacks are
    given when they are read."""
    data, memo = Lark(grammar, lexer="basic", **OPTIONS).memo_serialize([TerminalDef, Rule])
    data["parser"]["lexer_conf"]["lexer_type"] = None  # a class, not data
    return json.dumps({"key": _key(grammar), "data": data, "memo": memo})


def parser_from_tables(text: str, grammar: str, lexer: type, transformer) -> Lark | None:
    """The parser of `grammar` from tables_json's text, or None if they were built for another
    grammar or by another Lark."""
    tables = json.loads(text, object_pairs_hook=_integer_keys)
    if tables["key"] != _key(grammar):
        return None
    data = tables["data"]
    data["options"].update(lexer=lexer, transformer=transformer)
    data["parser"]["lexer_conf"]["lexer_type"] = lexer
    return Lark.load({"data": data, "memo": tables["memo"]})  # a dict: Lark's own standalone form


def _key(grammar: str) -> list[str]:
    return [hashlib.sha256(grammar.encode()).hexdigest(), lark.__version__]


def _integer_keys(pairs: list) -> dict:
    """JSON keys are strings; Lark's state and memo numbers are integers (no name is all digits)."""
    return {int(k) if k.isdigit() else k: v for k, v in pairs}
