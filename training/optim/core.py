"""Optimisers for pre-training (docs/math.md §1.7, §6.4, §8 #31): AdamW, Muon, parameter groups, clipping.

Two recipes, selected by :attr:`OptimizerConfig.name`:

- ``adamw``: AdamW (β = (0.9, 0.95), decoupled weight decay 0.1, clipping 1.0; ε = 1e-8 by
  default, the paper's 1e-15 is :data:`PAPER_ADAMW_EPS`) on every parameter.
- ``muon``: :class:`Muon` on the 2-D backbone matrices (attention QKV/output, dense and expert
  FC1/FC2, the MoE router projection); AdamW on embeddings, the output layer, norms, biases and
  **every** hyper-connection parameter (projections, router, gates, biases, conv kernels).

Weight decay (both recipes; docs/math.md §6.4, §8 #12): backbone tensors with ≥ 2 dims are decayed,
1-D tensors and ``*.bias`` are not (Megatron's rule).  Hyper-connection parameters are
classified by *name* (:func:`hc_param_kind`): projections (``W_pre``, ``W_res``, ``w_post``,
``router.weight``, ``pre.weight``, ...) and temporal conv kernels get the backbone weight decay;
biases (``b_*``, ``*.bias``), gates (``alpha*``, ``s_alpha``, ``s_beta``), static logits
(``S_res``, ``a_pre``, ``a_post``, ``hc_readout_logits``) and mapping-norm gains get none.

Backends (:func:`build_optimizer`):

- **torch** (CPU, or any device without Megatron DDP): ``torch.optim.AdamW`` plus this module's
  :class:`Muon`, wrapped in :class:`TrainOptimizer`, whose :meth:`~TrainOptimizer.step`
  computes the TP/EP/PP-aware global grad norm (:func:`grad_norm`), skips the update when it is
  not finite, clips, and steps.  Under tensor parallelism Muon orthogonalises the *full* matrix:
  each TP rank all-gathers the (sharded) momentum update along ``param.partition_dim`` in rank
  order, runs Newton–Schulz on the whole matrix and keeps its own slice (Newton–Schulz commutes
  with row/column permutations, so the rank-order layout of SwiGLU ``[gate; up]`` or GQA shards
  gives exactly the TP=1 result).
- **megatron** (GPU with Megatron-DDP-wrapped chunks; :mod:`training.optim.megatron`): Megatron's
  ``get_megatron_optimizer`` (distributed optimizer by default) for AdamW with this module's
  weight-decay rule passed as ``config_overrides``; without the distributed optimizer the fp32 HC
  parameters of a bf16 model get their own ``FP32Optimizer`` in the chain
  (``Float16OptimizerWithFloat16Params`` cannot checkpoint a mix of bf16 and fp32 params).  Muon:
  ``ShardedLayerWiseOptimizer`` (below), its state sharded over DP or, with
  ``use_distributed_optimizer`` false, replicated.  One global grad norm per step, computed once.
  Written against the 0.16.1 and 0.19.0 sources.  The wrappers allocate a few CUDA scalars (and
  check for CUDA tensor types); with those redirected to the CPU (test-only) the non-distributed
  paths, bf16 wrappers included, are checked against the torch backend and through
  ``dist_checkpointing`` round trips.  The distributed optimizer only runs on GPU.

State sharded over data parallelism (:attr:`OptimizerConfig.use_distributed_optimizer`; Muon's
default on the Megatron backend, opt-in on the torch backend): each parameter is owned by one rank
of its DP group (expert-DP group for routed experts; :func:`shard_owner_ranks`, Newton–Schulz cost
for Muon matrices and element count for AdamW, ``training.optim.shard_owners``).  Only the owner holds its
state and updates it (one Newton–Schulz per matrix across the group, with its TP peers for the full
matrix); :class:`ParamShards` then broadcasts the updated parameters.  Torch backend: the inner
optimisers hold the owned parameters only; checkpoints stay ``torch-sharded`` (each tensor written
by its owner), so they load into any layout, sharded or not.  Megatron backend:
``ShardedLayerWiseOptimizer`` (Megatron-Core's ``LayerWiseDistributedOptimizer`` with these owners,
per-dtype exchange and the fp32 HC parameters in their own ``FP32Optimizer``); its checkpoints are
``torch-sharded`` too, with the fp32 main copies, so they reshard like the torch backend's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from training.optim.param_shards import (ParamShards, build_param_shards, is_expert_dp_param,  # noqa: F401 (re-exported)
                                   muon_matrix_shape, shard_owner_ranks)
from xhc.config import HCConfig
from xhc.config_base import ConfigBase

__all__ = [
    "NS_COEFFICIENTS",
    "PAPER_ADAMW_EPS",
    "Muon",
    "OptimizerConfig",
    "OptimizerConfigError",
    "ParamInfo",
    "StepResult",
    "TrainOptimizer",
    "build_optimizer",
    "classify_param",
    "clip_grad_norm",
    "grad_norm",
    "hc_defaults_for_optimizer",
    "hc_param_kind",
    "megatron_config_overrides",
    "megatron_optimizer_config",
    "newton_schulz",
    "param_groups",
]

OPTIMIZERS = ("adamw", "muon")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Quintic Newton–Schulz coefficients (a, b, c) of Keller Jordan's Muon (docs/math.md §8 #31)."""
PAPER_ADAMW_EPS = 1e-15
"""AdamW ε of the [xHC] recipe (docs/math.md §6.4); set ``optimizer.eps`` to it for paper parity."""
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}

Models = Union[torch.nn.Module, Iterable[torch.nn.Module]]


class OptimizerConfigError(ValueError):
    """An optimiser setting is invalid (the message names the key, e.g. ``optimizer.name``)."""


def _err(key: str, value: Any, fix: str) -> OptimizerConfigError:
    return OptimizerConfigError(f"optimizer.{key}={value!r} is invalid: {fix}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class OptimizerConfig(ConfigBase):
    """Optimiser settings; defaults are docs/math.md §6.4 recipe."""

    name: str = "adamw"
    """``adamw`` | ``muon`` (Muon on 2-D backbone matrices, AdamW on the rest)."""
    lr: float = 3e-4
    """Peak learning rate (both optimisers; the schedule multiplies it)."""
    min_lr: Optional[float] = None
    """Optional floor; the schedule uses ``min_lr / lr`` as its final ratio (see training.schedule)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (``p ← p·(1 − lr·wd)``) for the decayed groups of both optimisers."""
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    """AdamW ε.  The paper's value is 1e-15 (:data:`PAPER_ADAMW_EPS`, docs/math.md §6.4); with it, AdamW turns
    gradients that are zero up to round-off into ±lr steps (e.g. the last sublayer's residual
    mixing under a sum readout, or every H_res while all streams are still equal at init)."""
    clip_grad: float = 1.0
    """Global grad-norm clipping threshold (0 disables clipping; the norm is still computed)."""
    skip_nonfinite: bool = True
    """Skip the update (parameters and optimiser state untouched) when the grad norm is inf/nan."""
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_coefficients: Tuple[float, float, float] = NS_COEFFICIENTS
    muon_rms: float = 0.2
    """Update RMS target: the orthogonalised update is multiplied by ``muon_rms·√max(d_out, d_in)``."""
    muon_eps: float = 1e-7
    """Floor of the Frobenius norm that starts Newton–Schulz."""
    muon_ns_dtype: str = "float32"
    """Newton–Schulz precision: float32 | bfloat16 (the usual GPU choice) | float64."""
    use_distributed_optimizer: Optional[bool] = None
    """Shard the optimizer state over data parallelism (None: on with the Megatron backend, off with the
    torch backend).  AdamW on the Megatron backend: Megatron's distributed optimizer.  Muon: every
    parameter is owned by one rank of its data-parallel group (the expert-data-parallel group for routed
    experts, :func:`training.optim.shard_owners.assign_owners`), which keeps its state (and fp32 main copy),
    runs its one Newton–Schulz and sends the updated parameter to the others (:class:`ParamShards`).
    The torch backend shards either optimizer this way when it is true."""

    def __post_init__(self):
        self.betas = tuple(self.betas)
        self.muon_ns_coefficients = tuple(self.muon_ns_coefficients)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`OptimizerConfigError` on the first invalid key."""
        if self.name not in OPTIMIZERS:
            raise _err("name", self.name, f"allowed values are {', '.join(OPTIMIZERS)}")
        if not _is_number(self.lr) or self.lr <= 0:
            raise _err("lr", self.lr, "must be a number > 0")
        if self.min_lr is not None and (not _is_number(self.min_lr) or not 0 <= self.min_lr <= self.lr):
            raise _err("min_lr", self.min_lr, f"must lie in [0, lr = {self.lr}] (or be null)")
        if not _is_number(self.weight_decay) or self.weight_decay < 0:
            raise _err("weight_decay", self.weight_decay, "must be a number >= 0")
        if len(self.betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in self.betas):
            raise _err("betas", list(self.betas), "must be two numbers in [0, 1), e.g. [0.9, 0.95]")
        if not _is_number(self.eps) or self.eps <= 0:
            raise _err("eps", self.eps, "must be a number > 0")
        if not _is_number(self.clip_grad) or self.clip_grad < 0:
            raise _err("clip_grad", self.clip_grad, "must be a number >= 0 (0 disables clipping)")
        for key in ("skip_nonfinite", "muon_nesterov"):
            if not isinstance(getattr(self, key), bool):
                raise _err(key, getattr(self, key), "must be true or false")
        if not _is_number(self.muon_momentum) or not 0 <= self.muon_momentum < 1:
            raise _err("muon_momentum", self.muon_momentum, "must lie in [0, 1)")
        if not isinstance(self.muon_ns_steps, int) or isinstance(self.muon_ns_steps, bool) or self.muon_ns_steps < 1:
            raise _err("muon_ns_steps", self.muon_ns_steps, "must be an integer >= 1")
        if len(self.muon_ns_coefficients) != 3 or not all(_is_number(c) for c in self.muon_ns_coefficients):
            raise _err("muon_ns_coefficients", list(self.muon_ns_coefficients), "must be three numbers (a, b, c)")
        if not _is_number(self.muon_rms) or self.muon_rms <= 0:
            raise _err("muon_rms", self.muon_rms, "must be a number > 0")
        if not _is_number(self.muon_eps) or self.muon_eps <= 0:
            raise _err("muon_eps", self.muon_eps, "must be a number > 0")
        if self.muon_ns_dtype not in NS_DTYPES:
            raise _err("muon_ns_dtype", self.muon_ns_dtype, f"allowed values are {', '.join(NS_DTYPES)}")
        if self.use_distributed_optimizer not in (None, True, False):
            raise _err("use_distributed_optimizer", self.use_distributed_optimizer, "must be true, false or null")

    # from_dict (an unknown key is an error naming it), to_dict, replace (validated): ConfigBase
    config_error: ClassVar[type] = OptimizerConfigError
    key_format: ClassVar[str] = "optimizer.{key}: {msg}"
    unknown_key_format: ClassVar[str] = "optimizer.{name} is not an optimizer setting; known: {known}"


def hc_defaults_for_optimizer(hc: HCConfig, optimizer_name: str, explicit_keys: Iterable[str] = ()) -> HCConfig:
    """docs/math.md §3.1 / §6.4: xHC's Gram–Schmidt is on under AdamW and off under Muon.

    Returns ``hc`` with ``gram_schmidt`` set to that default, unless ``"gram_schmidt"`` is among
    ``explicit_keys`` (the HC keys the user wrote: the preset's variant mapping and overrides).
    """
    if optimizer_name not in OPTIMIZERS:
        raise _err("name", optimizer_name, f"allowed values are {', '.join(OPTIMIZERS)}")
    if "gram_schmidt" in set(explicit_keys):
        return hc
    want = optimizer_name != "muon"
    return hc if hc.gram_schmidt == want else hc.replace(gram_schmidt=want)


# ----------------------------------------------------------------------------------------------
# Parameter classification and groups
# ----------------------------------------------------------------------------------------------
_HC_RULES: Tuple[Tuple[str, "re.Pattern[str]"], ...] = tuple(
    (kind, re.compile(pattern))
    for kind, pattern in (
        ("hc_projection", r"(^|\.)(W_pre|W_post|W_res|W_r|w_pre|w_post|hc_fn)$"),   # HC / mHC family, head
        ("hc_conv", r"(^|\.)conv\.\d+$"),                                     # xHC temporal kernels
        ("hc_bias", r"(^|\.)(b_pre|b_post|b_res|bias|hc_base)$"),
        ("hc_gate", r"(^|\.)(alpha|alpha_pre|alpha_post|alpha_res|s_alpha|s_beta|hc_scale)$"),
        ("hc_static", r"(^|\.)(a_pre|a_post|S_res|hc_readout_logits|logits)$"),  # static logits
        ("hc_norm", r"(^|\.)norm_weight$"),                                   # mapping-norm gain
        ("hc_projection", r"(^|\.)weight$"),   # xHC/Flash router, pre, res, post (after norm_weight)
    )
)
HC_DECAY_KINDS = frozenset({"hc_projection", "hc_conv"})
"""HC parameter kinds that get the backbone weight decay (docs/math.md §6.4); the others get none."""

_EMBEDDING_RE = re.compile(r"(^|\.)(word_embeddings|position_embeddings|tokentype_embeddings)\.weight$")
_OUTPUT_RE = re.compile(r"(^|\.)output_layer\.weight$")
_LEGACY_GROUPED_RE = re.compile(r"(^|\.)experts\.weight[12]$")


def hc_param_kind(name: str, param: Optional[torch.Tensor] = None) -> str:
    """Kind of a hyper-connection parameter from its name: ``hc_projection``, ``hc_conv``,
    ``hc_bias``, ``hc_gate``, ``hc_static``, ``hc_norm``, or ``hc_other`` (unknown name)."""
    for kind, pattern in _HC_RULES:
        if pattern.search(name):
            return kind
    return "hc_other"


def is_hc_param(name: str, param: torch.Tensor) -> bool:
    """Tagged by models.hc_layer (``is_hyper_connection``), or named like one (fallback)."""
    return bool(getattr(param, "is_hyper_connection", False)) or "hyper_connection" in name \
        or name.endswith("hc_readout_logits") or ".hc_head." in f".{name}"


def is_routed_expert(name: str) -> bool:
    """Routed-expert weight (expert-TP group); shared experts are ordinary dense weights."""
    return ".experts." in f".{name}"


@dataclass(frozen=True)
class ParamInfo:
    """How one parameter is optimised."""

    name: str
    kind: str
    """embedding | output | matrix | norm | bias | vector | tensor | hc_* (see :func:`hc_param_kind`)."""
    optimizer: str
    """adamw | muon."""
    decay: bool
    expert: bool
    """Routed-expert weight (Muon gathers it over the expert-TP group)."""
    group: str
    """Name of its param group: muon, muon_expert, decay, no_decay, hc_decay, hc_no_decay."""


def classify_param(name: str, param: torch.Tensor, optimizer_name: str = "adamw") -> ParamInfo:
    """Optimiser, weight decay and group of one parameter (see the module docstring)."""
    expert = is_routed_expert(name)
    if is_hc_param(name, param):
        kind = hc_param_kind(name, param)
        decay = kind in HC_DECAY_KINDS or (kind == "hc_other" and param.dim() >= 2)
        return ParamInfo(name, kind, "adamw", decay, expert, "hc_decay" if decay else "hc_no_decay")
    if (getattr(param, "is_embedding_or_output_parameter", False) or _EMBEDDING_RE.search(name)
            or _OUTPUT_RE.search(name)):
        kind = "output" if _OUTPUT_RE.search(name) else "embedding"
        return ParamInfo(name, kind, "adamw", True, False, "decay")
    if name.endswith(".bias") or name == "bias":
        return ParamInfo(name, "bias", "adamw", False, expert, "no_decay")
    if param.dim() < 2:
        return ParamInfo(name, "norm" if "norm" in name else "vector", "adamw", False, expert, "no_decay")
    if param.dim() > 2:
        return ParamInfo(name, "tensor", "adamw", True, expert, "decay")
    if optimizer_name == "muon":
        if _LEGACY_GROUPED_RE.search(name):
            raise OptimizerConfigError(
                f"optimizer.name='muon': {name} stores all local experts in one matrix (legacy GroupedMLP); "
                "use SequentialMLP or TEGroupedMLP (moe_grouped_gemm with Transformer Engine)")
        return ParamInfo(name, "matrix", "muon", True, expert, "muon_expert" if expert else "muon")
    return ParamInfo(name, "matrix", "adamw", True, expert, "decay")


GROUP_ORDER = ("muon", "muon_expert", "decay", "no_decay", "hc_decay", "hc_no_decay")


def _chunks(model: Models) -> List[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def named_trainable_parameters(model: Models) -> List[Tuple[str, torch.nn.Parameter]]:
    """``(name, param)`` of every trainable parameter; names of chunk ``i > 0`` get a ``chunk{i}.`` prefix."""
    chunks = _chunks(model)
    out, seen = [], set()
    for i, chunk in enumerate(chunks):
        prefix = f"chunk{i}." if len(chunks) > 1 and i > 0 else ""
        for name, p in chunk.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((prefix + name, p))
    return out


def param_groups(model: Models, cfg: OptimizerConfig) -> List[Dict[str, Any]]:
    """Param groups (torch format plus metadata), in :data:`GROUP_ORDER`, empty ones omitted.

    Each dict: ``name``, ``optimizer`` (adamw | muon), ``params``, ``param_names``, ``lr``,
    ``weight_decay`` (= ``cfg.weight_decay · wd_mult``), ``wd_mult`` (1 or 0), ``lr_mult`` (1;
    a trainer may change it, :class:`training.schedule.LRScheduler` honours it) and, for Muon,
    ``tp`` (``tp`` or ``expert_tp``: the group its TP shards are gathered over).
    """
    buckets: Dict[str, List[Tuple[str, torch.nn.Parameter]]] = {g: [] for g in GROUP_ORDER}
    for name, p in named_trainable_parameters(model):
        buckets[classify_param(name, p, cfg.name).group].append((name, p))
    groups = []
    for gname in GROUP_ORDER:
        members = buckets[gname]
        if not members:
            continue
        muon = gname.startswith("muon")
        decay = gname in ("muon", "muon_expert", "decay", "hc_decay")
        g = {
            "name": gname,
            "optimizer": "muon" if muon else "adamw",
            "params": [p for _, p in members],
            "param_names": [n for n, _ in members],
            "lr": cfg.lr,
            "lr_mult": 1.0,
            "wd_mult": 1.0 if decay else 0.0,
            "weight_decay": cfg.weight_decay if decay else 0.0,
        }
        if muon:
            g["tp"] = "expert_tp" if gname == "muon_expert" else "tp"
        groups.append(g)
    return groups


# ----------------------------------------------------------------------------------------------
# Gradient norm and clipping (Megatron's get_grad_norm_fp32 rule, on any device)
# ----------------------------------------------------------------------------------------------
def _params_of(params_or_model) -> List[torch.Tensor]:
    if isinstance(params_or_model, torch.nn.Module):
        return list(params_or_model.parameters())
    items = list(params_or_model)
    if items and isinstance(items[0], torch.nn.Module):
        return [p for m in items for p in m.parameters()]
    if items and isinstance(items[0], dict):  # param groups
        return [p for g in items for p in g["params"]]
    return items


def _grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    g = p.grad
    if g is None:
        g = getattr(p, "main_grad", None)  # Megatron DDP keeps grads in main_grad
    return g


def _megatron_groups():
    """(tp_rank, model-parallel group, expert model-parallel group), or None without Megatron."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:  # pragma: no cover - megatron is a dependency
        return None
    if not dist.is_available() or not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return None
    return (ps.get_tensor_model_parallel_rank(), ps.get_model_parallel_group(),
            ps.get_expert_tensor_model_pipeline_parallel_group())


@torch.no_grad()
def grad_norm(params_or_model, norm_type: float = 2.0) -> float:
    """Global L2 grad norm over all model-parallel ranks, as Megatron's optimiser computes it.

    Counted once each: TP-sharded params (``tensor_model_parallel``) on every TP rank, replicated
    params only on TP rank 0, ``shared`` params nowhere (their twin counts).  Dense squares are
    summed over the model-parallel group (TP×PP), expert squares (``allreduce == False``) over
    the expert model-parallel group (ETP×EP×PP).  Data-parallel replicas hold equal grads after
    :func:`models.parallel.finalize_grads` and are not summed.  Reads ``param.grad`` (or
    ``param.main_grad``).  Returns inf/nan if any grad holds one.  Without Megatron's parallel
    state this is the plain local norm.
    """
    if norm_type != 2.0:
        raise ValueError(f"grad_norm: only the L2 norm is supported, got norm_type={norm_type}")
    groups = _megatron_groups()
    tp_rank = groups[0] if groups else 0
    device = None
    dense, expert, mtp_dense, mtp_expert = [], [], [], []
    for p in _params_of(params_or_model):
        g = _grad(p)
        if g is None or getattr(p, "shared", False):
            continue
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        device = g.device
        sq = torch.linalg.vector_norm(g.detach(), dtype=torch.float32).double() ** 2
        if getattr(p, "is_mtp", False):  # summed apart: an MTP run with λ = 0 clips as the run without MTP
            (mtp_dense if getattr(p, "allreduce", True) else mtp_expert).append(sq)
        else:
            (dense if getattr(p, "allreduce", True) else expert).append(sq)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.float64, device=device)
    dense_sum = torch.stack(dense).sum() if dense else zero.clone()
    expert_sum = torch.stack(expert).sum() if expert else zero.clone()
    if mtp_dense:
        dense_sum = dense_sum + torch.stack(mtp_dense).sum()
    if mtp_expert:
        expert_sum = expert_sum + torch.stack(mtp_expert).sum()
    if groups is not None:
        _, mp_group, expert_group = groups
        if dist.get_world_size(mp_group) > 1:
            dist.all_reduce(dense_sum, group=mp_group)
        if dist.get_world_size(expert_group) > 1:
            dist.all_reduce(expert_sum, group=expert_group)
    return float((dense_sum + expert_sum).sqrt())


@torch.no_grad()
def clip_grads_(params_or_model, max_norm: float, total_norm: float) -> None:
    """Scale every grad by ``max_norm / (total_norm + 1e-6)`` when that is < 1 (Megatron's rule)."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in _params_of(params_or_model):
            g = _grad(p)
            if g is not None:
                g.mul_(coeff)


@torch.no_grad()
def clip_grad_norm(params_or_model, max_norm: float) -> float:
    """Compute :func:`grad_norm` and clip to ``max_norm`` (if > 0); return the pre-clip norm.

    When the norm is inf/nan the grads are left untouched (the caller should skip the update).
    """
    total = grad_norm(params_or_model)
    if max_norm > 0 and math.isfinite(total):
        clip_grads_(params_or_model, max_norm, total)
    return total


# ----------------------------------------------------------------------------------------------
# Muon
# ----------------------------------------------------------------------------------------------
def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients: Sequence[float] = NS_COEFFICIENTS,
                  eps: float = 1e-7, dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    """Quintic Newton–Schulz orthogonalisation of a matrix ``G [m, n]`` (docs/math.md §6.4, §8 #31).

    On the wide orientation (transpose when ``m > n``): ``X₀ = G / max(‖G‖_F, eps)``, then
    ``steps`` times ``A = X Xᵀ``, ``X ← a·X + (b·A + c·A²)·X``.  With the default coefficients
    the singular values land in roughly [0.7, 1.2] instead of exactly 1.  Computed in ``dtype``
    (``None`` = G's dtype); returns that dtype.
    """
    if G.dim() != 2:
        raise ValueError(f"newton_schulz: expected a 2-D matrix, got shape {tuple(G.shape)}")
    a, b, c = coefficients
    X = G.to(dtype) if dtype is not None else G
    transpose = G.size(0) > G.size(1)
    if transpose:
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.T if transpose else X


class Muon(torch.optim.Optimizer):
    """Muon (momentum + Newton–Schulz orthogonalisation) for 2-D parameters, TP-aware.

    Per parameter with gradient ``g`` (all group keys below):

    1. momentum ``B ← μ·B + (1 − μ)·g``; update ``U = (1 − μ)·g + μ·B`` (Nesterov) or ``B``;
    2. under TP, ``U`` is all-gathered along ``param.partition_dim`` over the group named by
       the param group's ``tp`` key (``tp``: Megatron's TP group, ``expert_tp``: the expert-TP
       group, ``none``), so ``O = NS(U_full)`` is computed on the full matrix on every rank and
       each rank keeps its slice;
    3. ``p ← p·(1 − lr·wd)`` (decoupled), then ``p ← p − lr·rms_scale·√max(d_out, d_in)·O``
       with the *full* shape.

    The momentum (state ``momentum_buffer``) stays sharded.  ``process_groups`` maps the ``tp``
    names to process groups; by default they come from Megatron's ``parallel_state`` when it is
    initialised (size-1 groups mean no gather).  Same update as ``torch.optim.Muon`` with
    ``adjust_lr_fn="match_rms_adamw"`` when ``ns_dtype="bfloat16"`` and TP = 1.
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_coefficients: Sequence[float] = NS_COEFFICIENTS, rms_scale: float = 0.2,
                 weight_decay: float = 0.0, eps: float = 1e-7, ns_dtype: str = "float32", tp: str = "tp",
                 process_groups: Optional[Mapping[str, Any]] = None):
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon: ns_dtype={ns_dtype!r}; allowed: {', '.join(NS_DTYPES)}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=tuple(ns_coefficients), rms_scale=rms_scale, weight_decay=weight_decay,
                        eps=eps, ns_dtype=ns_dtype, tp=tp)
        super().__init__(params, defaults)
        self.process_groups = dict(process_groups or {})
        self.ns_calls = 0
        """Newton–Schulz runs of this optimiser so far (one per matrix per step on its owning rank)."""
        for group in self.param_groups:
            if group["tp"] not in ("tp", "expert_tp", "none"):
                raise ValueError(f"Muon: param group tp={group['tp']!r}; allowed: tp, expert_tp, none")
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon: only 2-D parameters, got shape {tuple(p.shape)}")

    def _tp_group(self, name: str):
        if name == "none":
            return None
        if name in self.process_groups:
            group = self.process_groups[name]
        else:
            from megatron.core import parallel_state as ps

            if not dist.is_initialized() or not ps.model_parallel_is_initialized():
                return None
            group = ps.get_tensor_model_parallel_group() if name == "tp" else ps.get_expert_tensor_parallel_group()
        if group is None or dist.get_world_size(group) == 1:
            return None
        return group

    newton_schulz = staticmethod(newton_schulz)  # (a class attribute: bench.sharded_muon wraps it to time NS)

    @classmethod
    def _orthogonalize(cls, U: torch.Tensor, p: torch.Tensor, group: Dict[str, Any],
                       tp_group) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """NS of the full matrix of which ``U`` is this rank's shard; returns (local slice, full shape)."""
        dtype = NS_DTYPES[group["ns_dtype"]]
        kw = dict(steps=group["ns_steps"], coefficients=group["ns_coefficients"], eps=group["eps"], dtype=dtype)
        if tp_group is None or not getattr(p, "tensor_model_parallel", False):
            return cls.newton_schulz(U, **kw), tuple(U.shape)
        dim = int(p.partition_dim)
        world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        parts = [torch.empty_like(U) for _ in range(world)]
        dist.all_gather(parts, U.contiguous(), group=tp_group)
        full = torch.cat(parts, dim=dim)
        O = cls.newton_schulz(full, **kw)
        return O.narrow(dim, rank * U.size(dim), U.size(dim)), tuple(full.shape)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            tp_group = self._tp_group(group["tp"])
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - mu)
                U = g.lerp(buf, mu) if group["nesterov"] else buf
                O, (d_out, d_in) = self._orthogonalize(U, p, group, tp_group)
                self.ns_calls += 1
                p.mul_(1 - lr * wd)
                p.add_(O.to(p.dtype), alpha=-lr * group["rms_scale"] * math.sqrt(max(d_out, d_in)))
        return loss


def _muon_init_state(opt, config=None) -> None:
    """Megatron ``init_state_fn`` (checkpoint save before the first step needs the state)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


# ----------------------------------------------------------------------------------------------
# Optimizer state sharded over data parallelism (each parameter owned by one rank)
# ----------------------------------------------------------------------------------------------
def optimizer_shards(named: Sequence[Tuple[str, torch.Tensor]], cfg: OptimizerConfig,
                     process_groups: Optional[Mapping[str, Any]] = None,
                     kinds: Optional[Sequence[str]] = None) -> ParamShards:
    """The :class:`training.optim.param_shards.ParamShards` of the trainable parameters ``named`` (``(name,
    param)``, every rank the same order); ``kinds``: each one's optimizer, default :func:`classify_param`'s."""
    if kinds is None:
        kinds = [classify_param(n, p, cfg.name).optimizer for n, p in named]
    return build_param_shards([p for _, p in named], kinds, cfg.muon_ns_steps, process_groups)


def shards_state(cfg: OptimizerConfig, backend: str) -> bool:
    """Whether ``cfg`` shards the optimizer state over data parallelism on ``backend`` (torch | megatron)."""
    if cfg.use_distributed_optimizer is None:
        return backend == "megatron"
    return bool(cfg.use_distributed_optimizer)


# ----------------------------------------------------------------------------------------------
# The optimiser the trainer holds
# ----------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    updated: bool
    """False when the update was skipped (non-finite grad norm)."""
    grad_norm: float
    """Global grad norm before clipping."""


class TrainOptimizer:
    """One optimiser object for the trainer, whichever backend (:func:`build_optimizer`).

    ``step()`` → :class:`StepResult`: grad norm (TP/EP/PP-aware), skip if not finite (when
    ``cfg.skip_nonfinite``), clip to ``cfg.clip_grad``, update.  ``param_groups`` is the list of
    the inner optimisers' group dicts (an :class:`training.schedule.LRScheduler` sets their
    ``lr``/``weight_decay``).  ``state_dict`` / ``load_state_dict`` cover every inner
    optimiser (AdamW moments, Muon momentum) for exact resume; Megatron checkpoints should use
    :meth:`sharded_state_dict`.
    """

    def __init__(self, cfg: OptimizerConfig, optimizers: Dict[str, Any], params: List[torch.Tensor],
                 backend: str, megatron_optimizer=None, chunks: Sequence[torch.nn.Module] = (),
                 shards: Optional[ParamShards] = None):
        self.cfg = cfg
        self.shards = shards
        """Torch backend with a sharded state: who owns which parameter (the optimisers hold only this
        rank's); None: every rank updates every parameter."""
        self.optimizers = optimizers
        self.params = params
        self.backend = backend
        self.megatron_optimizer = megatron_optimizer
        self.chunks = list(chunks)
        self._loading_keys: Dict[str, List[str]] = {}  # torch backend: state keys of the last load template

    @property
    def param_groups(self) -> List[dict]:
        if self.megatron_optimizer is not None:
            return self.megatron_optimizer.param_groups
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads, including the grad buffers of Megatron-DDP-wrapped chunks."""
        for chunk in self.chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        if self.megatron_optimizer is not None:
            self.megatron_optimizer.zero_grad(set_to_none)
            return
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def grad_norm(self) -> float:
        if self.megatron_optimizer is not None:
            if self.megatron_optimizer.prepare_grads():
                return float("nan")
            return float(self.megatron_optimizer.get_grad_norm())
        return grad_norm(self.params)

    @torch.no_grad()
    def step(self) -> StepResult:
        if self.megatron_optimizer is not None:
            return self._megatron_step()
        for p in self.params:  # Megatron-DDP-wrapped chunks on the torch backend
            if p.grad is None and getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad
        norm = grad_norm(self.params)
        if not math.isfinite(norm) and self.cfg.skip_nonfinite:
            return StepResult(False, norm)
        if self.cfg.clip_grad > 0:
            clip_grads_(self.params, self.cfg.clip_grad, norm)
        for opt in self.optimizers.values():
            opt.step()
        if self.shards is not None:
            self.shards.sync()
        return StepResult(True, norm)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state tensors this rank holds (torch backend; step counts included)."""
        return sum(v.numel() * v.element_size() for opt in self.optimizers.values()
                   for st in opt.state.values() for v in st.values() if torch.is_tensor(v))

    def ns_calls(self) -> int:
        """Newton–Schulz runs on this rank so far (torch backend)."""
        return sum(getattr(opt, "ns_calls", 0) for opt in self.optimizers.values())

    def _megatron_step(self) -> StepResult:
        # Megatron's ChainedOptimizer.step() (prepare grads, global norm, clip, step), unrolled so
        # that a non-finite norm can skip the update (0.16.1-0.19.0 skip only on a loss-scaler
        # overflow) without computing the norm twice (one all-reduce and one host sync per step).
        opt = self.megatron_optimizer
        subs = getattr(opt, "chained_optimizers", [opt])
        if any(getattr(o, "grad_scaler", None) is not None for o in subs):
            # fp16 loss scaling: Megatron detects inf/nan and updates the scaler itself.
            updated, norm, _ = opt.step()
            return StepResult(bool(updated), float("nan") if norm is None else float(norm))
        if opt.prepare_grads():
            return StepResult(False, float("nan"))
        norm = float(opt.get_grad_norm())
        if not math.isfinite(norm) and self.cfg.skip_nonfinite:
            return StepResult(False, norm)
        if self.cfg.clip_grad > 0:
            from megatron.core.optimizer import optimizer as mopt

            for o in subs:
                params = [] if getattr(o, "is_stub_optimizer", False) else o.get_parameters()
                if params:
                    mopt.clip_grad_by_total_norm_fp32(
                        params, max_norm=self.cfg.clip_grad, total_norm=norm,
                        use_decoupled_grad=getattr(o.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))
        return StepResult(bool(opt.step_with_ready_grads()), norm)  # (sharded Muon: + the exchange)

    def reload_model_params(self) -> None:
        """Copy the model's parameters into the optimiser's fp32 main copies (Megatron backend).

        Call after loading model weights without the optimiser state (``checkpoint.load_optimizer
        = false``): the bf16 wrappers and the distributed optimizer keep main copies made at
        construction, and the first step would otherwise write *those* plus one update over the
        loaded weights.  The torch backend updates the parameters in place: nothing to do.
        """
        if self.megatron_optimizer is not None:
            self.megatron_optimizer.reload_model_params()

    def state_dict(self) -> Dict[str, Any]:
        if self.megatron_optimizer is not None:
            return self.megatron_optimizer.state_dict()
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.megatron_optimizer is not None:
            with torch.no_grad():  # the distributed optimizer writes into views of fp32 (HC) parameters
                self.megatron_optimizer.load_state_dict(state)
                for part in self._megatron_parts():
                    _restore_torch_adam_steps(part)
            return
        if set(state) != set(self.optimizers):
            raise ValueError(f"optimizer state holds {sorted(state)}, this optimizer has {sorted(self.optimizers)}: "
                             "was it saved with a different optimizer.name?")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])

    def _megatron_parts(self) -> list:
        return list(getattr(self.megatron_optimizer, "chained_optimizers", [self.megatron_optimizer]))

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """The optimiser's ``dist_checkpointing`` state dict: Megatron's (distributed) optimizer's own,
        or on the torch backend :meth:`torch_sharded_state_dict` (reshardable across layouts)."""
        if self.checkpoint_format == "torch-sharded":
            return self.torch_sharded_state_dict(model_sharded_state_dict, is_loading)
        if is_loading:
            for part in self._megatron_parts():
                # A distributed optimizer that has not stepped has no state to load into; without
                # Transformer Engine or Apex (torch's Adam) its state_dict then fails on the missing
                # step count.  Megatron's own remedy: one zero-gradient step on the fp32 main shards
                # (the model's parameters are untouched; the load replaces what it wrote).
                if hasattr(part, "_init_optimizer_states_with_dummy_values") and not part.optimizer.state:
                    part._init_optimizer_states_with_dummy_values()
        return self.megatron_optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)


    # -- optimizer state that follows its parameters' sharding (torch backend, GPU Muon) ---------
    @property
    def checkpoint_format(self) -> str:
        """How :func:`training.checkpoint.build_state` saves this optimizer: ``torch-sharded``
        (:meth:`torch_sharded_state_dict`: the torch backend, and Muon on the GPU path, sharded or
        not) or ``megatron`` (Megatron's own format: AdamW on the GPU path)."""
        if self.megatron_optimizer is None or getattr(self.megatron_optimizer, "per_param_checkpoint", False):
            return "torch-sharded"
        return "megatron"

    def _state_entries(self) -> Dict[str, List[Tuple[torch.Tensor, torch.Tensor, Any, Optional[str]]]]:
        """Per optimizer kind (adamw, muon): ``(model parameter, main parameter, torch optimizer, name)``
        of every parameter this rank updates, in a fixed order.  The main parameter is the one the
        torch optimizer updates: the model parameter itself, or its fp32 main copy (bf16 weights on
        the GPU path's Muon, :func:`_main_params`)."""
        entries: Dict[str, list] = {}
        if self.megatron_optimizer is None:
            for name, opt in self.optimizers.items():
                for g in opt.param_groups:
                    for p, n in zip(g["params"], g.get("param_names", [None] * len(g["params"]))):
                        entries.setdefault(name, []).append((p, p, opt, n))
            return entries
        for wrapper, kind in zip(self._megatron_parts(), self.megatron_optimizer.kinds):
            for model, main in _main_params(wrapper):
                entries.setdefault(kind, []).append((model, main, wrapper.optimizer, None))
        return entries

    @property
    def has_main_params(self) -> bool:
        """Whether :meth:`torch_sharded_state_dict` saves fp32 main copies (bf16 weights, GPU Muon)."""
        return any(m is not p for es in self._state_entries().values() for p, m, _, _ in es)

    def torch_sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False,
                                 main_params: bool = True) -> Dict[str, Any]:
        """Every state tensor of a parameter's shape (AdamW's ``exp_avg`` and ``exp_avg_sq``, Muon's
        ``momentum_buffer``, and on the GPU path the fp32 main copy of a bf16 weight, ``fp32_param``)
        as a ``ShardedTensor`` with the parameter's own sharding (key
        ``optimizer.<optimizer>.<state>.<parameter key>``, the parameter's global shape, offsets and
        replica id), so the state loads on any TP/SP/EP/PP/DP layout that the model weights load on,
        sharded over data parallelism or not; the step counts go into the common state, one per
        parameter key (gathered from every rank).  A parameter that never got a gradient has no
        torch state: it is saved as zeros with step 0, which is how torch initialises it at its
        first update.  The torch backend and the GPU path's Muon write the same keys.

        ``is_loading``: the template for ``dist_checkpointing.load`` (same structure); pass what the
        load returned to :meth:`load_torch_sharded_state_dict`.  ``main_params``: whether the
        checkpoint holds the fp32 main copies (loading one that does not: the copies are taken
        from the loaded weights).
        """
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                make_sharded_optimizer_tensor)

        state: Dict[str, Any] = {}
        steps: Dict[str, float] = {}
        for name, entries in self._state_entries().items():
            id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, [p for p, _, _, _ in entries])
            per_param = {}
            for i, (p, main, opt, pname) in enumerate(entries):
                sh = id_map.get(i)
                if sh is None:
                    raise ValueError(f"optimizer {name}: parameter {pname or i} {tuple(p.shape)} is not in the "
                                     "model's sharded state dict, so its state cannot be checkpointed")
                st = opt.state.get(main) or {}
                if is_loading or not st:
                    st = _zero_state(name, main)
                st = {k: v for k, v in st.items()}
                if main is not p and main_params:
                    st["fp32_param"] = torch.zeros_like(main) if is_loading else main.detach()
                per_param[i] = {k: make_sharded_optimizer_tensor(sh, v, prefix=f"optimizer.{name}.{k}")
                                for k, v in st.items() if k != "step"}
                if self.shards is not None:  # the owner writes it: its replica along data parallelism is the main one
                    for t in per_param[i].values():
                        t.replica_id = _dp_main_replica(t.replica_id)
                steps[f"{name}.{sh.key}"] = float(st["step"]) if "step" in st else 0.0
            state[name] = per_param
            if is_loading:
                self._loading_keys[name] = [f"{name}.{id_map[i].key}" for i in range(len(entries))]
        if not is_loading and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: List[Optional[Dict[str, float]]] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, steps)
            merged: Dict[str, float] = {}
            for part in parts:
                for k, v in (part or {}).items():
                    if merged.setdefault(k, v) != v:
                        raise ValueError(f"optimizer state of {k}: step {v} on one rank, {merged[k]} on another")
            steps = merged
        return {"tensors": state, "steps": dict(sorted(steps.items()))}

    def load_torch_sharded_state_dict(self, loaded: Dict[str, Any]) -> None:
        """Put what ``dist_checkpointing.load`` returned for the template of
        :meth:`torch_sharded_state_dict` (``is_loading=True``) into the torch optimisers (their param
        groups stay this run's: the scheduler sets lr and weight decay)."""
        tensors, steps = loaded["tensors"], loaded["steps"]
        entries = self._state_entries()
        if set(tensors) != set(entries) or set(self._loading_keys) != set(entries):
            raise ValueError(f"optimizer state holds {sorted(tensors)}, this optimizer has {sorted(entries)}: "
                             "was it saved with a different optimizer.name?")
        for name, items in entries.items():
            for i, (p, main, opt, _) in enumerate(items):
                key = self._loading_keys[name][i]
                if key not in steps:
                    raise ValueError(f"optimizer state has no step count for {key}: saved by another model?")
                st = {k: v.to(device=main.device) for k, v in tensors[name][i].items()}
                fp32 = st.pop("fp32_param", None)
                if main is not p:  # fp32 main copy: saved, else the loaded weight
                    with torch.no_grad():
                        main.copy_(fp32 if fp32 is not None else p.detach())
                if name != "muon":
                    st["step"] = torch.tensor(steps[key], dtype=_scalar_dtype())
                opt.state[main] = st


def _dp_main_replica(replica_id):
    """``replica_id`` of a parameter's ShardedTensor with its data-parallel component (the last) set to 0.

    With a sharded state only the owner holds a parameter's optimizer state, so its copy is the one
    ``dist_checkpointing`` writes; the other ranks of the DP group do not list it at all."""
    if isinstance(replica_id, int):
        return 0
    return (*tuple(replica_id)[:-1], 0)


def _scalar_dtype() -> torch.dtype:
    """The dtype of torch's per-parameter step counts (``torch.optim.optimizer._get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _zero_state(name: str, p: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The state torch gives ``p`` at its first update (zeros, step 0)."""
    if name == "muon":
        return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return {"step": torch.tensor(0.0, dtype=_scalar_dtype()),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _muon_kwargs(cfg: OptimizerConfig) -> Dict[str, Any]:
    return dict(lr=cfg.lr, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                ns_coefficients=cfg.muon_ns_coefficients, rms_scale=cfg.muon_rms, weight_decay=cfg.weight_decay,
                eps=cfg.muon_eps, ns_dtype=cfg.muon_ns_dtype)


def _main_params(wrapper) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``(model parameter, main parameter)`` of a Megatron optimizer wrapper, in its torch optimizer's
    order: a bf16 parameter's fp32 main copy (``Float16OptimizerWithFloat16Params``), else itself."""
    model_of = {}
    for models, mains in zip(getattr(wrapper, "float16_groups", []), getattr(wrapper, "fp32_from_float16_groups", [])):
        model_of.update({id(main): model for model, main in zip(models, mains)})
    return [(model_of.get(id(p), p), p) for g in wrapper.optimizer.param_groups for p in g["params"]]


def _restore_torch_adam_steps(opt) -> None:
    """After a distributed optimizer's load: with torch's Adam (no Transformer Engine or Apex) the
    loaded step count sits in each param group (``group["step"]``), and megatron-core 0.16 / 0.19
    leave the per-parameter ``step`` tensors at the placeholder state's value (or share one tensor
    among all parameters), so Adam's bias correction would be wrong.  Give every parameter's state
    its own tensor holding the group's step."""
    if not hasattr(opt, "model_param_group_index_map"):
        return
    for group in opt.optimizer.param_groups:
        if "step" not in group:
            continue
        for p in group["params"]:
            state = opt.optimizer.state.get(p)
            if state and torch.is_tensor(state.get("step")):  # (its own tensor: Megatron gives all
                # parameters one shared step tensor, which Adam would then advance once per parameter)
                state["step"] = torch.full_like(state["step"], float(group["step"]))
