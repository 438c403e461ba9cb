"""The device run's install path, on CPU (docs/gpu.md, "Carried wheels").

The lent GPU machine has no package registry and its ``python3`` is itself a virtual environment
holding torch, triton and transformers but no megatron-core or liger-kernel.  Here:

* ``tools/device_wheels.sh`` downloads the wheels (for this interpreter's Python version; the
  device gets 3.12's) into a folder: megatron-core capped below 0.20, one version of each;
* an interpreter that has torch but no megatron-core (this venv's torch and its requirements, the
  rest of site-packages hidden) runs ``bench/gpu_check.sh``'s environment step with
  ``--wheels`` that folder and no registry reachable (pip's index and proxies point at a closed
  port): megatron-core and liger-kernel are installed with ``--no-index --no-deps --target`` into
  the run's folder, on top of the existing torch, and imported from there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
bash = shutil.which("bash")
pytestmark = [pytest.mark.slow, pytest.mark.install, pytest.mark.skipif(bash is None, reason="needs bash")]
PYV = f"{sys.version_info.major}.{sys.version_info.minor}"
# torch and what it imports (its Requires-Dist), numpy and packaging (megatron-core's), pip, and of the
# image's other packages what the imports need (pyyaml, setuptools, triton)
BASE = ("torch", "torchgen", "functorch", "filelock", "typing_extensions", "sympy", "mpmath", "networkx", "jinja2",
        "markupsafe", "fsspec", "numpy", "numpy.libs", "packaging", "pip", "yaml", "setuptools", "pkg_resources",
        "_distutils_hack", "triton")
DEAD = "http://127.0.0.1:9"  # nothing listens there: any registry access fails


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    if PYV not in ("3.11", "3.12"):
        pytest.skip(f"megatron-core's tested range has no wheel for Python {PYV}")
    dest = tmp_path_factory.mktemp("whl")
    r = subprocess.run([bash, "tools/device_wheels.sh", "--dest", str(dest), "--python-version", PYV], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PIP=f"{sys.executable} -m pip"))
    assert r.returncode == 0, ("tools/device_wheels.sh could not download the wheels (it needs PyPI):\n"
                               + r.stdout[-2000:] + r.stderr[-3000:])
    return dest


def test_device_wheels_downloads_one_capped_version_of_each(wheels):
    names = sorted(p.name for p in wheels.glob("*.whl"))
    mc = [n for n in names if n.startswith("megatron_core-")]
    lk = [n for n in names if n.startswith("liger_kernel-")]
    assert len(mc) == 1 and len(lk) == 1 and len(names) == 2, names
    major, minor = (int(x) for x in mc[0].split("-")[1].split(".")[:2])
    assert (major, minor) == ((0, 19) if PYV == "3.12" else (0, 16)), mc
    assert f"cp{PYV.replace('.', '')}" in mc[0], mc
    # run again: still one of each (older files are removed first)
    r = subprocess.run([bash, "tools/device_wheels.sh", "--dest", str(wheels), "--python-version", PYV], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PIP=f"{sys.executable} -m pip"))
    assert r.returncode == 0 and sorted(p.name for p in wheels.glob("*.whl")) == names, r.stderr[-2000:]


def _torch_only_python(tmp_path: Path) -> tuple:
    """A launcher for this interpreter without its site-packages (``-S``), with torch, its
    requirements and pip on PYTHONPATH: torch present, megatron-core and liger-kernel absent."""
    import torch

    site = Path(torch.__file__).resolve().parents[1]
    base = tmp_path / "base-site"
    base.mkdir()
    for name in BASE:
        for src in (site / name, site / f"{name}.py"):
            if src.exists():
                (base / src.name).symlink_to(src)
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    launcher.chmod(0o755)
    return launcher, base


def test_gpu_check_installs_the_carried_wheels_without_a_registry(wheels, tmp_path):
    py, base = _torch_only_python(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "XHC_", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(base), PIP_INDEX_URL=f"{DEAD}/simple", PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="",
               http_proxy=DEAD, https_proxy=DEAD, HTTP_PROXY=DEAD, HTTPS_PROXY=DEAD, PIP_CONFIG_FILE=os.devnull)
    probe = subprocess.run([str(py), "-c", "import torch, importlib.util as u; "
                            "print(u.find_spec('megatron') is None, u.find_spec('liger_kernel') is None)"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.split() == ["True", "True"], probe.stdout + probe.stderr  # torch yes, the others no
    out = tmp_path / "out"
    # --steps kernels: env runs (and installs), then the kernels step prints its CPU-smoke SKIP
    r = subprocess.run([bash, "bench/gpu_check.sh", "--cpu-smoke", "--python", str(py), "--wheels", str(wheels),
                        "--steps", "kernels"], cwd=ROOT, env=dict(env, OUT=str(out)), capture_output=True, text=True,
                       timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-5000:]
    assert f"installing from {wheels} (--no-index)" in log, log[-3000:]
    envj = json.loads((out / "step-0-env.json").read_text())
    info = envj["environment"]
    assert envj["status"] == "PASS", envj
    want = "0.19." if PYV == "3.12" else "0.16."
    assert info["megatron_core"].startswith(want), info
    import torch

    for key in ("megatron_core_path", "liger_kernel_path"):  # from the fresh target, not site-packages
        assert "/runs/gpu_check-" in info[key] and "/site/" in info[key], (key, info)
    assert info["liger_kernel"] == next(wheels.glob("liger_kernel-*.whl")).name.split("-")[1], info
    assert Path(info["torch_path"]).resolve() == Path(torch.__file__).resolve().parent, info  # the existing torch
    assert not Path(info["megatron_core_path"]).exists()  # the run's scratch (the target) is removed at the end
