"""Small helpers shared by the data pipeline: errors, atomic writes, hashing, logging."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from typing import Callable, Iterator

Log = Callable[[str], None]


class DataError(ValueError):
    """Bad input to the data pipeline.  The message is one line naming the file/field and the fix."""


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def temp_path_for(path: str) -> str:
    """A unique temporary name in the same folder as ``path`` (so ``os.replace`` is atomic)."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
    return tmp


@contextmanager
def atomic_open(path: str, mode: str = "w", **kwargs) -> Iterator:
    """Open a temporary file next to ``path``; rename it onto ``path`` only if the block succeeds."""
    tmp = temp_path_for(path)
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` as pretty JSON, atomically."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def read_json(path: str) -> dict | None:
    """The JSON object in ``path``, or None when the file is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def human_bytes(n: float) -> str:
    """``3144501`` -> ``"3.1 MB"`` (decimal units)."""
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} GB"
