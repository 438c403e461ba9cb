"""Fault injection for tests and the chaos run: ``XHC_FAULT_INJECT``, read once, never a config key.

The trainer calls :func:`fault_point` at the start of each of its sections (``startup``, ``data``,
``forward_backward``, ``optimizer``, ``checkpoint_save``, ``checkpoint_load``, ``evaluation``).
Without the environment variable it returns at once (one test of a module-level flag): nothing
else runs, nothing is allocated.  With it, the faults it lists fire where they match::

    XHC_FAULT_INJECT='rank=1,step=6,section=forward_backward,action=hang'
    XHC_FAULT_INJECT='rank=1,step=*,section=forward_backward,action=sleep:0.2;rank=0,step=9,section=checkpoint_save,action=enospc,attempt=2'

Each fault (``;`` between faults) is ``rank=R,step=S,section=NAME,action=ACTION[,attempt=A]``:

- ``rank``: the global rank (``RANK``; 0 without it); ``step``: the step number, or ``*`` for every step;
- ``section``: one of :data:`SECTIONS`;
- ``action``: ``hang`` (sleep forever; signals still run their handlers), ``sleep:SECONDS`` (a slow
  rank), ``raise`` (``RuntimeError``), ``enospc`` (``OSError(ENOSPC)``, what a full disk gives a
  save), ``kill`` (``SIGKILL`` to this process);
- ``attempt``: fire only in that launch attempt (``XHC_ATTEMPT``, else the number of lines in
  ``<run.dir>/attempts.jsonl`` plus one, which the trainer passes to :func:`set_attempt`); by
  default in every attempt.

The step a section belongs to: the step being trained (``data``, ``forward_backward``,
``optimizer``: 1 for the first step), the step a checkpoint holds (``checkpoint_save``,
``checkpoint_load``), the step evaluated (``evaluation``), the step the run starts from (``startup``).
``checkpoint_save`` fires where the rank writes its files (inside the synchronous save, or in the
background writer thread of an asynchronous one), so ``enospc`` there fails the save as a full disk
does (exit 4, the partial save removed) and ``hang`` leaves a partial save behind for the watchdog.

A fault that fires prints one line on stderr (``[xhc] fault injected: ...``, with the wall time) so a
test can time what follows; a fault with ``step=*`` prints only the first time.  A malformed value
is a one-line :class:`FaultSpecError` (a ``ConfigError``: exit 2) at the first fault point.

See docs/reliability.md, "Fault injection".
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

from training.config import ConfigError

__all__ = ["ENV", "SECTIONS", "Fault", "FaultSpecError", "fault_point", "faults_active", "parse_faults",
           "set_attempt"]

ENV = "XHC_FAULT_INJECT"
SECTIONS = ("startup", "data", "forward_backward", "optimizer", "checkpoint_save", "checkpoint_load", "evaluation")
ACTIONS = ("hang", "sleep", "raise", "enospc", "kill")


class FaultSpecError(ConfigError):
    """``XHC_FAULT_INJECT`` is malformed (the message names the part and the accepted forms)."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: Optional[int]  # None: every step
    section: str
    action: str
    seconds: float = 0.0  # sleep:SECONDS
    attempt: Optional[int] = None

    def describe(self) -> str:
        act = f"sleep:{self.seconds:g}" if self.action == "sleep" else self.action
        return (f"rank={self.rank},step={'*' if self.step is None else self.step},section={self.section},"
                f"action={act}" + ("" if self.attempt is None else f",attempt={self.attempt}"))


def _bad(part: str, why: str) -> FaultSpecError:
    return FaultSpecError(f"{ENV}: {part!r}: {why}; the form is rank=R,step=S|*,section=NAME,"
                          f"action=hang|sleep:SECONDS|raise|enospc|kill[,attempt=A], faults separated by ';'")


def parse_faults(text: str) -> List[Fault]:
    """The faults of an ``XHC_FAULT_INJECT`` value (see the module docstring)."""
    faults = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        fields = {}
        for item in part.split(","):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or key not in ("rank", "step", "section", "action", "attempt") or key in fields:
                raise _bad(part, f"unknown, repeated or valueless field {item.strip()!r}")
            fields[key] = value
        missing = [k for k in ("rank", "step", "section", "action") if k not in fields]
        if missing:
            raise _bad(part, f"missing {', '.join(missing)}")
        try:
            rank = int(fields["rank"])
            step = None if fields["step"] == "*" else int(fields["step"])
            attempt = int(fields["attempt"]) if "attempt" in fields else None
        except ValueError:
            raise _bad(part, "rank, step and attempt are integers (step may be *)") from None
        section = fields["section"]
        if section not in SECTIONS:
            raise _bad(part, f"section must be one of {', '.join(SECTIONS)}")
        action, _, arg = fields["action"].partition(":")
        if action not in ACTIONS or (action == "sleep") != bool(arg):
            raise _bad(part, "action must be hang, sleep:SECONDS, raise, enospc or kill")
        seconds = 0.0
        if action == "sleep":
            try:
                seconds = float(arg)
            except ValueError:
                raise _bad(part, f"sleep:{arg}: SECONDS is a number") from None
            if not seconds >= 0:
                raise _bad(part, f"sleep:{arg}: SECONDS must be >= 0")
        faults.append(Fault(rank, step, section, action, seconds, attempt))
    return faults


# Read once, at import: the flag is all that fault_point tests when the variable is unset.
_TEXT = os.environ.get(ENV, "")
_ACTIVE = bool(_TEXT.strip())
_faults: Optional[List[Fault]] = None  # parsed at the first fault point (an error then is one line)
_attempt: Optional[int] = None
_announced: set = set()


def faults_active() -> bool:
    """True when ``XHC_FAULT_INJECT`` was set when this module was imported."""
    return _ACTIVE


def set_attempt(attempt: int) -> None:
    """The launch attempt number (1 for the first launch) for faults with ``attempt=``; ``XHC_ATTEMPT``
    wins when set."""
    global _attempt
    _attempt = attempt


def _current_attempt() -> Optional[int]:
    env = os.environ.get("XHC_ATTEMPT")
    if env:
        try:
            return int(env)
        except ValueError:
            raise FaultSpecError(f"XHC_ATTEMPT={env!r}: must be an integer (the launch attempt, 1 first)") from None
    return _attempt


def fault_point(section: str, step: int) -> None:
    """Fire the faults of ``XHC_FAULT_INJECT`` that match this rank, ``section`` and ``step`` (a no-op
    without the variable)."""
    if not _ACTIVE:
        return
    _fire(section, step)


def _fire(section: str, step: int) -> None:
    global _faults
    if _faults is None:
        _faults = parse_faults(_TEXT)
    rank = int(os.environ.get("RANK", "0") or 0)
    for f in _faults:
        if f.rank != rank or f.section != section or (f.step is not None and f.step != step):
            continue
        if f.attempt is not None and _current_attempt() != f.attempt:
            continue  # another attempt (or none known: an attempt-bound fault does not fire)
        if f.step is not None or f not in _announced:
            _announced.add(f)
            sys.stderr.write(f"[xhc] fault injected at {time.time():.3f}: {f.describe()} (step {step}, "
                             f"pid {os.getpid()})\n")
            sys.stderr.flush()
        if f.action == "hang":
            while True:  # sleeps in short slices: a signal handler runs between them
                time.sleep(1.0)
        elif f.action == "sleep":
            time.sleep(f.seconds)
        elif f.action == "raise":
            raise RuntimeError(f"injected fault ({ENV}): {f.describe()} at step {step}")
        elif f.action == "enospc":
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by {ENV}: {f.describe()})")
        elif f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
