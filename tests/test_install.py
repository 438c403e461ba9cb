"""A non-editable ``pip install .`` works outside the checkout: entry points, presets, packaged configs.

Cheap by design: the temporary venv reuses this interpreter's installed packages (a ``.pth``
file points at them) and xhc is installed with ``--no-deps --no-build-isolation``, so nothing is
downloaded.  Everything then runs from an empty working directory, where the checkout is not
on ``sys.path``: only what the wheel holds is importable.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("xhc", "models", "training", "tools", "configs")


def _copy_source(dst: Path) -> None:
    """The files a source distribution would hold (no venvs, runs, caches or git data)."""
    anywhere = shutil.ignore_patterns(".git", ".venv*", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")
    top = {"runs", "data", "build", "dist", "checkpoints", "outputs", "tests", "docs"}

    def ignore(directory, names):
        skip = set(anywhere(directory, names))
        return skip | (top & set(names) if Path(directory) == REPO else set())

    shutil.copytree(REPO, dst, ignore=ignore)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv bin dir, empty working directory) after a non-editable install."""
    if shutil.which("git") is None and not (REPO / "setup.py").is_file():
        pytest.skip("no source tree")
    root = tmp_path_factory.mktemp("install")
    src, venv, cwd = root / "src", root / "venv", root / "elsewhere"
    _copy_source(src)
    cwd.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # Reuse the running interpreter's packages (torch, megatron-core, ...) without copying them.
    parents = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
    Path(purelib, "_xhc_test_parent.pth").write_text("\n".join(dict.fromkeys(parents)) + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        "--no-build-isolation", "--no-index", str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return py, venv / "bin", cwd, Path(purelib)


def _run(cmd, cwd, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_wheel_holds_every_config_and_imports_from_site_packages(installed):
    py, _bin, cwd, purelib = installed
    for kind in ("models", "pretrain", "finetune"):  # the same YAML files as the checkout
        want = sorted(p.name for p in (REPO / "configs" / kind).glob("*.yaml"))
        assert want and sorted(p.name for p in (purelib / "configs" / kind).glob("*.yaml")) == want
    code = ("import importlib, json; print(json.dumps({m: importlib.import_module(m).__file__ for m in %r}))"
            % (PACKAGES,))
    r = _run([py, "-c", code], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    for mod, path in __import__("json").loads(r.stdout).items():
        assert Path(path).resolve().is_relative_to(purelib.resolve()), (mod, path)


@pytest.mark.slow
def test_every_preset_loads_from_any_directory(installed):
    py, _bin, cwd, _purelib = installed
    code = ("from models.zoo import list_presets, load_preset\n"
            "names = list_presets()\n"
            "for n in names: load_preset(n)\n"
            "print(len(names))")
    r = _run([py, "-c", code], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    sys.path.insert(0, str(REPO))
    try:
        from models.zoo import list_presets
    finally:
        sys.path.remove(str(REPO))
    assert int(r.stdout.split()[-1]) == len(list_presets()) > 0


@pytest.mark.slow
def test_entry_points_work_with_packaged_configs(installed):
    _py, bindir, cwd, _purelib = installed
    r = _run([bindir / "xhc-pretrain", "--print-config"], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "preset: tiny-moe:xhc" in r.stdout
    # the README's config paths resolve to the packaged files outside the checkout too
    r = _run([bindir / "xhc-pretrain", "--config", "configs/pretrain/moe-18b-xhc.yaml", "--print-config"], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "moe-18b" in r.stdout
    r = _run([bindir / "xhc-pretrain", "--config", "no-such-run", "--print-config"], cwd)
    assert r.returncode == 2 and "default-tiny" in r.stderr  # the error lists the packaged configs
    r = _run([bindir / "xhc-finetune", "--help"], cwd)
    assert r.returncode == 0 and "--config" in r.stdout, r.stderr[-3000:]
