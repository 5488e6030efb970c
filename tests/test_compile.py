"""The compiler against real safetensors files: bindings, blocks, errors, and the fused layouts
transformers does not provide, checked against direct torch operations on whole tensors."""


import pydantic
import pytest
import torch
from checkpoints import tiny_checkpoint

import remapdsl
from remapdsl import BindError
from remapdsl.language import rules_from_text


def compile_text(text, folder, config=None, strict=True):
    inventory = remapdsl.open_checkpoint(folder)
    return remapdsl.compile_rules(rules_from_text(text, "t.remap"), inventory, config or {}, strict=strict)


def load_text(text, folder, config=None):
    rules = rules_from_text(text, "t.remap")
    compiled = remapdsl.compile_rules(rules, remapdsl.open_checkpoint(folder), config or {})
    target = compiled.empty_state_dict()
    report = remapdsl.load(target, folder, rules, config=config or {})
    return target, report


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def bind_error(text, folder, config=None) -> BindError:
    with pytest.raises(BindError) as info:
        compile_text(text, folder, config)
    return info.value


def test_llama_fused_grouped_qkv_and_interleaved_gate_up(tmp_path):
    nh, nkv, hd, hidden, inter, layers = 8, 2, 4, 16, 32, 2
    tensors = {"model.embed_tokens.weight": randn(50, hidden), "model.norm.weight": randn(hidden),
               "lm_head.weight": randn(50, hidden)}
    for L in range(layers):
        p = f"model.layers.{L}."
        tensors |= {p + "input_layernorm.weight": randn(hidden),
                    p + "post_attention_layernorm.weight": randn(hidden),
                    p + "self_attn.q_proj.weight": randn(nh * hd, hidden),
                    p + "self_attn.k_proj.weight": randn(nkv * hd, hidden),
                    p + "self_attn.v_proj.weight": randn(nkv * hd, hidden),
                    p + "self_attn.o_proj.weight": randn(hidden, nh * hd),
                    p + "mlp.gate_proj.weight": randn(inter, hidden),
                    p + "mlp.up_proj.weight": randn(inter, hidden),
                    p + "mlp.down_proj.weight": randn(hidden, inter)}
    config = {"num_attention_heads": nh, "hidden_size": hidden, "head_dim": hd, "num_key_value_heads": nkv, "intermediate_size": inter, "tie_word_embeddings": False}
    folder = tiny_checkpoint(tmp_path, tensors, config)
    rules = remapdsl.load_rules("rules/llama_fused.remap")
    compiled = remapdsl.compile_rules(rules, remapdsl.open_checkpoint(folder), config)
    target = {d.runtime_key: torch.empty(d.shape) for d in compiled.runtime_tensors}
    remapdsl.load(target, folder, rules)
    for L in range(layers):
        p = f"model.layers.{L}."
        q, k, v = (tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        # Megatron: per KV group g, its nh/nkv query heads, then its k head, then its v head
        expected = torch.cat([torch.cat([q.chunk(nkv)[g], k.chunk(nkv)[g], v.chunk(nkv)[g]])
                              for g in range(nkv)])
        assert torch.equal(target[f"layers.{L}.attn.wqkv.weight"], expected)
        gate, up = tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]
        blocks = inter // 16
        expected = torch.cat([torch.cat([gate.chunk(blocks)[i], up.chunk(blocks)[i]]) for i in range(blocks)])
        assert torch.equal(target[f"layers.{L}.mlp.w13.weight"], expected)
        assert torch.equal(target[f"layers.{L}.attn.wo.weight"], tensors[p + "self_attn.o_proj.weight"])
    assert torch.equal(target["output.weight"], tensors["lm_head.weight"])


def test_experts_stack_in_numeric_order(tmp_path):
    experts = {f"m.experts.{e}.w": torch.full((2, 3), float(e)) for e in range(12)}
    folder = tiny_checkpoint(tmp_path, experts, {})
    target, report = load_text("m.experts.{E}.w -> w | stack(E, dim=0)\n", folder)
    assert target["w"][:, 0, 0].tolist() == [float(e) for e in range(12)]
    assert report.bytes_read == 12 * 2 * 3 * 4


def test_expert_gap_is_an_error_never_a_reslot(tmp_path):
    experts = {f"m.experts.{e}.w": randn(2, 3) for e in (0, 1, 2, 5)}
    folder = tiny_checkpoint(tmp_path, experts, {})
    error = bind_error("m.experts.{E}.w -> w | stack(E, dim=0)\n", folder)
    assert error.diagnostic.code == "E205"
    assert "found {0-2, 5}, missing {3-4}" in error.diagnostic.message
    assert error.diagnostic.span.line == 1


def test_stack_with_start_for_a_slice_of_the_experts(tmp_path):
    experts = {f"m.experts.{e}.w": torch.full((2,), float(e)) for e in (4, 5, 6)}
    folder = tiny_checkpoint(tmp_path, experts, {})
    target, _ = load_text("m.experts.{E}.w -> w | stack(E, dim=0, start=4)\n", folder)
    assert target["w"][:, 0].tolist() == [4.0, 5.0, 6.0]


def test_pattern_matching_nothing_points_at_the_pattern_with_a_suggestion(tmp_path):
    folder = tiny_checkpoint(tmp_path, {"model.layers.0.self_attn.o_proj.weight": randn(2, 2)}, {})
    error = bind_error("model.layers.{L}.self_atn.o_proj.weight -> wo.{L}\n", folder)
    d = error.diagnostic
    assert (d.code, d.span.line, d.span.column) == ("E201", 1, 1)
    assert d.hint == "did you mean `self_attn`?"


def test_unconsumed_tensor_is_an_error_unless_lenient(tmp_path):
    folder = tiny_checkpoint(tmp_path, {"a": randn(2), "b": randn(2)}, {})
    error = bind_error("a -> x\n", folder)
    assert error.diagnostic.code == "E202" and "`b`" in error.diagnostic.message
    compiled = compile_text("a -> x\n", folder, strict=False)
    assert [d.runtime_key for d in compiled.runtime_tensors] == ["x"]


def test_destination_produced_twice(tmp_path):
    folder = tiny_checkpoint(tmp_path, {"a": randn(2), "b": randn(2)}, {})
    error = bind_error("a -> x\nb -> x\n", folder)
    assert error.diagnostic.code == "E203" and error.diagnostic.span.line == 2
    assert error.diagnostic.hint == "first by the rule at t.remap:1:1", error.diagnostic.hint


def test_incomplete_binding_names_the_missing_key(tmp_path):
    tensors = {f"l.{L}.{n}": randn(2, 2) for L in range(2) for n in ("gate", "up")}
    del tensors["l.1.up"]
    folder = tiny_checkpoint(tmp_path, tensors, {})
    error = bind_error("l.{L}.{gate,up} -> w.{L} | concat(dim=0)\n", folder)
    assert error.diagnostic.code == "E204"
    assert "`l.1.gate` but not `l.1.up`" in error.diagnostic.message


def test_concat_of_mismatched_shapes_names_both(tmp_path):
    folder = tiny_checkpoint(tmp_path, {"a.x": randn(2, 3), "a.y": randn(2, 4)}, {})
    error = bind_error("a.{x,y} -> w | concat(dim=0)\n", folder)
    assert error.diagnostic.code == "E207"
    assert "[2, 3] and [2, 4]" in error.diagnostic.message


def test_wildcard_taking_two_keys_for_one_target_is_an_error(tmp_path):
    folder = tiny_checkpoint(tmp_path, {"m.a.inv_freq": randn(2), "m.b.inv_freq": randn(2)}, {})
    error = bind_error("m.*.inv_freq -> freq\n", folder)
    d = error.diagnostic
    assert (d.code, d.span.line, d.span.column) == ("E208", 1, 1), str(error)
    assert "`m.a.inv_freq`" in d.message and "`m.b.inv_freq`" in d.message, d.message


def test_drop_with_guard_and_otherwise(tmp_path):
    tensors = {f"model.layers.{L}.w": randn(2) for L in range(3)} | {"extra.bias": randn(2)}
    folder = tiny_checkpoint(tmp_path, tensors, {"num_hidden_layers": 2})
    compiled = compile_text("drop model.layers.{L}.** when L >= config.num_hidden_layers\n"
                            "model.layers.{L}.w -> layers.{L}.w\notherwise {P:path} -> {P}\n",
                            folder, {"num_hidden_layers": 2})
    assert [d.runtime_key for d in compiled.runtime_tensors] == ["extra.bias", "layers.0.w", "layers.1.w"]
    assert compiled.dropped == ("model.layers.2.w",)


def test_tied_embedding_fans_out(tmp_path):
    source = randn(4, 2)
    folder = tiny_checkpoint(tmp_path, {"model.embed_tokens.weight": source}, {})
    target, report = load_text("model.embed_tokens.weight -> embed\n"
                               "model.embed_tokens.weight -> head when config.tie\n",
                               folder, {"tie": True})
    assert sorted(target) == ["embed", "head"]
    assert torch.equal(target["embed"], source) and torch.equal(target["head"], source)
    assert target["embed"].data_ptr() != target["head"].data_ptr()  # two tensors, not one aliased
    assert report.bytes_read == 2 * source.nbytes  # each target reads its own copy


def test_cast_and_value_steps(tmp_path):
    source = randn(3, 4)
    folder = tiny_checkpoint(tmp_path, {"norm": source}, {})
    target, _ = load_text("norm -> w | add(1) | cast(bfloat16)\n", folder)
    assert target["w"].dtype == torch.bfloat16
    assert torch.equal(target["w"], (source + 1).to(torch.bfloat16))


def test_a_cast_statement_casts_every_floating_tensor_a_rule_does_not_cast_itself(tmp_path):
    a, b, c = randn(4, 6, dtype=torch.bfloat16), randn(8, 2, dtype=torch.bfloat16), randn(3, dtype=torch.float32)
    folder = tiny_checkpoint(tmp_path / "ckpt", {"a": a, "b": b, "c": c, "ids": torch.arange(5)}, {})
    text = ("let DT = config.dtype ?? float32\ncast DT\n"
            "a -> A | add(1)\n"                 # cast at the end of its ops
            "b -> B | cast(float64) | scale(2)\n"  # the rule's own cast wins
            "macro keep32() = cast(float32)\n"
            "c -> C | keep32()\n"               # a cast inside a macro counts
            "ids -> I\n")                       # integers are never cast
    target, _ = load_text(text, folder, {"dtype": "float16"})
    assert {k: v.dtype for k, v in target.items()} == {
        "A": torch.float16, "B": torch.float64, "C": torch.float32, "I": torch.int64}
    assert torch.equal(target["A"], (a + 1).to(torch.float16))
    assert torch.equal(target["B"], b.double() * 2) and torch.equal(target["I"], torch.arange(5))


def test_a_cast_statement_saves_back_byte_for_byte(tmp_path):
    folder = tiny_checkpoint(tmp_path / "ckpt", {"w": randn(4, 8, dtype=torch.bfloat16),
                                                 "q": randn(8, 3, dtype=torch.bfloat16)}, {})
    text = "cast float32\nw -> W\nq -> Q | rope_unpermute(heads=2)\n"
    target, _ = load_text(text, folder)
    assert target["W"].dtype == torch.float32
    remapdsl.save(target, tmp_path / "out", rules_from_text(text, "t.remap"), like=folder, config={})
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_transpose_and_pad(tmp_path):
    source = randn(3, 5)
    folder = tiny_checkpoint(tmp_path, {"w": source}, {})
    target, report = load_text("w -> t | transpose(0, 1) | pad(dim=1, to=4, value=7)\n", folder)
    assert torch.equal(target["t"][:, :3], source.T)
    assert (target["t"][:, 3] == 7).all()
    assert report.bytes_read == source.numel() * 4


def test_model_mismatches_are_reported_before_reading(tmp_path):
    folder = tiny_checkpoint(tmp_path, {"a": randn(2, 3)}, {})
    rules = rules_from_text("a -> x\n", "t.remap")
    with pytest.raises(BindError) as info:
        remapdsl.load({"x": torch.empty(3, 2), "y": torch.empty(1)}, folder, rules)
    assert sorted((d.code, d.message, d.span and d.span.line) for d in info.value.diagnostics) == [
        ("E231", "model tensor `y` is produced by no rule", None),
        ("E232", "`x` is [3, 2] float32 in the model, but the rules make it [2, 3] float32", 1)]
    with pytest.raises(BindError) as info:
        remapdsl.load({"z": torch.empty(2, 3)}, folder, rules)
    assert sorted((d.code, d.message, d.span and d.span.line) for d in info.value.diagnostics) == [
        ("E230", "the rules produce `x`, but the model has no such tensor", 1),
        ("E231", "model tensor `z` is produced by no rule", None)]


@pytest.mark.parametrize("call", ["load", "ingest", "save", "export"])
def test_a_tensor_missing_from_one_process_is_e230_naming_a_misspelling_no_rule_makes(call, tmp_path):
    """One process must hold every runtime tensor: a state dict without `norm.w` is E230 on every call, its
    hint the close name no rule makes (`norm.wt`), never a close one a rule already fills (`norm.b`)."""
    folder = tiny_checkpoint(tmp_path / "ckpt", {"norm.w": randn(4), "norm.b": randn(4)}, {})
    rules = rules_from_text("norm.w -> norm.w\nnorm.b -> norm.b\n", "t.remap")
    for state, hint in (({"norm.b": torch.empty(4)}, None),
                        ({"norm.b": torch.empty(4), "norm.wt": torch.empty(4)}, "did you mean `norm.wt`?")):
        with pytest.raises(BindError) as info:
            {"load": lambda: remapdsl.load(state, folder, rules, config={}),
             "ingest": lambda: remapdsl.ingest(state, {}, rules, like=folder, config={}),
             "save": lambda: remapdsl.save(state, tmp_path / "out", rules, like=folder, config={}),
             "export": lambda: list(remapdsl.export(state, rules, like=folder, config={}))}[call]()
        e230 = [d for d in info.value.diagnostics if d.code == "E230"]
        assert [(d.message, d.hint) for d in e230] == [("the rules produce `norm.w`, but the model has no such "
                                                         "tensor", hint)]
    assert not (tmp_path / "out").exists()

def test_a_runtime_key_the_rules_do_not_make_is_a_key_error_naming_it(tmp_path):
    """`runtime_tensor` (and `empty_state_dict(keys)` through it) finds each key the rules make, and for one
    they do not, before, between or after them in order, raises KeyError with that key."""
    folder = tiny_checkpoint(tmp_path, {"b": randn(2), "d": randn(3)}, {})
    compiled = compile_text("{b,d} -> {b,d}\n", folder)
    assert [compiled.runtime_tensor(k).shape for k in ("b", "d")] == [(2,), (3,)]
    for key in ("a", "c", "e"):
        with pytest.raises(KeyError) as info:
            compiled.empty_state_dict([key])
        assert info.value.args == (key,)


def test_compiled_is_frozen_serializable_and_stable(tmp_path):
    folder = tiny_checkpoint(tmp_path, {f"e.{i}.w": randn(2, 2) for i in range(3)}, {})
    a = compile_text("e.{E}.w -> w | stack(E, dim=1)\n", folder)
    b = compile_text("e.{E}.w -> w | stack(E, dim=1)\n", folder)
    assert a.digest() == b.digest()
    assert type(a).model_validate_json(a.model_dump_json()) == a
    with pytest.raises(pydantic.ValidationError) as info:
        a.runtime_tensors = ()
    assert [e["type"] for e in info.value.errors()] == ["frozen_instance"]
    assert a.runtime_tensors == b.runtime_tensors and len(a.runtime_tensors) == 1


def test_explain_command(tmp_path, capsys):
    from remapdsl.cli import main

    assert main(["explain", "rules/qwen3_moe.remap", "--checkpoint", "examples/tiny-qwen3-moe",
                 "--key", "*layers.1.mlp.experts.down_proj"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.experts.down_proj  [4, 16, 8] float32" in out
    assert "[3, 0:16, 0:8] <- model.layers.1.mlp.experts.3.down_proj.weight [0:16, 0:8]" in out


def test_bundled_example_is_what_its_script_writes(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("make_tiny", "examples/make_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bundled = Path("examples/tiny-qwen3-moe/model.safetensors")
    from safetensors.torch import load_file

    written = load_file(bundled)
    fresh = module.tensors()
    assert written.keys() == fresh.keys()
    assert all(torch.equal(written[k], fresh[k]) for k in fresh)


def test_digest_is_the_same_in_another_process(tmp_path):
    import subprocess
    import sys

    script = ("import remapdsl; r = remapdsl.load_rules('rules/qwen3_moe.remap'); "
              "i = remapdsl.open_checkpoint('examples/tiny-qwen3-moe'); "
              "print(remapdsl.compile_rules(r, i).digest())")
    digests = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True, env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout
               for seed in ("1", "2")}
    inventory = remapdsl.open_checkpoint("examples/tiny-qwen3-moe")
    here = remapdsl.compile_rules(remapdsl.load_rules("rules/qwen3_moe.remap"), inventory).digest()
    assert digests == {here + "\n"}


def test_many_short_runs_are_copied_from_the_mapped_file(tmp_path, monkeypatch):
    import remapdsl.checkpoint.reader as files
    from remapdsl.runtime.read import run_load_plan
    from remapdsl.sharding import LayoutPlan, Mesh

    source, other = randn(64, 48), randn(48, 64)
    folder = tiny_checkpoint(tmp_path, {"w": source, "o": other}, {})
    # a: a column shard (read straight into the tensor); b: one run, transposed; c: value steps
    rules = rules_from_text("w -> a\no -> b | transpose(0, 1)\nw -> c | scale(2) | add(1)\n", "t.remap")
    plan = LayoutPlan.from_mapping({"a": "rowwise", "b": "rowwise", "c": "rowwise"}, mesh_dim="tp")
    for many in (10**9, 0):  # per-run reads, then the mapped-file copy for every item
        monkeypatch.setattr(files, "MANY_RUNS", many)
        for rank in range(3):
            mesh = Mesh.of({"tp": 3})
            local = {k: torch.full((64, 16), float("nan")) for k in "abc"}
            compiled = remapdsl.compile_rules(rules, remapdsl.open_checkpoint(folder), {})
            inventory = remapdsl.open_checkpoint(folder)
            report = remapdsl.plan_rank(compiled, inventory, plan, mesh, rank)  # a rank of 3, one process
            assert {i.runtime_key: i.runs.count for i in report.items} == {"a": 64, "b": 1, "c": 64}
            run_load_plan(report, inventory, local)
            cols = slice(16 * rank, 16 * rank + 16)
            assert torch.equal(local["a"], source[:, cols])
            assert torch.equal(local["b"], other.T[:, cols])
            assert torch.equal(local["c"], (source[:, cols] * 2 + 1))
            assert report.bytes_read == report.bytes_owned == 3 * 64 * 16 * 4


README_TIED = ("model.embed_tokens.weight -> embed.weight\n"
               "lm_head.weight -> output.weight when not (config.tie_word_embeddings ?? false)\n")


def test_a_guard_that_is_false_switches_its_rule_off(tmp_path):
    """The README's example on the tied checkpoint it is written for: no lm_head.weight, no E201."""
    folder = tiny_checkpoint(tmp_path, {"model.embed_tokens.weight": randn(8, 4)}, {})
    compiled = compile_text(README_TIED, folder, {"tie_word_embeddings": True})
    assert [d.runtime_key for d in compiled.runtime_tensors] == ["embed.weight"]
    error = bind_error(README_TIED, folder, {"tie_word_embeddings": False})
    d = error.diagnostic
    assert (d.code, d.span.line, d.span.column) == ("E201", 2, 1)
    assert "its guard `not (config.tie_word_embeddings ?? false)` holds for this config" in d.hint
    assert "`optional`" in d.hint


def test_a_switched_off_rule_consumes_nothing(tmp_path):
    """A tied checkpoint that still stores lm_head.weight: the rule is off, so the key is left over."""
    folder = tiny_checkpoint(tmp_path, {"model.embed_tokens.weight": randn(8, 4), "lm_head.weight": randn(8, 4)},
                             {})
    assert bind_error(README_TIED, folder, {"tie_word_embeddings": True}).diagnostic.code == "E202"


def test_a_guard_over_captures_that_no_binding_satisfies_switches_the_rule_off(tmp_path):
    folder = tiny_checkpoint(tmp_path, {f"m.{L}.w": randn(2) for L in range(3)} | {"m.2.v": randn(2)}, {})
    rules = "m.{L}.w -> w.{L}\nm.{L}.w, m.{L}.x -> x.{L} when L >= 5 | concat(dim=0)\nm.2.v -> v\n"
    assert [d.runtime_key for d in compile_text(rules, folder).runtime_tensors] == ["v", "w.0", "w.1", "w.2"]
    error = bind_error(rules.replace("L >= 5", "L >= 1"), folder)
    assert error.diagnostic.code == "E201"
    assert "its guard `L >= 1` holds for (L=1)" in error.diagnostic.hint
    # the guard also excludes incomplete bindings: layer 2 has v, layers 0 and 1 do not
    rules = "m.{L}.w -> w.{L}\nm.{L}.w, m.{L}.v -> x.{L} when L < 2 | concat(dim=0)\nm.2.v -> v\n"
    with pytest.raises(BindError) as info:
        compile_text(rules, folder)
    assert {d.code for d in info.value.diagnostics} == {"E204"}  # L=0 and L=1 lack v
    rules = "m.{L}.w -> w.{L}\nm.{L}.w, m.{L}.v -> x.{L} when L == 2 | concat(dim=0)\n"
    assert "x.2" in {d.runtime_key for d in compile_text(rules, folder).runtime_tensors}


def test_an_optional_rule_whose_pattern_matches_nothing_is_no_error(tmp_path):
    folder = tiny_checkpoint(tmp_path, {"a.w": randn(2)}, {})
    compiled = compile_text("a.w -> b\noptional lm_head.weight -> out when 1 < 2\n", folder)
    assert [(d.runtime_key, d.ckpt_keys) for d in compiled.runtime_tensors] == [("b", ("a.w",))]


@pytest.mark.parametrize("rule, code", [
    ("m.{L}.w -> layers.{L - 1}.w\n", "E213"),
    ("let OFF = 0 - 3\nm.{L}.w -> layers.{L + OFF}.w\n", "E213"),
    ("m.{L}.w -> layers.{L - 1}.{a,b} | chunk(dim=0, n=2)\n", "E213"),
    ("m.{L}.w -> layers.{L}.e.{E} | unstack(E, dim=0, start=-1)\n", "E213"),
    ("let N = config.n\nm.{L}.w -> layers.{L} | pad(dim=0, to=N)\n", "E209"),
    ("let N = config.n\nm.{L}.w -> layers.{L} | repeat(dim=0, times=N // 1000)\n", "E209"),
    ("let N = config.n * config.n\nm.{L}.w -> layers.{L}\n", "E209"),
    ("let N = config.zero\nm.{L}.w -> layers.{L} | repeat(dim=0, times=N)\n", "E207"),
    ("let N = config.zero\nm.{L}.w -> layers.{L}.{a,b} | chunk(dim=0, n=N)\n", "E207"),
])
def test_impossible_keys_and_values_are_errors_at_the_rule(tmp_path, rule, code):
    folder = tiny_checkpoint(tmp_path, {"m.0.w": randn(2), "m.1.w": randn(2)}, {})
    error = bind_error(rule, folder, {"n": 10**15, "zero": 0})
    d = error.diagnostic
    assert d.code == code, str(error)
    at_let = code == "E209" and "*" in rule  # the arithmetic that overflows is the `let`'s
    assert d.span is not None and d.span.line == (1 if at_let else rule.count("\n"))


def test_the_guard_guarding_a_negative_index_is_enough(tmp_path):
    folder = tiny_checkpoint(tmp_path, {"m.0.w": randn(2), "m.1.w": randn(2)}, {})
    compiled = compile_text("m.{L}.w -> layers.{L - 1}.w when L >= 1\ndrop m.0.w\n", folder)
    assert [d.runtime_key for d in compiled.runtime_tensors] == ["layers.0.w"]


@pytest.mark.parametrize("two", [1, 2])
def test_a_config_guard_false_under_a_prefix_with_a_capture_guard_switches_the_rule_off(tmp_path, two):
    """`@x.u -> @x.y when config.two > 1` joined with the definition's `L < 100`: false for every
    binding when `config.two > 1` is, so the rule is off though no key matched to bind L (with
    config.two = 2 the rule is on, and its missing key is E201). Saving without `like` (deriving
    the checkpoint layout) decides alike."""
    tiny_checkpoint(tmp_path, {"a.0.w": torch.zeros(2)}, {"two": two})
    text = "remap 1\nprefix @x = a.{L} -> b.{L} when L < 100\n@x.w -> @x.v\n@x.u -> @x.y when config.two > 1\n"
    rules = rules_from_text(text, "t.remap")
    if two == 2:
        with pytest.raises(remapdsl.RemapError, match="E201"):
            remapdsl.compile_rules(rules, tmp_path)
        return
    compiled = remapdsl.compile_rules(rules, tmp_path)
    assert [t.runtime_key for t in compiled.runtime_tensors] == ["b.0.v"]
    state = {"b.0.v": torch.ones(2)}
    remapdsl.save(state, tmp_path / "out", rules, config={"two": two})
    assert list(remapdsl.open_checkpoint(tmp_path / "out").tensors) == ["a.0.w"]


@pytest.mark.parametrize("guard, code", [
    ("config.off and L < 100", None),  # a false config term on the left: off, whatever L
    ("L < 100 and config.off", None),  # on the right (a prefix's capture guard joined first)
    ("config.absent > 1 and L < 100", "E201"),  # a term that fails alone decides nothing: the key
    ("L < 100 and config.absent > 1", "E201"),  # must match, as for any guard that holds
    ("config.absent > 1", "E211"),  # a whole guard that reads no capture is evaluated, and fails
])
def test_an_and_term_of_a_guard_that_reads_no_capture_decides_alone(tmp_path, guard, code):
    """No checkpoint key has `u`: a false term switches the rule off; one that cannot be evaluated
    alone (a missing config key) leaves the rule on, so its pattern must match (E201), never raising
    the term's own error where the other term might have made it unnecessary."""
    folder = tiny_checkpoint(tmp_path, {"a.0.w": torch.zeros(2)}, {"off": False})
    rules = rules_from_text(f"remap 1\na.{{L}}.w -> b.{{L}}.v\na.{{L}}.u -> b.{{L}}.y when {guard}\n", "t.remap")
    if code is None:
        assert [t.runtime_key for t in remapdsl.compile_rules(rules, folder).runtime_tensors] == ["b.0.v"]
        return
    with pytest.raises(remapdsl.RemapError) as info:
        remapdsl.compile_rules(rules, folder)
    assert [d.code for d in info.value.diagnostics] == [code]
