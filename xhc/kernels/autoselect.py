"""``kernels: auto`` on CPU: pick the fused torch ops or the eager reference by measuring them.

``auto`` resolves to ``triton`` on CUDA and to ``compile`` while ``torch.compile`` traces (see
:func:`xhc.kernels.resolve_backend`).  For HC code that runs *eagerly* on the CPU the fused ops
are not faster by construction (they exist to be compiled), so ``auto`` times one probe — the
read and write of an xHC sublayer (N = 8, k = 4, C = 256, forward + backward) and of
an mHC sublayer (n = 4), 128 tokens — with both backends and takes the faster, once per process.

* ``XHC_HC_KERNELS_AUTO=compile|eager`` fixes the choice without measuring (tests, reproducible runs).
* :func:`decide` runs the probe now; with ``broadcast=True`` in a ``torch.distributed`` job rank 0
  measures and every rank takes its answer (ranks must agree: replicated HC parameters would
  otherwise drift apart by rounding).  ``xhc-pretrain`` calls it at start-up.
* Without :func:`decide`, the first ``auto`` resolution on a CPU tensor probes — unless
  ``torch.distributed`` is initialised with several ranks (a probe per rank could disagree, and a
  collective inside the first forward could deadlock a pipeline), then it takes ``compile`` and
  warns once.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

ENV = "XHC_HC_KERNELS_AUTO"
CHOICES = ("compile", "eager")
log = logging.getLogger(__name__)


@dataclass
class AutoChoice:
    backend: str  # "compile" | "eager"
    source: str  # "env" | "measured" | "rank 0" | "default (distributed, not measured)" | "set"
    ms: Dict[str, float] = field(default_factory=dict)  # probe time per backend (median, ms)

    def describe(self) -> str:
        t = ", ".join(f"{b} {v:.2f} ms" for b, v in self.ms.items())
        return f"HC kernels auto (CPU): {self.backend} ({self.source}{'; probe ' + t if t else ''})"


_CHOICE: Optional[AutoChoice] = None


def _env_choice() -> Optional[AutoChoice]:
    v = os.environ.get(ENV, "").strip()
    if not v:
        return None
    if v not in CHOICES:
        raise ValueError(f"{ENV}={v!r} is invalid: allowed values are {', '.join(CHOICES)} (or unset it to measure)")
    return AutoChoice(v, "env")


def _probe_units(backend: str):
    """Forward + backward closures of the probe's HC code on ``backend`` (fixed seed, CPU, fp32)."""
    from xhc.config import HCConfig
    from xhc.hyper_connection import HyperConnection
    from xhc.xhc import XHCSublayer

    g = torch.Generator().manual_seed(0)
    C, s, b = 256, 64, 2
    units = []
    xc = HCConfig(variant="xhc", n=8, k=4, m=2, kernels=backend)
    mc = HCConfig(variant="mhc", n=4, kernels=backend)
    for hc, n in ((XHCSublayer(xc, C, is_mlp=True, layer_index=1), 8), (HyperConnection(mc, C, layer_index=1), 4)):
        X = torch.randn(s, b, n, C, generator=g, requires_grad=True)
        y = torch.randn(s, b, C, generator=g, requires_grad=True)

        def run(hc=hc, X=X, y=y):
            u, ctx = hc.read(X)
            out = hc.write(X, y + 0.0 * u.sum(), ctx)
            out.sum().backward()
            X.grad = y.grad = None
            for p in hc.parameters():
                p.grad = None

        units.append(run)
    return units


def measure(reps: int = 3, timer: Callable[[], float] = time.perf_counter) -> Dict[str, float]:
    """Median forward + backward time (ms) of the probe per backend, interleaved so that machine
    load affects both alike.  ``timer`` is injectable for tests."""
    runs = {b: _probe_units(b) for b in CHOICES}
    for b in CHOICES:  # warm-up: allocator, lazy init
        for r in runs[b]:
            r()
    times: Dict[str, list] = {b: [] for b in CHOICES}
    for _ in range(reps):
        for b in CHOICES:
            t0 = timer()
            for r in runs[b]:
                r()
            times[b].append(1e3 * (timer() - t0))
    return {b: statistics.median(v) for b, v in times.items()}


def pick(ms: Dict[str, float]) -> str:
    """The faster backend; ``compile`` on a tie (it is what a compiled model uses)."""
    return "compile" if ms["compile"] <= ms["eager"] else "eager"


def _distributed_world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_available() and torch.distributed.is_initialized() else 1


def decide(broadcast: bool = True, refresh: bool = False, reps: int = 3) -> AutoChoice:
    """Fix the CPU ``auto`` choice now (env override, else measured; in a distributed job with
    ``broadcast``, measured on rank 0 and sent to every rank).  Returns it and logs it once."""
    global _CHOICE
    if _CHOICE is not None and not refresh:
        return _CHOICE
    choice = _env_choice()
    if choice is None:
        world = _distributed_world()
        if world > 1 and broadcast:
            rank = torch.distributed.get_rank()
            ms = measure(reps) if rank == 0 else {b: 0.0 for b in CHOICES}
            t = torch.tensor([ms["compile"], ms["eager"]], dtype=torch.float64)
            if torch.distributed.get_backend() == "nccl":
                t = t.cuda()
            torch.distributed.broadcast(t, src=0)
            ms = {"compile": float(t[0]), "eager": float(t[1])}
            choice = AutoChoice(pick(ms), "rank 0" if rank else "measured", ms)
        else:
            ms = measure(reps)
            choice = AutoChoice(pick(ms), "measured", ms)
    _CHOICE = choice
    log.info(choice.describe())
    return choice


def set_choice(backend: str) -> AutoChoice:
    """Fix the CPU ``auto`` choice by hand (``compile`` or ``eager``)."""
    global _CHOICE
    if backend not in CHOICES:
        raise ValueError(f"set_choice backend={backend!r}: allowed values are {', '.join(CHOICES)}")
    _CHOICE = AutoChoice(backend, "set")
    return _CHOICE


def reset() -> None:
    """Forget the choice (the next ``auto`` resolution decides again)."""
    global _CHOICE
    _CHOICE = None


def current() -> Optional[AutoChoice]:
    return _CHOICE


def cpu_backend() -> str:
    """The backend ``auto`` means for CPU tensors outside ``torch.compile``."""
    global _CHOICE
    if _CHOICE is not None:
        return _CHOICE.backend
    env = _env_choice()
    if env is not None:
        _CHOICE = env
        return env.backend
    if _distributed_world() > 1:
        _CHOICE = AutoChoice("compile", "default (distributed, not measured)")
        warnings.warn("HCConfig.kernels='auto' on CPU in a distributed job without xhc.kernels.autoselect.decide(): "
                      f"using 'compile' on every rank; call decide() after init_process_group, or set {ENV}")
        return "compile"
    return decide(broadcast=False).backend
