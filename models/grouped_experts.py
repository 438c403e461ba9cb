"""Grouped expert GEMMs without Transformer Engine: :class:`GroupedExperts`.

Megatron-Core's local spec (no Transformer Engine) runs the routed experts as
``SequentialMLP``, a Python loop with two small GEMMs per local expert; from megatron-core 0.17
on its legacy ``GroupedMLP`` (the ``grouped_gemm`` package) is gone.  :class:`GroupedExperts` is a
``SequentialMLP`` whose forward runs **all** local experts' ``linear_fc1`` GEMMs as one grouped
matmul, the activation once over every token, then **all** ``linear_fc2`` GEMMs as a second
grouped matmul (``torch.nn.functional.grouped_mm`` where torch has it, else
``torch._grouped_mm``; both run on CUDA in bf16 and on CPU in fp32 with torch >= 2.9).

It keeps ``SequentialMLP``'s parameters as they are (``local_experts.<i>.linear_fc1.weight`` ...):
the same initialisation, ``state_dict`` and sharded (distributed-checkpoint) keys, so a checkpoint
of one loads into the other unchanged, and optimisers (Muon's per-expert matrices included) see the
same tensors.  Each forward stacks the local weights (``torch.stack``: one copy of the expert
weights, small beside the GEMMs at thousands of tokens per step) and the stack's backward hands
each expert its own gradient.

Falls back to ``SequentialMLP.forward`` (the per-expert loop, identical results) where a grouped
matmul cannot run: neither torch function exists, the dtype is not fp32/bf16/fp16 (float64
reference tests), a row is not 16-byte aligned (hidden or FFN size not a multiple of 4 fp32 / 8
bf16 elements), linear biases (``add_bias_linear``), fp8/fp4, or Transformer Engine's activation
modules.  The first such forward logs why, once.

Expert tensor parallelism: with ``expert_tensor_parallel_size > 1`` each rank's expert linears
compute on their local shards and the token dispatcher does the communication
(``explicit_expert_comm``); the grouped GEMMs compute the same local products, so expert TP works
unchanged.  The one layout where the linears would communicate themselves (expert TP without
tensor or expert parallelism) is refused at construction.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer import mlp as _mlp
from megatron.core.transformer.moe.experts import SequentialMLP

log = logging.getLogger(__name__)

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
HAVE_GROUPED_MM = _GROUPED_MM is not None
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PROBED = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a grouped matmul runs for ``dtype`` on ``device`` (probed once per device type,
    index and dtype with a tiny product: some GPUs or builds lack a kernel)."""
    if not HAVE_GROUPED_MM or dtype not in _GROUPED_DTYPES:
        return False
    key = (device.type, device.index, dtype)
    if key not in _PROBED:
        try:
            a = torch.ones(8, 8, device=device, dtype=dtype)
            b = torch.ones(2, 8, 8, device=device, dtype=dtype)
            out = _GROUPED_MM(a, b, offs=torch.tensor([4, 8], device=device, dtype=torch.int32))
            _PROBED[key] = bool(torch.all(out == 8).item())
        except (RuntimeError, NotImplementedError) as e:  # no kernel for this device / dtype
            log.info("grouped matmul unavailable on %s for %s: %s", device, dtype, e)
            _PROBED[key] = False
    return _PROBED[key]


def _contiguous_grad(g: torch.Tensor) -> torch.Tensor:
    return g.contiguous()


def grouped_linear(x: torch.Tensor, weights, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of group e] @ weights[e].T`` for every group ``e`` at once.

    ``x``: [T, K]; ``weights``: E tensors [N, K] (``torch.nn.Linear`` layout); ``offs``: int32 [E],
    the cumulative row counts (group e owns rows ``offs[e-1]:offs[e]``)."""
    w = torch.stack(list(weights)).transpose(1, 2)  # [E, K, N]
    out = _GROUPED_MM(x.contiguous(), w, offs=offs)
    if out.requires_grad:  # torch's grouped-matmul backward refuses expanded gradients (e.g. of .sum())
        out.register_hook(_contiguous_grad)
    return out


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` with the local experts' GEMMs run as two grouped matmuls (module docstring).

    Same constructor, parameters and checkpoint format as ``SequentialMLP`` (megatron-core 0.16 and
    0.19: extra keyword arguments are passed on)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, **kwargs):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, **kwargs)
        fc1 = self.local_experts[0].linear_fc1 if self.num_local_experts else None
        if (self.tp_group is not None and self.tp_group.size() > 1 and fc1 is not None
                and not getattr(fc1, "explicit_expert_comm", True)):
            raise ValueError("model.backbone.moe_grouped_gemm=true with expert_tensor_parallel_size="
                             f"{self.tp_group.size()} needs tensor or expert parallelism > 1 (the expert linears "
                             "would communicate themselves); set moe_grouped_gemm=false for this layout")
        self._fallback_logged = False

    def _fallback_reason(self, x: torch.Tensor) -> Optional[str]:
        c = self.config
        if not HAVE_GROUPED_MM:
            return f"torch {torch.__version__} has no grouped matmul (needs torch >= 2.9)"
        if c.add_bias_linear:
            return "linear biases (add_bias_linear=true)"
        if getattr(c, "fp8", None) or getattr(c, "fp4", None):
            return "fp8/fp4"
        if getattr(c, "use_te_activation_func", False):
            return "Transformer Engine activation modules"
        if c.bias_activation_fusion and not (self.local_experts[0].activation_func is F.silu and c.gated_linear_unit):
            return "fused activation other than SwiGLU"
        w1 = self.local_experts[0].linear_fc1.weight
        w2 = self.local_experts[0].linear_fc2.weight
        if x.dtype != w1.dtype or not grouped_mm_available(x.device, x.dtype):
            return f"no grouped matmul for {x.dtype} on {x.device.type}"
        align = 16 // x.element_size()
        if any(d % align for d in (*w1.shape, *w2.shape)):
            return f"expert sizes {tuple(w1.shape)}, {tuple(w2.shape)} not multiples of {align} ({x.dtype})"
        return None

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``MLP.forward``'s activation and per-token scaling, branch for branch (0.16 and 0.19)."""
        c = self.config
        act = self.local_experts[0].activation_func
        if c.bias_activation_fusion:  # SwiGLU only (else the fallback ran)
            return _mlp.weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), c.activation_func_fp8_input_store)
        if c.gated_linear_unit:
            x_glu, x_linear = torch.chunk(h, 2, dim=-1)
            val = getattr(c, "activation_func_clamp_value", None)
            if val is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            h = c.activation_func(x_glu) * (x_linear + getattr(c, "glu_linear_offset", 0.0))
        else:
            h = act(h)
        dtype = h.dtype
        return (h * probs.unsqueeze(-1)).to(dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        reason = None if self.num_local_experts > 1 else "one local expert"
        reason = reason or self._fallback_reason(x)
        if reason is not None:
            if not self._fallback_logged and self.num_local_experts > 1:
                log.warning("GroupedExperts: per-expert loop (SequentialMLP) because of %s", reason)
                self._fallback_logged = True
            return super().forward(x, tokens_per_expert, permuted_probs)
        probs = permuted_probs
        if self.config.moe_apply_probs_on_input:
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        counts = torch.as_tensor(tokens_per_expert).to(device=x.device, non_blocking=True)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        experts = self.local_experts
        h = grouped_linear(x, (e.linear_fc1.weight for e in experts), offs)
        h = self._activation(h, probs.reshape(-1))
        out = grouped_linear(h, (e.linear_fc2.weight for e in experts), offs)
        return out.reshape(*shape[:-1], out.shape[-1]), None


def _is(obj, cls) -> bool:
    return isinstance(obj, type) and issubclass(obj, cls)


def use_grouped_experts(spec):
    """A copy of a layer / MLP spec (``ModuleSpec`` in megatron-core 0.16, ``functools.partial``
    builders in 0.19) whose routed experts are :class:`GroupedExperts` where they were the local
    ``SequentialMLP`` or the legacy ``GroupedMLP``.  Transformer Engine's experts are left alone."""
    import copy
    import dataclasses
    import functools

    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    try:
        from megatron.core.transformer.moe.experts import GroupedMLP as _Legacy
    except ImportError:  # gone from megatron-core 0.17 on
        _Legacy = None

    def local_submodules():
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules

        return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)

    def swap_experts(experts):
        if isinstance(experts, ModuleSpec):
            m = experts.module
            if m is SequentialMLP or (_Legacy is not None and m is _Legacy):
                return ModuleSpec(module=GroupedExperts, params=dict(experts.params or {}),
                                  submodules=experts.submodules if m is SequentialMLP else local_submodules())
            return experts
        if isinstance(experts, functools.partial) and experts.func is SequentialMLP:
            return functools.partial(GroupedExperts, *experts.args, **experts.keywords)
        return experts

    def swap_moe_submodules(sub):
        if sub is None or not hasattr(sub, "experts"):
            return sub
        return dataclasses.replace(sub, experts=swap_experts(sub.experts))

    def swap_mlp(mlp):
        if isinstance(mlp, ModuleSpec) and _is(mlp.module, MoELayer):
            new = copy.copy(mlp)
            new.submodules = swap_moe_submodules(mlp.submodules)
            return new
        if isinstance(mlp, functools.partial) and _is(mlp.func, MoELayer) and "submodules" in mlp.keywords:
            kw = dict(mlp.keywords, submodules=swap_moe_submodules(mlp.keywords["submodules"]))
            return functools.partial(mlp.func, *mlp.args, **kw)
        return mlp

    sub = getattr(spec, "submodules", None)
    if sub is not None and hasattr(sub, "mlp"):  # a layer spec
        new = copy.copy(spec)
        new.submodules = dataclasses.replace(sub, mlp=swap_mlp(sub.mlp))
        return new
    return swap_mlp(spec)
