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
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from megatron.core import parallel_state as ps

from xhc.temporal import (
    SequenceContext,
    cp_segments,
    pos_in_doc_from_cu_seqlens,
    take_segments,
    thd_cp_segments,
)

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
    return SequenceContext(pos_in_doc=pos, group=group, segments=segments)
