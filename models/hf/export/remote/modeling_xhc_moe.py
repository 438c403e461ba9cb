"""Hyper-connection MoE causal LM for Hugging Face ``transformers`` (exported by xhc).

The backbone is built from the native GLM-4.5-MoE layers of ``transformers`` (``Glm4MoeAttention``,
``Glm4MoeMLP``, ``Glm4MoeMoE``, ``Glm4MoeRMSNorm``, ``Glm4MoeRotaryEmbedding``): the architecture
a vanilla (``variant: none``) xhc model exports to natively.  Each decoder layer's two residual adds
are replaced by the hyper-connection modules of xhc (``hyper_connection.py``, ``xhc.py``,
``flash.py``, ``temporal.py`` next to this file: the very code the model was trained with), driven
exactly as the Megatron layer drives them::

    X       = expand(h)                                first layer     [s, b, C] -> [s, b, N, C]
    u, ctx  = attn_hc.read(X);   X = attn_hc.write(X, self_attn(input_layernorm(u)), ctx)
    u, ctx  = mlp_hc.read(X);    X = mlp_hc.write(X, mlp(post_attention_layernorm(u)), ctx, seq)
    h       = reduce(X)  or  hc_head(X)                last layer      [s, b, N, C] -> [s, b, C]

The N-stream state is kept sequence-first (``[s, b, N, C]``) as in training; the native layers see
``[b, s, C]``.  ``generate()`` works token by token: attention uses the ``transformers`` KV cache
and xHC's causal temporal convolution keeps its last κ_max − 1 branch outputs per sublayer in a
decode cache attached to that KV cache (reset when the KV cache is empty).  Batched generation
with left padding is not supported for xHC variants (the temporal conv would see the pad tokens).
"""

import inspect
from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeAttention,
    Glm4MoeMLP,
    Glm4MoeMoE,
    Glm4MoeRMSNorm,
    Glm4MoeRotaryEmbedding,
)

from xhc.config import FLASH_FAMILY, HCConfig
from xhc.flash import Flash4FirstLayer, Flash4SecondLayer, XHCFlashLayer
from xhc.head import LearnedHead
from xhc.hyper_connection import HyperConnection, expand_streams, reduce_streams
from xhc.temporal import SequenceContext
from xhc.xhc import XHCSublayer

from .configuration_xhc_moe import XHCMoeConfig

# transformers renamed the KV cache argument and output field from ``past_key_values`` to ``cache``
# (5.17 has the old name, newer releases the new one): use whichever this installation has.
_MASK_CACHE_KW = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
_ATTN_CACHE_KW = "cache" if "cache" in inspect.signature(Glm4MoeAttention.forward).parameters else "past_key_values"
_OUT_CACHE_FIELD = "cache" if "cache" in getattr(BaseModelOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"

HC_MODULE_NAMES = ("self_attention_hyper_connection", "mlp_hyper_connection", "hc_readout_logits", "hc_head")


def _flash_part(hc: HCConfig, C: int, i: int, num_layers: int):
    """xHC-Flash: one window per layer; Flash-4sub: layers (2g, 2g+1) share one, an odd last layer
    falls back to Flash (as the Megatron layer builds them)."""
    if hc.variant == "xhc_flash":
        return XHCFlashLayer(hc, C, layer_index=i)
    if i % 2 == 1:
        return Flash4SecondLayer(hc, C, layer_index=i)
    if i + 1 < num_layers:
        return Flash4FirstLayer(hc, C, layer_index=i)
    return XHCFlashLayer(hc, C, layer_index=i)


class XHCMoeDecoderLayer(GradientCheckpointingLayer):
    """A GLM-4.5-MoE decoder layer (same children, same names) with hyper-connections."""

    def __init__(self, config: XHCMoeConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = C = config.hidden_size
        self.layer_idx = layer_idx
        self.self_attn = Glm4MoeAttention(config=config, layer_idx=layer_idx)
        self.mlp = Glm4MoeMoE(config) if layer_idx >= config.first_k_dense_replace else Glm4MoeMLP(config)
        self.input_layernorm = Glm4MoeRMSNorm(C, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Glm4MoeRMSNorm(C, eps=config.rms_norm_eps)
        hc = HCConfig.from_dict(config.hc)
        self.hc = hc
        self.is_last = layer_idx == config.num_hidden_layers - 1
        self.mlp_hyper_connection = None
        if hc.variant in FLASH_FAMILY:
            self.self_attention_hyper_connection = _flash_part(hc, C, layer_idx, config.num_hidden_layers)
        elif hc.variant == "xhc":
            self.self_attention_hyper_connection = XHCSublayer(hc, C, is_mlp=False, layer_index=2 * layer_idx)
            self.mlp_hyper_connection = XHCSublayer(hc, C, is_mlp=True, layer_index=2 * layer_idx + 1)
        else:
            self.self_attention_hyper_connection = HyperConnection(hc, C, layer_index=2 * layer_idx)
            self.mlp_hyper_connection = HyperConnection(hc, C, layer_index=2 * layer_idx + 1)
        if self.is_last and hc.reduction == "softmax":
            self.hc_readout_logits = nn.Parameter(torch.zeros(hc.n))
        else:
            self.hc_readout_logits = None
        # reduction: learned (DeepSeek-V4's head, xhc head.py): hc_head.{hc_fn, hc_base, hc_scale}
        self.hc_head = LearnedHead(hc, C) if (self.is_last and hc.reduction == "learned") else None

    # The two branches: native modules, [s, b, C] in and out.
    def _attn(self, u, **kw):
        out, _ = self.self_attn(hidden_states=self.input_layernorm(u.transpose(0, 1).contiguous()), **kw)
        return out.transpose(0, 1)

    def _mlp(self, u):
        return self.mlp(self.post_attention_layernorm(u.transpose(0, 1).contiguous())).transpose(0, 1)

    def forward(self, X: torch.Tensor, seq=None, carry: Optional[dict] = None, **attn_kwargs):
        """``X``: ``[s, b, N, C]`` -> ``[s, b, N, C]`` (``[s, b, C]`` after the last layer)."""
        mod, mlp_mod = self.self_attention_hyper_connection, self.mlp_hyper_connection
        if mlp_mod is not None:  # HC / mHC family / xHC: one module per sublayer
            u, ctx = mod.read(X)
            X = mod.write(X, self._attn(u, **attn_kwargs), ctx, seq)
            u, ctx = mlp_mod.read(X)
            X = mlp_mod.write(X, self._mlp(u), ctx, seq)
        else:  # xHC-Flash window (Flash-4sub: the state is carried from layer 2g to 2g+1)
            key = self.layer_idx // 2
            st = carry.pop(key) if isinstance(mod, Flash4SecondLayer) else mod.begin(X)
            st = mod.attn_write(st, self._attn(mod.attn_read(st), **attn_kwargs), seq)
            st = mod.mlp_write(st, self._mlp(mod.mlp_read(st)), seq)
            if isinstance(mod, Flash4FirstLayer):
                carry[key] = st  # X is unchanged until the window's single scatter in layer 2g+1
            else:
                X = st
        if self.is_last and self.hc_head is not None:
            return self.hc_head(X)
        if self.is_last:
            return reduce_streams(X, self.hc.reduction, self.hc_readout_logits)
        return X


class XHCMoePreTrainedModel(PreTrainedModel):
    config_class = XHCMoeConfig
    config: XHCMoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["XHCMoeDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_attention_backend = True
    # HC tensors stay fp32 whatever the backbone dtype (as in training).
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight", *HC_MODULE_NAMES]

    def _init_weights(self, module):
        if getattr(module, "_xhc_hc_owned", False):
            return  # HC modules initialise themselves (identity at init)
        if isinstance(module, (HyperConnection, XHCSublayer, XHCFlashLayer, Flash4FirstLayer, Flash4SecondLayer,
                               LearnedHead)):
            for m in module.modules():
                m._xhc_hc_owned = True
            module.reset_parameters()
            return
        super()._init_weights(module)
        from transformers import initialization as init
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeExperts, Glm4MoeTopkRouter

        std = self.config.initializer_range
        if isinstance(module, Glm4MoeTopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, Glm4MoeExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, XHCMoeDecoderLayer) and module.hc_readout_logits is not None:
            init.zeros_(module.hc_readout_logits)


class XHCMoeModel(XHCMoePreTrainedModel):
    def __init__(self, config: XHCMoeConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([XHCMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Glm4MoeRotaryEmbedding(config=config)
        self.hc = HCConfig.from_dict(config.hc)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, past_key_values=None, **kwargs):
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                  position_ids=position_ids, **{_MASK_CACHE_KW: cache})
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        seq = None
        if cache is not None and self.hc.kernel_sizes:
            # xHC temporal conv: keep the last κ_max − 1 branch outputs of every sublayer with the KV cache.
            if past == 0 or getattr(cache, "_xhc_temporal", None) is None:
                cache._xhc_temporal = {}
            seq = SequenceContext(decode_cache=cache._xhc_temporal)
        X = expand_streams(inputs_embeds.transpose(0, 1), self.hc.n)  # [s, b, N, C]
        carry = {}
        for layer in self.layers:
            X = layer(X, seq=seq, carry=carry, attention_mask=mask, position_ids=position_ids,
                      use_cache=use_cache, position_embeddings=position_embeddings, **{_ATTN_CACHE_KW: cache}, **kwargs)
        hidden = self.norm(X.transpose(0, 1))
        return BaseModelOutputWithPast(last_hidden_state=hidden, **{_OUT_CACHE_FIELD: cache})


class XHCMoeForCausalLM(XHCMoePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: XHCMoeConfig):
        super().__init__(config)
        self.model = XHCMoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        sl = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, sl, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_OUT_CACHE_FIELD: getattr(out, _OUT_CACHE_FIELD)})


__all__ = ["XHCMoeForCausalLM", "XHCMoeModel", "XHCMoePreTrainedModel"]
