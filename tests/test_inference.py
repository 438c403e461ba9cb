"""Inference never needs autograd, and ``kernels: auto`` decides without measuring.

* Every HC variant on every backend runs forward-only under ``torch.no_grad()`` and
  ``torch.inference_mode()`` and gives the output of the grad-enabled forward on the same backend,
  which itself equals the float64 eager reference (tests/test_hc_kernels.py); Triton runs under
  the interpreter on CPU.
* The Megatron model forward runs under ``torch.inference_mode()`` for every variant.
* ``auto`` resolves by a fixed rule: two fresh processes agree, one of them while the CPU is
  saturated, and the retired ``XHC_HC_KERNELS_AUTO`` variable changes nothing (it warns).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from tests.test_hc_kernels import _build, _cfg, _perturb, _run, _variant_cases, C, B, S, POS  # noqa: F401
from xhc import kernels
from xhc.temporal import SequenceContext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _forward(kind, cfg, mode, dtype=torch.float64):
    torch.manual_seed(0)
    mod = _build(kind, cfg).to(dtype)
    _perturb(mod, 1)
    X = torch.randn(S, B, cfg.n, C, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    seq = SequenceContext(pos_in_doc=POS)
    if mode == "grad":
        return _run(kind, mod, X.requires_grad_(True), seq).detach()
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        out = _run(kind, mod, X, seq)
    assert not out.requires_grad
    return out.clone()


def _check_backend(kind, kw, n, backend, dtype=torch.float64, tol=1e-12):
    cfg = _cfg(kw, n).replace(kernels=backend)
    ref = _forward(kind, cfg, "grad", dtype)
    for mode in ("no_grad", "inference_mode"):
        got = _forward(kind, cfg, mode, dtype)
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol, msg=f"{backend} {kind} N={n} {mode}")


@pytest.mark.parametrize("backend", ["eager", "compile", "auto"])
@pytest.mark.parametrize("kind, kw, n", list(_variant_cases()))
def test_forward_only_every_variant_cpu(kind, kw, n, backend):
    _check_backend(kind, kw, n, backend)


@pytest.mark.interp
@pytest.mark.parametrize("kind, kw, n", [c for c in _variant_cases() if c.values[2] == 4])
def test_forward_only_every_variant_triton_interpreter(kind, kw, n):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.fail("TRITON_INTERPRET=1 is not set (tests/conftest.py sets it on machines without CUDA)")
    assert kernels.resolve_backend("triton", "cpu") == "triton"
    _check_backend(kind, kw, n, "triton")


@pytest.mark.interp
def test_liger_forward_only():
    """``kernels: liger`` (mHC, col_last) forward-only under both modes."""
    pytest.importorskip("liger_kernel")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.fail("TRITON_INTERPRET=1 is not set (tests/conftest.py sets it on machines without CUDA)")
    # Liger's op takes fp32 states (not float64): the same op with and without autograd, fp32 round-off
    _check_backend("hc", dict(variant="mhc", sinkhorn_order="col_last"), 4, "liger", torch.float32, 1e-6)


# ------------------------------------------------------------------------------------------------
@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_model_inference_mode_every_variant():
    from models.parallel import initialize_parallel
    from models.zoo import build_model, build_transformer_config, load_preset

    initialize_parallel()
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).unsqueeze(0)
    for v in ["vanilla", "hc", "mhc", "mhc-lite", "kromhc", "identity", "xhc", "xhc-flash", "xhc-flash4"]:
        preset = load_preset(f"tiny-moe:{v}")
        torch.manual_seed(0)
        model = build_model(preset, build_transformer_config(preset, cpu=True), use_transformer_engine=False,
                            vocab_size=64, seq_length=16).eval()
        with torch.no_grad():
            ref = model(tokens, pos, None)
        with torch.inference_mode():
            got = model(tokens, pos, None)
        assert torch.isfinite(got).all(), v
        torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=v)


# ------------------------------------------------------------------------------------------------
_RESOLVE = ("import warnings, json; warnings.simplefilter('ignore'); from xhc import kernels; "
            "print('BACKEND', json.dumps([kernels.resolve_backend(k, 'cpu') for k in ('auto', 'liger', 'triton')]))")


def _resolve_in_fresh_process(env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XHC_", "TRITON_", "TORCHDYNAMO_"))}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", _RESOLVE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return [ln for ln in out.splitlines() if ln.startswith("BACKEND")][-1]


@pytest.mark.slow
def test_auto_is_the_same_in_fresh_processes_under_load():
    idle = _resolve_in_fresh_process()
    burners = [subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<60: pass"])
               for _ in range(max(os.cpu_count() or 1, 2))]
    try:
        time.sleep(0.5)
        loaded = _resolve_in_fresh_process()
        retired = _resolve_in_fresh_process({"XHC_HC_KERNELS_AUTO": "eager"})
    finally:
        for p in burners:
            p.kill()
    assert idle == loaded == retired
    assert idle.startswith('BACKEND ["compile"')  # CPU, no interpreter: the fixed rule


def test_auto_rule_and_retired_variable(monkeypatch):
    assert kernels.resolve_backend("auto", "cpu") == "compile"
    assert kernels.resolve_backend("eager", "cpu") == "eager"
    monkeypatch.setattr(kernels, "_RETIRED_ENV_CHECKED", False)
    monkeypatch.setenv("XHC_HC_KERNELS_AUTO", "eager")
    with pytest.warns(UserWarning, match="XHC_HC_KERNELS_AUTO is no longer read"):
        assert kernels.resolve_backend("auto", "cpu") == "compile"


def test_no_library_call_draws_from_the_global_rng():
    """Resolving ``auto`` (and building nothing else) leaves the global RNG where it was."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    for _ in range(3):
        kernels.resolve_backend("auto", "cpu")
    assert torch.equal(before, torch.get_rng_state())


def test_inference_first_then_training_in_one_process():
    """A process whose first HC call is under inference_mode (generate, evaluation) can train
    afterwards: nothing cached during inference is an inference tensor (mHC-lite's permutation
    matrices were, and the next recorded forward failed)."""
    from xhc import doubly_stochastic as ds
    from xhc.config import HCConfig
    from xhc.hyper_connection import HyperConnection

    ds._PERMUTATIONS.clear()
    hc = HyperConnection(HCConfig(variant="mhc_lite", n=4, kernels="eager"), 8, layer_index=1)
    X = torch.randn(3, 2, 4, 8)
    with torch.inference_mode():
        u, ctx = hc.read(X)
        hc.write(X, u, ctx)
    X.requires_grad_(True)
    u, ctx = hc.read(X)
    hc.write(X, u, ctx).sum().backward()
    assert X.grad is not None and torch.isfinite(X.grad).all()
