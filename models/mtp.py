"""Multi-token prediction (MTP) through the hyper-connection streams (docs/architecture.md, "Multi-token
prediction"; docs/math.md).

``model.backbone.mtp_num_layers = D`` adds D prediction depths after the decoder, on the last pipeline
stage, as Megatron-Core does (``TransformerConfig.mtp_num_layers`` / ``mtp_loss_scaling_factor``).

Vanilla (variant ``none``) uses Megatron-Core's own ``MultiTokenPredictionLayer`` (concat + ``eh_proj``).

With hyper-connections each depth k (1-based) works on the N-stream state, never on a collapsed vector
(DeepSeek-V4's ``MTPBlock``, Megatron-LM ``dev``'s MTP with mHC)::

    X^(0)      = decoder state before its final collapse                     [s, b, N, C]
    E_k        = embedding(tokens shifted left by k)                          [s, b, C]
    U_k,i      = h_proj_k(hnorm_k(X^(k-1)_i)) + e_proj_k(enorm_k(E_k))        every stream i
    X^(k)      = one HC transformer layer (the preset's variant and MLP) on U_k
    h_k        = final_norm_k(head_k(X^(k)))                                  that depth's own head
    loss_k     = CE(output_layer(h_k), tokens shifted left by k + 1)          shared output layer

    loss = loss_main + mtp_loss_scaling_factor / D · Σ_k loss_k               (Megatron's rule)

``head_k`` is built by the same code as the decoder's final collapse (:func:`models.hc_layer.attach_stream_head`):
the preset's ``reduction`` (a learned head when ``reduction: learned``).  Flash windows: an MTP layer is
one stand-alone xHC-Flash window (``XHCFlashLayer``) for both ``xhc_flash`` and ``xhc_flash4`` (a
Flash-4sub window pairs two decoder layers; an MTP depth has one, as the decoder's final odd layer).

How the streams reach the depths through Megatron's ``GPTModel`` (so that PP, SP, recompute and the
checkpoint code see ordinary tensors): with MTP on, the decoder's last HC layer returns
``cat(collapse(X), X)`` on the hidden axis, ``[s, b, C + N·C]``; the decoder's final norm normalises the
first C channels and passes the streams through; each depth returns ``cat(h_k, X^(k))``; Megatron
stacks those along the sequence axis and the output layer reads the first C channels
(:func:`install_stream_passthrough`).  The parameters' names are unchanged, so checkpoints, HF
export and the tools see the same main model; the depths live under ``mtp.layers.<k-1>.``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import make_viewless_tensor

from xhc.config import HCConfig

__all__ = ["HCMultiTokenPredictionLayer", "get_mtp_block_spec", "install_stream_passthrough", "mtp_parameters",
           "isolated_init_rng"]


@contextlib.contextmanager
def isolated_init_rng():
    """Initialise the MTP depths without moving any random state the main model's init uses next
    (GPTModel builds ``mtp`` before ``output_layer``): the main model of an MTP run starts from the
    same weights as the run without MTP (same seed)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    try:
        tracker_states = tracker.get_states()
    except Exception:  # pragma: no cover - tracker without states
        tracker_states = None
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(torch.initial_seed() + 7919)  # a fixed offset: reproducible, distinct from the decoder
        try:
            yield
        finally:
            if tracker_states is not None:
                tracker.set_states(tracker_states)


def _roll(t, cp_group, packed_seq_params):
    """Megatron's CP-aware left shift by one (``roll_tensor``; its keyword set is feature-detected)."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    if t is None:
        return None
    kw = {}
    params = inspect.signature(roll_tensor).parameters
    if "cp_group" in params:
        kw["cp_group"] = cp_group
    if "packed_seq_params" in params:
        kw["packed_seq_params"] = packed_seq_params
    out = roll_tensor(t, shifts=-1, dims=-1, **kw)
    return out[0] if isinstance(out, tuple) else out


class HCMultiTokenPredictionLayer(MegatronModule):
    """One MTP depth through the N streams (see the module docstring).

    Built by Megatron's ``MultiTokenPredictionBlock`` from a ``ModuleSpec`` whose submodules are
    Megatron's ``MultiTokenPredictionLayerSubmodules`` (``enorm``, ``hnorm``, ``layer_norm``,
    ``transformer_layer``; ``eh_proj`` unused) and whose params hold ``hc_config``.  ``h_proj`` /
    ``e_proj`` are ``[C, C]`` maps replicated over TP (as the HC parameters are; tagged
    ``sequence_parallel`` so that SP all-reduces their gradients)."""

    def __init__(self, config, submodules, layer_number: int = 1, vp_stage: Optional[int] = None,
                 pg_collection=None, hc_config: Optional[HCConfig] = None, **_megatron_kwargs):
        super().__init__(config=config)
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from models.hc_layer import attach_stream_head

        self.hc_config = hc_config
        self.layer_number = layer_number
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        C = config.hidden_size
        with isolated_init_rng():
            norm = functools.partial(_build_norm, config=config, hidden_size=C)
            self.enorm = norm(submodules.enorm)
            self.hnorm = norm(submodules.hnorm)
            self.e_proj = torch.nn.Linear(C, C, bias=False)
            self.h_proj = torch.nn.Linear(C, C, bias=False)
            for lin in (self.e_proj, self.h_proj):
                with torch.no_grad():
                    lin.weight.copy_(_init_weight(config, lin.weight))
                lin.weight.sequence_parallel = bool(config.sequence_parallel)
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(lin.weight)
            try:
                offset = get_transformer_layer_offset(config, vp_stage)
            except TypeError:  # pragma: no cover - older signature
                offset = get_transformer_layer_offset(config)
            # global number L + k, as Megatron's own MTP layer: not the decoder's first nor last layer
            layer_spec = getattr(submodules, "transformer_layer", None) or getattr(submodules, "mtp_model_layer")
            self.transformer_layer = build_module(layer_spec, config=config, vp_stage=vp_stage,
                                                  layer_number=layer_number + config.num_layers - offset)
            _single_flash_window(self.transformer_layer)
            self.final_layernorm = norm(submodules.layer_norm)
            attach_stream_head(self, hc_config, C, config)

    def _head(self, X):
        from models.hc_layer import apply_stream_head

        return apply_stream_head(self, X)

    def _body(self, hidden_states, decoder_input, attention_mask, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
              packed_seq_params, sequence_len_offset):
        n, C = self.hc_config.n, self.config.hidden_size
        s, b = hidden_states.shape[0], hidden_states.shape[1]
        X = hidden_states[..., C:].reshape(s, b, n, C)
        U = self.h_proj(self.hnorm(X)) + self.e_proj(self.enorm(decoder_input)).unsqueeze(2)
        out, _ = self.transformer_layer(
            U.reshape(s, b, n * C), attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset)
        h = self.final_layernorm(self._head(out.view(s, b, n, C)))
        return torch.cat([h, out], dim=-1)

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, context=None, context_mask=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                inference_params=None, packed_seq_params=None, sequence_len_offset=None, embedding=None,
                padding_mask=None, **kwargs):
        if context is not None:
            raise NotImplementedError("multi-token prediction with cross-attention context is not supported")
        input_ids = _roll(input_ids, self.cp_group, packed_seq_params)
        position_ids = _roll(position_ids, self.cp_group, packed_seq_params)
        padding_mask = _roll(padding_mask, self.cp_group, packed_seq_params)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        args = (hidden_states, decoder_input, attention_mask, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                packed_seq_params, sequence_len_offset)
        if self.config.recompute_granularity == "full" and self.training:
            out = tensor_parallel.checkpoint(self._body, self.config.distribute_saved_activations, *args)
        else:
            out = self._body(*args)
        out = make_viewless_tensor(inp=out, requires_grad=True, keep_graph=True)
        if _megatron_layer_returns_padding_mask():  # newer Megatron-Core chains the padding mask too
            return out, input_ids, position_ids, padding_mask
        return out, input_ids, position_ids

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)


@functools.lru_cache(maxsize=None)
def _megatron_layer_returns_padding_mask() -> bool:
    """Whether Megatron's ``MultiTokenPredictionLayer.forward`` takes (and returns) ``padding_mask``
    (not in 0.16.1; the block then unpacks four values)."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    return "padding_mask" in inspect.signature(MultiTokenPredictionLayer.forward).parameters


def _build_norm(spec, config, hidden_size):
    """A norm from an MTP submodule entry: a ``ModuleSpec`` / class (0.16) or a norm builder callable."""
    if isinstance(spec, (ModuleSpec, type)):
        return build_module(spec, config=config, hidden_size=hidden_size, eps=config.layernorm_epsilon)
    return spec(config=config, hidden_size=hidden_size, eps=config.layernorm_epsilon)


def _init_weight(config, weight):
    w = torch.empty_like(weight)
    config.init_method(w)
    return w


def _single_flash_window(layer) -> None:
    """Flash-4sub's windows pair decoder layers (2g, 2g+1); an MTP depth has one layer, so it runs one
    stand-alone xHC-Flash window, as a decoder's final odd layer does."""
    hc = getattr(layer, "hc_config", None)
    if hc is None or not hc.enabled or hc.variant != "xhc_flash4":
        return
    from xhc.flash import XHCFlashLayer

    from models.hc_layer import _make_driver, _mark_hc_parameters

    if type(layer.self_attention_hyper_connection) is XHCFlashLayer:
        return
    i = layer.layer_number - 1
    layer.self_attention_hyper_connection = XHCFlashLayer(hc, layer.config.hidden_size, layer_index=i)
    layer._driver = _make_driver(layer)
    _mark_hc_parameters(layer, layer.config)


def get_mtp_block_spec(config, block_spec, hc: HCConfig, use_transformer_engine: bool, vp_stage=None, pp_rank=None):
    """The MTP block spec for ``config.mtp_num_layers`` depths, or None (no MTP / not on this stage).

    Megatron's ``get_gpt_mtp_block_spec`` builds the depths from the decoder's last layer spec; for an
    HC variant the layer class becomes :class:`HCMultiTokenPredictionLayer` (same submodules)."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from models.norms import substitute_norms

    kw = {}
    params = inspect.signature(get_gpt_mtp_block_spec).parameters
    if "vp_stage" in params:
        kw["vp_stage"] = vp_stage
    if "pp_rank" in params and pp_rank is not None:
        kw["pp_rank"] = pp_rank
    spec = get_gpt_mtp_block_spec(config, block_spec, use_transformer_engine=use_transformer_engine, **kw)
    if spec is None:
        return None
    if not use_transformer_engine:
        spec = substitute_norms(spec)  # SP-capable norms for enorm / hnorm / final norm (local backend)
    if hc.enabled:
        spec.layer_specs = [ModuleSpec(module=HCMultiTokenPredictionLayer, params={"hc_config": hc},
                                       submodules=s.submodules) for s in spec.layer_specs]
    else:
        spec.layer_specs = [ModuleSpec(module=_isolated_megatron_mtp_layer(), params=dict(s.params or {}),
                                       submodules=s.submodules) for s in spec.layer_specs]
    return spec


@functools.lru_cache(maxsize=None)
def _isolated_megatron_mtp_layer():
    """Megatron's ``MultiTokenPredictionLayer``, initialised under :func:`isolated_init_rng`."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    class MegatronMTPLayer(MultiTokenPredictionLayer):
        def __init__(self, *args, **kwargs):
            with isolated_init_rng():
                super().__init__(*args, **kwargs)

    MegatronMTPLayer.__name__ = MegatronMTPLayer.__qualname__ = "MultiTokenPredictionLayer"
    return MegatronMTPLayer


# ------------------------------------------------------------------------------------------------
# The main model's final norm / output layer see [.., C + N·C] when the streams pass through
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _passthrough_class(base: type, role: str):
    def forward(self, x, *args, **kwargs):
        C = self._mtp_hidden
        if x.shape[-1] == C:
            return base.forward(self, x, *args, **kwargs)
        h = base.forward(self, x[..., :C].contiguous(), *args, **kwargs)
        if role == "output":
            return h
        return torch.cat([h, x[..., C:]], dim=-1)

    return type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


def install_stream_passthrough(model) -> None:
    """Let ``[s, b, C + N·C]`` (collapsed hidden + streams) through the decoder's final norm (which
    normalises the first C channels) and the output layer (which reads them).  The modules keep their
    parameter names; only their class changes."""
    C = model.config.hidden_size
    for mod, role in ((getattr(model.decoder, "final_layernorm", None), "norm"),
                      (getattr(model, "output_layer", None), "output")):
        if mod is None:
            continue
        mod.__class__ = _passthrough_class(type(mod), role)
        mod._mtp_hidden = C


def finish_mtp_model(model, hc: HCConfig) -> None:
    """After ``GPTModel(..., mtp_block_spec=...)``: tag the depths' parameters ``is_mtp`` (the grad norm
    sums them apart, so a λ = 0 run clips exactly as the run without MTP), let the streams through the
    final norm / output layer (HC variants), and give Megatron's per-depth loss buffer a home on the
    model's device before each forward (Megatron allocates it on CUDA)."""
    if getattr(model, "mtp_process", False):
        for p in model.mtp.parameters():
            p.is_mtp = True
        D = int(model.config.mtp_num_layers)

        def ensure_tracker(module, args, kwargs):
            hs = kwargs.get("hidden_states", args[2] if len(args) > 2 else None)
            ensure_mtp_tracker(D, hs.device if hs is not None else torch.device("cpu"))

        model.mtp.register_forward_pre_hook(ensure_tracker, with_kwargs=True)
    if getattr(model.config, "mtp_num_layers", None) and hc.enabled and model.post_process:
        install_stream_passthrough(model)


def mtp_parameters(model):
    """(name, parameter) of the MTP depths of a GPT model (empty without MTP)."""
    return [(n, p) for n, p in model.named_parameters() if n.startswith("mtp.") or ".mtp." in n]


# ------------------------------------------------------------------------------------------------
# Per-depth loss logging
# ------------------------------------------------------------------------------------------------
def _tracker_keys():
    """The per-depth buffers of Megatron's ``MTPLossLoggingHelper.tracker``: ``values`` (0.16) or
    ``loss_values`` plus acceptance counts (newer Megatron-Core); the loss buffer first."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker"):
        return ("loss_values", "correct_values", "total_values")
    return ("values",)


def ensure_mtp_tracker(num_layers: int, device, zero: bool = False) -> None:
    """Give Megatron's per-depth MTP buffers a home on ``device`` (Megatron allocates them on the current
    CUDA device, which a CPU run lacks); ``zero``: clear them."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tr = MTPLossLoggingHelper.tracker
    for key in _tracker_keys():
        t = tr.get(key)
        if t is None or t.numel() != num_layers or t.device != torch.device(device):
            tr[key] = torch.zeros(num_layers, device=device)
        elif zero:
            t.zero_()


def mtp_tracker_prepare(num_layers: int, device) -> None:
    """Before a step: the per-depth buffers on ``device``, zeroed."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    ensure_mtp_tracker(num_layers, device, zero=True)
    MTPLossLoggingHelper.tracker["reduce_group"] = None
    MTPLossLoggingHelper.tracker["avg_group"] = None


def mtp_tracker_take(num_layers: int) -> list:
    """The per-depth Σ over this step's micro-batches of each micro-batch's token-mean MTP loss on this
    rank (zeros where no depth ran), and clear the buffers."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tr = MTPLossLoggingHelper.tracker
    keys = _tracker_keys()
    if keys[0] not in tr:
        return [0.0] * num_layers
    vals = [float(v) for v in tr[keys[0]].detach().double().cpu()]
    for key in keys:
        if key in tr:
            tr[key].zero_()
    return vals


# ------------------------------------------------------------------------------------------------
# Analytic counts (tools.accounting, training FLOPs / MFU, the sweep's compute)
# ------------------------------------------------------------------------------------------------
def mtp_counts(shape, hc: HCConfig, depths: int, convention: str = "megatron") -> dict:
    """Parameters and training FLOPs per token of ``depths`` MTP depths of a backbone ``shape``
    (:class:`xhc.accounting.BackboneShape`, its ``seq_len`` / ``vocab`` as trained).

    One depth: enorm, hnorm, final norm (3C), the two [C, C] maps (h_proj, e_proj; vanilla: eh_proj
    [C, 2C], the same count), one transformer layer of the decoder's last kind (MoE unless every layer
    is dense), its HC parameters (Flash-4sub: a Flash window) and head; FLOPs: the layer's and the
    maps' 6·(activated params), the shared output layer's GEMM and the layer's attention, under the
    backbone's FLOPs ``convention``.  Returns ``params_total``, ``params_activated``, ``params_hc``,
    ``flops_backbone``, ``flops_hc`` (all for the ``depths`` together; 0 when ``depths`` is 0)."""
    import dataclasses

    from xhc.accounting import backbone_params, hc_params_total, training_flops_per_token, vanilla_flops_per_token

    keys = ("params_total", "params_activated", "params_hc", "flops_backbone", "flops_hc")
    if not depths:
        return dict.fromkeys(keys, 0)
    C = shape.hidden
    moe_last = shape.num_layers > shape.num_dense_layers
    one = dataclasses.replace(shape, num_layers=1, num_dense_layers=0 if moe_last else 1)
    p = backbone_params(one)
    extra = 2 * C * C + 2 * C  # h_proj + e_proj (or eh_proj); enorm + hnorm (the final norm is in `p`)
    total = p.total - p.embedding - p.output_layer + extra
    activated = p.activated - p.embedding - p.output_layer + extra
    flops = vanilla_flops_per_token(one, convention) + 6.0 * extra
    hcp = f_hc = 0
    if hc.enabled:
        hcp = hc_params_total(hc, C, 1).total  # one layer (Flash-4sub: a Flash window) and its head
        f_hc = float(training_flops_per_token(hc, C, 1).f_hc)
    out = dict(params_total=total + hcp, params_activated=activated + hcp, params_hc=hcp, flops_backbone=flops,
               flops_hc=f_hc)
    return {k: v * depths for k, v in out.items()}
