"""Tokenize raw documents into Megatron's indexed dataset format (``<prefix>.bin`` / ``<prefix>.idx``).

Each document becomes one sequence: its token ids followed by the EOD id.  Documents that
tokenize to nothing are skipped.  Tokenization runs in a :class:`multiprocessing.Pool`
(``workers`` processes, batches returned in order, so the output does not depend on the number
of workers); the main process writes with Megatron's ``IndexedDatasetBuilder`` under a
``tqdm`` progress bar.

The output is atomic: everything is written under temporary names, then the old ``.idx`` and
meta are removed, the ``.bin`` renamed into place, the ``.idx`` renamed, and
``<prefix>.meta.json`` written last.  An interrupted run leaves either the old complete
dataset, or a prefix without ``.idx``/meta, which no reader accepts.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import warnings
from typing import Iterator, Optional, Sequence

from training.data._util import DataError, Log, read_json, write_json
from training.data.raw import Inputs, input_fingerprint, iter_texts, load_raw
from training.data.tokenizer import Tokenizer, load_tokenizer

_WORKER_TOKENIZER = None


def _init_worker(tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _encode_batch(texts: Sequence[str]) -> list[list[int]]:
    return _WORKER_TOKENIZER.tokenize_batch(texts)


def _batches(ds, text_key: str, batch_size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in iter_texts(ds, text_key):
        batch.append(text)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def data_meta_path(prefix: str) -> str:
    return prefix + ".meta.json"


def indexed_dataset_is_current(prefix: str, expected: dict) -> bool:
    """True when ``<prefix>.bin/.idx`` are complete and were made from ``expected`` (a meta subset)."""
    meta = read_json(data_meta_path(prefix))
    if meta is None or any(meta.get(k) != v for k, v in expected.items()):
        return False
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    if not (os.path.isfile(bin_path) and os.path.isfile(idx_path)):
        return False
    return os.path.getsize(bin_path) == meta.get("bin_bytes") and os.path.getsize(idx_path) == meta.get("idx_bytes")


def _remove(*paths: str) -> None:
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def preprocess(
    inputs: Inputs,
    output_prefix: str,
    tokenizer,
    text_key: str = "text",
    fmt: Optional[str] = None,
    workers: int = 1,
    batch_size: int = 256,
    append_eod: bool = True,
    split: str = "train",
    hub_config: Optional[str] = None,
    cache_dir: Optional[str] = None,
    text_sample_by: str = "paragraph",
    progress: bool = True,
    log: Optional[Log] = print,
) -> dict:
    """Tokenize ``inputs`` and write ``<output_prefix>.bin/.idx`` plus ``<output_prefix>.meta.json``.

    Args:
        inputs: file(s)/folder(s)/glob(s) of JSON(L), text, parquet or CSV, or a hub dataset name.
        output_prefix: output path without suffix (Megatron's "data path"), e.g. ``data/my_text_document``.
        tokenizer: a :class:`~training.data.tokenizer.Tokenizer` or a path to load one from.
        text_key: the column with the document text.
        fmt: force the input format (``json``/``text``/``parquet``/``csv``/``hub``).
        workers: tokenizer processes (1: tokenize in this process).
        batch_size: documents per task sent to a worker.
        append_eod: append the tokenizer's EOD id to every document (Megatron's ``--append-eod``).
        split, hub_config: which split/configuration of a hub dataset to read.
        cache_dir: the ``datasets`` Arrow cache folder (None: the HF default).
        text_sample_by: for text files: one document per ``line``, ``paragraph`` or ``document``.
        progress: show a ``tqdm`` progress bar (on stderr).

    Returns:
        the meta dict written next to the output: ``{"prefix", "documents", "tokens", ...}``.
    """
    import numpy as np
    from tqdm import tqdm

    log = log or (lambda _msg: None)
    if workers < 1:
        raise DataError(f"preprocess: workers must be >= 1, got {workers}")
    if batch_size < 1:
        raise DataError(f"preprocess: batch_size must be >= 1, got {batch_size}")
    tok: Tokenizer = load_tokenizer(tokenizer)
    t0 = time.perf_counter()
    ds = load_raw(inputs, text_key, fmt, split, hub_config, cache_dir, text_sample_by, progress)
    source = input_fingerprint(inputs, fmt, split, hub_config)
    n_docs = len(ds)
    if n_docs == 0:
        raise DataError(f"preprocess: {inputs!r} holds no documents")
    with warnings.catch_warnings():  # Megatron warns about missing GPU extras on import; irrelevant here
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    dtype = DType.optimal_dtype(tok.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp_prefix = f"{output_prefix}.tmp-{os.getpid()}"
    tmp_bin, tmp_idx = tmp_prefix + ".bin", tmp_prefix + ".idx"
    log(f"[preprocess] tokenizing {n_docs} documents with {workers} worker(s) -> {output_prefix}.bin/.idx")

    documents = skipped = tokens = 0
    builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
    pool = None
    try:
        batches = _batches(ds, text_key, batch_size)
        if workers > 1:
            # Never "fork": the caller may already run threads (torch, tqdm, a trainer's writers), and a
            # forked child can then block for ever on a lock one of them held (seen in the test suite).
            # The workers start from a clean server process and get the tokenizer pickled.
            method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            pool = multiprocessing.get_context(method).Pool(workers, initializer=_init_worker, initargs=(tok,))
            encoded = pool.imap(_encode_batch, batches, chunksize=1)
        else:
            encoded = (tok.tokenize_batch(b) for b in batches)
        bar = tqdm(total=n_docs, unit="doc", desc="tokenize", disable=not progress, file=sys.stderr, dynamic_ncols=True)
        with bar:
            for ids_batch in encoded:
                for ids in ids_batch:
                    if len(ids) == 0:
                        skipped += 1
                        continue
                    if append_eod:
                        ids = list(ids) + [tok.eod]
                    builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                    documents += 1
                    tokens += len(ids)
                bar.update(len(ids_batch))
        if documents == 0:
            raise DataError(f"preprocess: every document in {inputs!r} is empty (column {text_key!r})")
        builder.finalize(tmp_idx)
        # commit: invalidate the old output first, the new .idx/meta go in last
        _remove(data_meta_path(output_prefix), output_prefix + ".idx")
        os.replace(tmp_bin, output_prefix + ".bin")
        os.replace(tmp_idx, output_prefix + ".idx")
    except BaseException:
        if not builder.data_file.closed:
            builder.data_file.close()
        _remove(tmp_bin, tmp_idx)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    meta = {
        "prefix": os.path.abspath(output_prefix),
        "source": source,
        "text_key": text_key,
        "append_eod": append_eod,
        "tokenizer_sha256": tok.fingerprint,
        "vocab_size": tok.vocab_size,
        "eod": tok.eod,
        "dtype": np.dtype(dtype).name,
        "documents": documents,
        "skipped_empty": skipped,
        "tokens": tokens,
        "bin_bytes": os.path.getsize(output_prefix + ".bin"),
        "idx_bytes": os.path.getsize(output_prefix + ".idx"),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    write_json(data_meta_path(output_prefix), meta)
    log(f"[preprocess] {documents} documents, {tokens} tokens ({skipped} empty skipped) -> "
        f"{output_prefix}.bin/.idx in {meta['seconds']:.1f}s")
    return meta
