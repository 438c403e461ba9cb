"""Saving safely: signals held while a checkpoint is written, no helper server process, and one-line
errors for a failing disk (what :class:`training.checkpoint.Checkpointer` writes with)."""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import shutil
import signal
import threading
from typing import List

_HELD_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP")


@contextlib.contextmanager
def deferred_signals():
    """Hold SIGTERM / SIGINT / SIGUSR1 / SIGHUP for the duration of the block, then re-deliver them.

    Processes forked inside the block (``torch_dist``'s writers) inherit the holding handler, so a
    signal sent to the whole process group does not kill them mid-write.  Off the main thread
    (where Python cannot set handlers) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    received: List[int] = []

    def hold(signum, _frame):
        received.append(signum)

    previous = {}
    for name in _HELD_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, hold)
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


@contextlib.contextmanager
def inprocess_results_queue():
    """A plain queue for the write results of a *synchronous* ``torch_dist`` save.

    Megatron creates a ``multiprocessing.Manager`` (a spawned server process that re-imports the
    main module) for the results of async saves and uses it for synchronous ones too; in a
    synchronous save the results are put and read by this process, so a ``queue.Queue`` is enough.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:  # another Megatron layout: keep its default
        yield
        return
    if not hasattr(fa, "_results_queue"):
        yield
        return
    previous = fa._results_queue
    fa._results_queue = queue.Queue()
    try:
        yield
    finally:
        fa._results_queue = previous


_DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                errno.EPERM: "operation not permitted"}


def _causes(e: BaseException):
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        for v in getattr(x, "failures", {}).values() if isinstance(getattr(x, "failures", None), dict) else ():
            todo += list(v) if isinstance(v, (list, tuple)) else [v]
        todo += [a for a in getattr(x, "args", ()) if isinstance(a, BaseException)]


def describe_os_error(e: BaseException) -> str:
    """One line for an exception from a save: names disk-full / read-only / permission errors plainly."""
    for x in _causes(e):
        code = getattr(x, "errno", None)
        if isinstance(x, OSError) and code in _DISK_ERRNOS:
            return f"{_DISK_ERRNOS[code]} ({errno.errorcode.get(code, code)}{': ' + x.filename if x.filename else ''})"
    text = str(e).splitlines()[0] if str(e) else ""
    if "No space left on device" in str(e):
        return f"no space left on device (ENOSPC): {text}"
    return f"{type(e).__name__}: {text}"


_NO_SPACE_WORDS = ("no space left", "unexpected pos", "pytorchstreamwriter failed", "basic_ios::clear",
                   "short write", "disk quota exceeded", "file write failed")
"""How writers report a full disk besides ENOSPC: torch's zip writer (``inline_container.cc ...
unexpected pos N vs M``, ``PytorchStreamWriter failed writing file``), its C++ streams
(``basic_ios::clear``) and short writes."""


def mount_point(path: str) -> str:
    """The mount point of the filesystem holding ``path`` (the disk a message should name)."""
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    while not os.path.ismount(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def is_no_space(e: BaseException, directory: str) -> bool:
    """True when the save error ``e`` means the disk holding ``directory`` is full, whatever the
    writer's exception looks like (ENOSPC / EDQUOT, ``CheckpointException`` wrapping a worker's
    ``inline_container`` error, a short write), or the disk is nearly full after it."""
    for x in _causes(e):
        if isinstance(x, OSError) and getattr(x, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(x).lower()
        if any(w in text for w in _NO_SPACE_WORDS):
            return True
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return False
    return usage.free < max(64 << 20, usage.total // 100)


def explain_save_error(e: BaseException, directory: str) -> str:
    """:func:`describe_os_error`, plus the free space when the disk is (nearly) full: torch's C++
    writer reports a full disk as ``basic_ios::clear: iostream error``."""
    text = describe_os_error(e)
    if "no space" in text or "quota" in text:
        return text
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return text
    if usage.free < max(64 << 20, usage.total // 100):
        return (f"{text}; the disk holding it has only {usage.free / 2**20:.1f} MiB free of "
                f"{usage.total / 2**20:.0f} MiB: most likely no space left on device")
    return text
