"""The rooms' public surfaces, imported on first use.

A room is a sub-package by concern (``training.optim``, ``training.checkpoint``, ``training.plan``,
``training.run``, ``training.data``, ``tools.hf``, ``tools.inspect``, ``tools.sweep``).  Its
``__init__`` names its public surface as ``_EXPORTS = {name: module of the room}``; code outside the
room imports those names from the package (``from training.run import MetricsLogger``), code inside
imports its sibling modules directly and never the room's ``__init__`` (docs/architecture.md, "Rooms";
``tests/test_layering.py`` checks both, and that no import circle exists).

:func:`lazy_exports` is the room's ``__getattr__``: a name's module is imported when the name is first
used, so importing a room costs nothing more than what is used (``training.pretrain`` keeps its top
light: dist_checkpointing's save starts a helper process that re-imports the main module).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Dict


def lazy_exports(package: str, exports: Dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` serving ``exports`` (``{name: submodule}``)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # the next lookup is a plain attribute
        return value

    return __getattr__
