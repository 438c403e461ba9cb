"""Layer and decoder-block specs with hyper-connections, mirroring Megatron's GPT spec builders.

=============================================  =================================================
xhc                                            Megatron counterpart
=============================================  =================================================
:func:`get_hc_layer_local_spec`                ``get_gpt_layer_local_spec``
:func:`get_hc_layer_with_transformer_engine_spec`  ``get_gpt_layer_with_transformer_engine_spec``
:func:`get_hc_decoder_block_spec`              ``get_gpt_decoder_block_spec`` (dense-first-then-MoE)
:func:`to_hc_layer_spec`                       turn any stock layer spec into an HC layer spec
=============================================  =================================================

Each builder takes Megatron's own spec and changes only (a) the layer class to
:class:`~models.hc_layer.HyperConnectionTransformerLayer` with the two hyper-connection slots, and
(b) on the local backend without apex, Megatron's ``WrappedTorchNorm`` (no sequence-parallel
support) for our SP-capable :mod:`models.norms`.  Variant ``none`` (vanilla) keeps the stock
``TransformerLayer``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from models.hc_layer import HCTransformerLayerSubmodules, HyperConnectionTransformerLayer
from models.norms import substitute_norms
from xhc.config import FLASH_FAMILY, HCConfig

try:  # Transformer Engine is optional (GPU only)
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except Exception:  # pragma: no cover - depends on the machine
    HAVE_TE = False


def hc_sublayer_classes(hc: HCConfig):
    """(attention slot, MLP slot) module classes for ``hc.variant`` (``(None, None)`` for vanilla)."""
    if not hc.enabled:
        return None, None
    if hc.variant == "xhc":
        from xhc.xhc import XHCSublayer

        return XHCSublayer, XHCSublayer
    if hc.variant in FLASH_FAMILY:
        # The layer picks its window part by position (Flash-4sub pairs layers 2g, 2g+1).
        from xhc.flash import XHCFlashLayer

        return XHCFlashLayer, None
    from xhc.hyper_connection import HyperConnection

    return HyperConnection, HyperConnection


def to_hc_layer_spec(base: ModuleSpec, hc: HCConfig) -> ModuleSpec:
    """A stock ``TransformerLayer`` spec with its residual adds replaced by hyper-connections."""
    if not hc.enabled:
        return base
    if not (isinstance(base.module, type) and issubclass(base.module, TransformerLayer)):
        raise TypeError(f"to_hc_layer_spec needs a TransformerLayer spec, got module {base.module!r}")
    attn_cls, mlp_cls = hc_sublayer_classes(hc)
    fields = {f.name: getattr(base.submodules, f.name) for f in dataclasses.fields(base.submodules)}
    sub = HCTransformerLayerSubmodules(
        **fields, self_attention_hyper_connection=attn_cls, mlp_hyper_connection=mlp_cls
    )
    params = dict(base.params or {})
    params["hc_config"] = hc
    return ModuleSpec(module=HyperConnectionTransformerLayer, params=params, submodules=sub)


def _use_te(use_transformer_engine: Optional[bool]) -> bool:
    if use_transformer_engine is None:
        return HAVE_TE
    if use_transformer_engine and not HAVE_TE:
        raise ImportError("use_transformer_engine=True but transformer_engine is not importable: "
                          "pip install -e '.[te]' on a CUDA machine, or use the local backend")
    return use_transformer_engine


def default_grouped_experts() -> bool:
    """The local spec's expert module when the preset does not say (``moe_grouped_gemm: null``):
    grouped GEMMs (:class:`models.grouped_experts.GroupedExperts`) on CUDA, ``SequentialMLP`` on CPU."""
    import torch

    return torch.cuda.is_available()


def get_hc_layer_local_spec(hc: HCConfig, num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                            qk_layernorm: bool = False, normalization: Optional[str] = "RMSNorm",
                            **kwargs) -> ModuleSpec:
    """Local-backend (Megatron-Core modules only) layer spec with hyper-connections.
    ``moe_grouped_gemm``: routed experts as :class:`models.grouped_experts.GroupedExperts`
    (grouped matmuls, no Transformer Engine) instead of ``SequentialMLP``."""
    base = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                    normalization=normalization, **kwargs)
    if moe_grouped_gemm and num_experts:
        from models.grouped_experts import use_grouped_experts

        base = use_grouped_experts(base)
    return to_hc_layer_spec(substitute_norms(base), hc)


def get_hc_layer_with_transformer_engine_spec(hc: HCConfig, num_experts: Optional[int] = None,
                                              moe_grouped_gemm: bool = False, qk_layernorm: bool = False,
                                              **kwargs) -> ModuleSpec:
    """Transformer Engine layer spec with hyper-connections (needs TE; GPU)."""
    _use_te(True)
    base = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                                      qk_layernorm=qk_layernorm, **kwargs)
    return to_hc_layer_spec(base, hc)


def get_hc_decoder_block_spec(config, hc: HCConfig, use_transformer_engine: Optional[bool] = None,
                              normalization: Optional[str] = None, vp_stage: Optional[int] = None,
                              pp_rank: Optional[int] = None,
                              grouped_experts: Optional[bool] = None) -> TransformerBlockSubmodules:
    """Decoder block spec: ``config.moe_layer_freq`` decides dense vs MoE layers (e.g. one leading
    dense layer, then MoE), each turned into an HC layer.  Local backend by default when Transformer
    Engine is missing; its norms are replaced by the SP-capable :mod:`models.norms`.

    ``grouped_experts`` (local backend only; the preset's ``moe_grouped_gemm``): routed experts as
    :class:`models.grouped_experts.GroupedExperts` (True) or ``SequentialMLP`` (False); None:
    ``config.moe_grouped_gemm`` if set, else :func:`default_grouped_experts` (grouped on CUDA).
    With Transformer Engine ``config.moe_grouped_gemm`` picks TE's own grouped experts as before."""
    te = _use_te(use_transformer_engine)
    normalization = normalization or config.normalization
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=normalization,
                                       vp_stage=vp_stage, pp_rank=pp_rank)
    if not te:
        block = substitute_norms(block)
    block = copy.copy(block)
    if not te:
        if grouped_experts is None:
            grouped_experts = bool(config.moe_grouped_gemm) or default_grouped_experts()
        elif not grouped_experts and config.moe_grouped_gemm:
            raise ValueError("grouped_experts=False contradicts config.moe_grouped_gemm=True on the local spec "
                             "(it would build the legacy GroupedMLP); set both alike")
        if grouped_experts:
            from models.grouped_experts import use_grouped_experts

            block.layer_specs = [use_grouped_experts(s) for s in block.layer_specs]
    block.layer_specs = [to_hc_layer_spec(s, hc) for s in block.layer_specs]
    return block
