"""Atomic, verified, sharded checkpoints (Megatron ``dist_checkpointing``) with keep-last-K.

Layout under the checkpoint root::

    step_00000100/            one finished checkpoint (the directory name carries the step)
      metadata.json, .metadata, *.distcp, [common.pt]         dist_checkpointing (torch_dist;
                                                           common.pt only before megatron-core 0.19)
      manifest.json           written last: every file's size (+ sha256), the step, the layout
    step_00000200/
    latest                    name of the newest finished checkpoint (informational)
    .step_00000300.tmp/       a save in progress (or a crashed one: removed by the next save)

**Atomicity.**  Every rank writes into ``.step_XXXXXXXX.tmp``; after a barrier rank 0 writes
``manifest.json`` (temp file, fsync, rename), fsyncs and renames the directory to
``step_XXXXXXXX``, then deletes the oldest checkpoints beyond ``keep_last``.  A crash at any
point leaves either the previous set of finished checkpoints or a ``.tmp`` directory that is
never loaded.

**Verification.**  :func:`verify_checkpoint` re-reads the manifest (which carries a sha256 of
its own body), checks that every listed file exists with its recorded size and, where recorded,
its sha256, and that no listed file is missing.  A checkpoint that fails is never loaded: the
error names the directory and what is wrong.  ``checksum`` chooses what is hashed: ``all``
files, ``metadata`` (``metadata.json``, ``common.pt``, ``.metadata``, sharded objects, and the
bytes of every non-tensor object stored inside a ``.distcp`` file), ``none`` (sizes only) or
``auto`` (all when the checkpoint is below 2 GiB, metadata otherwise).  The last part matters
from megatron-core 0.19 on, which writes no ``common.pt``: the common state (step, scheduler,
counters) then lives in a ``.distcp`` file next to the tensors, as do the RNG states and the CPU
optimizer state; the manifest records those objects' byte ranges (read from the checkpoint's
``.metadata``) and their sha256, so ``metadata`` mode covers them on every version.

**Contents** (see :func:`build_state`): the model's sharded state dict (reshardable across
TP/PP/EP), the optimizer (Megatron's sharded optimizer state on GPU; on CPU each rank's torch
optimizer ``state_dict`` as a per-rank object, so a CPU resume keeps the parallel layout), the
scheduler, the trainer counters (step, consumed samples and tokens, skipped steps), and per
rank the python / numpy / torch / CUDA RNG states and Megatron's RNG-tracker states.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from training.data._util import sha256_file as _sha256  # hex sha256 of a file's bytes

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "build_state",
    "capture_rng_state",
    "checkpoint_name",
    "list_checkpoints",
    "restore_rng_state",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"
FORMAT = "xhc-pretrain-checkpoint/1"
_NAME_RE = re.compile(r"^step_(\d{8,})$")
_METADATA_FILES = ("metadata.json", "common.pt", ".metadata")
_AUTO_HASH_LIMIT = 2 << 30


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt (the message names the directory and the fix)."""


def checkpoint_name(step: int) -> str:
    return f"step_{int(step):08d}"


def list_checkpoints(root: str) -> List[Tuple[int, str]]:
    """``[(step, path), ...]`` of the finished (renamed) checkpoint directories under ``root``, oldest first."""
    if not root or not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _NAME_RE.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


# ------------------------------------------------------------------------------------------------
# Manifest
# ------------------------------------------------------------------------------------------------


def _object_ranges(directory: str) -> Dict[str, List[Tuple[int, int]]]:
    """``{file: [(offset, length), ...]}``: where the non-tensor objects sit inside the ``.distcp`` files.

    Read from the torch.distributed.checkpoint ``.metadata`` (objects are its
    ``BytesStorageMetadata`` entries); empty when there is none.
    """
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        return {}
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(directory).read_metadata()
    objects = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    out: Dict[str, List[Tuple[int, int]]] = {}
    for index, info in (md.storage_data or {}).items():
        if index.fqn in objects:
            out.setdefault(info.relative_path, []).append((int(info.offset), int(info.length)))
    return {rel: sorted(r) for rel, r in out.items()}


def _sha256_ranges(path: str, ranges: Sequence[Sequence[int]]) -> str:
    """Hex sha256 of the concatenated byte ranges ``[(offset, length), ...]`` of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for offset, length in ranges:
            f.seek(offset)
            while length > 0:
                block = f.read(min(length, 1 << 20))
                if not block:
                    break  # short file: the hash differs, and the size check names it
                h.update(block)
                length -= len(block)
    return h.hexdigest()


def _walk(directory: str) -> List[str]:
    files = []
    for base, _dirs, names in os.walk(directory):
        for n in names:
            rel = os.path.relpath(os.path.join(base, n), directory)
            if rel != MANIFEST:
                files.append(rel)
    return sorted(files)


def _is_metadata(rel: str) -> bool:
    # common.pt / metadata.json / .metadata and the per-object files of ShardedObjects
    # (small torch files in sub-directories).
    return os.path.basename(rel) in _METADATA_FILES or os.sep in rel


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(directory: str, info: Dict[str, Any], checksum: str = "auto") -> dict:
    """Write ``manifest.json`` (sizes of all files, sha256 per ``checksum``) into ``directory``, atomically."""
    files = _walk(directory)
    sizes = {rel: os.path.getsize(os.path.join(directory, rel)) for rel in files}
    mode = checksum
    if mode == "auto":
        mode = "all" if sum(sizes.values()) < _AUTO_HASH_LIMIT else "metadata"
    objects = _object_ranges(directory) if mode == "metadata" else {}
    entries = {}
    for rel in files:
        e = {"size": sizes[rel]}
        if mode == "all" or (mode == "metadata" and _is_metadata(rel)):
            e["sha256"] = _sha256(os.path.join(directory, rel))
        elif rel in objects:
            ranges = [list(r) for r in objects[rel]]
            e["objects"] = {"ranges": ranges, "sha256": _sha256_ranges(os.path.join(directory, rel), ranges)}
        entries[rel] = e
    body = {"format": FORMAT, "checksum": mode, "files": entries, **info}
    text = json.dumps(body, sort_keys=True, indent=1)
    manifest = {"body": body, "sha256": hashlib.sha256(text.encode()).hexdigest()}
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))
    _fsync_dir(directory)
    return body


def verify_checkpoint(directory: str, hashes: bool = True) -> dict:
    """Check ``directory`` against its manifest; return the manifest body or raise :class:`CheckpointError`."""
    hint = ("it is partial or corrupt and will not be loaded; delete it, or set checkpoint.load to an older "
            "checkpoint directory")
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint {directory}: not a directory")
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {directory}: no {MANIFEST} (the save did not finish): {hint}")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        body = manifest["body"]
        text = json.dumps(body, sort_keys=True, indent=1)
        ok = hashlib.sha256(text.encode()).hexdigest() == manifest["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {directory}: unreadable {MANIFEST} ({type(e).__name__}: {e}): {hint}") from None
    if not ok:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST} fails its own sha256: {hint}")
    if body.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {directory}: format {body.get('format')!r}, expected {FORMAT!r}")
    for rel, e in sorted(body["files"].items()):
        full = os.path.join(directory, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {directory}: file {rel} is missing: {hint}")
        size = os.path.getsize(full)
        if size != e["size"]:
            raise CheckpointError(f"checkpoint {directory}: file {rel} has {size} bytes, the manifest says "
                                  f"{e['size']}: {hint}")
        if hashes and "sha256" in e and _sha256(full) != e["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: file {rel} fails its sha256 check: {hint}")
        obj = e.get("objects")
        if hashes and obj and _sha256_ranges(full, obj["ranges"]) != obj["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: file {rel} fails its sha256 check of the non-tensor "
                                  f"objects it holds (step, scheduler, RNG, optimizer state): {hint}")
    return body


# ------------------------------------------------------------------------------------------------
# RNG
# ------------------------------------------------------------------------------------------------
def capture_rng_state() -> Dict[str, Any]:
    """python / numpy / torch (CPU and CUDA) generators and Megatron's RNG-tracker states."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() if torch.is_tensor(v) else v
                    for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# ------------------------------------------------------------------------------------------------
# The state that goes into a checkpoint
# ------------------------------------------------------------------------------------------------
def _unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") and hasattr(chunk, "finish_grad_sync") else chunk


def _model_sharded_state(chunks: Sequence[torch.nn.Module]) -> dict:
    if len(chunks) == 1:
        return {"model": _unwrap(chunks[0]).sharded_state_dict()}
    from megatron.core import parallel_state as ps

    out = {}
    for i, c in enumerate(chunks):
        ps.set_virtual_pipeline_model_parallel_rank(i)
        out[f"model{i}"] = _unwrap(c).sharded_state_dict()
    return out


def _rank_object(key: str, data: Any):
    """A ShardedObject held once per global rank (RNG, CPU optimizer state)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(key, data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def is_megatron_optimizer(optimizer) -> bool:
    """Megatron's optimizer (or training.optim.TrainOptimizer on its Megatron backend): sharded state."""
    if getattr(optimizer, "megatron_optimizer", None) is not None:
        return True
    return hasattr(optimizer, "sharded_state_dict") and hasattr(optimizer, "get_parameters")


def build_state(chunks: Sequence[torch.nn.Module], optimizer=None, scheduler=None, trainer: Optional[dict] = None,
                rng: bool = True, is_loading: bool = False, extra: Optional[dict] = None) -> dict:
    """The sharded state dict of a training run (for :meth:`Checkpointer.save` and ``.load``).

    ``trainer``: plain counters, identical on every rank (saved once, as common state).
    ``extra``: further common entries (e.g. the config); must be identical on every rank.
    """
    state = _model_sharded_state(chunks)
    if optimizer is not None:
        if is_megatron_optimizer(optimizer):
            model_sd = state["model"] if len(chunks) == 1 else {k: v for k, v in state.items()}
            state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
        else:
            state["optimizer_rank"] = _rank_object("optimizer_rank_state", optimizer.state_dict())
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if trainer is not None:
        state["trainer"] = dict(trainer)
    if rng:
        state["rng"] = _rank_object("rng_state", capture_rng_state())
    if extra:
        state.update(extra)
    return state


# ------------------------------------------------------------------------------------------------
# Checkpointer
# ------------------------------------------------------------------------------------------------
def _barrier():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast_text(text: Optional[str]) -> Optional[str]:
    """Rank 0's string (or None) on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return text
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Checkpointer:
    """Save / find / verify / load checkpoints under ``root`` (see the module docstring).

    Args:
        root: the checkpoint directory (shared by all ranks; on several nodes a shared filesystem).
        keep_last: how many finished checkpoints to keep.
        checksum: ``auto`` / ``all`` / ``metadata`` / ``none`` (what the manifest hashes).
        log: callable for one-line messages (rank 0 only is sensible).
    """

    def __init__(self, root: str, keep_last: int = 2, checksum: str = "auto", log: Callable[[str], None] = print):
        self.root = os.path.abspath(root)
        self.keep_last = int(keep_last)
        self.checksum = checksum
        self.log = log
        self.last_save_seconds: Optional[float] = None

    # ---- discovery -----------------------------------------------------------------------------
    def checkpoints(self) -> List[Tuple[int, str]]:
        return list_checkpoints(self.root)

    def latest(self) -> Optional[str]:
        """The newest finished checkpoint directory, or None (partial ``.tmp`` saves are ignored)."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    def resolve(self, load: Optional[str]) -> Optional[str]:
        """``auto`` -> :meth:`latest` (or None); ``none``/None -> None; a path -> that path.

        A path may be a checkpoint root: then its newest checkpoint.
        """
        if load in (None, "none"):
            return None
        if load == "auto":
            return self.latest()
        path = os.path.abspath(load)
        if not os.path.isfile(os.path.join(path, MANIFEST)) and not _NAME_RE.match(os.path.basename(path)):
            found = list_checkpoints(path)
            if found:
                return found[-1][1]
        return path

    # ---- save ----------------------------------------------------------------------------------
    def save(self, step: int, state: dict, info: Optional[dict] = None) -> str:
        """Save ``state`` (from :func:`build_state`) as ``step_<step>``; collective over all ranks.

        Returns the final directory.  An existing checkpoint of the same step is replaced.
        """
        from megatron.core import dist_checkpointing

        t0 = time.perf_counter()
        name = checkpoint_name(step)
        final = os.path.join(self.root, name)
        tmp = os.path.join(self.root, f".{name}.tmp")
        if _rank() == 0:
            os.makedirs(self.root, exist_ok=True)
            for stale in os.listdir(self.root):  # crashed saves
                if stale.startswith(".step_") and stale.endswith(".tmp"):
                    shutil.rmtree(os.path.join(self.root, stale), ignore_errors=True)
            os.makedirs(tmp)
        _barrier()
        dist_checkpointing.save(state, tmp)
        _barrier()
        error = None
        if _rank() == 0:
            try:
                import megatron.core

                meta = {"step": int(step), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "megatron_core": getattr(megatron.core, "__version__", "?"), **(info or {})}
                write_manifest(tmp, meta, self.checksum)
                if os.path.isdir(final):
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_dir(self.root)
                latest_tmp = os.path.join(self.root, "latest.tmp")
                with open(latest_tmp, "w") as f:
                    f.write(name + "\n")
                os.replace(latest_tmp, os.path.join(self.root, "latest"))
                self._prune()
            except Exception as e:  # report on every rank rather than hang the others
                error = f"{type(e).__name__}: {e}"
        error = _broadcast_text(error)
        if error:
            raise CheckpointError(f"checkpoint {final}: save failed: {error}")
        self.last_save_seconds = time.perf_counter() - t0
        return final

    def _prune(self) -> None:
        found = self.checkpoints()
        for _step, path in found[: max(0, len(found) - self.keep_last)]:
            shutil.rmtree(path, ignore_errors=True)

    # ---- load ----------------------------------------------------------------------------------
    def verify(self, directory: str) -> dict:
        """:func:`verify_checkpoint` on rank 0, the verdict on every rank (raises on all ranks)."""
        error, body = None, None
        if _rank() == 0:
            try:
                body = verify_checkpoint(directory)
            except CheckpointError as e:
                error = str(e)
        error = _broadcast_text(error)
        if error:
            raise CheckpointError(error)
        if body is None:
            body = verify_checkpoint(directory, hashes=False)
        return body

    def load(self, directory: str, state: dict) -> dict:
        """Verify ``directory`` and load into the template ``state`` (from ``build_state(is_loading=True)``)."""
        from megatron.core import dist_checkpointing

        body = self.verify(directory)
        try:
            loaded = dist_checkpointing.load(state, directory)
        except Exception as e:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_initialized() else 1
            saved = body.get("world_size")
            hint = ""
            if saved is not None and saved != world:
                hint = (f" (saved with world size {saved} and layout {body.get('parallel')}, loading with {world}: "
                        "CPU optimizer and RNG states are per rank; resume with the same layout or set "
                        "checkpoint.load_optimizer=false checkpoint.load_rng=false)")
            raise CheckpointError(f"checkpoint {directory}: loading failed: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}{hint}") from e
        return loaded
