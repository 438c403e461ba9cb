"""Where the local rows of a Megatron micro-batch sit, for xHC's temporal convolution (docs/math.md §3.6).

The convolution is the only part of the hyper-connection maths that is not per token: it needs
the κ_max − 1 preceding rows, which under sequence parallelism (SP) or context parallelism (CP)
live on other ranks, and it must reset where attention resets between packed documents.
:func:`sequence_context_from_megatron` builds the :class:`xhc.temporal.SequenceContext` from what
a ``TransformerLayer`` receives plus Megatron's parallel state:

- SP (TP > 1 with ``sequence_parallel``): rows are consecutive slices over the TP group.
- CP: Megatron's load-balanced layout (chunks r and 2cp−1−r), optionally followed by SP.
- Documents: ``packed_seq_params`` (THD, ``cu_seqlens``) or an attention mask that resets between
  documents (``reset_attention_mask``); an explicit context from position ids can be installed
  with :func:`models.hc_layer.sequence_context` instead.

The rows other ranks hold travel here too: :class:`DistHaloExchange` (``HALO_EXCHANGE``) is the
halo exchange over torch.distributed that every distributed context carries (the maths package
``xhc`` takes the halo rows as tensors and never communicates; docs/math.md §3.6).
"""

from __future__ import annotations

import bisect
import weakref
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from xhc.temporal import (
    Segments,
    SequenceContext,
    _fit_halo,  # the last H rows of a segment, zero-filled in front
    cp_segments,
    pos_in_doc_from_cu_seqlens,
    take_segments,
    thd_cp_segments,
)

# ----------------------------------------------------------------------------------------------
# Halo exchange over torch.distributed (docs/math.md §3.6): the temporal conv's SP / CP rows
# ----------------------------------------------------------------------------------------------
class _SPHaloExchange(torch.autograd.Function):
    """SP layout: forward sends the last H rows to rank+1 and receives H rows from rank−1 (rank 0:
    zeros); backward sends the halo gradient back to rank−1 and adds what rank+1 returns to dy."""

    @staticmethod
    def forward(ctx, y: Tensor, H: int, group) -> Tensor:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        ctx.H, ctx.group, ctx.rank, ctx.world, ctx.shape = H, group, rank, world, y.shape
        tail = y[y.shape[0] - H :].contiguous()
        halo = torch.zeros_like(tail)
        ops = []
        if rank + 1 < world:
            ops.append(dist.P2POp(dist.isend, tail, dist.get_global_rank(group, rank + 1), group))
        if rank > 0:
            ops.append(dist.P2POp(dist.irecv, halo, dist.get_global_rank(group, rank - 1), group))
        for req in dist.batch_isend_irecv(ops) if ops else ():
            req.wait()
        return halo

    @staticmethod
    def backward(ctx, d_halo: Tensor):
        d_halo = d_halo.contiguous()
        d_tail = torch.zeros_like(d_halo)
        ops = []
        if ctx.rank > 0:
            ops.append(dist.P2POp(dist.isend, d_halo, dist.get_global_rank(ctx.group, ctx.rank - 1), ctx.group))
        if ctx.rank + 1 < ctx.world:
            ops.append(dist.P2POp(dist.irecv, d_tail, dist.get_global_rank(ctx.group, ctx.rank + 1), ctx.group))
        for req in dist.batch_isend_irecv(ops) if ops else ():
            req.wait()
        dy = d_halo.new_zeros(ctx.shape)
        dy[ctx.shape[0] - ctx.H :] = d_tail
        return dy, None, None


class _AllGatherStack(torch.autograd.Function):
    """``[...]`` -> ``[world, ...]``; backward all-reduces the gradient and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x, group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def _exchange_plan(segments: Segments, H: int, group, device) -> Tuple[int, Tensor]:
    """Gather every rank's segments; for each local halo row find the tail row that holds it.

    Returns ``(n_max, idx)``: ``n_max`` = most segments on any rank (tails are padded to it) and
    ``idx[k, h]`` = flat row of the gathered tails ``[world, n_max, H]`` holding global position
    ``start_k − H + h``, or ``world·n_max·H`` (an appended zero row) for positions before 0.
    """
    world = dist.get_world_size(group)
    n = torch.tensor([len(segments)], dtype=torch.long, device=device)
    counts = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(counts, n, group=group)
    n_max = max(int(c) for c in counts)
    meta = torch.full((n_max, 2), -1, dtype=torch.long, device=device)
    meta[: len(segments)] = torch.tensor(segments, dtype=torch.long, device=device).view(-1, 2)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)

    owners = sorted(
        (start, start + length, rk, k)
        for rk, m in enumerate(metas)
        for k, (start, length) in enumerate(m.tolist())
        if length > 0
    )
    starts = [o[0] for o in owners]
    for a, b in zip(owners[:-1], owners[1:]):
        if a[1] > b[0]:
            raise ValueError(f"SequenceContext.segments overlap across ranks: rows {a[:2]} and {b[:2]}")
    zero_row = world * n_max * H
    idx = []
    for start, _ in segments:
        row_idx = []
        for p in range(start - H, start):
            if p < 0:
                row_idx.append(zero_row)
                continue
            o = bisect.bisect_right(starts, p) - 1
            if o < 0 or not owners[o][0] <= p < owners[o][1]:
                raise ValueError(
                    f"SequenceContext.segments: global row {p} (needed before segment start {start}) "
                    "is held by no rank of the group; pass every piece's rank in group"
                )
            o_start, o_end, rk, k = owners[o]
            row_idx.append((rk * n_max + k) * H + p - (o_end - H))
        idx.append(row_idx)
    return n_max, torch.tensor(idx, dtype=torch.long, device=device)


def _segment_halos(y: Tensor, seq: SequenceContext, H: int) -> List[Tensor]:
    """General layout: one halo ``[H, b, C]`` per local segment, via a tiny all-gather."""
    s, b, C = y.shape
    if H not in seq._plans:
        seq._plans[H] = _exchange_plan(seq.segments, H, seq.group, y.device)
    n_max, idx = seq._plans[H]
    tails = [_fit_halo(seg, H, seg) for seg in y.split([n for _, n in seq.segments], 0)]
    tails += [y.new_zeros(H, b, C)] * (n_max - len(tails))
    gathered = _AllGatherStack.apply(torch.stack(tails), seq.group)  # [world, n_max, H, b, C]
    flat = torch.cat([gathered.reshape(-1, b, C), y.new_zeros(1, b, C)], 0)
    return list(flat[idx.flatten()].view(len(seq.segments), H, b, C))


class DistHaloExchange:
    """The temporal conv's halo exchange over a process group (:data:`xhc.temporal.HaloExchange`):
    ``exchange(y, H, seq)`` -> the H rows preceding each local segment of ``y`` ``[s, b, C]``.

    * plain SP (``seq.segments`` None): one point-to-point autograd function over ``seq.group``
      (rank t sends its last H rows to t+1; backward sends the halo gradient back); needs ≥ H local
      tokens per rank;
    * general layout (``seq.segments``; CP, CP+SP, THD+CP): one small all-gather of every segment's
      tail, assembled row by row by a plan computed once per context (``seq._plans``).
    """

    def __call__(self, y: torch.Tensor, H: int, seq: SequenceContext) -> List[Optional[torch.Tensor]]:
        if seq.segments is not None:
            return _segment_halos(y, seq, H)
        if dist.get_world_size(seq.group) == 1:
            return [None]
        if y.shape[0] < H:
            raise ValueError(
                f"TemporalAugmentation: the sequence-parallel halo needs >= kappa_max-1 = {H} local tokens "
                f"per rank, got s={y.shape[0]}; use a longer sequence or fewer SP ranks, or pass "
                "SequenceContext.segments (the general exchange has no minimum)"
            )
        return [_SPHaloExchange.apply(y, H, seq.group)]


HALO_EXCHANGE = DistHaloExchange()
"""The exchange every Megatron-built :class:`~xhc.temporal.SequenceContext` carries."""


def distributed_sequence_context(pos_in_doc: Optional[torch.Tensor] = None, group=None,
                                 segments: Optional[Segments] = None) -> SequenceContext:
    """A :class:`~xhc.temporal.SequenceContext` whose rows are spread over the process ``group``
    (plain SP slices, or ``segments``; see :func:`xhc.temporal.sp_segments`, :func:`~xhc.temporal.cp_segments`,
    :func:`~xhc.temporal.thd_cp_segments`), with :data:`HALO_EXCHANGE` as its exchange.
    ``group`` None: this rank holds the whole sequence (no exchange)."""
    return SequenceContext(pos_in_doc=pos_in_doc, group=group, segments=segments,
                           exchange=HALO_EXCHANGE if group is not None else None)



_MASK_CACHE: dict = {}


def pos_in_doc_from_attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """Document positions implied by a causal, document-resetting mask.

    ``mask``: ``[b, 1, S, S]`` (or ``[1, 1, S, S]``) boolean, True = masked (Megatron's convention).
    Query t attends to keys start(t)..t, so its position in the document is (#visible keys − 1).
    Returns ``[S, b]`` long.
    """
    if mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}: expected [b, 1, S, S]")
    visible = (~mask.bool()).sum(-1)[:, 0]  # [b, S]
    return (visible - 1).clamp_min(0).t().long().contiguous()


def _cached_mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """:func:`pos_in_doc_from_attention_mask`, computed once per mask tensor: every layer of a
    forward pass receives the same mask object.  The cache holds a weak reference to the mask and
    compares identity and version, so a new mask allocated at a freed one's address (same
    ``id``/``data_ptr``) or an in-place edit is never mistaken for the cached one."""
    hit = _MASK_CACHE.get("entry")
    if hit is not None and hit[0]() is mask and hit[1] == mask._version:
        return hit[2]
    pos = pos_in_doc_from_attention_mask(mask)
    _MASK_CACHE["entry"] = (weakref.ref(mask), mask._version, pos)
    return pos


_CONTEXT_CACHE: dict = {}


def _ref_key(obj):
    """Identity (weakly held) and version of a per-micro-batch input: the mask, or the cu_seqlens."""
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return weakref.ref(obj), obj._version
    cu = getattr(obj, "cu_seqlens_q_padded", None)
    if cu is None:
        cu = getattr(obj, "cu_seqlens_q", None)
    return weakref.ref(obj), (weakref.ref(cu), cu._version) if isinstance(cu, torch.Tensor) else None


def _same_ref(a, b) -> bool:
    if a is None or b is None:
        return a is b
    (ra, va), (rb, vb) = a, b
    if ra() is None or ra() is not rb():
        return False
    if isinstance(va, tuple) or isinstance(vb, tuple):
        return va is not None and vb is not None and va[0]() is vb[0]() and va[1] == vb[1]
    return va == vb


def sequence_context_from_megatron(config, attention_mask, packed_seq_params, s: int, b: int,
                                   reset: str = "auto") -> SequenceContext:
    """The temporal conv's :class:`SequenceContext` for local activations ``[s, b, ·]``.

    Every layer of a forward pass receives the same mask / ``packed_seq_params`` objects, so the
    context is built once and shared: the CP exchange plan (two small all-gathers and a host
    sync) and the ``cu_seqlens`` host read then happen once per micro-batch, not once per xHC MLP
    sublayer.  Without a mask or packing (the plain SP / CP layouts) the context depends on the
    parallel layout and shapes alone and is reused across steps: no collectives at all in steady
    state.  Only the most recent context is kept; a new mask or packing object (or an in-place
    edit of one) builds a new one.
    """
    layout = _layout(config)
    key = (s, b, reset, *layout[:4])
    mask_ref, packed_ref = _ref_key(attention_mask), _ref_key(packed_seq_params)
    hit = _CONTEXT_CACHE.get("entry")
    if (hit is not None and hit["key"] == key and hit["group"] is layout[4] and _same_ref(hit["mask"], mask_ref)
            and _same_ref(hit["packed"], packed_ref)):
        return hit["ctx"]
    ctx = _build_sequence_context(layout, attention_mask, packed_seq_params, s, b, reset)
    _CONTEXT_CACHE["entry"] = {"key": key, "group": layout[4], "mask": mask_ref, "packed": packed_ref, "ctx": ctx}
    return ctx


def _layout(config):
    """``(sp, cp, sp_rank, cp_rank, group)`` of the local rows: SP size (TP with sequence
    parallelism, else 1), CP size, ranks in each, and the group holding the sequence's pieces."""
    from megatron.core import parallel_state as ps  # here, so the halo exchange imports without Megatron

    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    cp = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    sp = tp if (config.sequence_parallel and tp > 1) else 1
    sp_rank = ps.get_tensor_model_parallel_rank() if sp > 1 else 0
    cp_rank = ps.get_context_parallel_rank() if cp > 1 else 0
    if cp > 1:
        group = ps.get_tensor_and_context_parallel_group() if sp > 1 else ps.get_context_parallel_group()
    else:
        group = ps.get_tensor_model_parallel_group() if sp > 1 else None
    return sp, cp, sp_rank, cp_rank, group


def _build_sequence_context(layout, attention_mask, packed_seq_params, s: int, b: int,
                            reset: str = "auto") -> SequenceContext:
    sp, cp, sp_rank, cp_rank, group = layout

    pos = None
    segments = None
    if packed_seq_params is not None and reset != "never":
        # With padded THD the rows of sequence i start at cu_seqlens_q_padded[i] (CP or not);
        # cu_seqlens_q holds the unpadded lengths and would misplace every later document start.
        cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        total = s * sp * cp
        pos_global = pos_in_doc_from_cu_seqlens(cu, total)  # [T, 1]
        if cp > 1:
            segments = thd_cp_segments(cu, cp, cp_rank)
            if sp > 1:
                raise NotImplementedError("THD packing with CP and SP together is not supported by the xHC conv")
        else:
            segments = ((sp_rank * s, s),) if sp > 1 else None
        pos = take_segments(pos_global, segments) if segments is not None else pos_global
    elif attention_mask is not None and reset != "never":
        if cp > 1:
            raise NotImplementedError(
                "an explicit attention mask with context parallelism: pass document positions with "
                "models.hc_layer.sequence_context(...) instead")
        pos_global = _cached_mask_positions(attention_mask)
        pos = pos_global[sp_rank * s:(sp_rank + 1) * s]
        if pos.shape[1] != b:
            pos = pos.expand(s, b)
    elif reset == "always":
        raise ValueError("HCConfig.conv_doc_reset='always' needs document boundaries: pass packed_seq_params, "
                         "a document-resetting attention mask, or models.hc_layer.sequence_context(...)")

    if cp > 1:
        if segments is None:
            segments = cp_segments(s * sp * cp, cp, cp_rank, sp, sp_rank)
    elif sp > 1:
        if segments is not None and packed_seq_params is not None:
            segments = None  # plain SP slices: the consecutive-slice halo is exact
    return distributed_sequence_context(pos, group, segments)
