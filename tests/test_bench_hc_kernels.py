"""bench.hc_kernels counters: the bytes they report on ops whose traffic is known by hand.

The benchmark's traffic columns are only as good as these counters, so each is checked on a
known op: an elementwise add (read 2, write 1), a matmul, a broadcast (the storage, not the
logical size), views (nothing), an in-place op, backward of a mul, the saved-tensor count of a
known graph, and the inductor kernel count of a compiled add.
"""

from __future__ import annotations

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
