"""xHC-Flash and xHC-Flash-4sub: one routing decision and one full-state read per window (docs/math.md §4).

A *window* is a run of sublayers that share the routing (I, p) and whose pre-mappings are all
generated from the window-entry state X^(0), in one pass over the N·C state:

* **xHC-Flash** (§4.1): window = one layer (attention A, MLP M).  :class:`XHCFlashLayer`.
* **xHC-Flash-4sub** (§4.2): window = two layers (A1, M1, A2, M2).  :class:`Flash4Window`, split into
  :class:`Flash4FirstLayer` (Megatron layer 2g) and :class:`Flash4SecondLayer` (layer 2g+1).

Only the k active streams X_a (``[s, b, k, C]``) are carried between the sublayers; inactive
streams cannot change inside a window, so one scatter into X^(0) at the end gives the exit state.

Driving a window one sublayer at a time (every transition returns a **new** state object and never
mutates its input, so a sublayer can be recomputed, e.g. by activation checkpointing)::

    st = flash.begin(X0)                       # routing + both pre-maps + both base readouts
    y = attention(flash.attn_read(st));   st = flash.attn_write(st, y, seq)
    y = mlp(flash.mlp_read(st));          X1 = flash.mlp_write(st, y, seq)

    st = first.begin(X0)                       # Flash-4sub; layer 2g
    y = attn1(first.attn_read(st));   st = first.attn_write(st, y, seq)
    y = mlp1(first.mlp_read(st));     st = first.mlp_write(st, y, seq)   # hand st to layer 2g+1
    y = attn2(second.attn_read(st));  st = second.attn_write(st, y, seq)
    y = mlp2(second.mlp_read(st));    X2 = second.mlp_write(st, y, seq)  # the only scatter

Equations (shape legend of :mod:`xhc.xhc`; per token):

==============================  ==================================================================
:meth:`XHCFlashLayer.begin`     (I, p), h^A, h^M from X^(0);  inp_A = Σ_i h^A_i X^(0)_i, inp_M likewise
                                (base readouts: one :func:`~xhc.streams.read_streams` of T = 2 maps)
:func:`flash_mlp_input`         inp_MLP = inp_M + Σ_t β_t·V^A_t,  β_t = Σ_j h^M[I_j]·p_j·H_post^A[j,t]
                                (``triton``: made by the attention write's kernel, :mod:`xhc.kernels.flash_attn`)
:func:`nonactive_weights`       base_t = Σ_{i∉I} h^t_i · X^(0)_i = read_streams(h·[i∉I], X^(0))  (4sub, once)
:func:`flash4_read`             u_t = base_t + Σ_j h^t[I_j] · X_a[j]    (split read; read_streams on X_a;
                                ``triton``: in the pass of the write's mappings kernel, :mod:`xhc.kernels.xhc_active`)
:func:`carried_write`           attention / M1: X_a ← X_a + diag(p)·H_post·V (no H_res);
                                last MLP: X_a ← H_res·X_a + diag(p)·H_post·V;  then one scatter
                                (:func:`~xhc.streams.write_streams`, :func:`~xhc.streams.scatter_active`)
==============================  ==================================================================

Every read and write runs as :func:`xhc.kernels.read` / :func:`~xhc.kernels.write` on the resolved
backend (``eager``: the reference functions of :mod:`xhc.streams`; docs/kernels.md).

Every H_post (and the final H_res) is generated from the *current* carried X_a (docs/math.md §8 #24).
With K_A = 1 (attention, default) the correction is the documented scalar form β·y_A; with
``attn_temporal`` (K_A = r+1 components after attention) it is applied per component.

Parameters (names; shapes as in :mod:`xhc.xhc`, ``[out, in]`` layout, fp32):

* :class:`XHCFlashLayer`: ``router``, ``pre_A``, ``pre_M`` (``[N, N·C]`` each), ``post_A``
  (``[k·K_A, k·C]``), ``res_M`` (``[k², k·C]``), ``post_M`` (``[k·K_r, k·C]``), ``temporal_M``
  (and ``temporal_A`` with ``attn_temporal``).  Dominant count (3N² + k³ + k²(1+K_r) + Σκ)·C (§4.3).
* :class:`Flash4FirstLayer`: everything generated at window entry — ``router`` and the four
  pre-mappings ``pre_A1``, ``pre_M1``, ``pre_A2``, ``pre_M2`` — plus ``post_A1``, ``post_M1``,
  ``temporal_M1``.  :class:`Flash4SecondLayer`: ``post_A2``, ``res_M2``, ``post_M2``, ``temporal_M2``.
  The entry-time maps live in the first layer so that the window entry reads X^(0) once without
  reaching into the next layer's module.  Together: (5N² + k³ + 2k²(1+K_r) + 2Σκ)·C (§4.3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from xhc import kernels
from xhc.config import FLASH_FAMILY, HCConfig
from xhc.norms import fp32, moments_of_rows, rms_norm_flat
from xhc.router import StreamRouter
from xhc.xhc import (
    Components,
    PostMapping,
    ReadMapping,
    ResMapping,
    active_mappings,
    branch_components,
    check_xhc_config,
    entry_mappings,
    entry_statistics,
    fold_components,
    fused_write,
    fused_write_runs,
    make_temporal,
    mapping_diagnostics,
    num_components,
    resolve_fused,
    write_components,
)

# ================================================================================================
# Equations
# ================================================================================================


def flash_mlp_input(
    inp_M: torch.Tensor, h_M_active: torch.Tensor, p: torch.Tensor, H_post_A: torch.Tensor, V_A: torch.Tensor
) -> torch.Tensor:
    """inp_MLP = inp_M + Σ_t β_t · V^A_t,  β_t = Σ_j h^M[I_j] · p_j · H_post^A[j, t]  (docs/math.md §4.1).

    Exact replacement of a second dense read Σ_i h^M_i X^(A)_i when I, p, h^M are fixed at window
    entry, nothing mixes before the MLP read and attention writes only the active streams.
    ``inp_M``: ``[..., C]``;  ``h_M_active``, ``p``: ``[..., k]``;  ``H_post_A``: ``[..., k, K_A]``;
    ``V_A``: ``[..., K_A, C]``  ->  fp32 ``[..., C]``.
    """
    beta = torch.einsum("...j,...jt->...t", h_M_active * p, H_post_A)  # [..., K_A]
    return fp32(inp_M) + torch.einsum("...t,...tc->...c", beta, V_A)


@dataclass(frozen=True)
class WindowRun:
    """How a window runs its sublayers: the resolved kernel ``backend``, whether the coefficients take
    the ``fused`` path (:func:`~xhc.xhc.resolve_fused`) and the mapping norm's ``eps``."""

    backend: str
    fused: bool
    eps: float


@dataclass(frozen=True)
class WindowExit:
    """The window exit of the last write: scatter the new X_a into the entry state ``X0`` at rows ``I``."""

    X0: torch.Tensor  # [..., N, C] window-entry state, residual dtype
    I: torch.Tensor  # [..., k] long active streams


def nonactive_weights(h: torch.Tensor, I: torch.Tensor) -> torch.Tensor:
    """h with the active entries zeroed, h^t_i · [i ∉ I] ``[..., T, N]``: read by
    :func:`xhc.kernels.read`, base_t = Σ_{i∉I} h^t_i · X^(0)_i  (docs/math.md §4.2 split dense read)."""
    return h.scatter(-1, I.unsqueeze(-2).expand(*h.shape[:-1], I.shape[-1]), 0.0)


def fused_mappings_run(run: WindowRun, k: int, K: int, ablate_post: bool) -> bool:
    """Whether a window write's mappings run as one kernel (:func:`xhc.kernels.xhc_mappings`): the kernels
    room answers for the run's backend and fused choice, k, K and an ablated post mapping
    (:func:`xhc.kernels.xhc_mappings_fused`)."""
    return kernels.xhc_mappings_fused(run.backend, run.fused, k, K, ablate_post)


def window_mappings(Xa: torch.Tensor, p: torch.Tensor, post: PostMapping, res: Optional[ResMapping], run: WindowRun,
                    moments=None, read=None):
    """(H_res or None, H_post, P = diag(p)·H_post) of a window write from the *current* carried X_a
    (docs/math.md §8 #24): :func:`~xhc.xhc.active_mappings`, or one kernel where
    :func:`fused_mappings_run`; ``read`` (base, I, h, row, u dtype; that kernel only): also the
    sublayer's split read u from the same pass over X_a, returned fourth."""
    k, K = post.k, post.K
    if fused_mappings_run(run, k, K, post.weight is None):
        c = res.cfg if res is not None else None
        return kernels.xhc_mappings(
            Xa, p, *((res.weight, res.bias, res.alpha) if res is not None else (None, None, None)), post.weight,
            post.bias, post.alpha, K, run.eps, c.sinkhorn_iters if c else 0, c.sinkhorn_eps if c else 0.0,
            c.sinkhorn_order if c else "row_last", read)
    if read is not None:
        raise ValueError("window_mappings: a fused read needs the fused mappings kernel (fused_mappings_run)")
    H_res, H_post = active_mappings(Xa, [res, post], run.eps, run.fused, moments, run.backend)
    return H_res, H_post, p.unsqueeze(-1) * H_post


def carried_write(Xa: torch.Tensor, p: torch.Tensor, post: PostMapping, res: Optional[ResMapping],
                  comps: Components, run: WindowRun, exit: Optional[WindowExit] = None, moments=None, maps=None):
    """One window sublayer's write on the carried active streams (docs/math.md §4.1, §4.2 "Writes").

    H_post (and H_res when ``res`` is given) come from RMSNorm(vec X_a) of the *current* X_a
    (docs/math.md §8 #24), by :func:`~xhc.xhc.active_mappings`; X_a ← [H_res·]X_a + diag(p)·H_post·V
    by :func:`xhc.kernels.write` on ``run.backend`` (``eager``: :func:`xhc.streams.write_streams`).
    ``Xa``: ``[..., k, C]``;  ``comps``: the components (:func:`~xhc.xhc.branch_components`; their
    Gram–Schmidt coefficients, if any, are folded into the branch weights)  ->  (new X_a
    ``[..., k, C]`` in X_a's dtype, H_res or None, H_post).  With ``exit`` the new X_a is scattered
    into ``exit.X0`` (the window exit) and the first element is X' ``[..., N, C]`` in X0's dtype.
    ``moments``: (μ, ν) of vec(X_a) when already known; ``maps``: (H_res, H_post, P) when already made
    from this X_a (a Flash-4sub sublayer's fused read).
    """
    H_res, H_post, P = maps if maps is not None else window_mappings(Xa, p, post, res, run, moments)
    P = fold_components(P, comps.L)
    X0, I = (None, None) if exit is None else (exit.X0, exit.I)
    out_dtype = Xa.dtype if X0 is None else X0.dtype
    return kernels.write(X0, I, Xa, H_res, P, comps.V, out_dtype, backend=run.backend), H_res, H_post


def carried_write_fused(Xa: torch.Tensor, p: torch.Tensor, post: PostMapping, res: Optional[ResMapping],
                        y: torch.Tensor, temporal: nn.Module, cfg: HCConfig, seq, run: WindowRun,
                        exit: Optional[WindowExit] = None, moments=None, maps=None):
    """:func:`carried_write` with the branch output ``y`` itself: its temporal components, their
    Gram–Schmidt coefficients and the write in one kernel (:func:`~xhc.xhc.fused_write`, where
    :func:`~xhc.xhc.fused_write_runs`); same results and return values."""
    H_res, H_post, P = maps if maps is not None else window_mappings(Xa, p, post, res, run, moments)
    X0, I = (None, None) if exit is None else (exit.X0, exit.I)
    return fused_write(X0, I, Xa, H_res, P, y, temporal, cfg, seq), H_res, H_post


def unbind_readouts(R: torch.Tensor) -> Optional[tuple]:
    """The window's readouts ``R`` ``[..., T, C]`` (one read of X^(0) for all T sublayers) as T tensors,
    for autograd outside ``torch.compile``: their T gradients then come back as one stack instead of
    T zero-padded copies added up (T·C each).  None while ``torch.compile`` traces: inductor fuses the
    slices' gradients itself, and T separate outputs would make it read X^(0) once per output."""
    return None if torch.compiler.is_compiling() else R.unbind(-2)


def readout(R: torch.Tensor, parts: Optional[tuple], t: int) -> torch.Tensor:
    """Readout ``t`` of :func:`unbind_readouts` (or the slice of ``R`` when it gave None)."""
    return R[..., t, :] if parts is None else parts[t]


def _check_stage(state, expected, what: str) -> None:
    if state.stage != expected:
        raise RuntimeError(
            f"{what} called on a window state at stage {state.stage!r}, expected {expected!r}: drive the "
            "sublayers in order (begin, attn_read, attn_write, mlp_read, mlp_write)"
        )


# ================================================================================================
# xHC-Flash: one layer
# ================================================================================================
@dataclass
class FlashState:
    """State of one xHC-Flash window (plain tensors; transitions return new objects)."""

    X0: torch.Tensor  # [..., N, C] window-entry state, residual dtype
    I: torch.Tensor  # [..., k] long active streams (fixed first, routed ascending)
    p: torch.Tensor  # [..., k] fp32 route weights
    score: torch.Tensor  # [..., N] fp32 router scores (diagnostics)
    h_pre: torch.Tensor  # [..., 2, N] fp32: h^A, h^M from X^(0)
    inp: torch.Tensor  # [..., 2, C] fp32: base readouts inp_A, inp_M = Σ_i h_i X^(0)_i
    Xa: torch.Tensor  # [..., k, C] residual dtype: X^(0)[I] at entry, X_a^(A) after attn_write
    H_post_A: Optional[torch.Tensor] = None  # [..., k, K_A] fp32 (after attn_write)
    V_A: Optional[torch.Tensor] = None  # [..., K_A, C] fp32 attention components (after attn_write)
    stage: str = "entry"  # "entry" -> "attn_done"
    act_moments: Optional[tuple] = None  # (μ, ν) of vec(X_a) at entry (fused backends; from the entry pass)
    inps: Optional[tuple] = None  # inp as two tensors (unbind_readouts)
    u_M: Optional[torch.Tensor] = None  # [..., C] residual dtype: the MLP's input, made by the fused attention write


class _WindowPart(nn.Module):
    """Shared by the Flash window modules (:class:`XHCFlashLayer`, :class:`Flash4FirstLayer`,
    :class:`Flash4SecondLayer`): the common settings, how a window runs on the current device,
    the two-sublayer drive, the last mixing and the diagnostics.

    A part sets ``_res_name`` (the attribute of the window's last H_res mapping it owns, or None)
    and ``_mixing_stage`` (the state stage at which that mapping is next applied).
    """

    _res_name: Optional[str] = None
    _mixing_stage: Optional[str] = None

    def _setup(self, cfg: HCConfig, hidden_size: int, layer_index: int, fused: Optional[bool]) -> None:
        self.cfg, self.n, self.k, self.hidden_size = cfg, cfg.n, cfg.k, hidden_size
        self.layer_index, self.fused = layer_index, fused  # fused None: follow the resolved backend
        self.K_A, self.K_M = num_components(cfg, cfg.attn_temporal), num_components(cfg, True)

    def _run(self, X: torch.Tensor) -> WindowRun:
        """The resolved backend for tensors like ``X``, the fused choice that follows it, the norm ε."""
        backend = kernels.resolve_backend(self.cfg, X.device)
        return WindowRun(backend, resolve_fused(self.fused, backend), self.cfg.norm_eps)

    def _components(self, y: torch.Tensor, temporal: Optional[nn.Module], seq, backend: str) -> Components:
        return branch_components(y, temporal, self.cfg, seq, backend)

    def _fused_entry(self, run: WindowRun, pres) -> bool:
        """Whether the window entry runs as one kernel (:func:`xhc.kernels.xhc_window_read`; the kernels room
        answers, :func:`xhc.kernels.window_entry_fused`)."""
        return kernels.window_entry_fused(self.cfg, run.backend, run.fused, [pre.weight for pre in pres])

    def _entry_read(self, X0: torch.Tensor, run: WindowRun, pres, nonactive: bool):
        """(R ``[..., T, C]``, I, p, score, h ``[..., T, N]``, X_a) of the fused window entry."""
        return kernels.xhc_window_read(X0, self.router.weight, [(pre.weight, pre.bias, pre.alpha) for pre in pres],
                                       self.k, self.cfg.m, run.eps, nonactive)

    def _branch_write(self, Xa, p, post, res, y, temporal, seq, run: WindowRun, exit=None, moments=None, maps=None):
        """A carried write from the branch output ``y``: the fused write kernel where it runs
        (:func:`carried_write_fused`), else the components then :func:`carried_write`."""
        if fused_write_runs(temporal, Xa, y, seq, run.backend):
            return carried_write_fused(Xa, p, post, res, y, temporal, self.cfg, seq, run, exit, moments, maps)
        comps = self._components(y, temporal, seq, run.backend)
        return carried_write(Xa, p, post, res, comps, run, exit, moments, maps)

    def _two_sublayers(self, st, attn: Callable, mlp: Callable, seq=None):
        """attention then MLP on a window state: ``mlp_write(st', mlp(mlp_read(st')))``, st' = attn_write(…)."""
        st = self.attn_write(st, attn(self.attn_read(st)), seq)
        return self.mlp_write(st, mlp(self.mlp_read(st)), seq)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for mod in self.children():
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters()

    def hc_parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def mlp_mixing(self, state) -> Optional[torch.Tensor]:
        """The window's last H_res ``[..., k, k]`` from the state's carried X_a (diagnostics; the state
        must be at :attr:`_mixing_stage`), None when this part owns none or it is ablated."""
        res = getattr(self, self._res_name) if self._res_name is not None else None
        if res is None:
            return None
        return res(rms_norm_flat(state.Xa.flatten(-2), self.cfg.norm_eps))

    def diagnostics(self, state) -> dict:
        """Detached logging tensors (router load ``[N]``, route weight, H_res distance from I, …); the
        H_res entries need a state at :attr:`_mixing_stage`."""
        with torch.no_grad():
            H = self.mlp_mixing(state) if state.stage == self._mixing_stage else None
        return mapping_diagnostics(state.I, state.p, self.n, H)


class XHCFlashLayer(_WindowPart):
    """xHC-Flash window over one transformer layer (docs/math.md §4.1).

    Args:
        cfg: :class:`~xhc.config.HCConfig` with ``variant`` ``xhc_flash`` (or ``xhc_flash4``, whose
            odd last layer falls back to Flash, §4.3).
        hidden_size: C.
        layer_index: global 0-based *transformer layer* index i (sublayers ℓ = 2i, 2i+1); used only
            by ``read_init='one_hot'`` (hot stream ℓ mod N).
        fused: router and both pre-projections in one GEMM (:func:`~xhc.xhc.fused_entry_projections`);
            default (``None``): what the resolved backend runs (:func:`~xhc.xhc.resolve_fused`).
    """

    _res_name, _mixing_stage = "res_M", "attn_done"

    def __init__(self, cfg: HCConfig, hidden_size: int, layer_index: int = 0, fused: Optional[bool] = None):
        super().__init__()
        check_xhc_config(cfg, FLASH_FAMILY)
        self._setup(cfg, hidden_size, layer_index, fused)
        C, k = hidden_size, cfg.k
        read_init = "one_hot" if cfg.read_init == "one_hot" else "uniform"
        self.router = StreamRouter(cfg.n, C, k, cfg.m, cfg.router, cfg.norm_eps)
        self.pre_A = ReadMapping(cfg.n, C, cfg.gate_init, cfg.ablate_pre, read_init, 2 * layer_index, cfg.read_delta)
        self.pre_M = ReadMapping(cfg.n, C, cfg.gate_init, cfg.ablate_pre, read_init, 2 * layer_index + 1,
                                 cfg.read_delta)
        self.post_A = PostMapping(k, self.K_A, C, cfg.gate_init, cfg.ablate_post)
        self.temporal_A = make_temporal(cfg, C, cfg.attn_temporal)
        self.res_M = None if cfg.ablate_res else ResMapping(k, C, cfg)
        self.post_M = PostMapping(k, self.K_M, C, cfg.gate_init, cfg.ablate_post)
        self.temporal_M = make_temporal(cfg, C, True)

    # --------------------------------------------------------------------------------------------
    def begin(self, X0: torch.Tensor) -> FlashState:
        """Window entry: routing, h^A and h^M, both base readouts, gather (one pass over X^(0)).

        ``X0``: ``[s, b, N, C]`` (any leading dims)  ->  :class:`FlashState`.
        """
        run = self._run(X0)
        if self._fused_entry(run, [self.pre_A, self.pre_M]):
            inp, I, p, score, h, Xa = self._entry_read(X0, run, [self.pre_A, self.pre_M], False)
            return FlashState(X0, I, p, score, h, inp, Xa, inps=unbind_readouts(inp))
        stats, entry_mom = entry_statistics(X0, run.fused, run.backend)
        routing, (h_A, h_M) = entry_mappings(X0, self.router, [self.pre_A, self.pre_M], run.eps, run.fused,
                                              entry_mom, run.backend)
        h = torch.stack([h_A, h_M], -2)  # [..., 2, N]
        inp = kernels.read(h, X0, fp32(h).dtype, backend=run.backend)  # inp_t = Σ_i h^t_i X^(0)_i
        act = None if stats is None else moments_of_rows(*stats, X0.shape[-1], routing.I)
        return FlashState(X0, routing.I, routing.p, routing.score, h, inp,
                          kernels.gather(X0, routing.I, run.backend, after=routing.p), act_moments=act,
                          inps=unbind_readouts(inp))

    def attn_read(self, state: FlashState) -> torch.Tensor:
        """u_A = inp_A = Σ_i h^A_i X^(0)_i  ->  ``[..., C]`` in the residual dtype."""
        _check_stage(state, "entry", "XHCFlashLayer.attn_read")
        return readout(state.inp, state.inps, 0).to(state.X0.dtype)

    def attn_write(self, state: FlashState, y: torch.Tensor, seq=None) -> FlashState:
        """X_a^(A) = X_a^(0) + diag(p)·H_post^A·V_A, no residual mixing (docs/math.md §4.1 attention sublayer).

        V_A is orthogonalised on every backend: :meth:`mlp_read`'s correction reads it."""
        _check_stage(state, "entry", "XHCFlashLayer.attn_write")
        run = self._run(state.X0)
        if kernels.flash_attn_fused(run.backend):  # the write and the MLP read's correction
            # in one kernel (xhc.kernels.flash_attn); a single component is y itself, in its own dtype
            _, H_post, P = window_mappings(state.Xa, state.p, self.post_A, None, run, state.act_moments)
            V = y.unsqueeze(-2) if self.temporal_A is None else write_components(
                y, self.temporal_A, self.cfg.gram_schmidt, self.cfg.gs_eps, seq)
            Xa, u = kernels.flash_attn_write(state.Xa, P, V, readout(state.inp, state.inps, 1), state.I, state.h_pre,
                                             1, state.X0.dtype)
            return dataclasses.replace(state, Xa=Xa, H_post_A=H_post, u_M=u, stage="attn_done", act_moments=None)
        V = write_components(y, self.temporal_A, self.cfg.gram_schmidt, self.cfg.gs_eps, seq)
        Xa, _, H_post = carried_write(state.Xa, state.p, self.post_A, None, Components(V, None), run,
                                      moments=state.act_moments)
        return dataclasses.replace(state, Xa=Xa.to(state.X0.dtype), H_post_A=H_post, V_A=V, stage="attn_done",
                                   act_moments=None)

    def mlp_read(self, state: FlashState) -> torch.Tensor:
        """u_M = inp_M + β·y_A, the exact correction (docs/math.md §4.1)  ->  ``[..., C]`` residual dtype."""
        _check_stage(state, "attn_done", "XHCFlashLayer.mlp_read")
        if state.u_M is not None:  # made with the attention write (triton)
            return state.u_M
        h_M_active = state.h_pre[..., 1, :].gather(-1, state.I)
        u = flash_mlp_input(readout(state.inp, state.inps, 1), h_M_active, state.p, state.H_post_A, state.V_A)
        return u.to(state.X0.dtype)

    def mlp_write(self, state: FlashState, y: torch.Tensor, seq=None) -> torch.Tensor:
        """X_a^(M) = H_res^M·X_a^(A) + diag(p)·H_post^M·V, scattered into X^(0): X^(1) ``[..., N, C]``."""
        _check_stage(state, "attn_done", "XHCFlashLayer.mlp_write")
        run = self._run(state.X0)
        X1, _, _ = self._branch_write(state.Xa, state.p, self.post_M, self.res_M, y, self.temporal_M, seq, run,
                                      WindowExit(state.X0, state.I))
        return X1

    def forward(self, X0: torch.Tensor, attn: Callable, mlp: Callable, seq=None) -> torch.Tensor:
        """Convenience: the whole window with branch callables ``attn(u)``, ``mlp(u)`` -> X^(1)."""
        return self._two_sublayers(self.begin(X0), attn, mlp, seq)

    def extra_repr(self) -> str:
        c = self.cfg
        return f"n={c.n}, k={c.k}, m={c.m}, K_A={self.K_A}, K_M={self.K_M}, C={self.hidden_size}, layer_index={self.layer_index}"


# ================================================================================================
# xHC-Flash-4sub: two layers
# ================================================================================================
FLASH4_SUBLAYERS = ("A1", "M1", "A2", "M2")


@dataclass
class Flash4State:
    """State of one Flash-4sub window, carried from Megatron layer 2g to layer 2g+1.

    Plain tensors plus the sublayer counter ``step`` (0 = A1 next … 3 = M2 next); transitions
    return new objects and never mutate their input.
    """

    X0: torch.Tensor  # [..., N, C] window-entry state, residual dtype (the exit scatter target)
    I: torch.Tensor  # [..., k] long active streams
    p: torch.Tensor  # [..., k] fp32 route weights
    score: torch.Tensor  # [..., N] fp32 router scores (diagnostics)
    h_pre: torch.Tensor  # [..., 4, N] fp32: h^t for t = A1, M1, A2, M2, all from X^(0)
    h_active: Optional[torch.Tensor]  # [4, ..., k] fp32: h^t[I_j] (t first); None where the reads run fused
    base: torch.Tensor  # [..., 4, C] fp32: base_t = Σ_{i∉I} h^t_i X^(0)_i
    Xa: torch.Tensor  # [..., k, C] residual dtype: carried active streams
    bases: Optional[tuple] = None  # base as four tensors (unbind_readouts)
    step: int = 0
    backend: str = "eager"  # resolved kernel backend (xhc.kernels.resolve_backend)
    act_moments: Optional[tuple] = None  # (μ, ν) of vec(X_a) while X_a = X^(0)[I] (fused backends)
    # sublayer t -> (X_a, (H_res, H_post, P)): the write's mappings, made by t's fused read from the same X_a
    # (filled by the read, taken by the write; a recomputed read overwrites its entry)
    read_maps: dict = dataclasses.field(default_factory=dict)

    @property
    def stage(self) -> str:
        return FLASH4_SUBLAYERS[self.step] if self.step < 4 else "done"


def active_read_weights(h: torch.Tensor, I: torch.Tensor) -> torch.Tensor:
    """h^t[I_j] for every sublayer t as ``[T, ..., k]`` (t first, so that each sublayer's split read gets
    contiguous weights: one copy here instead of one per read) from h ``[..., T, N]``, I ``[..., k]``."""
    return h.gather(-1, I.unsqueeze(-2).expand(*h.shape[:-1], I.shape[-1])).movedim(-2, 0).contiguous()


def flash4_read(state: Flash4State, t: int) -> torch.Tensor:
    """u_t of sublayer ``t`` (0..3) by the split read u_t = base_t + Σ_j h^t[I_j] · X_a[j]
    (docs/math.md §4.2)  ->  ``[..., C]`` residual dtype."""
    if state.step != t:
        raise RuntimeError(
            f"Flash-4sub read of sublayer {FLASH4_SUBLAYERS[t]} on a state at stage {state.stage!r}: "
            "drive A1, M1 (layer 2g), A2, M2 (layer 2g+1) in order, read before write"
        )
    h_a = state.h_active[t] if state.h_active is not None else active_read_weights(state.h_pre, state.I)[t]
    u = readout(state.base, state.bases, t) + kernels.read(h_a, state.Xa, fp32(h_a).dtype, backend=state.backend)
    return u.to(state.X0.dtype)


class _Flash4Part(_WindowPart):
    """A Flash-4sub half: the in-order read and write of sublayer t (0..3) on the carried state."""

    def _fused_reads(self, run: WindowRun) -> bool:
        """Whether every sublayer's read runs in its write's mappings kernel (:func:`fused_mappings_run`)."""
        return fused_mappings_run(run, self.k, max(self.K_A, self.K_M), self.cfg.ablate_post)

    def _read(self, state: Flash4State, t: int, post: PostMapping, res: Optional[ResMapping]) -> torch.Tensor:
        """u_t (:func:`flash4_read`); where the reads run fused, together with sublayer t's write mappings
        from the same pass over X_a (:func:`window_mappings` with ``read``), which the state keeps for the write."""
        if state.h_active is not None or state.step != t:
            return flash4_read(state, t)
        run = self._run(state.X0)
        H_res, H_post, P, u = window_mappings(state.Xa, state.p, post, res, run, read=(
            readout(state.base, state.bases, t), state.I, state.h_pre, t, state.X0.dtype))
        state.read_maps[t] = (state.Xa, (H_res, H_post, P))
        return u

    def _write(self, state: Flash4State, t: int, y, post, temporal, res, seq, last: bool = False):
        """Sublayer ``t``'s write; ``last`` (M2): the window exit X' ``[..., N, C]`` instead of a state."""
        if state.step != t:
            raise RuntimeError(
                f"Flash-4sub write of sublayer {FLASH4_SUBLAYERS[t]} on a state at stage {state.stage!r}: "
                "drive A1, M1 (layer 2g), A2, M2 (layer 2g+1) in order"
            )
        run = self._run(state.X0)
        mom = state.act_moments  # X_a is still X^(0)[I] only before the first write
        made = state.read_maps.get(t)  # the mappings the fused read made from this X_a
        maps = made[1] if made is not None and made[0] is state.Xa else None
        if last:
            X, _, _ = self._branch_write(state.Xa, state.p, post, res, y, temporal, seq, run,
                                         WindowExit(state.X0, state.I), mom, maps)
            return X
        Xa, _, _ = self._branch_write(state.Xa, state.p, post, res, y, temporal, seq, run, moments=mom, maps=maps)
        return dataclasses.replace(state, Xa=Xa.to(state.X0.dtype), step=t + 1, act_moments=None, read_maps={})


class Flash4FirstLayer(_Flash4Part):
    """Flash-4sub parameters and sublayers A1, M1 of a window (Megatron layer 2g; docs/math.md §4.2).

    Owns what the window entry generates (router, four pre-mappings) plus H_post^{A1}, H_post^{M1}
    and M1's temporal convs.  ``layer_index``: the global index 2g of this layer.
    """

    def __init__(self, cfg: HCConfig, hidden_size: int, layer_index: int = 0, fused: Optional[bool] = None):
        super().__init__()
        check_xhc_config(cfg, ("xhc_flash4",))
        self._setup(cfg, hidden_size, layer_index, fused)
        C, k = hidden_size, cfg.k
        read_init = "one_hot" if cfg.read_init == "one_hot" else "uniform"
        self.router = StreamRouter(cfg.n, C, k, cfg.m, cfg.router, cfg.norm_eps)
        for t, name in enumerate(FLASH4_SUBLAYERS):  # sublayer ℓ = 2·layer_index + t
            setattr(self, f"pre_{name}", ReadMapping(cfg.n, C, cfg.gate_init, cfg.ablate_pre, read_init,
                                                     2 * layer_index + t, cfg.read_delta))
        self.post_A1 = PostMapping(k, self.K_A, C, cfg.gate_init, cfg.ablate_post)
        self.temporal_A1 = make_temporal(cfg, C, cfg.attn_temporal)
        self.post_M1 = PostMapping(k, self.K_M, C, cfg.gate_init, cfg.ablate_post)
        self.temporal_M1 = make_temporal(cfg, C, True)

    def begin(self, X0: torch.Tensor) -> Flash4State:
        """Window entry: routing, four pre-mappings, four non-active bases (one pass over X^(0))."""
        pres = [getattr(self, f"pre_{name}") for name in FLASH4_SUBLAYERS]
        run = self._run(X0)
        if self._fused_entry(run, pres):
            base, I, p, score, h, Xa = self._entry_read(X0, run, pres, True)
            h_active = None if self._fused_reads(run) else active_read_weights(h, I)
            return Flash4State(X0, I, p, score, h, h_active, base, Xa, bases=unbind_readouts(base),
                               backend=run.backend)
        stats, entry_mom = entry_statistics(X0, run.fused, run.backend)
        routing, hs = entry_mappings(X0, self.router, pres, run.eps, run.fused, entry_mom, run.backend)
        h = torch.stack(hs, -2)  # [..., 4, N]
        I = routing.I
        h_active = active_read_weights(h, I)
        # base_t = Σ_{i∉I} h^t_i X^(0)_i: one read with the active weights zeroed
        base = kernels.read(nonactive_weights(h, I), X0, fp32(h).dtype, backend=run.backend)
        act = None if stats is None else moments_of_rows(*stats, X0.shape[-1], I)
        return Flash4State(X0, I, routing.p, routing.score, h, h_active, base,
                           kernels.gather(X0, I, run.backend, after=routing.p), bases=unbind_readouts(base),
                           backend=run.backend, act_moments=act)

    def attn_read(self, state: Flash4State) -> torch.Tensor:
        return self._read(state, 0, self.post_A1, None)

    def attn_write(self, state: Flash4State, y: torch.Tensor, seq=None) -> Flash4State:
        """A1: X_a ← X_a + diag(p)·H_post^{A1}·V."""
        return self._write(state, 0, y, self.post_A1, self.temporal_A1, None, seq)

    def mlp_read(self, state: Flash4State) -> torch.Tensor:
        return self._read(state, 1, self.post_M1, None)

    def mlp_write(self, state: Flash4State, y: torch.Tensor, seq=None) -> Flash4State:
        """M1: X_a ← X_a + diag(p)·H_post^{M1}·V (no H_res); returns the state for layer 2g+1."""
        return self._write(state, 1, y, self.post_M1, self.temporal_M1, None, seq)

    def forward(self, X0: torch.Tensor, attn: Callable, mlp: Callable, seq=None) -> Flash4State:
        """Convenience: begin, A1, M1 -> the state to hand to layer 2g+1."""
        return self._two_sublayers(self.begin(X0), attn, mlp, seq)


class Flash4SecondLayer(_Flash4Part):
    """Flash-4sub sublayers A2, M2 of a window (Megatron layer 2g+1; docs/math.md §4.2).

    Owns H_post^{A2}, H_res^{M2}, H_post^{M2} and M2's temporal convs; M2 mixes once and scatters
    the carried active streams into X^(0).  ``layer_index``: the global index 2g+1 of this layer.
    """

    _res_name, _mixing_stage = "res_M2", "M2"

    def __init__(self, cfg: HCConfig, hidden_size: int, layer_index: int = 1):
        super().__init__()
        check_xhc_config(cfg, ("xhc_flash4",))
        self._setup(cfg, hidden_size, layer_index, None)
        C, k = hidden_size, cfg.k
        self.post_A2 = PostMapping(k, self.K_A, C, cfg.gate_init, cfg.ablate_post)
        self.temporal_A2 = make_temporal(cfg, C, cfg.attn_temporal)
        self.res_M2 = None if cfg.ablate_res else ResMapping(k, C, cfg)
        self.post_M2 = PostMapping(k, self.K_M, C, cfg.gate_init, cfg.ablate_post)
        self.temporal_M2 = make_temporal(cfg, C, True)

    def attn_read(self, state: Flash4State) -> torch.Tensor:
        return self._read(state, 2, self.post_A2, None)

    def attn_write(self, state: Flash4State, y: torch.Tensor, seq=None) -> Flash4State:
        """A2: X_a ← X_a + diag(p)·H_post^{A2}·V."""
        return self._write(state, 2, y, self.post_A2, self.temporal_A2, None, seq)

    def mlp_read(self, state: Flash4State) -> torch.Tensor:
        return self._read(state, 3, self.post_M2, self.res_M2)

    def mlp_write(self, state: Flash4State, y: torch.Tensor, seq=None) -> torch.Tensor:
        """M2: X_a ← H_res^{M2}·X_a + diag(p)·H_post^{M2}·V, then the window's only scatter -> X ``[..., N, C]``."""
        return self._write(state, 3, y, self.post_M2, self.temporal_M2, self.res_M2, seq, last=True)

    def forward(self, state: Flash4State, attn: Callable, mlp: Callable, seq=None) -> torch.Tensor:
        """Convenience: A2, M2 on the state from layer 2g -> the window's exit state."""
        return self._two_sublayers(state, attn, mlp, seq)


class Flash4Window(_WindowPart):
    """Both halves of a Flash-4sub window, for single-module use and tests (docs/math.md §4.2).

    ``first`` belongs to Megatron layer 2g, ``second`` to layer 2g+1; a Megatron integration
    gives each layer its half and carries the :class:`Flash4State` between the two layer calls.
    """

    def __init__(self, cfg: HCConfig, hidden_size: int, layer_index: int = 0, fused: Optional[bool] = None):
        super().__init__()
        self.first = Flash4FirstLayer(cfg, hidden_size, layer_index, fused)
        self.second = Flash4SecondLayer(cfg, hidden_size, layer_index + 1)

    def forward(self, X0: torch.Tensor, branches: Sequence[Callable], seq=None) -> torch.Tensor:
        """The whole window with branch callables for A1, M1, A2, M2 -> exit state ``[..., N, C]``."""
        a1, m1, a2, m2 = branches
        return self.second(self.first(X0, a1, m1, seq), a2, m2, seq)
