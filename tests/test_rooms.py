"""The house test of the rooms (docs/architecture.md, "Rooms"): an AST walk over every import of the
product (module level and inside functions alike) that fails on

- an import circle anywhere in the product, where a name taken from a room's lazy surface
  (``from training.run import MetricsLogger``) counts as an import of the module that defines it;
- an import of a room's private module, or of a private name, from outside the room (outside code
  uses the room's ``__init__``; inside, a module never imports its own room's ``__init__``);
- an import that points up across the rooms of ``training/`` and ``tools/`` (``ORDER`` below).

The scan of each rule is tested on a small tree of its own, so that a blind scan cannot pass.

``python -m tests.test_rooms --floors training [--root DIR]`` prints the import floors and arrows of
a package (module by module, and room by room): the numbers of issue 51's before/after.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("xhc", "models", "training", "tools", "bench", "configs")
ROOM_PARENTS = ("training", "tools")  # their sub-packages are the rooms held to the surface rule
# bottom to top, per package: a unit is a room or a top-level module; a unit imports only the units
# at or below its own place.  ``*`` is the floor of every module not named (the single-file tools).
ORDER = {
    "training": ["rooms", "data", "schedule", "optim", "config", "checkpoint", "run", "plan", "builder",
                 "finetune", "pretrain"],
    "tools": ["_cli", "hf", "inspect", "sweep", "*"],
}

Edge = Tuple[str, int, str]  # (importing module, line, imported module)


@functools.lru_cache(maxsize=4)
def modules(root: Path) -> Dict[str, Path]:
    out = {}
    for pkg in PRODUCT:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _surface(path: Path) -> Optional[Dict[str, str]]:
    """A room ``__init__``'s ``_EXPORTS = {name: submodule}``, or None."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            return {ast.literal_eval(k): ast.literal_eval(v) for k, v in zip(node.value.keys, node.value.values)}
    return None


def _import_module_literal(node: ast.Call) -> Optional[str]:
    f = node.func
    if not ((isinstance(f, ast.Attribute) and f.attr == "import_module") or
            (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))) or not node.args:
        return None
    a = node.args[0]
    if isinstance(a, ast.Constant) and isinstance(a.value, str):
        return a.value
    return None


@functools.lru_cache(maxsize=4)
def edges(root: Path) -> Tuple[Dict[str, Path], List[Tuple[str, int, str, Tuple[str, ...]]]]:
    """Every import of the product as ``(importer, line, imported module, names)``, relative imports
    resolved, ``from package import submodule`` as an import of the submodule."""
    mods = modules(root)
    out = []
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                out += [(mod, node.lineno, a.name, ()) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    head = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(head + ([node.module] if node.module else []))
                names = tuple(a.name for a in node.names)
                subs = [n for n in names if f"{base}.{n}" in mods]
                out += [(mod, node.lineno, f"{base}.{n}", ()) for n in subs]
                rest = tuple(n for n in names if n not in subs)
                if rest or not subs:
                    out.append((mod, node.lineno, base, rest))
            elif isinstance(node, ast.Call):
                name = _import_module_literal(node)
                if name:
                    out.append((mod, node.lineno, name, ()))
    return mods, [e for e in out if e[2].split(".")[0] in PRODUCT]


def rooms(mods: Dict[str, Path]) -> Set[str]:
    """The rooms held to the surface rule: every sub-package of ``training/`` and ``tools/``
    (``xhc/kernels/`` has its own room test: tests/test_xhc_layering.py; the kernel compiler and
    benches build and time its kernel modules one by one, on purpose)."""
    return {m for m, p in mods.items() if p.name == "__init__.py" and m.count(".") == 1 and m.split(".")[0] in ROOM_PARENTS}


def room_of(mod: str, all_rooms: Iterable[str]) -> Optional[str]:
    return next((r for r in all_rooms if mod == r or mod.startswith(r + ".")), None)


def graph(root: Path) -> Tuple[Dict[str, Set[str]], Dict[Tuple[str, str], int]]:
    """``{module: modules it imports}``: a name from a lazy surface points at its defining module; an
    import also runs the ``__init__`` of each package above the imported module (not the importer's own)."""
    mods, es = edges(root)
    surfaces = {m: _surface(p) for m, p in mods.items() if p.name == "__init__.py"}
    g: Dict[str, Set[str]] = {m: set() for m in mods}
    where: Dict[Tuple[str, str], int] = {}

    def add(a, b, line):
        if b in mods and b != a:
            g[a].add(b)
            where.setdefault((a, b), line)

    for mod, line, name, names in es:
        target = name
        while target and target not in mods:
            target = target.rpartition(".")[0]
        if not target:
            continue
        own = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        parts = target.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in own:
                add(mod, parent, line)
        surface = surfaces.get(target)
        add(mod, target, line)  # (its ``__init__`` runs)
        if surface and names:
            for n in names:
                if n in surface:
                    add(mod, f"{target}.{surface[n]}", line)
    return g, where


def circles(g: Dict[str, Set[str]]) -> List[List[str]]:
    """One circle per strongly connected component with more than one module (Tarjan)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(_cycle_in(sorted(comp), g))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def _cycle_in(comp: List[str], g: Dict[str, Set[str]]) -> List[str]:
    """A concrete circle through the component's first module (breadth-first back to it)."""
    start, members = comp[0], set(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v] & members):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def surface_problems(root: Path) -> List[str]:
    """Imports of a room's private module (or private name) from outside it, and of a room's own
    ``__init__`` from inside it."""
    mods, es = edges(root)
    all_rooms = rooms(mods)
    out = []
    for mod, line, name, names in es:
        target = name
        while target and target not in mods:
            target = target.rpartition(".")[0]
        room = room_of(target, all_rooms)
        if room is None:
            continue
        rel = mods[mod].relative_to(root).as_posix()
        mine = room_of(mod, all_rooms)
        if mine == room:
            if target == room and mods[mod].name not in ("__init__.py", "__main__.py"):  # (the command runs the surface)
                out.append(f"{rel}:{line} imports its own room's __init__ ({room}): import the sibling module")
            continue
        if target != room:
            out.append(f"{rel}:{line} imports {target}, a module inside the room {room}: import from {room}")
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        if private:
            out.append(f"{rel}:{line} takes private {', '.join(private)} from {room}")
    return out


def _unit(mod: str) -> Optional[Tuple[str, str]]:
    parts = mod.split(".")
    if len(parts) < 2 or parts[0] not in ORDER:
        return None
    return parts[0], parts[1]


def _place(pkg: str, unit: str) -> Optional[int]:
    order = ORDER[pkg]
    if unit in order:
        return order.index(unit)
    return order.index("*") if "*" in order else None


def upward_problems(root: Path) -> List[str]:
    g, where = graph(root)
    mods = modules(root)
    out = []
    for a in sorted(g):
        ua = _unit(a)
        if ua is None:
            continue
        pa = _place(*ua)
        if pa is None:
            out.append(f"{a}: the unit {ua[1]} has no place in ORDER[{ua[0]!r}] (tests/test_rooms.py): give it one")
            continue
        for b in sorted(g[a]):
            ub = _unit(b)
            if ub is None or ub[0] != ua[0] or ub[1] == ua[1]:
                continue
            pb = _place(*ub)
            if pb is None or pb > pa or (pb == pa and ua[1] != ub[1] and ORDER[ua[0]][pa] == "*"):
                rel = mods[a].relative_to(root).as_posix()
                out.append(f"{rel}:{where[(a, b)]} imports {b}: {ua[1]} sits below {ub[1]} in ORDER[{ua[0]!r}]")
    return out


def floors(root: Path, package: str, by_room: bool = False) -> Tuple[List[List[str]], int]:
    """The modules (or units) of ``package`` on import floors (floor 0 imports nothing of the package;
    floor k imports something on floor k-1), and the number of arrows between them."""
    g, _ = graph(root)
    key = (lambda m: m.split(".")[1] if m.count(".") >= 1 else m) if by_room else (lambda m: m)
    nodes = {key(m) for m in g if m.startswith(package + ".")}
    arrows = {(key(a), key(b)) for a in g if a.startswith(package + ".") for b in g[a]
              if b.startswith(package + ".") and key(a) != key(b)}
    level: Dict[str, int] = {}

    def lvl(n, seen=()):
        if n in level:
            return level[n]
        if n in seen:
            return 0  # a circle: counted once
        deps = [b for a, b in arrows if a == n]
        level[n] = 1 + max((lvl(b, seen + (n,)) for b in deps), default=-1)
        return level[n]

    for n in nodes:
        lvl(n)
    out: List[List[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for n, k in level.items():
        out[k].append(n)
    return [sorted(f) for f in out], len(arrows)


# ------------------------------------------------------------------------------------------------
def test_the_product_has_no_import_circle():
    g, where = graph(ROOT)
    assert "training.optim.build" in g and "training.optim.megatron" in g["training.optim.build"]
    found = circles(g)
    assert not found, "import circles (a lazy import counts; move the shared code below both):\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_rooms_are_entered_through_their_surface():
    bad = surface_problems(ROOT)
    assert not bad, "docs/architecture.md, 'Rooms':\n" + "\n".join(bad)


def test_rooms_point_one_way():
    bad = upward_problems(ROOT)
    assert not bad, "docs/architecture.md, 'Rooms':\n" + "\n".join(bad)


@functools.lru_cache(maxsize=None)
def _bound_names(path: Path) -> Set[str]:
    """The names a module binds at its top: definitions, assignments and imports."""
    out: Set[str] = set()
    for n in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return out


def test_every_surface_name_exists_in_its_module():
    """Each ``_EXPORTS`` entry names a module of the room that binds the name, and no surface name
    shadows a module of its room (importing the module would replace the name on the package)."""
    mods = modules(ROOT)
    bad = []
    for m, p in mods.items():
        surface = _surface(p) if p.name == "__init__.py" else None
        for name, sub in (surface or {}).items():
            path = mods.get(f"{m}.{sub}")
            if path is None:
                bad.append(f"{m}: {name} -> missing module {sub}")
            elif name not in _bound_names(path):
                bad.append(f"{m}: {name} is not defined in {m}.{sub}")
            if f"{m}.{name}" in mods:
                bad.append(f"{m}: surface name {name} shadows the module {m}.{name}")
    assert len([m for m, p in mods.items() if p.name == "__init__.py" and _surface(p)]) >= 6
    assert not bad, "\n".join(bad)


def _tree(tmp: Path, files: Dict[str, str]) -> Path:
    for rel, src in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    for pkg in PRODUCT:
        (tmp / pkg).mkdir(exist_ok=True)
    return tmp


def test_the_scans_see_every_form(tmp_path):
    """Each rule on a small tree: a lazy circle through a surface, a private module and a private name
    taken from outside, an own-room ``__init__`` import, an upward import; clean code passes."""
    root = _tree(tmp_path, {
        "training/__init__.py": "",
        "training/rooms.py": "",
        "training/optim/__init__.py": "_EXPORTS = {'build': 'build', 'Config': 'core'}\n",
        "training/optim/core.py": "class Config: pass\ndef f():\n    from training.optim.megatron import g\n",
        "training/optim/megatron.py": "from training.optim.core import Config\n",
        "training/optim/build.py": "from training.optim import Config\n",
        "training/config.py": "from training.optim import Config\n",
        "training/run/__init__.py": "_EXPORTS = {'log': 'metrics'}\n",
        "training/run/metrics.py": "def log(): pass\n_x = 1\n",
        "training/plan/__init__.py": "",
        "training/plan/model.py": "from training.run.metrics import log\nfrom training.run import _x\n",
        "training/schedule.py": "def f():\n    from training.config import X\n",
        "tools/__init__.py": "",
        "tools/zoo.py": "from training.run import log\n",
    })
    g, _ = graph(root)
    assert g["training.config"] == {"training.optim", "training.optim.core"}  # the surface name -> its module
    got = " | ".join(" -> ".join(c) for c in circles(g))
    assert "training.optim.core -> training.optim.megatron -> training.optim.core" in got, got
    sp = "\n".join(surface_problems(root))
    assert "training/plan/model.py:1 imports training.run.metrics, a module inside the room training.run" in sp, sp
    assert "training/plan/model.py:2 takes private _x from training.run" in sp, sp
    assert "training/optim/build.py:1 imports its own room's __init__ (training.optim)" in sp, sp
    assert "training/config.py" not in sp and "tools/zoo.py" not in sp
    up = "\n".join(upward_problems(root))
    assert "training/schedule.py:2 imports training.config: schedule sits below config" in up, up
    assert "training/config.py" not in up and "training/plan" not in up


def test_the_circle_of_issue_51_would_be_found(tmp_path):
    """The flat layout's lazy circle (optim imports build_megatron inside a function, optim_megatron
    takes the shared types back at module level) is a circle to the scan."""
    root = _tree(tmp_path, {
        "training/__init__.py": "",
        "training/optim.py": "def build_optimizer():\n    from training.optim_megatron import build_megatron\n",
        "training/optim_megatron.py": "from training.optim import Muon, TrainOptimizer\n",
    })
    assert circles(graph(root)[0]) == [["training.optim", "training.optim_megatron", "training.optim"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.test_rooms", description="import floors and arrows of a package")
    p.add_argument("--floors", default="training", help="the package (default: training)")
    p.add_argument("--root", default=str(ROOT), help="the checkout to scan (default: this one)")
    args = p.parse_args(argv)
    root = Path(args.root)
    for by_room, what in ((False, "modules"), (True, "units (rooms and top-level modules)")):
        fl, arrows = floors(root, args.floors, by_room)
        print(f"{args.floors}/: {sum(map(len, fl))} {what} on {len(fl)} floors, {arrows} arrows")
        for k, f in enumerate(fl):
            print(f"  floor {k}: {' '.join(f)}")
    g, _ = graph(root)
    print(f"circles: {[' -> '.join(c) for c in circles(g) if c[0].startswith(args.floors + '.')] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
