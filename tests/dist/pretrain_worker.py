"""torchrun worker: xhc-pretrain's Trainer under DP=2, TP=2+SP, EP=2 and PP=2 (gloo, CPU).

Run (2 ranks)::

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/pretrain_worker.py OUT_DIR [mode ...]

Each mode trains the tiny xHC-MoE preset on Megatron's mock data (ids 1, 2, 3, ... per
document: a repeated pattern the model can fit) for a few dozen steps through the same
:class:`training.pretrain.Trainer` that ``python -m training.pretrain`` uses, into
``OUT_DIR/<mode>``, and rank 0 prints one line::

    RESULT <mode> {"losses": [...], "eval": [...], "dp": .., "checkpoints": [...]}

The process group stays up between modes (Megatron's groups are rebuilt for each).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# Light top level: dist_checkpointing's save starts a helper process that re-imports this module.
if __name__ in ("__main__", "__mp_main__"):  # run as the worker, not imported by a test: no dynamo
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

COMMON = [
    "data.mock=true", "tokenizer.type=none", "tokenizer.vocab_size=128", "tokenizer.make_vocab_size_divisible_by=64",
    "batch.seq_length=32", "batch.micro_batch_size=2", "batch.global_batch_size=4", "run.train_steps=24",
    "optimizer.lr=1e-2", "schedule.warmup_steps=4", "run.eval_interval=12", "run.eval_iters=1",
    "logging.tensorboard=false", "logging.interval=12", "logging.hc_health_interval=12", "checkpoint.interval=8",
    "checkpoint.keep_last=3", "checkpoint.async_save=true", "run.dist_timeout_minutes=3",
]  # async saves at steps 8 and 16 (each rank writes its part in the background), the final one sync
MODES = {
    "dp": ["parallel.tp=1"],
    "tp_sp": ["parallel.tp=2", "parallel.sp=true"],
    "ep": ["parallel.ep=2"],
    "pp": ["parallel.pp=2", "model.backbone.mtp_num_layers=1"],  # with one MTP depth on the last stage
}


def run_mode(mode: str, out_dir: str) -> dict:
    from training.checkpoint import verify_checkpoint
    from training.config import load_config
    from training.pretrain import Trainer

    cfg = load_config(None, [*COMMON, *MODES[mode], f"run.dir={os.path.join(out_dir, mode)}"])
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        trainer.train()
        trainer.finish()
        return {"losses": [h["loss"] for h in trainer.history], "eval": [e["loss"] for e in trainer.evals],
                "dp": trainer.dp, "checkpoints": sorted(os.listdir(trainer.paths["checkpoints"])),
                "verified": [verify_checkpoint(os.path.join(trainer.paths["checkpoints"], n))["step"]
                             for n in sorted(os.listdir(trainer.paths["checkpoints"])) if n.startswith("step_")],
                "hc": trainer.health.num_wrapped,
                "mtp": [r["mtp_loss"] for r in _train_records(trainer) if "mtp_loss" in r]}
    finally:
        trainer.close(destroy_process_group=False)


def _train_records(trainer):
    with open(os.path.join(trainer.run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("kind") == "train"]


def main(argv):
    import torch.distributed as dist

    out_dir, modes = argv[0], argv[1:] or list(MODES)
    for mode in modes:
        try:
            result = run_mode(mode, out_dir)
        except Exception:
            print(f"FAIL {mode} (rank {os.environ.get('RANK')}):\n{traceback.format_exc()}", flush=True)
            os._exit(1)
        if dist.get_rank() == 0:
            print(f"RESULT {mode} {json.dumps(result)}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
