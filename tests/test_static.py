"""Static checks: every inconsistency a rule program can have without a checkpoint, located."""

import pytest

from remapdsl import RuleCheckError
from remapdsl.compile.quantized import check_formats
from remapdsl.language import ir, rules_from_text


def check_error(text: str) -> RuleCheckError:
    """The static checks' error: the language's, then the format calls' against the registered formats."""
    with pytest.raises(RuleCheckError) as info:
        check_formats(rules_from_text(text, "t.remap"))
    return info.value


@pytest.mark.parametrize("text, code, line, column", [
    ("a -> c.{L}\n", "E101", 1, 9),
    ("a.{L}.b -> c\n", "E102", 1, 3),
    ("a.{L} -> c.{L} | stack(E, dim=0)\n", "E103", 1, 18),
    ("a.{P:seg}.{E} -> c.{E} | stack(P, dim=0)\n", "E103", 1, 26),
    ("a.{E} -> c.{E} | stack(E, dim=0)\n", "E104", 1, 18),
    ("a.{E} -> c.{E} | unstack(E, dim=0)\n", "E105", 1, 18),
    ("a -> c | unstack(E, dim=0)\n", "E105", 1, 10),
    ("a.{P:path} -> c.{P + 1}\n", "E106", 1, 18),
    ("otherwise {P:path} -> {P}\notherwise x.{Q:path} -> {Q}\n", "E107", 2, 1),
    ("otherwise a, b -> c | concat(dim=0)\n", "E108", 1, 1),
    ("a.{L}.b.{L} -> c.{L}\n", "E109", 1, 9),
    ("a -> b | concat(dim=0)\n", "E110", 1, 10),
    ("a.{q,k} -> b\n", "E111", 1, 1),
    ("a.{q,k,v} -> b.{x,y}\n", "E111", 1, 1),
    ("a -> b.{x,y} | split(dim=0, sizes=[1, 2, 3])\n", "E111", 1, 16),
    ("dequantize a.{x,y} -> b | fp8_tensor(to=bfloat16)\n", "E111", 1, 1),
    ("a -> b | transpose(0, 1.5)\n", "E120", 1, 23),
    ("a -> b | reshape(3)\n", "E120", 1, 18),
    ("a -> b | cast(bfloat61)\n", "E121", 1, 15),
    ("a -> b | cast(3)\n", "E121", 1, 15),
    ("dequantize a, s -> b | fp8_block(block=[128, 128], scale=e8m1, to=bfloat16)\n", "E121", 1, 58),
    ("a.{q,k} -> b | interleave(dim=0, groups=0)\n", "E122", 1, 41),
    ("a -> b.{x,y} | split(dim=0, sizes=[4, -2])\n", "E122", 1, 39),
    ("a -> b | reshape([-1, 4, -1])\n", "E123", 1, 26),
    ("a -> b | permute([0, 0, 1])\n", "E124", 1, 18),
    ("dequantize a, s -> b | fp8_block(block=[128], to=bfloat16)\n", "E125", 1, 40),
    ("dequantize a, s -> b | fp8_block(block=[0, 128], to=bfloat16)\n", "E122", 1, 41),
    ("dequantize a, s -> b | fp8_block(to=bfloat16)\n", "E128", 1, 24),
    ("dequantize a, s -> b | fp8_block(blok=[1, 1], to=bfloat16)\n", "E128", 1, 34),
    ("dequantize a, s -> b | fp8_block(block=[1, 1], block=[2, 2], to=bfloat16)\n", "E128", 1, 48),
    ("quantized a, s | fp8_block(block=[1, 1], float32)\n", "E128", 1, 42),
    ("dequantize a, s -> b | fp8_blok(block=[1, 1], to=bfloat16)\n", "E035", 1, 24),
    ("quantized a, s | fp8_block(block=[1, 1], scale=1)\n", "E121", 1, 48),
    ("quantized a, s | fp8_block(block=1)\n", "E120", 1, 34),
    ("let X = Y + 1\n", "E130", 1, 9),
    ("let X = 1\nlet X = 2\n", "E131", 2, 1),
    ("let L = 1\na.{L} -> b.{L}\n", "E132", 2, 3),
    ("macro m() = transpose(0, 1)\nmacro m() = transpose(1, 0)\n", "E133", 2, 1),
    ("a -> b | concatt(dim=0)\n", "E134", 1, 10),
    ("macro m(n) = reshape([n, -1])\na -> b | m(k=2)\n", "E135", 2, 12),
    ("macro m(n) = reshape([n, -1])\na -> b | m()\n", "E135", 2, 10),
])
def test_static_errors(text, code, line, column):
    error = check_error(text)
    first = error.diagnostic
    assert first.code == code, error.render()
    assert (first.span.line, first.span.column) == (line, column), error.render()


def test_unknown_name_suggests_a_let():
    error = check_error("let HIDDEN = 4\nlet Y = HIDEN * 2\n")
    assert error.diagnostic.hint == "did you mean `HIDDEN`?"


def test_let_used_before_its_definition_is_unknown():
    error = check_error("let A = B\nlet B = 1\n")
    assert error.diagnostic.code == "E130"


def test_unknown_op_suggests_macros_too():
    error = check_error("macro rope_fix(n) = reshape([n, -1])\na -> b | rope_fx(n=2)\n")
    assert error.diagnostic.hint == "did you mean `rope_fix`?"


def test_macro_may_only_use_earlier_macros_so_it_cannot_recurse():
    error = check_error("macro m(n) = m(n=n)\n")
    assert error.diagnostic.code == "E134"


def test_consumed_capture_inside_a_macro_counts():
    rules_from_text("macro stack_experts() = stack(E, dim=0)\na.{E}.w -> b | stack_experts()\n")
    # the same rule without the macro's stack leaves E unconsumed: the macro is what counts
    assert check_error("macro keep_experts() = transpose(0, 1)\na.{E}.w -> b | keep_experts()\n"
                       ).diagnostic.code == "E102"


def test_a_macro_that_calls_another_checks_as_the_ops_it_expands_to():
    """The inner macro's ops count: its concat combines the rule's two sources (a concat of one source is
    E110), its stack consumes the capture."""
    nested = "macro c() = concat(dim=0)\nmacro d() = c()\n"
    rules_from_text(nested + "a.{x,y} -> b | d()\n")
    assert check_error(nested + "a.x -> b | d()\n").diagnostic.code == "E110"
    rules_from_text("macro s() = stack(E, dim=0)\nmacro t() = s()\na.{E}.w -> b | t()\n")


def test_let_types_flow_into_op_arguments():
    rules_from_text("let DT = bfloat16\nlet G = 2\na.{q,k} -> b | interleave(dim=0, groups=G) | cast(DT)\n")
    error = check_error("let G = 2.5\na.{q,k} -> b | interleave(dim=0, groups=G)\n")
    assert error.diagnostic.code == "E120"


def test_config_values_are_checked_later_not_now():
    rules = rules_from_text("a.{q,k} -> b | interleave(dim=0, groups=config.num_key_value_heads)\n")
    (op,) = rules.statements[0].ops
    assert isinstance(op.groups, ir.Config) and op.groups.path == ("num_key_value_heads",)
    # a constant in the same place is checked now
    assert check_error("a.{q,k} -> b | interleave(dim=0, groups=0)\n").diagnostic.code == "E122"


def test_valid_programs_pass():
    rules = rules_from_text(
        "remap 1\n"
        "let KV = config.num_key_value_heads\n"
        "{input,post_attention}_layernorm.weight -> {attn,mlp}_norm.weight\n"
        "layers.{L}.{q,k,v}_proj.weight -> layers.{L}.wqkv | interleave(dim=0, groups=KV)\n"
        "layers.{L}.experts.{E}.{gate,up}_proj.weight -> layers.{L}.w13\n"
        "    | stack(E, dim=0)\n    | concat(dim=1)\n"
        "fused.{L}.qkv -> layers.{L}.{q,k,v} | split(dim=0, sizes=[8, 2, 2])\n"
        "fused.{L}.experts -> layers.{L}.experts.{X}.w | unstack(X, dim=0)\n"
        "a.{L}.b -> c.{L - 1}.b when L > 0\n"
        "drop model.layers.{L}.** when L >= config.num_hidden_layers\n"
        "otherwise {P:path} -> {P}\n",
        "t.remap",
    )
    assert len(rules.statements) == 10


def test_every_error_of_the_program_is_reported_at_once():
    error = check_error("let A = B\na -> c.{L}\nx.{q,k} -> y\n")
    assert [d.code for d in error.diagnostics] == ["E130", "E101", "E111"]


def test_an_unknown_format_suggests_a_known_one():
    error = check_error("dequantize a, s -> b | fp8_blok(block=[1, 1], to=bfloat16)\n")
    assert error.diagnostic.hint == "did you mean `fp8_block`?"
    error = check_error("quantized a, s | int8(to=bfloat16)\n")
    assert error.diagnostic.hint.startswith("formats: fp8_block, fp8_channel, fp8_tensor, mxfp4, nvfp4")


def test_a_block_of_the_wrong_length_names_its_sizes():
    error = check_error("dequantize a, s -> b | fp8_block(block=[1, 2, 3], to=bfloat16)\n")
    assert error.diagnostic.message == "`block` takes two sizes, [rows, cols]; got 3"

