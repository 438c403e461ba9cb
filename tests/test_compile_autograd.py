"""The fused ops' custom autograd functions traced by dynamo (``backend="eager"``: no inductor, so
this is fast) give the gradients of the float64 references.

With torch 2.11, a custom function whose forward returned a no-op ``.to(dtype)`` of its result got
zero gradients under ``torch.compile`` (the compiled HC path trained nothing); the ops now return
fresh tensors (``xhc.kernels.torch_ops._cast``).  This file is the quick check of that on whatever
torch is installed (the device image has 2.11; ``tools/device_env_check.sh`` runs it there).
"""
import pytest
import torch

from xhc import kernels
from xhc.kernels import torch_ops

F64 = torch.float64


def _grads(fn, leaves, G):
    out = fn()
    return out, torch.autograd.grad((out * G).sum(), leaves)


def _dynamo(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)


@pytest.mark.parametrize("with_I", [False, True])
def test_write_gradients_under_dynamo(with_I):
    g = torch.Generator().manual_seed(3)
    T, N, k, K, C = 4, 6, 3, 2, 5
    X = torch.randn(T, N, C, generator=g, dtype=F64, requires_grad=True)
    I = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(T)]) if with_I else None
    Xa = None if with_I else torch.randn(T, k, C, generator=g, dtype=F64, requires_grad=True)
    H = torch.randn(T, k, k, generator=g, dtype=F64, requires_grad=True)
    P = torch.randn(T, k, K, generator=g, dtype=F64, requires_grad=True)
    V = torch.randn(T, K, C, generator=g, dtype=F64, requires_grad=True)
    G = torch.randn(T, N if with_I else k, C, generator=g, dtype=F64)
    leaves = [t for t in (X if with_I else None, Xa, H, P, V) if t is not None]
    xa_ref = (lambda: X[torch.arange(T)[:, None], I]) if with_I else (lambda: Xa)
    ref, ref_g = _grads(lambda: torch_ops.write_reference(X if with_I else None, I, xa_ref(), H, P, V), leaves, G)
    fn = _dynamo(lambda X_, Xa_, H_, P_, V_: kernels.write(X_, I, Xa_, H_, P_, V_, backend="compile"))
    got, got_g = _grads(lambda: fn(X if with_I else None, Xa, H, P, V), leaves, G)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_g, ref_g):
        assert a.abs().max() > 0  # the failure mode was all-zero gradients
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_read_gradients_under_dynamo():
    g = torch.Generator().manual_seed(4)
    T, n, C = 5, 4, 6
    h = torch.randn(T, 1, n, generator=g, dtype=F64, requires_grad=True)
    X = torch.randn(T, n, C, generator=g, dtype=F64, requires_grad=True)
    G = torch.randn(T, 1, C, generator=g, dtype=F64)
    ref, ref_g = _grads(lambda: torch.einsum("tqj,tjc->tqc", h, X), [h, X], G)  # u = Σ_j h_j X_j
    fn = _dynamo(lambda h_, X_: torch_ops.read(h_, X_, F64))
    got, got_g = _grads(lambda: fn(h, X), [h, X], G)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_g, ref_g):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
