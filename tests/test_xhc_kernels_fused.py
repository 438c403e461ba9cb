"""The fused xHC entry kernels (xhc/kernels/xhc_entry.py, xhc_grad.py; docs/kernels.md) against the eager
float64 reference, on CPU under ``TRITON_INTERPRET=1`` (natively on a GPU: ids contain ``cuda``).

* every output (u, X', the routing I) and every gradient equals eager in float64: attention and MLP
  sublayers (K = 1 and K = r + 1 folded Gram–Schmidt components), N from 4 to 16, k − m routed
  streams from 0 (no router) to 8, both Sinkhorn orders; the fused path ran and dX was written once;
* router ties (all scores equal) pick the lower stream index, as :func:`xhc.router.topk_stable`;
* a bf16 state: within a bf16 ulp-derived bound of the fp32 reference;
* the backward is deterministic and the weights' gradient does not depend on the token split;
* the launch counts of ``python -m bench.hc_kernels --launches`` meet the xHC attention and MLP targets;
* MLP sublayers run the fused write (temporal components with document resets, Gram–Schmidt on or off,
  up to 3 kernels), except on a sequence this rank does not hold whole;
* every autotuning candidate of the xHC kernels gives the eager result;
* Flash and Flash-4sub windows: the fused window entry (2 or 4 pre-maps), every write's mappings
  (xhc_active.py) and every augmented write (xhc_post.py's carried modes) run and the window equals
  eager in float64; a bf16 window within bf16-ulp bounds and bit-identical across runs;
* the xHC-Flash attention write with the MLP read's correction (flash_attn.py) equals its formula in
  float64 (outputs and every gradient, either output alone), and in a window each carried X_a's
  gradient is written once, by the op that made the write's P from it.
"""

import os
from types import SimpleNamespace

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from xhc.config import HCConfig  # noqa: E402
from xhc.temporal import SequenceContext  # noqa: E402
from xhc.xhc import XHCSublayer  # noqa: E402

F64 = torch.float64
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
S, B, C = 5, 2, 8
# positions inside documents: batch row 1 starts a new document at t = 2 (the conv taps reset there)
POS = torch.tensor([[0, 0], [1, 1], [2, 0], [3, 1], [4, 2]])

pytestmark = pytest.mark.interp


def _need_triton():
    pytest.importorskip("triton")
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")


def _run(cfg, device, is_mlp, dtype=F64, pdtype=None, seed=0, zero_router=False):
    torch.manual_seed(seed)
    mod = XHCSublayer(cfg, C, is_mlp=is_mlp, layer_index=1).to(device=device, dtype=pdtype or dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=F64).to(p))
        if zero_router and mod.router.weight is not None:
            mod.router.weight.zero_()
    g = torch.Generator().manual_seed(seed + 2)
    X = torch.randn(S, B, cfg.n, C, generator=g, dtype=F64).to(device=device, dtype=dtype).requires_grad_()
    Wy = torch.randn(C, C, generator=g, dtype=F64).to(device=device, dtype=dtype)
    Gu = torch.randn(S, B, C, generator=g, dtype=F64).to(device)
    Go = torch.randn(S, B, cfg.n, C, generator=g, dtype=F64).to(device)
    seq = SequenceContext(pos_in_doc=POS.to(device))
    u, ctx = mod.read(X)
    y = torch.tanh(u @ Wy)  # the branch output depends on u: du gets both paths
    out = mod.write(X, y, ctx, seq)
    loss = (u.double() * Gu).sum() + (out.double() * Go).sum()
    names = [n for n, _ in mod.named_parameters()]
    grads = torch.autograd.grad(loss, [X] + list(mod.parameters()))
    return [u, out], ctx.I, dict(zip(["X"] + names, grads))


def _close(a, b, what, rtol=1e-9, atol=1e-11):
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


CASES = [
    pytest.param(dict(n=4, k=3, m=1), False, id="attn-N4-k3-m1"),
    pytest.param(dict(n=4, k=2, m=2), False, id="attn-N4-k2-m2-no-router"),
    pytest.param(dict(n=8, k=4, m=2, kernel_sizes=(2, 3)), True, id="mlp-N8-k4-m2-K3"),
    pytest.param(dict(n=6, k=3, m=0, kernel_sizes=(2,), sinkhorn_order="col_last", sinkhorn_iters=3), True,
                 id="mlp-N6-k3-m0-col_last"),
    pytest.param(dict(n=16, k=8, m=0, sinkhorn_iters=2), False, id="attn-N16-k8"),
    pytest.param(dict(n=4, k=2, m=1, kernel_sizes=(2, 3, 4)), True, id="mlp-N4-k2-K4"),
    pytest.param(dict(n=4, k=3, m=1, kernel_sizes=(3, 2), gram_schmidt=False), True, id="mlp-no-gram-schmidt"),
    pytest.param(dict(n=4, k=3, m=1, kernel_sizes=(4,), conv_doc_reset="never"), True, id="mlp-no-doc-reset"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw, is_mlp", CASES)
def test_fused_xhc_equals_eager_float64(monkeypatch, device, kw, is_mlp):
    _need_triton()
    from xhc.kernels import xhc_entry, xhc_grad, xhc_post

    calls = []
    sg = xhc_grad.state_grad
    monkeypatch.setattr(xhc_grad, "state_grad", lambda *a, **kw: (calls.append("dX"), sg(*a, **kw))[1])
    orig = xhc_entry.XHCEntry.apply
    monkeypatch.setattr(xhc_entry.XHCEntry, "apply", lambda *a: (calls.append("entry"), orig(*a))[1])
    post = xhc_post.XHCPost.apply
    monkeypatch.setattr(xhc_post.XHCPost, "apply", lambda *a: (calls.append("post"), post(*a))[1])
    cfg = HCConfig(variant="xhc", **kw)
    outs_r, I_r, g_r = _run(cfg.replace(kernels="eager"), device, is_mlp)
    outs_f, I_f, g_f = _run(cfg.replace(kernels="triton"), device, is_mlp)
    want = ["entry", "post", "dX"] if is_mlp else ["entry", "dX"]
    assert calls == want, calls  # the fused path ran, dX written once
    assert torch.equal(I_f.cpu(), I_r.cpu())
    for a, b, w in zip(outs_f, outs_r, ("u", "out")):
        _close(a, b, w)
    assert g_r.keys() == g_f.keys()
    for name in g_r:
        _close(g_f[name], g_r[name], f"d{name}")


def test_fused_xhc_router_ties_go_to_the_lower_index():
    """A zero router: every score is σ(0) = ½, so the routed streams are the lowest k − m after the fixed ones."""
    _need_triton()
    cfg = HCConfig(variant="xhc", n=8, k=4, m=1)
    outs_r, I_r, g_r = _run(cfg.replace(kernels="eager"), "cpu", False, zero_router=True)
    outs_f, I_f, g_f = _run(cfg.replace(kernels="triton"), "cpu", False, zero_router=True)
    assert torch.equal(I_f, torch.arange(4).expand(S, B, 4))
    assert torch.equal(I_f, I_r)
    _close(outs_f[1], outs_r[1], "out")
    _close(g_f["router.weight"], g_r["router.weight"], "drouter.weight")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_xhc_bf16_state(device):
    """bf16 X, fp32 parameters: u and X' are the fp32 values rounded once (≤ 1 bf16 ulp = 2⁻⁸ relative,
    plus the fp32 coefficients' own rounding); gradients within a few bf16 ulps of their scale.
    The router's choice can flip on a near tie between fp32 orders of summation; the seed has none
    (the routing is compared exactly)."""
    _need_triton()
    cfg = HCConfig(variant="xhc", n=8, k=4, m=2, kernel_sizes=(2,), sinkhorn_iters=4)
    outs_r, I_r, g_r = _run(cfg.replace(kernels="eager"), device, True, dtype=torch.bfloat16, pdtype=torch.float32)
    outs_f, I_f, g_f = _run(cfg.replace(kernels="triton"), device, True, dtype=torch.bfloat16, pdtype=torch.float32)
    assert torch.equal(I_f.cpu(), I_r.cpu())
    for a, b, w in zip(outs_f, outs_r, ("u", "out")):
        assert a.dtype == torch.bfloat16
        _close(a, b, w, rtol=2 ** -7, atol=2 ** -7)
    for name in g_r:
        scale = g_r[name].abs().max().item() + 1e-6
        _close(g_f[name], g_r[name], f"d{name}", rtol=2 ** -5, atol=2 ** -5 * scale)


def test_fused_xhc_backward_is_deterministic_and_split_free(monkeypatch):
    """Two backwards give the same bits; the weights' gradients with 1 token split equal those with
    several (a fixed-order reduction, no atomics) to fp64 rounding."""
    _need_triton()
    from xhc.kernels import mhc_common

    cfg = HCConfig(variant="xhc", n=4, k=3, m=1, sinkhorn_iters=2, kernels="triton")
    split = lambda Sp: monkeypatch.setattr(  # noqa: E731  (BT = 2: float64 runs without tl.dot)
        mhc_common, "DEFAULT_BLOCKS", dict(mhc_common.DEFAULT_BLOCKS, xhc_dw={"BT": 2, "BK": 32, "S": Sp}))
    split(3)  # 6 tokens in 3 splits
    _, _, g1 = _run(cfg, "cpu", False)
    _, _, g2 = _run(cfg, "cpu", False)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name
    split(1)
    _, _, g3 = _run(cfg, "cpu", False)
    for name in ("router.weight", "pre.weight", "res.weight", "post.bias", "res.alpha"):
        _close(g3[name], g1[name], name)


@pytest.mark.parametrize("variant, target", [("xhc-attn", (6, 8)), ("xhc-mlp", (7, 9))])
def test_xhc_launch_counts_meet_targets(variant, target):
    """``bench.hc_kernels --launches`` for the xHC attention and MLP sublayers: ≤ 6 / 8 and ≤ 7 / 9
    forward / backward (docs/kernels.md "Launch counts"), every launch a Triton kernel."""
    _need_triton()
    from bench.hc_kernels import count_launches

    fwd, bwd, fnames, bnames = count_launches(variant, "triton", C=16, tokens=4)
    assert fwd <= target[0] and bwd <= target[1], (fwd, bwd, fnames, bnames)
    assert all(k.startswith("triton:") for k in list(fnames) + list(bnames)), (fnames, bnames)


def test_fused_xhc_write_falls_back_for_a_distributed_sequence():
    """A sequence split over ranks (a halo exchange) or a decode cache keeps the separate ops: the
    fused write needs every earlier row of y on this rank."""
    _need_triton()
    from xhc.temporal import SequenceContext as SC

    mod = XHCSublayer(HCConfig(variant="xhc", n=4, k=2, m=1, kernel_sizes=(2,), kernels="triton"), C, is_mlp=True)
    X, y = torch.randn(S, B, 4, C), torch.randn(S, B, C)
    assert mod._fused_post(X, y, None, "triton") and mod._fused_post(X, y, SC(pos_in_doc=POS), "triton")
    assert not mod._fused_post(X, y, SC(decode_cache={}), "triton")
    assert not mod._fused_post(X, y, None, "compile")


def test_every_autotuning_candidate_equals_eager(monkeypatch):
    """Each block-size candidate ``bench.hc_kernels --autotune`` may commit for the xHC kernels
    (``mhc_common.TUNE_GRID``) gives the eager float64 result, on 10 tokens: ragged last blocks for
    every BT.  Run i sets candidate i of every kernel's grid (cycling the shorter grids)."""
    _need_triton()
    from xhc.kernels import mhc_common as cm

    grids = {k: g for k, g in cm.TUNE_GRID.items() if k.startswith("xhc_") and k != "xhc_active"}
    assert set(grids) == {"xhc_entry_fwd", "xhc_entry_bwd", "xhc_dx", "xhc_dw", "xhc_dw_reduce"}
    cfg = HCConfig(variant="xhc", n=8, k=4, m=2, kernel_sizes=(2, 3))
    outs_r, I_r, g_r = _run(cfg.replace(kernels="eager"), "cpu", True)
    for i in range(max(len(g) for g in grids.values())):
        monkeypatch.setattr(cm, "OVERRIDE", {k: g[i % len(g)] for k, g in grids.items()})
        outs_f, I_f, g_f = _run(cfg.replace(kernels="triton"), "cpu", True)
        assert torch.equal(I_f, I_r), i
        for a, b, w in zip(outs_f, outs_r, ("u", "out")):
            _close(a, b, f"candidate set {i}: {w}")
        for name in g_r:
            _close(g_f[name], g_r[name], f"candidate set {i}: d{name}")


def _run_window(cfg, dtype=F64, pdtype=None):
    """A Flash (one layer) or Flash-4sub window with perturbed weights (float64 unless ``dtype``, the
    parameters in ``pdtype``); (X', grads)."""
    from xhc.flash import Flash4Window, XHCFlashLayer

    torch.manual_seed(0)
    mod = (XHCFlashLayer if cfg.variant == "xhc_flash" else Flash4Window)(cfg, C, layer_index=0).to(pdtype or dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=F64).to(p))
    X = torch.randn(S, B, cfg.n, C, generator=g, dtype=F64).to(dtype).requires_grad_()
    Go = torch.randn(S, B, cfg.n, C, generator=g, dtype=F64).to(dtype)
    Ws = [torch.randn(C, C, generator=g, dtype=F64).to(dtype) for _ in range(4)]
    branches = [lambda u, W=W: torch.tanh(u @ W) for W in Ws]
    seq = SequenceContext(pos_in_doc=POS)
    out = mod(X, *branches[:2], seq=seq) if cfg.variant == "xhc_flash" else mod(X, branches, seq=seq)
    grads = torch.autograd.grad((out * Go).sum(), [X] + list(mod.parameters()))
    return out, grads


@pytest.mark.parametrize("kw, modes", [
    pytest.param(dict(variant="xhc_flash", n=8, k=4, m=2, kernel_sizes=(2, 3)), ["exit"], id="flash"),
    pytest.param(dict(variant="xhc_flash", n=6, k=3, m=1, kernel_sizes=(2,), attn_temporal=True), ["exit"],
                 id="flash-attn-temporal"),
    pytest.param(dict(variant="xhc_flash4", n=8, k=4, m=2, kernel_sizes=(2, 3)), ["carried", "exit"], id="flash4"),
    pytest.param(dict(variant="xhc_flash4", n=16, k=8, m=0, kernel_sizes=(3,), gram_schmidt=False,
                      attn_temporal=True), ["carried"] * 3 + ["exit"], id="flash4-attn-temporal-no-gs"),
    pytest.param(dict(variant="xhc_flash4", n=6, k=3, m=1, kernel_sizes=(2,), ablate_res=True), ["carried", "exit"],
                 id="flash4-no-res"),
])
def test_flash_windows_write_through_the_fused_kernel(monkeypatch, kw, modes):
    """Every augmented write of a Flash window (carried X_a, the last one scattered into X^(0)) runs the
    fused write kernel on ``triton``, every write's mappings come from the fused active-mappings kernel,
    and the window equals eager in float64 (document resets, Gram–Schmidt on and
    off, temporal attention, no H_res); where the fused write does not run (a distributed sequence,
    a decode cache) the separate ops give the same."""
    _need_triton()
    from xhc import flash
    from xhc.kernels import xhc_active, xhc_entry, xhc_post
    from xhc.temporal import SequenceContext as SC

    calls = []
    post = xhc_post.XHCPost.apply

    def spy(X, Xa, *a):
        assert Xa is not None  # a window's writes never read X^(0)[I]: X_a is carried
        calls.append("carried" if X is None else "exit")
        return post(X, Xa, *a)

    monkeypatch.setattr(xhc_post.XHCPost, "apply", spy)
    entries = []  # the window entry in one kernel (xhc/kernels/xhc_entry.py: window_entry)
    entry = xhc_entry.XHCEntry.apply
    monkeypatch.setattr(xhc_entry.XHCEntry, "apply", lambda *a: (entries.append(a[-1][7]), entry(*a))[1])
    maps = []  # every write's mappings from the carried X_a in one kernel (xhc/kernels/xhc_active.py)
    active = xhc_active.XHCActive.apply
    monkeypatch.setattr(xhc_active.XHCActive, "apply",
                        lambda Xa, p, W_res, *a: (maps.append(W_res is not None), active(Xa, p, W_res, *a))[1])
    cfg = HCConfig(**kw)
    out_r, g_r = _run_window(cfg.replace(kernels="eager"))
    assert calls == [] and maps == []
    out_f, g_f = _run_window(cfg.replace(kernels="triton"))
    assert calls == modes, calls
    writes = 2 if cfg.variant == "xhc_flash" else 4  # H_res only at the window's last write
    assert entries == [writes], entries  # one entry op with a pre-map per sublayer
    assert maps == [False] * (writes - 1) + [not cfg.ablate_res], maps
    _close(out_f, out_r, "X'")
    for i, (a, b) in enumerate(zip(g_f, g_r)):
        _close(a, b, f"grad {i}")
    calls.clear()
    entries.clear()
    temporal = SimpleNamespace(conv=[None])  # one temporal kernel: what fused_write_runs reads of the module
    Xa, y = torch.randn(S, B, cfg.k, C), torch.randn(S, B, C)
    assert flash.fused_write_runs(temporal, Xa, y, SC(pos_in_doc=POS), "triton")
    assert not flash.fused_write_runs(temporal, Xa, y, SC(decode_cache={}), "triton")
    monkeypatch.setattr(flash, "fused_write_runs", lambda *a: False)
    out_d, g_d = _run_window(cfg.replace(kernels="triton"))
    assert calls == [] and entries == [writes]
    _close(out_d, out_r, "X' (separate ops)")
    for i, (a, b) in enumerate(zip(g_d, g_r)):
        _close(a, b, f"grad {i} (separate ops)")


def test_flash4_window_bf16_state_and_deterministic():
    """A bf16 Flash-4sub window with fp32 parameters on the fused kernels: X' within a few bf16 ulps of
    eager's (both round the carried X_a to bf16 after every write; fp32 orders of summation differ),
    gradients within a few bf16 ulps of their scale; two runs give the same bits."""
    _need_triton()
    cfg = HCConfig(variant="xhc_flash4", n=8, k=4, m=2, kernel_sizes=(2,), sinkhorn_iters=4)
    out_r, g_r = _run_window(cfg.replace(kernels="eager"), torch.bfloat16, torch.float32)
    out_f, g_f = _run_window(cfg.replace(kernels="triton"), torch.bfloat16, torch.float32)
    assert out_f.dtype == torch.bfloat16
    _close(out_f, out_r, "X'", rtol=2 ** -6, atol=2 ** -6)
    for i, (a, b) in enumerate(zip(g_f, g_r)):
        scale = b.abs().max().item() + 1e-6
        _close(a, b, f"grad {i}", rtol=2 ** -4, atol=2 ** -4 * scale)
    out_2, g_2 = _run_window(cfg.replace(kernels="triton"), torch.bfloat16, torch.float32)
    assert torch.equal(out_2, out_f) and all(torch.equal(a, b) for a, b in zip(g_2, g_f))


def test_every_autotuning_candidate_of_the_window_mappings_equals_eager(monkeypatch):
    """Each ``xhc_active`` block size the autotuning may commit gives a Flash-4sub window equal to eager
    in float64 (10 tokens: a ragged last block for every BT)."""
    _need_triton()
    from xhc.kernels import mhc_common as cm

    cfg = HCConfig(variant="xhc_flash4", n=8, k=4, m=2, kernel_sizes=(2,))
    out_r, g_r = _run_window(cfg.replace(kernels="eager"))
    assert len(cm.TUNE_GRID["xhc_active"]) >= 2
    for cand in cm.TUNE_GRID["xhc_active"]:
        monkeypatch.setattr(cm, "OVERRIDE", {"xhc_active": cand})
        out_f, g_f = _run_window(cfg.replace(kernels="triton"))
        _close(out_f, out_r, f"{cand}: X'")
        for i, (a, b) in enumerate(zip(g_f, g_r)):
            _close(a, b, f"{cand}: grad {i}")


@pytest.mark.parametrize("K", [1, 3])
def test_flash_attention_write_with_the_correction_equals_its_formula(K):
    """X_a' = X_a + P·V and u_M = inp + Σ_t β_t·V_t, β_t = Σ_j h[1, I_j]·P[j, t] (docs/math.md §4.1) and every
    gradient, float64, against autograd through the formula; with only one of the two outputs used too."""
    _need_triton()
    from xhc.kernels.flash_attn import flash_attn

    g = torch.Generator().manual_seed(3)
    T, N, k, Cw = 6, 8, 3, 40  # C not a multiple of the block: a ragged last block
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64).requires_grad_()  # noqa: E731
    Xa, P, V, inp, h = r(2, 3, k, Cw), r(2, 3, k, K), r(2, 3, K, Cw), r(2, 3, Cw), r(2, 3, 2, N)
    I = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(6)]).view(2, 3, k)
    Go, Gu = torch.randn(2, 3, k, Cw, generator=g, dtype=F64), torch.randn(2, 3, Cw, generator=g, dtype=F64)

    def ref(Xa, P, V, inp, h):
        beta = torch.einsum("...j,...jt->...t", h[..., 1, :].gather(-1, I), P)
        return Xa + P @ V, inp + torch.einsum("...t,...tc->...c", beta, V)

    ins = [Xa, P, V, inp, h]
    for use in ("both", "out", "u"):
        a_out, a_u = flash_attn(Xa, P, V, inp, I, h, 1, F64)
        b_out, b_u = ref(*ins)
        _close(a_out, b_out, "X_a'")
        _close(a_u, b_u, "u_M")
        la = (a_out * Go).sum() * (use != "u") + (a_u * Gu).sum() * (use != "out")
        lb = (b_out * Go).sum() * (use != "u") + (b_u * Gu).sum() * (use != "out")
        ga = torch.autograd.grad(la, ins, allow_unused=True)
        gb = torch.autograd.grad(lb, ins, allow_unused=True)
        for name, t, x, y in zip(["X_a", "P", "V", "inp", "h"], ins, ga, gb):
            _close(torch.zeros_like(t) if x is None else x, torch.zeros_like(t) if y is None else y, f"{use}: d{name}")
    assert (torch.autograd.grad((flash_attn(Xa, P, V, inp, I, h, 1, F64)[1] * Gu).sum(), h)[0][..., 0, :] == 0).all()


def test_flash_window_carried_state_gradient_is_written_once(monkeypatch):
    """In an xHC-Flash window on ``triton`` every carried X_a's gradient comes out of one kernel: each
    write hands its dX_a to the active-mappings op that made its P (which adds it in the kernel that
    writes dX_a), the window's last write hands its dX^(0) term to the window entry; the result still
    equals eager (float64)."""
    _need_triton()
    from xhc.kernels import state_grad as triton_ops, xhc_active

    cfg = HCConfig(variant="xhc_flash", n=8, k=4, m=2, kernel_sizes=(2,))
    out_r, g_r = _run_window(cfg.replace(kernels="eager"))
    handed = []
    hand = triton_ops.hand_over
    monkeypatch.setattr(triton_ops, "hand_over", lambda o, slot, t: (handed.append((type(o).__name__, slot)),
                                                                       hand(o, slot, t))[1])
    out_f, g_f = _run_window(cfg.replace(kernels="triton"))
    active = xhc_active.XHCActive._backward_cls.__name__
    assert handed.count((active, "dxa")) == 2, handed  # the attention write's and the MLP write's
    assert [s for _, s in handed].count("write") == 1, handed  # the last write's dX^(0) term, to the entry
    _close(out_f, out_r, "X'")
    for i, (a, b) in enumerate(zip(g_f, g_r)):
        _close(a, b, f"grad {i}")
