"""The layers point one way (docs/architecture.md, "Layers"): an AST walk over every import of the
product code, module level and inside functions alike, plus ``importlib.import_module("...")``
with a literal name.

- ``xhc`` <- ``models`` <- ``training`` <- ``tools`` <- ``bench``: a package imports itself and the
  layers below it, never one above;
- ``configs`` is data: it imports the standard library only;
- ``xhc`` imports torch, numpy and the standard library only; the one named room for optional GPU
  libraries is ``xhc/kernels/``, whose backends import ``triton`` and ``liger_kernel`` (the
  ``kernels`` extra) when that backend is chosen.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("xhc", "models", "training", "tools", "bench")  # bottom to top
DATA = "configs"
XHC_THIRD_PARTY = {"torch", "numpy"}
XHC_KERNEL_LIBRARIES = {"triton", "liger_kernel"}  # only under xhc/kernels/
STDLIB = set(sys.stdlib_module_names) | {"__future__"}

def product_files() -> List[Path]:
    return sorted(p for pkg in LAYERS + (DATA,) for p in (ROOT / pkg).rglob("*.py"))


def _module_of(path: Path) -> Tuple[str, bool]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def imports_of(path: Path) -> Iterator[Tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``path``, at any depth."""
    module, is_pkg = _module_of(path)
    package = module if is_pkg else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                yield node.lineno, ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.lineno, node.module or ""
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            name = _literal_prefix(node.args[0])
            if name:
                yield node.lineno, name


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def _literal_prefix(arg: ast.expr) -> Optional[str]:
    """The module name of a string literal, or the literal head of an f-string (``f"training.data.{x}"``)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".")
    return None


def violation(rel: str, name: str) -> Optional[str]:
    """Why importing ``name`` from the product file ``rel`` breaks the layering, or None."""
    top = name.split(".")[0]
    layer = rel.split("/")[0]
    if top in STDLIB:
        return None
    if layer == DATA:
        return f"{DATA} is data and imports the standard library only"
    if top in LAYERS or top == DATA:
        if top == DATA:
            return None  # every layer may read the packaged YAML data
        if LAYERS.index(top) > LAYERS.index(layer):
            return f"{layer} may import {', '.join(LAYERS[:LAYERS.index(layer) + 1])} only, not {top} (a layer above)"
        return None
    if layer == "xhc":
        if top in XHC_THIRD_PARTY:
            return None
        if top in XHC_KERNEL_LIBRARIES and rel.startswith("xhc/kernels/"):
            return None
        return (f"xhc imports torch, numpy and the standard library only"
                f"{' (triton and liger_kernel under xhc/kernels/ only)' if top in XHC_KERNEL_LIBRARIES else ''}")
    return None  # models and above may use third-party libraries


def layering_violations() -> List[str]:
    out = []
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, name in imports_of(path):
            why = violation(rel, name)
            if why:
                out.append(f"{rel}:{line} imports {name}: {why}")
    return out


def test_layers_point_one_way():
    bad = layering_violations()
    assert not bad, "imports against the layering (docs/architecture.md):\n" + "\n".join(bad)


def test_the_walk_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The checker itself: an upward import inside a function, a relative import, an
    ``import_module`` literal and an f-string head are all seen and judged."""
    pkg = tmp_path / "models"
    pkg.mkdir()
    src = pkg / "fake.py"
    src.write_text(
        "import os\n"
        "from . import zoo\n"
        "def f():\n"
        "    from training.checkpoint import Checkpointer\n"
        "    import importlib\n"
        "    importlib.import_module('tools.zoo')\n"
        "    importlib.import_module(f'bench.{os.sep}')\n"
    )
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    found = sorted(imports_of(src))
    assert found == [(1, "os"), (2, "models"), (4, "training.checkpoint"), (5, "importlib"),
                     (6, "tools.zoo"), (7, "bench")]
    judged = {name: violation("models/fake.py", name) for _, name in found}
    assert [n for n, why in judged.items() if why] == ["training.checkpoint", "tools.zoo", "bench"]
    assert "not training (a layer above)" in judged["training.checkpoint"]
    assert violation("xhc/norms.py", "scipy.optimize") and violation("xhc/norms.py", "triton")
    assert violation("xhc/kernels/read.py", "triton") is None
    assert violation("xhc/norms.py", "megatron.core") and violation("configs/__init__.py", "xhc.config")
    assert violation("bench/x.py", "tools.zoo") is None and violation("tools/x.py", "bench.throughput")


@pytest.mark.parametrize("layer", LAYERS + (DATA,))
def test_every_layer_is_walked(layer):
    assert any(p.relative_to(ROOT).parts[0] == layer for p in product_files())
