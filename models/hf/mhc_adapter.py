"""mHC as a parameter-efficient adapter on a frozen Hugging Face causal LM ([PEFT], docs/math.md §2.g).

Every decoder layer of the backbone is replaced, in place, by an :class:`HCDecoderLayer` that owns
the layer's own sub-modules (same names, so backbone state-dict keys and ``peft`` target names do
not change) plus one :class:`~xhc.hyper_connection.HyperConnection` per sublayer::

    X = expand(h)                         first layer:   [b, s, C]   -> [b, s, N, C]
    u, ctx = hc_attn.read(X);  X = hc_attn.write(X, F_attn(u), ctx)
    u, ctx = hc_mlp.read(X);   X = hc_mlp.write(X, F_mlp(u), ctx)
    between layers X travels as [b, s, N·C] (stream-major, docs/math.md §1.2)
    h = readout(X)                        last layer:    [b, s, N, C] -> [b, s, C]  (mean / softmax)

followed by the backbone's own final norm and LM head, so ``forward``, ``generate`` (with KV cache:
the mHC maths is per token), ``labels`` -> ``loss`` and ``save_pretrained`` keep working.

Branches F (docs/math.md §1.3 convention 2, §2.g):

============  ======================================  ===========================================
kind          families                                F_attn(u) / F_mlp(u)
============  ======================================  ===========================================
``pre_norm``  llama, mistral, qwen2, qwen3            Attn(input_ln(u)) / MLP(post_attention_ln(u))
``post_norm`` olmo2                                   post_attention_ln(Attn(u)) / post_ff_ln(MLP(u))
============  ======================================  ===========================================

Sublayer ℓ = 2i (attention of layer i) and 2i+1 (its MLP) sets the one-hot read (ℓ mod N).

Public API: :func:`wrap_with_mhc`, :func:`unwrap_mhc`, :func:`hc_disabled`, :func:`is_wrapped`,
:func:`adapter_named_parameters`, :func:`count_adapter_parameters`, :func:`mark_adapter_trainable`,
:func:`adapter_param_groups`, :func:`save_adapter`, :func:`load_adapter`, :func:`record_routing`,
:func:`peft_paper_config`, :class:`UnsupportedModelError`.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from xhc.config import MHC_FAMILY, HCConfig, HCConfigError
from xhc.hyper_connection import HyperConnection, StreamReadout, expand_streams

try:  # transformers >= 4.48: the base class that provides per-layer gradient checkpointing
    from transformers.modeling_layers import GradientCheckpointingLayer as _LayerBase
except ImportError:  # pragma: no cover - older transformers
    _LayerBase = nn.Module

ADAPTER_WEIGHTS_NAME = "hc_adapter.safetensors"
ADAPTER_CONFIG_NAME = "hc_adapter_config.json"
ADAPTER_FORMAT = "xhc-mhc-adapter"
ADAPTER_FORMAT_VERSION = 1
WRAPPABLE_VARIANTS = MHC_FAMILY  # the mHC family wraps a Hugging Face model (§2.g)


class UnsupportedModelError(TypeError):
    """The model is not a pre-norm (or OLMo-2 post-branch-norm) decoder stack this wrapper knows."""


@dataclass(frozen=True)
class Family:
    """How one architecture's decoder layer is split into two branches."""

    layer_class: str  # expected decoder-layer class name (guards against look-alike subclasses)
    kind: str  # "pre_norm" or "post_norm"

    @property
    def children(self) -> Tuple[str, ...]:
        if self.kind == "pre_norm":
            return ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
        return ("self_attn", "post_attention_layernorm", "mlp", "post_feedforward_layernorm")


FAMILIES: Dict[str, Family] = {
    "llama": Family("LlamaDecoderLayer", "pre_norm"),
    "mistral": Family("MistralDecoderLayer", "pre_norm"),
    "qwen2": Family("Qwen2DecoderLayer", "pre_norm"),
    "qwen3": Family("Qwen3DecoderLayer", "pre_norm"),
    "olmo2": Family("Olmo2DecoderLayer", "post_norm"),
}


# ================================================================================================
# Configuration helpers
# ================================================================================================
def peft_paper_config(variant: str = "identity", n: int = 4, dynamic: bool = True, **overrides) -> HCConfig:
    """The [PEFT] settings (Table 12, App. C.3, docs/math.md §2.g preset ``peft_paper``) for one variant.

    ``variant``: ``mhc`` | ``mhc_lite`` | ``kromhc`` | ``identity`` (= dynamic KromHC with H_res = I).
    Paper settings: Sinkhorn 20 iterations, ε = 1e-6; init noise σ = 1e-4; mapping-norm gain
    (N·C parameters, dynamic only); gates 1e-2; mean readout, except static Sinkhorn mHC, whose
    reported 772 parameters include an N-logit softmax readout (docs/math.md §8 #33).
    """
    d = dict(
        variant=variant, n=n, dynamic=dynamic, preset="peft_paper", mapping_norm_affine=dynamic,
        init_noise=1e-4, sinkhorn_iters=20, sinkhorn_eps=1e-6, gate_init=0.01, res_logit_dropout=0.0,
        reduction="softmax" if (variant == "mhc" and not dynamic) else "mean",
    )
    d.update(overrides)
    return HCConfig(**d)


def _as_config(cfg: Union[HCConfig, dict, None]) -> HCConfig:
    if cfg is None:
        return peft_paper_config()
    if isinstance(cfg, dict):
        return HCConfig.from_dict(cfg)
    if not isinstance(cfg, HCConfig):
        raise TypeError(f"wrap_with_mhc: cfg must be an HCConfig or a dict, got {type(cfg).__name__}")
    return cfg


def _check_variant(cfg: HCConfig) -> None:
    if cfg.variant not in WRAPPABLE_VARIANTS:
        raise HCConfigError(
            f"HCConfig.variant={cfg.variant!r} cannot wrap a pretrained model: use one of "
            f"{', '.join(WRAPPABLE_VARIANTS)} (the mHC family, [PEFT])"
        )
    if cfg.disabled:
        raise HCConfigError("HCConfig.disabled=True: nothing to wrap; use the backbone directly")
    if cfg.reduction not in ("mean", "softmax"):
        raise HCConfigError(
            f"HCConfig.reduction={cfg.reduction!r} cannot wrap a pretrained model: use mean or softmax "
            "(the frozen final norm must see the backbone's scale, [PEFT] §C.3)"
        )


# ================================================================================================
# The wrapped decoder layer
# ================================================================================================
def _no_autocast(device_type: str):
    """HC coefficient maths runs in fp32 even under bf16 autocast (docs/math.md §1.5)."""
    if device_type not in ("cpu", "cuda", "xpu", "mps"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


class HCDecoderLayer(_LayerBase):
    """One backbone decoder layer with its two residual adds replaced by hyper-connections.

    Owns the backbone layer's children under their original names (``self_attn``, ``mlp`` and the
    norms), ``hc_attn`` / ``hc_mlp`` (:class:`HyperConnection`, sublayers 2i and 2i+1) and, in the
    last layer, ``hc_readout`` (:class:`StreamReadout`).

    Input: ``[b, s, C]`` (first layer) or ``[b, s, N·C]``; output: ``[b, s, N·C]`` or ``[b, s, C]``
    (last layer).  Keyword arguments (masks, position embeddings, cache, ...) go to the attention
    module unchanged.
    """

    def __init__(self, layer: nn.Module, family: Family, cfg: HCConfig, hidden_size: int, layer_index: int,
                 is_first: bool, is_last: bool):
        super().__init__()
        for name, child in layer.named_children():
            self.add_module(name, child)
        for attr in ("attention_type", "layer_idx", "sliding_window", "is_sliding"):
            if hasattr(layer, attr) and not isinstance(getattr(layer, attr), nn.Module):
                setattr(self, attr, getattr(layer, attr))
        self.hidden_size = hidden_size
        self.n = cfg.n
        self.kind = family.kind
        self.layer_index = layer_index
        self.is_first, self.is_last = is_first, is_last
        self.hc_attn = HyperConnection(cfg, hidden_size, 2 * layer_index)
        self.hc_mlp = HyperConnection(cfg, hidden_size, 2 * layer_index + 1)
        self.hc_readout = StreamReadout(cfg.n, cfg.reduction) if is_last else None
        # the original layer (same children) is kept unregistered so unwrapping restores it exactly
        object.__setattr__(self, "_hc_backbone_layer", layer)
        object.__setattr__(self, "_hc_recorder", None)

    # ---- branches (frozen backbone maths) --------------------------------------------------------
    def attn_branch(self, u: torch.Tensor, **kwargs) -> torch.Tensor:
        """F_attn(u): ``[b, s, C]`` -> ``[b, s, C]``."""
        if self.kind == "pre_norm":
            return self.self_attn(hidden_states=self.input_layernorm(u), **kwargs)[0]
        return self.post_attention_layernorm(self.self_attn(hidden_states=u, **kwargs)[0])

    def mlp_branch(self, u: torch.Tensor) -> torch.Tensor:
        """F_mlp(u): ``[b, s, C]`` -> ``[b, s, C]``."""
        if self.kind == "pre_norm":
            return self.mlp(self.post_attention_layernorm(u))
        return self.post_feedforward_layernorm(self.mlp(u))

    # ---- forward ---------------------------------------------------------------------------------
    def _sublayer(self, hc: HyperConnection, X: torch.Tensor, branch: Callable) -> torch.Tensor:
        dev = X.device.type
        with _no_autocast(dev):
            u, ctx = hc.read(X)
        y = branch(u)
        with _no_autocast(dev):
            X_new = hc.write(X, y, ctx)
        if self._hc_recorder is not None:
            self._hc_recorder.append(RoutingRecord(
                sublayer=hc.layer_index,
                h_pre=None if ctx.h_pre is None else ctx.h_pre.detach(),
                h_post=None if ctx.h_post is None else ctx.h_post.detach(),
                H_res=None if ctx.H_res is None else ctx.H_res.detach(),
                X=X_new.detach(),
            ))
        return X_new

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        n, C = self.n, self.hidden_size
        if self.is_first:
            if hidden_states.shape[-1] != C:
                raise ValueError(f"HCDecoderLayer {self.layer_index}: expected [b, s, {C}] input, "
                                 f"got {tuple(hidden_states.shape)}")
            X = expand_streams(hidden_states, n)  # [b, s, N, C]
        else:
            X = hidden_states.view(*hidden_states.shape[:-1], n, C)
        X = self._sublayer(self.hc_attn, X, lambda u: self.attn_branch(u, **kwargs))
        X = self._sublayer(self.hc_mlp, X, self.mlp_branch)
        if self.is_last:
            with _no_autocast(X.device.type):
                return self.hc_readout(X)  # [b, s, C]
        return X.flatten(-2)  # [b, s, N·C]

    def extra_repr(self) -> str:
        return f"layer={self.layer_index}, kind={self.kind}, n={self.n}, first={self.is_first}, last={self.is_last}"


@dataclass
class RoutingRecord:
    """Routing objects of one sublayer from one forward pass (for diagnostics)."""

    sublayer: int
    h_pre: Optional[torch.Tensor]  # [b, s, N] (None: ablated, uniform 1/N)
    h_post: Optional[torch.Tensor]  # [b, s, N] (None: ablated, ones)
    H_res: Optional[torch.Tensor]  # [b, s, N, N] (None: identity)
    X: torch.Tensor  # state after the sublayer, [b, s, N, C]


# ================================================================================================
# Locating the decoder stack
# ================================================================================================
def _peft_base(model: nn.Module) -> nn.Module:
    """The ``PreTrainedModel`` inside a ``peft.PeftModel`` (or ``model`` itself)."""
    get_base = getattr(type(model), "get_base_model", None)
    if get_base is not None and type(model).__module__.startswith("peft"):
        return model.get_base_model()
    return model


def _decoder(model: nn.Module) -> Tuple[nn.Module, nn.Module, Family]:
    """(causal LM, decoder with ``.layers``/``.norm``, family) or :class:`UnsupportedModelError`."""
    lm = _peft_base(model)
    cls = type(lm).__name__
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"wrap_with_mhc: cannot wrap {cls} (model_type={model_type!r}): supported are pre-norm residual "
            f"decoders of model_type {', '.join(FAMILIES)} (OLMo-2 with its post-branch norms)"
        )
    fam = FAMILIES[model_type]
    prefix = getattr(lm, "base_model_prefix", "model")
    dec = getattr(lm, prefix, None) if not hasattr(lm, "layers") else lm
    if dec is None or not isinstance(getattr(dec, "layers", None), nn.ModuleList) or not hasattr(dec, "norm"):
        raise UnsupportedModelError(f"wrap_with_mhc: {cls} has no decoder with .layers and .norm to wrap")
    for i, layer in enumerate(dec.layers):
        if isinstance(layer, HCDecoderLayer):
            continue
        if type(layer).__name__ != fam.layer_class:
            raise UnsupportedModelError(
                f"wrap_with_mhc: {cls} layer {i} is {type(layer).__name__}, expected {fam.layer_class}; "
                "this layer type's residual structure is not verified"
            )
        missing = [c for c in fam.children if not hasattr(layer, c)]
        if missing:
            raise UnsupportedModelError(f"wrap_with_mhc: {cls} layer {i} lacks {', '.join(missing)}")
    return lm, dec, fam


def is_wrapped(model: nn.Module) -> bool:
    """True when the model's decoder layers are :class:`HCDecoderLayer`."""
    try:
        _, dec, _ = _decoder(model)
    except UnsupportedModelError:
        return False
    return len(dec.layers) > 0 and all(isinstance(l, HCDecoderLayer) for l in dec.layers)


def hc_layers(model: nn.Module) -> List[HCDecoderLayer]:
    """The wrapped layers, in order (error if the model is not wrapped)."""
    _, dec, _ = _decoder(model)
    layers = list(dec.layers)
    if not layers or not all(isinstance(l, HCDecoderLayer) for l in layers):
        raise ValueError(f"{type(_peft_base(model)).__name__} is not wrapped with mHC; call wrap_with_mhc first")
    return layers


def adapter_config(model: nn.Module) -> HCConfig:
    """The :class:`HCConfig` a wrapped model was wrapped with."""
    return hc_layers(model)[0].hc_attn.cfg


# ================================================================================================
# Wrap / unwrap
# ================================================================================================
def wrap_with_mhc(model: nn.Module, cfg: Union[HCConfig, dict, None] = None, freeze_backbone: bool = True):
    """Wrap a Hugging Face causal LM (or a ``peft`` model around one) with mHC, in place.

    Args:
        model: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
            ``Olmo2ForCausalLM`` (or their bare ``*Model``), optionally inside a ``peft.PeftModel``.
        cfg: :class:`HCConfig` (variant mhc / mhc_lite / kromhc / identity, static or dynamic,
            ablations); default :func:`peft_paper_config` (identity, n = 4).
        freeze_backbone: set ``requires_grad=False`` on every backbone parameter.  A ``PeftModel``
            keeps its own flags (its LoRA/VeRA weights stay trainable).

    Returns the same ``model`` object.  Adapter parameters are fp32, on the backbone's device, and
    trainable.  Raises :class:`UnsupportedModelError` (naming the class) for other architectures.
    """
    cfg = _as_config(cfg)
    _check_variant(cfg)
    lm, dec, fam = _decoder(model)
    if any(isinstance(l, HCDecoderLayer) for l in dec.layers):
        raise ValueError(f"{type(lm).__name__} is already wrapped with mHC; call unwrap_mhc first")
    if freeze_backbone and model is lm:
        for p in lm.parameters():
            p.requires_grad_(False)
    hidden = int(lm.config.hidden_size)
    L = len(dec.layers)
    for i in range(L):
        old = dec.layers[i]
        ref = next(iter(old.parameters()), None)
        device = ref.device if ref is not None else torch.device("cpu")
        with torch.device(device) if device.type == "meta" else contextlib.nullcontext():
            new = HCDecoderLayer(old, fam, cfg, hidden, i, is_first=(i == 0), is_last=(i == L - 1))
        _hc_modules_to(new, device)
        new.train(old.training)
        dec.layers[i] = new
    return model


def _hc_modules_to(layer: HCDecoderLayer, device) -> None:
    for m in (layer.hc_attn, layer.hc_mlp, layer.hc_readout):
        if m is not None:
            m.to(device=device, dtype=torch.float32)
            for p in m.parameters():
                p.requires_grad_(True)


def unwrap_mhc(model: nn.Module):
    """Put the original decoder layers back (the adapter is dropped); returns ``model``."""
    _, dec, _ = _decoder(model)
    for i, layer in enumerate(dec.layers):
        if isinstance(layer, HCDecoderLayer):
            dec.layers[i] = layer._hc_backbone_layer
    return model


@contextlib.contextmanager
def hc_disabled(model: nn.Module):
    """Temporarily run the plain backbone (same modules, no hyper-connections)."""
    layers = hc_layers(model)
    _, dec, _ = _decoder(model)
    try:
        for i, layer in enumerate(layers):
            dec.layers[i] = layer._hc_backbone_layer
        yield model
    finally:
        for i, layer in enumerate(layers):
            dec.layers[i] = layer


@contextlib.contextmanager
def record_routing(model: nn.Module):
    """Collect a :class:`RoutingRecord` per sublayer for every forward run inside the block."""
    records: List[RoutingRecord] = []
    layers = hc_layers(model)
    for l in layers:
        object.__setattr__(l, "_hc_recorder", records)
    try:
        yield records
    finally:
        for l in layers:
            object.__setattr__(l, "_hc_recorder", None)


# ================================================================================================
# Parameters
# ================================================================================================
def adapter_named_parameters(model: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """Adapter parameters under their canonical names ``layers.{i}.hc_attn.b_pre``, ..., ``readout.logits``.

    The names do not depend on the model class or on a ``peft`` wrapper around it.
    """
    for i, layer in enumerate(hc_layers(model)):
        for sub in ("hc_attn", "hc_mlp"):
            for pname, p in getattr(layer, sub).named_parameters():
                yield f"layers.{i}.{sub}.{pname}", p
        if layer.hc_readout is not None:
            for pname, p in layer.hc_readout.named_parameters():
                yield f"readout.{pname}", p


def is_adapter_parameter(name: str) -> bool:
    """Whether a ``model.named_parameters()`` name belongs to the mHC adapter."""
    return ".hc_attn." in name or ".hc_mlp." in name or ".hc_readout." in name


def count_adapter_parameters(model: nn.Module) -> int:
    """Total ``numel`` of the adapter parameters (works on the meta device)."""
    return sum(p.numel() for _, p in adapter_named_parameters(model))


def mark_adapter_trainable(model: nn.Module) -> nn.Module:
    """``requires_grad=True`` on every adapter parameter (call after ``peft.get_peft_model``,
    which freezes everything that is not its own adapter)."""
    for _, p in adapter_named_parameters(model):
        p.requires_grad_(True)
    return model


def trainable_parameter_report(model: nn.Module) -> dict:
    """Counts: adapter (mHC), other trainable (e.g. LoRA/VeRA), frozen, total."""
    hc_ids = {id(p) for _, p in adapter_named_parameters(model)} if is_wrapped(model) else set()
    seen, hc, other, frozen = set(), 0, 0, 0
    for _, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in hc_ids:
            hc += p.numel()
        elif p.requires_grad:
            other += p.numel()
        else:
            frozen += p.numel()
    total = hc + other + frozen
    trainable = hc + other
    return {"hc": hc, "other_trainable": other, "trainable": trainable, "frozen": frozen, "total": total,
            "trainable_percent": 100.0 * trainable / max(total, 1)}


def adapter_param_groups(model: nn.Module, hc_lr: float = 1e-3, other_lr: float = 1e-4,
                         weight_decay: float = 0.0) -> List[dict]:
    """AdamW groups: mHC parameters at ``hc_lr``, any other trainable parameter (LoRA, VeRA) at
    ``other_lr`` ([PEFT] Table 13, docs/math.md §6.6).  Empty groups are left out."""
    hc = [p for _, p in adapter_named_parameters(model) if p.requires_grad]
    hc_ids = {id(p) for p in hc}
    other, seen = [], set()
    for _, p in model.named_parameters():
        if p.requires_grad and id(p) not in hc_ids and id(p) not in seen:
            seen.add(id(p))
            other.append(p)
    groups = []
    if hc:
        groups.append({"params": hc, "lr": hc_lr, "weight_decay": weight_decay, "name": "mhc"})
    if other:
        groups.append({"params": other, "lr": other_lr, "weight_decay": weight_decay, "name": "peft"})
    return groups


# ================================================================================================
# Save / load (safetensors + JSON)
# ================================================================================================
def save_adapter(model: nn.Module, directory: str) -> Tuple[str, str]:
    """Write ``hc_adapter.safetensors`` and ``hc_adapter_config.json`` into ``directory``.

    Only the adapter is saved (the backbone is shared separately, e.g. as its hub name).
    Returns the two paths.
    """
    from safetensors.torch import save_file

    lm, dec, fam = _decoder(model)
    cfg = adapter_config(model)
    os.makedirs(directory, exist_ok=True)
    tensors = {k: p.detach().to("cpu", torch.float32).contiguous() for k, p in adapter_named_parameters(model)}
    wpath = os.path.join(directory, ADAPTER_WEIGHTS_NAME)
    cpath = os.path.join(directory, ADAPTER_CONFIG_NAME)
    save_file(tensors, wpath, metadata={"format": "pt", "adapter": ADAPTER_FORMAT})
    meta = {
        "format": ADAPTER_FORMAT,
        "format_version": ADAPTER_FORMAT_VERSION,
        "hc_config": cfg.to_dict(),
        "model_type": lm.config.model_type,
        "backbone_class": type(lm).__name__,
        "backbone_name_or_path": getattr(lm.config, "_name_or_path", "") or "",
        "num_hidden_layers": len(dec.layers),
        "hidden_size": int(lm.config.hidden_size),
        "num_parameters": int(sum(t.numel() for t in tensors.values())),
    }
    with open(cpath, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    return wpath, cpath


def read_adapter_config(directory: str) -> Tuple[HCConfig, dict]:
    """(HCConfig, full JSON dict) of a saved adapter."""
    cpath = os.path.join(directory, ADAPTER_CONFIG_NAME)
    if not os.path.isfile(cpath):
        raise FileNotFoundError(f"{cpath}: no mHC adapter config here; save one with save_adapter(model, dir)")
    with open(cpath, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{cpath}: format={meta.get('format')!r}, expected {ADAPTER_FORMAT!r}")
    return HCConfig.from_dict(meta["hc_config"]), meta


def load_adapter(model: nn.Module, directory: str, freeze_backbone: bool = True):
    """Load an adapter saved by :func:`save_adapter` into ``model`` (wrapping it first if needed).

    The backbone geometry (model_type, layers, hidden size) and, for an already wrapped model, the
    HC configuration must match; every tensor must be present with its saved shape.
    """
    from safetensors.torch import load_file

    cfg, meta = read_adapter_config(directory)
    lm, dec, _ = _decoder(model)
    got = {"model_type": lm.config.model_type, "num_hidden_layers": len(dec.layers),
           "hidden_size": int(lm.config.hidden_size)}
    for key, val in got.items():
        if meta.get(key) != val:
            raise ValueError(f"{os.path.join(directory, ADAPTER_CONFIG_NAME)}: {key}={meta.get(key)!r} but the "
                             f"model has {val!r}; load the adapter into the backbone it was trained on")
    if is_wrapped(model):
        have = adapter_config(model).to_dict()
        if have != cfg.to_dict():
            diff = sorted(k for k in have if have[k] != cfg.to_dict().get(k))
            raise ValueError(f"load_adapter: the model is wrapped with a different HCConfig (fields {diff}); "
                             "unwrap_mhc(model) first or load into an unwrapped model")
    else:
        wrap_with_mhc(model, cfg, freeze_backbone=freeze_backbone)
    tensors = load_file(os.path.join(directory, ADAPTER_WEIGHTS_NAME))
    params = dict(adapter_named_parameters(model))
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(f"{os.path.join(directory, ADAPTER_WEIGHTS_NAME)}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]} tensors for this adapter configuration")
    with torch.no_grad():
        for k, p in params.items():
            t = tensors[k]
            if t.shape != p.shape:
                raise ValueError(f"{ADAPTER_WEIGHTS_NAME}: {k} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            p.copy_(t.to(p.device, p.dtype))
    return model
