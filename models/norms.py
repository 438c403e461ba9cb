"""Backbone RMSNorm / LayerNorm for Megatron specs that work with sequence parallelism.

Without Transformer Engine and apex, Megatron's local spec (``get_gpt_layer_local_spec``) falls
back to ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel`` and does not mark its
parameters for the TP gradient all-reduce that sequence parallelism needs (with SP every TP rank
normalises a different slice of the sequence, so a replicated norm weight only sees part of the
gradient).  :class:`RMSNorm` and :class:`LayerNorm` here take Megatron's norm-constructor
signature ``(config, hidden_size, eps)`` and set ``param.sequence_parallel =
config.sequence_parallel`` the way ``TENorm`` / apex ``FusedLayerNorm`` do, so Megatron's
``finalize_model_grads`` (GPU) and :func:`models.parallel.allreduce_sequence_parallel_grads`
(CPU) all-reduce them.  They also serve as QK-norm (``qk_layernorm=True``; Megatron all-reduces
``q_layernorm``/``k_layernorm`` grads across TP by name).

Maths is computed in fp32 (float64 stays float64) and cast back to the input dtype:
``RMSNorm(x) = x · rsqrt(mean(x²) + ε) · γ``; ``LayerNorm(x) = (x − μ) · rsqrt(var + ε) · γ + β``.
``config.layernorm_zero_centered_gamma`` stores ``γ − 1`` (init 0), as Megatron does.

:func:`substitute_norms` swaps ``WrappedTorchNorm`` for these classes in any Megatron spec.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from xhc.norms import fp32, layer_norm_flat, rms_norm_flat

__all__ = ["LayerNorm", "Norm", "RMSNorm", "norm_class", "substitute_norms"]


class _Norm(torch.nn.Module):
    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, bias: bool = False, **_: Any):
        # Extra kwargs (persist_layer_norm, zero_centered_gamma, normalization) are accepted for
        # signature compatibility with Megatron's norm builders; they only select CUDA kernels.
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype)) if bias else None
        sp = bool(getattr(config, "sequence_parallel", False))
        for p in self.parameters():
            p.sequence_parallel = sp  # read by Megatron's finalize_model_grads / our CPU helper

    def _gamma(self) -> torch.Tensor:
        w = fp32(self.weight)
        return w + 1 if self.zero_centered_gamma else w

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class RMSNorm(_Norm):
    """RMSNorm over the last dim, Megatron signature ``(config, hidden_size, eps)``; SP-aware."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        super().__init__(config, hidden_size, eps, bias=False, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., hidden_size]`` -> same shape and dtype."""
        return (rms_norm_flat(x, self.eps) * self._gamma()).to(x.dtype)


class LayerNorm(_Norm):
    """LayerNorm (with bias) over the last dim, Megatron signature; SP-aware."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        super().__init__(config, hidden_size, eps, bias=True, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., hidden_size]`` -> same shape and dtype."""
        return (layer_norm_flat(x, self.eps) * self._gamma() + fp32(self.bias)).to(x.dtype)


def norm_class(normalization: str) -> type:
    """``"RMSNorm"`` -> :class:`RMSNorm`, ``"LayerNorm"`` -> :class:`LayerNorm`."""
    if normalization == "RMSNorm":
        return RMSNorm
    if normalization == "LayerNorm":
        return LayerNorm
    raise ValueError(f"normalization={normalization!r} is not supported: use 'RMSNorm' or 'LayerNorm'")


class Norm:
    """Spec entry that builds :class:`RMSNorm` or :class:`LayerNorm` from ``config.normalization``.

    The drop-in replacement for Megatron's ``WrappedTorchNorm`` (which dispatches the same way).
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
        return norm_class(config.normalization)(config, hidden_size, eps, **kwargs)


def _substitute(obj: Any, new: type, memo: dict) -> Any:
    if id(obj) in memo:
        return memo[id(obj)]
    if obj is WrappedTorchNorm:
        out: Any = new
    elif isinstance(obj, ModuleSpec):
        out = copy.copy(obj)
        out.module = _substitute(obj.module, new, memo)
        out.submodules = _substitute(obj.submodules, new, memo)
    elif isinstance(obj, functools.partial):  # 0.19 builds some submodules with partial(...)
        out = functools.partial(
            _substitute(obj.func, new, memo),
            *(_substitute(a, new, memo) for a in obj.args),
            **{k: _substitute(v, new, memo) for k, v in obj.keywords.items()},
        )
    elif isinstance(obj, (list, tuple)):
        out = type(obj)(_substitute(o, new, memo) for o in obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            setattr(out, f.name, _substitute(getattr(obj, f.name), new, memo))
    else:
        out = obj
    memo[id(obj)] = out
    return out


def substitute_norms(spec: Any, norm: type = Norm) -> Any:
    """Return a copy of a Megatron spec with every ``WrappedTorchNorm`` replaced by ``norm``.

    ``spec``: a ``ModuleSpec``, ``TransformerBlockSubmodules``, or a list of layer specs (what
    ``get_gpt_layer_local_spec`` / ``get_gpt_decoder_block_spec`` return).  The default
    :class:`Norm` picks RMSNorm/LayerNorm from ``config.normalization`` at build time.
    Parameter-free norms (``L2Norm``) and TE / apex norms are left alone; the input is not modified.
    """
    return _substitute(spec, norm, {})
