"""Every documented error code is raised by some test and its code asserted; this file holds the
cases no other test covers, and a meta-test that keeps the whole set covered as codes are added.

Each case triggers its error as a user would (a rule file, a config.json, a call on real gloo
ranks) and asserts the code and where it points: the span (file, line, column) of a rule-file
error, the key or file of an error without a line. A code that no user input can reach is raised
by the smallest honest means, said in the case's docstring.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint
from safetensors.torch import save_file

import remapdsl
from remapdsl.language import ir, rules_from_text
from remapdsl.language.includes import load_rules

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
CORPUS = TESTS / "corpus"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
CODE = re.compile(r"(?<![A-Za-z0-9])E\d{3}(?![0-9])")
RENDERED = re.compile(r"error\[(E\d{3})\]")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A one-tensor checkpoint `a.w` [4, 2] with an empty config."""
    return tiny_checkpoint(tmp_path / "ckpt", {"a.w": torch.arange(8, dtype=torch.float32).reshape(4, 2)}, {})


# ---- rule files and configs ----------------------------------------------------------------


@pytest.mark.parametrize("config, why", [({}, "is not in the config"), ({"use_b": None}, "is null in the config")])
def test_a_config_key_read_without_a_default_is_e211(checkpoint, config, why):
    rules = rules_from_text("remap 1\na.w -> b when config.use_b\n", "t.remap")
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.compile_rules(rules, checkpoint, config)
    (d,) = info.value.diagnostics
    assert d.code == "E211" and d.message == f"`config.use_b` {why}", d
    assert d.span[:5] == ("t.remap", 2, 15, 2, 27)  # `config.use_b`, carets under it
    assert str(info.value).startswith("t.remap:2:15: error[E211]:")


@pytest.mark.parametrize("rule, config, message, span", [
    ("a.w -> b\n    | pad(dim=0, to=config.n)\n", {"n": [4, 8]}, "`to` must be an integer, got [4, 8]",
     (3, 21, 3, 29)),
    ("a.w -> b when config.n\n", {"n": 3}, "a `when` guard must be true or false, got 3", (2, 15, 2, 23)),
    ("a.w -> b\n    | scale(config.s)\n", {"s": "big"},
     "`config.s` is str, not a number, a boolean, a list or a dtype name", (3, 13, 3, 21)),
])
def test_a_value_of_the_wrong_kind_is_e210_at_the_expression(checkpoint, rule, config, message, span):
    """Known only once the config is read: the parser cannot tell, the compiler points at the value."""
    rules = rules_from_text("remap 1\n" + rule, "t.remap")
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.compile_rules(rules, checkpoint, config)
    (d,) = info.value.diagnostics
    assert (d.code, d.message, d.span[:5]) == ("E210", message, ("t.remap", *span)), d


def test_a_config_json_that_is_not_json_is_e212(checkpoint):
    (checkpoint / "config.json").write_text('{"hidden_size": 8,}')
    rules = rules_from_text("remap 1\na.w -> b\n", "t.remap")
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.compile_rules(rules, checkpoint)
    (d,) = info.value.diagnostics
    assert d.code == "E212" and d.path == str(checkpoint / "config.json") and d.span is None, d
    assert str(info.value).startswith(f"{checkpoint / 'config.json'}: error[E212]: cannot read the model config")


def test_an_include_of_another_language_version_is_e144(tmp_path, monkeypatch):
    """remapdsl reads one language version today, so an included file of another version stops
    at E031 first; E144 is reached here as it will be once a second version exists, by making
    the parser accept version 2 (ir.LANGUAGE_VERSIONS, which builder and ir both read)."""
    monkeypatch.setattr(ir, "LANGUAGE_VERSIONS", (1, 2))
    (tmp_path / "main.remap").write_text('remap 1\ninclude "part.remap"\na.w -> b\n')
    (tmp_path / "part.remap").write_text("remap 2\nc.w -> e\n")
    with pytest.raises(remapdsl.RemapError) as info:
        load_rules(tmp_path / "main.remap")
    (d,) = info.value.diagnostics
    assert d.code == "E144" and d.message == "`part.remap` is written for version 2, this file for version 1"
    assert d.span[1:] == (2, 1, 2, 21) and d.span.path.endswith("main.remap")  # the whole include


@pytest.mark.parametrize("tamper", ["twice", "overlapping halves"])
def test_blocks_that_do_not_tile_are_e206(checkpoint, tamper):
    """E206 guards an invariant of the compiler (its blocks tile each runtime tensor once), so
    no rule file reaches it: the compiler's own check runs here on a runtime tensor whose
    blocks were tampered with after a correct compile (covering it twice, or half of it twice)."""
    from remapdsl.compile.compiler import _Compiler

    rules = rules_from_text("remap 1\na.w -> b\n    | transpose(0, 1)\n", "t.remap")
    compiler = _Compiler(rules, remapdsl.open_checkpoint(checkpoint), {}, True)
    (tensor,) = compiler.run().runtime_tensors
    (block,) = tensor.blocks
    if tamper == "twice":
        blocks, covered = (block, block), 16
    else:
        half = block._replace(sizes=(1, 4))
        blocks, covered = (half, half), 8
    compiler.runtime_tensors = {"b": dataclasses.replace(tensor, blocks=blocks)}
    with pytest.raises(remapdsl.RemapError) as info:
        compiler.check_tiling()
    (d,) = info.value.diagnostics
    assert d.code == "E206" and d.message == f"blocks of `b` do not tile it exactly once ({covered} of 8 elements)"
    assert d.span[:3] == ("t.remap", 2, 1) and d.line_text == "a.w -> b"
    assert d.hint == "this is a bug in remapdsl; please report it with the rule file"


def test_verify_against_transformers_without_it_is_e530(checkpoint, monkeypatch, capsys):
    """transformers is installed here: a None in sys.modules makes its import fail as it would."""
    from remapdsl import cli

    (checkpoint / "t.remap").write_text("remap 1\na.w -> b\n")
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert cli.main(["verify", str(checkpoint / "t.remap"), "--checkpoint", str(checkpoint),
                     "--against", "transformers"]) == 2
    err = capsys.readouterr().err
    assert "error[E530]: `--against transformers` needs transformers, which is not installed" in err, err


@pytest.mark.parametrize("plan, mesh, rank, code, message, key", [
    ({"b": [("shard", 2)]}, {"tp": 2}, 0, "E405", "placement S(2) names dim 2 of a 2-d tensor", "b"),
    ({"b": [("shard", 0)]}, {"dp": 2, "tp": 2}, 0, "E403", "rule `b` gives 1 placements for a 2-d mesh", "b"),
    ({"b": "colwise"}, {"dp": 2}, 0, "E408", "the mesh has no dim `tp`", None),
    ({"b": "colwise"}, {"tp": 2}, 2, "E404", "rank 2 is outside a mesh of 2 ranks", None),
    ({"b": [("strided", 0)]}, {"tp": 2}, 0, "E406", "split_factor must be at least 1, got 0", None),
    ({"b": "colwse"}, {"tp": 2}, 0, "E407", "unknown layout style `colwse`", "b"),
])
def test_a_layout_that_does_not_fit_names_the_tensor_or_the_mesh(checkpoint, plan, mesh, rank, code, message, key):
    """Planning one rank of a job in one process (remapdsl.plan_rank): each mistake's code, its
    message and the runtime key it names (none for a mistake in the mesh or the rank)."""
    from remapdsl.sharding import LayoutPlan, Mesh, Shard, StridedShard

    rules = rules_from_text("remap 1\na.w -> b\n    | transpose(0, 1)\n", "t.remap")  # b is [2, 4]
    inventory = remapdsl.open_checkpoint(checkpoint)
    compiled = remapdsl.compile_rules(rules, inventory, {})
    made = {"shard": lambda n: Shard(dim=n), "strided": lambda n: StridedShard(dim=0, split_factor=n)}
    with pytest.raises(remapdsl.RemapError) as info:
        given = {k: v if isinstance(v, str) else [made[kind](n) for kind, n in v] for k, v in plan.items()}
        remapdsl.plan_rank(compiled, inventory, LayoutPlan.from_mapping(given, mesh_dim="tp"), Mesh.of(mesh), rank)
    (d,) = info.value.diagnostics
    assert (d.code, d.message, d.path) == (code, message, key), d


def test_a_torch_placement_where_remapdsl_s_is_due_is_e402():
    from torch.distributed.tensor import Shard as TorchShard

    from remapdsl.sharding import local_shard

    with pytest.raises(remapdsl.RemapError) as info:
        local_shard((2, 4), (2,), [TorchShard(0)], (0,), runtime_key="b")
    (d,) = info.value.diagnostics
    assert (d.code, d.message, d.path) == ("E402", "Shard(dim=0) is not a remapdsl placement", "b"), d
    assert "placements_from_dtensor" in d.hint


# ---- checkpoints, saves and conversions: the file or key each error names --------------------


def test_a_folder_without_safetensors_is_e320_naming_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.open_checkpoint(tmp_path)
    (d,) = info.value.diagnostics
    assert (d.code, d.path) == ("E320", str(tmp_path)), d
    assert d.message == "no `model.safetensors.index.json` and no `*.safetensors` file in the folder"


def test_two_index_files_and_no_default_are_e327_naming_both(tmp_path):
    save_file({"a.w": torch.ones(2)}, str(tmp_path / "part-1.safetensors"))
    for name in ("a", "b"):
        (tmp_path / f"{name}.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {"a.w": "part-1.safetensors"}}))
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.open_checkpoint(tmp_path)
    (d,) = info.value.diagnostics
    assert (d.code, d.path) == ("E327", str(tmp_path)), d
    assert d.message.endswith("none is `model.safetensors.index.json`: a.safetensors.index.json, "
                              "b.safetensors.index.json"), d.message


@pytest.mark.parametrize("where, message", [("out", "the destination exists"),
                                            ("nowhere/out", "the destination's parent folder does not exist")])
def test_a_save_to_an_existing_folder_or_a_missing_parent_is_e510(checkpoint, tmp_path, where, message):
    (tmp_path / "out").mkdir()
    rules = rules_from_text("remap 1\na.w -> b\n    | transpose(0, 1)\n", "t.remap")
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.save({"b": torch.ones(2, 4)}, tmp_path / where, rules, like=checkpoint, config={})
    (d,) = info.value.diagnostics
    named = tmp_path / where if where == "out" else tmp_path / "nowhere"
    assert (d.code, d.message, d.path) == ("E510", message, str(named)), d
    assert list((tmp_path / "out").iterdir()) == []


def test_a_reverse_conversion_of_a_checkpoint_in_the_other_layout_is_e521(checkpoint, tmp_path):
    rules = rules_from_text("remap 1\na.w -> b\n    | transpose(0, 1)\n", "t.remap")
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.convert(checkpoint, tmp_path / "back", rules, reverse=True, like=checkpoint)
    (d,) = info.value.diagnostics
    assert (d.code, d.message, d.path) == ("E521", "`b` is not in the runtime-layout checkpoint", str(checkpoint)), d
    assert not (tmp_path / "back").exists()


def test_auto_without_a_checkpoint_is_e148():
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.load_rules("auto")
    (d,) = info.value.diagnostics
    assert d.code == "E148" and d.message.endswith("and there is no checkpoint here"), d
    assert "`--checkpoint DIR`" in d.hint and "qwen3_moe" in d.hint


@pytest.mark.parametrize("statements, message, line", [
    (("dequantize a.q, a.s -> x | fp8_tensor(to=bfloat16)\ndequantize b.q, b.s -> x | fp8_tensor(to=bfloat16)\n"
     "x -> y\na.w -> w\n"), "logical tensor `x` is made twice (also by the statement at t.remap:2:1)", 3),
    (("dequantize a.q, a.s -> a.w | fp8_tensor(to=bfloat16)\ndequantize b.q, b.s -> x | fp8_tensor(to=bfloat16)\n"
     "a.w -> y\nx -> z\n"), "logical tensor `a.w` has the name of a checkpoint tensor it does not consume", 2),
])
def test_a_logical_tensor_made_twice_or_named_like_a_checkpoint_tensor_is_e223(tmp_path, statements, message, line):
    tiny_checkpoint(tmp_path, {"a.q": torch.randn(4, 2).to(torch.float8_e4m3fn), "a.s": torch.tensor(0.5),
                               "b.q": torch.randn(4, 2).to(torch.float8_e4m3fn), "b.s": torch.tensor(0.5),
                               "a.w": torch.ones(2)})
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.compile_rules(rules_from_text("remap 1\n" + statements, "t.remap"), tmp_path, {}, strict=False)
    (d,) = [d for d in info.value.diagnostics if d.code == "E223"]
    assert d.message == message and d.span[:3] == ("t.remap", line, 1), d


# ---- on two gloo ranks ---------------------------------------------------------------------


def _two_ranks(rank: int, world: int, checkpoint: str, out: str) -> None:
    """Each rank's diagnostics for the mistakes a job can make, written to `out`; then each rank
    fails a check of its own (an assert on rank 0, pytest.fail on rank 1), which the parent must
    see as those checks' messages."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from remapdsl.sharding import LayoutPlan, Mesh, Shard

    rules = rules_from_text("remap 1\na.w -> b\n    | transpose(0, 1)\n", "t.remap")  # b is [2, 4]
    seen = {}

    def record(name, call):
        with pytest.raises(remapdsl.RemapError) as info:
            call()
        seen[name] = [d.model_dump(mode="json") for d in info.value.diagnostics]

    mesh, plan = Mesh.of({"tp": 2}), LayoutPlan.from_mapping({"b": [Shard(dim=1)]}, mesh_dim="tp")
    local = torch.zeros(2, 2) if rank == 0 else torch.zeros(2, 4)  # rank 1 passes the whole tensor
    record("E233", lambda: remapdsl.load({"b": local}, checkpoint, rules, layout=plan, mesh=mesh))
    partial = DTensor.from_local(torch.zeros(2, 4), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
                                 [Partial()])
    record("E401", lambda: remapdsl.load({"b": partial}, checkpoint, rules))
    target = {"b": [[0.0] * 4] * 2 if rank == 1 else torch.zeros(2, 4)}  # a list where a tensor belongs
    record("E232", lambda: remapdsl.load(target, checkpoint, rules))
    record("E411", lambda: remapdsl.load(_Broken(rank == 1, b=torch.zeros(2, 4)), checkpoint, rules))
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        assert seen["E233"][0]["code"] == "E999", "rank zero's own check failed"
    pytest.fail("rank one's own check failed")


class _Broken(dict):
    """A user's state-dict mapping whose lookups fail on one rank: an error remapdsl cannot foresee."""

    def __init__(self, broken: bool, **tensors):
        super().__init__(**tensors)
        self.broken = broken

    def get(self, key, default=None):
        if self.broken:
            raise RuntimeError("the mapping's storage went away")
        return super().get(key, default)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], str]:
    """What each rank of one 2-rank run of `_two_ranks` saw, and the parent's failure text."""
    from remapdsl.testing.ranks import run_ranks

    folder = tmp_path_factory.mktemp("two-ranks")
    tiny_checkpoint(folder / "ckpt", {"a.w": torch.arange(8, dtype=torch.float32).reshape(4, 2)}, {})
    with pytest.raises(AssertionError) as info:
        run_ranks(_two_ranks, 2, str(folder / "ckpt"), str(folder), timeout=60)
    seen = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    return seen, str(info.value)


@pytest.mark.distributed
def test_a_rank_whose_local_tensor_is_not_its_shard_is_e233(two_ranks):
    for seen in two_ranks[0]:
        (d,) = seen["E233"]
        assert d["code"] == "E233" and d["span"]["path"] == "t.remap" and d["span"]["line"] == 2, d
        assert d["message"] == "`b` is [2, 4] on rank 1, but its layout gives this rank [2, 2] of [2, 4] (on rank 1)"


@pytest.mark.distributed
def test_a_dtensor_with_a_partial_placement_is_e401(two_ranks):
    for seen in two_ranks[0]:
        (d,) = seen["E401"]
        assert d["code"] == "E401" and d["path"] == "b" and "partial values" in d["message"], d


@pytest.mark.distributed
def test_an_unexpected_error_on_one_rank_is_e411_on_every_rank(two_ranks):
    for seen in two_ranks[0]:
        (d,) = seen["E411"]
        assert d["code"] == "E411", d
        assert d["message"].startswith("1 of 2 ranks failed:\nrank 1: RuntimeError: the mapping's storage"), d


@pytest.mark.distributed
def test_a_value_that_is_no_tensor_is_named_on_every_rank(two_ranks):
    """A list where the state dict should hold a tensor (on rank 1): E232 at the rule, naming the
    key and what it is, on both ranks; not an AttributeError from deep inside."""
    for seen in two_ranks[0]:
        (d,) = seen["E232"]
        assert d["code"] == "E232" and "`b` is a list in the model, not a tensor" in d["message"], d
        assert "(on rank 1)" in d["message"] and d["span"]["line"] == 2, d


@pytest.mark.distributed
def test_a_failing_check_on_a_rank_reaches_the_parent_with_its_message(two_ranks):
    """remapdsl.testing.ranks.run_ranks: an AssertionError's message, and pytest's own outcomes
    (`Failed` derives from BaseException, not Exception), come back per rank, not as a crash."""
    text = two_ranks[1]
    assert "rank 0: rank zero's own check failed" in text, text
    assert "rank 1: " in text and "Failed: rank one's own check failed" in text, text
    assert "died" not in text and "no result" not in text, text


def _fails_a_check():
    pytest.fail("the check's own message")


def _raises_nothing():
    with pytest.raises(ValueError):
        pass


def _asserts():
    one, two = 1, 2
    assert one == two, "one is not two"


@pytest.mark.parametrize("call, message", [(_fails_a_check, "Failed: the check's own message"),
                                           (_raises_nothing, "Failed: DID NOT RAISE"),
                                           (_asserts, "AssertionError: one is not two")])
def test_a_worker_records_a_failed_check_with_its_message(call, message):
    """tests/gloo.py's `record`, which `record_cases` runs each case of a gloo worker with: a
    pytest outcome (a BaseException) is recorded with its message, not left to crash the worker."""
    from gloo import record

    seen = record(call)
    assert seen["type"] == "escaped" and message in seen["text"], seen
    assert record(lambda: None) is None


# ---- every documented code is asserted somewhere ---------------------------------------------


def documented_codes() -> dict[str, str]:
    """Code -> the doc that lists it as a table row `| E123 | ... |` (tests/test_docs.py checks
    that these are exactly the codes in remapdsl/)."""
    return {code: doc.name for doc in DOCS for code in re.findall(r"^\| (E\d{3}) \|", doc.read_text(), re.MULTILINE)}


def _codes(node: ast.AST) -> set[str]:
    return {code for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            for code in CODE.findall(n.value)}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _assigned(statements) -> dict[str, list[ast.AST]]:
    """Name -> the values assigned to it among `statements` (and, for a function, its body)."""
    values: dict[str, list[ast.AST]] = {}
    for statement in statements:
        for node in ast.walk(statement):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in _names(target):
                        values.setdefault(name, []).append(node.value)
    return values


def asserted_codes(source: str) -> set[str]:
    """The codes a test source asserts: a string holding the code in an `assert`'s condition (not
    its message) or `pytest.raises(match=...)`, or in the value of a name one of those uses that is
    assigned in the same function; in a `pytest.mark.parametrize` decorator, or the value of a
    module-level name it uses.
    A code in a comment, a docstring, a message or a print does not count."""
    tree = ast.parse(source)
    module = _assigned(s for s in tree.body if isinstance(s, (ast.Assign, ast.AnnAssign)))
    found: set[str] = set()

    def used(node: ast.AST, scope: dict[str, list[ast.AST]]) -> None:
        found.update(_codes(node))
        for name in _names(node):
            for value in scope.get(name, []):
                found.update(_codes(value))

    for function in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        scope = _assigned(function.body) if function is not tree else {}
        for decorator in getattr(function, "decorator_list", []):
            if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", None) == "parametrize":
                used(decorator, module)
        for node in ast.walk(function):
            if isinstance(node, ast.Assert):
                used(node.test, scope)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "raises":
                for keyword in node.keywords:
                    if keyword.arg == "match":
                        used(keyword.value, scope)
    return found


def test_the_collector_counts_assertions_only():
    source = '''
"""E901 in a docstring."""
import pytest

CASES = [("x", "E902")]
UNUSED = ["E903"]


@pytest.mark.parametrize("text, code", CASES)
def test_a(text, code):
    # E904 in a comment
    print("E905")
    expected = {"a": "E906"}["a"]
    message = "E907"
    assert run(text) == code and run(text) == expected, message


def test_b():
    with pytest.raises(Error, match=r"error\\[E908\\]"):
        run("E909")
    assert [d.code for d in diagnostics] == ["E910"]
'''
    assert sorted(asserted_codes(source)) == ["E902", "E906", "E908", "E910"]


def evidence() -> dict[str, str]:
    """Code -> where a test asserts it: an .err file of the error or binding corpus (which
    tests/test_error_corpus.py and tests/test_bind_corpus.py compare with the rendered error, codes
    and spans included), or a test source."""
    found: dict[str, str] = {}
    for err in sorted(CORPUS.rglob("*.err")):
        for code in RENDERED.findall(err.read_text(encoding="utf-8", errors="replace")):
            found.setdefault(code, err.relative_to(ROOT).as_posix())
    for test in sorted(TESTS.rglob("*.py")):
        for code in asserted_codes(test.read_text(encoding="utf-8")):
            found.setdefault(code, test.relative_to(ROOT).as_posix())
    return found


# Codes added while their tests are still being written (issue #18), each with what raises it. Once a
# test asserts one, the meta-test below fails until it leaves this list: the list only shrinks.
PENDING: dict[str, str] = {
    "E602": "remapdsl/dcp/metadata.py: a runtime dtype torch has no type for",
}


def test_every_documented_code_is_asserted_by_a_test():
    documented, found = documented_codes(), evidence()
    assert len(documented) > 100
    assert set(PENDING) <= set(documented), "PENDING names a code no doc lists"
    done = sorted(set(PENDING) & set(found))
    assert done == [], f"asserted now: remove {done} from PENDING"
    missing = sorted(set(documented) - set(found) - set(PENDING))
    assert missing == [], ("documented codes no test triggers and asserts (add a case to tests/corpus/errors/ "
                           "or a test that asserts the code and its span, key or file):\n"
                           + "\n".join(f"  {code} ({documented[code]})" for code in missing))


def test_a_layout_plan_of_torch_placements_is_e402_naming_the_pattern():
    """A user writes torch's own placements into a plan: a located E402, not pydantic's validation text."""
    from torch.distributed.tensor import Shard as TorchShard

    from remapdsl.sharding import LayoutPlan

    with pytest.raises(remapdsl.RemapError) as info:
        LayoutPlan.from_mapping({"layers.*.q_proj": [TorchShard(0)]}, prefix="model.")
    (d,) = info.value.diagnostics
    assert d.code == "E402" and d.path == "model.layers.*.q_proj" and d.message.startswith("torch's `Shard"), d


class _Planner:
    """The two calls a StorageReader makes of a LoadPlanner: a planner other than DCP's default
    (which never asks for these) may ask for bytes, or for a box outside the tensor."""

    def __init__(self):
        self.committed = []

    def resolve_tensor(self, item):
        return torch.empty(tuple(item.lengths), dtype=torch.float32)

    def commit_tensor(self, item, tensor):
        self.committed.append(item)


def _request(key: str, offsets, lengths, kind=None):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    zero = torch.Size([0] * len(lengths))
    return ReadItem(type=kind or LoadItemType.TENSOR, dest_index=MetadataIndex(key, zero), dest_offsets=zero,
                    storage_index=MetadataIndex(key, zero), storage_offsets=torch.Size(offsets),
                    lengths=torch.Size(lengths))


@pytest.mark.parametrize("what", ["bytes", "outside"])
def test_a_custom_planners_request_the_rules_cannot_serve(what):
    """E603 (a value asked for as bytes) and E604 (a box past the tensor's end), naming the key; no
    tensor is committed."""
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

    from remapdsl.dcp import RuleStorageReader

    reader = RuleStorageReader(ROOT / "examples" / "tiny-qwen3-moe", "qwen3_moe")
    key, meta = next((k, m) for k, m in reader.read_metadata().state_dict_metadata.items() if len(m.size) == 2)
    rows, cols = meta.size
    item = (_request(key, (0, 0), (rows, cols), LoadItemType.BYTE_IO) if what == "bytes"
            else _request(key, (rows // 2, 0), (rows, cols)))
    planner = _Planner()
    with pytest.raises(remapdsl.RemapError) as info:
        reader.read_data(LoadPlan([item]), planner)
    (d,) = info.value.diagnostics
    assert d.code == {"bytes": "E603", "outside": "E604"}[what] and f"`{key}`" in d.message, d
    assert planner.committed == []
