"""Tools whose output needs an optional package say so in one line and exit 2, before any work.

The package is hidden from this process (a meta-path finder that refuses it, and its modules
dropped from ``sys.modules`` for the test), as on an install without the extra.
"""

from __future__ import annotations

import importlib.abc
import sys

import pytest


class _Hide(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by the test)", name=fullname)
        return None


@pytest.fixture
def hide(monkeypatch):
    def apply(*names):
        monkeypatch.setattr(sys, "meta_path", [_Hide(names), *sys.meta_path])
        for mod in list(sys.modules):
            if mod.split(".")[0] in names:
                monkeypatch.delitem(sys.modules, mod)
    return apply


def _one_line(capsys, code, extra, package):
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and package in lines[0] and f"pip install 'xhc[{extra}]'" in lines[0], lines
    assert "Traceback" not in err + out


def test_inspect_figures_without_matplotlib(hide, capsys, tmp_path):
    from tools.inspect import main

    hide("matplotlib")
    _one_line(capsys, main([str(tmp_path), "--output", str(tmp_path / "out"), "--quiet"]), "plot", "matplotlib")
    assert not (tmp_path / "out").exists()  # checked before any work


def test_sweep_fit_plots_without_matplotlib(hide, capsys, tmp_path):
    from tools.sweep import main

    hide("matplotlib")
    _one_line(capsys, main(["fit", "--config", str(tmp_path / "sweep.yaml")]), "plot", "matplotlib")


@pytest.mark.parametrize("package", ["lm_eval", "transformers"])
def test_evaluate_without_its_extra(hide, capsys, tmp_path, package):
    from tools.evaluate import main

    hide(package)
    _one_line(capsys, main([str(tmp_path)]), "eval", package)
