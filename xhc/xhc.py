"""xHC: sparse k-of-N residual streams with temporal write-back (docs/math.md §3, [xHC]).

A framework drives one :class:`XHCSublayer` per wrapped sublayer (attention or MLP)::

    u, ctx = hc.read(X)              # X: [s, b, N, C] -> u: [s, b, C]; routing, mappings in ctx
    y = F(u)                         # the backbone sublayer (own norm, bias and dropout included)
    X = hc.write(X, y, ctx, seq)     # X': [s, b, N, C]; only the k active streams change

Shape legend: ``s`` sequence, ``b`` batch, ``N`` streams, ``C`` hidden size, ``k`` active streams,
``m`` fixed streams, ``K`` write-back components (K_r = r+1 after MLPs, 1 after attention).
Per-token functions accept any leading dims ``...``; the temporal convolution needs ``[s, b, ·]``.

Equations (docs/math.md §3.4, §3.5), per token, X ∈ R^{N×C}, x = vec(X):

=================================  ===================================================================
:func:`~xhc.router.route`          I, p from score = σ(LayerNorm(x) W_router)          (router.py)
:func:`read_weights`               h_pre  = σ(α_pre · RMSNorm(x) W_pre + b_pre)          ∈ (0,1)^N
:func:`~xhc.streams.read_streams`  u      = Σ_{i<N} h_pre[i] · X_i                  (dense read; xhc/streams.py)
:func:`~xhc.streams.gather_active` X_a    = X[I]                                          ∈ R^{k×C}
:func:`res_weights`                H_res  = clamp_rows(sinkhorn(α_res·mat_{k×k}(x̂_a W_res) + b_res))
:func:`post_weights_active`        H_post = 2σ(α_post · mat_{k×K}(x̂_a W_post) + b_post)  ∈ (0,2)^{k×K}
:func:`write_components`           V      = GS([y, g_1, …, g_r])  (MLP; attention: V = [y])
:func:`~xhc.streams.write_streams` X_a'[j] = Σ_q H_res[j,q]·X_a[q] + Σ_t P[j,t]·V_t,  P = diag(p)·H_post
                                   (the sparse write: p gates only the new write, not the mixing)
:func:`~xhc.streams.scatter_active` X'[I_j] = X_a'[j];  X'[i] = X[i] for i ∉ I   (out-of-place)
:func:`entry_mappings`             routing and pre-mappings from one state (shared by Flash windows)
:func:`fused_entry_projections`    router + pre GEMMs as one GEMM on x (§1.5 reordering, §3.5 fusion)
=================================  ===================================================================

The read, gather and write run as :func:`xhc.kernels.read` / :func:`~xhc.kernels.gather` /
:func:`~xhc.kernels.write` on the resolved kernel backend (``eager``: the reference functions of
:mod:`xhc.streams`; docs/kernels.md).

Routing ties go to the lower stream index (:func:`~xhc.router.topk_stable`, a stable sort).
``read`` and ``write`` accept any leading dims ``[..., N, C]``; sublayers with temporal augmentation
(MLPs) need ``[s, b, N, C]`` because the convolution runs along s.

Parameters of one :class:`XHCSublayer` (fp32; projections in torch ``Linear`` layout ``[out, in]``,
the transpose of the documented ``in × out``; biases and gates 1-D so no-weight-decay rules apply):

==========================  ====================  ============================  =====================
name                        shape                 docs/math.md §3.1                     init (§3.4)
==========================  ====================  ============================  =====================
``router.weight``           ``[N, N·C]``          W_router                      N(0, 1/(N·C))
``pre.weight``              ``[N, N·C]``          W_pre                         0
``pre.bias``, ``pre.alpha`` ``[N]``, ``[1]``      b_pre, α_pre                  −ln(N−1), gate_init
``res.weight``              ``[k², k·C]``         W_res                         0
``res.bias``, ``res.alpha`` ``[k²]``, ``[1]``     b_res, α_res                  0 diag / −8 off, gate
``post.weight``             ``[k·K, k·C]``        W_post                        0
``post.bias``, ``post.alpha`` ``[k·K]``, ``[1]``  b_post, α_post                0, gate_init
``temporal.*``              ``[κ_j, C]`` each     conv_j (MLP only)             TemporalAugmentation
==========================  ====================  ============================  =====================

Ablations ([xHC] Table 2, docs/math.md §7.1): ``m = 0`` (no fixed streams), any ``k`` (``k = m``: no routing,
no router parameter), ``router='softmax'`` (see :mod:`xhc.router`), and ``dense_read=False``:
**read only the k active streams**, with read weights generated from the active state the same
way as the write mappings, h_pre = σ(α_pre · RMSNorm(vec X_a) W_pre + b_pre) ∈ (0,1)^k,
W_pre ``[k, k·C]``, b_pre = −ln(k−1) (uniform 1/k read; k = 1 gives b_pre = 0, h_pre = ½, exact
only through the branch norm's scale invariance), and u = Σ_j h_pre[j] · X_a[j].
The mHC-family switches ``ablate_pre`` (h_pre ≡ 1/n), ``ablate_res`` (H_res ≡ I_k) and
``ablate_post`` (H_post ≡ 1) are honoured too and drop the corresponding parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from xhc import kernels
from xhc.config import HCConfig, HCConfigError
from xhc.diagnostics import identity_distance_tensor
from xhc.doubly_stochastic import clamp_rows, sinkhorn
from xhc.hyper_connection import dynamic_logits, mixing_sinkhorn, near_one_hot_read_bias, uniform_read_bias
from xhc.norms import fp32, layer_scale, moments_of_rows, rms_norm_flat, rms_scale
from xhc.router import Routing, StreamRouter, effective_mixing, router_load
from xhc.streams import gather_active, read_streams, scatter_active, write_streams  # noqa: F401  (§3.4 equations)

# ================================================================================================
# Equations (pure functions)
# ================================================================================================


def read_weights(z_pre: torch.Tensor) -> torch.Tensor:
    """h_pre = σ(z_pre), z_pre = α_pre · RMSNorm(vec X) W_pre + b_pre  (docs/math.md §3.4 dense read).  ``[..., n]``."""
    return torch.sigmoid(z_pre)


def res_weights(
    xa_hat: torch.Tensor,
    W_res: torch.Tensor,
    b_res: torch.Tensor,
    alpha_res: torch.Tensor,
    k: int,
    t_max: int = 20,
    eps: float = 1e-6,
    order: str = "row_last",
    recompute: bool = False,
) -> torch.Tensor:
    """H_res = clamp_rows(sinkhorn(α_res · mat_{k×k}(x̂_a W_res) + mat_{k×k}(b_res)))  (docs/math.md §3.4, §2.f).

    ``xa_hat``: ``[..., k·C]`` = RMSNorm(vec X_a);  ``W_res``: ``[k², k·C]``  ->  ``[..., k, k]``, rows
    are output slots.  The row-sum clamp is always on in xHC.
    """
    z = dynamic_logits(xa_hat, W_res, fp32(alpha_res), fp32(b_res)).unflatten(-1, (k, k))
    return clamp_rows(sinkhorn(z, t_max, eps, order, recompute=recompute))


def res_weights_from_logits(z: torch.Tensor, cfg: HCConfig, backend: str) -> torch.Tensor:
    """H_res = clamp_rows(Sinkhorn(z)) for logits ``z`` ``[..., k, k]`` on the given kernel backend."""
    return clamp_rows(mixing_sinkhorn(z, cfg, backend))


def post_weights_active(
    xa_hat: torch.Tensor, W_post: torch.Tensor, b_post: torch.Tensor, alpha_post: torch.Tensor, k: int, K: int
) -> torch.Tensor:
    """H_post = 2σ(α_post · mat_{k×K}(x̂_a W_post) + mat_{k×K}(b_post))  (docs/math.md §3.4).

    ``xa_hat``: ``[..., k·C]``;  ``W_post``: ``[k·K, k·C]``  ->  ``[..., k, K]`` in (0, 2).
    """
    z = dynamic_logits(xa_hat, W_post, fp32(alpha_post), fp32(b_post))
    return (2.0 * torch.sigmoid(z)).unflatten(-1, (k, K))


def write_components(
    y: torch.Tensor,
    temporal: Optional[nn.Module] = None,
    use_gram_schmidt: bool = True,
    gs_eps: float = 1e-6,
    seq=None,
) -> torch.Tensor:
    """V = [y, g_1, …, g_r], Gram–Schmidt-orthogonalised (docs/math.md §3.2, §3.3); V = [y] without ``temporal``.

    ``y``: ``[s, b, C]`` (``[..., C]`` when ``temporal`` is None)  ->  fp32 ``[..., K, C]``.
    """
    if temporal is None:
        return fp32(y).unsqueeze(-2)
    V = temporal(y, seq)
    if use_gram_schmidt:
        from xhc.gram_schmidt import gram_schmidt

        V = gram_schmidt(V, gs_eps)
    return V


def write_components_folded(
    y: torch.Tensor,
    temporal: Optional[nn.Module] = None,
    use_gram_schmidt: bool = True,
    gs_eps: float = 1e-6,
    seq=None,
):
    """(V_raw, L): the raw components [y, g_1, …, g_r] and the Gram–Schmidt coefficients with
    :func:`write_components` = L · V_raw (``L`` None when there is nothing to orthogonalise).

    For the fused write: the branch weights P (``[..., k, K]``) become P·L and the write reads the raw
    components, so the orthogonalised V is never materialised (docs/kernels.md).

    While ``torch.compile`` traces, ``V_raw`` is the list ``[y, g_1, …, g_r]`` of ``[..., C]`` tensors
    (:meth:`~xhc.temporal.TemporalAugmentation.component_list`), which :func:`xhc.kernels.write` and
    :func:`xhc.kernels.gram` take as they are: no stacked copy of the components is made.
    """
    if temporal is None:
        return fp32(y).unsqueeze(-2), None
    V = temporal.component_list(y, seq) if torch.compiler.is_compiling() else temporal(y, seq)
    K = len(V) if isinstance(V, list) else V.shape[-2]
    if not use_gram_schmidt or K < 2:
        return V, None
    from xhc.gram_schmidt import gram_schmidt_coefficients

    C = V[0].shape[-1] if isinstance(V, list) else V.shape[-1]
    M = kernels.gram(V) / C  # mean_c(V_a V_b): one pass over the components
    return V, gram_schmidt_coefficients(M, gs_eps)


def fold_components(P: torch.Tensor, L: Optional[torch.Tensor]) -> torch.Tensor:
    """P·L ``[..., k, K]`` (P unchanged when ``L`` is None): branch weights on the raw components."""
    if L is None:
        return P
    return (P.unsqueeze(-1) * L.unsqueeze(-3)).sum(-2)


def fused_entry_projections(
    x: torch.Tensor, W_router: Optional[torch.Tensor], W_pres: Sequence[torch.Tensor], eps: float = 1e-6,
    moments=None, backend: str = "compile",
):
    """Router logits and pre-projections from ONE GEMM on the raw state (docs/math.md §1.5 reordering, §3.5).

    z_router = (x W_r − μ·1ᵀW_r) · rsqrt(ν − μ² + ε)      (= LayerNorm(x) W_r)
    x̂ W_t   = (x W_t) · rsqrt(ν + ε)                       (= RMSNorm(x) W_t)
    with μ = mean(x), ν = mean(x²) over the N·C entries.

    ``x``: ``[..., N·C]``;  ``W_router``: ``[N, N·C]`` or ``None``;  ``W_pres``: list of ``[n_t, N·C]``
    ->  (z_router ``[..., N]`` or ``None``, [x̂ W_t ``[..., n_t]``]), fp32.
    ``moments``: (μ, ν) ``[..., 1]`` when already computed (:func:`xhc.norms.moments_of_rows`;
    only ν is used: μ comes out of the GEMM).  The GEMM is :func:`xhc.kernels.linear_moment` on
    ``backend`` (``triton``: x read once in its dtype, fp32 accumulation).

    The LayerNorm's mean is folded into the GEMM as well: x W_rᵀ − μ·W_r1 = x (W_r − W_r1/D 1ᵀ)ᵀ
    (centred router weights, D = N·C), and μ = x·(1/D)1 is one more GEMM column, so the state is
    read once and its gradient comes back through the GEMM's backward alone.
    """
    D = x.shape[-1]
    Ws = [fp32(W) for W in W_pres]
    if W_router is not None:
        Wr = fp32(W_router)
        Ws = [Wr - Wr.mean(-1, keepdim=True)] + Ws + [torch.full((1, D), 1.0 / D, dtype=Wr.dtype, device=Wr.device)]
    # one pass over x (triton: in its own dtype); the norm statistic once per token
    proj, nu = kernels.linear_moment(x, torch.cat(Ws, 0), backend, second_moment=moments is None,
                                     after=None if moments is None else moments[1])
    nu = nu if moments is None else moments[1]
    start, z_router = 0, None
    if W_router is not None:
        n = W_router.shape[0]
        mu = proj[..., -1:]
        z_router = proj[..., :n] * layer_scale(mu, nu, eps)
        start = n
    r = rms_scale(nu, eps)
    outs = []
    for W in W_pres:
        outs.append(proj[..., start : start + W.shape[0]] * r)
        start += W.shape[0]
    return z_router, outs


def active_mappings(Xa: torch.Tensor, maps: Sequence[Optional[nn.Module]], eps: float = 1e-6,
                    fused: bool = False, moments=None, backend: str = "compile"):
    """The mappings generated from the active state, [m(RMSNorm(vec X_a)) for m in maps] (docs/math.md §3.4);
    ``None`` entries stay ``None``.  ``fused``: one GEMM on vec(X_a) for every map's projection with
    the RMSNorm applied after it (:func:`xhc.kernels.norm_linear` on ``backend``, docs/math.md §1.5).

    ``Xa``: ``[..., k, C]``; maps: :class:`ResMapping` / :class:`PostMapping` / :class:`ReadMapping`.
    """
    x = Xa.flatten(-2)
    Ws = [m.weight for m in maps if m is not None and m.weight is not None]
    if not fused or not Ws:
        x_hat = rms_norm_flat(x, eps)
        return [None if m is None else m(x_hat) for m in maps]
    proj = kernels.norm_linear(x, torch.cat(Ws, 0), eps, "rms", backend=backend, moments=moments)
    out, start = [], 0
    for m in maps:
        if m is None or m.weight is None:
            out.append(None if m is None else m(x))
            continue
        d = m.weight.shape[0]
        out.append(m(x, proj[..., start : start + d]))
        start += d
    return out


def entry_statistics(X: torch.Tensor, fused: bool, backend: str):
    """(per-row sums, (μ, ν) of vec X) from one pass over the state on the fused backends
    (:func:`xhc.kernels.stream_moments`; the statistics of any X[I] follow from the sums
    via :func:`~xhc.norms.moments_of_rows`), else (None, None): the reference order
    computes them where it normalises."""
    if not fused or not kernels.fused(backend):
        return None, None
    stats = kernels.stream_moments(X, backend)
    return stats, moments_of_rows(*stats, X.shape[-1])


def entry_mappings(X: torch.Tensor, router: StreamRouter, pre_maps: Sequence["ReadMapping"], eps: float = 1e-6,
                   fused: bool = False, moments=None, backend: str = "compile"):
    """Routing and dense pre-mappings generated from one state (docs/math.md §3.5 steps 1–2; the Flash window
    entry of §4.1 / §4.2 generates several pre-mappings in the same pass).

    ``X``: ``[..., N, C]``  ->  (:class:`~xhc.router.Routing`, [h_pre_t fp32 ``[..., N]`` per map]).
    ``fused`` computes every projection with one GEMM on vec(X) (:func:`fused_entry_projections`);
    ``moments``: its (μ, ν) of vec(X) when already computed.
    """
    x = X.flatten(-2)  # vec(X): [..., N·C], stream-major (§1.2)
    Ws = [pm.weight for pm in pre_maps if pm.weight is not None]
    if fused and (router.weight is not None or Ws):
        z_router, projs = fused_entry_projections(x, router.weight, Ws, eps, moments, backend)
        it = iter(projs)
        h = [pm(x, next(it) if pm.weight is not None else None) for pm in pre_maps]
        return router(x, z_router), h
    x_hat = rms_norm_flat(x, eps) if Ws else x  # x only lends its shape to ablated (constant) reads
    return router(x), [pm(x_hat) for pm in pre_maps]


# ================================================================================================
# Coefficient modules (one per mapping group; shared by xHC, Flash and Flash-4sub)
# ================================================================================================
def _gate(init: float) -> nn.Parameter:
    return nn.Parameter(torch.full((1,), float(init)))


class ReadMapping(nn.Module):
    """Pre-mapping over ``n`` streams: h_pre = σ(α · x̂ W + b) (docs/math.md §3.4), or 1/n when ablated.

    ``weight`` ``[n, n·C]``, ``bias`` ``[n]``, ``alpha`` ``[1]``.  ``read_init``: ``uniform``
    (b = −ln(n−1), the xHC default, §3.4) or ``one_hot`` (near-one-hot on stream ``hot``, §2.0, §8 #17).
    """

    def __init__(self, n: int, hidden_size: int, gate_init: float = 0.01, ablate: bool = False,
                 read_init: str = "uniform", hot: int = 0, read_delta: float = 0.01):
        super().__init__()
        self.n, self.hidden_size, self.gate_init = n, hidden_size, gate_init
        self.read_init, self.hot, self.read_delta = read_init, hot % n, read_delta
        if ablate:
            self.weight = self.bias = self.alpha = None
        else:
            self.weight = nn.Parameter(torch.zeros(n, n * hidden_size))
            self.bias = nn.Parameter(torch.zeros(n))
            self.alpha = _gate(gate_init)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.weight is None:
            return
        self.weight.zero_()
        self.alpha.fill_(self.gate_init)
        if self.read_init == "one_hot" and self.n > 1:
            self.bias.copy_(near_one_hot_read_bias(self.n, self.hot, self.read_delta))
        else:
            self.bias.copy_(uniform_read_bias(self.n))

    def forward(self, x_hat: torch.Tensor, proj: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x_hat`` = RMSNorm(vec X) ``[..., n·C]`` (only its shape is used when ``proj`` = x̂W is
        given, or when ablated)  ->  h_pre fp32 ``[..., n]``."""
        if self.weight is None:
            return torch.full((*x_hat.shape[:-1], self.n), 1.0 / self.n, dtype=fp32(x_hat).dtype,
                              device=x_hat.device)
        if proj is None:
            proj = F.linear(x_hat, fp32(self.weight))
        return read_weights(fp32(self.alpha) * proj + fp32(self.bias))


class ResMapping(nn.Module):
    """H_res (k×k Sinkhorn + row clamp) from the normalised active state (docs/math.md §3.4); ``None`` = I_k.

    ``weight`` ``[k², k·C]``, ``bias`` ``[k²]`` (0 diagonal, ``res_offdiag_init`` off), ``alpha`` ``[1]``.
    """

    def __init__(self, k: int, hidden_size: int, cfg: HCConfig):
        super().__init__()
        self.k, self.cfg = k, cfg
        self.weight = nn.Parameter(torch.zeros(k * k, k * hidden_size))
        self.bias = nn.Parameter(torch.zeros(k * k))
        self.alpha = _gate(cfg.gate_init)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.zero_()
        self.alpha.fill_(self.cfg.gate_init)
        self.bias.copy_((self.cfg.res_offdiag_init * (1.0 - torch.eye(self.k))).flatten())

    def forward(self, xa_hat: torch.Tensor, proj: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``xa_hat``: ``[..., k·C]`` -> H_res ``[..., k, k]``.  ``proj`` = x̂_a W_res from a fused GEMM
        (then ``xa_hat`` only lends its device); the fused backends run the one-op Sinkhorn."""
        c = self.cfg
        if proj is None:  # the same sums as res_weights: z = α·(x̂_a W_res) + b_res
            proj = F.linear(xa_hat, fp32(self.weight))
        z = (fp32(self.alpha) * proj + fp32(self.bias)).unflatten(-1, (self.k, self.k))
        return res_weights_from_logits(z, c, kernels.resolve_backend(c, xa_hat.device))


class PostMapping(nn.Module):
    """H_post ∈ (0,2)^{k×K} from the normalised active state (docs/math.md §3.4), or ones when ablated.

    ``weight`` ``[k·K, k·C]``, ``bias`` ``[k·K]`` (0: H_post = 1 at init), ``alpha`` ``[1]``.
    """

    def __init__(self, k: int, K: int, hidden_size: int, gate_init: float = 0.01, ablate: bool = False):
        super().__init__()
        self.k, self.K, self.gate_init = k, K, gate_init
        if ablate:
            self.weight = self.bias = self.alpha = None
        else:
            self.weight = nn.Parameter(torch.zeros(k * K, k * hidden_size))
            self.bias = nn.Parameter(torch.zeros(k * K))
            self.alpha = _gate(gate_init)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.weight is not None:
            self.weight.zero_()
            self.bias.zero_()
            self.alpha.fill_(self.gate_init)

    def forward(self, xa_hat: torch.Tensor, proj: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``xa_hat``: ``[..., k·C]`` -> H_post ``[..., k, K]``; ``proj`` = x̂_a W_post from a fused GEMM."""
        if self.weight is None:
            return torch.ones(*xa_hat.shape[:-1], self.k, self.K, dtype=fp32(xa_hat).dtype, device=xa_hat.device)
        if proj is None:
            return post_weights_active(xa_hat, self.weight, self.bias, self.alpha, self.k, self.K)
        return (2.0 * torch.sigmoid(fp32(self.alpha) * proj + fp32(self.bias))).unflatten(-1, (self.k, self.K))


def make_temporal(cfg: HCConfig, hidden_size: int, augmented: bool) -> Optional[nn.Module]:
    """The sublayer's TemporalAugmentation (docs/math.md §3.2), or ``None`` (attention, or ``kernel_sizes=()``)."""
    if not augmented or len(cfg.kernel_sizes) == 0:
        return None
    from xhc.temporal import TemporalAugmentation

    return TemporalAugmentation(hidden_size, cfg.kernel_sizes, cfg.conv_doc_reset)


def num_components(cfg: HCConfig, augmented: bool) -> int:
    """K: r + 1 on augmented sublayers (MLP, or attention with ``attn_temporal``), else 1 (docs/math.md §3.1)."""
    return len(cfg.kernel_sizes) + 1 if augmented else 1


def resolve_fused(fused: Optional[bool], backend: str) -> bool:
    """Fused coefficient generation unless asked otherwise: what the *resolved* ``backend`` runs
    (:func:`xhc.kernels.fused`: on for every backend but ``eager``)."""
    return kernels.fused(backend) if fused is None else bool(fused)


class Components(NamedTuple):
    """A sublayer's write components as the backend's write takes them: ``V`` and the Gram–Schmidt
    coefficients ``L`` (None: V is already orthogonalised, or there is nothing to orthogonalise)."""

    V: object  # [..., K, C] fp32, or a list of K [..., C] tensors (compiled, raw components)
    L: Optional[torch.Tensor]  # [..., K, K] or None


def branch_components(y: torch.Tensor, temporal: Optional[nn.Module], cfg: HCConfig, seq, backend: str) -> Components:
    """The write components on ``backend``: the orthogonalised V (:func:`write_components`, ``L`` None)
    where the backend runs the reference order, the raw components and their Gram–Schmidt
    coefficients (:func:`write_components_folded`, folded into P by :func:`fold_components`) on the
    fused backends (:func:`xhc.kernels.fused`)."""
    if kernels.fused(backend):
        return Components(*write_components_folded(y, temporal, cfg.gram_schmidt, cfg.gs_eps, seq))
    return Components(write_components(y, temporal, cfg.gram_schmidt, cfg.gs_eps, seq), None)


def fused_write_runs(temporal: Optional[nn.Module], X: torch.Tensor, y: torch.Tensor, seq, backend: str) -> bool:
    """Whether a write with the temporal components of ``temporal`` runs as the fused xHC write kernel
    (the xHC MLP sublayer and the Flash windows' writes): the kernels room answers
    (:func:`xhc.kernels.xhc_write_fused`: the backend, the number of kernels, the tensors' ranks and
    whether this rank holds the whole sequence)."""
    return kernels.xhc_write_fused(backend, temporal, X, y, seq)


def fused_write(X: Optional[torch.Tensor], I: Optional[torch.Tensor], Xa: Optional[torch.Tensor],
                H_res: Optional[torch.Tensor], P: torch.Tensor, y: torch.Tensor, temporal: nn.Module, cfg: HCConfig,
                seq) -> torch.Tensor:
    """The fused xHC write (:func:`xhc.kernels.xhc_write`) with ``temporal``'s convs and document
    positions: X' (``Xa`` None, or ``X`` given: the exit) or the new carried X_a (``X`` None)."""
    pos = temporal._doc_positions(seq.pos_in_doc if seq is not None else None, y)
    return kernels.xhc_write(X, I, H_res, P, y, list(temporal.conv), pos, cfg.gram_schmidt, cfg.gs_eps, Xa=Xa)


def check_xhc_config(cfg: HCConfig, variants: Sequence[str]) -> None:
    """Reject settings that xHC does not define (one-line error naming the field)."""
    if cfg.variant not in variants:
        raise HCConfigError(f"HCConfig.variant={cfg.variant!r} is not handled here: expected one of {', '.join(variants)}")
    if not cfg.dynamic:
        raise HCConfigError("HCConfig.dynamic=False is not defined for xHC (routing is input-dependent); set dynamic: true")
    if cfg.mapping_norm_affine:
        raise HCConfigError("HCConfig.mapping_norm_affine=True is an mHC-family [PEFT] option; set it to false for xHC")
    if cfg.preset != "spec":
        raise HCConfigError(f"HCConfig.preset={cfg.preset!r} is an mHC-family option; use preset: spec for xHC")
    if cfg.res_logit_dropout > 0 or cfg.init_noise > 0:
        raise HCConfigError("HCConfig.res_logit_dropout / init_noise are mHC-family options; set them to 0 for xHC")


def mapping_diagnostics(I: torch.Tensor, p: torch.Tensor, n: int, H_res: Optional[torch.Tensor]) -> dict:
    """Detached logging tensors: per-stream router load ``[N]``, mean route weight of routed slots,
    mean ‖H_res − I‖_F and the token-mean H_res ``[k, k]`` (None when H_res ≡ I)."""
    with torch.no_grad():
        out = {"router_load": router_load(I, n), "route_weight_mean": p.float().mean()}
        if H_res is not None:
            Hf = H_res.float()
            out["h_res_identity_distance"] = identity_distance_tensor(Hf)
            out["h_res_mean"] = Hf.reshape(-1, *Hf.shape[-2:]).mean(0)
    return out


# ================================================================================================
# XHCSublayer
# ================================================================================================
@dataclass
class XHCContext:
    """What :meth:`XHCSublayer.read` hands to :meth:`XHCSublayer.write` (one sublayer, one step)."""

    I: torch.Tensor  # [..., k] long: active streams (fixed 0..m−1 first, routed ascending)
    p: torch.Tensor  # [..., k] fp32: route weights
    score: torch.Tensor  # [..., N] fp32: router scores (diagnostics)
    h_pre: torch.Tensor  # [..., N] fp32 dense read weights ([..., k] when dense_read=False)
    Xa: torch.Tensor  # [..., k, C] residual dtype: gathered active streams X[I]
    H_res: Optional[torch.Tensor]  # [..., k, k] fp32 (None when ablate_res: I_k)
    H_post: torch.Tensor  # [..., k, K] fp32
    P: Optional[torch.Tensor] = None  # [..., k, K] fp32: diag(p)·H_post when the fused entry computed it


class XHCSublayer(nn.Module):
    """xHC around one sublayer (docs/math.md §3.4, §3.5): route, dense read, sparse k-stream write.

    Args:
        cfg: the model's :class:`~xhc.config.HCConfig` with ``variant='xhc'``.
        hidden_size: C.
        is_mlp: MLP/MoE sublayer (temporal augmentation, K = r+1) or attention (K = 1 unless
            ``cfg.attn_temporal``).
        layer_index: ℓ, the global 0-based sublayer index (attention of layer i is 2i, its MLP 2i+1);
            only used by ``read_init='one_hot'`` (hot stream ℓ mod n).  xHC's default read is uniform.
        fused: compute the router logits and the pre-projection with one GEMM on vec(X)
            (:func:`fused_entry_projections`), and the res/post projections with one GEMM on
            vec(X_a) (:func:`active_mappings`), norms applied after the GEMMs; same values within
            fp32 rounding.  Default (``None``): what the resolved backend runs (:func:`resolve_fused`:
            on unless it resolves to ``eager``).

    Parameters: see the module docstring table.  ``read(X)`` -> (u, :class:`XHCContext`);
    ``write(X, y, ctx, seq)`` -> X'.
    """

    def __init__(self, cfg: HCConfig, hidden_size: int, is_mlp: bool, layer_index: int = 0,
                 fused: Optional[bool] = None):
        super().__init__()
        check_xhc_config(cfg, ("xhc",))
        self.cfg, self.n, self.k, self.m = cfg, cfg.n, cfg.k, cfg.m
        self.hidden_size, self.is_mlp, self.layer_index = hidden_size, is_mlp, layer_index
        self.fused = fused  # None: follow the resolved backend (resolve_fused)
        augmented = is_mlp or cfg.attn_temporal
        self.K = num_components(cfg, augmented)
        self.router = StreamRouter(cfg.n, hidden_size, cfg.k, cfg.m, cfg.router, cfg.norm_eps)
        n_read = cfg.n if cfg.dense_read else cfg.k
        read_init = "one_hot" if cfg.read_init == "one_hot" else "uniform"
        self.pre = ReadMapping(n_read, hidden_size, cfg.gate_init, cfg.ablate_pre, read_init, layer_index,
                               cfg.read_delta)
        self.res = None if cfg.ablate_res else ResMapping(cfg.k, hidden_size, cfg)
        self.post = PostMapping(cfg.k, self.K, hidden_size, cfg.gate_init, cfg.ablate_post)
        self.temporal = make_temporal(cfg, hidden_size, augmented)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """docs/math.md §3.4 init for every mapping; TemporalAugmentation keeps its own init (§3.2)."""
        for mod in (self.router, self.pre, self.res, self.post, self.temporal):
            if mod is not None and hasattr(mod, "reset_parameters"):
                mod.reset_parameters()

    def hc_parameter_count(self) -> int:
        """Number of HC parameters of this sublayer (compare with docs/math.md §3.1)."""
        return sum(p.numel() for p in self.parameters())

    # --------------------------------------------------------------------------------------------
    def _fused_entry(self, X: torch.Tensor, backend: str) -> bool:
        """Whether routing, every mapping and the read run as the fused xHC entry kernel
        (:func:`xhc.kernels.xhc_entry_fused`; the ablations keep the separate ops)."""
        return kernels.xhc_entry_fused(self.cfg, backend, resolve_fused(self.fused, backend),
                                       [self.pre.weight, self.post.weight, self.res], self.K)

    def _fused_post(self, X: torch.Tensor, y: torch.Tensor, seq, backend: str) -> bool:
        """Whether the temporal components, their Gram–Schmidt coefficients and the write run as the
        fused xHC write kernel (:func:`fused_write_runs`)."""
        return fused_write_runs(self.temporal, X, y, seq, backend)

    def read(self, X: torch.Tensor):
        """Route, generate every mapping and read the branch input (docs/math.md §3.5 steps 1–3).

        ``X``: ``[..., N, C]`` -> (u ``[..., C]`` in X's dtype, :class:`XHCContext`).
        """
        cfg = self.cfg
        if self._fused_entry(X, kernels.resolve_backend(cfg, X.device)):
            u, I, p, score, h_pre, H_res, H_post, P = kernels.xhc_read(
                X, self.router.weight, self.pre.weight, self.pre.bias, self.pre.alpha, self.res.weight,
                self.res.bias, self.res.alpha, self.post.weight, self.post.bias, self.post.alpha, self.k, self.m,
                self.K, cfg.norm_eps, cfg.sinkhorn_iters, cfg.sinkhorn_eps, cfg.sinkhorn_order)
            return u, XHCContext(I, p, score, h_pre, None, H_res, H_post, P)
        dense = cfg.dense_read
        backend = kernels.resolve_backend(cfg, X.device)
        fused = resolve_fused(self.fused, backend)
        stats, entry_mom = entry_statistics(X, fused, backend)
        act_mom = None
        routing, h_pres = entry_mappings(X, self.router, [self.pre] if dense else [], cfg.norm_eps, fused,
                                         entry_mom, backend)
        Xa = kernels.gather(X, routing.I, backend, after=routing.p)  # [..., k, C]
        if stats is not None:
            act_mom = moments_of_rows(*stats, X.shape[-1], routing.I)
        H_res, H_post, h_pre_a = active_mappings(Xa, [self.res, self.post, None if dense else self.pre],
                                                 cfg.norm_eps, fused, act_mom, backend)
        h_pre, src = (h_pres[0], X) if dense else (h_pre_a, Xa)  # ablation: read only the k active streams
        u = kernels.read(h_pre, src, X.dtype, backend)
        ctx = XHCContext(routing.I, routing.p, routing.score, h_pre, Xa, H_res, H_post)
        return u, ctx

    def components(self, y: torch.Tensor, seq=None) -> torch.Tensor:
        """V ``[..., K, C]`` fp32 from the branch output ``y`` (docs/math.md §3.2–§3.3)."""
        return write_components(y, self.temporal, self.cfg.gram_schmidt, self.cfg.gs_eps, seq)

    def write(self, X: torch.Tensor, y: torch.Tensor, ctx: XHCContext, seq=None) -> torch.Tensor:
        """Sparse write and scatter (docs/math.md §3.5 steps 4–5).

        ``X``: ``[s, b, N, C]`` (the state given to :meth:`read`);  ``y``: ``[s, b, C]``;
        ``seq``: :class:`~xhc.temporal.SequenceContext` for the temporal conv  ->  X' ``[s, b, N, C]``.
        """
        backend = kernels.resolve_backend(self.cfg, X.device)
        if ctx.P is not None and self._fused_post(X, y, seq, backend):
            return fused_write(X, ctx.I, None, ctx.H_res, ctx.P, y, self.temporal, self.cfg, seq)
        V, L = branch_components(y, self.temporal, self.cfg, seq, backend)
        P = ctx.P if ctx.P is not None else ctx.p.unsqueeze(-1) * ctx.H_post  # P = diag(p)·H_post
        P = fold_components(P, L)  # (·L)
        # X_a = X[I] here (rows_of_X): the fused backends read the active rows from X itself
        return kernels.write(X, ctx.I, ctx.Xa, ctx.H_res, P, V, X.dtype, backend, rows_of_X=True)

    def forward(self, X: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor], seq=None) -> torch.Tensor:
        """Convenience: ``write(X, branch(u), ctx, seq)`` with ``u, ctx = read(X)``."""
        u, ctx = self.read(X)
        return self.write(X, branch(u), ctx, seq)

    # --------------------------------------------------------------------------------------------
    def diagnostics(self, ctx: XHCContext) -> dict:
        """Detached logging tensors: ``router_load`` ``[N]`` (fraction of tokens selecting each
        stream), ``route_weight_mean``, ``h_res_identity_distance`` (mean ‖H_res − I‖_F),
        ``h_res_mean`` ``[k, k]``."""
        return mapping_diagnostics(ctx.I, ctx.p, self.n, ctx.H_res)

    def effective_mixing(self, ctx: XHCContext) -> torch.Tensor:
        """The N×N mixing Ĥ this sublayer applied (identity on inactive streams).  ``[..., N, N]``."""
        H = ctx.H_res if ctx.H_res is not None else torch.eye(self.k, device=ctx.I.device).expand(
            *ctx.I.shape, self.k)
        return effective_mixing(ctx.I, H, self.n)

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"n={c.n}, k={c.k}, m={c.m}, K={self.K}, C={self.hidden_size}, is_mlp={self.is_mlp}, "
                f"router={c.router}, dense_read={c.dense_read}, layer_index={self.layer_index}")
