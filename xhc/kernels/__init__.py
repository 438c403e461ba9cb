"""Fused hyper-connection ops and the one place that picks their backend (docs/kernels.md).

Backends (``HCConfig.kernels``):

=========  ============================================================================
``eager``  the readable reference functions of :mod:`xhc` (autograd through every op)
``compile``  the fused torch implementations of :mod:`xhc.kernels.torch_ops`: custom autograd
           functions with hand-written backwards, traceable by ``torch.compile(fullgraph=True)``
           (zero graph breaks); eager-callable too
``triton`` the Triton kernels of modules of :mod:`xhc.kernels` (CUDA tensors; the interpreter,
           ``TRITON_INTERPRET=1``, runs them on CPU tensors for tests)
``auto``   on CUDA the measured faster backend per variant (:data:`AUTO_CUDA`, today ``compile``
           for every variant); ``compile`` everywhere else (CPU tensors, and under
           ``torch.compile``).  A fixed rule: no measurement, no state, the same answer in every
           process (docs/kernels.md, "auto")
``liger``  ``variant: mhc`` only: Liger-Kernel's fused coefficient op (:mod:`.liger`) where its
           maths equals ours; the ops here then resolve as for ``triton`` (``compile`` under
           ``torch.compile``, where Liger's op is not used either)
=========  ============================================================================

This package is the only place that dispatches an HC op: the maths modules (:mod:`xhc.hyper_connection`,
:mod:`xhc.xhc`, :mod:`xhc.flash`) call the ops below with a *resolved* backend (from
:func:`resolve_backend`) and never branch on its name.  Every op has the signature of its
reference, and ``eager`` runs that reference: :mod:`xhc.streams` (read, write, gather, scatter),
:mod:`xhc.doubly_stochastic` (Sinkhorn), :mod:`xhc.norms` (norms and their statistics); tests
compare every backend against them.  Those modules import only torch, so this package imports
them without a cycle.

==================  ==========================================================================
:func:`sinkhorn`    H = Sinkhorn–Knopp(Z) (docs/math.md §1.4), one op, hand-written backward
:func:`sinkhorn_deepseek`  DeepSeek-V4's comb (softmax + ε, column first, + ε denominators; §2.h)
:func:`read`        u_t = Σ_j h[t, j] · X_j  (T reads of one state in one pass; §1.3, §3.4, §4.1)
:func:`write`       X'[I_j] = Σ_q H[j, q]·X_a[q] + Σ_s P[j, s]·V_s;  X'[i] = X[i] for i ∉ I  (§1.3, §3.4)
:func:`gram`        M[a, b] = Σ_c V_a·V_b, the Gram matrix of the write components (§3.3)
:func:`norm_linear` RMSNorm(x)·Wᵀ or LayerNorm(x)·Wᵀ with the norm applied after the GEMM (§1.5)
:func:`gather`      X_a = X[I], the active rows (§3.4), with a row-wise backward (no scatter_add)
==================  ==========================================================================

:func:`stream_moments` gives the per-row Σ X and Σ X² of the state in one pass (the flat norms'
statistics, §1.5); on ``triton`` :func:`norm_linear` computes them in the GEMM's pass, and
:func:`linear_moment` gives a GEMM with the mean square of its input.  :func:`fused` says whether a
backend takes the fused coefficient path (norm after the GEMM, Gram–Schmidt folded into the
write); :func:`liger_runs` / :func:`mhc_coefficients` are Liger-Kernel's mHC op; :func:`compile_module`
is the one place HC code is put under ``torch.compile``.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Union

import torch

from xhc import streams
from xhc.config import KERNEL_BACKENDS as KERNEL_CHOICES  # the one definition of the backend names
from xhc.config import OP_BACKENDS as BACKENDS
from xhc.kernels.runtime import interpreting, triton_available  # noqa: F401  (re-exported)

# Inductor settings for graphs of HC code (``torch.compile(..., options=INDUCTOR_OPTIONS)``;
# :func:`compile_options` merges them with a ``mode``).  The xHC write is one loop over the state
# in which every row reads its slot's k mixing and K branch coefficients, k active rows and K
# components: more distinct reads than inductor's CPU default (12) lets one pointwise node
# accumulate before it stores it, which would write all N new rows to memory and read them back
# (+32C per sublayer at N = 16; docs/kernels-bench.md).  GPU kernels are Triton (the ``triton``
# backend), so this only shapes the compiled CPU path and ``torch.compile`` on GPU.
INDUCTOR_OPTIONS = {"realize_acc_reads_threshold": 64}


def compile_options(mode: Optional[str] = None) -> dict:
    """``options`` for ``torch.compile`` of HC code: a ``mode``'s inductor settings (``torch.compile``
    takes either a mode or options) with :data:`INDUCTOR_OPTIONS` on top."""
    opts = {}
    if mode is not None:
        opts.update(torch._inductor.list_mode_options(mode))
    opts.update(INDUCTOR_OPTIONS)
    extra = os.environ.get("XHC_INDUCTOR_OPTIONS", "")
    if extra:  # tuning: a JSON object of inductor settings on top
        try:
            more = json.loads(extra)
        except ValueError as e:
            raise ValueError(f"XHC_INDUCTOR_OPTIONS={extra!r} is not a JSON object: {e}; "
                             'write e.g. XHC_INDUCTOR_OPTIONS=\'{"realize_reads_threshold": 8}\'') from None
        if not isinstance(more, dict):
            raise ValueError(f"XHC_INDUCTOR_OPTIONS={extra!r} is not a JSON object; "
                             'write e.g. XHC_INDUCTOR_OPTIONS=\'{"realize_reads_threshold": 8}\'')
        opts.update(more)
    return opts

_RETIRED_ENV_CHECKED = False


def _warn_retired_env() -> None:
    """``XHC_HC_KERNELS_AUTO`` steered a timing probe that no longer exists: say so once."""
    global _RETIRED_ENV_CHECKED
    _RETIRED_ENV_CHECKED = True
    if os.environ.get("XHC_HC_KERNELS_AUTO"):
        import warnings

        warnings.warn("XHC_HC_KERNELS_AUTO is no longer read: kernels 'auto' follows a fixed rule (compile on CPU, "
                      "the AUTO_CUDA table on CUDA); pin a backend with HCConfig.kernels / model.hc_kernels=eager|compile instead",
                      UserWarning, stacklevel=3)


# ``auto`` on CUDA: the backend per variant, from GPU measurements (docs/kernels.md, "auto on CUDA";
# tests/test_hc_kernels.py checks that this table and the one in the docs agree).  An entry is a
# backend name, or (backend, minimum compute capability) for a path measured faster only from that
# capability on (below it, ``compile``).  Change an entry only with a GPU run that shows the other
# backend ahead for that variant (``bash bench/gpu_check.sh --perf``).
AUTO_CUDA = {
    "none": "compile",
    "hc": "compile",
    "mhc": "compile",
    "mhc_lite": "compile",
    "kromhc": "compile",
    "identity": "compile",
    "xhc": "compile",
    "xhc_flash": "compile",
    "xhc_flash4": "compile",
}
AUTO_CUDA_DEFAULT = "compile"  # a bare string without a variant


def _auto_cuda(variant: Optional[str], capability) -> str:
    entry = AUTO_CUDA.get(variant, AUTO_CUDA_DEFAULT) if variant is not None else AUTO_CUDA_DEFAULT
    if isinstance(entry, tuple):
        backend, min_cap = entry
        if capability is None or tuple(capability) < tuple(min_cap):
            return "compile"
        entry = backend
    if entry == "triton" and not triton_available():
        return "compile"
    return entry


def resolve_backend(cfg_or_kernels: Union[str, "object"], device: Union[torch.device, str, None] = None,
                    variant: Optional[str] = None, capability=None) -> str:
    """The backend HC ops use for tensors on ``device``: ``eager`` | ``compile`` | ``triton``.

    ``cfg_or_kernels``: an :class:`~xhc.config.HCConfig` (its ``kernels`` and ``variant`` fields) or the
    string (then ``variant`` may name the variant).  A pure function of (the string, the variant, the
    device type, the compute ``capability`` where a table entry needs it (a ``(major, minor)`` tuple;
    queried from the device when omitted), whether Triton imports, ``TRITON_INTERPRET``, whether
    ``torch.compile`` is tracing): nothing is measured, so the same config on the same kind of
    device with the same packages always runs the same maths.

    ``auto`` -> on CUDA devices the entry of :data:`AUTO_CUDA` for the variant (the measured faster
    path; today ``compile`` for every variant: docs/gpu.md timed ``compile`` ahead on every row), and
    ``compile`` everywhere else (the fused torch ops: on CPU they were faster than the eager reference
    in most of the shapes we measured, and they are what a compiled model traces; docs/kernels.md
    gives the measurements).  ``eager`` and ``compile`` are returned as given.  An explicit
    ``triton`` gives ``triton`` on CUDA when Triton imports, and on a CPU device only with
    ``TRITON_INTERPRET=1`` (the Triton interpreter runs the kernels on CPU tensors), else
    ``compile``.  ``liger`` resolves as ``triton`` (only the mHC coefficients come from
    Liger-Kernel, :mod:`xhc.kernels.liger`).  While ``torch.compile`` traces, ``auto`` and ``liger``
    give ``compile`` (inductor then writes the kernels from the fused torch ops).
    """
    kernels = getattr(cfg_or_kernels, "kernels", cfg_or_kernels)
    if variant is None:
        variant = getattr(cfg_or_kernels, "variant", None)
    if kernels == "auto" and not _RETIRED_ENV_CHECKED:
        _warn_retired_env()
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"HCConfig.kernels={kernels!r} is invalid: allowed values are {', '.join(KERNEL_CHOICES)}")
    if kernels == "liger":  # under torch.compile Liger's op is not used either (xhc/kernels/liger.py)
        kernels = "compile" if torch.compiler.is_compiling() else "triton"
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if kernels == "eager" or kernels == "compile":
        return kernels
    if kernels == "auto":
        if torch.compiler.is_compiling() or dev.type != "cuda":
            return "compile"  # inside a compiled model inductor generates the kernels from the torch ops
        entry = AUTO_CUDA.get(variant, AUTO_CUDA_DEFAULT) if variant is not None else AUTO_CUDA_DEFAULT
        if capability is None and isinstance(entry, tuple) and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(dev)
        return _auto_cuda(variant, capability)
    if dev.type == "cuda" and triton_available():
        return "triton"
    if interpreting() and triton_available():
        return "triton"
    return "compile"


def backend_reason(cfg, device) -> str:
    """One line for the training banner and ``--help-config``: which HC path runs for ``cfg`` on
    ``device`` and why."""
    got = resolve_backend(cfg, device)
    kernels, variant = cfg.kernels, cfg.variant
    dev = torch.device(device)
    if kernels != "auto":
        return f"HC kernels: {kernels} -> {got} (pinned by model.hc_kernels)"
    if dev.type != "cuda":
        return f"HC kernels: auto -> {got} (CPU rule: the fused torch ops; docs/kernels.md)"
    why = ("the measured faster path on CUDA for this variant (docs/kernels.md, 'auto on CUDA'; "
           "it is fast when compiled: model.compile_hc=true)" if got == "compile" else
           "the measured faster path on CUDA for this variant (docs/kernels.md, 'auto on CUDA')")
    return f"HC kernels: auto -> {got} for variant {variant} ({why})"


# ------------------------------------------------------------------------------------------------
# Ops
# ------------------------------------------------------------------------------------------------
def sinkhorn(Z: torch.Tensor, t_max: int = 20, eps: float = 1e-6, order: str = "row_last",
             backend: str = "compile", recompute: bool = False) -> torch.Tensor:
    """Sinkhorn–Knopp of ``Z`` ``[..., n, n]`` -> fp32 ``[..., n, n]`` (float64 stays float64).

    ``eager``: the reference :func:`xhc.doubly_stochastic.sinkhorn`, with autograd through the
    unrolled loop, or its recompute op when ``recompute`` (``HCConfig.sinkhorn_recompute``);
    ``compile``: one autograd op saving only Z, backward by recomputation and a hand-written
    adjoint (``recompute`` is implied); ``triton``: the same op as two kernels (one program per matrix).
    """
    from xhc import doubly_stochastic as ds

    if backend == "eager":
        return ds.sinkhorn(Z, t_max, eps, order, recompute=recompute)
    if backend == "triton":
        from xhc.kernels import sinkhorn_ops as triton_sinkhorn

        return triton_sinkhorn.sinkhorn(Z, t_max, eps, order)
    return ds.sinkhorn(Z, t_max, eps, order, recompute=True)


def sinkhorn_deepseek(Z: torch.Tensor, iters: int = 20, eps: float = 1e-6, backend: str = "compile",
                      recompute: bool = False) -> torch.Tensor:
    """DeepSeek-V4's Sinkhorn of ``Z`` ``[..., n, n]`` -> fp32 ``[..., n, n]`` (docs/math.md §2.h).

    ``eager``: the reference :func:`xhc.doubly_stochastic.sinkhorn_deepseek` (unrolled autograd, or its
    recompute op when ``recompute``); ``compile``: the recompute op (saves only Z); ``triton``: the
    same op as two kernels (:func:`xhc.kernels.sinkhorn_ops.sinkhorn_deepseek`).
    """
    from xhc import doubly_stochastic as ds

    if backend == "eager":
        return ds.sinkhorn_deepseek(Z, iters, eps, recompute=recompute)
    if backend == "triton":
        from xhc.kernels import sinkhorn_ops as triton_sinkhorn

        return triton_sinkhorn.sinkhorn_deepseek(Z, iters, eps)
    return ds.sinkhorn_deepseek(Z, iters, eps, recompute=True)


def read(h: torch.Tensor, X: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
         backend: str = "compile") -> torch.Tensor:
    """u = Σ_j h[..., j] · X[..., j, :]: ``h`` ``[..., n]`` or ``[..., T, n]``, ``X`` ``[..., n, C]``.

    Returns ``[..., C]`` (or ``[..., T, C]``) in ``out_dtype`` (default: fp32, float64 stays float64),
    accumulated in fp32 without an fp32 copy of X (compile / triton).
    """
    from xhc.kernels import torch_ops

    if backend == "eager":
        return streams.read_streams(h, X, out_dtype)
    if backend == "triton":
        from xhc.kernels import read_ops as triton_read

        return triton_read.read(h, X, out_dtype)
    return torch_ops.read(h, X, out_dtype)


def write(X: Optional[torch.Tensor], I: Optional[torch.Tensor], Xa: torch.Tensor, H: Optional[torch.Tensor],
          P: torch.Tensor, V: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
          backend: str = "compile", inplace: bool = False, rows_of_X: bool = False) -> torch.Tensor:
    """The hyper-connection write, residual mixing + branch write + scatter in one op.

    new_j = Σ_q H[j, q]·Xa[q] + Σ_s P[j, s]·V[s]  (H ``None`` = identity), then

    * ``I is None``: returns ``new`` ``[..., k, C]`` (the mHC-family write with k = N and Xa = X,
      or a Flash carried write);
    * ``I`` given: returns X with rows ``I`` replaced by ``new`` ``[..., N, C]``, the other rows
      copied bit-exactly (xHC scatter).

    ``Xa`` ``[..., k, C]``; ``H`` ``[..., k, k]``; ``P`` ``[..., k, K]`` (h_post, or p·H_post);
    ``V`` ``[..., K, C]``.  Output dtype: ``out_dtype``, default X's (or Xa's) dtype.

    ``Xa`` may be ``None`` with ``I``: X_a = X[I], read from X by the op itself (one read of the
    state; the mixing gradient then goes to X), in the ``compile`` and ``triton`` backends.

    ``V`` may be a sequence of K ``[..., C]`` tensors, the components one by one (the ``compile``
    backend reads them as they are; the others stack them first).

    ``rows_of_X`` (with ``I``): the caller's ``Xa`` is X[I] gathered from this very X (the xHC
    sublayer); ``eager`` uses it as given (the reference gradient path), the fused backends read the
    active rows from X themselves (``Xa=None`` above).

    ``inplace`` (with ``I``): X itself is updated and returned, rows outside ``I`` are neither read
    nor written.  Only for callers that own X and need no gradient through it afterwards
    (inference, or a state no other op saved for backward); autograd raises otherwise.

    ``eager``: the reference :func:`xhc.streams.write_streams`, then
    :func:`xhc.streams.scatter_active` (:func:`xhc.kernels.torch_ops.write_reference`).
    """
    from xhc.kernels import torch_ops

    if rows_of_X and I is not None and backend != "eager" and not inplace:
        Xa = None
    if isinstance(V, (list, tuple)) and (backend != "compile" or inplace):
        V = torch.stack(list(V), -2)
    if Xa is None and I is not None and (backend == "eager" or inplace):  # these take X_a explicitly
        Xa = streams.gather_active(X, I)
    if inplace and I is not None and backend != "triton":
        new = streams.write_streams(Xa, H, P, V, X.dtype)
        return X.scatter_(-2, I.unsqueeze(-1).expand(*I.shape, X.shape[-1]), new)
    if backend == "eager":
        return torch_ops.write_reference(X, I, Xa, H, P, V, out_dtype)
    if backend == "triton":
        from xhc.kernels import write_ops as triton_write

        return triton_write.write(X, I, Xa, H, P, V, out_dtype, inplace=inplace)
    return torch_ops.write(X, I, Xa, H, P, V, out_dtype)


def gather(X: torch.Tensor, I: torch.Tensor, backend: str = "compile",
           after: Optional[torch.Tensor] = None) -> torch.Tensor:
    """X_a = X[..., I, :] (``X`` ``[..., N, C]``, ``I`` long ``[..., k]``) -> ``[..., k, C]`` in X's dtype.

    ``eager``: the reference :func:`xhc.streams.gather_active` (``gather``, whose backward is a
    ``scatter_add``); otherwise one op whose backward writes dX row by row (dX[i] = dX_a[slot(i)] on
    active rows, 0 elsewhere), which ``torch.compile`` fuses with X's other gradient terms.
    ``triton``: with ``after`` (a tensor computed from the state's coefficient GEMM, e.g. the routing
    weights) dX_a joins the one-pass state gradient of :mod:`xhc.kernels.state_grad`.
    """
    if backend == "eager":
        return streams.gather_active(X, I)
    if backend == "triton" and after is not None:
        from xhc.kernels import read_ops as triton_read

        return triton_read.gather(X, I, after)
    from xhc.kernels import torch_ops

    return torch_ops.gather(X, I)


def gram(V) -> torch.Tensor:
    """G[..., a, b] = Σ_c V_a[..., c]·V_b[..., c] (fp32; float64 stays float64) ``[..., K, K]``.

    ``V``: ``[..., K, C]``, or a sequence of K ``[..., C]`` tensors (the components as separate
    expressions, :meth:`xhc.temporal.TemporalAugmentation.component_list`).  One reduction pass
    over the components when compiled (:func:`xhc.kernels.torch_ops.row_dots`,
    :func:`xhc.kernels.torch_ops.gram_of_list`)."""
    from xhc.kernels import torch_ops

    if isinstance(V, (list, tuple)):
        return torch_ops.gram_of_list(V)
    return torch_ops.row_dots(V, V)


def norm_linear(x: torch.Tensor, W: torch.Tensor, eps: float = 1e-6, kind: str = "rms",
                gain: Optional[torch.Tensor] = None, backend: str = "compile", moments=None) -> torch.Tensor:
    """Norm(x) · Wᵀ with the flat norm folded after the GEMM (docs/math.md §1.5).

    ``rms``:   (x ⊙ g / rms(x)) Wᵀ = (x (W diag g)ᵀ) · rsqrt(mean(x²) + ε)
    ``layer``: LayerNorm(x) Wᵀ = (x Wᵀ − μ·(W 1)) · rsqrt(mean(x²) − μ² + ε)

    ``x`` ``[..., D]``, ``W`` ``[d, D]``, ``gain`` ``[D]`` or None  ->  fp32 ``[..., d]``.
    ``eager`` normalises first (the reference order).  ``moments``: (μ, ν) of x, keepdim, when
    already known (e.g. from :func:`xhc.norms.stream_moments`); otherwise computed.
    """
    from xhc.kernels import torch_ops

    if backend == "eager":
        return torch_ops.norm_linear_reference(x, W, eps, kind, gain)
    if backend == "triton":  # the GEMM and x's statistics in one pass, x read in its own dtype
        from xhc.kernels import linear_stats as triton_stats
        from xhc.norms import fp32

        Wf = fp32(W) if gain is None else fp32(W) * fp32(gain)
        proj, s1, s2 = triton_stats.linear_stats(x.unsqueeze(-2), Wf)
        if moments is None:
            moments = (s1 / x.shape[-1], s2 / x.shape[-1])
        return torch_ops.norm_after(proj, Wf, *moments, eps, kind)
    return torch_ops.norm_linear(x, W, eps, kind, gain, moments)


def stream_moments(X: torch.Tensor, backend: str = "compile"):
    """Per-row sums (Σ_c X[..., i, c], Σ_c X[..., i, c]²) ``[..., n]`` each, fp32 (float64 stays), from
    one pass over ``X`` ``[..., n, C]`` (:func:`xhc.norms.stream_moments`; the ``triton``
    backend reads X once in its own dtype)."""
    if backend == "triton":
        from xhc.kernels import linear_stats as triton_stats
        from xhc.norms import fp32

        _, s1, s2 = triton_stats.linear_stats(X, fp32(X.new_empty(0, X.shape[-2] * X.shape[-1])))
        return s1, s2
    from xhc.norms import stream_moments as reference

    return reference(X)


def fused(backend: str) -> bool:
    """Whether ``backend`` (resolved) runs the fused coefficient path: the flat norms applied after
    one GEMM per state (:func:`norm_linear`, :func:`linear_moment`, docs/math.md §1.5), the state's
    statistics from one pass (:func:`stream_moments`) and Gram–Schmidt folded into the branch
    weights of one write (:func:`xhc.xhc.write_components_folded`).  ``eager`` runs the reference
    order instead: normalise, then project; orthogonalise, then write."""
    return backend != "eager"


def linear_moment(x: torch.Tensor, W: torch.Tensor, backend: str = "compile", second_moment: bool = True,
                  after: Optional[torch.Tensor] = None):
    """(x·Wᵀ ``[..., d]`` fp32, ν = mean(x²) ``[..., 1]`` or None) from one pass over ``x`` ``[..., D]``.

    ``W`` is fp32 ``[d, D]``.  ``triton``: :func:`xhc.kernels.linear_stats.linear_stats` (x read once in
    its own dtype, no fp32 copy of a bf16 state; ν always comes with it); otherwise the GEMM on fp32(x)
    and, when ``second_moment``, ν from the same fp32 x.  ``after`` (``triton``): the statistics of an
    earlier one-pass op on the same state (:func:`stream_moments`); x's gradient term then joins that
    op's one-pass state gradient.
    """
    from xhc.norms import fp32

    if backend == "triton":
        from xhc.kernels import linear_stats as triton_stats

        proj, _, s2 = triton_stats.linear_stats(x.unsqueeze(-2), W, after)
        return proj, s2 / x.shape[-1]
    x = fp32(x)
    proj = torch.nn.functional.linear(x, W)
    return proj, (x.pow(2).mean(-1, keepdim=True) if second_moment else None)


# ------------------------------------------------------------------------------------------------
# Which path runs: one predicate per fused op (docs/kernels.md, "Which path runs")
# ------------------------------------------------------------------------------------------------
# The maths asks these and never compares a backend name; each kernel's limits live beside it
# (``covers`` of its module), read only when the backend is ``triton`` (so Triton imports).
def mhc_fused(cfg, X: torch.Tensor, training: bool, groups: bool = True) -> bool:
    """Whether an mHC sublayer's read and write run as the fused kernels :func:`mhc_read` and
    :func:`mhc_write` for tensors like ``X``: the ``triton`` backend (not Liger's coefficient op) and a
    configuration the kernels cover (:func:`xhc.kernels.mhc_common.covers`); ``groups``: every mapping
    group has its parameters (no ablation)."""
    if resolve_backend(cfg, X.device) != "triton" or liger_runs(cfg.kernels, X.device):
        return False
    from xhc.kernels import mhc_common

    return mhc_common.covers(cfg, training, groups)


def xhc_entry_fused(cfg, backend: str, fused: bool, mappings, K: int) -> bool:
    """Whether an xHC sublayer's routing, every mapping and its read run as the fused entry
    :func:`xhc_read`: ``triton`` with fused coefficients, and the entry kernel covers ``cfg`` with the
    ``mappings`` (their weights, None where ablated) and K components
    (:func:`xhc.kernels.xhc_common.entry_covers`)."""
    if backend != "triton" or not fused:
        return False
    from xhc.kernels import xhc_common

    return xhc_common.entry_covers(cfg, mappings, K)


def window_entry_fused(cfg, backend: str, fused: bool, pres) -> bool:
    """Whether a Flash window's entry runs as one kernel (:func:`xhc_window_read`): ``triton`` with fused
    coefficients, and the entry kernel covers ``cfg`` with the pre-maps' weights ``pres``
    (:func:`xhc.kernels.xhc_common.entry_covers` without active mappings)."""
    if backend != "triton" or not fused:
        return False
    from xhc.kernels import xhc_common

    return xhc_common.entry_covers(cfg, pres)


def xhc_mappings_fused(backend: str, fused: bool, k: int, K: int, post_ablated: bool) -> bool:
    """Whether a Flash window write's mappings run as one kernel (:func:`xhc_mappings`): ``triton`` with
    fused coefficients, a post mapping, and k, K within :func:`xhc.kernels.xhc_common.mappings_cover`."""
    if backend != "triton" or not fused or post_ablated:
        return False
    from xhc.kernels import xhc_common

    return xhc_common.mappings_cover(k, K)


def xhc_write_fused(backend: str, temporal, X: torch.Tensor, y: torch.Tensor, seq) -> bool:
    """Whether a write with the temporal components of ``temporal`` runs as the fused xHC write
    :func:`xhc_write` (the xHC MLP sublayer, a Flash window's writes): ``triton``, and the write kernel
    covers the temporal module, the tensors and the sequence (:func:`xhc.kernels.xhc_post.covers`)."""
    if backend != "triton":
        return False
    from xhc.kernels import xhc_post

    return xhc_post.covers(temporal, X, y, seq)


def flash_attn_fused(backend: str) -> bool:
    """Whether a Flash window's attention write and the MLP read's correction run as one kernel
    (:func:`flash_attn_write`): on ``triton``, every window configuration (:mod:`xhc.kernels.flash_attn`)."""
    return backend == "triton"


def mhc_read(X, W_pre, W_post, W_res, b_pre, b_post, b_res, a_pre, a_post, a_res, gain, norm_eps: float,
             t_max: int, sk_eps: float, order: str, clamp: bool = False, convention: str = "paper"):
    """The fused mHC read on the ``triton`` backend (:mod:`xhc.kernels.mhc_pre`): the coefficient GEMM,
    the epilogue (norm, σ, Sinkhorn) and u = Σ_j h_pre[j]·X_j in one kernel ->
    (u, h_pre, h_post, H_res)."""
    from xhc.kernels import mhc_pre

    return mhc_pre.mhc_pre(X, W_pre, W_post, W_res, b_pre, b_post, b_res, a_pre, a_post, a_res, gain, norm_eps,
                           t_max, sk_eps, order, clamp, convention)


def xhc_read(X, W_r, W_pre, b_pre, a_pre, W_res, b_res, a_res, W_post, b_post, a_post, k: int, m: int, K: int,
             norm_eps: float, t_max: int, sk_eps: float, order: str):
    """The fused xHC entry on the ``triton`` backend (:mod:`xhc.kernels.xhc_entry`): the router, the
    dense read weights, H_res and H_post from two GEMMs and the read u in one kernel ->
    (u, I, p, score, h_pre, H_res, H_post, P = diag(p)·H_post)."""
    from xhc.kernels import xhc_entry

    return xhc_entry.xhc_entry(X, W_r, W_pre, b_pre, a_pre, W_res, b_res, a_res, W_post, b_post, a_post, k, m, K,
                               norm_eps, t_max, sk_eps, order)


def xhc_window_read(X, W_r, pres, k: int, m: int, norm_eps: float, nonactive: bool):
    """A Flash window's entry on the ``triton`` backend (:func:`xhc.kernels.xhc_entry.window_entry`): the
    routing, every pre-map's read weights, their readouts (over the streams outside I when ``nonactive``)
    and the gathered X_a in one kernel -> (R ``[..., T, C]``, I, p, score, h ``[..., T, N]``, X_a)."""
    from xhc.kernels import xhc_entry

    return xhc_entry.window_entry(X, W_r, pres, k, m, norm_eps, nonactive)


def xhc_mappings(Xa, p, W_res, b_res, a_res, W_post, b_post, a_post, K: int, norm_eps: float, t_max: int,
               sk_eps: float, order: str, read=None):
    """A Flash window write's mappings on the ``triton`` backend (:mod:`xhc.kernels.xhc_active`): H_res
    (None without ``W_res``), H_post and P = diag(p)·H_post from the carried X_a in one kernel; with
    ``read`` = (base, I, h, row, u dtype) also the sublayer's split read u = base + Σ_j h[row, I_j]·X_a[j]
    from the same pass over X_a, returned fourth."""
    from xhc.kernels import xhc_active as xa

    return xa.xhc_active(Xa, p, W_res, b_res, a_res, W_post, b_post, a_post, K, norm_eps, t_max, sk_eps, order,
                         read)


def flash_attn_write(Xa, P, V, inp, I, h, row: int, u_dtype):
    """The xHC-Flash attention write and the MLP read's correction on the ``triton`` backend
    (:mod:`xhc.kernels.flash_attn`) in one kernel -> (X_a' = X_a + P·V, u_M = inp + Σ_t β_t·V_t with
    β_t = Σ_j h[row, I_j]·P[j, t])."""
    from xhc.kernels import flash_attn

    return flash_attn.flash_attn(Xa, P, V, inp, I, h, row, u_dtype)


def xhc_write(X, I, H, P, y, weights, pos, gram_schmidt: bool, gs_eps: float, Xa=None):
    """The fused xHC MLP write on the ``triton`` backend (:mod:`xhc.kernels.xhc_post`): the temporal
    components of ``y``, their Gram–Schmidt coefficients folded into ``P`` and the sparse write in one
    kernel -> X' (with ``Xa``, a Flash window's carried active streams: the new X_a when ``X`` is None,
    else X' with the new X_a scattered into X at ``I``)."""
    from xhc.kernels import xhc_post

    return xhc_post.xhc_post(X, I, H, P, y, weights, pos, gram_schmidt, gs_eps, Xa=Xa)


def mhc_write(X, H, h_post, y):
    """The fused mHC write on the ``triton`` backend (:mod:`xhc.kernels.mhc_post`): H·X + h_post ⊗ y."""
    from xhc.kernels import mhc_post

    return mhc_post.mhc_post(X, H, h_post, y)


def check_available(kernels: str) -> None:
    """Raise one clear line when the configured kernels need a package that is missing (``liger``)."""
    if kernels == "liger":
        from xhc.kernels import liger

        liger.require()  # which configurations Liger covers: HCConfig.validate


def liger_runs(kernels: str, device) -> bool:
    """``kernels: liger`` and Liger-Kernel's op can run on ``device`` now (:func:`xhc.kernels.liger.runnable`):
    the mHC coefficients then come from :func:`mhc_coefficients`."""
    if kernels != "liger":
        return False
    from xhc.kernels import liger

    return liger.runnable(torch.device(device) if not isinstance(device, torch.device) else device)


def liger_note(kernels: str, device) -> Optional[str]:
    """What ``kernels: liger`` computes the mHC coefficients with on ``device`` (a line for the run's
    log), or None for the other backends."""
    if kernels != "liger":
        return None
    where = ("Liger-Kernel's fused op" if liger_runs(kernels, device) else
             "the compiled ops (same maths; Liger's Triton kernels need CUDA or TRITON_INTERPRET=1)")
    return f"model.hc_kernels: liger: mHC coefficients by {where}"


def mhc_coefficients(X: torch.Tensor, W: torch.Tensor, b: torch.Tensor, alphas, t_max: int, norm_eps: float,
                     gain: Optional[torch.Tensor] = None):
    """Dynamic mHC coefficients (h_pre, h_post, H_res) by Liger-Kernel's fused op (``kernels: liger``;
    :func:`xhc.kernels.liger.mhc_coefficients`): the same maps as
    :meth:`xhc.hyper_connection.HyperConnection.coefficients` for the configurations HCConfig allows."""
    from xhc.kernels import liger

    return liger.mhc_coefficients(X, W, b, alphas, t_max, norm_eps, gain)


# ------------------------------------------------------------------------------------------------
# torch.compile of HC code: the one owner
# ------------------------------------------------------------------------------------------------
HC_METHODS = ("read", "write", "begin", "attn_read", "attn_write", "mlp_read", "mlp_write")
"""The methods of an HC module (:class:`~xhc.hyper_connection.HyperConnection`,
:class:`~xhc.xhc.XHCSublayer`, the Flash window parts) that :func:`compile_module` wraps."""


def check_compile_enabled() -> None:
    """Raise when ``TORCHDYNAMO_DISABLE=1``: ``torch.compile`` would silently run the HC code eagerly."""
    if os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        raise RuntimeError("compile_hc_modules: torch.compile is switched off in this process "
                           "(TORCHDYNAMO_DISABLE=1); unset TORCHDYNAMO_DISABLE to compile the HC modules")


def compile_module(mod: torch.nn.Module, fullgraph: bool = False, **compile_kwargs) -> bool:
    """Wrap ``mod``'s HC methods (:data:`HC_METHODS` it has) in ``torch.compile`` with the HC inductor
    options (:func:`compile_options`); the ``compile`` backend's fused ops then run as inductor
    kernels.  Returns False when ``mod`` was wrapped already.  Every compiled HC graph of the project
    goes through here (``models.hc_layer.compile_hc_modules`` walks a model and calls it).
    ``fullgraph=True`` turns a graph break into an error."""
    check_compile_enabled()
    if getattr(mod, "_hc_compiled", False):
        return False
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 4096)
    kw = dict(compile_kwargs)
    if kw.get("backend", "inductor") == "inductor":  # HC graphs get INDUCTOR_OPTIONS
        kw["options"] = {**compile_options(kw.pop("mode", None)), **(kw.get("options") or {})}
    for name in HC_METHODS:
        fn = getattr(mod, name, None)
        if fn is not None:
            setattr(mod, name, torch.compile(fn, fullgraph=fullgraph, **kw))
    mod._hc_compiled = True
    return True
