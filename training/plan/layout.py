"""The planner's hardware and layout: the GPU kinds (:data:`GPUS`), the named efficiencies of the
time model (:class:`Efficiencies`) and a run's parallel layout and batch (:class:`Layout`); the
planner (:mod:`training.plan.model`) builds on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


SHARDED_MUON_DEFAULT = True
"""Whether Muon's state is planned sharded over DP by default (GPU, DP > 1), as
:func:`training.optim.shards_state` decides for the trainer: on the Megatron backend unless
``optimizer.use_distributed_optimizer`` is false (``tools.plan --no-sharded-muon`` plans it replicated)."""


# ================================================================================================
# GPUs and efficiencies (docs/planning.md, "GPU table")
# ================================================================================================
@dataclass(frozen=True)
class GPU:
    """One accelerator kind: memory in GB (1e9 bytes), dense bf16 peak in TFLOP/s, HBM bandwidth in TB/s,
    NVLink bandwidth per GPU and direction in GB/s, inter-node network per GPU in GB/s, GPUs per node."""

    name: str
    memory_gb: float
    bf16_tflops: float
    hbm_tbs: float
    nvlink_gbs: float
    network_gbs: float
    per_node: int = 8
    memory_mib: Optional[float] = None
    """The device memory as the driver reports it (``nvidia-smi``'s total, MiB); the capacity when set
    (an "80 GB" H100 reports 81,559 MiB = 79.6 GiB), else ``memory_gb``·1e9."""
    fp32_tflops: float = 0.0
    """Dense fp32 (non-tensor-core) peak: the fp32 router GEMM (``moe_router_dtype: fp32``) runs there."""

    @property
    def memory_bytes(self) -> float:
        return self.memory_mib * 2 ** 20 if self.memory_mib else self.memory_gb * 1e9


GPUS: Dict[str, GPU] = {
    # vendor data sheets (SXM parts); network: one 400 Gb/s NIC per GPU (50 GB/s), A100: 200 Gb/s
    # memory_mib: nvidia-smi's total of the SXM parts (A100 80GB 81,920; H100 80GB HBM3 81,559; H200 143,771);
    # B200: the data sheet's 180 GB.  fp32: the data sheets' non-tensor FP32 peaks.
    "a100": GPU("a100", 80, 312, 2.039, 300, 25, memory_mib=81920, fp32_tflops=19.5),
    "h100": GPU("h100", 80, 989, 3.35, 450, 50, memory_mib=81559, fp32_tflops=67),
    "h200": GPU("h200", 141, 989, 4.8, 450, 50, memory_mib=143771, fp32_tflops=67),
    "b200": GPU("b200", 180, 2250, 8.0, 900, 50, fp32_tflops=80),
}


@dataclass(frozen=True)
class Efficiencies:
    """Named assumptions of the time model, as fractions of the peaks (printed with every plan)."""

    gemm: float = 0.75
    """The GEMM efficiency's asymptote: the fraction of the bf16 peak a large GEMM reaches; each GEMM gets
    :func:`training.plan.gpu_model.gemm_efficiency` of its shape (a roofline on arithmetic intensity), at most
    this.  0.75 (742 of 989 TFLOP/s on an H100): cuBLASLt's large bf16 GEMMs run at 0.7-0.8 of the dense peak."""
    attn: float = 0.45
    """Fraction of the bf16 peak of the fused (flash / cuDNN) attention on its forward FLOPs + 2.5x them backward
    (the backward recomputes the scores): FlashAttention-2/3 and cuDNN reach 0.35-0.6 of the H100's peak at
    head dim 128 (FlashAttention-3 paper, Figs. 4-6)."""
    elementwise: float = 0.7
    """Fraction of HBM bandwidth of the backbone's memory-bound ops (norms, SwiGLU, RoPE, residual adds, permute,
    loss) and the optimizer step: an H100 copies at 2.9 of 3.35 TB/s (0.87); fused TE kernels less."""
    hbm: float = 0.3
    """Achieved fraction of HBM bandwidth on the HC streams' accounted memory traffic (calibrated: the geometric
    mean of the compile-path mHC, xHC and Flash-4sub units measured on the H200, docs/planning.md)."""
    link: float = 0.7
    """Achieved fraction of NVLink / network bandwidth on collectives and pipeline sends."""
    a2a: float = 0.5
    """Fraction of the link bandwidth NCCL's all-to-all (``alltoall`` dispatcher) reaches on the EP dispatch."""
    deepep: float = 0.85
    """Fraction DeepEP's dispatch / combine (``flex`` dispatcher) reaches: its README measures 153 of 160 GB/s
    NVLink and 43-47 of 50 GB/s RDMA with the normal (training) kernels."""
    overlap_dp: float = 1.0
    """Fraction of the DP reduce-scatter / all-gather hideable behind the backward of the last / forward of the
    first micro-batch that ``overlap_grad_reduce`` / ``overlap_param_gather`` hide."""
    overlap_tp: float = 0.8
    """Fraction of the TP collectives ``parallel.tp_comm_overlap`` (TE userbuffers) hides behind the GEMMs."""
    overlap_ep: float = 0.8
    """Fraction of the expert all-to-all ``parallel.ep_overlap`` (1F1B A2A overlap) hides behind compute."""
    overlap_pp: float = 0.75
    """Fraction of the pipeline sends the interleaved schedule overlaps with compute (``overlap_p2p_comm``)."""
    moe_imbalance: float = 1.15
    """The most loaded expert rank's share over the mean under dropless routing (expert GEMMs and all-to-all):
    Megatron-MoE-ModelZoo's Qwen3-235B runs measure 1.09-1.25 between forced-balance and dropless routing."""
    layer_overhead_ms: float = 0.0
    """Fixed time per layer per micro-batch (kernel launches, router, host): the small-model floor."""
    moe_layer_overhead_ms: float = 1.0
    """Fixed time per MoE layer per forward or backward pass: the host waits for the routed token counts (a
    device-to-host sync for the grouped GEMM's split sizes and the dispatcher's layout) before it launches the
    experts.  Megatron-Core captures ``moe_router`` / ``moe_preprocess`` in CUDA graphs to remove it
    (Megatron-MoE-ModelZoo's GB200 recipes).  Fitted on the five published MoE rows: ``python -m
    bench.plan_public --fit`` gives 1.03, rounded (docs/planning.md)."""


# ================================================================================================
# Layout
# ================================================================================================
@dataclass(frozen=True)
class Layout:
    """The parallel layout and the batch of one run (from a training config, or given by a search)."""

    gpus: int
    tp: int = 1
    sp: bool = False
    ep: int = 1
    etp: Optional[int] = None
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    seq: int = 1
    recompute: str = "none"
    hc_recompute: bool = False
    optimizer: str = "adamw"
    distributed_optimizer: Optional[bool] = None
    sharded_muon: Optional[bool] = None
    gpu: bool = True
    bf16: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_fp32: bool = True
    """GPU: the DDP main-grad buffer and reduce in fp32 (``parallel.grad_reduce_in_fp32``), else bf16."""
    tp_comm_overlap: bool = False
    ep_overlap: bool = False
    dispatcher: Optional[str] = None
    """The MoE token dispatcher (``moe_token_dispatcher_type``; None: the preset's)."""
    te: bool = True
    """GPU: Transformer Engine's layer spec (fused attention); false: the local spec (``model.use_transformer_engine``)."""
    vocab: Optional[int] = None
    """Embedding rows, padded (None: the preset's vocabulary)."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        return self.gpus // (self.pp * self.ep * self.expert_tp)

    @property
    def num_micro(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def uses_distributed_optimizer(self) -> bool:
        """Megatron's distributed optimizer: AdamW on GPU unless ``optimizer.use_distributed_optimizer``
        is false.  Never with Muon, whose state (its AdamW parameters' too) is sharded layer-wise or
        replicated as a whole (:attr:`uses_sharded_muon`), as training.optim.megatron builds it."""
        if not self.gpu or self.optimizer == "muon":
            return False
        if self.distributed_optimizer is not None:
            return bool(self.distributed_optimizer)
        return self.optimizer == "adamw"

    @property
    def uses_sharded_muon(self) -> bool:
        """Muon with each parameter's state on one DP rank (issue #44): on by default wherever AdamW would use
        the distributed optimizer (GPU, DP > 1), as the trainer does (:func:`training.optim.shards_state`)."""
        if self.optimizer != "muon" or not self.gpu:
            return False
        if self.sharded_muon is not None:
            return bool(self.sharded_muon)
        return SHARDED_MUON_DEFAULT and self.distributed_optimizer is not False

    def describe(self) -> str:
        parts = [f"tp={self.tp}{'+sp' if self.sp else ''}", f"pp={self.pp}" + (f" vpp={self.vpp}" if self.vpp else ""),
                 f"ep={self.ep}"]
        if self.etp:
            parts.append(f"etp={self.etp}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        parts += [f"dp={self.dp}", f"mbs={self.micro_batch}", f"recompute={self.recompute}",
                  f"hc_recompute={'on' if self.hc_recompute else 'off'}"]
        over = [n for n, on in (("tp", self.tp_comm_overlap), ("ep", self.ep_overlap),
                                ("dp", self.overlap_grad_reduce)) if on]
        if self.gpu and over:
            parts.append("overlap=" + "+".join(over))
        return " ".join(parts)
