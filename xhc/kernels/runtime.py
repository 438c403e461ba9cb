"""What this process can run, without importing Triton: whether ``import triton`` works and whether the
Triton interpreter is on (``TRITON_INTERPRET=1``: kernels run on CPU tensors, for tests).  The
dispatcher (:mod:`xhc.kernels`), Liger's op (:mod:`.liger`) and the kernels' settings
(:mod:`.mhc_common`) read it here; it is shipped with an exported model (it imports no GPU library)."""

from __future__ import annotations

import os
from typing import Optional

_TRITON_OK: Optional[bool] = None


def triton_available() -> bool:
    """True when ``import triton`` works (checked once; never raises)."""
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401

            _TRITON_OK = True
        except Exception:  # ImportError, or a broken install
            _TRITON_OK = False
    return _TRITON_OK


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels on CPU tensors (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
