"""Process-wide defaults for command-line entry points on machines without an NVIDIA driver.

On a CPU-only machine two environment defaults make the command-line tools much faster:

- ``TORCHDYNAMO_DISABLE=1``: Megatron-Core wraps a few small fused functions in ``torch.compile``;
  on CPU compiling them only costs start-up time.  Dynamo reads the variable at every call, so it
  must not leak out of the entry point: importing ``training.pretrain`` (tests, notebooks, other
  tools) must leave ``torch.compile`` working in the importing process.
- ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads that spin while waiting make a busy machine (other
  processes on the same cores) up to 10x slower for this many small ops.  OpenMP reads it when
  torch's libraries load, so entry points set it at import time (it changes nothing else).

Both only apply where the variable is not set already, and neither is applied where
``/dev/nvidiactl`` exists (a GPU machine).  Child processes (torchrun workers, dist_checkpointing's
writer) inherit what the entry point set.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


def on_cpu_machine() -> bool:
    return not os.path.exists("/dev/nvidiactl")


def set_omp_wait_policy() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` on CPU machines, unless set (call before ``import torch``)."""
    if on_cpu_machine():
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class _EntryPoint:
    def __init__(self, before):
        self._before = before

    def allow_compile(self) -> None:
        """The command compiles something after all (e.g. ``model.compile_hc``): undo the switch-off
        (a ``TORCHDYNAMO_DISABLE`` the user set is kept)."""
        if self._before is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)


@contextlib.contextmanager
def cpu_entry_point() -> Iterator[_EntryPoint]:
    """For the duration of a command's ``main``: switch dynamo off on a CPU machine unless the user
    set ``TORCHDYNAMO_DISABLE`` or the command calls ``allow_compile()`` on the yielded handle once
    its configuration is read; restore after."""
    key = "TORCHDYNAMO_DISABLE"
    before = os.environ.get(key)
    if on_cpu_machine() and before is None:
        os.environ[key] = "1"
    try:
        yield _EntryPoint(before)
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
