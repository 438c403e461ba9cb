"""Compile the HC Triton kernels for NVIDIA GPUs ahead of time, on a machine without a GPU.

The ``triton`` backend (the kernel modules of :mod:`xhc.kernels`, and Liger-Kernel's mHC op where installed)
is tested on CPU under the Triton interpreter, which never runs Triton's compiler.  A compiler-only
error (a construct the interpreter accepts and the MLIR lowering rejects, a register or shared-memory
overflow, a ptxas failure) would only show on the first GPU run, in every training check at once.
This tool finds such errors here:

1. **capture** (runs under ``TRITON_INTERPRET=1``): build the HC modules of every zoo preset
   (``configs/models/*.yaml``, every variant, at its hidden size C) with ``kernels: triton``, and the
   Liger mHC module (``kernels: liger``) where liger-kernel is installed; run forward + backward on
   16 tokens with a bf16 state (the GPU training path: bf16 backbone, fp32 HC parameters) and an
   fp32 state.  Every kernel launch is recorded: the kernel, its arguments' types and its integer
   and constexpr values.  ``--extra n:C:dtype`` adds the HC ops (sinkhorn, read, write,
   linear_stats) at the shapes of ``tests/test_hc_kernels.py`` (see :data:`TEST_SHAPES`).
2. **compile**: for every distinct launch, Triton's own JIT path (its argument binder, its
   specialisation of integers and pointers, ``ASTSource`` and ``triton.compile``) is driven with
   ``warmup=True`` against a stand-in driver that reports ``GPUTarget("cuda", arch, 32)``, so the
   result is what ``kernel[grid](...)`` would compile on that GPU: TTIR, TTGIR, LLVM IR, PTX and a
   cubin from the bundled ptxas.  Nothing is launched; no GPU or CUDA driver is needed.

Run::

    python -m tools.triton_aot                       # capture + compile for sm_90 and sm_80
    python -m tools.triton_aot --arch 90 --json runs/aot.json
    python -m tools.triton_aot capture specs.json    # the two halves (compile may run under
    python -m tools.triton_aot compile specs.json    #   another Triton: PYTHONPATH=<dir> python ...)
    python -m tools.triton_aot compile specs.json --arch 80 --dtypes bfloat16   # the bf16 launches only
    python -m tools.triton_aot resources --arch 90 [--presets P,...] [--extra n:C:dtype]   # registers, spills, smem

``resources`` captures the zoo presets' HC modules (bf16 state, the GPU training path), compiles
every kernel and prints, per distinct compiled specialisation of our kernels,
``resources <kernel> <shape> regs <R> spills <S> smem <bytes>`` (``cuobjdump -res-usage`` on the
cubin: registers per thread, local-memory + stack bytes per thread, shared memory per program);
``<shape>`` is the first launch that compiled it (presets/C=<C>/<unit>/<dtype>) and its integer
constexprs and launch options (``/DP=512,BT=16,BK=16,num_warps=8``).

Output: one line per (kernel specialisation, arch), ``OK`` or ``FAIL`` with the compiler's first
error line, then ``SUMMARY triton <version>: <ok>/<total> compiled, <n> failed``.  Exit status 1
if any compile failed (or nothing was captured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from xhc.config import FLASH_FAMILY

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 16  # a multiple of 16: the token count gets the divisibility specialisation real runs get
# n:C:dtype of the kernel tests (tests/test_hc_kernels.py: float64 Sinkhorn, read, write and
# linear_stats at n = 4, 16 and C = 37, 40, 11 (not multiples of 16); fp32 at C = 24, 48; bf16 states
# at C = 48, 64): one of each kind (the kernels' code depends on C only through the block size and
# whether C is a multiple of 16).
TEST_SHAPES = ("4:40:float64", "16:37:float64", "16:11:float64", "16:24:float32", "16:48:bfloat16")
# The module tests (tests/test_hc_kernels.py: S, B, C = 6, 2, 8, float64): every preset config at C = 8.
TEST_MODULE_C = 8


# ------------------------------------------------------------------------------------------------
# Argument encoding (JSON-safe)
# ------------------------------------------------------------------------------------------------
def _encode(v: Any) -> Any:
    import torch

    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).replace("torch.", "")}
    if isinstance(v, bool):
        return {"bool": v}
    if isinstance(v, int):
        return {"int": v}
    if isinstance(v, float):
        return {"float": v}
    if isinstance(v, str):
        return {"str": v}
    import triton.language as tl

    if isinstance(v, tl.dtype):
        return {"tl": str(v)}
    if isinstance(v, tl.constexpr):
        return _encode(v.value)
    raise TypeError(f"triton_aot: cannot record a kernel argument of type {type(v).__name__}")


def _decode(v: Any) -> Any:
    import torch

    if v is None:
        return None
    (kind, val), = v.items()
    if kind == "tensor":
        return torch.empty(64, dtype=getattr(torch, val))  # 256-byte aligned like a CUDA allocation
    if kind in ("bool", "int", "float", "str"):
        return val
    if kind == "tl":
        import triton.language as tl

        for name in dir(tl):
            obj = getattr(tl, name)
            if isinstance(obj, tl.dtype) and str(obj) == val:
                return obj
        raise ValueError(f"triton_aot: unknown Triton dtype {val!r}")
    raise ValueError(f"triton_aot: unknown argument kind {kind!r}")


# ------------------------------------------------------------------------------------------------
# 1. capture (under the interpreter)
# ------------------------------------------------------------------------------------------------
class Recorder:
    """Records every interpreted kernel launch while active (a context manager).  ``execute``
    False: the kernel is not run (its outputs keep whatever ``torch.empty`` gave them); the launch
    arguments come from the Python wrappers, which do not depend on the values, and the
    interpreter would take about a minute per preset sublayer at C = 2048."""

    def __init__(self, execute: bool = False):
        self.launches: List[dict] = []
        self.context = ""
        self.execute = execute

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._cls, self._orig = InterpretedFunction, InterpretedFunction.run
        rec = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            fn = fn_self.fn
            rec.launches.append({
                "module": fn.__module__, "name": fn.__qualname__, "context": rec.context,
                "args": [_encode(a) for a in args],
                "kwargs": {k: _encode(v) for k, v in kwargs.items()}})
            if rec.execute:
                return rec._orig(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            import torch

            for a in args:  # the integer outputs a kernel would write (routing indices): valid zeros, so the
                if isinstance(a, torch.Tensor) and not a.is_floating_point():  # torch ops after it can index
                    a.data.zero_()  # (.data: no version bump for autograd)
            return None

        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        self._cls.run = self._orig
        return False


def _units(cfg, C: int):
    """[(name, modules, step)] for one HC config: the modules a model of that variant builds."""
    variant = cfg.variant
    if variant == "xhc":
        from xhc.xhc import XHCSublayer

        out = []
        for is_mlp in (False, True):
            hc = XHCSublayer(cfg, C, is_mlp=is_mlp, layer_index=1)
            out.append(("mlp" if is_mlp else "attention", [hc], _sublayer_step(hc)))
        return out
    if variant in FLASH_FAMILY:
        from xhc.flash import Flash4FirstLayer, Flash4SecondLayer, XHCFlashLayer

        fl = XHCFlashLayer(cfg, C, layer_index=0)

        def flash(X, ys, fl=fl):
            st = fl.begin(X)
            ua = fl.attn_read(st)
            st = fl.attn_write(st, ys[0])
            um = fl.mlp_read(st)
            return ua, um, fl.mlp_write(st, ys[1])

        out = [("flash layer", [fl], flash)]
        if variant == "xhc_flash4":
            first, second = Flash4FirstLayer(cfg, C, layer_index=0), Flash4SecondLayer(cfg, C, layer_index=1)

            def window(X, ys):
                st = first.begin(X)
                us = [first.attn_read(st)]
                st = first.attn_write(st, ys[0])
                us.append(first.mlp_read(st))
                st = first.mlp_write(st, ys[1])
                us.append(second.attn_read(st))
                st = second.attn_write(st, ys[2])
                us.append(second.mlp_read(st))
                return (*us, second.mlp_write(st, ys[3]))

            out.append(("flash4 window", [first, second], window))
        return out
    from xhc.hyper_connection import HyperConnection

    hc = HyperConnection(cfg, C, layer_index=1)
    return [("sublayer", [hc], _sublayer_step(hc))]


def _sublayer_step(hc):
    def step(X, ys):
        u, ctx = hc.read(X)
        return u, hc.write(X, ys[0], ctx)

    return step


def _run_unit(step, modules, n: int, C: int, dtype, tokens: int = TOKENS) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    b = 2
    s = tokens // b
    X = torch.randn(s, b, n, C, generator=g).to(dtype).requires_grad_()
    ys = [torch.randn(s, b, C, generator=g).to(dtype).requires_grad_() for _ in range(4)]
    outs = step(X, ys)
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else [outs]) if o.requires_grad]
    torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])


def preset_configs(patterns: Optional[List[str]] = None) -> List[Tuple[str, Any, int]]:
    """[(preset names, HCConfig, C)]: every zoo preset variant with hyper-connections (or those
    matching one of the fnmatch ``patterns``, e.g. ``tiny-moe:*``), one entry per distinct (config, C)."""
    import dataclasses
    import fnmatch

    from models.zoo import list_presets, load_preset

    names = list_presets()
    if patterns:
        unmatched = [p for p in patterns if not fnmatch.filter(names, p)]
        if unmatched:
            raise ValueError(f"--presets {','.join(unmatched)}: no zoo preset matches; presets are e.g. "
                             f"{', '.join(names[:4])} (python -m tools.zoo --list)")
        names = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
    seen: Dict[str, List] = {}
    for name in names:
        p = load_preset(name)
        if not p.hc.enabled:
            continue
        cfg = dataclasses.replace(p.hc, kernels="triton")
        key = repr((cfg, p.hidden_size))
        seen.setdefault(key, [[], cfg, p.hidden_size])[0].append(name)
    return [(",".join(names), cfg, C) for names, cfg, C in seen.values()]


def _op_shapes(rec: Recorder, spec: str) -> None:
    """The HC ops at one test shape ``n:C:dtype`` (forward + backward): Sinkhorn (both orders),
    read (one and several reads), write (with and without the active rows I, mixing H, X_a read
    from the state), linear_stats at the kernel tests' (R, d).  The state (X, X_a, V) has the
    dtype; the coefficients are fp32 (float64 with a float64 state), as in the models."""
    import torch

    from types import SimpleNamespace

    from xhc.kernels import linear_stats, read_ops, sinkhorn_ops, write_ops

    T = SimpleNamespace(sinkhorn=sinkhorn_ops.sinkhorn, sinkhorn_deepseek=sinkhorn_ops.sinkhorn_deepseek,
                        read=read_ops.read, gather=read_ops.gather, write=write_ops.write, linear_stats=linear_stats.linear_stats)

    n, C, dt = spec.split(":")
    n, C, dtype = int(n), int(C), getattr(torch, dt)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(0)
    st = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()  # noqa: E731
    co = lambda *s: torch.randn(*s, generator=g).to(cdt).requires_grad_()  # noqa: E731
    t = TOKENS
    rec.context = f"ops {spec}"
    k, K = (4, 4) if n >= 16 else (2, 2)
    outs = [T.sinkhorn(co(t, n, n), 20, 1e-6, order) for order in ("row_last", "col_last")]
    outs.append(T.sinkhorn_deepseek(co(t, n, n), 20, 1e-6))  # convention: deepseek_v4 (docs/math.md §2.h)
    X = st(t, n, C)
    outs += [T.read(co(t, n), X), T.read(co(t, 3, n), X)]
    I = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])
    for H in (co(t, k, k), None):
        outs.append(T.write(X, I, st(t, k, C), H, co(t, k, K), st(t, K, C)))
        outs.append(T.write(X, I, None, H, co(t, k, K), st(t, K, C)))
        outs.append(T.write(None, None, st(t, k, C), H, co(t, k, K), st(t, K, C)))
    for R, d in ((1, 24), (4, 24), (n, 0), (3, 40)):
        outs.extend(o for o in T.linear_stats(st(t, R, C), co(d, R * C)) if o.numel())
    # the one-pass state gradient (the separate ops' path): linear_stats owns Xs, the read and the gather
    # hand their dX terms over, _state_grad_kernel writes dX
    Xs = st(t, n, C)
    proj = T.linear_stats(Xs, co(2 * n, n * C))[0]
    h = torch.sigmoid(proj[..., :n])
    outs += [T.read(h, Xs), T.gather(Xs, I, h)]
    outs = [o for o in outs if o.requires_grad]
    torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])


def capture(extra: List[str], dtypes=("bfloat16", "float32"), log=print, execute: bool = False,
            presets: Optional[List[str]] = None, module_tests: bool = True) -> dict:
    """Run the modules (see the module docstring) under the interpreter; returns the specs.  With
    ``extra`` (and ``module_tests``) also every preset config at the module tests' C, float64."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton_aot capture: set TRITON_INTERPRET=1 before Python starts "
                           "(`TRITON_INTERPRET=1 python -m tools.triton_aot capture FILE`)")
    import dataclasses

    import torch
    import triton

    torch.manual_seed(0)
    rec = Recorder(execute)
    sources: List[str] = []
    with rec:
        for names, cfg, C in preset_configs(presets):
            cfgs = [(names, cfg)]
            if cfg.variant == "mhc" and cfg.convention == "paper":  # DeepSeek-V4's convention: other constexprs
                try:
                    cfgs.append((f"{names}+deepseek_v4", dataclasses.replace(cfg, convention="deepseek_v4")))
                except Exception as e:  # a preset the convention does not take (one-line reason)
                    log(f"deepseek_v4: {names} not covered ({e})")
            for label, ccfg in cfgs:
                for dt in dtypes:
                    for part, modules, step in _units(ccfg, C):
                        rec.context = f"{label} C={C} {part} {dt}"
                        t0 = time.perf_counter()
                        _run_unit(step, modules, ccfg.n, C, getattr(torch, dt))
                        log(f"captured {rec.context} ({time.perf_counter() - t0:.1f}s)")
                        sources.append(rec.context)
        from xhc.kernels import liger

        if liger.liger_available():
            for names, cfg, C in preset_configs(presets):
                if cfg.variant != "mhc":
                    continue
                try:
                    lcfg = dataclasses.replace(cfg, kernels="liger", sinkhorn_order="col_last")
                except Exception as e:  # a preset Liger's maths does not cover
                    log(f"liger: {names} not covered ({e})")
                    continue
                for dt in dtypes:
                    for part, modules, step in _units(lcfg, C):
                        rec.context = f"liger {names} C={C} {part} {dt}"
                        _run_unit(step, modules, lcfg.n, C, getattr(torch, dt))
                        log(f"captured {rec.context}")
                        sources.append(rec.context)
        else:
            log("liger-kernel not installed: its mHC op is not captured")
            sources.append("liger: not installed")
        for spec in extra:
            _op_shapes(rec, spec)
            log(f"captured {rec.context}")
            sources.append(rec.context)
        if extra and module_tests:  # the module tests' size: every distinct preset config at C = 8, float64
            done = set()
            for names, cfg, _ in preset_configs(presets):
                if repr(cfg) in done:
                    continue
                done.add(repr(cfg))
                for part, modules, step in _units(cfg, TEST_MODULE_C):
                    rec.context = f"{names} C={TEST_MODULE_C} {part} float64"
                    _run_unit(step, [m.double() for m in modules], cfg.n, TEST_MODULE_C, torch.float64)
                    log(f"captured {rec.context}")
                    sources.append(rec.context)
    return {"triton": triton.__version__, "torch": torch.__version__, "tokens": TOKENS, "sources": sources,
            "launches": rec.launches}


# ------------------------------------------------------------------------------------------------
# 2. compile (no interpreter, no GPU)
# ------------------------------------------------------------------------------------------------
class _TargetDriver:
    """What JITFunction.run asks the active driver for, answered for a chosen GPU target."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self):
        return True


def _jit_function(module: str, name: str):
    import importlib

    from triton.runtime.jit import JITFunction

    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):  # autotuner / heuristics wrappers
        obj = obj.fn
    if not isinstance(obj, JITFunction):
        raise TypeError(f"{module}.{name} is {type(obj).__name__}, not a triton.jit function "
                        "(is TRITON_INTERPRET=1 set for the compile step? it must not be)")
    return obj


def cubin_resources(cubin: bytes) -> dict:
    """Registers per thread, spilled bytes (local memory + stack, per thread) and static shared memory
    of the one kernel in ``cubin``, from ``cuobjdump -res-usage`` (the tool Triton bundles)."""
    import re

    from triton import knobs

    tool = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump")
    with tempfile.TemporaryDirectory(prefix="xhc-res-") as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        raise RuntimeError(f"cuobjdump -res-usage: no resource line in {out[:200]!r}")
    reg, stack, shared, local = (int(g) for g in m.groups())
    return {"regs": reg, "spills": stack + local, "static_shared": shared}


def _meta(launch: dict) -> str:
    """The launch's integer constexprs and launch options (block sizes, num_warps), ``K=v,...``: what
    tells two compiled specialisations of one kernel apart in the resource lines."""
    vals = [f"{k}={v['int']}" for k, v in launch["kwargs"].items() if isinstance(v, dict) and "int" in v]
    return ",".join(vals)


def resources_lines(results: List[dict], module_prefix: str = "xhc.") -> List[str]:
    """``resources <kernel> <shape> regs <R> spills <S> smem <bytes>`` for every compiled kernel of
    our own modules (smem: Triton's dynamic shared memory plus the static one)."""
    out = []
    for r in results:
        if r["status"] != "OK" or not r["module"].startswith(module_prefix) or "regs" not in r:
            continue
        shape = r["context"].replace(" ", "/") + (f"/{r['meta']}" if r.get("meta") else "")
        out.append(f"resources {r['kernel']} {shape} regs {r['regs']} spills {r['spills']} "
                   f"smem {int(r['shared'] or 0) + int(r['static_shared'])}")
    return out


def compile_specs(specs: dict, archs: List[int], log=print, resources: bool = False,
                  dtypes: Optional[Tuple[str, ...]] = None) -> List[dict]:
    """Compile every recorded launch for every arch (with ``dtypes``: only the launches captured with
    one of those state dtypes, the last word of their context).  Launches that Triton's binder specialises
    alike (e.g. C = 1024 and 2048: both multiples of 16, same constexprs) share one kernel, as they
    would on the GPU (Triton's own kernel cache): one result dict per distinct kernel and arch, with
    ``launches`` counting the launches it serves."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("triton_aot compile: unset TRITON_INTERPRET (the interpreter never compiles)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    results: List[dict] = []
    previous = getattr(driver, "_active", None)
    for arch in archs:
        driver.set_active(_TargetDriver(GPUTarget("cuda", arch, 32)))
        by_kernel: Dict[int, dict] = {}  # id(CompiledKernel) -> its result
        fresh = set()
        try:
            for launch in specs["launches"]:
                if dtypes and launch["context"].split()[-1].split(":")[-1] not in dtypes:  # "... bfloat16", "ops 4:64:bfloat16"
                    continue
                name = launch["name"]
                res = {"arch": arch, "kernel": name, "module": launch["module"], "context": launch["context"],
                       "triton": triton.__version__, "launches": 1, "meta": _meta(launch)}
                t0 = time.perf_counter()
                try:
                    fn = _jit_function(launch["module"], name)
                    if id(fn) not in fresh:  # the binder and kernel cache hold the previous arch's target
                        fn.device_caches.clear()
                        fresh.add(id(fn))
                    args = [_decode(a) for a in launch["args"]]
                    kwargs = {k: _decode(v) for k, v in launch["kwargs"].items()}
                    kernel = fn.run(*args, grid=(1,), warmup=True, **kwargs)
                    if id(kernel) in by_kernel:  # a launch an earlier compile already serves
                        by_kernel[id(kernel)]["launches"] += 1
                        continue
                    cubin = kernel.asm.get("cubin", b"")
                    if not cubin:
                        raise RuntimeError("no cubin produced")
                    md = kernel.metadata
                    res.update(status="OK", cubin_bytes=len(cubin), shared=getattr(md, "shared", None),
                               num_warps=getattr(md, "num_warps", None))
                    if resources:
                        res.update(cubin_resources(cubin))
                    by_kernel[id(kernel)] = res
                except Exception as e:
                    msg = [m.strip() for m in str(e).strip().splitlines() if m.strip()]
                    where = f"{msg[0]} ... {msg[-1]}" if len(msg) > 1 else (msg[0] if msg else "")
                    res.update(status="FAIL", error=f"{type(e).__name__}: {where}",
                               traceback=traceback.format_exc()[-4000:])
                res["seconds"] = round(time.perf_counter() - t0, 3)
                results.append(res)
                line = f"{res['status']} sm_{arch} {name} [{launch['context']}]"
                if res["status"] == "OK":
                    line += f" cubin {res['cubin_bytes']} B, shared {res['shared']} B, {res['seconds']:.2f}s"
                else:
                    line += f": {res['error']}"
                log(line)
        finally:
            driver._active = previous  # as found (None: the next use picks the real driver, if any)
    return results


def summary_line(results: List[dict]) -> str:
    import triton

    bad = [r for r in results if r["status"] != "OK"]
    kernels = sorted({r["kernel"] for r in results})
    archs = sorted({r["arch"] for r in results})
    served = sum(r["launches"] for r in results)
    return (f"SUMMARY triton {triton.__version__}: {len(results) - len(bad)}/{len(results)} compiled "
            f"({served} launches), {len(bad)} failed; {len(kernels)} kernels ({', '.join(kernels)}), "
            f"archs {', '.join(f'sm_{a}' for a in archs)}")


def _capture_in_subprocess(path: str, extra: List[str], presets: Optional[List[str]] = None,
                           dtypes: Optional[Tuple[str, ...]] = None, module_tests: bool = True) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, "-m", "tools.triton_aot", "capture", path]
    for e in extra:
        cmd += ["--extra", e]
    if not extra:
        cmd.append("--no-extra")
    if presets:
        cmd += ["--presets", ",".join(presets)]
    if dtypes:
        cmd += ["--dtypes", ",".join(dtypes)]
    if not module_tests:
        cmd.append("--no-module-tests")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.triton_aot", description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", default="all", choices=("all", "capture", "compile", "resources"))
    p.add_argument("specs", nargs="?", help="capture: where to write the launches (JSON); compile: the file to read")
    p.add_argument("--arch", default="90,80", help="compute capabilities, comma-separated (default: 90,80)")
    p.add_argument("--extra", action="append", default=None,
                   help="capture: also the HC ops at n:C:dtype (repeatable; default: the kernel tests' shapes)")
    p.add_argument("--no-extra", action="store_true", help="capture: only the zoo presets")
    p.add_argument("--no-module-tests", action="store_true",
                   help="capture: with --extra, only the ops' shapes (not the float64 module tests' configs)")
    p.add_argument("--presets", default=None,
                   help="capture: zoo presets to use, comma-separated fnmatch patterns (default: all), e.g. 'tiny-moe:*'")
    p.add_argument("--execute", action="store_true",
                   help="capture: also run each kernel in the interpreter (slow; default: record the launch only)")
    p.add_argument("--json", default=None, help="compile: write the results here")
    p.add_argument("--dtypes", default=None,
                   help="capture: state dtypes (default: bfloat16,float32); compile: only the launches captured "
                        "with these (default: every launch in the file)")
    args = p.parse_args(argv)
    extra = [] if args.no_extra else (args.extra or list(TEST_SHAPES))
    presets = [p.strip() for p in args.presets.split(",") if p.strip()] if args.presets else None
    dtypes = tuple(d for d in args.dtypes.split(",") if d) if args.dtypes else None
    try:
        archs = [int(a) for a in args.arch.split(",") if a.strip()]
    except ValueError:
        p.error(f"--arch {args.arch!r}: write compute capabilities as integers, e.g. --arch 90,80")
    if args.command == "capture":
        if not args.specs:
            p.error("capture needs the output file: python -m tools.triton_aot capture specs.json")
        specs = capture(extra, dtypes or ("bfloat16", "float32"),
                        log=lambda s: print(s, file=sys.stderr, flush=True), execute=args.execute, presets=presets,
                        module_tests=not args.no_module_tests)
        Path(args.specs).write_text(json.dumps(specs))
        print(f"{len(specs['launches'])} launches captured ({len(specs['sources'])} sources) -> {args.specs}")
        return 0 if specs["launches"] else 1
    if args.command == "resources":  # capture the presets, compile, print the resource lines
        with tempfile.TemporaryDirectory(prefix="xhc-aot-") as d:
            path = os.path.join(d, "specs.json")
            _capture_in_subprocess(path, args.extra or [], presets, dtypes=("bfloat16",),  # --extra: the ops too
                                   module_tests=False)
            specs = json.loads(Path(path).read_text())
        results = compile_specs(specs, archs, log=lambda s: print(s, file=sys.stderr, flush=True), resources=True)
        lines = resources_lines(results)
        for line in lines:
            print(line, flush=True)
        bad = [r for r in results if r["status"] != "OK"]
        for r in bad:
            print(f"FAIL {r['kernel']} [{r['context']}]: {r['error']}", flush=True)
        return 0 if lines and not bad else 1
    if args.command == "compile":
        if not args.specs or not os.path.exists(args.specs):
            p.error(f"compile needs the file written by `capture`; {args.specs!r} does not exist")
        specs = json.loads(Path(args.specs).read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="xhc-aot-") as d:
            path = os.path.join(d, "specs.json")
            _capture_in_subprocess(path, extra, presets)
            specs = json.loads(Path(path).read_text())
    if not specs.get("launches"):
        print("FAIL nothing captured: no kernel launch was recorded")
        return 1
    results = compile_specs(specs, archs, log=lambda s: print(s, flush=True), dtypes=dtypes)
    print(summary_line(results), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"captured_with": specs.get("triton"), "results": results}, indent=1))
    return 0 if results and all(r["status"] == "OK" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
