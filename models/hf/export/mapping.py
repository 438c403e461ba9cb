"""Parameter names and layouts: Megatron-Core (single rank, TP = EP = PP = 1) <-> Hugging Face.

The backbone maps onto ``transformers``' GLM-4.5-MoE (``Glm4MoeForCausalLM``) names, the
hyper-connection tensors keep their xhc names under ``model.layers.<i>.``::

    embedding.word_embeddings.weight                       model.embed_tokens.weight
    decoder.layers.i.input_layernorm.weight                model.layers.i.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv.weight      model.layers.i.self_attn.{q,k,v}_proj.weight
    decoder.layers.i.self_attention.{q,k}_layernorm.weight model.layers.i.self_attn.{q,k}_norm.weight
    decoder.layers.i.self_attention.linear_proj.weight     model.layers.i.self_attn.o_proj.weight
    decoder.layers.i.pre_mlp_layernorm.weight              model.layers.i.post_attention_layernorm.weight
    decoder.layers.i.mlp.linear_fc1.weight (dense)         model.layers.i.mlp.{gate,up}_proj.weight
    decoder.layers.i.mlp.linear_fc2.weight (dense)         model.layers.i.mlp.down_proj.weight
    decoder.layers.i.mlp.router.weight                     model.layers.i.mlp.gate.weight
    decoder.layers.i.mlp.router.expert_bias                model.layers.i.mlp.gate.e_score_correction_bias
    decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight
                                     model.layers.i.mlp.experts.e.{gate,up}_proj.weight    (Hub layout)
                                     model.layers.i.mlp.experts.gate_up_proj[e]            (fused layout)
    decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight
                                     model.layers.i.mlp.experts.e.down_proj.weight / experts.down_proj[e]
    decoder.layers.i.mlp.shared_experts.linear_fc{1,2}.weight  model.layers.i.mlp.shared_experts.*
    decoder.layers.i.<hc name>                              model.layers.i.<hc name>
    decoder.final_layernorm.weight                         model.norm.weight
    output_layer.weight                                    lm_head.weight

Megatron's fused QKV weight is grouped by query group: for each of the ``g`` KV groups, its
``h/g`` query heads, then its key head, then its value head (``[g·(h/g + 2)·d, C]``); query head
``j`` of group ``q`` is head ``q·h/g + j``, which is the head order ``transformers``' ``repeat_kv``
assumes.  SwiGLU's ``linear_fc1`` stacks ``[gate; up]`` along the output dimension, as does the
fused ``gate_up_proj`` of ``transformers``' experts.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Optional

import torch

HC_NAMES = ("self_attention_hyper_connection.", "mlp_hyper_connection.", "hc_readout_logits", "hc_head.")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

# Tensors kept in fp32 in an exported folder whatever --dtype says (as in training, and as
# transformers keeps the GLM-4.5 router in fp32).
FP32_PATTERNS = ("_hyper_connection.", "hc_readout_logits", "hc_head.", "mlp.gate.weight", "e_score_correction_bias")


class MappingError(ValueError):
    """A tensor name or shape does not fit the architecture (the message names the tensor)."""


def keep_fp32(hf_name: str) -> bool:
    return any(p in hf_name for p in FP32_PATTERNS)


def is_hc_name(name: str) -> bool:
    return any(h in name for h in HC_NAMES)


def group_of(megatron_name: str) -> str:
    """The streaming group of a Megatron tensor: ``embedding``, ``layer.<i>`` or ``head``."""
    m = _LAYER_RE.match(megatron_name)
    if m:
        return f"layer.{int(m.group(1))}"
    return "embedding" if megatron_name.startswith("embedding.") else "head"


def split_qkv(w: torch.Tensor, heads: int, groups: int, head_dim: int):
    per = heads // groups
    C = w.shape[-1]
    w = w.reshape(groups, per + 2, head_dim, C)
    q = w[:, :per].reshape(heads * head_dim, C)
    k = w[:, per].reshape(groups * head_dim, C)
    v = w[:, per + 1].reshape(groups * head_dim, C)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, head_dim: int):
    per = heads // groups
    C = q.shape[-1]
    w = torch.cat([q.reshape(groups, per, head_dim, C), k.reshape(groups, 1, head_dim, C),
                   v.reshape(groups, 1, head_dim, C)], 1)
    return w.reshape(groups * (per + 2) * head_dim, C).contiguous()


def megatron_to_hf(tensors: Dict[str, torch.Tensor], arch: dict, fused_experts: bool) -> Dict[str, torch.Tensor]:
    """One streaming group of Megatron tensors -> HF tensors.

    ``arch``: ``heads``, ``groups``, ``head_dim``, ``num_experts``.  ``fused_experts``: stack the
    experts into ``gate_up_proj`` / ``down_proj`` (the module layout of ``transformers`` >= 5)
    instead of the per-expert Hub layout.
    """
    out: Dict[str, torch.Tensor] = {}
    experts: Dict[int, Dict[str, torch.Tensor]] = {}
    layer_prefix = None
    for name, t in tensors.items():
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t
            continue
        if name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
            continue
        if name == "output_layer.weight":
            out["lm_head.weight"] = t
            continue
        m = _LAYER_RE.match(name)
        if not m:
            raise MappingError(f"tensor {name}: no Hugging Face counterpart (is this a GPTModel of the zoo?)")
        i, rest = int(m.group(1)), m.group(2)
        p = f"model.layers.{i}."
        layer_prefix = p
        if is_hc_name(rest):
            out[p + rest] = t
        elif rest == "input_layernorm.weight":
            out[p + "input_layernorm.weight"] = t
        elif rest == "pre_mlp_layernorm.weight":
            out[p + "post_attention_layernorm.weight"] = t
        elif rest == "self_attention.linear_qkv.weight":
            q, k, v = split_qkv(t, arch["heads"], arch["groups"], arch["head_dim"])
            out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"], out[p + "self_attn.v_proj.weight"] = q, k, v
        elif rest == "self_attention.linear_proj.weight":
            out[p + "self_attn.o_proj.weight"] = t
        elif rest == "self_attention.q_layernorm.weight":
            out[p + "self_attn.q_norm.weight"] = t
        elif rest == "self_attention.k_layernorm.weight":
            out[p + "self_attn.k_norm.weight"] = t
        elif rest in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
            sub = "mlp." if rest.startswith("mlp.linear") else "mlp.shared_experts."
            gate, up = t.chunk(2, 0)
            out[p + sub + "gate_proj.weight"], out[p + sub + "up_proj.weight"] = gate.contiguous(), up.contiguous()
        elif rest in ("mlp.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight"):
            sub = "mlp." if rest.startswith("mlp.linear") else "mlp.shared_experts."
            out[p + sub + "down_proj.weight"] = t
        elif rest == "mlp.router.weight":
            out[p + "mlp.gate.weight"] = t
        elif rest == "mlp.router.expert_bias":
            out[p + "mlp.gate.e_score_correction_bias"] = t
        elif _EXPERT_RE.match(rest):
            e, which = _EXPERT_RE.match(rest).groups()
            experts.setdefault(int(e), {})[which] = t
        else:
            raise MappingError(f"tensor {name}: no Hugging Face counterpart in the GLM-4.5-MoE layout")
    if experts:
        ids = sorted(experts)
        if ids != list(range(arch["num_experts"])):
            raise MappingError(f"{layer_prefix}mlp.experts: got experts {ids[:4]}..., expected 0..{arch['num_experts'] - 1}")
        if fused_experts:
            out[layer_prefix + "mlp.experts.gate_up_proj"] = torch.stack([experts[e]["linear_fc1"] for e in ids])
            out[layer_prefix + "mlp.experts.down_proj"] = torch.stack([experts[e]["linear_fc2"] for e in ids])
        else:
            for e in ids:
                gate, up = experts[e]["linear_fc1"].chunk(2, 0)
                q = f"{layer_prefix}mlp.experts.{e}."
                out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = gate.contiguous(), up.contiguous()
                out[q + "down_proj.weight"] = experts[e]["linear_fc2"]
    return out


def hf_group_of(hf_name: str) -> str:
    m = _HF_LAYER_RE.match(hf_name)
    if m:
        return f"layer.{int(m.group(1))}"
    return "embedding" if hf_name.startswith("model.embed_tokens") else "head"


def hf_to_megatron(tensors: Dict[str, torch.Tensor], arch: dict) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`megatron_to_hf` for one group (either expert layout)."""
    out: Dict[str, torch.Tensor] = {}
    pending: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name == "model.embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = t
            continue
        if name == "model.norm.weight":
            out["decoder.final_layernorm.weight"] = t
            continue
        if name == "lm_head.weight":
            out["output_layer.weight"] = t
            continue
        m = _HF_LAYER_RE.match(name)
        if not m:
            raise MappingError(f"tensor {name}: not part of a GLM-4.5-MoE / xhc model")
        i, rest = int(m.group(1)), m.group(2)
        p = f"decoder.layers.{i}."
        if is_hc_name(rest):
            out[p + rest] = t
            continue
        simple = {"input_layernorm.weight": "input_layernorm.weight",
                  "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
                  "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
                  "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
                  "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
                  "mlp.down_proj.weight": "mlp.linear_fc2.weight",
                  "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
                  "mlp.gate.weight": "mlp.router.weight",
                  "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias"}
        if rest in simple:
            out[p + simple[rest]] = t
        elif rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            pending.setdefault(p + "self_attention.linear_qkv.weight", {})[rest[10]] = t
        elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            pending.setdefault(p + "mlp.linear_fc1.weight", {})[rest[4]] = t
        elif rest in ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"):
            pending.setdefault(p + "mlp.shared_experts.linear_fc1.weight", {})[rest[19]] = t
        elif rest == "mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.local_experts.{e}.linear_fc1.weight"] = t[e].contiguous()
        elif rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.local_experts.{e}.linear_fc2.weight"] = t[e].contiguous()
        elif _HF_EXPERT_RE.match(rest):
            e, which = _HF_EXPERT_RE.match(rest).groups()
            if which == "down_proj":
                out[f"{p}mlp.experts.local_experts.{e}.linear_fc2.weight"] = t
            else:
                pending.setdefault(f"{p}mlp.experts.local_experts.{e}.linear_fc1.weight", {})[which[0]] = t
        else:
            raise MappingError(f"tensor {name}: not part of a GLM-4.5-MoE / xhc model")
    for name, parts in pending.items():
        if name.endswith("linear_qkv.weight"):
            if set(parts) != {"q", "k", "v"}:
                raise MappingError(f"{name}: q/k/v projections incomplete (have {sorted(parts)})")
            out[name] = merge_qkv(parts["q"], parts["k"], parts["v"], arch["heads"], arch["groups"], arch["head_dim"])
        else:
            if set(parts) != {"g", "u"}:
                raise MappingError(f"{name}: gate/up projections incomplete")
            out[name] = torch.cat([parts["g"], parts["u"]], 0).contiguous()
    return out


def arch_of(backbone: dict) -> dict:
    heads = int(backbone["num_attention_heads"])
    return {"heads": heads, "groups": int(backbone.get("num_query_groups") or heads),
            "head_dim": int(backbone.get("kv_channels") or int(backbone["hidden_size"]) // heads),
            "num_experts": int(backbone.get("num_moe_experts") or 0)}


def sort_groups(groups: Iterable[str]) -> list:
    """Group names in streaming order: embedding, layers ascending, head."""
    def key(g):
        return (0, 0) if g == "embedding" else ((1, int(g.split(".")[1])) if g.startswith("layer.") else (2, 0))

    return sorted(set(groups), key=key)


def count(tensors: Dict[str, torch.Tensor], only: Optional[str] = None) -> int:
    return sum(t.numel() for k, t in tensors.items() if only is None or only in k)
