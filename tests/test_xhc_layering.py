"""The maths package ``xhc`` never communicates: no module under xhc/ imports ``torch.distributed``
(docs/architecture.md: xhc is torch/numpy only; the temporal conv's halo exchange lives in
models/sequence.py).  An AST scan of every file, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

XHC = Path(__file__).resolve().parents[1] / "xhc"


def _distributed_imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from torch import distributed` and `from torch.distributed import ...`
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                yield f"{path.relative_to(XHC.parent)}:{node.lineno}: {name}"


def _distributed_attributes(path: Path):
    """``torch.distributed.<x>`` written out without an import (e.g. ``import torch`` then
    ``torch.distributed.all_reduce``)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
                and node.value.id == "torch"):
            yield f"{path.relative_to(XHC.parent)}:{node.lineno}: torch.distributed"


def test_scan_sees_every_form(tmp_path):
    """The scan itself: each way of reaching torch.distributed is caught, ordinary torch is not."""
    forms = ["import torch.distributed as dist", "from torch.distributed import all_reduce",
             "from torch import distributed", "def f():\n    import torch.distributed.nn\n"]
    for i, src in enumerate(forms):
        f = tmp_path / "xhc" / f"m{i}.py"
        f.parent.mkdir(exist_ok=True)
        f.write_text(src + "\n")
        global XHC
        old, XHC = XHC, tmp_path / "xhc"
        try:
            assert list(_distributed_imports(f)), src
        finally:
            XHC = old
    f = tmp_path / "xhc" / "attr.py"
    f.write_text("import torch\nx = torch.distributed.get_rank()\ny = torch.nn.Linear\n")
    old, XHC = XHC, tmp_path / "xhc"
    try:
        assert len(list(_distributed_attributes(f))) == 1
        assert not list(_distributed_imports(f))
    finally:
        XHC = old


def test_xhc_never_imports_torch_distributed():
    files = sorted(XHC.rglob("*.py"))
    assert len(files) > 10, files  # the package is where we think it is
    found = [hit for f in files for hit in (*_distributed_imports(f), *_distributed_attributes(f))]
    assert not found, "xhc/ must not use torch.distributed (move communication to models/): " + "; ".join(found)
