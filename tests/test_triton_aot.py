"""Ahead-of-time compilation of every HC Triton kernel for sm_90 (H100/H200) and sm_80 (A100), on
this CPU machine, with the installed (newest) Triton and with Triton 3.6 (the GPU check image's).

The test suite runs the kernels only under ``TRITON_INTERPRET=1``, which never runs Triton's
compiler; ``tools/triton_aot.py`` records every launch the HC modules make (the ``tiny-moe`` zoo
presets, every variant, bf16 and fp32 states; the kernel tests' op shapes and float64 module
size; Liger-Kernel's mHC op) and compiles each distinct specialisation through Triton's own JIT
path down to a cubin (the bf16 launches: with Triton 3.6 for sm_90, with the newest Triton for sm_80;
the newest Triton's sm_90 compile of the fused kernels is the resources test below; the GPU check's kernel
tests compile the float64 test shapes themselves).  A compile error fails the test.  The full capture (every preset at its
hidden size, minutes per kernel for some) is ``python -m tools.triton_aot`` (docs/gpu.md).

Triton 3.6 is installed from the registry (``pip install --no-deps --target``) into
``runs/.triton-3.6.0-cp<XY>`` (ignored by git; ``XHC_TRITON36_DIR`` overrides) the first time; a
failed install fails the test with pip's message.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.slow]
ARCHS = (90, 80)
OLD = "3.6.0"


def _kernel_names() -> set:
    """Every ``@triton.jit`` kernel of xhc/kernels/ (triton_ops and the fused mHC modules; read from
    the source: the names defined right under a ``@triton.jit`` decorator and launched with a grid)."""
    src = "\n".join(p.read_text() for p in sorted((ROOT / "xhc" / "kernels").glob("*.py")) if p.name != "liger.py")
    names = set()
    lines = src.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip() == "@triton.jit" and lines[i + 1].startswith("def "):
            name = lines[i + 1][4:].split("(")[0]
            if f"{name}[" in src:  # launched (helpers such as _cast are inlined into the kernels)
                names.add(name)
    return names


def _liger_installed() -> bool:
    try:
        from xhc.kernels import liger
    except Exception:
        return False
    return liger.liger_available()


def _env(pythonpath: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(ROOT)) if p)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton >= 3.9 warns while it is unset; 1 is the old default
    return env


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    path = tmp_path_factory.mktemp("aot") / "specs.json"
    env = dict(_env(), TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "tools.triton_aot", "capture", str(path), "--presets", "tiny-moe:*"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return path


@pytest.fixture(scope="module")
def triton36():
    """A folder holding Triton 3.6.0 (installed from the registry the first time)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    target = Path(os.environ.get("XHC_TRITON36_DIR") or ROOT / "runs" / f".triton-{OLD}-{tag}")
    if not (target / "triton" / "__init__.py").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                            "--target", str(target), f"triton=={OLD}"], capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, (f"could not install triton=={OLD} from the registry into {target} (needed to "
                                   f"compile for the GPU image's Triton; set XHC_TRITON36_DIR to a folder that "
                                   f"holds it):\n{r.stdout[-1000:]}{r.stderr[-2000:]}")
    return target


def _compile(specs: Path, out: Path, pythonpath: str = "", archs=ARCHS, dtypes=()):
    only = ["--dtypes", ",".join(dtypes)] if dtypes else []
    return subprocess.Popen([sys.executable, "-m", "tools.triton_aot", "compile", str(specs), "--arch",
                             ",".join(map(str, archs)), "--json", str(out), *only], cwd=ROOT, env=_env(pythonpath),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _check(proc, out: Path, version: str, archs=ARCHS):
    log, _ = proc.communicate(timeout=1800)
    failed = [line for line in log.splitlines() if line.startswith("FAIL")]
    assert proc.returncode == 0 and not failed, f"Triton {version}: compile errors:\n" + "\n".join(failed[:20]) + log[-3000:]
    results = json.loads(out.read_text())["results"]
    assert {r["triton"] for r in results} == {version}, {r["triton"] for r in results}
    want = _kernel_names()
    for arch in archs:
        got = {r["kernel"] for r in results if r["arch"] == arch and r["status"] == "OK"}
        assert want <= got, (version, arch, sorted(want - got))
        liger = {r["kernel"] for r in results if r["arch"] == arch and r["module"].startswith("liger_kernel")}
        assert bool(liger) == _liger_installed(), (version, arch, liger)  # Liger's mHC op where installed
        assert all(r["cubin_bytes"] > 0 for r in results if r["arch"] == arch)
    summary = [line for line in log.splitlines() if line.startswith("SUMMARY")]
    assert summary and " 0 failed" in summary[-1], summary


@pytest.mark.install
@pytest.mark.extended  # CONTRIBUTING.md, "Test tiers": the extended tier (run it when a kernel changes)
def test_every_kernel_compiles_for_sm80_with_the_newest_triton_and_sm90_with_3_6(specs, triton36, tmp_path):
    """Two compiles at once, one architecture each (the compiles are single-threaded): the bf16-state
    launches (the training path; every kernel has some) for sm_90 with Triton 3.6, the GPU check image's (a
    Hopper machine: what its training runs compile), and for sm_80 with the newest Triton.  The newest
    Triton's sm_90 compile of the HC kernels at the presets' shapes is
    :func:`test_resources_lines_for_every_hc_kernel_without_spills`; the fp32-state launches (a state dtype
    no GPU run uses) and the float64 test shapes (compiled by the GPU check's own kernel tests) are left
    out, which keeps this test's time in CI's budget."""
    assert _kernel_names() >= {"_read_fwd_kernel", "_write_bwd_kernel", "_sinkhorn_fwd_kernel",
                               "_linear_stats_dw_kernel"}, _kernel_names()
    new = _compile(specs, tmp_path / "new.json", archs=(80,), dtypes=("bfloat16",))
    old = _compile(specs, tmp_path / "old.json", str(triton36), archs=(90,), dtypes=("bfloat16",))
    _check(new, tmp_path / "new.json", triton.__version__, archs=(80,))
    _check(old, tmp_path / "old.json", OLD, archs=(90,))


def test_a_compile_error_fails(tmp_path):
    """A kernel the interpreter runs but the compiler rejects (``break`` in a loop): a FAIL line with
    the compiler's message and exit status 1, while the kernel beside it compiles."""
    (tmp_path / "aot_bad_kernel.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        "def early_exit_kernel(X, B: tl.constexpr):\n"
        "    acc = tl.zeros([B], dtype=tl.float32)\n"
        "    for k in range(0, 4):\n"
        "        if k == 2:\n"
        "            break\n"
        "        acc += tl.load(X + k * B + tl.arange(0, B))\n"
        "    tl.store(X + tl.arange(0, B), acc)\n\n\n@triton.jit\n"
        "def fine_kernel(X, B: tl.constexpr):\n"
        "    tl.store(X + tl.arange(0, B), tl.load(X + tl.arange(0, B)) * 2)\n")
    launch = {"module": "aot_bad_kernel", "context": "B=16", "args": [{"tensor": "float32"}, {"int": 16}], "kwargs": {}}
    spec = {"launches": [dict(launch, name="early_exit_kernel"), dict(launch, name="fine_kernel")]}
    path = tmp_path / "specs.json"
    path.write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, "-m", "tools.triton_aot", "compile", str(path), "--arch", "90"], cwd=ROOT,
                       env=_env(str(tmp_path)), capture_output=True, text=True, timeout=600)
    lines = r.stdout.splitlines()
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    bad = [line for line in lines if line.startswith("FAIL sm_90 early_exit_kernel [B=16]")]
    assert bad and "UnsupportedLanguageConstruct" in bad[0] and "Break" in bad[0], lines
    assert any(line.startswith("OK sm_90 fine_kernel [B=16]") for line in lines), lines
    assert "1/2 compiled" in lines[-1] and "1 failed" in lines[-1], lines[-1]


MHC_KERNELS = ("_mhc_pre_fwd_kernel", "_mhc_post_fwd_kernel", "_mhc_post_bwd_kernel", "_mhc_pre_bwd_kernel",
               "_mhc_dx_kernel", "_mhc_dw_kernel", "_mhc_dw_reduce_kernel")

XHC_KERNELS = ("_xhc_entry_fwd_kernel", "_xhc_entry_bwd_kernel", "_xhc_dx_kernel", "_xhc_dw_kernel",
               "_xhc_dw_reduce_kernel", "_xhc_post_fwd_kernel", "_xhc_post_bwd_kernel",
               "_xhc_conv_bwd_kernel",  # the fused xHC entry and MLP write (xhc_entry.py, xhc_grad.py, xhc_post.py)
               "_xhc_active_fwd_kernel", "_xhc_active_bwd_kernel",  # the Flash writes' mappings (xhc_active.py)
               "_flash_attn_fwd_kernel", "_flash_attn_bwd_kernel")  # xHC-Flash's attention write (flash_attn.py)


# the separate HC ops (xhc.kernels.triton_ops) the xHC sublayer and the Flash windows launch
HC_OP_KERNELS = ("_linear_stats_fwd_kernel", "_linear_stats_dx_kernel", "_linear_stats_dw_kernel", "_read_fwd_kernel",
                 "_read_bwd_kernel", "_write_fwd_kernel", "_write_bwd_kernel", "_sinkhorn_fwd_kernel",
                 "_sinkhorn_bwd_kernel", "_state_grad_kernel")
# one preset per family: mHC (the fused kernels), xHC (N = 8), Flash and Flash-4sub at N = 16, C = 1024 (the
# largest coefficient count d, where _linear_stats_dw_kernel and _state_grad_kernel spilled before their
# block sizes were bounded)
RESOURCE_PRESETS = "tiny-moe:mhc,tiny-moe:xhc,tiny-moe:xhc-flash,moe-2p5b:xhc-flash4"
# the separate ops (the ablations' path: sparse read, softmax router, ...; no preset launches the Sinkhorn op
# or linear_stats' dX since the Flash writes run fused) at N = 16 and the Flash presets' C
RESOURCE_OPS = "16:1024:bfloat16"


@pytest.mark.extended  # CONTRIBUTING.md, "Test tiers": the extended tier (run it when a kernel changes)
def test_resources_lines_for_every_hc_kernel_without_spills():
    """``python -m tools.triton_aot resources --arch 90 --presets tiny-moe:mhc,tiny-moe:xhc,tiny-moe:xhc-flash,moe-2p5b:xhc-flash4
    --extra 16:1024:bfloat16``: one line per compiled
    specialisation in the documented form, every fused mHC and xHC kernel and every HC op kernel present, no spills,
    registers within the sm_90 limit and shared memory within its 227 KB per block."""
    import re

    r = subprocess.run([sys.executable, "-m", "tools.triton_aot", "resources", "--arch", "90", "--presets",
                        RESOURCE_PRESETS, "--extra", RESOURCE_OPS], env=_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [l for l in r.stdout.splitlines() if l.startswith("resources ")]
    seen = set()
    for line in lines:
        m = re.fullmatch(r"resources (\S+) (\S+) regs (\d+) spills (\d+) smem (\d+)", line)
        assert m, line
        kernel, _, regs, spills, smem = m.group(1), m.group(2), *map(int, m.groups()[2:])
        seen.add(kernel)
        assert spills == 0, line
        assert 0 < regs <= 255 and smem <= 227 * 1024, line
    want = set(MHC_KERNELS) | set(XHC_KERNELS) | set(HC_OP_KERNELS)
    assert want <= seen, sorted(want - seen)
    assert set(HC_OP_KERNELS) <= _kernel_names(), sorted(set(HC_OP_KERNELS) - _kernel_names())
