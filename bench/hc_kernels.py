"""Hyper-connection kernels side by side: bytes moved, bytes saved for backward, time (docs/kernels-bench.md).

Run::

    python -m bench.hc_kernels                                   # CPU, fp32, C = 1024 and 2048, every variant/backend
    python -m bench.hc_kernels --device cpu --tokens 512 --backends eager,compile
    python -m bench.hc_kernels --device cuda --dtype bf16 --hidden 2048 --tokens 8192   # the GPU check
    python -m bench.hc_kernels --json runs/hc_kernels.json
    TRITON_INTERPRET=1 python -m bench.hc_kernels --device cpu --backends triton --reps 1   # Triton bytes on CPU

Per variant (vanilla residual, mHC N=4, xHC N=16 attention and MLP sublayer, xHC-Flash, Flash-4sub)
and per kernel backend (``HCConfig.kernels``: eager, compile, triton; liger on CUDA for the mHC row,
with ``sinkhorn_order: col_last``, the one configuration it covers), one *unit* is timed and
counted: the HC read and write of one sublayer (mHC, xHC), one layer (Flash: begin, two reads, two
writes) or one two-layer window (Flash-4sub), driven with fixed branch outputs ``y`` (the branch
itself is not part of the measurement).  Every number is divided by the tokens and by the
sublayers of the unit (Flash 2, Flash-4sub 4), so the columns read "per token per sublayer".

Columns
-------
``fwd`` / ``bwd``  bytes moved, in units of C elements of the state dtype (bytes / (C · itemsize)):
    * eager / triton / liger: a ``TorchDispatchMode`` adds up the input and output bytes of every aten op
      that is not a view (views, ``detach`` and metadata ops move nothing; a broadcast input counts
      its storage, not its logical size); Triton launches do not pass the dispatcher, so each
      ``JITFunction`` launch adds the bytes of its tensor arguments.
    * compile: the kernels inductor generated for the forward graph and for the backward graph,
      each counted by inductor's own estimate (``GraphLowering.count_bytes``, summed into
      ``torch._inductor.metrics.num_bytes_accessed``: per kernel the bytes of every buffer read or
      written, the smaller of the buffer size and the indexed range), GEMMs and other extern
      kernels included.
``acct``  the designed forward traffic of ``xhc.accounting`` (``memory_traffic_per_sublayer`` /
    ``memory_traffic_summary``, docs/math.md §5.3), elements in units of C.
``saved``  bytes kept for backward per token per sublayer, in units of C of the state dtype: every
    tensor handed to autograd's pack hook (``torch.autograd.graph.saved_tensors_hooks``) counted
    once per storage; parameters and the branch outputs' own graph excluded, the unit's input state
    and the ``y`` included (they are what an HC layer must keep).  ``floor`` = X + y = (N + 1)·C.
``rc/flr``  the same count under HC recompute (``models.hc_layer.HCRecompute``, the unit as one
    region: it keeps the entry state and the y's; Flash windows keep one state for 2 or 4 sublayers).
``ms`` / ``vs vanilla``  median wall time of forward + backward of the unit per sublayer, and its
    ratio to the vanilla residual add (``x + y`` and its backward).

Targets of the fused path (docs/kernels-bench.md): fwd ≤ 1.5 × acct, bwd ≤ 2 × fwd, saved ≤ 1.5 × floor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xhc.config import KERNEL_BACKENDS

VARIANTS = ("vanilla", "mhc", "xhc-attn", "xhc-mlp", "flash", "flash4")
BACKENDS = tuple(b for b in KERNEL_BACKENDS if b != "auto")  # every concrete backend
LIGER_VARIANTS = ("vanilla", "mhc")  # Liger-Kernel has only the Sinkhorn mHC map


# ================================================================================================
# Byte counters
# ================================================================================================
def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes an op touches in ``t``: its logical size, capped by its storage (a broadcast/expanded
    view reads the storage once)."""
    logical = t.numel() * t.element_size()
    try:
        return min(logical, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without storage (fake/meta)
        return logical


_NO_TRAFFIC = {"detach", "alias", "lift_fresh", "_unsafe_view", "empty", "empty_like", "empty_strided",
               "new_empty", "new_empty_strided", "set_", "resize_", "_local_scalar_dense", "sym_size",
               "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"}


def _leaves(obj) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            out.extend(_leaves(o))
    elif isinstance(obj, dict):
        for o in obj.values():
            out.extend(_leaves(o))
    return out


class ByteCounter(TorchDispatchMode):
    """Sum of input + output bytes of every non-view aten op run under it (``.bytes``; ``.ops`` counts
    the ops, ``.by_op`` the bytes per op name).  View ops (``OpOverload.is_view``), ``detach`` and
    allocation/metadata ops count nothing; an in-place op counts its operands read and its result written.

    >>> with ByteCounter() as bc:
    ...     z = x + y            # counts x, y and z
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops = 0
        self.by_op: Dict[str, int] = {}

    def add(self, name: str, nbytes: int) -> None:
        self.bytes += nbytes
        self.ops += 1
        self.by_op[name] = self.by_op.get(name, 0) + nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if getattr(func, "is_view", False) or name in _NO_TRAFFIC:
            return out
        nbytes = sum(tensor_bytes(t) for t in _leaves(args) + _leaves(kwargs))
        nbytes += sum(tensor_bytes(t) for t in _leaves(out))
        self.add(name, nbytes)
        return out


@contextlib.contextmanager
def count_triton_launches(counter: ByteCounter):
    """Add the tensor-argument bytes of every ``triton.jit`` kernel launch to ``counter`` (Triton
    kernels are launched outside the dispatcher).  Under ``TRITON_INTERPRET=1`` the interpreter
    copies every argument to and from host buffers with torch ops; those copies are not the
    kernel's traffic, so dispatch counting is suspended while a launch runs, and CPU counts of the
    ``triton`` backend mean what they would on a GPU.  A no-op without Triton."""
    try:
        from triton.runtime.jit import JITFunction
    except Exception:  # no triton
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except Exception:  # an interpreter-less Triton build
        pass
    origs = {cls: cls.run for cls in classes}

    def wrap(orig):
        def run(self, *args, **kwargs):
            if kwargs.get("warmup"):
                return orig(self, *args, **kwargs)
            ts = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            counter.add("triton:" + getattr(self, "__name__", "kernel"), sum(tensor_bytes(t) for t in ts))
            with _disable_current_modes():
                return orig(self, *args, **kwargs)

        return run

    for cls, orig in origs.items():
        cls.run = wrap(orig)
    try:
        yield
    finally:
        for cls, orig in origs.items():
            cls.run = orig


class SavedCounter:
    """Bytes of the tensors autograd saves for backward, each storage counted once.

    ``exclude``: tensors whose storages are not activations (parameters).  Use as a context manager
    around the forward; read ``.bytes`` (and ``.count``) afterwards.
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: Dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor):
        try:
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):
            key, nbytes = id(t), t.numel() * t.element_size()
        if key not in self._exclude:
            self._seen[key] = max(self._seen.get(key, 0), nbytes)
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def count(self) -> int:
        return len(self._seen)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


@contextlib.contextmanager
def inductor_bytes():
    """Yield a callable returning the bytes inductor has counted for the graphs compiled so far in
    this context (``torch._inductor.metrics.num_bytes_accessed``; needs the ``inductor_metrics`` log
    artifact at INFO, switched on here and restored after)."""
    from torch._inductor import metrics

    if os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":  # nothing would be compiled, so 0 bytes counted
        raise RuntimeError("inductor_bytes: torch.compile is switched off in this process (TORCHDYNAMO_DISABLE=1); "
                           "unset TORCHDYNAMO_DISABLE")
    log = torch._logging.getArtifactLogger("torch._inductor.compile_fx", "inductor_metrics")
    old_level, old_prop, old_disabled = log.level, log.propagate, log.disabled
    log.setLevel(logging.INFO)
    log.propagate = False  # count without printing the per-graph dicts
    log.disabled = False
    metrics.reset()
    # A graph served from inductor's FX-graph or AOTAutograd cache is not lowered again, so its
    # bytes would not be counted: compile afresh inside this context.
    caches = contextlib.ExitStack()
    caches.enter_context(torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False))
    try:
        import torch._functorch.config as functorch_config

        caches.enter_context(functorch_config.patch(enable_autograd_cache=False))
    except (ImportError, AttributeError, RuntimeError):  # older torch: no AOTAutograd cache
        pass
    try:
        with caches:
            yield lambda: metrics.num_bytes_accessed
    finally:
        log.setLevel(old_level)
        log.propagate, log.disabled = old_prop, old_disabled


# ================================================================================================
# Units: the HC code of one sublayer / layer / window, driven with fixed branch outputs
# ================================================================================================
@dataclass
class Unit:
    """``step(X, ys) -> outputs``; gradients ``grads`` are fed to every output in backward."""

    name: str
    n: int                       # streams of the state (1 for vanilla)
    sublayers: int               # sublayers the unit covers
    modules: List[torch.nn.Module]
    step: Callable
    acct: float                  # accounted forward traffic per sublayer, units of C


def hc_config(variant: str, kernels: str):
    """The benchmark's HCConfig for a variant (the zoo presets' shapes: mHC N=4; xHC N=16, k=4, m=2)."""
    from xhc.config import HCConfig

    kw = {}
    if "kernels" in HCConfig.__dataclass_fields__:
        kw["kernels"] = kernels
    if variant == "vanilla":
        return HCConfig(variant="none", **kw)
    if variant == "mhc":
        # kernels: liger covers only the col_last Sinkhorn (xhc/kernels/liger.py); same traffic
        return HCConfig(variant="mhc", n=4, **kw, **({"sinkhorn_order": "col_last"} if kernels == "liger" else {}))
    v = {"xhc-attn": "xhc", "xhc-mlp": "xhc", "flash": "xhc_flash", "flash4": "xhc_flash4"}[variant]
    return HCConfig(variant=v, n=16, k=4, m=2, **kw)


def build_unit(variant: str, C: int, backend: str, device, dtype) -> Unit:
    from xhc import accounting

    cfg = hc_config(variant, backend)
    if variant == "vanilla":
        return Unit(variant, 1, 1, [], lambda X, ys: (X + ys[0],), accounting.memory_traffic_summary(cfg).total)
    if variant == "mhc":
        from xhc.hyper_connection import HyperConnection

        hc = HyperConnection(cfg, C, layer_index=1).to(device)

        def step(X, ys):
            u, ctx = hc.read(X)
            return u, hc.write(X, ys[0], ctx)

        return Unit(variant, cfg.n, 1, [hc], step, accounting.memory_traffic_summary(cfg).total)
    if variant in ("xhc-attn", "xhc-mlp"):
        from xhc.xhc import XHCSublayer

        is_mlp = variant == "xhc-mlp"
        hc = XHCSublayer(cfg, C, is_mlp=is_mlp, layer_index=1).to(device)

        def step(X, ys):
            u, ctx = hc.read(X)
            return u, hc.write(X, ys[0], ctx)

        acct = accounting.memory_traffic_per_sublayer(cfg, "mlp" if is_mlp else "attention").total
        return Unit(variant, cfg.n, 1, [hc], step, acct)
    from xhc.flash import Flash4FirstLayer, Flash4SecondLayer, XHCFlashLayer

    acct = accounting.memory_traffic_summary(cfg).total
    if variant == "flash":
        fl = XHCFlashLayer(cfg, C, layer_index=0).to(device)

        def step(X, ys):
            st = fl.begin(X)
            ua = fl.attn_read(st)
            st = fl.attn_write(st, ys[0])
            um = fl.mlp_read(st)
            return ua, um, fl.mlp_write(st, ys[1])

        return Unit(variant, cfg.n, 2, [fl], step, acct)
    first, second = Flash4FirstLayer(cfg, C, layer_index=0).to(device), Flash4SecondLayer(cfg, C, layer_index=1).to(device)

    def step(X, ys):
        st = first.begin(X)
        us = [first.attn_read(st)]
        st = first.attn_write(st, ys[0])
        us.append(first.mlp_read(st))
        st = first.mlp_write(st, ys[1])
        us.append(second.attn_read(st))
        st = second.attn_write(st, ys[2])
        us.append(second.mlp_read(st))
        return (*us, second.mlp_write(st, ys[3]))

    return Unit(variant, cfg.n, 4, [first, second], step, acct)


# ================================================================================================
# Measurement
# ================================================================================================
@dataclass
class Row:
    variant: str
    backend: str
    C: int
    tokens: int
    acct: float
    fwd: Optional[float] = None
    bwd: Optional[float] = None
    saved: Optional[float] = None
    saved_rc: Optional[float] = None
    floor: Optional[float] = None
    ms: Optional[float] = None
    vs_vanilla: Optional[float] = None
    count_method: str = ""
    note: str = ""
    by_op: Dict[str, float] = field(default_factory=dict)  # dispatch-counted backends: "fwd op"/"bwd op" -> units of C

    @property
    def fwd_over_acct(self):
        return None if self.fwd is None or not self.acct else self.fwd / self.acct

    @property
    def bwd_over_fwd(self):
        return None if self.bwd is None or not self.fwd else self.bwd / self.fwd

    @property
    def saved_rc_over_floor(self):
        return None if self.saved_rc is None or not self.floor else self.saved_rc / self.floor

    @property
    def saved_over_floor(self):
        return None if self.saved is None or not self.floor else self.saved / self.floor


def _inputs(unit: Unit, C: int, tokens: int, device, dtype, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = 2 if tokens % 2 == 0 else 1
    s = tokens // b
    shape = (s, b, C) if unit.n == 1 else (s, b, unit.n, C)
    X = torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_()
    nys = 1 if unit.name in ("vanilla", "mhc", "xhc-attn", "xhc-mlp") else unit.sublayers
    ys = [torch.randn(s, b, C, generator=g).to(device=device, dtype=dtype).requires_grad_() for _ in range(nys)]
    return X, ys


def _backward(outs, grads):
    torch.autograd.backward(list(outs), list(grads))


def _grads_like(outs, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    return [torch.randn(o.shape, generator=g).to(device=o.device, dtype=o.dtype) for o in outs]


def measure(variant: str, backend: str, C: int, tokens: int, device, dtype, reps: int = 5, seed: int = 0,
            compile_mode: Optional[str] = None) -> Row:
    """One row of the table (see the module docstring for the method)."""
    unit = build_unit(variant, C, backend, device, dtype)
    row = Row(variant, backend, C, tokens, unit.acct)
    X, ys = _inputs(unit, C, tokens, device, dtype, seed)
    per = tokens * unit.sublayers * C * torch.tensor([], dtype=dtype).element_size()  # bytes -> units of C
    params = [p for m in unit.modules for p in m.parameters()]
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    step = unit.step
    compiled = backend == "compile"
    if compiled:
        torch._dynamo.reset()
        from xhc.kernels import compile_options  # the options xhc.kernels.compile_module (model.compile_hc) uses

        step = torch.compile(unit.step, fullgraph=True, options=compile_options(compile_mode))

    # ---- traffic ---------------------------------------------------------------------------
    if compiled:
        row.count_method = "inductor kernels"
        with inductor_bytes() as nbytes:
            outs = step(X, ys)
            f = nbytes()
            _backward(outs, _grads_like(outs, seed))
            b = nbytes() - f
        row.fwd, row.bwd = f / per, b / per
    else:
        row.count_method = "dispatch ops" + (" + triton launches" if backend in ("triton", "liger") else "")
        outs = step(X, ys)  # warm-up (autotuning, lazy init) outside the count
        _backward(outs, _grads_like(outs, seed))
        for t in [X, *ys, *params]:  # else the counted backward adds into .grad: not the HC's traffic
            t.grad = None
        fc, bc = ByteCounter(), ByteCounter()
        with count_triton_launches(fc), fc:
            outs = step(X, ys)
        grads = _grads_like(outs, seed)
        with count_triton_launches(bc), bc:
            _backward(outs, grads)
        row.fwd, row.bwd = fc.bytes / per, bc.bytes / per
        row.by_op = {f"{pas} {op}": n / per for pas, c in (("fwd", fc), ("bwd", bc)) for op, n in c.by_op.items()}
    X.grad = None
    for y in ys:
        y.grad = None

    # ---- saved for backward -----------------------------------------------------------------
    if variant != "vanilla":
        sc = SavedCounter(exclude=params)
        try:
            with sc:
                outs = step(X, ys)
            row.saved = sc.bytes / per
        except Exception as e:  # a compiled graph may refuse Python pack hooks
            row.note = f"saved: {type(e).__name__}"
        row.floor = (unit.n + 1) * 1.0
        del outs
        try:  # HC recompute (models.hc_layer.HCRecompute): the unit as one region, inputs X and the y's
            from models.hc_layer import HCRecompute

            sc = SavedCounter(exclude=params)
            with sc:
                rc = HCRecompute(params)
                for t in [X] + ys:
                    rc.add_input(t)
                outs = rc.call(lambda X_, *ys_: step(X_, list(ys_)), X, *ys)
            row.saved_rc = sc.bytes / per
            del outs, rc
        except ImportError:  # a checkout without HC recompute
            pass

    # ---- time -------------------------------------------------------------------------------
    grads = None
    times = []
    for i in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        outs = step(X, ys)
        if grads is None:
            grads = _grads_like(outs, seed)
        _backward(outs, grads)
        sync()
        if i:  # first round warms up
            times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
        X.grad = None
        for y in ys:
            y.grad = None
    row.ms = 1e3 * statistics.median(times) / unit.sublayers
    return row


# ================================================================================================
# Launches: kernels one unit starts on a GPU
# ================================================================================================
LAUNCH_VARIANTS = ("mhc", "xhc-attn", "xhc-mlp", "flash", "flash4")


def count_launches(variant: str, backend: str = "triton", C: int = 64, tokens: int = 4, device="cpu",
                   dtype=torch.float32, seed: int = 0) -> Tuple[int, int, Dict[str, int], Dict[str, int]]:
    """(forward launches, backward launches, forward ops by name, backward ops by name) per *sublayer*
    of the unit: Triton kernel launches plus ATen ops that would launch a GPU kernel (views, ``detach``,
    allocation and metadata ops excluded, as in :class:`ByteCounter`).  A unit's counts are divided by
    its sublayers (Flash 2, Flash-4sub 4) and rounded up.  Counted after one warm-up step."""
    unit = build_unit(variant, C, backend, device, dtype)
    X, ys = _inputs(unit, C, tokens, device, dtype, seed)
    outs = unit.step(X, ys)
    _backward(outs, _grads_like(outs, seed))
    params = [p for m in unit.modules for p in m.parameters()]
    for t in [X, *ys, *params]:
        t.grad = None
    fc, bc = _OpCounter(), _OpCounter()
    with count_triton_launches(fc), fc:
        outs = unit.step(X, ys)
    grads = _grads_like(outs, seed)
    with count_triton_launches(bc), bc:
        _backward(outs, grads)
    per = lambda n: -(-n // unit.sublayers)  # noqa: E731
    return per(fc.ops), per(bc.ops), dict(fc.names), dict(bc.names)


class _OpCounter(ByteCounter):
    """:class:`ByteCounter` that also counts launches per op name (``.names``)."""

    def __init__(self):
        super().__init__()
        self.names: Dict[str, int] = {}

    def add(self, name: str, nbytes: int) -> None:
        super().add(name, nbytes)
        self.names[name] = self.names.get(name, 0) + 1


def launches_main(variants: Sequence[str], backend: str, C: int, tokens: int, device, dtype, verbose: bool) -> None:
    """One line per variant: ``launches <variant> fwd <F> bwd <B>`` (per sublayer)."""
    for v in variants:
        f, b, fn, bn = count_launches(v, backend, C, tokens, device, dtype)
        print(f"launches {v} fwd {f} bwd {b}", flush=True)
        if verbose:
            print(f"  fwd: {sorted(fn.items())}\n  bwd: {sorted(bn.items())}", file=sys.stderr)


# ================================================================================================
# Kernel timing, perf (fraction of the bandwidth floor) and autotuning of the fused mHC kernels
# ================================================================================================
PERF_VARIANTS = ("mhc", "xhc-mlp", "flash4")


@contextlib.contextmanager
def time_triton_launches(device):
    """Yield a dict kernel name -> list of launch times (seconds), filled as kernels launch: CUDA
    events around each launch on a GPU (read after a synchronize), wall time in the interpreter."""
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except Exception:
        pass
    origs = {cls: cls.run for cls in classes}
    cuda = torch.device(device).type == "cuda"
    pending: List[Tuple[str, object, object]] = []
    times: Dict[str, List[float]] = {}

    def wrap(orig):
        def run(self, *args, **kwargs):
            if kwargs.get("warmup"):
                return orig(self, *args, **kwargs)
            name = getattr(self, "__name__", "kernel")
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = orig(self, *args, **kwargs)
                b.record()
                pending.append((name, a, b))
                return out
            t0 = time.perf_counter()
            out = orig(self, *args, **kwargs)
            times.setdefault(name, []).append(time.perf_counter() - t0)
            return out

        return run

    for cls, orig in origs.items():
        cls.run = wrap(orig)

    def flush():
        if cuda:
            torch.cuda.synchronize()
            for name, a, b in pending:
                times.setdefault(name, []).append(a.elapsed_time(b) / 1e3)
            pending.clear()
        return times

    try:
        yield flush
    finally:
        for cls, orig in origs.items():
            cls.run = orig


def floor_units(unit: Unit) -> float:
    """The bandwidth floor of one unit's forward + backward, in units of C per token: every tensor
    read or written once — forward reads X (N·C) and each sublayer's y, writes X' and each u;
    backward reads dX', each du, X and each y, writes dX and each dy: (2N + 2L) + (3N + 3L) for a unit
    of L sublayers (a Flash window reads and writes its state once for all of them)."""
    n, L = unit.n, unit.sublayers
    return (2 * n + 2 * L) + (3 * n + 3 * L)


def _rotating(unit: Unit, C: int, tokens: int, device, dtype, k: int = 3):
    return [_inputs(unit, C, tokens, device, dtype, seed) for seed in range(k)]


def _timed_unit(unit: Unit, sets, reps: int, device):
    """Median forward + backward seconds of the unit over ``reps`` runs, cycling the input sets, and
    the median time of each Triton kernel per run."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    params = [p for m in unit.modules for p in m.parameters()]
    grads = None
    walls: List[float] = []
    per_kernel: Dict[str, List[float]] = {}
    for i in range(reps + 1):
        X, ys = sets[i % len(sets)]
        with time_triton_launches(device) as flush:
            sync()
            t0 = time.perf_counter()
            outs = unit.step(X, ys)
            if grads is None:
                grads = _grads_like(outs, 0)
            _backward(outs, grads)
            sync()
            wall = time.perf_counter() - t0
            ktimes = flush()
        if i:  # the first run warms up (JIT)
            walls.append(wall)
            for name, ts in ktimes.items():
                per_kernel.setdefault(name, []).append(sum(ts))
        for t in [X, *ys, *params]:
            t.grad = None
    return statistics.median(walls), {k: statistics.median(v) for k, v in per_kernel.items()}


def perf_main(device: str, C: int, tokens: int, dtype, reps: int, out_dir: Optional[str],
              copy_gbps: Optional[float], backend: str = "triton",
              variants: Sequence[str] = PERF_VARIANTS) -> List[dict]:
    """Time each HC kernel and each whole unit (mhc N=4 sublayer, xhc-mlp sublayer, flash4 window) with
    rotating inputs; print the fraction of the bandwidth floor (floor bytes / time / copy rate).
    A kernel's floor is the bytes of its tensor arguments (each read or written once)."""
    rows = []
    isz = torch.tensor([], dtype=dtype).element_size()
    for variant in variants:
        unit = build_unit(variant, C, backend, device, dtype)
        sets = _rotating(unit, C, tokens, device, dtype)
        X, ys = sets[0]
        kbytes = ByteCounter()
        with count_triton_launches(kbytes):
            outs = unit.step(X, ys)
            _backward(outs, _grads_like(outs, 0))
        wall, per_kernel = _timed_unit(unit, sets, reps, device)
        floor = floor_units(unit) * C * isz * tokens
        rows.append({"variant": variant, "what": "unit", "scope": "sublayer", "seconds": wall, "floor_bytes": floor})
        for op, nb in sorted(kbytes.by_op.items()):
            name = op.split(":", 1)[1] if op.startswith("triton:") else op
            if name in per_kernel:
                rows.append({"variant": variant, "what": name, "scope": "kernel", "seconds": per_kernel[name],
                             "floor_bytes": nb})
    lines = [f"# HC perf, {device}, C={C}, {tokens} tokens, {str(dtype).replace('torch.', '')}, backend {backend}, "
             f"median of {reps}, rotating inputs; floor = bytes / copy rate"
             + (f" ({copy_gbps:g} GB/s)" if copy_gbps else " (no --copy-gbps: GB/s only)")]
    lines.append(f"{'variant':<8} {'kernel / unit':<26} {'ms':>9} {'floor MB':>9} {'GB/s':>8} {'of floor':>8}")
    for r in rows:
        gbs = r["floor_bytes"] / r["seconds"] / 1e9 if r["seconds"] > 0 else float("nan")
        r["gbps"] = gbs
        r["fraction"] = gbs / copy_gbps if copy_gbps else None
        r["fraction_of_copy"] = r["fraction"]  # the name bench/gpu_checks.py's target table reads
        frac = f"{r['fraction']:.2f}" if r["fraction"] is not None else "-"
        lines.append(f"{r['variant']:<8} {r['what']:<26} {1e3 * r['seconds']:>9.3f} {r['floor_bytes'] / 1e6:>9.1f} "
                     f"{gbs:>8.1f} {frac:>8}")
    print("\n".join(lines), flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "hc_perf.json"), "w") as f:
            json.dump({"device": device, "C": C, "tokens": tokens, "dtype": str(dtype), "copy_gbps": copy_gbps,
                       "rows": rows}, f, indent=1)
        with open(os.path.join(out_dir, "hc_perf.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return rows


def _mhc_unit(n: int, C: int, device, dtype) -> Unit:
    """The mHC sublayer unit with ``n`` streams (the bench's unit when n = 4)."""
    unit = build_unit("mhc", C, "triton", device, dtype)
    if n == unit.n:
        return unit
    from xhc.hyper_connection import HyperConnection

    hc = HyperConnection(hc_config("mhc", "triton").replace(n=n), C, layer_index=1).to(device)

    def step(X, ys):
        u, ctx = hc.read(X)
        return u, hc.write(X, ys[0], ctx)

    return Unit("mhc", n, 1, [hc], step, 0.0)


def _write_json_atomic(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def autotune_main(device: str, C: int, tokens: int, dtype, reps: int, out: str, ns: Sequence[int] = (4,),
                  grid_limit: Optional[int] = None) -> dict:
    """Time each fused HC kernel over :data:`xhc.kernels.mhc_common.TUNE_GRID` at (N, C, tokens), one
    kernel at a time (the others at their defaults): the mHC kernels (``mhc_*``) in the mHC sublayer
    with N in ``ns``, the fused xHC kernels (``xhc_*``) in the bench's xHC MLP sublayer (N = 16, k = 4),
    the Flash writes' mappings (``xhc_active``, keyed by the carried k rows) in its Flash-4sub window.
    The fastest block sizes go to ``out`` as JSON in the layout of ``xhc/kernels/tuned_blocks.json``,
    ``{kernel: {"N<n>_C<C>": blocks}}`` (merged into ``out`` when it exists), rewritten atomically
    after every kernel: a run stopped by a time limit keeps the kernels it finished."""
    from xhc.kernels import mhc_common as cm

    result: Dict[str, Dict[str, dict]] = {}
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
    units = [(_mhc_unit(n, C, device, dtype), lambda kern: kern.startswith("mhc_")) for n in ns]
    units.append((build_unit("xhc-mlp", C, "triton", device, dtype),
                  lambda kern: kern.startswith("xhc_") and kern != "xhc_active"))
    units.append((build_unit("flash4", C, "triton", device, dtype), lambda kern: kern == "xhc_active"))
    for unit, tuned_here in units:
        sets = _rotating(unit, C, tokens, device, dtype, k=2)
        key = f"N{unit.n}_C{C}"
        if unit.name == "flash4":  # the carried X_a has k rows: the kernel looks its blocks up at (k, C)
            key = f"N{unit.modules[0].k}_C{C}"
        for kernel, grid in cm.TUNE_GRID.items():
            if not tuned_here(kernel):
                continue
            grid = grid[:grid_limit] if grid_limit else grid
            best = None
            for cand in grid:
                cm.OVERRIDE.clear()
                cm.OVERRIDE[kernel] = cand
                try:
                    _, per_kernel = _timed_unit(unit, sets, reps, device)
                except Exception as e:  # a block size the kernel cannot take at this shape
                    print(f"autotune {kernel} {key} {cand}: failed ({type(e).__name__}: {str(e)[:80]})", file=sys.stderr)
                    continue
                t = per_kernel.get(cm.KERNEL_OF[kernel])
                if t is None:
                    continue
                print(f"autotune {kernel} {key} {json.dumps(cand, sort_keys=True)} {1e3 * t:.4f} ms", flush=True)
                if best is None or t < best[0]:
                    best = (t, cand)
            cm.OVERRIDE.clear()
            if best is not None:
                result.setdefault(kernel, {})[key] = best[1]
                print(f"autotune best {kernel} {key} {json.dumps(best[1], sort_keys=True)} {1e3 * best[0]:.4f} ms",
                      flush=True)
                _write_json_atomic(out, result)
    _write_json_atomic(out, result)
    print(f"autotune: wrote {out} (commit it as xhc/kernels/tuned_blocks.json)", flush=True)
    return result


# ================================================================================================
# Table
# ================================================================================================
def _f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def format_table(rows: List[Row], title: str) -> str:
    head = (f"{'variant':<9} {'backend':<8} {'C':>5} {'acct':>6} {'fwd':>7} {'fwd/acct':>8} {'bwd':>8} {'bwd/fwd':>7} "
            f"{'saved':>6} {'floor':>5} {'sv/flr':>6} {'rc/flr':>6} {'ms':>8} {'vs van':>7}  method")
    lines = [title, head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.variant:<9} {r.backend:<8} {r.C:>5} {_f(r.acct):>6} {_f(r.fwd):>7} {_f(r.fwd_over_acct, '{:.2f}x'):>8} "
            f"{_f(r.bwd):>8} {_f(r.bwd_over_fwd, '{:.2f}x'):>7} {_f(r.saved):>6} {_f(r.floor, '{:.0f}'):>5} "
            f"{_f(r.saved_over_floor, '{:.2f}x'):>6} {_f(r.saved_rc_over_floor, '{:.2f}x'):>6} {_f(r.ms, '{:.3f}'):>8} {_f(r.vs_vanilla, '{:.2f}x'):>7}  "
            f"{r.count_method}{(' (' + r.note + ')') if r.note else ''}")
    lines.append("units: C elements of the state dtype per token per sublayer (acct: xhc.accounting, forward); "
                 "floor = X + y = (N + 1)C; rc: saved under HC recompute; ms per sublayer, forward + backward")
    return "\n".join(lines)


def slope_row(r1: Row, r2: Row) -> Row:
    """Per-token bytes from two runs at T and 2T tokens: bytes are a·T + b (b: per-call terms such
    as weight reads), each column is (bytes/T)/unit, so a/unit = 2·v(2T) − v(T).  Times are dropped."""
    out = Row(r1.variant, r1.backend, r1.C, r1.tokens, r1.acct, floor=r1.floor,
              count_method=r1.count_method + f", slope {r1.tokens}->{r2.tokens} tokens", note=r1.note)
    for name in ("fwd", "bwd", "saved", "saved_rc"):
        a, b = getattr(r1, name), getattr(r2, name)
        setattr(out, name, None if a is None or b is None else 2 * b - a)
    out.by_op = {k: 2 * r2.by_op.get(k, 0.0) - r1.by_op.get(k, 0.0) for k in set(r1.by_op) | set(r2.by_op)}
    return out


def available_backends(device: str) -> List[str]:
    try:
        from xhc.kernels import triton_available
    except ImportError:  # a checkout without xhc.kernels: only the eager reference exists
        return ["eager"]
    out = ["eager", "compile"]
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"  # CPU: bytes are counted, times mean nothing
    if (device == "cuda" or interpreting) and triton_available():
        out.append("triton")
        from xhc.kernels import liger

        if liger.liger_available():
            out.append("liger")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hc_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--hidden", default="1024,2048", help="C, comma-separated (default: 1024,2048)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per unit (default: 8192 on CUDA, 256 on CPU)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--backends", default=None, help="comma-separated subset of eager,compile,triton,liger "
                   "(default: every backend available on the device)")
    p.add_argument("--reps", type=int, default=5, help="timed forward+backward repetitions (median)")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows here as JSON")
    p.add_argument("--by-kernel", action="store_true",
                   help="after each table, the bytes of every op / Triton kernel of 0.5C or more (eager, triton, liger)")
    p.add_argument("--slope", action="store_true",
                   help="byte columns as the per-token slope between --tokens and twice as many tokens "
                        "(removes per-call terms such as reading the weights, which small token counts "
                        "inflate; used for the Triton interpreter, where every token costs seconds); no times")
    p.add_argument("--recommend", action="store_true",
                   help="measure eager vs compile for CPU tensors run eagerly (forward only and forward + "
                        "backward, a few widths) and print which is faster (bench/kernel_choice.py): the "
                        "measurement behind `kernels: auto` on CPU; --hidden/--tokens/--reps/--threads apply")
    p.add_argument("--launches", action="store_true",
                   help="print `launches <variant> fwd <F> bwd <B>` per sublayer for mhc, xhc-attn, xhc-mlp, flash, "
                        "flash4 on the triton backend (Triton launches + kernel-launching ATen ops; on CPU run it "
                        "under TRITON_INTERPRET=1); --hidden/--tokens give the shape (default C=64, 4 tokens)")
    p.add_argument("--verbose", action="store_true", help="--launches: also the ops by name (stderr)")
    p.add_argument("--perf", action="store_true",
                   help="time each HC kernel and whole unit (mhc N=4, xhc-mlp, flash4 window) on the triton backend "
                        "with rotating inputs (median of --reps) and print the fraction of the bandwidth floor; "
                        "GPU defaults C=2048, 8192 tokens, bf16; --device cpu (under TRITON_INTERPRET=1) is a smoke run")
    p.add_argument("--copy-gbps", type=float, default=None, help="--perf: the machine's measured copy rate (GB/s)")
    p.add_argument("--autotune", action="store_true",
                   help="time the fused mHC and xHC kernels over a small block-size grid at --hidden/--tokens and write "
                        "the winners to --out as JSON (the layout of xhc/kernels/tuned_blocks.json)")
    p.add_argument("--out", default=None, help="--perf: a folder for hc_perf.json/.txt; --autotune: the JSON file")
    args = p.parse_args(argv)

    if args.perf or args.autotune:
        if args.device == "cuda" and not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device is visible; use --device cpu (with TRITON_INTERPRET=1)")
        if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
        smoke = args.device == "cpu"
        C = int(str(args.hidden).split(",")[0]) if args.hidden != "1024,2048" else (16 if smoke else 2048)
        tokens = args.tokens or (4 if smoke else 8192)
        dt = torch.bfloat16 if (args.dtype == "bf16" or not smoke) else torch.float32
        reps = 1 if smoke else args.reps
        if args.perf:
            perf_main(args.device, C, tokens, dt, reps, args.out, args.copy_gbps)
        else:
            if not args.out:
                p.error("--autotune needs --out FILE")
            autotune_main(args.device, C, tokens, dt, reps, args.out, grid_limit=2 if smoke else None)
        return 0

    if args.launches:
        variants = [v for v in (args.variants.split(",") if args.variants != ",".join(VARIANTS) else LAUNCH_VARIANTS)
                    if v in LAUNCH_VARIANTS]
        C = int(str(args.hidden).split(",")[0]) if args.hidden != "1024,2048" else 64
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        launches_main(variants, (args.backends or "triton").split(",")[0], C, args.tokens or 4, args.device, dt,
                      args.verbose)
        return 0
    if args.recommend:
        from bench.kernel_choice import recommend

        hidden_r = [int(h) for h in str(args.hidden).split(",") if h] if args.hidden != "1024,2048" else [64, 256, 1024]
        recommend(hidden_r, [args.tokens] if args.tokens else [16, 256], args.reps, args.threads)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    tokens = args.tokens or (8192 if args.device == "cuda" else 256)
    hidden = [int(h) for h in str(args.hidden).split(",") if h]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; choose from {','.join(VARIANTS)}")
    if "vanilla" not in variants:
        variants.insert(0, "vanilla")  # the time ratio needs it
    avail = available_backends(args.device)
    backends = [b.strip() for b in (args.backends or ",".join(avail)).split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            p.error(f"--backends: unknown backend {b!r}; choose from {','.join(BACKENDS)}")
    skipped = [b for b in backends if b not in avail]
    backends = [b for b in backends if b in avail]
    if skipped:
        print(f"skipping backend(s) {','.join(skipped)}: not available on {args.device} "
              "(triton needs CUDA and `pip install triton`; liger also `pip install liger-kernel`)", file=sys.stderr)

    dev = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    all_rows: List[Row] = []
    runs = lambda b: [v for v in variants if b != "liger" or v in LIGER_VARIANTS]  # noqa: E731
    total = len(hidden) * sum(len(runs(b)) for b in backends)
    done = 0
    for C in hidden:
        rows: List[Row] = []
        for backend in backends:
            base = None
            for v in runs(backend):
                done += 1
                print(f"[{done}/{total}] C={C} {backend:<7} {v} ...", file=sys.stderr, flush=True)
                try:
                    r = measure(v, backend, C, tokens, args.device, dtype, args.reps, args.seed)
                    if args.slope:
                        r = slope_row(r, measure(v, backend, C, 2 * tokens, args.device, dtype, args.reps, args.seed))
                except Exception as e:  # report and keep going: one broken path must not hide the others
                    r = Row(v, backend, C, tokens, float("nan"), note=f"failed: {type(e).__name__}: {str(e)[:80]}")
                if v == "vanilla":
                    base = r.ms
                if r.ms is not None and base:
                    r.vs_vanilla = r.ms / base
                rows.append(r)
        title = f"\nHC kernels, C = {C}, {tokens} tokens, {args.dtype}, {dev}"
        if args.device == "cpu" and {"triton", "liger"} & set(backends):
            title += " (triton/liger under TRITON_INTERPRET=1: their bytes count, their times do not)"
        print(format_table(rows, title))
        if args.by_kernel:
            for r in rows:
                big = sorted(((n, k) for k, n in r.by_op.items() if n >= 0.5), reverse=True)
                if big:
                    print(f"  {r.variant} {r.backend}: " + ", ".join(f"{k} {n:.1f}" for n, k in big))
        all_rows += rows
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": dev, "dtype": args.dtype, "tokens": tokens, "torch": torch.__version__,
                       "rows": [dict(asdict(r), fwd_over_acct=r.fwd_over_acct, bwd_over_fwd=r.bwd_over_fwd,
                                     saved_over_floor=r.saved_over_floor, saved_rc_over_floor=r.saved_rc_over_floor) for r in all_rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
