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


# ------------------------------------------------------------------------------------------------
# The maths asks, the kernels room answers (docs/kernels.md, "Which path runs")
# ------------------------------------------------------------------------------------------------
KERNELS = XHC / "kernels"
MATHS = [XHC, XHC.parent / "models", XHC.parent / "training"]  # the packages that call the room (the benches
# and tools/triton_aot.py compare backends by name on purpose: they measure and build each one)
NAME_HOME = XHC / "config.py"  # defines the backend names and validates ``HCConfig.kernels`` against them
SIZE_NAMES = {"n", "N", "k", "K", "m"}  # the HC sizes a fused kernel bounds (streams, active, components)


def _backend_names():
    from xhc.config import KERNEL_BACKENDS

    return set(KERNEL_BACKENDS) - {"auto"}  # ``auto`` also names other settings' defaults (read_init, ...)


def _size_of(node) -> bool:
    """``n``, ``cfg.k``, ``self.K``, ``len(...)``: an HC size or a count."""
    if isinstance(node, ast.Name):
        return node.id in SIZE_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in SIZE_NAMES
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len"


def _int(node) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def maths_decisions(path: Path, root: Path):
    """Where ``path`` decides a kernel path itself: a comparison with a backend name (``== "triton"``,
    ``in ("triton", "liger")``), a bound of an HC size by a number of 3 or more (``k <= 16``,
    ``len(conv) <= 3``), or a use of a kernel limit constant (``kernels.*MAX*``, or imported from the room)."""
    names = _backend_names()
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(root)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            consts = [c for s in sides for c in ([s] if isinstance(s, ast.Constant) else
                                                 getattr(s, "elts", []) if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [])]
            if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                yield f"{rel}:{node.lineno}: backend name compared: {ast.unparse(node)}"
            for a, op, b in zip(sides, node.ops, sides[1:]):
                if isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) and (
                        (_size_of(a) and _int(b) and b.value >= 3) or (_size_of(b) and _int(a) and a.value >= 3)):
                    yield f"{rel}:{node.lineno}: kernel-style size bound: {ast.unparse(node)}"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kernels":
            if _limit(node.attr):
                yield f"{rel}:{node.lineno}: kernel limit used outside the room: kernels.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xhc.kernels"):
            for a in node.names:
                if _limit(a.name):
                    yield f"{rel}:{node.lineno}: kernel limit imported from the room: {a.name}"


def _limit(ident: str) -> bool:
    """A limit constant of a fused kernel: an upper-case name with ``MAX`` (``FUSED_WRITE_MAX_KERNELS``)."""
    return ident.isupper() and "MAX" in ident


def _maths_files():
    return sorted(p for root in MATHS for p in root.rglob("*.py") if KERNELS not in p.parents and p != NAME_HOME)


def test_the_decision_scan_sees_every_form(tmp_path):
    """The scan itself: each way the maths could pick a kernel path is caught; ordinary maths is not."""
    bad = ['ok = backend == "triton"', 'ok = self.backend(X) != "compile"', 'ok = b in ("triton", "liger")',
           "ok = cfg.k <= 16", "ok = 8 >= K", "ok = len(t.conv) <= 3", "ok = n < 17",
           "ok = len(t.conv) <= kernels.FUSED_WRITE_MAX_KERNELS", "from xhc.kernels import XHC_MAX_K"]
    good = ['ok = cfg.read_init == "auto"', "ok = K < 2", "ok = x.dim() == 4", "ok = len(parts) > 2",
            "ok = self.step < 4", 'ok = kernels.mhc_fused(cfg, X, training)', 'ok = s == "sigmoid"']
    for i, src in enumerate(bad):
        f = tmp_path / f"bad{i}.py"
        f.write_text(src + "\n")
        assert list(maths_decisions(f, tmp_path)), src
    f = tmp_path / "good.py"
    f.write_text("\n".join(good) + "\n")
    assert not list(maths_decisions(f, tmp_path))


def test_only_the_kernels_room_picks_a_kernel_path():
    """The maths (xhc/ outside xhc/kernels/, models/) asks the room's predicates (``kernels.mhc_fused``,
    ``kernels.xhc_entry_fused``, ...) and never compares a backend name or repeats a fused kernel's
    limits: those live once, beside the kernel.  training/ compares no backend name either."""
    files = _maths_files()
    assert len(files) > 20 and XHC / "flash.py" in files, files
    training = XHC.parent / "training"  # (counts and sizes there are data, not kernel limits: names only)
    found = [hit for f in files for hit in maths_decisions(f, XHC.parent)
             if training not in f.parents or "backend name" in hit]
    assert not found, ("the maths decides a kernel path itself; ask a predicate of xhc/kernels instead: "
                       + "; ".join(found))


# ------------------------------------------------------------------------------------------------
# A kernels room without circles
# ------------------------------------------------------------------------------------------------
def _module(path: Path) -> str:
    parts = list(path.relative_to(XHC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_imports(files):
    """``{module: {(line, imported module, names), ...}}`` for every import inside the room, at any depth
    (a lazy import inside a function makes a circle too); relative imports resolved."""
    mods = {_module(p): p for p in files}
    out = {}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges += [(node.lineno, a.name, ()) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    head = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(head + ([node.module] if node.module else []))
                names = tuple(a.name for a in node.names)
                subs = [n for n in names if f"{base}.{n}" in mods]  # `from pkg import submodule`
                edges += [(node.lineno, f"{base}.{n}", ()) for n in subs]
                rest = tuple(n for n in names if n not in subs)
                if rest or not subs:
                    edges.append((node.lineno, base, rest))
        out[mod] = [(line, name, names) for line, name, names in edges if name in mods]
    return mods, out


def room_problems(root: Path):
    """Circles among the room's modules, imports of a room package's own ``__init__`` from inside it,
    and private names (``_x``) borrowed from another module of the room."""
    files = sorted(root.rglob("*.py"))
    global XHC
    old, XHC = XHC, root.parent
    try:
        mods, edges = room_imports(files)
    finally:
        XHC = old
    problems = []
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    for mod, es in edges.items():
        for line, name, names in es:
            if name in packages and mods[mod].name != "__init__.py" and (name == mod.rpartition(".")[0] or
                                                                           mod.startswith(name + ".")):
                problems.append(f"{mod}:{line} imports its room's __init__ ({name}: {', '.join(names) or '*'})")
            private = [n for n in names if n.startswith("_")]
            if private and name != mod:
                problems.append(f"{mod}:{line} borrows private {', '.join(private)} from {name}")
    graph = {m: {n for _, n, _ in es if n != m and n not in packages} for m, es in edges.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                problems.append("circle: " + " -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return problems


def test_the_room_scan_sees_circles_init_imports_and_borrowing(tmp_path):
    room = tmp_path / "xhc" / "kernels"
    (room / "sub").mkdir(parents=True)
    (room / "__init__.py").write_text("LIMIT = 3\n")
    (room / "sub" / "__init__.py").write_text("")
    (room / "a.py").write_text("from xhc.kernels import LIMIT\nfrom xhc.kernels.b import _tile\n")
    (room / "b.py").write_text("def f():\n    from xhc.kernels import a\n_tile = 1\n")
    (room / "sub" / "c.py").write_text("from . import d\n")
    (room / "sub" / "d.py").write_text("from .c import *\n")
    (room / "e.py").write_text("from xhc.kernels.b import f\nfrom xhc.kernels.sub import c\n")
    got = "\n".join(room_problems(room))
    assert "xhc.kernels.a:1 imports its room's __init__" in got
    assert "xhc.kernels.a:2 borrows private _tile from xhc.kernels.b" in got
    assert "circle: xhc.kernels.a -> xhc.kernels.b -> xhc.kernels.a" in got
    assert "circle: xhc.kernels.sub.c -> xhc.kernels.sub.d -> xhc.kernels.sub.c" in got
    assert "xhc.kernels.e" not in got  # a public name, a submodule through its package: fine


def test_the_kernels_room_has_no_circles():
    """No import circle among xhc/kernels' modules (lazy imports count), nothing in the room imports the
    room's own ``__init__`` (it imports them: shared constants live in common modules), and no module
    borrows another's private helper (shared helpers are public in a common module)."""
    problems = room_problems(KERNELS)
    assert not problems, "the kernels room (docs/kernels.md, 'The room'):\n" + "\n".join(problems)


def test_no_room_module_shadows_a_dispatcher_op():
    """A module of the room named like one of the dispatcher's ops (``xhc/kernels/read.py`` beside
    ``kernels.read``) would replace that op by the module on its first import: the package attribute
    of a submodule is set when it is imported."""
    tree = ast.parse((KERNELS / "__init__.py").read_text())
    ops = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    ops |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert {"read", "write", "sinkhorn", "mhc_fused"} <= ops, ops  # the scan sees the dispatcher's names
    modules = {p.stem for p in KERNELS.glob("*.py")} | {p.name for p in KERNELS.iterdir() if (p / "__init__.py").exists()}
    clash = sorted(modules & ops)
    assert not clash, f"xhc/kernels modules named like a dispatcher op of xhc/kernels/__init__.py: {clash}; rename the module"


def test_the_docs_show_the_room():
    """docs/kernels.md's tree of the room names every module of xhc/kernels/, one line each, and no other."""
    text = (XHC.parent / "docs" / "kernels.md").read_text()
    tree = text.split("```\nxhc/kernels/\n", 1)[1].split("```", 1)[0]
    listed = sorted(line.split()[0] for line in tree.splitlines() if line.strip())
    files = sorted(p.name for p in KERNELS.iterdir() if p.suffix in (".py", ".json"))
    assert listed == files, f"docs/kernels.md 'The room' lists {listed}; xhc/kernels/ holds {files}"
