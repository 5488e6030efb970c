"""remapdsl.testing: a kit for proving a rule file right in a model's own CI (docs/testing.md): assertions,
a gloo multi-rank runner, random checkpoints in a snapshot's layout, hypothesis strategies (`.strategies`),
a pytest plugin (`.plugin`), and every property at once (`.verify`, `remapdsl verify`)."""

from remapdsl.testing.assertions import assert_matches_reference, assert_round_trip, load_whole, transformers_state_dict
from remapdsl.testing.compare import assert_state_dicts_equal, state_dict_differences, tensor_difference
from remapdsl.testing.data import (layer_and_expert, random_bytes, scale_down, write_checkpoint, write_dcp_sharded,
                                  write_pretrained)
from remapdsl.testing.ranks import (as_mesh, assert_sharded_equals_whole, assert_sharded_round_trip, run_ranks,
                                   shard_everything)

__all__ = ["as_mesh", "assert_matches_reference", "assert_round_trip", "assert_sharded_equals_whole",
           "assert_sharded_round_trip", "assert_state_dicts_equal", "layer_and_expert", "load_whole", "random_bytes",
           "run_ranks", "scale_down", "shard_everything", "state_dict_differences", "tensor_difference",
           "transformers_state_dict", "write_checkpoint", "write_dcp_sharded", "write_pretrained"]
