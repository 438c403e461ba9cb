"""Shared pytest fixtures."""

import pytest


@pytest.fixture(scope="session")
def run_torchrun():
    """``run_torchrun(script, nproc=2, args=(), timeout=180, check=True)``: launch a torchrun
    worker (see :func:`tests.dist.launch.run_torchrun`) and return the ``CompletedProcess``."""
    from tests.dist.launch import run_torchrun as _run

    return _run
