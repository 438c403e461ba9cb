"""The temporal conv's halo contract without any process group (docs/math.md §3.6): xhc takes the
halo rows from ``SequenceContext.exchange``; the exchange over torch.distributed is
models/sequence.py (its multi-rank parity: tests/test_temporal.py with tests/dist_temporal_worker.py)."""

from __future__ import annotations

import pytest
import torch

from xhc.temporal import SequenceContext, TemporalAugmentation, cp_segments, take_segments

F64 = torch.float64


def _module():
    torch.manual_seed(0)
    return TemporalAugmentation(8, (4, 8, 12)).double()


def test_exchange_rows_give_the_single_rank_result_and_its_gradient():
    """Rows [24, 48) of a sequence with an exchange that hands over rows [13, 24) (what the previous
    SP rank holds) equal the whole sequence's rows, forward and the gradient of the halo rows."""
    m = _module()
    y = torch.randn(48, 2, 8, dtype=F64, requires_grad=True)
    G = torch.randn(48, 2, 4, 8, dtype=F64)
    full = m(y)
    (full * G).sum().backward()
    ref_dy = y.grad.clone()
    y.grad = None

    calls = []

    def exchange(local, H, seq):
        calls.append((local.shape[0], H, seq.segments))
        return [y[24 - H:24]]  # differentiable: the halo's gradient reaches the rows that own it

    out = m(y[24:], SequenceContext(group="the ranks", exchange=exchange))
    assert calls == [(24, 11, None)]
    torch.testing.assert_close(out, full[24:], rtol=0, atol=1e-12)
    (out * G[24:]).sum().backward()
    # rows 13..47 get exactly the gradient they get on one rank; rows 0..12 none (no halo reaches them)
    torch.testing.assert_close(y.grad[13:], ref_dy[13:] - _tail_only(m, y, G, 13), rtol=0, atol=1e-12)
    assert torch.count_nonzero(y.grad[:13]) == 0


def _tail_only(m, y, G, start):
    """The part of dy[start:] that comes from outputs before row 24 (those were not computed above)."""
    y2 = y.detach().clone().requires_grad_(True)
    out = m(y2)
    (out[:24] * G[:24]).sum().backward()
    return y2.grad[start:]


def test_segment_exchange_gets_one_halo_per_segment():
    """CP layout (two segments per rank): the exchange is asked once for all segments and returns one
    halo per segment; the result equals the single-rank rows."""
    m = _module()
    y = torch.randn(48, 2, 8, dtype=F64)
    full = m(y)
    segs = cp_segments(48, 2, 1)  # rows [12, 24) and [24, 36)
    H = m.halo_size

    def exchange(local, H_, seq):
        return [y[max(0, s - H_):s] for s, _ in seq.segments]

    out = m(take_segments(y, segs), SequenceContext(group="cp", segments=segs, exchange=exchange))
    torch.testing.assert_close(out, take_segments(full, segs), rtol=0, atol=1e-12)
    assert H == 11


def test_group_without_exchange_is_one_clear_error():
    m = _module()
    with pytest.raises(ValueError, match="SequenceContext.group needs SequenceContext.exchange"):
        m(torch.randn(24, 2, 8, dtype=F64), SequenceContext(group="the ranks"))
