"""`RuleStorageReader`: a DCP StorageReader serving `dcp.load` from a checkpoint folder through a rule file;
`read_data` makes the planner's requests one box per runtime tensor and runs one load plan."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..checkpoint.snapshot import require_data
from ..indexmap import Box
from ..language.includes import RuleSet
from ..language.library import resolve_rules_path
from ..runtime import bounds, dist
from ..drivers.prepare import prepare_everywhere, rules_for
from ..gcpause import frozen_heap
from ..runtime.read import run_load_plan
from ..runtime.staging import Rings, staging_within
from ..sharding.holdings import unfillable
from ..sharding.placements import LocalShard
from ..sharding.plans import make_load_plan
from . import errors
from .metadata import runtime_metadata


class ReadReport(NamedTuple):
    """What the last `read_data` of a rank did: requests served, runtime tensors, bytes read."""

    requests: int
    tensors: int
    bytes_read: int  # every byte this rank read from the files (quantization scale tiles included)
    bytes_owned: int  # checkpoint bytes behind the elements this rank's requests cover
    seconds: float


class RuleStorageReader(StorageReader):
    """Serves `dcp.load` from `path` through `rules`, the checkpoint presented in the runtime layout
    (the keys, shapes and dtypes the rules make). Every rank constructs it (a collective).

    Args:
        path: a checkpoint folder (or its index or .safetensors file).
        rules: a .remap file path, a shipped name (`qwen3_moe`), `"auto"` or a RuleSet, as for `remapdsl.load`.
        config: the model config; by default the folder's config.json.
        strict: refuse checkpoint tensors that no rule takes and no `drop` names.
        timeout: the most a rank waits at one of the reader's exchanges (seconds or a timedelta; default
            300 s), as for `remapdsl.load`; DCP's own collectives are bounded by its group's timeout.
        staging_bytes: the most host memory a `read_data` pins for device tensors (default 16 MiB).
    """

    def __init__(self, path: str | os.PathLike, rules: str | os.PathLike | RuleSet, *,
                 config: Mapping[str, Any] | None = None, strict: bool = True, timeout=None,
                 staging_bytes: int | None = None):
        super().__init__()
        self._rules, self._config, self._strict = rules, config, strict
        self._timeout = bounds.seconds(timeout)
        self._staging = staging_within(staging_bytes)
        self.report: ReadReport | None = None
        self._open(path)

    def _open(self, path) -> None:
        """Compile the rules against `path` on every rank together (errors: RemapError, every rank)."""
        require_data(path, "dcp.load")
        path = os.fspath(path)
        with bounds.bounded(self._timeout), frozen_heap():
            rules = rules_for(self._rules, path, self._config)  # `auto`: chosen and logged as load does
            self._inventory, self.compiled, _, _ = prepare_everywhere(rules, path, self._config, self._strict)
            self._metadata = runtime_metadata(self.compiled, path, _rules_named(rules))  # the runtime layout
        self.checkpoint_id: str | os.PathLike = path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new read: a `checkpoint_id` naming another checkpoint is opened on every rank together."""
        self.report = None
        if checkpoint_id is not None and os.path.abspath(checkpoint_id) != os.path.abspath(self.checkpoint_id):
            self._open(checkpoint_id)

    def read_metadata(self) -> Metadata:
        """The runtime tensors the rules make, each one whole chunk (remapdsl/dcp/metadata.py)."""
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every request of `plan` into the tensors `planner` resolves, then commit them."""
        with frozen_heap():  # a RemapError raised here crosses DCP's exchange pickled, intact
            start = time.perf_counter()
            rounds = _rounds(plan.items, self._metadata.state_dict_metadata)
            read = owned = 0
            rings = Rings(self._staging)  # one staging ring per reader thread, over every round
            for requests in rounds:  # one round unless a key is asked for in several pieces
                views = {key: planner.resolve_tensor(item) for key, item in requests.items()}
                held = {key: _shard(item) for key, item in requests.items()}
                _check_views(views, held, self.compiled)
                load_plan = make_load_plan(self.compiled, self._inventory, held, dist.rank())
                try:
                    run_load_plan(load_plan, self._inventory, views, rings=rings)
                finally:
                    rings.close()  # every copy to a device finished before the planner commits the views
                for key, item in requests.items():
                    planner.commit_tensor(item, views[key])
                read, owned = read + load_plan.bytes_read, owned + load_plan.bytes_owned
            self.report = ReadReport(len(plan.items), len({k for r in rounds for k in r}), read, owned,
                                     time.perf_counter() - start)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """A folder holding .safetensors files, a .safetensors file, or a safetensors index."""
        path = os.fspath(checkpoint_id)
        if os.path.isdir(path):
            return any(name.endswith(".safetensors") for name in os.listdir(path))
        return os.path.isfile(path) and path.endswith((".safetensors", ".safetensors.index.json"))


def _rules_named(rules) -> str:
    """The rules in words, for messages: `the rules of `qwen3_moe.remap``."""
    if isinstance(rules, RuleSet):
        path = rules.files[0].path if rules.files else None
    else:
        path = resolve_rules_path(rules)  # a shipped name: its file
    return f"the rules of `{os.path.basename(os.fspath(path))}`" if path else "the rules"


def _rounds(items: list[ReadItem], made) -> list[dict[str, ReadItem]]:
    """The requests in rounds of at most one per runtime key; a key `made` lacks is E600."""
    rounds: list[dict[str, ReadItem]] = []
    for item in items:
        made.require(item.dest_index.fqn)
        if item.type != LoadItemType.TENSOR:
            raise errors.fail("E603", f"`{item.dest_index.fqn}` is asked for as bytes, but the rules make "
                              "only tensors", hint="leave non-tensor values out of the state dict given to "
                              "dcp.load through this reader")
        key = item.dest_index.fqn
        free = next((r for r in rounds if key not in r), None)  # the first round without this key
        if free is None:
            rounds.append(free := {})
        free[key] = item
    return rounds


def _shard(item: ReadItem) -> LocalShard:
    """The box of the runtime tensor a request asks for, filling its resolved view from the origin."""
    offsets = tuple(a + b for a, b in zip(item.storage_index.offset or (0,) * len(item.lengths),
                                          item.storage_offsets))
    sizes = tuple(item.lengths)
    return LocalShard(sizes, (Box(offsets, sizes),), ((0,) * len(sizes),))


def _check_views(views: dict, held: dict[str, LocalShard], compiled) -> None:
    """Each resolved view has the request's shape and the rules' dtype, its box in the tensor (E601, E604)."""
    problems = []
    for key, view in views.items():
        d = compiled.runtime_tensor(key)
        box = held[key].boxes[0]
        name = str(view.dtype).removeprefix("torch.")
        if name != d.dtype:
            problems.append(errors.fail(
                "E601", f"`{key}` is {name} in the state dict, but the rules make it {d.dtype}",
                hint="give the state dict the dtype the rules make, or add `| cast(...)` to the rule").diagnostic)
        if tuple(view.shape) != box.sizes or len(box.offsets) != len(d.shape) or any(
                o < 0 or o + s > n for o, s, n in zip(box.offsets, box.sizes, d.shape)):
            problems.append(errors.fail(
                "E604", f"`{key}` is asked for as the box at {list(box.offsets)} of size {list(box.sizes)} "
                f"into a view of {list(view.shape)}, but the rules make it {list(d.shape)}",
                hint="the planner's request does not fit the tensor; DCP's default planner makes requests "
                "that do").diagnostic)
    problems.extend(unfillable(compiled, views))
    if problems:
        raise errors.ReaderError(problems)
