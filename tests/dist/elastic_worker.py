"""Runs of the elastic-resume tests, one after another in one process (under torchrun, or plain
python for one process): ``elastic_worker.py JOBS.json``.

``JOBS.json`` is a list of ``{"args": [key=value, ...], "resave": bool, "save_at_start": bool}``.
Each job is what ``xhc-pretrain args`` does (:func:`training.pretrain.main`), except that with
``resave`` the trainer saves a checkpoint right after it has loaded one, before its first step, so
that a test can compare what a resume on another layout holds with what was saved; with
``save_at_start`` a fresh run saves its initial state (``step_00000000``), so that a run on another
layout can start from the same weights.  The process group
stays up between jobs (every job rebuilds Megatron's groups for its own layout).
"""

import json
import os
import sys

from training.run import cpu_entry_point
from training.config import load_config
from training.pretrain import Trainer


def run(args, resave: bool = False, save_at_start: bool = False) -> None:
    with cpu_entry_point():
        trainer = Trainer(load_config(None, args))
        try:
            trainer.setup()
            if resave:
                assert trainer.resumed_from, f"resave: nothing was loaded ({args})"
                trainer.save_checkpoint("resharded")
            if save_at_start:
                assert not trainer.resumed_from, f"save_at_start: this run resumed ({args})"
                trainer.save_checkpoint("start")
            code = trainer.train()
            trainer.finish()
        finally:
            trainer.close(destroy_process_group=False)
    assert code == 0, f"exit {code}: {args}"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for job in jobs:
        run(job["args"], job.get("resave", False), job.get("save_at_start", False))
    sys.stdout.flush()
    os.write(1, f"rank {os.environ.get('RANK', 0)} done {len(jobs)} jobs\n".encode())
