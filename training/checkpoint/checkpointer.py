"""Atomic, verified, sharded checkpoints (Megatron ``dist_checkpointing``) with keep-last-K.

Layout under the checkpoint root::

    step_00000100/            one finished checkpoint (the directory name carries the step)
      metadata.json, .metadata, *.distcp, [common.pt]         dist_checkpointing (torch_dist;
                                                           common.pt only before megatron-core 0.19)
      manifest.json           written last: every file's size (+ sha256), the step, the layout
    step_00000200/
    latest                    name of the newest finished checkpoint (informational)
    .step_00000300.tmp/       a save in progress (or a crashed one: removed by the next save or start)

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

**Signals.**  A save is not interruptible: SIGTERM / SIGINT / SIGUSR1 / SIGHUP that arrive while
it runs are held and re-delivered when it is done (the caller's handler then sees them), and the
writer processes that ``torch_dist`` forks inherit the holding handler, so a signal sent to the
whole process group (``kill -TERM -- -<pgid>``, torchrun's and SLURM's shutdown) no longer kills
them mid-write.  The results queue of the synchronous save is an in-process queue instead of
Megatron's default ``multiprocessing.Manager`` server process (a separate process that a group
signal killed, giving ``BrokenPipeError``, and that a ``kill -9`` of the trainer left behind).

**Asynchronous saves** (:meth:`Checkpointer.save_async`, ``checkpoint.async_save``).  The plan and
a snapshot of every tensor (pinned host memory on GPU, a copy on CPU) are taken in the caller's
thread; a thread per rank writes the files into the ``.tmp`` directory; :meth:`Checkpointer.poll`,
called at step boundaries, runs Megatron's finalize once every rank's write is done and then rank
0's manifest, verification, rename and pruning in another thread.  Until then the checkpoint is a
``.tmp`` directory like any unfinished save.  At most one save is in flight.

**Storage faults.**  A failed save (sync or async) removes its ``.tmp`` directory and raises one
line: for a full disk (:func:`is_no_space`: ENOSPC, torch's ``inline_container ... unexpected
pos``, short writes, whatever exception wraps them) it names the disk, its free space and the
previous checkpoint that is kept.  :func:`remove_partial_saves` clears the ``.tmp`` directories of
crashed saves (every save, and the trainer's start-up before its free-space check).

**Selection and fallback.**  ``checkpoint.load=auto`` takes the newest checkpoint that passes
:func:`verify_checkpoint`; a newer one that fails is renamed ``step_XXXXXXXX.corrupt`` (kept for
inspection, never loaded again) with a warning.  A save is verified before any older checkpoint
is pruned, so the newest good checkpoint always survives.

**Compatibility.**  :func:`check_compatible` compares the manifest's preset, HC config, vocabulary,
global batch and parallel layout with the run about to load it: what makes it another run raises
a one-line error that says what differs and how to proceed; another layout is resharded
(``checkpoint.reshard=auto``) or refused (``never``).

**Contents** (see :func:`build_state`): the model's sharded state dict (reshardable across
TP/PP/EP/DP), the optimizer (Megatron's sharded optimizer state on GPU; on the torch backend every
moment and momentum buffer as a sharded tensor that follows its parameter, so it reshards like the
weights), the scheduler, the trainer counters (step, consumed samples and tokens, skipped steps),
and per rank the python / numpy / torch / CUDA RNG states and Megatron's RNG-tracker states (the
one part that does not reshard: a resume on another layout reseeds them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import queue
import re
import shutil
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from training.data import sha256_file as _sha256  # hex sha256 of a file's bytes
from training.checkpoint.rng_state import capture_rng_state, restore_rng_state  # noqa: F401 (re-exported)
from training.checkpoint.save_safety import (deferred_signals, describe_os_error, explain_save_error,  # noqa: F401 (re-exported)
                                  inprocess_results_queue, is_no_space, mount_point)

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "build_state",
    "capture_rng_state",
    "check_compatible",
    "deferred_signals",
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
# Compatibility of a checkpoint with the run that loads it
# ------------------------------------------------------------------------------------------------
_LAYOUT_KEYS = ("tp", "pp", "ep", "cp", "etp", "vpp")


def _layout(world: Any, parallel: Optional[dict]) -> str:
    p = parallel or {}
    return f"world size {world} (" + " ".join(f"{k}={p.get(k)}" for k in _LAYOUT_KEYS if p.get(k) is not None) + ")"


RUNTIME_HC_FIELDS = frozenset({"kernels", "sinkhorn_recompute"})
"""HCConfig fields that choose how the maths runs, not what it is: a run may resume with other values."""


def _preset_key(preset: str) -> str:
    """A preset name as compared between runs: a file preset (``path/preset.yaml:variant``) by the
    file's real path, so a relative path names the same preset as the absolute one a run recorded."""
    path, sep, variant = str(preset).rpartition(":")
    if sep and path.endswith((".yaml", ".yml")) and os.path.isfile(path):
        return f"{os.path.realpath(path)}:{variant}"
    return str(preset)


OPTIMIZER_FORMATS = ("torch-sharded", "megatron", "rank")
"""How a checkpoint holds the optimizer state (manifest ``optimizer_format``): ``torch-sharded``, the
torch backend's state as sharded tensors that follow their parameters (reshards like the weights);
Muon on GPU (sharded over data parallelism or not) writes it too, with the fp32 main copies when the
manifest says ``optimizer_main_params``; ``megatron``, Megatron's (distributed) optimizer (AdamW on GPU)
with the manifest's ``optimizer_sharding`` (``layer_wise``: Megatron's layer-wise Muon format of one
earlier version, same DP layout only);
``rank``, one torch ``state_dict`` per rank (checkpoints written before resharding existed: they
resume on their own layout only)."""


_FORMAT_USERS = {"megatron": "Megatron's optimizer: AdamW on GPU",
                 "torch-sharded": "AdamW or Muon on the CPU backend, Muon on GPU"}


def _optimizer_reshard_problem(body: dict, fmt: str, sp: dict, np_: dict) -> Optional[str]:
    """Why the saved optimizer state cannot follow a change of layout from ``sp`` to ``np_`` (None: it can)."""
    if fmt == "rank":
        return ("its optimizer state is one object per rank (a checkpoint written before resharding was "
                "supported)")
    if fmt == "megatron" and body.get("optimizer_sharding") == "layer_wise":
        return ("its Muon state was saved sharded by the GPU path's layer-wise optimizer, whose checkpoint "
                "resumes on the same layout only")
    if fmt == "megatron" and body.get("optimizer_sharding", "dp_reshardable") == "dp_reshardable":
        changed = [k for k in _LAYOUT_KEYS if k in sp and k in np_ and sp.get(k) != np_.get(k)]
        if changed:
            return ("its distributed-optimizer state was saved with checkpoint.optimizer_sharding=dp_reshardable, "
                    f"which reshards across data parallelism only (this run changes {', '.join(changed)}; save "
                    "with checkpoint.optimizer_sharding=fully_reshardable to change those)")
    return None


def check_compatible(directory: str, body: dict, expected: dict, load_optimizer: bool = True,
                     sharded_optimizer: bool = False, reshard: str = "auto",
                     optimizer_format: Optional[str] = None) -> Optional[str]:
    """Raise a one-line :class:`CheckpointError` when ``directory`` (manifest ``body``) cannot resume this run.

    ``expected``: this run's ``preset``, ``hc`` (dict), ``vocab_size``, ``world_size``, ``parallel`` (dict),
    ``global_batch_size``; keys the manifest lacks (older checkpoints) are not compared.
    ``sharded_optimizer``: this run uses Megatron's optimizer (tells an older manifest's format).
    ``optimizer_format``: the format this run's optimizer loads (:func:`optimizer_checkpoint_format`);
    a saved state of the other format is refused unless ``load_optimizer`` is false.

    What makes a run different (preset, HC config, vocabulary, global batch) is refused.  A different
    parallel layout (world size, tp, pp, ep, cp, etp, vpp) is resharded when ``reshard`` is ``auto``:
    the weights and the optimizer state (unless :func:`_optimizer_reshard_problem` says its format
    cannot) follow the new layout; the per-rank RNG states do not (the caller reseeds).  Returns a
    line naming the old and the new layout when it reshards, None when the layout is the same.
    """
    where = f"checkpoint {directory}"
    fresh = "start a fresh run (another run.dir, or checkpoint.load=none)"
    saved, now = body.get("preset"), expected.get("preset")
    if saved is not None and now is not None and _preset_key(saved) != _preset_key(now):
        raise CheckpointError(f"{where} holds model.preset={saved}, this run is model.preset={now}: resume with "
                              f"model.preset={saved}, or {fresh}; weights do not convert between presets")
    shc, nhc = body.get("hc"), expected.get("hc")
    if isinstance(shc, dict) and isinstance(nhc, dict):
        keys = (set(shc) & set(nhc)) - RUNTIME_HC_FIELDS
        diff = [f"{k}: saved {shc[k]!r}, now {nhc[k]!r}" for k in sorted(keys) if shc[k] != nhc[k]]
        if diff:
            raise CheckpointError(f"{where} has a different hyper-connection config "
                                  f"(model.hc.{'; model.hc.'.join(diff)}): resume with the saved model.hc values, "
                                  f"or {fresh}")
    sv, nv = body.get("vocab_size"), expected.get("vocab_size")
    if sv is not None and nv is not None and int(sv) != int(nv):
        raise CheckpointError(f"{where} has a (padded) vocabulary of {sv} ids, this run {nv}: use the tokenizer and "
                              f"tokenizer.* settings it was trained with, or {fresh}")
    sg, ng = body.get("global_batch_size"), expected.get("global_batch_size")
    if sg is not None and ng is not None and int(sg) != int(ng):
        raise CheckpointError(f"{where} was trained with batch.global_batch_size={sg}, this run has {ng}: resume with "
                              f"batch.global_batch_size={sg} (the data position and the schedule count samples in "
                              f"global batches), or {fresh}")
    saved_fmt = body.get("optimizer_format")
    if load_optimizer and optimizer_format and saved_fmt in ("megatron", "torch-sharded") and saved_fmt != optimizer_format:
        raise CheckpointError(f"{where} holds its optimizer state in the {saved_fmt} format, this run's optimizer "
                              f"loads the {optimizer_format} one ({_FORMAT_USERS[optimizer_format]}; saved by "
                              f"{_FORMAT_USERS[saved_fmt]}): resume with the optimizer.name and device it was saved "
                              "with, or load the weights only with checkpoint.load_optimizer=false")
    sw, nw = body.get("world_size"), expected.get("world_size")
    sp, np_ = body.get("parallel") or {}, expected.get("parallel") or {}
    same = (sw is None or nw is None or int(sw) == int(nw)) and all(
        sp.get(k) == np_.get(k) for k in _LAYOUT_KEYS if k in sp and k in np_)
    if same:
        return None
    old, new = _layout(sw, sp), _layout(nw, np_)
    if reshard == "never":
        raise CheckpointError(f"{where} was saved with {old}, this run has {new}, and checkpoint.reshard=never: "
                              "relaunch with the saved layout to resume exactly, or set checkpoint.reshard=auto to "
                              "reshard (losses then continue within floating-point tolerance)")
    fmt = body.get("optimizer_format") or ("megatron" if sharded_optimizer else "rank")
    problem = _optimizer_reshard_problem(body, fmt, sp, np_) if load_optimizer else None
    if problem:
        raise CheckpointError(f"{where} was saved with {old}, this run has {new}, but {problem}: relaunch with the "
                              "saved layout to resume exactly, or load the (reshardable) weights only with "
                              "checkpoint.load_optimizer=false checkpoint.load_rng=false")
    return f"resharding {where} from {old} to {new}"


# ------------------------------------------------------------------------------------------------
# The state that goes into a checkpoint
# ------------------------------------------------------------------------------------------------
def _unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") and hasattr(chunk, "finish_grad_sync") else chunk


def _chunk_sharded_state(model) -> dict:
    """``model.sharded_state_dict()``.  A pipeline stage with MTP but no embedding input (the last stage)
    ties its embedding copy to the first stage's, and Megatron's ``GPTModel`` (0.16) reads
    ``metadata['dp_cp_group']`` there without filling it in: it is given explicitly."""
    if getattr(model, "mtp_process", False) and not getattr(model, "pre_process", True):
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        return model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    return model.sharded_state_dict()


def _model_sharded_state(chunks: Sequence[torch.nn.Module]) -> dict:
    if len(chunks) == 1:
        return {"model": _chunk_sharded_state(_unwrap(chunks[0]))}
    from megatron.core import parallel_state as ps

    out = {}
    for i, c in enumerate(chunks):
        ps.set_virtual_pipeline_model_parallel_rank(i)
        out[f"model{i}"] = _chunk_sharded_state(_unwrap(c))
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


def optimizer_checkpoint_format(optimizer) -> str:
    """How :func:`build_state` saves ``optimizer``: ``megatron`` (Megatron's own sharded state: AdamW on
    the GPU path) or ``torch-sharded`` (one entry per parameter: the torch backend, Muon on GPU)."""
    fmt = getattr(optimizer, "checkpoint_format", None)
    return fmt or ("megatron" if is_megatron_optimizer(optimizer) else "torch-sharded")


def build_state(chunks: Sequence[torch.nn.Module], optimizer=None, scheduler=None, trainer: Optional[dict] = None,
                rng: bool = True, is_loading: bool = False, extra: Optional[dict] = None,
                optimizer_sharding: str = "dp_reshardable", optimizer_format: str = "torch-sharded",
                optimizer_main_params: Optional[bool] = None) -> dict:
    """The sharded state dict of a training run (for :meth:`Checkpointer.save` and ``.load``).

    ``trainer``: plain counters, identical on every rank (saved once, as common state).
    ``extra``: further common entries (e.g. the config); must be identical on every rank.
    ``optimizer_sharding``: the layout of Megatron's distributed optimizer state
    (``checkpoint.optimizer_sharding``; loading must use the layout of the save).  It is always
    named: megatron-core's own default (``fully_sharded_model_space``) cannot be saved on 0.16 or 0.19.
    ``optimizer_format``: an optimizer of the ``torch-sharded`` format (:func:`optimizer_checkpoint_format`)
    saves that (tensors that follow their parameters) and, to load an older checkpoint, reads ``rank``
    (one ``state_dict`` object per rank).  ``optimizer_main_params``: whether the ``torch-sharded``
    state holds fp32 main copies (None: when the optimizer keeps any; loading: what the manifest says).
    """
    state = _model_sharded_state(chunks)
    if optimizer is not None:
        if optimizer_checkpoint_format(optimizer) == "megatron":
            model_sd = state["model"] if len(chunks) == 1 else {k: v for k, v in state.items()}
            metadata = {"distrib_optim_sharding_type": optimizer_sharding}
            if optimizer_sharding == "fully_reshardable" and not torch.cuda.is_available():
                metadata["distrib_optim_fully_reshardable_mem_efficient"] = True  # gathers over gloo
            state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
        elif optimizer_format == "rank":
            state["optimizer_rank"] = _rank_object("optimizer_rank_state", optimizer.state_dict())
        else:
            model_sd = state["model"] if len(chunks) == 1 else {k: v for k, v in state.items()}
            if optimizer_main_params is None:
                optimizer_main_params = bool(getattr(optimizer, "has_main_params", False))
            state["optimizer_torch"] = optimizer.torch_sharded_state_dict(model_sd, is_loading=is_loading,
                                                                          main_params=optimizer_main_params)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if trainer is not None:
        state["trainer"] = dict(trainer)
    if rng:
        state["rng"] = _rank_object("rng_state", capture_rng_state())
    if extra:
        state.update(extra)
    return state


def read_whole_tensors(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the ``torch_dist`` checkpoint in ``path`` by its key, read whole by this process
    with torch's own checkpoint reader (no process group needed): how two checkpoints of one run saved
    on different layouts are compared."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


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


def _save_errors() -> tuple:
    try:  # torch's CheckpointException derives from BaseException, not Exception
        from torch.distributed.checkpoint.api import CheckpointException

        return (Exception, CheckpointException)
    except ImportError:
        return (Exception,)


_SAVE_ERRORS = _save_errors()


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_reduce_max(value: float) -> float:
    """The maximum of ``value`` over all ranks (on the GPU under NCCL, else on the CPU)."""
    import torch.distributed as dist

    device = "cpu"
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([value], dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def remove_partial_saves(root: str) -> int:
    """Delete the ``.step_*.tmp`` directories of crashed or failed saves under ``root``; the bytes freed."""
    freed = 0
    if not os.path.isdir(root):
        return 0
    for stale in os.listdir(root):
        if stale.startswith(".step_") and stale.endswith(".tmp"):
            path = os.path.join(root, stale)
            for base, _dirs, names in os.walk(path):
                for n in names:
                    with contextlib.suppress(OSError):
                        freed += os.path.getsize(os.path.join(base, n))
            shutil.rmtree(path, ignore_errors=True)
    return freed


class _PendingSave:
    """An asynchronous save in flight (:meth:`Checkpointer.save_async`)."""

    def __init__(self, step, final, tmp, info, request, thread, t0):
        self.step, self.final, self.tmp, self.info = step, final, tmp, info
        self.request, self.thread, self.t0 = request, thread, t0
        self.publisher: Optional[threading.Thread] = None  # rank 0's manifest / verify / rename thread
        self.error: Optional[str] = None

    def publish(self, ckpt: "Checkpointer") -> None:
        self.error = ckpt._publish(self.step, self.final, self.tmp, self.info)


def snapshot_write_buckets(buckets):
    """A copy of every tensor in Megatron's write buckets, taken now: GPU tensors into pinned host
    memory (one device sync), CPU tensors cloned.  The serialised non-tensor objects are already
    bytes.  Training may then update the parameters while the copy is written."""
    out, cuda = [], False
    for bucket in buckets:
        file_name, storage_key, (bytes_data, tensor_data) = bucket
        staged = []
        for item, t in tensor_data:
            if t.is_cuda:
                c = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                c.copy_(t, non_blocking=True)
                cuda = True
            else:
                c = t.detach().clone()
            staged.append((item, c))
        out.append((file_name, storage_key, (bytes_data, staged)))
    if cuda:
        torch.cuda.synchronize()
    return out


def _write_in_background(async_fn, args, write_hook: Optional[Callable[[], None]] = None) -> None:
    """The body of the writer thread: Megatron's per-file writer, one file after the other, in this
    thread (its own function forks a writer process per file, which a thread should not do); the
    results (or the exception) go to the results queue the finalize step reads."""
    results = args[2] if len(args) > 2 else None
    try:
        if write_hook is not None:
            write_hook()
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        fn = getattr(async_fn, "func", None)
        if getattr(fn, "__name__", "") != "write_preloaded_data_multiproc" or results is None:
            async_fn(*args)
            return
        transforms = async_fn.args[0] if async_fn.args else []
        _rank_, buckets, results = args[:3]
        local: "queue.Queue" = queue.Queue()
        count: "queue.Queue" = queue.Queue()
        written = {}
        for i, bucket in enumerate(buckets):
            count.put(i)
            FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, local, count, True)
            idx, out = local.get()
            if isinstance(out, Exception):
                results.put(out)
                return
            written[idx] = out
        results.put(written)
    except Exception as e:  # reported by the finalize step, on every rank
        if results is not None:
            results.put(e)
        else:
            raise


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
        self.snapshot_seconds: Optional[float] = None  # the caller's share of the last asynchronous save
        self.pending: Optional[_PendingSave] = None  # the asynchronous save in flight
        # called with the step where this rank's files are written (the synchronous save's writer, or
        # the background writer thread): the trainer's fault point (XHC_FAULT_INJECT, tests only); an
        # exception from it is a failed write like any other
        self.write_hook: Optional[Callable[[int], None]] = None

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

    def select(self, load: Optional[str]) -> Tuple[Optional[str], Optional[dict]]:
        """The checkpoint to resume from and its verified manifest body (collective).

        ``auto``: the newest checkpoint that verifies; each newer one that does not is renamed
        ``<name>.corrupt`` with a warning (never deleted).  An explicit path must verify.
        """
        if load != "auto":
            path = self.resolve(load)
            return (path, self.verify(path)) if path is not None else (None, None)
        for _step, path in reversed(self.checkpoints()):
            try:
                return path, self.verify(path)
            except CheckpointError as e:
                if _rank() == 0:
                    bad = path + ".corrupt"
                    try:
                        os.replace(path, bad)
                    except OSError:
                        bad = path
                    self.log(f"[xhc] warning: {e}; set aside as {bad}, trying the previous checkpoint")
                _barrier()
        return None, None

    # ---- save ----------------------------------------------------------------------------------
    def save(self, step: int, state: dict, info: Optional[dict] = None) -> str:
        """Save ``state`` (from :func:`build_state`) as ``step_<step>``; collective over all ranks.

        Returns the final directory.  An existing checkpoint of the same step is replaced.  Signals
        that arrive during the save are held until it is done (:func:`deferred_signals`).  The new
        checkpoint is verified before older ones are pruned.  On failure (disk full, read-only, ...)
        the partial directory is removed and a one-line :class:`CheckpointError` names the cause;
        the previous checkpoints are untouched.
        """
        with deferred_signals():
            return self._save(step, state, info)

    def _begin(self, step: int) -> Tuple[str, str]:
        """Rank 0 removes crashed saves and creates ``.step_<step>.tmp`` (collective); (final, tmp)."""
        name = checkpoint_name(step)
        final = os.path.join(self.root, name)
        tmp = os.path.join(self.root, f".{name}.tmp")
        error = None
        if _rank() == 0:
            try:
                os.makedirs(self.root, exist_ok=True)
                remove_partial_saves(self.root)
                os.makedirs(tmp)
            except OSError as e:
                error = self._failure(e, tmp)
        error = _broadcast_text(error)
        if error:
            raise CheckpointError(f"checkpoint {final}: save failed: {error}")
        return final, tmp

    def _agree(self, error: Optional[BaseException], tmp: str) -> Optional[str]:
        """Every rank's verdict on a step of a save (collective): None when all succeeded, else rank 0's
        one-line explanation (:meth:`_failure`, which also removes the partial ``tmp``) on every rank."""
        local = None if error is None else (str(error) or type(error).__name__)
        if _world() > 1:
            import torch.distributed as dist

            texts: List[Optional[str]] = [None] * _world()
            dist.all_gather_object(texts, local)
            local = next((t for t in texts if t), None)
        if local is None:
            return None
        text = None
        if _rank() == 0:
            text = self._failure(error if error is not None else CheckpointError(local), tmp)
        return _broadcast_text(text)

    def _failure(self, e: BaseException, tmp: str) -> str:
        """Rank 0: remove the partial ``tmp`` and say in one line why the save failed and what is kept."""
        full = is_no_space(e, self.root)
        try:
            usage = shutil.disk_usage(self.root)
        except OSError:
            usage = None
        shutil.rmtree(tmp, ignore_errors=True)  # partial: free its space
        previous = self.latest()
        kept = (f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists")
        if full:
            disk = mount_point(self.root)
            space = (f", {usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB" if usage else "")
            return (f"no space left on device (disk {disk}{space}); the partial save was removed and {kept}: free "
                    f"space or point checkpoint.dir at a larger disk, then rerun the same command to resume")
        why = e if isinstance(e, CheckpointError) else explain_save_error(e, self.root)
        return f"{why}; the partial save was removed and {kept}"

    def _save(self, step: int, state: dict, info: Optional[dict]) -> str:
        from megatron.core import dist_checkpointing

        t0 = time.perf_counter()
        final, tmp = self._begin(step)
        error = None
        try:
            if self.write_hook is not None:
                self.write_hook(step)
            with inprocess_results_queue():
                dist_checkpointing.save(state, tmp)
        except _SAVE_ERRORS as e:
            error = e
        error = self._agree(error, tmp)
        if error:
            raise CheckpointError(f"checkpoint {final}: save failed: {error}")
        path = self._finish(step, final, tmp, info)
        self.last_save_seconds = time.perf_counter() - t0
        return path

    def _finish(self, step: int, final: str, tmp: str, info: Optional[dict]) -> str:
        """After every rank wrote its part: manifest, verification, rename to ``step_*``, pruning (collective)."""
        _barrier()
        error = self._publish(step, final, tmp, info) if _rank() == 0 else None
        error = _broadcast_text(error)
        if error:
            raise CheckpointError(f"checkpoint {final}: save failed: {error}")
        return final

    def _publish(self, step: int, final: str, tmp: str, info: Optional[dict]) -> Optional[str]:
        """Rank 0, once every file is written: manifest, verification, rename, ``latest``, pruning; the
        one-line error (partial removed) or None.  Not collective (an async save runs it in a thread)."""
        try:
            import megatron.core

            meta = {"step": int(step), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "megatron_core": getattr(megatron.core, "__version__", "?"), **(info or {})}
            write_manifest(tmp, meta, self.checksum)
            verify_checkpoint(tmp)
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            latest_tmp = os.path.join(self.root, "latest.tmp")
            with open(latest_tmp, "w") as f:
                f.write(os.path.basename(final) + "\n")
            os.replace(latest_tmp, os.path.join(self.root, "latest"))
        except Exception as e:  # reported on every rank rather than hang the others
            return self._failure(e, tmp)
        self._prune()
        return None

    # ---- asynchronous save ---------------------------------------------------------------------
    def save_async(self, step: int, state: dict, info: Optional[dict] = None) -> None:
        """Start saving ``state`` as ``step_<step>`` in the background; collective over all ranks.

        Waits for (and finalizes) a save still in flight first.  What happens now, in the caller's
        thread: the plan (Megatron's collectives), the non-tensor objects serialised, and a snapshot
        of every tensor this rank writes (pinned host memory for GPU tensors, a copy for CPU ones),
        so training may change the parameters at once.  A thread then writes the files; the
        manifest, verification, rename to ``step_*`` and pruning happen in :meth:`poll` once every
        rank's write has finished, so an unfinished save is never the newest checkpoint.
        """
        from megatron.core import dist_checkpointing

        self.wait()
        with deferred_signals():
            t0 = time.perf_counter()
            final, tmp = self._begin(step)
            error, request, args = None, None, []
            try:
                with inprocess_results_queue():
                    request = dist_checkpointing.save(state, tmp, async_sharded_save=True)
                args = list(request.async_fn_args)
                if request.async_fn is not None and len(args) >= 2:
                    args[1] = snapshot_write_buckets(args[1])
            except _SAVE_ERRORS as e:
                error = e
            error = self._agree(error, tmp)
            if error:
                raise CheckpointError(f"checkpoint {final}: save failed: {error}")
            thread = None
            if request.async_fn is not None:
                hook = None if self.write_hook is None else functools.partial(self.write_hook, step)
                thread = threading.Thread(target=_write_in_background, args=(request.async_fn, args, hook),
                                          name=f"xhc-checkpoint-{step}", daemon=True)
                thread.start()
            self.pending = _PendingSave(step, final, tmp, info, request, thread, t0)
            self.snapshot_seconds = time.perf_counter() - t0

    @property
    def in_flight(self) -> bool:
        return self.pending is not None

    def poll(self, blocking: bool = False) -> Optional[str]:
        """Finalize the save in flight if every rank's write has finished (``blocking``: wait for it);
        the new checkpoint's path, or None.  Collective while a save is in flight.  A failed write
        raises the same one-line :class:`CheckpointError` as a synchronous save (partial removed).

        Two phases: the files (every rank's writer thread; then Megatron's finalize, which gathers
        the write results and writes ``.metadata``, collectively), then rank 0's manifest, hashes,
        verification, rename and pruning in a thread of its own (hashing a large checkpoint takes
        seconds that training need not wait for)."""
        p = self.pending
        if p is None:
            return None
        if p.publisher is None:  # phase 1: the files
            if blocking and p.thread is not None:
                p.thread.join()
            alive = p.thread is not None and p.thread.is_alive()
            if _world() > 1:
                alive = _all_reduce_max(float(alive)) > 0
            if alive:
                return None
            if p.thread is not None:
                p.thread.join()
            error = None
            try:
                with inprocess_results_queue():
                    for fn in p.request.finalize_fns:  # Megatron's: gather the write results, write .metadata
                        fn()
                _barrier()
            except _SAVE_ERRORS as e:
                error = e
            error = self._agree(error, p.tmp)
            if error:
                self.pending = None
                raise CheckpointError(f"checkpoint {p.final}: save failed: {error}")
            p.publisher = threading.Thread(target=p.publish, args=(self,), name=f"xhc-checkpoint-{p.step}-publish",
                                           daemon=True)
            if _rank() == 0:
                p.publisher.start()
        # phase 2: rank 0 publishes
        if blocking and p.publisher.is_alive():
            p.publisher.join()
        alive = p.publisher.is_alive()
        if _world() > 1:
            alive = _all_reduce_max(float(alive)) > 0
        if alive:
            return None
        self.pending = None
        error = _broadcast_text(p.error)
        if error:
            raise CheckpointError(f"checkpoint {p.final}: save failed: {error}")
        self.last_save_seconds = time.perf_counter() - p.t0
        return p.final

    def wait(self) -> Optional[str]:
        """Finish the save in flight, if any (collective); its path or None."""
        return self.poll(blocking=True)

    def abandon(self) -> None:
        """The run is failing: let the write in flight end, never finalize it, remove its partial
        directory (the previous verified checkpoint stays the newest).  Not collective."""
        p, self.pending = self.pending, None
        if p is None:
            return
        if p.thread is not None:
            p.thread.join()
        if p.publisher is not None and p.publisher.is_alive():
            p.publisher.join()  # a checkpoint being published is whole: let it become step_*
        if _rank() == 0:
            shutil.rmtree(p.tmp, ignore_errors=True)

    def _prune(self) -> None:
        """Delete the oldest checkpoints beyond ``keep_last``; the newest one is never deleted."""
        found = self.checkpoints()
        for _step, path in found[: max(0, len(found) - max(1, self.keep_last))]:
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

    def load(self, directory: str, state: dict, body: Optional[dict] = None) -> dict:
        """Verify ``directory`` (unless its verified manifest ``body`` is given) and load into the template
        ``state`` (from ``build_state(is_loading=True)``)."""
        from megatron.core import dist_checkpointing

        if body is None:
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
