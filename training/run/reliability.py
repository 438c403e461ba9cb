"""Run-directory lock, launcher-death handling and start-up (pre-flight) checks for xhc-pretrain.

- :class:`RunLock`: ``<run.dir>/.lock`` (JSON: host, PID, the PID's start time, when) created with
  ``O_EXCL`` by rank 0.  A second run on the same directory refuses with the holder's host and PID;
  a lock whose holder is gone (same host, PID not running, or running with another start time,
  i.e. a reused PID) is stale and taken over with a warning.  A lock from another host cannot be
  checked from here: the message says how to remove it if that run is gone.
- :func:`exit_with_launcher`: a worker started by torchrun asks the kernel for SIGTERM when its
  launcher dies (``prctl(PR_SET_PDEATHSIG)``), so a ``kill -9`` of torchrun makes the workers save
  and exit instead of training on as orphans.
- :func:`check_writable`, :func:`check_free_space`: a read-only or full output directory is
  reported at start-up in one line, not at the first save.

See ``docs/reliability.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from typing import Callable, Optional

from training.config import ConfigError

__all__ = ["RunLock", "RunLocked", "check_free_space", "check_writable", "exit_with_launcher", "human_mb"]

LOCK_NAME = ".lock"


class RunLocked(ConfigError):
    """Another live run holds the run directory."""


def _start_time(pid: int) -> Optional[str]:
    """The kernel's start time of ``pid`` (field 22 of /proc/<pid>/stat), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``<directory>/.lock`` held by this process (see the module docstring)."""

    def __init__(self, directory: str, log: Callable[[str], None] = print):
        self.path = os.path.join(directory, LOCK_NAME)
        self.log = log
        self.held = False

    def _holder(self) -> Optional[dict]:
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable or half-written: treated as stale below

    def _stale(self, holder: dict) -> bool:
        if not holder or "pid" not in holder:
            return True
        if holder.get("host") != socket.gethostname():
            return False
        pid = int(holder["pid"])
        if pid == os.getpid() or not _alive(pid):
            return True
        started = holder.get("start_time")
        return started is not None and _start_time(pid) not in (None, started)

    def acquire(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": _start_time(os.getpid()),
              "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        for _attempt in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released in between
                if not self._stale(holder):
                    where = "" if holder.get("host") == me["host"] else f" on host {holder.get('host')}"
                    raise RunLocked(f"run.dir {os.path.dirname(self.path)} is in use by PID {holder.get('pid')}"
                                    f"{where} (since {holder.get('since')}; lock {self.path}): wait for that run, "
                                    f"stop it, or choose another run.dir; if that run is gone, delete the lock file")
                self.log(f"[xhc] warning: taking over the stale lock {self.path} of PID {holder.get('pid')} "
                         f"on {holder.get('host')} (no longer running)")
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                continue
            except OSError as e:
                raise ConfigError(f"run.dir {os.path.dirname(self.path)}: cannot create the lock file "
                                  f"({e.strerror}): choose a writable run.dir") from None
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(me, f)
            self.held = True
            return
        raise RunLocked(f"run.dir {os.path.dirname(self.path)}: could not take the lock {self.path}; retry")

    def release(self) -> None:
        if not self.held:
            return
        holder = self._holder()
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self.held = False


def exit_with_launcher() -> bool:
    """Under torchrun (Linux): SIGTERM this process when its launcher dies; True when armed.

    The signal goes through the trainer's handler (save at the step boundary, exit 0).  When the
    launcher is already gone (re-parented to init) the signal is sent at once.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ and "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return False
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
        if os.getppid() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return True
    except (OSError, AttributeError):
        return False


def human_mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def check_writable(directory: str, key: str) -> None:
    """Create ``directory`` and a probe file in it; a one-line :class:`ConfigError` naming ``key`` if not."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".xhc-write-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        what = e.strerror or type(e).__name__
        if e.filename and e.filename != directory:
            what += f": {e.filename}"
        raise ConfigError(f"{key} {directory}: not writable ({what}): choose a writable {key}") from None


def check_free_space(directory: str, needed_bytes: float, key: str) -> None:
    """A one-line :class:`ConfigError` when ``directory`` has less free space than ``needed_bytes``."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return
    if free < needed_bytes:
        raise ConfigError(f"{key} {directory}: {human_mb(free)} free, one checkpoint needs about "
                          f"{human_mb(needed_bytes)}: free space or point {key} at a larger disk")
