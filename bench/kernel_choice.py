"""Measure which HC backend is faster for CPU tensors run eagerly: ``python -m bench.hc_kernels --recommend``.

``kernels: auto`` no longer measures anything inside a library call (it resolves by a fixed rule,
:func:`xhc.kernels.resolve_backend`).  This is the measurement behind the CPU rule, as an explicit
tool: it times the read and write of an xHC sublayer (N = 8, k = 4), an mHC sublayer (n = 4) and a
Flash-4sub window's first layer at a few widths, forward only (inference) and forward + backward
(training), with the ``eager`` reference and the fused ``compile`` ops, interleaved so that machine
load affects both alike, and prints the median times, their ratio and the backend it recommends.

It builds its modules from its own generator inside :func:`torch.random.fork_rng`: the global RNG
(and so any model initialised after it) is left exactly as it was.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List

import torch

BACKENDS = ("eager", "compile")


def _units(backend: str, C: int, tokens: int, train: bool):
    from xhc.config import HCConfig
    from xhc.hyper_connection import HyperConnection
    from xhc.xhc import XHCSublayer

    g = torch.Generator().manual_seed(0)
    b = 2
    s = max(tokens // b, 1)
    out = []
    cases = (("xhc N=8 k=4", HCConfig(variant="xhc", n=8, k=4, m=2, kernels=backend), True),
             ("mhc n=4", HCConfig(variant="mhc", n=4, kernels=backend), False))
    for name, cfg, is_xhc in cases:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            hc = XHCSublayer(cfg, C, is_mlp=True, layer_index=1) if is_xhc else HyperConnection(cfg, C, layer_index=1)
        X = torch.randn(s, b, cfg.n, C, generator=g, requires_grad=train)
        y = torch.randn(s, b, C, generator=g, requires_grad=train)

        def run(hc=hc, X=X, y=y):
            if train:
                u, ctx = hc.read(X)
                hc.write(X, y + 0.0 * u.sum(), ctx).sum().backward()
                X.grad = y.grad = None
                for p in hc.parameters():
                    p.grad = None
            else:
                with torch.inference_mode():
                    u, ctx = hc.read(X)
                    hc.write(X, y + 0.0 * u.sum(), ctx)

        out.append((name, run))
    return out


def measure(C: int, tokens: int, train: bool, reps: int = 5) -> Dict[str, Dict[str, float]]:
    """``{case: {backend: median ms}}`` for one width and token count."""
    runs = {bk: _units(bk, C, tokens, train) for bk in BACKENDS}
    for bk in BACKENDS:  # warm-up
        for _, r in runs[bk]:
            r()
    times: Dict[str, Dict[str, List[float]]] = {}
    for _ in range(reps):
        for bk in BACKENDS:
            for name, r in runs[bk]:
                t0 = time.perf_counter()
                r()
                times.setdefault(name, {}).setdefault(bk, []).append(1e3 * (time.perf_counter() - t0))
    return {name: {bk: statistics.median(v) for bk, v in d.items()} for name, d in times.items()}


def recommend(hidden=(64, 256, 1024), tokens=(16, 256), reps: int = 5, threads=None, out=None) -> str:
    """Print the table and return the recommended CPU backend (the one faster in most rows)."""
    if out is None:
        def out(line):
            print(line, flush=True)
    if threads:
        torch.set_num_threads(threads)
    out(f"# HC backends on CPU, eager vs compile (torch {torch.__version__}, {torch.get_num_threads()} threads); "
        f"median of {reps}, ms per call")
    out(f"{'case':<14}{'mode':<10}{'C':>6}{'tokens':>8}{'eager':>10}{'compile':>10}{'eager/compile':>15}")
    wins = {bk: 0 for bk in BACKENDS}
    for train in (False, True):
        for C in hidden:
            for T in tokens:
                for name, ms in measure(C, T, train, reps).items():
                    ratio = ms["eager"] / ms["compile"]
                    wins["compile" if ratio >= 1.0 else "eager"] += 1
                    out(f"{name:<14}{'fwd+bwd' if train else 'forward':<10}{C:>6}{T:>8}{ms['eager']:>10.3f}"
                        f"{ms['compile']:>10.3f}{ratio:>14.2f}x")
    best = "compile" if wins["compile"] >= wins["eager"] else "eager"
    out(f"# faster in: compile {wins['compile']} rows, eager {wins['eager']} rows -> recommended for CPU: {best} "
        f"(`kernels: auto` on CPU is compile; set model.hc_kernels={best} to pin it)")
    return best
