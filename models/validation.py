"""Reject Megatron options that cannot work with hyper-connections (docs/math.md §1.7).

Every error is one line that names the option, why, and the alternative.
"""

from __future__ import annotations

from xhc.config import HCConfig, HCConfigError


class HCMegatronConfigError(HCConfigError):
    """A Megatron TransformerConfig option is incompatible with hyper-connections."""


def validate_hc_transformer_config(config, hc: HCConfig) -> None:
    """Raise :class:`HCMegatronConfigError` for an unsupported combination (no-op for vanilla)."""
    if not hc.enabled:
        return
    name = hc.variant

    def bad(option, value, why, alternative):
        raise HCMegatronConfigError(
            f"TransformerConfig.{option}={value!r} is not supported with hyper-connections "
            f"(variant {name!r}): {why}; {alternative}"
        )

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if getattr(config, "mtp_num_layers", None) and layout is not None:
        bad("pipeline_model_parallel_layout", "(set)", "multi-token prediction through the streams runs on the "
            "last pipeline stage only", "drop the layout (MTP then sits on the last stage)")
    if getattr(config, "enable_cuda_graph", False) or getattr(config, "external_cuda_graph", False):
        opt = "enable_cuda_graph" if getattr(config, "enable_cuda_graph", False) else "external_cuda_graph"
        bad(opt, True, "CUDA graphs are not supported with hyper-connection layers yet",
            "set it to False (eager execution)")
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none"):
        bad("cuda_graph_impl", config.cuda_graph_impl, "CUDA graphs are not supported with hyper-connection layers yet",
            "set cuda_graph_impl='none'")
    if getattr(config, "fused_residual_rmsnorm", False):
        bad("fused_residual_rmsnorm", True, "the residual add it fuses is replaced by the hyper-connection write",
            "set fused_residual_rmsnorm=False")
    if getattr(config, "fp32_residual_connection", False):
        bad("fp32_residual_connection", True,
            "the N-stream state is kept in the residual dtype and HC maths already accumulates in fp32",
            "set fp32_residual_connection=False")
    if getattr(config, "inference_fuse_tp_communication", False):
        bad("inference_fuse_tp_communication", True, "the fused reduce-scatter+residual-add+norm kernel assumes one stream",
            "set inference_fuse_tp_communication=False")
    if name == "xhc_flash4":
        crossing = _flash4_window_crossing(config)
        if crossing is not None:
            i, where = crossing
            bad("num_layers", config.num_layers,
                f"Flash-4sub windows span layers (2g, 2g+1) and may not cross a pipeline stage, but layers "
                f"{i} and {i + 1} (0-based) sit on {where}",
                "give every (virtual) pipeline stage an even number of layers starting at an even layer "
                "(pipeline_model_parallel_size, num_layers_in_first/last_pipeline_stage, "
                "pipeline_model_parallel_layout), or use variant 'xhc_flash'")
        if getattr(config, "recompute_granularity", None) == "full":
            bad("recompute_granularity", "full", "Flash-4sub carries routing state from layer 2g to 2g+1, "
                "which a full-layer recompute would lose", "use recompute_granularity='selective' or None")


def stage_layer_ids(config) -> list:
    """Global 0-based layer ids of every (pipeline rank, virtual stage) chunk, from Megatron's own
    layer-placement functions (even split, uneven first/last stage, embedding/loss accounting,
    explicit layouts)."""
    pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if pp == 1 and vpp is None:
        return [list(range(config.num_layers))]
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    chunks = []
    for vp_stage in (range(vpp) if vpp else [None]):
        for pp_rank in range(pp):
            if layout is not None:
                chunks.append(list(layout.get_layer_id_list(LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)))
            else:
                offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
                n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
                chunks.append(list(range(offset, offset + n)))
    return chunks


def _flash4_window_crossing(config):
    """``(2g, description)`` of the first Flash-4sub window split across chunks, or None."""
    where = {}
    for c, ids in enumerate(stage_layer_ids(config)):
        for pos, i in enumerate(ids):
            where[i] = (c, pos)
    L = config.num_layers
    for i in range(0, L - 1, 2):
        a, b = where.get(i), where.get(i + 1)
        if a is None or b is None or a[0] != b[0] or b[1] != a[1] + 1:
            return i, "different (virtual) pipeline stages"
    return None
