"""The remote code an export ships: ``models/hf/export/remote`` plus the xhc modules it imports,
flattened into the export folder with relative imports (``trust_remote_code=True`` loads them)."""

from __future__ import annotations

import os
import re
from typing import List, Tuple

import models.hf.export as _export
import xhc as _xhc
from tools.hf.errors import ConversionError

REMOTE_DIR = os.path.join(os.path.dirname(os.path.abspath(_export.__file__)), "remote")
XHC_DIR = os.path.dirname(os.path.abspath(_xhc.__file__))


# The exported model runs the HC maths on the ``eager`` backend (the readable reference functions,
# plain PyTorch): inference needs no hand-written backward, no Triton and no Liger-Kernel, so these
# modules are not shipped.  An import of one of them in the shipped code becomes a placeholder that
# raises (with the reason) if it is ever used; it never is with ``hc.kernels: eager``.
EXPORT_KERNELS = "eager"
# every module of xhc/kernels/ but the package itself, torch_ops (the eager and compile ops) and runtime
# (whether Triton imports; the package imports it): a kernel module added later is left out without
# being listed here
NOT_SHIPPED = tuple(sorted(f"xhc.kernels.{f[:-3]}" for f in os.listdir(os.path.join(os.path.dirname(_xhc.__file__),
                                                                                      "kernels"))
                           if f.endswith(".py") and f not in ("__init__.py", "torch_ops.py", "runtime.py")))
NOT_SHIPPED_FILE = "xhc_not_shipped.py"
_NOT_SHIPPED_SRC = '''"""Placeholder for the xhc modules an exported folder does not ship (it runs the eager HC path)."""


class NotShipped:
    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        raise RuntimeError(f"{self._module}.{name}: this exported folder runs the hyper-connection maths on the "
                           "eager backend only (config.json hc.kernels = 'eager'); the fused backends ship with "
                           "the xhc package (pip install xhc), not with exported models")
'''


def export_remote_code(out_dir: str) -> List[str]:
    """Copy the remote code and the xhc modules it uses into ``out_dir``, flat, with relative imports.

    ``xhc.a`` becomes ``a.py`` and ``xhc.a.b`` (a module of the package ``xhc/a/``) becomes
    ``a_b.py``: transformers' remote-code loader resolves ``from .name import`` against files in
    the same folder only.  The modules in :data:`NOT_SHIPPED` (GPU kernels) are left out.
    """
    sources = [(os.path.join(REMOTE_DIR, n), n) for n in ("configuration_xhc_moe.py", "modeling_xhc_moe.py")]
    sources += [(xhc_module_file(mod), flat_module_name(mod) + ".py")
                for mod in xhc_modules_needed([p for p, _ in sources])]
    written = []
    for path, name in sources:
        with open(path, encoding="utf-8") as f:
            text = relative_imports(f.read())
        left = re.findall(r"^\s*(?:from|import)\s+(xhc|models|training)\b", text, re.M)
        if left:
            raise ConversionError(f"remote code {name}: still imports {left[0]} after the rewrite")
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.write(text)
        written.append(name)
    with open(os.path.join(out_dir, NOT_SHIPPED_FILE), "w", encoding="utf-8") as f:
        f.write(_NOT_SHIPPED_SRC)
    return written + [NOT_SHIPPED_FILE]


_FROM_XHC = re.compile(r"^(\s*)from xhc((?:\.\w+)*) import (.+)$", re.M)


def xhc_module_file(dotted: str) -> str:
    """The source file of ``xhc.a`` / ``xhc.a.b`` (a package's ``__init__.py``), or '' if none."""
    parts = dotted.split(".")[1:]
    base = os.path.join(XHC_DIR, *parts)
    if os.path.isfile(base + ".py"):
        return base + ".py"
    return os.path.join(base, "__init__.py") if os.path.isfile(os.path.join(base, "__init__.py")) else ""


def flat_module_name(dotted: str) -> str:
    return "_".join(dotted.split(".")[1:])


def _imported_names(names: str) -> List[Tuple[str, str]]:
    """``a, b as c`` -> [(a, a), (b, c)]; [] for a parenthesised (multi-line) list."""
    if "(" in names:
        return []
    out = []
    for part in names.split("#")[0].split(","):
        bits = part.split()
        if bits:
            out.append((bits[0], bits[2] if len(bits) == 3 and bits[1] == "as" else bits[0]))
    return out


def _imports_of(text: str) -> List[str]:
    """Dotted xhc modules a source imports (``from xhc.a import f``, ``from xhc.a import submodule``)."""
    mods = []
    for _, pkg, names in _FROM_XHC.findall(text):
        if pkg:
            mods.append("xhc" + pkg)
        for name, _ in _imported_names(names):
            if xhc_module_file(f"xhc{pkg}.{name}"):
                mods.append(f"xhc{pkg}.{name}")
    return mods


def xhc_modules_needed(files: List[str]) -> List[str]:
    """The ``xhc`` modules (dotted) ``files`` import, transitively (module-level and lazy imports)."""
    todo, seen = list(files), set()
    while todo:
        with open(todo.pop(), encoding="utf-8") as f:
            for mod in _imports_of(f.read()):
                if mod not in seen and mod not in NOT_SHIPPED and xhc_module_file(mod):
                    seen.add(mod)
                    todo.append(xhc_module_file(mod))
    return sorted(seen)


def relative_imports(text: str) -> str:
    """Rewrite ``from xhc...`` imports for the flat export folder (see :func:`export_remote_code`)."""

    def one(m: "re.Match") -> str:
        indent, pkg, names = m.group(1), m.group(2), m.group(3)
        pairs = _imported_names(names)
        if pairs and all(xhc_module_file(f"xhc{pkg}.{n}") for n, _ in pairs):  # importing modules
            # transformers copies a remote module's files by matching ``from .x import`` lines, so
            # a module import also names one attribute of the module in that form.
            lines = []
            for n, alias in pairs:
                if f"xhc{pkg}.{n}" in NOT_SHIPPED:
                    lines.append(f"{indent}from .{NOT_SHIPPED_FILE[:-3]} import NotShipped as _NotShipped  # noqa: E402")
                    lines.append(f"{indent}{alias} = _NotShipped({'xhc' + pkg + '.' + n!r})")
                    continue
                flat = flat_module_name(f"xhc{pkg}.{n}")
                lines.append(f"{indent}from .{flat} import __name__ as _{flat}_name  # noqa: F401 (listed for transformers)")
                lines.append(f"{indent}from . import {flat} as {alias}")
            return "\n".join(lines)
        return f"{indent}from .{flat_module_name('xhc' + pkg)} import {names}"

    return _FROM_XHC.sub(one, text)
