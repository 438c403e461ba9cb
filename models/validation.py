"""Reject Megatron options that cannot work with hyper-connections (spec §1.7).

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

    if getattr(config, "mtp_num_layers", None):
        bad("mtp_num_layers", config.mtp_num_layers, "multi-token prediction layers expect a single residual stream",
            "set mtp_num_layers=None (no MTP) or use variant 'none'")
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
        pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
        vpp = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
        per_stage = config.num_layers // (pp * vpp)
        if (pp > 1 or vpp > 1) and per_stage % 2 != 0:
            bad("num_layers", config.num_layers,
                f"Flash-4sub windows span two layers and may not cross a pipeline stage, but each stage holds {per_stage}",
                "use an even number of layers per (virtual) pipeline stage, or variant 'xhc_flash'")
        if getattr(config, "recompute_granularity", None) == "full":
            bad("recompute_granularity", "full", "Flash-4sub carries routing state from layer 2g to 2g+1, "
                "which a full-layer recompute would lose", "use recompute_granularity='selective' or None")
