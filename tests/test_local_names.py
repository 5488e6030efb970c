"""`local=`: a rank's local tensor names -> the global runtime names (remapdsl/sharding/local_names.py),
as Megatron-Core numbers a pipeline stage's layers and an expert-parallel rank's experts from zero."""

import pytest

from remapdsl import RemapError
from remapdsl.sharding.local_names import global_names

MEGATRON = {"decoder.layers.{}": 8, "decoder.layers.*.mlp.experts.linear_fc1.weight{}": 4,
            "decoder.layers.*.mlp.experts.local_experts.{}": 4}


def test_a_stage_offsets_its_layers_and_an_expert_rank_its_experts():
    names = ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.1.mlp.experts.linear_fc1.weight3",
             "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight", "decoder.layers.10.mlp.router.weight",
             "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    assert list(global_names(dict.fromkeys(names), MEGATRON)) == [
        "decoder.layers.8.self_attention.linear_qkv.weight", "decoder.layers.9.mlp.experts.linear_fc1.weight7",
        "decoder.layers.9.mlp.experts.local_experts.4.linear_fc2.weight", "decoder.layers.18.mlp.router.weight",
        "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]


def test_the_number_is_a_whole_segment_or_a_segment_s_end():
    """`decoder.layers.{}` does not take `decoder.layers.1x` or `decoder.layersX.1`; `weight{}` takes only
    digits after `weight`, and a name without the number keeps its own."""
    names = ["decoder.layers.1x.w", "decoder.layersX.1.w", "decoder.layers.2.mlp.experts.linear_fc1.weight",
             "decoder.layers.2.mlp.experts.linear_fc1.weight_scale"]
    assert list(global_names(dict.fromkeys(names), MEGATRON)) == [
        "decoder.layers.1x.w", "decoder.layersX.1.w", "decoder.layers.10.mlp.experts.linear_fc1.weight",
        "decoder.layers.10.mlp.experts.linear_fc1.weight_scale"]


def test_virtual_pipeline_chunks_under_a_prefix_are_renamed_and_offset():
    local = {"decoder.layers.{}": 0, "chunk1.decoder.layers.{}": ("decoder.layers.{}", 16)}
    tensors = {"decoder.layers.0.w": 1, "chunk1.decoder.layers.0.w": 2, "chunk1.decoder.layers.3.w": 3}
    assert global_names(tensors, local) == {"decoder.layers.0.w": 1, "decoder.layers.16.w": 2, "decoder.layers.19.w": 3}
    assert global_names(tensors, None) is tensors and global_names(tensors, {}) is tensors


_ONE_NUMBER = 'for example "decoder.layers.{}" or "decoder.layers.*.mlp.experts.linear_fc1.weight{}"'
_OFFSET = "the offset is what this rank's first local number is globally"


@pytest.mark.parametrize("local, message, hint", [
    ({"decoder.layers": 1}, "local template 'decoder.layers' must be a name with exactly one `{}` (the number)",
     _ONE_NUMBER),
    ({"decoder.layers.{}.{}": 1},
     "local template 'decoder.layers.{}.{}' must be a name with exactly one `{}` (the number)", _ONE_NUMBER),
    ({"decoder.**.layers.{}": 1},
     "local template 'decoder.**.layers.{}' must be a name with exactly one `{}` (the number)", _ONE_NUMBER),
    ({"a.{}": ("b.{}.{}", 0)}, "local template 'b.{}.{}' must be a name with exactly one `{}` (the number)",
     _ONE_NUMBER),
    ({"decoder.layers.{}": -1}, "local['decoder.layers.{}'] = -1: the offset must be an integer of 0 or more", _OFFSET),
    ({"decoder.layers.{}": True}, "local['decoder.layers.{}'] = True: the offset must be an integer of 0 or more",
     _OFFSET),
    ({"decoder.layers.{}": "8"}, "local['decoder.layers.{}'] = '8': the offset must be an integer of 0 or more",
     _OFFSET),
    ({"a.*.b{}": ("b{}", 1)}, "local template 'a.*.b{}' and its global 'b{}' have different numbers of `*`",
     "each `*` of the local name is kept in the same place of the global one"),
    (["decoder.layers.{}"], "local=['decoder.layers.{}'] is not a mapping of local name templates to offsets",
     'for example local={"decoder.layers.{}": stage * layers_per_stage}'),
])
def test_a_malformed_renaming_is_e419_saying_what_a_template_must_be(local, message, hint):
    with pytest.raises(RemapError) as info:
        global_names({"decoder.layers.0.w": 1}, local)
    d = info.value.diagnostic
    assert (d.code, d.message, d.hint) == ("E419", message, hint), d


def test_two_local_names_made_one_is_e419_naming_both():
    local = {"decoder.layers.{}": 8, "chunk1.decoder.layers.{}": ("decoder.layers.{}", 8)}  # the chunk's offset
    with pytest.raises(RemapError) as info:
        global_names({"decoder.layers.0.w": 1, "chunk1.decoder.layers.0.w": 2}, local)
    assert info.value.diagnostic.message == ("local names `decoder.layers.0.w` and `chunk1.decoder.layers.0.w` both "
                                             "become `decoder.layers.8.w`")
