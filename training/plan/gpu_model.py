"""The GPU path of the planner: what Megatron-Core and Transformer Engine keep for backward, and a time model
that knows GEMM shapes, the EP domain and the overlaps a config turns on (docs/planning.md, "GPU memory" and
"Time").

Every term names the code or document it follows.  Sources (read, not copied):

- [TML] Megatron-LM ``megatron/training/theoretical_memory_usage.py`` (weights + optimizer per most-loaded
  shard, ``6 + 12/DP`` bytes per parameter with the distributed optimizer; activations per layer after
  Korthikanti et al. 2022, arXiv 2205.05198, Table 2) and the open Megatron-LM pull request that adds MoE
  activations to it (the routed experts' activations per routed copy of a token).
- [TE-LNL] Transformer Engine ``pytorch/module/layernorm_linear.py``: the fused norm + GEMM saves the norm's
  input, its output ``ln_out`` (the GEMM input; under sequence parallelism the local shard, all-gathered again
  in backward) and ``rsigma`` (fp32).  [MC-LIN] Megatron-Core ``tensor_parallel/layers.py``
  (``LinearWithGradAccumulationAndAsyncCommunication``): the local spec's GEMM saves its input the same way.
- [MC-ATT] Megatron-Core ``transformer/attention.py`` (``get_query_key_value_tensors``: q is a copy of the
  split of ``mixed_qkv``, k and v views of it) and the fused RoPE (``apply_rope_fusion``, TE's
  ``fused_rope``: new q, k, nothing saved); [TE-DPA] TE ``DotProductAttention`` (flash / cuDNN fused
  attention): saves q, k, v, the output and the fp32 softmax statistics (one per head and token).
- [MC-DPA] Megatron-Core ``transformer/dot_product_attention.py`` (the local spec): ``baddbmm`` scores,
  ``FusedScaleMaskSoftmax`` keeps its output (``a·s`` per token), ``bmm`` with v.
- [MC-MLP] Megatron-Core ``transformer/mlp.py`` and ``fusions/fused_bias_swiglu.py``: the fused SwiGLU
  (``bias_activation_fusion``) saves its input (the FC1 output, 2F) and FC2 saves the SwiGLU output (F); the
  unfused path keeps ``silu(gate)`` as well (one more F).
- [MC-MOE] Megatron-Core ``transformer/moe/`` (``router.py``: fp32 logits and scores with
  ``moe_router_dtype=fp32``; ``token_dispatcher.py``: all-to-all over the expert group, tokens all-gathered
  over expert-TP; ``moe_utils.py`` / TE ``moe_permute``/``moe_unpermute`` with ``moe_permute_fusion``: only
  the row-id map is kept; ``experts.py``: the grouped GEMM saves its input, the activation its input).
- [MC-REC] Megatron-Core ``TransformerConfig.recompute_modules`` (``core_attn`` default, ``layernorm``,
  ``mlp``, ``moe``, ``moe_act``, ``shared_experts``) and ``recompute_granularity=full``.
- [MC-DDP] Megatron-Core ``distributed/distributed_data_parallel_config.py``: the main-grad buffer in fp32
  with ``grad_reduce_in_fp32`` (Megatron-LM forces it for bf16: "accumulate and all-reduce gradients in fp32
  for bfloat16 data type"), otherwise in the parameter dtype.
- [DeepEP] deepseek-ai/DeepEP README: normal (training) kernels reach about 153 of 160 GB/s on NVLink and 43-47
  of 50 GB/s over RDMA on H800 (bandwidth fraction ~0.9).
- [MOEZOO] yanring/Megatron-MoE-ModelZoo ``best_practice/qwen3``: the same run "forced balance" vs
  "dropless" (295 vs 237, 335 vs 277, 368 vs 320, 389 vs 357 TFLOP/s): dropless routing costs 1.09-1.25x.
- [ND-H100] Azure ND H100 v5 micro-benchmarks (samuel-bohman/AI-benchmarking-guide): HBM copy 2.90 of 3.35
  TB/s; cuBLASLt large GEMMs near the dense peak, small ones far below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts")


class PlanError(ValueError):
    """A plan that cannot be made (message names the key or option and the fix)."""


class ModelNotPlaceable(PlanError):
    """A model the accounting cannot place (one line: the key and the fix)."""


def model_dims(preset) -> SimpleNamespace:
    """The backbone's dimensions, or :class:`ModelNotPlaceable` for a model the planner's accounting does not
    cover (one line naming the key).  A preset without experts is dense in every layer."""
    b = preset.backbone
    L, C = preset.num_layers, preset.hidden_size
    a = int(b["num_attention_heads"])
    E = int(b.get("num_moe_experts") or 0)
    K = int(b.get("moe_router_topk") or 0)
    if b.get("multi_latent_attention"):
        raise ModelNotPlaceable("model.backbone.multi_latent_attention: the planner counts GQA attention only; "
                                "plan the model without MLA")
    if b.get("gated_linear_unit", True) is False:
        raise ModelNotPlaceable("model.backbone.gated_linear_unit: the accounting counts SwiGLU MLPs only; set it "
                                "to true")
    if E and not K:
        raise ModelNotPlaceable(f"model.backbone.moe_router_topk: {E} experts need a top-k >= 1; set "
                                "moe_router_topk")
    if E and K > E:
        raise ModelNotPlaceable(f"model.backbone.moe_router_topk: {K} > num_moe_experts={E}; set a top-k <= {E}")
    dense = int(b.get("first_dense_layers", 0)) if E else L
    if not 0 <= dense <= L:
        raise ModelNotPlaceable(f"model.backbone.first_dense_layers: {dense} must lie in [0, num_layers={L}]")
    if b.get("moe_layer_freq") not in (None, 1):
        raise ModelNotPlaceable("model.backbone.moe_layer_freq: the planner places MoE layers after "
                                "first_dense_layers only; use first_dense_layers")
    return SimpleNamespace(
        L=L, C=C, a=a, g=int(b.get("num_query_groups") or a), d=int(b.get("kv_channels") or C // a),
        F=int(b["ffn_hidden_size"]), E=E, K=K,
        Fe=int(b.get("moe_ffn_hidden_size") or b["ffn_hidden_size"]),
        Fs=int(b.get("moe_shared_expert_intermediate_size") or 0), dense=dense,
        qk_norm=bool(b.get("qk_layernorm")), V=int(b["vocab_size"]),
        fused_act=bool(b.get("bias_activation_fusion", False)),
        permute_fusion=bool(b.get("moe_permute_fusion", False)),
        dispatcher=str(b.get("moe_token_dispatcher_type") or "allgather"),
        modules=tuple(b.get("recompute_modules") or ("core_attn",)))


# ================================================================================================
# Memory: what one layer keeps for backward on the GPU path
# ================================================================================================
def gpu_layer_saved_elements(D, lay, layer: int, s: int, b: int) -> float:
    """bf16 elements (2 bytes; fp32 tensors count twice) one decoder layer keeps for backward on one micro-batch
    of ``b`` sequences of ``s`` tokens (``s`` already divided by CP) on one rank, as Megatron-Core with the TE
    or the local spec keeps them (module docstring for the sources):

    ========================  ===========================================  ======================================
    part                      elements per token                           on tokens
    ========================  ===========================================  ======================================
    each pre-norm + GEMM      ``C`` (input) + ``C`` (ln_out) + 2 (rsigma)  the SP shard ``s·b/tp`` [TE-LNL][MC-LIN]
                              ``layernorm`` recompute: ``C``               [MC-REC]
    QKV                       ``(a+2g)d/tp`` (``mixed_qkv``: v is a view)  ``s·b`` [MC-ATT]
    RoPE'd q, k               ``(a+g)d/tp``                                [MC-ATT] fused RoPE
    QK-norm                   ``2(a+g)/tp`` (fp32 rsigma)                  [TE-LNL]
    core attention            ``ad/tp`` (output = proj input) + ``2a/tp``   [TE-DPA]; ``core_attn`` recompute
                              (fp32 softmax stats); the local spec's       drops the statistics / probabilities
                              unfused attention: ``a·s/tp`` (the softmax
                              output, [MC-DPA])
    dense SwiGLU              ``2F/tp + F/tp`` (+``F/tp`` unfused)         ``s·b`` [MC-MLP]
    MoE router                ``4E`` (fp32 logits + scores)                SP shard [MC-MOE]
    per routed copy           ``C`` (grouped-GEMM input) + ``3F_e/etp``     ``K·(s·b/tp)·etp`` copies [MC-MOE],
                              (FC1 output, the weighted SwiGLU's output;   the [TML] MoE PR's per-copy count
                              +``2F_e/etp`` unfused; ``2F_e/etp`` with
                              ``moe_act``) + 2 (the fp32 probability:
                              0.16 applies it in the activation, the
                              unpermute keeps nothing) + 4 (int64
                              index, unfused permute only)
    shared expert             ``3F_s/tp`` (+``F_s/tp`` unfused)            ``s·b``
    ========================  ===========================================  ======================================

    ``mlp`` / ``moe`` recompute keep the sublayer's input only; ``full`` recompute is handled by the caller
    (the layer input only).  Without SP the SP-shard terms are on all ``s·b`` tokens."""
    tp, etp = lay.tp, lay.expert_tp
    seq_split = tp if lay.sp else 1
    tok_full = s * b
    tok_sp = s * b / seq_split
    mods = set(D.modules) if lay.recompute == "selective" else set()
    C, a, g, d = D.C, D.a, D.g, D.d

    def norm_linear() -> float:
        return C if "layernorm" in mods else 2 * C + 2

    attn = norm_linear() * tok_sp
    attn += ((a + 2 * g) * d + (a + g) * d + a * d) / tp * tok_full
    if D.qk_norm:
        attn += 2 * (a + g) / tp * tok_full
    if "core_attn" not in mods:
        if getattr(lay, "te", True):  # flash / cuDNN attention: fp32 softmax statistics per head
            attn += 2 * a / tp * tok_full
        else:  # the local spec's unfused DotProductAttention: the softmax output, one row of s per head
            attn += a * s * lay.cp / tp * tok_full
    act_extra = 0 if D.fused_act else 1
    if layer < D.dense:
        if "mlp" in mods:
            mlp = C * tok_sp
        else:
            mlp = norm_linear() * tok_sp + (3 + act_extra) * D.F / tp * tok_full
    elif "moe" in mods:
        mlp = C * tok_sp
    else:
        copies = D.K * tok_sp * etp
        if "moe_act" in mods:  # the activation checkpointed: its input (FC1's output) only
            widths = 2
        else:  # FC1 output 2F_e + the weighted activation's output F_e (FC2's input); unfused: silu and the
            widths = 3 + 2 * act_extra  # product before the probabilities too
        per_copy = C + widths * D.Fe / etp + 2  # + the fp32 probability the weighted activation keeps
        per_copy += 0 if D.permute_fusion else 4
        mlp = norm_linear() * tok_sp + 4 * D.E * tok_sp + copies * per_copy
        if D.Fs and "shared_experts" not in mods:
            mlp += (3 + act_extra) * D.Fs / tp * tok_full
    return attn + mlp


def megatron_grad_bytes(lay) -> int:
    """Bytes per parameter of the DDP main-grad buffer [MC-DDP]: 4 with ``grad_reduce_in_fp32`` (training's
    default, Megatron-LM's for bf16), 2 otherwise."""
    return 4 if getattr(lay, "grad_reduce_fp32", True) else 2


# ================================================================================================
# Time
# ================================================================================================
def gemm_efficiency(M: float, N: float, K: float, peak_flops: float, hbm_bytes_s: float, gemm_max: float) -> float:
    """Achieved fraction of the bf16 peak on an ``M×K @ K×N`` GEMM: a roofline on arithmetic intensity with
    no overlap of the operand traffic and the math, ``t = 2MNK/(peak·gemm_max) + 2(MK+KN+MN)/HBM``, hence

        efficiency = gemm_max · I / (I + peak·gemm_max/HBM),   I = MNK/(MK+KN+MN) = 1/(1/M + 1/N + 1/K)

    (the arithmetic intensity in FLOP per byte of bf16 operands).  A 16k×16k×16k GEMM on an H100 gets
    ``0.96·gemm_max``, a 4096-token expert GEMM of width 1536 ``0.80·gemm_max``, a 512-token one ``0.64·gemm_max``:
    the order cuBLASLt shows ([ND-H100]: 1024³ at 0.28 of the FP8 peak, 8192³ at 0.65)."""
    if min(M, N, K) <= 0:
        return gemm_max
    intensity = 1.0 / (1.0 / M + 1.0 / N + 1.0 / K)
    ridge = peak_flops * gemm_max / hbm_bytes_s
    return gemm_max * intensity / (intensity + ridge)


@dataclass
class Gemm:
    """One GEMM of the step on one rank: its shape (per call), forward FLOPs per call and calls per step."""

    name: str
    M: float
    N: float
    K: float
    calls: float  # per step (forward)
    kind: str = "gemm"  # gemm | attention | router

    @property
    def flops(self) -> float:
        """Training FLOPs (forward + the two backward GEMMs) of all calls."""
        return 3 * 2 * self.M * self.N * self.K * self.calls


def gemm_inventory(D, lay, stage_layers: List[int], first: bool, last: bool, micro: int) -> List[Gemm]:
    """The GEMMs one rank of a pipeline stage runs per step (``micro`` micro-batches), with the shapes they run
    at: tokens ``s·b`` per micro-batch (the SP all-gather makes the TP GEMMs see every token), widths divided
    by TP; the routed experts as one grouped GEMM per local expert on ``K·s·b/tp·etp·ep/E`` copies each (even
    load); the attention scores as the causal ``QK^T`` and ``AV``.  Summed over the stages and divided by the
    tokens this is the accounting's FLOPs per token (``tests/test_plan.py`` checks it)."""
    tp, etp, ep = lay.tp, lay.expert_tp, lay.ep
    seq_split = tp if lay.sp else 1
    s = lay.seq // lay.cp
    T = s * lay.micro_batch
    C, a, g, d = D.C, D.a, D.g, D.d
    out: List[Gemm] = []
    n = {"dense": 0, "moe": 0}
    for i in stage_layers:
        n["dense" if i < D.dense else "moe"] += 1
    nl = n["dense"] + n["moe"]
    if nl:
        out.append(Gemm("qkv", T, (a + 2 * g) * d / tp, C, nl * micro))
        out.append(Gemm("proj", T, C, a * d / tp, nl * micro))
        # causal scores and weighted sum: 2 GEMMs of 2·s·s·(a/tp)·d each, halved by the mask (per sequence)
        out.append(Gemm("attention", s, s * lay.cp / 2, a * d / tp, 2 * nl * micro * lay.micro_batch, "attention"))
    if n["dense"]:
        out.append(Gemm("fc1", T, 2 * D.F / tp, C, n["dense"] * micro))
        out.append(Gemm("fc2", T, C, D.F / tp, n["dense"] * micro))
    if n["moe"]:
        local = D.E / ep
        copies = D.K * T / seq_split * etp  # routed copies one rank computes per micro-batch (even load)
        per_expert = copies / local
        out.append(Gemm("router", T / seq_split, D.E, C, n["moe"] * micro, "router"))
        out.append(Gemm("expert_fc1", per_expert, 2 * D.Fe / etp, C, n["moe"] * micro * local))
        out.append(Gemm("expert_fc2", per_expert, C, D.Fe / etp, n["moe"] * micro * local))
        if D.Fs:
            out.append(Gemm("shared_fc1", T, 2 * D.Fs / tp, C, n["moe"] * micro))
            out.append(Gemm("shared_fc2", T, C, D.Fs / tp, n["moe"] * micro))
    if last:
        out.append(Gemm("output", T, (getattr(lay, "vocab", None) or D.V) / tp, C, micro))
    return out


def elementwise_bytes_per_token(D, lay, layer: int) -> float:
    """HBM bytes per token of one layer's memory-bound ops (forward + backward, bf16), on one TP rank: the two
    RMSNorms (forward reads x, writes y; backward reads x and dy, writes dx: 5C each), the two residual adds
    (6C each), RoPE on q and k (4(a+g)d), the SwiGLU (forward 3 widths, backward 5: 8F), and for a MoE layer
    the permute and unpermute of every routed copy (forward and backward each read and write it: 8C per copy)
    and the router's softmax / top-k (fp32, 6E).  SP-shard terms divide by TP under SP; head and FFN widths by
    TP (expert widths by expert-TP)."""
    tp = lay.tp
    seq_split = tp if lay.sp else 1
    C = D.C
    per = (10 * C + 12 * C) / seq_split + 4 * (D.a + D.g) * D.d / tp
    if not getattr(lay, "te", True):  # the unfused softmax: scores written, read, probabilities written, read
        per += 4 * D.a * lay.seq / tp
    if layer < D.dense:
        per += 8 * D.F / tp
    else:
        copies = D.K / seq_split * lay.expert_tp
        per += copies * (8 * C + 8 * D.Fe / lay.expert_tp) + 6 * D.E / seq_split
        if D.Fs:
            per += 8 * D.Fs / tp
    return 2 * per


def ep_domain(lay, per_node: int) -> Tuple[int, int]:
    """(ranks of a rank's expert all-to-all group, of which on its node).  Megatron builds the expert groups from
    the ``ep·etp`` consecutive ranks of a pipeline stage, expert-TP innermost: the ``ep`` ranks of one
    all-to-all are ``etp`` apart, so ``per_node / etp`` of them share a node, and the all-to-all stays on
    NVLink while ``ep·etp <= per_node`` (not ``ep·tp``: with ``etp = 1`` a TP = 2 run's EP = 8 group is one
    node)."""
    return lay.ep, max(1, min(lay.ep, per_node // max(1, lay.expert_tp)))


def a2a_seconds(nbytes: float, lay, gpu, eff, dispatcher: str, topk: int = 1) -> float:
    """One all-to-all in which each rank sends ``nbytes`` (``topk`` copies of each of its tokens) spread evenly
    over its EP group (its own share stays): the share to peers of its node over NVLink, the rest over the
    network, both at once (the slower sets the time).  NCCL's all-to-all (``alltoall`` dispatcher) at ``eff.a2a``
    of the links sends every copy; DeepEP (``flex``) at ``eff.deepep`` sends a token once per remote node that
    holds one of its experts and forwards it inside the node over NVLink [DeepEP], so its network bytes are
    ``(nodes - 1)·(1 - (1 - 1/nodes)^topk)`` tokens' worth instead of ``topk·(group - on_node)/group``."""
    group, on_node = ep_domain(lay, gpu.per_node)
    if group <= 1:
        return 0.0
    frac = eff.deepep if dispatcher == "flex" else eff.a2a
    on = nbytes * (on_node - 1) / group
    off = nbytes * (group - on_node) / group
    if dispatcher == "flex" and group > on_node:
        nodes = group / on_node
        off = nbytes / topk * (nodes - 1) * (1 - (1 - 1 / nodes) ** topk)
    return max(on / (gpu.nvlink_gbs * 1e9 * frac), off / (gpu.network_gbs * 1e9 * frac))


def _link(gpu, eff, within_node: bool) -> float:
    return (gpu.nvlink_gbs if within_node else gpu.network_gbs) * 1e9 * eff.link


def gpu_time(D, lay, gpu, eff, stages: List[Tuple[List[int], bool, bool, float, float]], hc_seconds: float,
             hc_compute_seconds: float, pp_width: int) -> Dict[str, float]:
    """Seconds per optimizer step on the GPU path, by component (docs/planning.md, "Time").

    ``stages``: per pipeline stage ``(layers, first, last, dense params, expert params)`` of one rank;
    ``hc_seconds`` / ``hc_compute_seconds``: the HC streams' memory time and the HC maps' FLOP time per step of
    one rank (the caller's accounting); ``pp_width``: elements per token of a pipeline send (``N·C`` with HC).

    Per stage, per step: GEMMs at their shape's efficiency (:func:`gemm_efficiency`; the attention scores at
    ``eff.attn`` on forward + 2.5x forward for the flash backward, which recomputes the scores; the fp32 router
    at the fp32 peak); memory-bound ops (:func:`elementwise_bytes_per_token`, the loss) at ``eff.elementwise``
    of HBM; TP collectives (exposed unless ``tp_comm_overlap``, then ``1 - eff.overlap_tp`` of them, at most
    the GEMM time hidden); the CP ring (overlapped by TE with the attention of the previous chunk); the EP
    all-to-all over the expert group (:func:`a2a_seconds`; ``1 - eff.overlap_ep`` exposed with
    ``ep_overlap``, Megatron's ``overlap_moe_expert_parallel_comm``); routed-expert GEMMs and all-to-all at the
    most loaded rank's share (``eff.moe_imbalance``); pipeline sends (``1 - eff.overlap_pp`` exposed under the
    interleaved schedule, which overlaps them).  The slowest stage sets the pace; the bubble adds
    ``(pp - 1) / (micro-batches · vpp)`` of it.  The DP reduce-scatter (main-grad dtype) and the parameter
    all-gather of the distributed optimizer (an all-reduce without it) hide, with ``overlap_grad_reduce`` /
    ``overlap_param_gather``, behind the backward of the last / forward of the first micro-batch only (where
    Megatron issues them).  The optimizer step reads and writes each local shard's state once."""
    peak = gpu.bf16_tflops * 1e12
    hbm = gpu.hbm_tbs * 1e12
    tp, cp = lay.tp, lay.cp
    seq_split = tp if lay.sp else 1
    s = lay.seq // cp
    T = s * lay.micro_batch
    m = lay.num_micro
    mods = set(D.modules) if lay.recompute == "selective" else set()
    dispatcher = getattr(lay, "dispatcher", None) or D.dispatcher
    per_stage = []
    for layers, first, last, _, _ in stages:
        c = {k: 0.0 for k in ("gemm", "attention", "router", "elementwise", "tp_comm", "cp_comm", "ep_comm",
                              "pp_comm", "tp_hidden", "ep_hidden", "moe_overhead")}
        expert_gemm = 0.0
        for gm in gemm_inventory(D, lay, layers, first, last, m):
            fwd = 2 * gm.M * gm.N * gm.K * gm.calls
            if gm.kind == "attention":
                runs = 1 + 2.5 + (1 if (lay.recompute == "full" or "core_attn" in mods) else 0)
                c["attention"] += fwd * runs / (peak * eff.attn)
                continue
            again = lay.recompute == "full" or (gm.name in ("fc1", "fc2") and "mlp" in mods) or (
                gm.name.startswith(("expert", "router")) and "moe" in mods) or (
                gm.name.startswith("shared") and "shared_experts" in mods)
            runs = 3 + (1 if (again and gm.name != "output") else 0)
            if gm.kind == "router":  # fp32 router GEMM (moe_router_dtype=fp32) on the fp32 units
                c["router"] += fwd * runs / (gpu.fp32_tflops * 1e12 * eff.gemm)
                continue
            t = fwd * runs / (peak * gemm_efficiency(gm.M, gm.N, gm.K, peak, hbm, eff.gemm))
            if gm.name.startswith("expert"):
                t *= eff.moe_imbalance
                expert_gemm += t
            c["gemm"] += t
        tokens_stage = T * m
        ew = sum(elementwise_bytes_per_token(D, lay, i) for i in layers) * tokens_stage
        if lay.recompute == "full":
            ew *= 4 / 3  # one more forward
        if last:  # the loss: bf16 logits read, fp32 softmax written and read, the gradient written (20 B)
            ew += 20 * (getattr(lay, "vocab", None) or D.V) / tp * tokens_stage
        c["elementwise"] = ew / (hbm * eff.elementwise)
        compute = c["gemm"] + c["attention"] + c["router"] + c["elementwise"]
        # TP: per TP sublayer all-gather + reduce-scatter of [s·b, C] bf16, forward and backward
        if tp > 1:
            subl = sum(1 + (1 if (i < D.dense or lay.expert_tp > 1 or D.Fs) else 0) for i in layers)
            vol = 4 * subl * m * T * D.C * 2 * (tp - 1) / tp
            t = vol / _link(gpu, eff, tp <= gpu.per_node)
            if lay.recompute == "full":
                t *= 1.5  # the recomputed forward gathers again
            hidden = min(t * eff.overlap_tp, c["gemm"]) if getattr(lay, "tp_comm_overlap", False) else 0.0
            c["tp_comm"], c["tp_hidden"] = t - hidden, hidden
        if cp > 1:  # ring attention: K and V of each chunk pass cp - 1 hops forward, K, V and their grads backward
            vol = 3 * len(layers) * m * T * 2 * D.g * D.d / tp * 2 * (cp - 1) / cp
            t = vol / _link(gpu, eff, cp * tp <= gpu.per_node)
            c["cp_comm"] = max(0.0, t - c["attention"])  # TE overlaps each hop with the previous chunk's attention
        moe = sum(1 for i in layers if i >= D.dense)
        if lay.ep > 1 and moe:  # dispatch + combine, forward and backward, K copies of each SP-shard token
            one = a2a_seconds(D.K * T / seq_split * D.C * 2, lay, gpu, eff, dispatcher, D.K)
            passes = 4 + (2 if (lay.recompute == "full" or "moe" in mods) else 0)
            t = one * passes * moe * m * eff.moe_imbalance
            hidden = min(t * eff.overlap_ep, compute) if getattr(lay, "ep_overlap", False) else 0.0
            c["ep_comm"], c["ep_hidden"] = t - hidden, hidden
        if lay.pp > 1:  # the [s·b/sp, C] activation forward and its gradient back, per chunk boundary
            vol = 2 * m * (lay.vpp or 1) * T / seq_split * pp_width * 2
            t = vol / _link(gpu, eff, lay.gpus <= gpu.per_node)
            c["pp_comm"] = t * (1 - (eff.overlap_pp if lay.vpp else 0.0))
        # a fixed cost per MoE layer and pass (forward, backward): the host waits for the routed token counts
        # (the grouped GEMM's split sizes, the dispatcher's layout) before it can launch the experts
        c["moe_overhead"] = moe * m * (2 + (1 if (lay.recompute == "full" or "moe" in mods) else 0)) \
            * eff.moe_layer_overhead_ms * 1e-3
        c["busy"] = (compute + c["moe_overhead"] + c["tp_comm"] + c["cp_comm"] + c["ep_comm"] + c["pp_comm"] + hc_seconds
                     + hc_compute_seconds)
        per_stage.append(c)
    worst = max(per_stage, key=lambda c: c["busy"])
    out = {k: v for k, v in worst.items()}
    out["bubble"] = worst["busy"] * (lay.pp - 1) / (m * (lay.vpp or 1)) if lay.pp > 1 else 0.0
    # DP: gradient reduce-scatter (main-grad dtype) + parameter all-gather (bf16) under the distributed
    # optimizer, an all-reduce of the main grads otherwise; dense parameters over DP·CP, experts over expert-DP
    dense_p = max(st[3] for st in stages)
    expert_p = max(st[4] for st in stages)
    gbytes = megatron_grad_bytes(lay)
    dpcp, edp = lay.dp * cp, lay.expert_dp
    rs = ag = 0.0
    for n, group, span in ((dense_p, dpcp, lay.gpus <= gpu.per_node or tp * cp * lay.dp <= gpu.per_node),
                           (expert_p, edp, lay.gpus <= gpu.per_node)):
        if group <= 1 or not n:
            continue
        bw = _link(gpu, eff, span)
        if lay.uses_distributed_optimizer:
            rs += n * gbytes * (group - 1) / group / bw
            ag += n * 2 * (group - 1) / group / bw
        else:
            rs += 2 * n * gbytes * (group - 1) / group / bw
    micro_busy = worst["busy"] / m
    hide_rs = eff.overlap_dp * micro_busy * 2 / 3 if lay.overlap_grad_reduce else 0.0
    hide_ag = eff.overlap_dp * micro_busy / 3 if getattr(lay, "overlap_param_gather", False) else 0.0
    out["dp_comm"] = max(0.0, rs - hide_rs) + max(0.0, ag - hide_ag)
    out["dp_hidden"] = rs + ag - out["dp_comm"]
    # the optimizer step: each local shard's fp32 master, m, v read and written, the grad read, the bf16 param
    # written (30 B per element; replicated state: every element)
    shard = dense_p / (dpcp if lay.uses_distributed_optimizer else 1) + expert_p / (
        edp if lay.uses_distributed_optimizer else 1)
    out["optimizer"] = shard * 30 / (hbm * eff.elementwise)
    return out
