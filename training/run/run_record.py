"""The run record: what a run trained on, resolved, in one file every tool reads.

At start-up :func:`write_run_record` writes ``<run.dir>/run_record.json``: the absolute path of the
tokenizer the run loaded and of every dataset prefix it read (train, valid, test, blend weights),
and for the embedded default data its corpus, each with its size and a content hash.  Every
checkpoint carries the same record in its ``manifest.json`` (key ``run_record``), so a checkpoint
copied to another place or machine still says what it was trained on; an export carries it as
``run_record.json`` in the Hugging Face folder.

:func:`read_run_record` is the one reader (a run directory, a checkpoint or an exported folder);
:meth:`RunRecord.tokenizer`, :meth:`RunRecord.prefixes` and :meth:`RunRecord.corpus` return the
recorded paths after checking that the files are still there and unchanged, or raise
:class:`RecordError` with one line naming the recorded path, what was found, and the flag that
points the tool elsewhere (``--tokenizer PATH``, ``--data PREFIX``, ``--corpus FILE``).

Hashes (all sha256): a SentencePiece model file's bytes; an HF tokenizer folder's files (name and
hash of each, :func:`training.data.tokenizer.folder_fingerprint`); the corpus file's bytes; a
dataset prefix's ``<prefix>.meta.json`` (written by the data build: it records the ``.bin``/``.idx``
sizes and the tokenizer's hash) where there is one, else its ``.idx`` file (document and sequence
boundaries), always with the ``.bin``/``.idx`` sizes.  The ``.bin`` itself is never hashed: it may be
terabytes.  docs/conversion.md ("Where a tool finds the tokenizer") shows an example.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from training.data import sha256_file

RECORD_NAME = "run_record.json"
MANIFEST_KEY = "run_record"
MANIFEST = "manifest.json"  # training.checkpoint.MANIFEST (not imported: it loads torch)
FORMAT = "xhc-run-record/1"


class RecordError(RuntimeError):
    """A recorded file is missing or changed (one line: the recorded path, what was found, the flag)."""


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------
def _tokenizer_entry(path: str, kind: str) -> dict:
    from training.data import folder_fingerprint

    path = os.path.abspath(path)
    if os.path.isdir(path):
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                   if os.path.isfile(os.path.join(path, n)))
        return {"path": path, "kind": kind, "bytes": size, "sha256": folder_fingerprint(path)}
    return {"path": path, "kind": kind, "bytes": os.path.getsize(path), "sha256": sha256_file(path)}


def prefix_entry(prefix: str) -> dict:
    """A dataset prefix: absolute path, ``.bin``/``.idx`` sizes, and the hash of its ``.meta.json``
    (``hashed: meta``) or, without one, of its ``.idx`` (``hashed: idx``)."""
    prefix = os.path.abspath(prefix)
    meta = prefix + ".meta.json"
    hashed = "meta" if os.path.isfile(meta) else "idx"
    return {"prefix": prefix, "bin_bytes": os.path.getsize(prefix + ".bin"),
            "idx_bytes": os.path.getsize(prefix + ".idx"), "hashed": hashed,
            "sha256": sha256_file(meta if hashed == "meta" else prefix + ".idx")}


def build_run_record(cfg, tokenizer_path: Optional[str], tokenizer_kind: Optional[str]) -> dict:
    """The record of a :class:`~training.config.PretrainConfig` whose data and tokenizer are built
    (relative paths resolve against the working directory, as training resolved them)."""
    d = cfg.data
    data: Dict[str, Any]
    if d.mock:
        data = {"source": "mock"}
    elif d.per_split:
        data = {"source": "per_split",
                "per_split": {k: [prefix_entry(p) for p in (v or [])] for k, v in d.per_split.items()}}
    elif d.prefixes:
        data = {"source": "prefixes", "split": d.split, "weights": d.weights,
                "prefixes": [prefix_entry(p) for p in d.prefixes]}
    else:
        from training.data import default_paths

        paths = default_paths(d.default_dir)
        corpus = paths["corpus"]
        data = {"source": "default", "split": d.split, "weights": None,
                "prefixes": [prefix_entry(paths["data_prefix"])],
                "corpus": {"path": corpus, "bytes": os.path.getsize(corpus), "sha256": sha256_file(corpus)}}
    tok = _tokenizer_entry(tokenizer_path, tokenizer_kind) if tokenizer_path else None
    return {"format": FORMAT, "tokenizer": tok, "data": data}


def write_run_record(run) -> Optional[dict]:
    """Build the record of a set-up :class:`~training.pretrain.Trainer` and write
    ``<run.dir>/run_record.json`` (main rank; other ranks return None)."""
    if not run.is_main:
        return None
    kind = getattr(run.tokenizer, "kind", None)
    record = build_run_record(run.cfg, run.paths.get("tokenizer"), kind)
    write_record_file(os.path.join(run.run_dir, RECORD_NAME), record)
    return record


def write_record_file(path: str, record: dict) -> None:
    from training.data import write_json

    write_json(path, record)


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------
class RunRecord:
    """A record and where it came from (``where``: the file, for the error lines)."""

    def __init__(self, body: dict, where: str):
        self.body, self.where = body, where

    @property
    def data(self) -> dict:
        return self.body.get("data") or {}

    @property
    def has_tokenizer(self) -> bool:
        return bool(self.body.get("tokenizer"))

    def _fail(self, what: str, found: str, flag: str) -> RecordError:
        return RecordError(f"run record {self.where}: {what} {found}; {flag}")

    def _present(self, entry: dict, override: Optional[str], noun: str, option: str, flag: str, exists):
        """(path, how the error names it) of a recorded file, or of ``override`` (``option``), which must exist."""
        path = entry["path"] if override is None else os.path.abspath(override)
        where = f"{noun} {path}" if override is None else f"{option} {override}"
        if not exists(path):
            raise self._fail(where, "is missing", flag)
        return path, where

    def tokenizer(self, override: Optional[str] = None) -> Optional[str]:
        """The tokenizer the run trained with (None: mock data or raw ids), checked; ``override``:
        ``--tokenizer PATH``, which must hold the same tokenizer (same hash)."""
        entry = self.body.get("tokenizer")
        if not entry:
            return None
        flag = "pass --tokenizer PATH to a copy of the tokenizer the run trained with"
        path, where = self._present(entry, override, "tokenizer", "--tokenizer", flag, os.path.exists)
        found = _tokenizer_entry(path, entry.get("kind"))
        if found["sha256"] != entry["sha256"]:
            raise self._fail(where, f"is not the tokenizer the run trained with (sha256 {found['sha256'][:12]} "
                             f"found, {entry['sha256'][:12]} recorded at {entry['path']})", flag)
        return path

    def prefixes(self, split: str = "train", override: Optional[List[str]] = None) -> List[str]:
        """The dataset prefixes of ``split`` (``train``/``valid``/``test``), checked; ``override``:
        ``--data PREFIX`` (one per recorded prefix, each the same data: same sizes and hash)."""
        d = self.data
        if d.get("source") == "per_split":
            entries = (d.get("per_split") or {}).get(split) or []
        else:
            entries = d.get("prefixes") or []
        if override is not None and len(override) != len(entries):
            raise RecordError(f"--data {' '.join(override)}: {len(override)} prefixes for the {len(entries)} the run "
                              f"recorded in {self.where}; give one per recorded prefix")
        out = []
        flag = "pass --data PREFIX to a copy of the dataset the run trained on"
        for i, e in enumerate(entries):
            prefix = e["prefix"] if override is None else os.path.abspath(override[i])
            where = f"dataset {prefix}" if override is None else f"--data {override[i]}"
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise self._fail(where, f"is missing ({prefix + ext} not found)", flag)
            meta = prefix + ".meta.json"
            got = {"bin_bytes": os.path.getsize(prefix + ".bin"), "idx_bytes": os.path.getsize(prefix + ".idx"),
                   "sha256": sha256_file(meta if e.get("hashed") == "meta" and os.path.isfile(meta) else prefix + ".idx")}
            changed = [k for k in ("bin_bytes", "idx_bytes", "sha256") if got[k] != e[k]]
            if changed:
                k = changed[0]
                show = (lambda v: str(v)[:12]) if k == "sha256" else str
                name = {"bin_bytes": ".bin bytes", "idx_bytes": ".idx bytes",
                        "sha256": f"{'.meta.json' if e.get('hashed') == 'meta' else '.idx'} sha256"}[k]
                raise self._fail(where, f"has changed since training ({name} {show(got[k])} found, "
                                 f"{show(e[k])} recorded)", flag)
            out.append(prefix)
        return out

    def corpus(self, override: Optional[str] = None) -> Optional[str]:
        """The embedded default data's JSONL corpus, checked (None: the run trained on other data)."""
        entry = self.data.get("corpus")
        if not entry:
            return None
        flag = "pass --corpus FILE to a copy of the corpus the run trained on"
        path, where = self._present(entry, override, "corpus", "--corpus", flag, os.path.isfile)
        got = sha256_file(path)
        if got != entry["sha256"]:
            raise self._fail(where, f"has changed since training (sha256 {got[:12]} found, {entry['sha256'][:12]} "
                             f"recorded)", flag)
        return path

    @property
    def split(self) -> str:
        return self.data.get("split") or "969,30,1"

    @property
    def fingerprint(self) -> str:
        """12 hex digits naming what was trained on by content, not place: the tokenizer's and the
        data's hashes, sizes, split and weights (the same data moved elsewhere keeps its fingerprint)."""
        import hashlib

        def strip(obj):
            if isinstance(obj, dict):
                return {k: strip(v) for k, v in obj.items() if k not in ("path", "prefix")}
            if isinstance(obj, list):
                return [strip(v) for v in obj]
            return obj

        text = json.dumps(strip({"tokenizer": self.body.get("tokenizer"), "data": self.data}), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def read_run_record(path: str) -> Optional[RunRecord]:
    """The record of ``path``: a checkpoint (its ``manifest.json``), a run directory or an exported
    Hugging Face folder (their ``run_record.json``); None when there is none (a run made before
    records existed).  A checkpoint without one falls back to its run directory's."""
    manifest = os.path.join(path, MANIFEST)
    if os.path.isfile(manifest):
        try:
            with open(manifest, encoding="utf-8") as f:
                body = json.load(f)["body"].get(MANIFEST_KEY)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            body = None
        if body:
            return RunRecord(body, manifest)
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        return read_run_record(run_dir) if os.path.isfile(os.path.join(run_dir, RECORD_NAME)) else None
    file = os.path.join(path, RECORD_NAME)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError) as e:
        raise RecordError(f"run record {file}: unreadable ({type(e).__name__}: {e}); delete it to fall back to "
                          f"the lookup of runs made before records, or restore it") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise RecordError(f"run record {file}: format {body.get('format') if isinstance(body, dict) else None!r}, "
                          f"expected {FORMAT!r}")
    return RunRecord(body, file)
