"""Lark's LALR tables for the grammar as JSON, built with the package (hatch_build.py) and read instead
of building them at a process's first parse; keyed on the grammar's SHA-256 and Lark's version.
Imports only lark and the standard library: the build hook loads this file by its path."""

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
    """The grammar's tables (Lark's own serialization) as JSON; lexer and callbacks come at reading."""
    data, memo = Lark(grammar, lexer="basic", **OPTIONS).memo_serialize([TerminalDef, Rule])
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
