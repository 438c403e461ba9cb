"""Temporal feature augmentation of xHC MLP/MoE sublayers (docs/math.md §3.2, §3.6; §8 #18, #22, #23).

After an MLP/MoE sublayer, xHC writes K_r = r + 1 components per token instead of y alone:

    g_j[t, c] = Σ_{i=0}^{κ_j−1} w_j[i, c] · y[t−i, c]            j = 1..r   (causal depthwise conv)
    V[t]      = [y[t], g_1[t], …, g_r[t]]                          ∈ R^{K_r × C}

where y[t'] = 0 for t' < 0 and for t' in an earlier document of a packed sequence.

Layout is Megatron's: ``y`` is ``[s, b, C]`` (sequence first), ``V`` is ``[s, b, K_r, C]``.
All maths runs in fp32 (float64 stays float64 for reference tests and gradcheck).

What this file provides
=======================

=========================================  ==========================================================
:func:`causal_dwconv`                      the equation for one kernel (with halo rows and resets)
:func:`temporal_conv`                      all r kernels at once (one grouped conv), ``[s,b,r,C]``
:class:`TemporalAugmentation`              the module: parameters, ``forward(y, seq) -> V``, decode
:class:`SequenceContext`                   where the local rows sit (SP / CP / THD layouts, resets)
``pos_in_doc_from_*``                      document positions from what Megatron passes
:func:`sp_segments`, :func:`cp_segments`,  global row ranges held by one rank, for
:func:`thd_cp_segments`                    :attr:`SequenceContext.segments`
=========================================  ==========================================================

Documents (docs/math.md §3.6 "Packed documents")
----------------------------------------
``pos_in_doc[t, b]`` is the index of token t inside its document (0 at a document start).  Tap i at
position t is used only if ``pos_in_doc[t] ≥ i``.  The rule reads the *receiving* token's position
only, so it covers the halo rows received from other ranks without shipping their positions: a
halo row at distance i is used exactly when the local token is at least i tokens into its document.

Sequence / context parallelism (docs/math.md §3.6 "SP", "CP", "General rule")
--------------------------------------------------------------------
Every layout gives, at every global position, exactly the single-rank result (forward and
gradients).  The convolution takes its halo rows as tensors (:func:`temporal_conv`) and gets them
from ``SequenceContext.exchange`` (:data:`HaloExchange`); this package never communicates: the
exchange over process groups below lives in :mod:`models.sequence`.  With H = κ_max − 1:

* **SP** (``SequenceContext.group`` set, ``segments`` None): rank t of the group holds the t-th
  consecutive slice.  One autograd function sends the last H rows to rank t+1 and receives H rows
  from rank t−1 (rank 0: zeros); backward sends the halo gradient back, where it is added to dy.
  Needs ≥ H local tokens per rank.
* **General** (``segments`` set; CP load-balanced, CP+SP, THD+CP): the local rows are a list of
  contiguous global ranges.  Every rank publishes, per segment, its last H rows (one small
  all-gather over the group); each segment's halo is assembled row by row from the tails that hold
  global positions start−H .. start−1; backward all-reduces the tail gradients so each owner gets
  its share.  Any segment length works (a short segment's halo simply comes from several tails).

Decoding (docs/math.md §3.6 "Decoding")
-------------------------------
:meth:`TemporalAugmentation.step` takes new rows plus a rolling cache of the previous H outputs
``[b, H, C]`` and returns V and the updated cache; token-by-token decoding equals the full forward.
Passing ``SequenceContext(decode_cache={})`` makes :meth:`forward` do the same, keyed by module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xhc.norms import fp32

CONV_DOC_RESET = ("auto", "always", "never")
DEFAULT_KERNEL_SIZES = (4, 8, 12)

Segments = Tuple[Tuple[int, int], ...]
"""Contiguous global row ranges ``(start, length)`` held by one rank, in local row order."""

HaloExchange = Callable[[Tensor, int, "SequenceContext"], List[Optional[Tensor]]]
"""``exchange(y, H, seq) -> halos``: for local rows ``y`` ``[s, b, C]``, the H rows preceding each
local segment (``seq.segments``; one halo for the plain SP layout), ``[H, b, C]`` each or None for
zeros, differentiable (the halo gradient flows back to the ranks that own the rows).  This package
never communicates: the exchange over process groups is :data:`models.sequence.HALO_EXCHANGE`."""


# ----------------------------------------------------------------------------------------------
# Sequence context
# ----------------------------------------------------------------------------------------------
@dataclass
class SequenceContext:
    """Where this rank's local tokens sit in the global sequence (used only by the temporal conv).

    Build one per micro-batch and pass the same object to every sublayer (it caches the
    general-layout exchange plan in ``_plans``, for ``exchange``).
    """

    pos_in_doc: Optional[Tensor] = None
    """``[s, b]`` long: index of each local token inside its document (0 at a document start);
    None = no document resets.  See the ``pos_in_doc_from_*`` helpers."""
    group: Optional[object] = None
    """Ranks holding pieces of the same sequences (an opaque handle, e.g. a process group, that only
    ``exchange`` reads).  With ``segments=None``: ranks holding consecutive slices in group-rank
    order (SP: the TP group).  With ``segments``: every rank that holds any piece (CP: the CP group;
    CP+SP: the TP×CP group).  None = this rank holds all."""
    segments: Optional[Segments] = None
    """Global ``(start, length)`` ranges of the local rows, in local order (see :func:`cp_segments`,
    :func:`thd_cp_segments`); None = the plain SP layout.  Needs ``group``."""
    decode_cache: Optional[dict] = None
    """Decoding: a dict ``{module: [b, H, C] cache}`` the modules read and update; ``{}`` starts a
    sequence.  Incompatible with ``group``."""
    exchange: Optional[HaloExchange] = None
    """The halo exchange for ``group`` (:data:`HaloExchange`; needed whenever ``group`` is set):
    :data:`models.sequence.HALO_EXCHANGE` over torch.distributed, built by
    :func:`models.sequence.distributed_sequence_context` and
    :func:`models.sequence.sequence_context_from_megatron`."""
    _plans: Dict[int, Tuple[int, Tensor]] = field(default_factory=dict, init=False, repr=False, compare=False)


# ----------------------------------------------------------------------------------------------
# Document positions from what Megatron passes
# ----------------------------------------------------------------------------------------------
def pos_in_doc_from_position_ids(position_ids: Tensor, sp_rank: int = 0, sp_size: int = 1) -> Tensor:
    """``pos_in_doc`` from Megatron position ids built with ``reset_position_ids=True``.

    Megatron's GPTDataset restarts position ids at 0 after every EOD token, so they *are* the
    positions inside the documents; only the layout differs (``[b, s]`` there, ``[s, b]`` here).

    Args:
        position_ids: ``[b, S]`` integer position ids (after any CP split, before the SP split).
        sp_rank, sp_size: return only rows ``[sp_rank·S/sp_size, (sp_rank+1)·S/sp_size)``.

    Returns:
        ``[S / sp_size, b]`` long.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}: expected Megatron's [b, s]")
    return _sp_slice(position_ids.t().long(), sp_rank, sp_size, "position_ids").contiguous()


def pos_in_doc_from_eod(tokens: Tensor, eod_token: int, sp_rank: int = 0, sp_size: int = 1) -> Tensor:
    """``pos_in_doc`` from token ids: a new document starts after every EOD token.

    Same boundaries as Megatron's ``reset_attention_mask=True`` (the EOD token ends its document);
    use it when attention is reset but position ids are not.

    Args:
        tokens: ``[b, S]`` token ids.
        eod_token: id of the end-of-document token.

    Returns:
        ``[S / sp_size, b]`` long.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}: expected Megatron's [b, s]")
    b, S = tokens.shape
    t = torch.arange(S, device=tokens.device).expand(b, S)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eod_token
    last_start = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values
    return _sp_slice((t - last_start).t(), sp_rank, sp_size, "tokens").contiguous()


def pos_in_doc_from_cu_seqlens(cu_seqlens: Tensor, total_tokens: Optional[int] = None) -> Tensor:
    """``pos_in_doc`` for the packed THD format (Megatron ``PackedSeqParams.cu_seqlens_q``).

    Document d occupies rows ``[cu_seqlens[d], cu_seqlens[d+1])``; rows past the last boundary
    (padding up to ``total_tokens``) form one extra document.  Under CP pass
    ``cu_seqlens_q_padded`` and select the local rows with :func:`take_segments` and
    :func:`thd_cp_segments`.

    Args:
        cu_seqlens: ``[n_docs + 1]`` cumulative lengths starting at 0.
        total_tokens: number of packed rows T (default ``cu_seqlens[-1]``).

    Returns:
        ``[T, 1]`` long (THD activations are ``[T, 1, C]``).
    """
    cu = cu_seqlens.long().flatten()
    if cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens={cu.tolist()}: must start at 0 and be non-decreasing")
    T = int(cu[-1]) if total_tokens is None else int(total_tokens)
    if T < int(cu[-1]):
        raise ValueError(f"total_tokens={T} is smaller than cu_seqlens[-1]={int(cu[-1])}")
    t = torch.arange(T, device=cu.device)
    doc = torch.searchsorted(cu, t, right=True) - 1  # last boundary ≤ t
    return (t - cu[doc])[:, None]


def _sp_slice(x: Tensor, rank: int, size: int, name: str) -> Tensor:
    if size == 1:
        return x
    if x.shape[0] % size != 0 or not 0 <= rank < size:
        raise ValueError(f"{name}: {x.shape[0]} rows cannot be split over sp_size={size} (rank {rank})")
    n = x.shape[0] // size
    return x[rank * n : (rank + 1) * n]


# ----------------------------------------------------------------------------------------------
# Layouts: which global rows a rank holds
# ----------------------------------------------------------------------------------------------
def _merge(segs: List[Tuple[int, int]]) -> Segments:
    out: List[Tuple[int, int]] = []
    for start, length in segs:
        if length <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return tuple(out)


def sp_segments(seq_len: int, sp_size: int, sp_rank: int) -> Segments:
    """Plain SP: rank t holds rows ``[t·S/sp, (t+1)·S/sp)``."""
    if seq_len % sp_size != 0:
        raise ValueError(f"seq_len={seq_len} is not divisible by sp_size={sp_size}")
    n = seq_len // sp_size
    return ((sp_rank * n, n),)


def cp_segments(seq_len: int, cp_size: int, cp_rank: int, sp_size: int = 1, sp_rank: int = 0) -> Segments:
    """Megatron's load-balanced CP layout, optionally followed by an SP split.

    The sequence of ``seq_len`` rows is cut into 2·cp chunks; CP rank r holds chunks r and
    2cp−1−r, concatenated (``get_batch_on_this_cp_rank``).  SP then gives TP rank q the q-th
    consecutive slice of that concatenation.
    """
    if seq_len % (2 * cp_size) != 0 or (seq_len // cp_size) % sp_size != 0:
        raise ValueError(
            f"seq_len={seq_len} must be divisible by 2*cp_size={2 * cp_size} and by cp_size*sp_size={cp_size * sp_size}"
        )
    ch = seq_len // (2 * cp_size)
    local = [(cp_rank * ch, ch), ((2 * cp_size - 1 - cp_rank) * ch, ch)]  # rows [0,ch) then [ch,2ch)
    m = 2 * ch // sp_size
    lo, hi = sp_rank * m, (sp_rank + 1) * m
    segs = []
    for k, (start, length) in enumerate(local):
        a, b = max(lo, k * ch), min(hi, (k + 1) * ch)
        if a < b:
            segs.append((start + a - k * ch, b - a))
    return _merge(segs)


def thd_cp_segments(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int) -> Segments:
    """CP layout of the packed THD format (Transformer Engine's ``thd_get_partitioned_indices``).

    Each sequence (padded length L, divisible by 2·cp) is cut into 2·cp chunks; CP rank r holds
    chunks r and 2cp−1−r of every sequence, sequence by sequence.
    """
    cu = [int(v) for v in cu_seqlens_padded.flatten().tolist()]
    segs = []
    for a, b in zip(cu[:-1], cu[1:]):
        L = b - a
        if L % (2 * cp_size) != 0:
            raise ValueError(f"cu_seqlens_padded: sequence length {L} is not divisible by 2*cp_size={2 * cp_size}")
        ch = L // (2 * cp_size)
        segs += [(a + cp_rank * ch, ch), (a + (2 * cp_size - 1 - cp_rank) * ch, ch)]
    return _merge(segs)


def take_segments(x: Tensor, segments: Segments, dim: int = 0) -> Tensor:
    """The local rows of a global tensor: ``x`` rows of each segment, concatenated along ``dim``."""
    return torch.cat([x.narrow(dim, start, length) for start, length in segments], dim)


# ----------------------------------------------------------------------------------------------
# The equation (docs/math.md §3.2)
# ----------------------------------------------------------------------------------------------
def _fit_halo(halo: Optional[Tensor], H: int, like: Tensor) -> Tensor:
    """``[H, b, C]``: the last H rows of ``halo``, zero-filled at the front when it is shorter."""
    s, b, C = like.shape
    if halo is None:
        return like.new_zeros(H, b, C)
    if halo.dim() != 3 or halo.shape[1:] != like.shape[1:]:
        raise ValueError(f"halo has shape {tuple(halo.shape)}: expected [h, {b}, {C}] rows preceding y")
    halo = halo.to(like.dtype)
    if halo.shape[0] >= H:
        return halo[halo.shape[0] - H :]
    return torch.cat([like.new_zeros(H - halo.shape[0], b, C), halo], 0)


def _stack_kernels(weights: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """``[r, κ_max, C]``: w_j zero-extended over taps i ≥ κ_j (no gradient reaches the padding)."""
    kmax = max(w.shape[0] for w in weights)
    return torch.stack([F.pad(w.to(dtype), (0, 0, 0, kmax - w.shape[0])) for w in weights])


def _segment_offsets(lengths: Sequence[int], H: int) -> List[int]:
    """Start of each segment's conv output (= its first row in xpad minus H): segments are laid
    out as [halo_1 (H rows), seg_1, halo_2, seg_2, …]."""
    offs = [0]
    for n in lengths[:-1]:
        offs.append(offs[-1] + H + n)
    return offs


def _temporal_conv(
    y: Tensor,
    weights: Sequence[Tensor],
    halos: Sequence[Optional[Tensor]],
    lengths: Sequence[int],
    pos_in_doc: Optional[Tensor],
) -> Tensor:
    """All kernels over local rows made of contiguous segments, each with its own halo.

    ``y``: ``[s, b, C]``; ``halos[k]``: rows preceding segment k (or None);
    ``lengths``: segment lengths (sum = s).  Returns ``G``: ``[s, b, r, C]``, fp32/f64.
    """
    s, b, C = y.shape
    y = fp32(y)
    r = len(weights)
    if r == 0:
        return y.new_zeros(s, b, 0, C)
    W = _stack_kernels(weights, y.dtype)  # [r, κmax, C], W[j, i, c] = w_j[i, c]
    kmax = W.shape[1]
    H = kmax - 1

    if len(lengths) == 1 and H > 0 and torch.compiler.is_compiling():
        # Compiled, one segment: the convolution as κ_max shifted multiply-adds, which the compiler
        # turns into one loop over y (and the halo) writing [y, g_1, …, g_r]'s g part, instead of
        # a padded copy, a layout copy and an external convolution.  Resets: tap i is kept where
        # pos_in_doc ≥ i.  Same sums as the grouped conv below, in another order.
        xpad = F.pad(y, (0, 0, 0, 0, H, 0)) if halos[0] is None else torch.cat([_fit_halo(halos[0], H, y), y], 0)
        G = None
        for i in range(kmax):
            term = W[:, i, :] * xpad[H - i : H - i + s][:, :, None, :]  # [s, b, r, C]
            if pos_in_doc is not None and i > 0:
                term = term * (pos_in_doc >= i).to(y.dtype)[:, :, None, None]
            G = term if G is None else G + term
        return G

    # Padded input: [halo_1, seg_1, halo_2, seg_2, ...], each halo exactly H rows.
    parts: List[Tensor] = []
    for halo, seg in zip(halos, y.split(list(lengths), 0)):
        parts += [_fit_halo(halo, H, seg), seg]
    xpad = torch.cat(parts, 0) if len(parts) > 2 or H > 0 else y  # [L, b, C]

    # One grouped conv for all kernels: out channel c·r + j sees input channel c.
    # conv1d is a cross-correlation, out[o] = Σ_k weight[k]·xpad[o + k], so weight[k] = w[κmax−1−k].
    weight = W.flip(1).permute(2, 0, 1).reshape(C * r, 1, kmax)
    out = F.conv1d(xpad.permute(1, 2, 0), weight, groups=C)  # [b, C·r, L − H]; out[o] ends at row o+H
    if len(lengths) > 1:
        offs = _segment_offsets(lengths, H)
        out = torch.cat([out[..., o : o + n] for o, n in zip(offs, lengths)], -1)
    G = out.view(b, C, r, s).permute(3, 0, 2, 1)  # [s, b, r, C]

    if pos_in_doc is not None and H > 0 and torch.compiler.is_compiling():
        # Same resets without data-dependent shapes (torch.compile, fullgraph): subtract every
        # dropped tap, G[t] −= Σ_{i > pos_in_doc[t]} w_i ⊙ y[t−i], as H masked dense passes.
        row = torch.cat([torch.arange(n, device=y.device) + (o + H) for o, n in
                         zip(_segment_offsets(lengths, H), lengths)])  # row of y[t] inside xpad
        for i in range(1, kmax):
            drop = (pos_in_doc < i).to(y.dtype)[:, :, None, None]  # [s, b, 1, 1]
            G = G - drop * (W[:, i, :] * xpad[row - i][:, :, None, :])
    elif pos_in_doc is not None and H > 0:
        # Document resets: only tokens with pos_in_doc < H have a tap to drop; recompute those
        # exactly (tap i kept iff pos_in_doc[t] ≥ i) and overwrite the conv output there.
        t_idx, b_idx = (pos_in_doc < H).nonzero(as_tuple=True)
        if t_idx.numel() > 0:
            seg_id = torch.repeat_interleave(
                torch.arange(len(lengths), device=y.device), torch.tensor(list(lengths), device=y.device)
            )
            row = torch.arange(s, device=y.device) + H * (seg_id + 1)  # row of y[t] inside xpad
            taps = torch.arange(kmax, device=y.device)
            win = xpad[row[t_idx][:, None] - taps, b_idx[:, None]]  # [n, κmax, C]; column i = y[t−i]
            keep = (pos_in_doc[t_idx, b_idx][:, None] >= taps).to(y.dtype)  # [n, κmax]
            g = torch.einsum("nic,jic->njc", win * keep[..., None], W)  # [n, r, C]
            G = G.index_put((t_idx, b_idx), g)
    return G


def temporal_conv(
    y: Tensor,
    weights: Sequence[Tensor],
    halo: Optional[Tensor] = None,
    pos_in_doc: Optional[Tensor] = None,
) -> Tensor:
    """``G[:, :, j] = causal_dwconv(y, weights[j], halo, pos_in_doc)`` for all j in one grouped conv.

    Returns ``[s, b, r, C]`` in fp32 (float64 stays float64).
    """
    return _temporal_conv(y, weights, [halo], [y.shape[0]], pos_in_doc)


def causal_dwconv(
    y: Tensor,
    w: Tensor,
    halo: Optional[Tensor] = None,
    pos_in_doc: Optional[Tensor] = None,
) -> Tensor:
    """g[t, c] = Σ_{i=0}^{κ−1} w[i, c] · y[t−i, c]   (docs/math.md §3.2, one kernel).

    Args:
        y: ``[s, b, C]`` branch output (any float dtype).
        w: ``[κ, C]``; ``w[i, c]`` multiplies ``y[t−i, c]``.
        halo: ``[h, b, C]`` rows immediately before ``y[0]`` (another rank's tail, or a decode
            cache); its last κ−1 rows are used, missing rows are zeros.  None = all zeros.
        pos_in_doc: ``[s, b]``; tap i at position t is used only if ``pos_in_doc[t] ≥ i``.

    Returns:
        ``[s, b, C]`` in fp32 (float64 stays float64).
    """
    return temporal_conv(y, [w], halo, pos_in_doc)[:, :, 0]


# ----------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------
class TemporalAugmentation(nn.Module):
    """V = [y, g_1, …, g_r] for one MLP/MoE sublayer (docs/math.md §3.2, §3.6).

    Parameters ``conv[j]``: ``[κ_j, C]`` fp32, ``w_j[i, c]`` multiplies ``y[t−i, c]``, no bias,
    initialised like PyTorch's depthwise Conv1d: uniform ±1/√κ_j (docs/math.md §8 #18).

    Args:
        hidden_size: C.
        kernel_sizes: κ_1..κ_r (each ≥ 1); ``()`` gives V = [y].
        conv_doc_reset: ``"auto"`` resets at document starts whenever ``seq.pos_in_doc`` is given
            (the caller gives it exactly when attention is reset); ``"never"`` ignores it;
            ``"always"`` requires it.
    """

    def __init__(
        self,
        hidden_size: int,
        kernel_sizes: Sequence[int] = DEFAULT_KERNEL_SIZES,
        conv_doc_reset: str = "auto",
    ):
        super().__init__()
        kernel_sizes = tuple(int(k) for k in kernel_sizes)
        if hidden_size < 1:
            raise ValueError(f"TemporalAugmentation hidden_size={hidden_size}: must be >= 1")
        if any(k < 1 for k in kernel_sizes):
            raise ValueError(f"TemporalAugmentation kernel_sizes={kernel_sizes}: every kernel size must be >= 1")
        if conv_doc_reset not in CONV_DOC_RESET:
            raise ValueError(
                f"TemporalAugmentation conv_doc_reset={conv_doc_reset!r}: "
                f"allowed values are {', '.join(CONV_DOC_RESET)}"
            )
        self.hidden_size = hidden_size
        self.kernel_sizes = kernel_sizes
        self.conv_doc_reset = conv_doc_reset
        self.conv = nn.ParameterList([nn.Parameter(torch.empty(k, hidden_size)) for k in kernel_sizes])
        self.reset_parameters()

    @property
    def num_components(self) -> int:
        """K_r = r + 1."""
        return len(self.kernel_sizes) + 1

    @property
    def halo_size(self) -> int:
        """H = κ_max − 1 rows of history needed per position (0 without kernels)."""
        return max(self.kernel_sizes, default=1) - 1

    def reset_parameters(self) -> None:
        """PyTorch's depthwise Conv1d default: kaiming_uniform(a=√5) with fan_in = κ, i.e. U(±1/√κ)."""
        with torch.no_grad():
            for w in self.conv:
                bound = 1.0 / math.sqrt(w.shape[0])
                w.uniform_(-bound, bound)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, kernel_sizes={self.kernel_sizes}, "
            f"conv_doc_reset={self.conv_doc_reset!r}"
        )

    # -- helpers ---------------------------------------------------------------------------
    def _check(self, y: Tensor) -> None:
        if y.dim() != 3 or y.shape[-1] != self.hidden_size:
            raise ValueError(
                f"TemporalAugmentation input has shape {tuple(y.shape)}: expected [s, b, {self.hidden_size}]"
            )

    def _doc_positions(self, pos_in_doc: Optional[Tensor], y: Tensor) -> Optional[Tensor]:
        if self.conv_doc_reset == "never":
            return None
        if pos_in_doc is None:
            if self.conv_doc_reset == "always":
                raise ValueError(
                    "TemporalAugmentation conv_doc_reset='always' needs SequenceContext.pos_in_doc "
                    "([s, b] positions inside each document; see pos_in_doc_from_position_ids / "
                    "pos_in_doc_from_cu_seqlens), or set conv_doc_reset='auto'"
                )
            return None
        if tuple(pos_in_doc.shape) != tuple(y.shape[:2]):
            raise ValueError(
                f"SequenceContext.pos_in_doc has shape {tuple(pos_in_doc.shape)}: expected [s, b] = "
                f"{tuple(y.shape[:2])} (Megatron position_ids are [b, s]: transpose them)"
            )
        return pos_in_doc

    def _components(self, y, halos, lengths, pos) -> Tensor:
        G = _temporal_conv(y, list(self.conv), halos, lengths, pos)
        return torch.cat([fp32(y)[:, :, None, :], G], 2)

    # -- training / prefill ----------------------------------------------------------------
    def forward(self, y: Tensor, seq: Optional[SequenceContext] = None) -> Tensor:
        """``y``: ``[s, b, C]`` -> ``V``: ``[s, b, 1 + r, C]`` = [y, g_1, …, g_r], fp32 (f64 stays)."""
        self._check(y)
        pos = self._doc_positions(seq.pos_in_doc if seq is not None else None, y)
        H, s = self.halo_size, y.shape[0]
        if seq is not None and seq.decode_cache is not None:
            if seq.group is not None:
                raise ValueError("SequenceContext.decode_cache cannot be combined with SequenceContext.group")
            V, seq.decode_cache[self] = self._step(y, seq.decode_cache.get(self), pos)
            return V
        if seq is None or seq.group is None:
            if seq is not None and seq.segments is not None:
                raise ValueError(
                    "SequenceContext.segments needs SequenceContext.group (the ranks holding the other rows)"
                )
            return self._components(y, [None], [s], pos)
        if seq.segments is not None:
            total = sum(n for _, n in seq.segments)
            if total != s or any(n < 1 for _, n in seq.segments):
                raise ValueError(
                    f"SequenceContext.segments={seq.segments} cover {total} rows but y has {s}; "
                    "lengths must be >= 1 and sum to the local sequence length"
                )
        lengths = [s] if seq.segments is None else [n for _, n in seq.segments]
        if H == 0:
            return self._components(y, [None] * len(lengths), lengths, pos)
        if seq.exchange is None:
            raise ValueError(
                "SequenceContext.group needs SequenceContext.exchange, the halo exchange between the ranks "
                "(build the context with models.sequence.distributed_sequence_context(...))"
            )
        return self._components(y, seq.exchange(y, H, seq), lengths, pos)

    def component_list(self, y: Tensor, seq: Optional[SequenceContext] = None) -> List[Tensor]:
        """The components of :meth:`forward` as a list ``[y, g_1, …, g_r]`` of fp32 ``[s, b, C]``.

        While ``torch.compile`` traces a sequence held whole by this rank (no halo: no sequence
        group, no segments, no decode cache) each g_j is its own sum of κ_j shifted slices of the
        zero-padded y, Σ_i w_j[i] ⊙ y[t − i] (tap i dropped where pos_in_doc < i), and no stacked
        [s, b, 1 + r, C] buffer is made: the compiler computes every g_j and the Gram matrix in
        one pass over y, and the write reads them where it needs them (docs/kernels.md).
        Otherwise the slices of :meth:`forward`.  Same sums as the compiled form of :meth:`forward`.
        """
        whole = seq is None or (seq.group is None and seq.segments is None and seq.decode_cache is None)
        if not (whole and torch.compiler.is_compiling()):
            return list(self.forward(y, seq).unbind(-2))
        self._check(y)
        pos = self._doc_positions(seq.pos_in_doc if seq is not None else None, y)
        yf = fp32(y)
        s, H = yf.shape[0], self.halo_size
        xpad = F.pad(yf, (0, 0, 0, 0, H, 0))  # [H zero rows, y]: row t − i of y is row H + t − i
        out = [yf]
        for w in self.conv:
            wf = w.to(yf.dtype)
            g = None
            for i in range(w.shape[0]):
                term = wf[i] * xpad[H - i : H - i + s]
                if pos is not None and i > 0:
                    term = term * (pos >= i).to(yf.dtype)[:, :, None]
                g = term if g is None else g + term
            out.append(g)
        return out

    # -- decoding --------------------------------------------------------------------------
    def init_cache(self, batch_size: int, dtype=torch.float32, device=None) -> Tensor:
        """An empty rolling cache ``[b, H, C]`` (zeros = nothing before the first token)."""
        return torch.zeros(batch_size, self.halo_size, self.hidden_size, dtype=dtype, device=device)

    @staticmethod
    def clear_cache(cache: Tensor, new_document: Tensor) -> Tensor:
        """Zero the cache of the batch elements that start a new document (``new_document``: [b] bool)."""
        return cache.masked_fill(new_document.view(-1, 1, 1), 0)

    def step(
        self, y: Tensor, cache: Optional[Tensor] = None, pos_in_doc: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        """Decode one token or a chunk given the previous outputs.

        Args:
            y: ``[s_new, b, C]`` new branch outputs.
            cache: ``[b, H, C]`` the H outputs before ``y`` (None = start of a sequence).
            pos_in_doc: ``[s_new, b]`` (optional, same rule as :meth:`forward`; with it the cache
                need not be cleared at a document start).

        Returns:
            ``(V [s_new, b, 1 + r, C], new cache [b, H, C])`` (the cache is detached, in y's dtype).
        """
        self._check(y)
        return self._step(y, cache, self._doc_positions(pos_in_doc, y))

    def _step(self, y, cache, pos) -> Tuple[Tensor, Tensor]:
        H = self.halo_size
        s, b, C = y.shape
        if cache is not None and tuple(cache.shape) != (b, H, C):
            raise ValueError(f"decode cache has shape {tuple(cache.shape)}: expected [b, H, C] = {(b, H, C)}")
        halo = y.new_zeros(H, b, C) if cache is None else cache.transpose(0, 1).to(y.dtype)
        V = self._components(y, [halo], [s], pos)
        history = torch.cat([halo, y], 0)
        return V, history[history.shape[0] - H :].transpose(0, 1).detach().contiguous()
