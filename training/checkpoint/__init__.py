"""The checkpoint room: atomic, verified, reshardable checkpoints of a run.

Modules: ``checkpointer`` (the format: manifest, hashes, Megatron's ``dist_checkpointing`` save and
load, asynchronous saves, compatibility checks), ``run`` (a run's save, the save in flight, load and
resume), ``save_safety`` (signals deferred during a save, disk errors explained), ``rng_state`` (the
RNG states saved with a checkpoint).
"""

from __future__ import annotations

from training.rooms import lazy_exports

_EXPORTS = {
    "build_state": "checkpointer", "check_compatible": "checkpointer", "Checkpointer": "checkpointer",
    "CheckpointError": "checkpointer", "list_checkpoints": "checkpointer", "MANIFEST": "checkpointer",
    "read_whole_tensors": "checkpointer", "remove_partial_saves": "checkpointer",
    "verify_checkpoint": "checkpointer", "write_manifest": "checkpointer",
    "capture_rng_state": "rng_state", "restore_rng_state": "rng_state",
    "load_run": "run", "poll_run_save": "run", "save_run": "run",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
