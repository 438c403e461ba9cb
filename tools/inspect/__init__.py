"""The inspection room: ``python -m tools.inspect`` (``xhc-inspect``) reads a run or checkpoint and
draws what the streams, mixings and router do.

Modules: ``cli`` (the command and its reports), ``sources`` (runs, checkpoints and HF folders as
inputs), ``figures`` (the plots).
"""

from __future__ import annotations

from training.rooms import lazy_exports

_EXPORTS = {
    "main": "cli", "nearest_permutation": "cli", "Recorder": "cli",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
