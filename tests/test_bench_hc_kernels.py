"""bench.hc_kernels counters: the bytes they report on ops whose traffic is known by hand.

The benchmark's traffic columns are only as good as these counters, so each is checked on a
known op: an elementwise add (read 2, write 1), a matmul, a broadcast (the storage, not the
logical size), views (nothing), an in-place op, backward of a mul, the saved-tensor count of a
known graph, and the inductor kernel count of a compiled add.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench.hc_kernels import ByteCounter, SavedCounter, inductor_bytes, measure


def test_add_counts_two_reads_and_one_write():
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    with ByteCounter() as bc:
        x + y
    assert bc.bytes == 3 * 64 * 32 * 4 and bc.ops == 1


def test_matmul_counts_operands_and_result():
    a, b = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    with ByteCounter() as bc:
        a @ b
    assert bc.bytes == (8 * 16 + 16 * 4 + 8 * 4) * 8


def test_views_move_nothing_and_broadcast_counts_storage():
    x = torch.randn(10, 20)
    with ByteCounter() as bc:
        v = x.view(200).reshape(20, 10).t().unsqueeze(0).expand(3, 10, 20)
        x.detach()
    assert bc.bytes == 0 and bc.ops == 0
    s = torch.randn(1, 20)
    with ByteCounter() as bc:
        x * s.expand(10, 20)  # broadcast operand: its 20 stored elements
    assert bc.bytes == (200 + 20 + 200) * 4
    del v


def test_inplace_and_bf16_sizes():
    x = torch.randn(100, dtype=torch.bfloat16)
    with ByteCounter() as bc:
        x.mul_(2.0)
    assert bc.bytes == 2 * 100 * 2  # read x, write x (bf16: 2 bytes)


def test_backward_of_mul_counts_the_gradient_kernels():
    a = torch.randn(50, requires_grad=True)
    b = torch.randn(50, requires_grad=True)
    out = a * b
    g = torch.ones(50)
    with ByteCounter() as bc:
        out.backward(g)
    # da = g·b and db = g·a: two muls of 3 × 50 floats; accumulating into fresh .grad is a no-copy alias
    assert bc.by_op.get("mul") == 2 * 3 * 50 * 4


def test_saved_counter_counts_each_storage_once_and_skips_excluded():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedCounter(exclude=[w]) as sc:
        h = x @ w              # saves x and w (w excluded)
        y = torch.tanh(h)      # saves its output y
        z = y * x              # saves y and x again (same storages)
    assert sc.bytes == (4 * 8 + 4 * 8) * 4 and sc.count == 2
    del z


@pytest.mark.inductor
def test_inductor_count_of_a_compiled_add():
    pytest.importorskip("torch._inductor")
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: a + b, fullgraph=True)
    a, b = torch.randn(256), torch.randn(256)
    with inductor_bytes() as nbytes:
        try:
            f(a, b)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # no C++ toolchain for inductor's CPU backend
            pytest.skip(f"torch.compile unavailable here: {type(e).__name__}")
        counted = nbytes()
    assert counted == 3 * 256 * 4


def test_vanilla_row_is_the_residual_add():
    """The benchmark's vanilla unit moves exactly x, y -> x + y forward (3C) and nothing but the
    gradient pass-through in backward; it saves nothing."""
    r = measure("vanilla", "eager", 64, 8, "cpu", torch.float32, reps=1)
    assert r.fwd == pytest.approx(3.0) and r.acct == 3.0
    assert r.saved is None


def test_slope_row_removes_per_call_bytes():
    """--slope: with bytes a·T + b (b per call, e.g. weight reads) each column reads a + b/T per
    token; two runs at T and 2T give a back exactly, and the times are dropped."""
    from bench.hc_kernels import Row, slope_row

    a, b, T = 7.5, 96.0, 16

    def row(tokens):
        return Row("mhc", "triton", 64, tokens, 34.0, fwd=a + b / tokens, bwd=2 * a + 3 * b / tokens,
                   saved=5.0, saved_rc=5.0 + b / tokens, floor=5.0, ms=1.0)

    r = slope_row(row(T), row(2 * T))
    assert r.fwd == pytest.approx(a) and r.bwd == pytest.approx(2 * a)
    assert r.saved == pytest.approx(5.0) and r.saved_rc == pytest.approx(5.0)
    assert r.ms is None and r.tokens == T and "slope 16->32" in r.count_method


# ------------------------------------------------------------------------------------------------
# --launches, --perf, --autotune (the Triton kernels in the interpreter)
# ------------------------------------------------------------------------------------------------
LAUNCH_CEILING = {  # docs/kernels.md "Launch counts": the targets (per sublayer, forward / backward)
    "mhc": (5, 6), "xhc-attn": (6, 8), "xhc-mlp": (7, 9), "flash": (6, 8), "flash4": (5, 7)}


def _interp(monkeypatch):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.interp
def test_launches_prints_one_line_per_variant_within_targets(monkeypatch, capsys):
    import re

    from bench.hc_kernels import main

    _interp(monkeypatch)
    assert main(["--device", "cpu", "--launches", "--hidden", "16", "--tokens", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    got = {}
    for line in lines:
        m = re.fullmatch(r"launches (\S+) fwd (\d+) bwd (\d+)", line)
        assert m, line
        got[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    assert list(got) == ["mhc", "xhc-attn", "xhc-mlp", "flash", "flash4"]
    for v, (f, b) in got.items():
        assert f <= LAUNCH_CEILING[v][0] and b <= LAUNCH_CEILING[v][1], (v, f, b)


@pytest.mark.interp
def test_perf_smoke_times_every_fused_kernel(monkeypatch, tmp_path):
    """``--perf`` on CPU: the mHC unit and each of its seven kernels get a time, a floor and a
    fraction of the given copy rate, and the files land in --out."""
    import json

    from bench.hc_kernels import perf_main

    _interp(monkeypatch)
    rows = perf_main("cpu", 16, 4, torch.float32, 1, str(tmp_path), 100.0, variants=("mhc",))
    names = {r["what"] for r in rows}
    assert {"unit", "_mhc_pre_fwd_kernel", "_mhc_post_fwd_kernel", "_mhc_post_bwd_kernel", "_mhc_pre_bwd_kernel",
            "_mhc_dx_kernel", "_mhc_dw_kernel", "_mhc_dw_reduce_kernel"} == names
    unit = next(r for r in rows if r["what"] == "unit")
    assert unit["floor_bytes"] == (5 * 4 + 5) * 16 * 4 * 4  # (5N + 5)·C·itemsize·tokens
    for r in rows:
        assert r["seconds"] > 0 and r["floor_bytes"] > 0 and r["fraction"] == pytest.approx(r["gbps"] / 100.0)
    packed = json.loads((tmp_path / "hc_perf.json").read_text())
    assert packed["rows"]
    assert (tmp_path / "hc_perf.txt").read_text().startswith("# HC perf")
    # the GPU call's target table (bench/gpu_checks.py) reads the whole unit's fraction, never a kernel's,
    # whatever order the rows come in
    from bench.gpu_checks import bandwidth_fractions

    assert bandwidth_fractions(packed) == {"mhc": pytest.approx(unit["fraction"])}
    assert bandwidth_fractions({"rows": packed["rows"][::-1]}) == {"mhc": pytest.approx(unit["fraction"])}


@pytest.mark.interp
@pytest.mark.extended  # bench tooling, ~30 s interpreted (CONTRIBUTING.md, "Test tiers": run it when a kernel's
# block sizes or bench.hc_kernels --autotune change)
def test_autotune_smoke_writes_blocks_the_kernels_read(monkeypatch, tmp_path):
    from bench.hc_kernels import autotune_main
    from xhc.kernels import mhc_common as cm

    _interp(monkeypatch)
    out = tmp_path / "tuned.json"
    res = autotune_main("cpu", 16, 4, torch.float32, 1, str(out), grid_limit=1)
    # the mHC kernels at the mHC sublayer's N = 4, the fused xHC kernels at the xHC MLP sublayer's N = 16,
    # the Flash writes' mappings at the carried k = 4 rows
    assert set(res) == set(cm.TUNE_GRID) and any(k.startswith("xhc_") for k in res) and "xhc_active" in res
    assert all(set(v) == {"N16_C16" if k.startswith("xhc_") and k != "xhc_active" else "N4_C16"}
               for k, v in res.items())
    assert all(next(iter(res[k].values())) == cm.TUNE_GRID[k][0] for k in res)  # one candidate each: it wins
    assert json.loads(out.read_text()) == res
    monkeypatch.setattr(cm, "TUNED_FILE", str(out))
    cm._tuned.cache_clear()
    try:
        assert cm.blocks("mhc_dw", 4, 16) == cm.TUNE_GRID["mhc_dw"][0]
        assert cm.blocks("mhc_dw", 4, 32) == cm.DEFAULT_BLOCKS["mhc_dw"]  # a shape not tuned: the defaults
        assert cm.TUNE_GRID["xhc_entry_bwd"][0] != cm.DEFAULT_BLOCKS["xhc_entry_bwd"]  # so the file is what decides
        assert cm.blocks("xhc_entry_bwd", 16, 16) == cm.TUNE_GRID["xhc_entry_bwd"][0]
    finally:
        cm._tuned.cache_clear()
