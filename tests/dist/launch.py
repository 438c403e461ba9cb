"""Launch a torchrun worker script from a test: ``run_torchrun(script, nproc=2, args=())``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    script: str | os.PathLike,
    nproc: int = 2,
    args: Sequence[str] = (),
    timeout: float = 180.0,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --nproc_per_node <nproc> <script> <args>``.

    ``script`` is absolute or relative to the repository root.  Runs on a free local port with
    ``OMP_NUM_THREADS=1`` and the repo on ``PYTHONPATH``; stdout and stderr are captured
    together in ``.stdout``.  With ``check`` a non-zero exit raises ``AssertionError`` carrying
    the output tail; a run longer than ``timeout`` seconds is killed and raises.
    """
    script = Path(script)
    if not script.is_absolute():
        script = REPO / script
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", f"--master_port={free_port()}", "--master_addr=127.0.0.1",
        str(script), *map(str, args),
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"torchrun {script.name} timed out after {timeout:.0f} s:\n{out[-4000:]}") from None
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun {script.name} exited with {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc


def run_modes(modes: dict, argv: Sequence[str], what: str = "tensors") -> None:
    """Worker side: run the named test modes (all by default) on every rank.

    Each mode returns how many tensors it checked.  A failure prints the traceback and exits at
    once (torchrun then stops the peer, which may be waiting in a collective); after each mode the
    ranks meet at a barrier and rank 0 prints ``OK <mode>``.
    """
    import traceback

    import torch.distributed as dist

    from models.parallel import destroy_parallel

    for mode in argv or list(modes):
        try:
            n = modes[mode]()
        except Exception:
            print(f"FAIL {mode} (rank {os.environ.get('RANK')}):\n{traceback.format_exc()}", flush=True)
            os._exit(1)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"OK {mode} ({n} {what} checked)", flush=True)
    destroy_parallel(destroy_process_group=True)
