"""Temporal feature augmentation (docs/math.md §3.2, §3.6, §3.7 #4): equations, resets, layouts, decoding.

References are written directly from docs/math.md with explicit Python loops over positions, taps and
channels, using *document ids* (not pos_in_doc) to decide which history a token may see.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from xhc.temporal import (
    SequenceContext,
    TemporalAugmentation,
    causal_dwconv,
    cp_segments,
    pos_in_doc_from_cu_seqlens,
    pos_in_doc_from_eod,
    pos_in_doc_from_position_ids,
    sp_segments,
    take_segments,
    temporal_conv,
    thd_cp_segments,
)

pytestmark = pytest.mark.megatron  # the Python 3.12 / newest megatron-core CI stage runs these

F64 = torch.float64
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# Independent references
# ----------------------------------------------------------------------------------------------
def doc_ids(doc_lengths_per_b, s):
    """[s][b] document ids from per-batch-element document lengths (Python lists)."""
    ids = [[0] * len(doc_lengths_per_b) for _ in range(s)]
    for bb, lengths in enumerate(doc_lengths_per_b):
        assert sum(lengths) == s
        t = 0
        for d, n in enumerate(lengths):
            for _ in range(n):
                ids[t][bb] = d
                t += 1
    return ids


def positions(doc_lengths_per_b, s):
    """[s, b] long: index inside the document, built by counting."""
    pos = torch.zeros(s, len(doc_lengths_per_b), dtype=torch.long)
    for bb, lengths in enumerate(doc_lengths_per_b):
        t = 0
        for n in lengths:
            for k in range(n):
                pos[t, bb] = k
                t += 1
    return pos


def ref_conv(y, w, docs=None):
    """g[t,b,c] = Σ_i w[i,c]·y[t−i,b,c]; y[t'] = 0 if t' < 0 or t' is in another document (§3.2)."""
    Y, Wl = y.tolist(), w.tolist()
    s, b, C = y.shape
    g = [[[0.0] * C for _ in range(b)] for _ in range(s)]
    for t in range(s):
        for bb in range(b):
            for c in range(C):
                acc = 0.0
                for i in range(len(Wl)):
                    tp = t - i
                    if tp < 0 or (docs is not None and docs[tp][bb] != docs[t][bb]):
                        continue
                    acc += Wl[i][c] * Y[tp][bb][c]
                g[t][bb][c] = acc
    return torch.tensor(g, dtype=F64)


def ref_V(m, y, docs=None):
    return torch.stack([y.to(F64)] + [ref_conv(y.to(F64), w.detach().to(F64), docs) for w in m.conv], 2)


DOCS = [[5, 1, 9, 9], [13, 11]]  # b = 2, s = 24; documents shorter and longer than every kernel


@pytest.fixture
def module():
    torch.manual_seed(0)
    return TemporalAugmentation(8, (4, 8, 12)).double()


# ----------------------------------------------------------------------------------------------
# The equation
# ----------------------------------------------------------------------------------------------
def test_forward_matches_loop_reference(module):
    y = torch.randn(24, 2, 8, dtype=F64)
    V = module(y)
    assert V.shape == (24, 2, 4, 8) and V.dtype == F64
    torch.testing.assert_close(V, ref_V(module, y), rtol=0, atol=1e-13)


def test_forward_with_resets_matches_loop_reference(module):
    y = torch.randn(24, 2, 8, dtype=F64)
    V = module(y, SequenceContext(pos_in_doc=positions(DOCS, 24)))
    torch.testing.assert_close(V, ref_V(module, y, doc_ids(DOCS, 24)), rtol=0, atol=1e-13)


def test_spec_pytorch_equivalent_conv1d():
    """§3.2: Conv1d(C, C, κ, groups=C) on input left-padded with κ−1 zeros, weight[c,0,κ−1−i] = w[i,c]."""
    torch.manual_seed(1)
    C, k = 6, 5
    w = torch.randn(k, C, dtype=F64)
    y = torch.randn(17, 3, C, dtype=F64)
    conv = nn.Conv1d(C, C, k, groups=C, bias=False).double()
    with torch.no_grad():
        for c in range(C):
            for i in range(k):
                conv.weight[c, 0, k - 1 - i] = w[i, c]
    x = nn.functional.pad(y.permute(1, 2, 0), (k - 1, 0))  # [b, C, κ−1+s]
    expected = conv(x).permute(2, 0, 1)
    torch.testing.assert_close(causal_dwconv(y, w), expected, rtol=0, atol=1e-13)


def test_halo_rows_continue_the_sequence():
    torch.manual_seed(2)
    w = torch.randn(6, 4, dtype=F64)
    y = torch.randn(20, 2, 4, dtype=F64)
    full = causal_dwconv(y, w)
    for h in (5, 9):  # exactly κ−1 rows, and more than needed
        torch.testing.assert_close(causal_dwconv(y[h:], w, halo=y[:h]), full[h:], rtol=0, atol=1e-14)
    # fewer rows than κ−1: the missing history is zero
    yz = torch.cat([torch.zeros(3, 2, 4, dtype=F64), y[:2], y[2:]])
    torch.testing.assert_close(causal_dwconv(y[2:], w, halo=y[:2]), causal_dwconv(yz, w)[5:], rtol=0, atol=1e-14)
    # with a reset: halo taps are dropped exactly when the token is close to its document start
    pos = positions([[7, 13], [4, 16]], 20)
    ref = ref_conv(y, w, doc_ids([[7, 13], [4, 16]], 20))
    torch.testing.assert_close(causal_dwconv(y[8:], w, halo=y[:8], pos_in_doc=pos[8:]), ref[8:], rtol=0, atol=1e-14)


def test_temporal_conv_stacks_kernels():
    torch.manual_seed(3)
    ws = [torch.randn(k, 5, dtype=F64) for k in (1, 3, 7)]
    y = torch.randn(11, 2, 5, dtype=F64)
    pos = positions([[4, 7], [11]], 11)
    G = temporal_conv(y, ws, pos_in_doc=pos)
    for j, w in enumerate(ws):
        torch.testing.assert_close(G[:, :, j], ref_conv(y, w, doc_ids([[4, 7], [11]], 11)), rtol=0, atol=1e-14)


def test_strict_causality(module):
    """Changing tokens t+1.. never changes any output at positions ≤ t (bitwise)."""
    torch.manual_seed(4)
    m32 = TemporalAugmentation(8)
    for m, dtype in ((module, F64), (m32, torch.float32)):
        y = torch.randn(24, 2, 8, dtype=dtype)
        for pos in (None, positions(DOCS, 24)):
            V = m(y, SequenceContext(pos_in_doc=pos))
            for t in (0, 4, 11, 17, 22):
                y2 = y.clone()
                y2[t + 1 :] = torch.randn_like(y2[t + 1 :]) * 100
                V2 = m(y2, SequenceContext(pos_in_doc=pos))
                assert torch.equal(V2[: t + 1], V[: t + 1])
                assert not torch.equal(V2[t + 1 :], V[t + 1 :])


def test_perturbation_footprint(module):
    """§3.7 #4: a change of y at t changes g_j exactly at t..t+κ_j−1, never across a reset."""
    torch.manual_seed(5)
    y = torch.randn(24, 2, 8, dtype=F64)
    docs = doc_ids(DOCS, 24)
    for pos in (None, positions(DOCS, 24)):
        V = module(y, SequenceContext(pos_in_doc=pos))
        for t in (0, 3, 5, 6, 14, 20):
            y2 = y.clone()
            y2[t] += 1.0
            changed = (module(y2, SequenceContext(pos_in_doc=pos)) - V).abs().amax(-1) > 0  # [s, b, K]
            for bb in range(2):
                for j, k in enumerate(module.kernel_sizes):
                    expected = [
                        t <= u < t + k and (pos is None or docs[u][bb] == docs[t][bb]) for u in range(24)
                    ]
                    assert changed[:, bb, j + 1].tolist() == expected, (t, bb, k, pos is None)
                assert changed[:, bb, 0].tolist() == [u == t for u in range(24)]


def test_reset_equals_running_each_document_separately(module):
    torch.manual_seed(6)
    y = torch.randn(24, 2, 8, dtype=F64)
    V = module(y, SequenceContext(pos_in_doc=positions(DOCS, 24)))
    for bb, lengths in enumerate(DOCS):
        t = 0
        for n in lengths:
            alone = module(y[t : t + n, bb : bb + 1])
            torch.testing.assert_close(V[t : t + n, bb : bb + 1], alone, rtol=0, atol=1e-14)
            t += n


def test_conv_doc_reset_modes():
    torch.manual_seed(7)
    y = torch.randn(24, 2, 8)
    pos = positions(DOCS, 24)
    auto, never, always = (TemporalAugmentation(8, conv_doc_reset=mode) for mode in ("auto", "never", "always"))
    never.load_state_dict(auto.state_dict())
    always.load_state_dict(auto.state_dict())
    plain = auto(y)
    reset = auto(y, SequenceContext(pos_in_doc=pos))
    assert not torch.equal(plain, reset)
    assert torch.equal(never(y, SequenceContext(pos_in_doc=pos)), plain)
    assert torch.equal(always(y, SequenceContext(pos_in_doc=pos)), reset)
    with pytest.raises(ValueError, match=r"conv_doc_reset='always' needs SequenceContext\.pos_in_doc"):
        always(y)
    with pytest.raises(ValueError, match=r"conv_doc_reset='sometimes'.*auto, always, never"):
        TemporalAugmentation(8, conv_doc_reset="sometimes")


def test_gradcheck_conv_weights_halo_and_resets():
    torch.manual_seed(8)
    y = torch.randn(9, 2, 3, dtype=F64, requires_grad=True)
    halo = torch.randn(3, 2, 3, dtype=F64, requires_grad=True)
    w1 = torch.randn(2, 3, dtype=F64, requires_grad=True)
    w2 = torch.randn(4, 3, dtype=F64, requires_grad=True)
    pos = positions([[2, 7], [9]], 9) + torch.tensor([[0, 2]])  # element 1 starts mid-document
    fn = lambda y, halo, w1, w2: temporal_conv(y, [w1, w2], halo=halo, pos_in_doc=pos)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (y, halo, w1, w2))
    m = TemporalAugmentation(3, (2, 4)).double()
    assert torch.autograd.gradcheck(lambda y: m(y, SequenceContext(pos_in_doc=pos)), (y,))


# ----------------------------------------------------------------------------------------------
# Parameters, dtypes, shapes
# ----------------------------------------------------------------------------------------------
def test_parameters_init_and_dtypes():
    torch.manual_seed(9)
    C = 2048
    m = TemporalAugmentation(C, (4, 8, 12))
    assert [tuple(w.shape) for w in m.conv] == [(4, C), (8, C), (12, C)]
    assert all(w.dtype == torch.float32 for w in m.conv)
    assert sum(w.numel() for w in m.parameters()) == 24 * C  # Σκ·C, no bias (§3.1)
    assert m.num_components == 4 and m.halo_size == 11
    for w in m.conv:
        bound = 1 / math.sqrt(w.shape[0])  # PyTorch depthwise default, §3.2 / §8 #18
        assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
        assert abs(w.std().item() - bound / math.sqrt(3)) < 0.03 * bound
        ref = nn.Conv1d(C, C, w.shape[0], groups=C, bias=False).weight  # the claim itself
        assert ref.abs().max() <= bound and ref.abs().max() > 0.99 * bound

    y = torch.randn(6, 2, C).bfloat16()
    V = m(y)
    assert V.dtype == torch.float32 and V.shape == (6, 2, 4, C)
    assert torch.equal(V[:, :, 0], y.float())  # v_1 = y, exactly
    torch.testing.assert_close(V, m(y.float()), rtol=0, atol=0)  # bf16 in, fp32 maths

    none = TemporalAugmentation(C, ())
    assert none.num_components == 1 and len(list(none.parameters())) == 0
    assert torch.equal(none(y), y.float()[:, :, None])


# ----------------------------------------------------------------------------------------------
# pos_in_doc from what Megatron passes
# ----------------------------------------------------------------------------------------------
def test_pos_in_doc_hand_built():
    EOD = 0
    tokens = torch.tensor([[5, 7, EOD, 3, EOD, EOD, 9, 2], [1, 2, 3, 4, 5, 6, 7, EOD]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]]).t()
    assert torch.equal(pos_in_doc_from_eod(tokens, EOD), expected)
    assert torch.equal(pos_in_doc_from_eod(tokens, EOD, sp_rank=1, sp_size=2), expected[4:])
    # Megatron position ids are [b, s]; ours are [s, b]
    assert torch.equal(pos_in_doc_from_position_ids(expected.t()), expected)
    assert torch.equal(pos_in_doc_from_position_ids(expected.t(), sp_rank=0, sp_size=4), expected[:2])

    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    assert pos_in_doc_from_cu_seqlens(cu).flatten().tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert pos_in_doc_from_cu_seqlens(cu, total_tokens=11).flatten().tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1]
    assert pos_in_doc_from_cu_seqlens(cu).shape == (9, 1)


def test_pos_in_doc_matches_megatron_gpt_dataset():
    """Against Megatron's own _get_ltor_masks_and_position_ids (reset_position_ids=True)."""
    gpt_dataset = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    torch.manual_seed(10)
    EOD = 3
    for _ in range(5):
        data = torch.randint(0, 6, (40,))
        _, _, position_ids = gpt_dataset._get_ltor_masks_and_position_ids(data, EOD, True, True, False, False)
        ours = pos_in_doc_from_eod(data[None], EOD)
        assert torch.equal(ours, position_ids[:, None])
        assert torch.equal(pos_in_doc_from_position_ids(position_ids[None]), ours)


def test_pos_in_doc_errors():
    with pytest.raises(ValueError, match=r"position_ids has shape \(8,\): expected Megatron's \[b, s\]"):
        pos_in_doc_from_position_ids(torch.arange(8))
    with pytest.raises(ValueError, match="cu_seqlens=.*must start at 0 and be non-decreasing"):
        pos_in_doc_from_cu_seqlens(torch.tensor([0, 5, 3]))
    with pytest.raises(ValueError, match="total_tokens=4 is smaller than cu_seqlens"):
        pos_in_doc_from_cu_seqlens(torch.tensor([0, 5]), total_tokens=4)
    with pytest.raises(ValueError, match="cannot be split over sp_size=3"):
        pos_in_doc_from_position_ids(torch.zeros(1, 8, dtype=torch.long), sp_rank=0, sp_size=3)


# ----------------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------------
class _FakeGroup:
    """A process group of ``size`` ranks seen from rank ``rank`` (no communication needed)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_cp_segments_match_megatron_get_batch_on_this_cp_rank(monkeypatch):
    pytest.importorskip("megatron.core.utils")
    from models.parallel import batch_on_this_cp_rank

    # Megatron reads the CP size/rank from the group, through megatron.core.utils.get_pg_size /
    # get_pg_rank (<= 0.17) or torch.distributed.get_world_size / get_rank (0.18+): answer both
    # from the fake group.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: group.size())
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: group.rank())
    S = 48
    for cp in (1, 2, 3, 4):
        for r in range(cp):
            theirs = batch_on_this_cp_rank({"tokens": torch.arange(S)[None]}, cp_group=_FakeGroup(cp, r))
            local = theirs["tokens"][0]
            assert torch.equal(take_segments(torch.arange(S), cp_segments(S, cp, r)), local)
            for sp in (1, 2, 4):  # SP then splits the local rows into consecutive slices
                n = local.numel() // sp
                for q in range(sp):
                    ours = take_segments(torch.arange(S), cp_segments(S, cp, r, sp_size=sp, sp_rank=q))
                    assert torch.equal(ours, local[q * n : (q + 1) * n])
    assert cp_segments(16, 2, 0) == ((0, 4), (12, 4))
    assert cp_segments(16, 2, 1) == ((4, 8),)  # chunks 1 and 2 are adjacent: one segment
    assert sp_segments(16, 4, 2) == ((8, 4),)
    with pytest.raises(ValueError, match="divisible by 2\\*cp_size=4"):
        cp_segments(18, 2, 0)


def test_thd_cp_segments_hand_built():
    cu = torch.tensor([0, 8, 24, 28])  # padded lengths 8, 16, 4 with cp = 2 -> chunks of 2, 4, 1
    assert thd_cp_segments(cu, 2, 0) == ((0, 2), (6, 6), (20, 5), (27, 1))
    assert thd_cp_segments(cu, 2, 1) == ((2, 4), (12, 8), (25, 2))
    rows = sorted(
        i for r in (0, 1) for i in take_segments(torch.arange(28), thd_cp_segments(cu, 2, r)).tolist()
    )
    assert rows == list(range(28))  # every row held exactly once
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by 2\\*cp_size=4"):
        thd_cp_segments(torch.tensor([0, 6]), 2, 0)


# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------
def test_decode_token_by_token_equals_full_forward(module):
    torch.manual_seed(11)
    y = torch.randn(24, 2, 8, dtype=F64)
    for pos in (None, positions(DOCS, 24)):
        full = module(y, SequenceContext(pos_in_doc=pos))
        for chunks in ([1] * 24, [3, 1, 5, 7, 8]):
            cache, outs, t = None, [], 0
            for n in chunks:
                V, cache = module.step(y[t : t + n], cache, None if pos is None else pos[t : t + n])
                assert cache.shape == (2, 11, 8)
                outs.append(V)
                t += n
            torch.testing.assert_close(torch.cat(outs), full, rtol=0, atol=1e-14)
        # the same through forward with a decode-cache dict (keyed by module)
        ctx_cache, outs = {}, []
        for t in range(24):
            p = None if pos is None else pos[t : t + 1]
            outs.append(module(y[t : t + 1], SequenceContext(pos_in_doc=p, decode_cache=ctx_cache)))
        torch.testing.assert_close(torch.cat(outs), full, rtol=0, atol=1e-14)
        assert set(ctx_cache) == {module}


def test_decode_cache_cleared_at_document_start(module):
    """Without pos_in_doc, clearing the cache at a document start gives the reset result."""
    torch.manual_seed(12)
    y = torch.randn(24, 2, 8, dtype=F64)
    full = module(y, SequenceContext(pos_in_doc=positions(DOCS, 24)))
    starts = positions(DOCS, 24) == 0  # [s, b]
    cache, outs = module.init_cache(2, dtype=F64), []
    for t in range(24):
        cache = module.clear_cache(cache, starts[t])
        V, cache = module.step(y[t : t + 1], cache)
        outs.append(V)
    torch.testing.assert_close(torch.cat(outs), full, rtol=0, atol=1e-14)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------
def test_error_messages(module):
    y = torch.randn(24, 2, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"input has shape \(24, 2, 9\): expected \[s, b, 8\]"):
        module(torch.randn(24, 2, 9, dtype=F64))
    with pytest.raises(ValueError, match=r"pos_in_doc has shape \(2, 24\).*transpose"):
        module(y, SequenceContext(pos_in_doc=torch.zeros(2, 24, dtype=torch.long)))
    with pytest.raises(ValueError, match="segments needs SequenceContext.group"):
        module(y, SequenceContext(segments=((0, 24),)))
    with pytest.raises(ValueError, match="cover 20 rows but y has 24"):
        module(y, SequenceContext(group=object(), segments=((0, 20),)))
    with pytest.raises(ValueError, match="decode_cache cannot be combined with SequenceContext.group"):
        module(y, SequenceContext(group=object(), decode_cache={}))
    with pytest.raises(ValueError, match=r"decode cache has shape \(2, 5, 8\): expected"):
        module.step(y[:1], torch.zeros(2, 5, 8, dtype=F64))
    with pytest.raises(ValueError, match=r"kernel_sizes=\(4, 0\): every kernel size must be >= 1"):
        TemporalAugmentation(8, (4, 0))
    with pytest.raises(ValueError, match=r"halo has shape \(3, 2, 7\)"):
        causal_dwconv(y, torch.randn(4, 8, dtype=F64), halo=torch.zeros(3, 2, 7, dtype=F64))


# ----------------------------------------------------------------------------------------------
# Multi-rank parity (gloo, CPU): SP, CP = 2, CP×SP, THD+CP against one rank
# ----------------------------------------------------------------------------------------------
def _case(name, layout, S, b, C, kernel_sizes, docs=None, seed=0, **extra):
    g = torch.Generator().manual_seed(seed)
    m = TemporalAugmentation(C, kernel_sizes)
    case = {
        "name": name,
        "layout": layout,
        "kernel_sizes": kernel_sizes,
        "state": m.state_dict(),
        "y": torch.randn(S, b, C, generator=g, dtype=F64),
        "dV": torch.randn(S, b, len(kernel_sizes) + 1, C, generator=g, dtype=F64),
        "pos": None if docs is None else positions(docs, S),
    }
    case.update(extra)
    return case


def _single_rank(case):
    m = TemporalAugmentation(case["y"].shape[-1], case["kernel_sizes"])
    m.load_state_dict(case["state"])
    m.double()
    y = case["y"].clone().requires_grad_(True)
    V = m(y, SequenceContext(pos_in_doc=case["pos"]))
    (V * case["dV"]).sum().backward()
    return V.detach(), y.grad, [w.grad for w in m.conv]


def _run_world(tmp_path_factory, world, cases):
    out = tmp_path_factory.mktemp(f"dist{world}")
    torch.save(cases, out / "cases.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "dist_temporal_worker.py"), str(out / "cases.pt"), str(out), str(world)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {c["name"]: [torch.load(out / f"{c['name']}.{r}.pt") for r in range(world)] for c in cases}, cases


# Documents cross rank boundaries in every layout below (S = 48: SP slices of 24, CP chunks of 12).
DIST_DOCS = [[10, 20, 3, 15], [30, 18]]
CASES_2 = [
    _case("sp", "sp", 48, 2, 8, (4, 8, 12)),
    _case("sp_reset", "sp", 48, 2, 8, (4, 8, 12), DIST_DOCS, seed=1),
    _case("sp_general_reset", "sp_general", 48, 2, 8, (4, 8, 12), DIST_DOCS, seed=2),
    _case("cp", "cp", 48, 2, 8, (4, 8, 12), seed=3),
    _case("cp_reset", "cp", 48, 2, 8, (4, 8, 12), DIST_DOCS, seed=4),
    # THD: b = 1, three packed sequences; CP chunks of 2, 5 and 3 rows (shorter than κ_max−1)
    _case("thd_cp_reset", "thd_cp", 40, 1, 8, (4, 8, 12), [[8, 20, 12]], seed=5,
          cu_seqlens_padded=torch.tensor([0, 8, 28, 40])),
    _case("thd_cp_noreset", "thd_cp", 40, 1, 8, (4, 8, 12), None, seed=6,
          cu_seqlens_padded=torch.tensor([0, 8, 28, 40])),
    _case("sp_too_short", "sp", 16, 2, 8, (4, 8, 12), seed=7),  # 8 rows per rank < 11
]
CASES_4 = [
    _case("cp2_sp2_reset", "cp_sp", 48, 2, 8, (4, 8, 12), DIST_DOCS, seed=8),  # 4 segments of 12 rows
    _case("sp4", "sp", 48, 2, 8, (4, 8, 12), DIST_DOCS, seed=9),
]


@pytest.fixture(scope="module")
def dist2(tmp_path_factory):
    return _run_world(tmp_path_factory, 2, CASES_2)


@pytest.fixture(scope="module")
def dist4(tmp_path_factory):
    return _run_world(tmp_path_factory, 4, CASES_4)


def _check_parity(results, case):
    V_ref, dy_ref, dw_ref = _single_rank(case)
    covered = []
    for r, res in enumerate(results):
        assert "error" not in res, res.get("error")
        segs = res["segments"]
        covered += take_segments(torch.arange(case["y"].shape[0]), segs).tolist()
        torch.testing.assert_close(res["V"], take_segments(V_ref, segs), rtol=0, atol=1e-12)
        torch.testing.assert_close(res["dy"], take_segments(dy_ref, segs), rtol=0, atol=1e-12)
        for dw, ref in zip(res["dw"], dw_ref):
            torch.testing.assert_close(dw, ref, rtol=0, atol=1e-12)
    assert sorted(covered) == list(range(case["y"].shape[0]))


@pytest.mark.parametrize("name", [c["name"] for c in CASES_2 if c["name"] != "sp_too_short"])
@pytest.mark.slow
def test_two_rank_parity(dist2, name):
    results, cases = dist2
    _check_parity(results[name], next(c for c in cases if c["name"] == name))


def test_two_rank_layouts_are_the_intended_ones(dist2):
    results, _ = dist2
    assert [r["segments"] for r in results["cp_reset"]] == [((0, 12), (36, 12)), ((12, 24),)]
    assert [r["segments"] for r in results["sp_reset"]] == [((0, 24),), ((24, 24),)]
    assert min(n for r in results["thd_cp_reset"] for _, n in r["segments"]) < 11


def test_sp_halo_too_short_error(dist2):
    results, _ = dist2
    for res in results["sp_too_short"]:
        assert "needs >= kappa_max-1 = 11 local tokens per rank, got s=8" in res["error"]


@pytest.mark.parametrize("name", [c["name"] for c in CASES_4])
@pytest.mark.slow
def test_four_rank_parity(dist4, name):
    results, cases = dist4
    _check_parity(results[name], next(c for c in cases if c["name"] == name))
