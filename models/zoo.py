"""Model zoo: YAML presets under ``configs/models/`` -> Megatron ``TransformerConfig`` + ``HCConfig``
-> ``GPTModel``.

A preset name is ``<file>:<variant>``, e.g. ``moe-18b:xhc`` or ``tiny-moe:mhc``.  Each file holds
one ``backbone:`` (TransformerConfig field names plus a few GPTModel/zoo keys, layered over
``_defaults.yaml``) and a ``variants:`` map of :class:`~xhc.config.HCConfig` fields.

Zoo-only backbone keys:

====================  ==========================================================================
``first_dense_layers``  leading dense layers; the rest are MoE (sets ``moe_layer_freq``)
``activation``        ``silu`` / ``gelu`` (with ``gated_linear_unit`` gives SwiGLU / GeGLU)
``vocab_size``        tokenizer size (a pre-training config may override it)
``seq_length``        maximum sequence length
``rotary_base``, ``position_embedding_type``, ``untie_embeddings``   GPTModel arguments
``peak_lr``           the paper's peak learning rate (informational; training reads its own)
====================  ==========================================================================
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
import yaml

from configs import config_dir
from xhc.accounting import BackboneShape
from xhc.config import HCConfig, HCConfigError

CONFIG_DIR = config_dir("models")  # package data: found from any working directory, installed or not
ZOO_KEYS = {"first_dense_layers", "activation", "vocab_size", "seq_length", "rotary_base",
            "position_embedding_type", "untie_embeddings", "peak_lr", "hc_recompute"}
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


class ZooError(ValueError):
    """A model preset is missing or invalid (message names the preset/file and key)."""


@dataclass
class ModelPreset:
    """A resolved preset: backbone settings and the hyper-connection config."""

    name: str
    backbone: Dict[str, Any]
    hc: HCConfig
    description: str = ""
    source: Optional[Path] = None

    @property
    def num_layers(self) -> int:
        return int(self.backbone["num_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.backbone["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.backbone["vocab_size"])

    @property
    def seq_length(self) -> int:
        return int(self.backbone["seq_length"])

    @property
    def hc_recompute(self) -> bool:
        """HC recompute (:class:`models.hc_layer.HCRecompute`): zoo key ``hc_recompute`` of the backbone
        or of the variant entry (the variant wins)."""
        return bool(self.backbone.get("hc_recompute", False))


def _read_yaml(path: Path) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ZooError(f"model preset file {path} does not exist: see `python -m tools.zoo --list`") from None
    except yaml.YAMLError as e:
        raise ZooError(f"model preset file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ZooError(f"model preset file {path} must hold a mapping with 'backbone' and 'variants'")
    return data


def preset_files() -> List[Path]:
    return sorted(p for p in CONFIG_DIR.glob("*.yaml") if not p.name.startswith("_"))


def list_presets() -> List[str]:
    """Every ``file:variant`` name in the zoo."""
    names = []
    for path in preset_files():
        for v in (_read_yaml(path).get("variants") or {}):
            names.append(f"{path.stem}:{v}")
    return names


def load_preset(name: str, backbone_overrides: Optional[dict] = None, hc_overrides: Optional[dict] = None) -> ModelPreset:
    """Resolve ``file:variant`` (or ``path/to/file.yaml:variant``) into a :class:`ModelPreset`."""
    if ":" not in name:
        raise ZooError(f"model preset {name!r} must be '<file>:<variant>', e.g. 'tiny-moe:xhc'; "
                       f"see `python -m tools.zoo --list`")
    file_part, variant = name.rsplit(":", 1)
    path = Path(file_part) if file_part.endswith(".yaml") else CONFIG_DIR / f"{file_part}.yaml"
    data = _read_yaml(path)
    defaults = _read_yaml(CONFIG_DIR / "_defaults.yaml").get("backbone", {})
    backbone = {**defaults, **(data.get("backbone") or {}), **(backbone_overrides or {})}
    variants = data.get("variants") or {}
    if variant not in variants:
        raise ZooError(f"model preset file {path.name} has no variant {variant!r}; "
                       f"available: {', '.join(variants) or '(none)'}")
    hc_dict = {**(variants[variant] or {}), **(hc_overrides or {})}
    if "hc_recompute" in hc_dict:  # a zoo key, allowed per variant: not an HCConfig field
        backbone["hc_recompute"] = hc_dict.pop("hc_recompute")
    if not isinstance(backbone.get("hc_recompute", False), bool):
        raise ZooError(f"model preset {name}: hc_recompute={backbone['hc_recompute']!r} must be true or false")
    try:
        hc = HCConfig.from_dict(hc_dict)
    except HCConfigError as e:
        raise ZooError(f"model preset {name}: {e}") from None
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if key not in backbone:
            raise ZooError(f"model preset {name}: backbone.{key} is missing")
    return ModelPreset(name=name, backbone=backbone, hc=hc, description=data.get("description", ""), source=path)


def transformer_config_kwargs(preset: ModelPreset) -> Dict[str, Any]:
    """Backbone settings as ``TransformerConfig`` keyword arguments (zoo-only keys translated)."""
    b = dict(preset.backbone)
    kw = {k: v for k, v in b.items() if k not in ZOO_KEYS}
    if kw.get("moe_grouped_gemm", False) is None:  # null: the spec builder decides (models.specs)
        del kw["moe_grouped_gemm"]
    act = b.get("activation", "silu")
    if act not in ACTIVATIONS:
        raise ZooError(f"model preset {preset.name}: backbone.activation={act!r}; allowed: {', '.join(ACTIVATIONS)}")
    kw["activation_func"] = ACTIVATIONS[act]
    if kw.get("num_moe_experts"):
        dense = int(b.get("first_dense_layers", 0))
        if not 0 <= dense <= preset.num_layers:
            raise ZooError(f"model preset {preset.name}: backbone.first_dense_layers={dense} must lie in [0, num_layers]")
        kw["moe_layer_freq"] = [0] * dense + [1] * (preset.num_layers - dense)
    return kw


def build_transformer_config(preset: ModelPreset, parallel: Optional[dict] = None, cpu: Optional[bool] = None,
                             **overrides):
    """A Megatron ``TransformerConfig`` for the preset.

    Args:
        parallel: ``tensor_model_parallel_size``, ``sequence_parallel``, ``expert_model_parallel_size``,
            ``pipeline_model_parallel_size``, ``context_parallel_size``, ... (TransformerConfig names).
        cpu: apply :func:`models.cpu_compat.cpu_safe_overrides` (default: when CUDA is absent).
        overrides: any further TransformerConfig fields (e.g. ``bf16=True``).
    """
    from megatron.core.transformer import TransformerConfig

    kw = transformer_config_kwargs(preset)
    kw.update(parallel or {})
    kw.update(overrides)
    if cpu is None:
        cpu = not torch.cuda.is_available()
    if cpu:
        from models.cpu_compat import cpu_safe_overrides

        kw.update(cpu_safe_overrides())
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(k for k in kw if k not in names)
    if unknown:
        raise ZooError(f"model preset {preset.name}: unknown backbone key(s) {', '.join(unknown)} "
                       f"(not TransformerConfig fields nor zoo keys {', '.join(sorted(ZOO_KEYS))})")
    try:
        return TransformerConfig(**kw)
    except (AssertionError, ValueError) as e:
        raise ZooError(f"model preset {preset.name}: Megatron rejected the config: {e}") from None


def build_model(preset: ModelPreset, config, pre_process: bool = True, post_process: bool = True,
                vp_stage: Optional[int] = None, use_transformer_engine: Optional[bool] = None,
                vocab_size: Optional[int] = None, seq_length: Optional[int] = None, pg_collection=None,
                hc_recompute: Optional[bool] = None):
    """``GPTModel`` with the preset's hyper-connections on this rank's pipeline stage.

    ``pg_collection``: Megatron ``ProcessGroupCollection`` (default: the global parallel state).
    ``hc_recompute``: HC recompute in every HC layer (default: the preset's ``hc_recompute``)."""
    from megatron.core.models.gpt import GPTModel

    from models.specs import get_hc_decoder_block_spec

    pp_rank = pg_collection.pp.rank() if pg_collection is not None and pg_collection.pp is not None else None
    grouped = preset.backbone.get("moe_grouped_gemm")  # null: grouped experts on CUDA (models.specs)
    spec = get_hc_decoder_block_spec(config, preset.hc, use_transformer_engine=use_transformer_engine,
                                     vp_stage=vp_stage, pp_rank=pp_rank,
                                     grouped_experts=None if grouped is None else bool(grouped))
    from models.mtp import finish_mtp_model, get_mtp_block_spec

    from models.specs import _use_te

    te = _use_te(use_transformer_engine)
    mtp_spec = get_mtp_block_spec(config, spec, preset.hc, use_transformer_engine=te, vp_stage=vp_stage,
                                  pp_rank=pp_rank)
    b = preset.backbone
    kwargs = dict(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=int(vocab_size or b["vocab_size"]),
        max_sequence_length=int(seq_length or b["seq_length"]),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not b.get("untie_embeddings", True),
        position_embedding_type=b.get("position_embedding_type", "rope"),
        rotary_base=int(b.get("rotary_base", 10000)),
    )
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    if mtp_spec is not None:
        kwargs["mtp_block_spec"] = mtp_spec
    model = GPTModel(**kwargs)
    finish_mtp_model(model, preset.hc)  # MTP: parameter tags, the streams through the final norm (no-op without)
    rc = preset.hc_recompute if hc_recompute is None else hc_recompute
    if rc:
        from models.hc_layer import set_hc_recompute

        set_hc_recompute(model, True)
    return model


def hc_parameters(model: torch.nn.Module):
    """The hyper-connection parameters of a model (tagged by :mod:`models.hc_layer`)."""
    return [p for p in model.parameters() if getattr(p, "is_hyper_connection", False)]


def backbone_shape(preset):
    """The analytic :class:`xhc.accounting.BackboneShape` of a zoo preset."""
    b = preset.backbone
    return BackboneShape(
        name=preset.name, num_layers=int(b["num_layers"]), hidden=int(b["hidden_size"]),
        num_heads=int(b["num_attention_heads"]), num_kv_groups=int(b.get("num_query_groups") or b["num_attention_heads"]),
        expert_ffn=int(b.get("moe_ffn_hidden_size") or b.get("ffn_hidden_size")),
        head_dim=int(b.get("kv_channels") or b["hidden_size"] // b["num_attention_heads"]),
        num_experts=int(b.get("num_moe_experts") or 0), top_k=int(b.get("moe_router_topk") or 0),
        shared_expert_ffn=int(b.get("moe_shared_expert_intermediate_size") or 0),
        num_shared_experts=1 if b.get("moe_shared_expert_intermediate_size") else 0,
        # a preset without experts is dense in every layer (its MLP counted), whatever first_dense_layers says
        dense_ffn=int(b["ffn_hidden_size"]),
        num_dense_layers=int(b.get("first_dense_layers", 0)) if b.get("num_moe_experts") else int(b["num_layers"]),
        vocab=int(b["vocab_size"]), seq_len=int(b["seq_length"]),
        tied_embeddings=not b.get("untie_embeddings", True), qk_norm=bool(b.get("qk_layernorm", False)),
    )


def count_model(model, topk: int, num_experts: int) -> dict:
    """Total / activated / HC parameter counts of a (meta-device) GPTModel."""
    total = routed = hc = emb = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if ".experts." in name and "shared_experts" not in name:
            routed += n
        if getattr(p, "is_hyper_connection", False):
            hc += n
        if "embedding" in name or "output_layer" in name:
            emb += n
    activated = total - routed + (routed * topk // num_experts if num_experts else routed)
    return {"total": total, "activated": activated, "hc": hc, "embeddings": emb}
