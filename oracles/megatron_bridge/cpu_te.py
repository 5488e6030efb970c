"""Transformer Engine's module classes as CPU stand-ins: the class names and parameter names that
Megatron-Core's TE layer spec builds, with Megatron-Core's own CPU layers underneath.

Megatron-Bridge decides how to shard a parameter from its module's class name (`AutoMapping`'s
registry: `TELayerNormColumnParallelLinear` column, its `layer_norm_weight` replicated, `TERowParallelLinear`
row, `TELinear` by `parallel_mode`, ...) and maps parameters by name. Transformer Engine needs CUDA, so
these classes give the bridge the same names and shapes on the CPU: each holds the parameters its TE
namesake holds, shaped as that layer shards them on this rank, and has no forward pass of its own
(the oracle never runs one). `install()` makes Megatron-Core's TE spec provider build them.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn


class _Dummy:
    def __init__(self, *args, **kwargs):
        pass

    def __class_getitem__(cls, item):
        return cls


class _StubModule(types.ModuleType):
    """A module whose every attribute is a placeholder class: enough for modules that name
    `transformer_engine.pytorch.X` at import time (megatron.bridge.peft's LoRA layers)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Dummy,), {})
        setattr(self, name, value)
        return value


def import_bridge():
    """Import megatron.bridge. Its conversion modules import its PEFT modules, which import
    `transformer_engine.pytorch` unconditionally (for LoRA layers the conversion never builds); a
    placeholder module stands in for that import only, and is removed again after it."""
    import megatron.core.models.gpt.gpt_layer_specs  # Megatron-Core first: it sees no TE

    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops"]
    for name in names:
        module = _StubModule(name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        sys.modules[name] = module
    sys.modules["transformer_engine"].pytorch = sys.modules["transformer_engine.pytorch"]
    sys.modules["transformer_engine.pytorch"].ops = sys.modules["transformer_engine.pytorch.ops"]
    try:
        import megatron.bridge  # noqa: F401
        from megatron.bridge import AutoBridge
    finally:
        for name in names:
            sys.modules.pop(name, None)
    return AutoBridge


def _tp_size(tp_group, is_expert: bool) -> int:
    from megatron.core import parallel_state

    if tp_group is not None:
        return tp_group.size()
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_world_size()
    return parallel_state.get_tensor_model_parallel_world_size()


def _param(shape, config, partition_dim: int | None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=config.params_dtype))
    with torch.no_grad():
        p.fill_(float("nan"))  # a value the conversion does not write stays visible
    if partition_dim is not None:
        p.tensor_model_parallel = True
        p.partition_dim = partition_dim
        p.partition_stride = 1
    return p


class _Linear(nn.Module):
    """A weight [out / tp, in] (column), [out, in / tp] (row) or [out, in] (duplicated)."""

    mode = "column"

    def __init__(self, input_size, output_size, *, config, init_method=None, bias=False, skip_bias_add=False,
                 is_expert=False, tp_group=None, parallel_mode=None, **_ignored):
        super().__init__()
        mode = parallel_mode or self.mode
        self.parallel_mode = mode
        self.config = config
        tp = 1 if mode == "duplicated" else _tp_size(tp_group, is_expert)
        self.is_expert = is_expert
        self.tensor_model_parallel = mode != "duplicated"
        if mode == "column":
            self.weight = _param((output_size // tp, input_size), config, 0)
            self.partition_dim = 0
        elif mode == "row":
            self.weight = _param((output_size, input_size // tp), config, 1)
            self.partition_dim = 1
        else:
            self.weight = _param((output_size, input_size), config, None)
        if bias:
            self.bias = _param((output_size // tp if mode == "column" else output_size,), config,
                               0 if mode == "column" else None)
        else:
            self.register_parameter("bias", None)


class TELinear(_Linear):
    mode = "duplicated"


class TEColumnParallelLinear(_Linear):
    mode = "column"


class TERowParallelLinear(_Linear):
    mode = "row"


class TELayerNormColumnParallelLinear(_Linear):
    """A column-parallel linear with the norm before it fused in: `layer_norm_weight` [in], replicated."""

    mode = "column"

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = _param((input_size,), config, None)
        if config.normalization == "LayerNorm":
            self.layer_norm_bias = _param((input_size,), config, None)


class _GroupedLinear(nn.Module):
    """`num_gemms` local experts' weights as `weight0`, `weight1`, ... (TE's GroupedLinear)."""

    mode = "column"

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method=None, bias=False,
                 skip_bias_add=False, is_expert=True, tp_comm_buffer_name=None, pg_collection=None, **_ignored):
        super().__init__()
        group = getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
        tp = _tp_size(group, True)
        self.config = config
        self.num_gemms = num_gemms
        self.is_expert = True
        for i in range(num_gemms):
            if self.mode == "column":
                shape, dim = (output_size // tp, input_size), 0
            else:
                shape, dim = (output_size, input_size // tp), 1
            p = _param(shape, config, dim)
            p.allreduce = False
            self.register_parameter(f"weight{i}", p)


class TEColumnParallelGroupedLinear(_GroupedLinear):
    mode = "column"


class TERowParallelGroupedLinear(_GroupedLinear):
    mode = "row"


class RMSNorm(nn.Module):
    """What TENorm makes for RMSNorm (te.pytorch.RMSNorm): one `weight`."""

    def __init__(self, hidden_size, config):
        super().__init__()
        self.weight = _param((hidden_size,), config, None)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, config):
        super().__init__()
        self.weight = _param((hidden_size,), config, None)
        self.bias = _param((hidden_size,), config, None)


class TENorm:
    """TE's norm factory: a module of class RMSNorm or LayerNorm, as te.pytorch makes."""

    def __new__(cls, config, hidden_size, eps=1e-5, has_residual=False, **_ignored):
        return (LayerNorm if config.normalization == "LayerNorm" else RMSNorm)(hidden_size, config)


class TEDotProductAttention(nn.Module):
    """Core attention holds no parameter (without attention sinks)."""

    def __init__(self, *args, **kwargs):
        super().__init__()


class _TENormWithResidual:
    def __new__(cls, *args, **kwargs):
        return TENorm(*args, **kwargs)


def spec_provider():
    """Megatron-Core's TESpecProvider with the stand-ins above."""
    from functools import partial

    from megatron.core.models.backends import BackendSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, SequentialMLP, TEGroupedMLP

    class CpuTESpecProvider(BackendSpecProvider):
        def linear(self):
            return TELinear

        def column_parallel_linear(self):
            return TEColumnParallelLinear

        def row_parallel_linear(self):
            return TERowParallelLinear

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return TELayerNormColumnParallelLinear

        def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):
            return _TENormWithResidual if has_residual else TENorm

        def core_attention(self):
            return TEDotProductAttention

        def grouped_mlp_modules(self, moe_use_grouped_gemm):
            if moe_use_grouped_gemm:
                return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
                    linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear,
                    activation_func=None))
            return partial(SequentialMLP, submodules=MLPSubmodules(
                linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear, activation_func=None))

        def activation_func(self):
            return None

    return CpuTESpecProvider


def install() -> None:
    """Every loaded Megatron-Core module that names TESpecProvider or a TE class gets the stand-ins (and
    TransformerBlock's final norm, `LayerNormImpl`, is TENorm as where TE is installed)."""
    provider = spec_provider()
    standins = {"TESpecProvider": provider, "TENorm": TENorm, "LayerNormImpl": TENorm, "TELinear": TELinear,
                "TEColumnParallelLinear": TEColumnParallelLinear, "TEDotProductAttention": TEDotProductAttention,
                "TERowParallelLinear": TERowParallelLinear,
                "TELayerNormColumnParallelLinear": TELayerNormColumnParallelLinear,
                "TEColumnParallelGroupedLinear": TEColumnParallelGroupedLinear,
                "TERowParallelGroupedLinear": TERowParallelGroupedLinear}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("megatron.core", "megatron.bridge")):
            continue
        for attr, value in standins.items():
            if attr in vars(module):
                setattr(module, attr, value)
