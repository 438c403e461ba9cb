"""The embedded default data: stdlib corpus -> SentencePiece tokenizer -> Megatron ``.bin/.idx``.

:func:`prepare_default_data` runs the three steps into one folder and skips any step whose
output is already there, complete, and made from the same inputs and parameters (each output
has a ``.meta.json`` recording that).  Running it twice does the work once.  It holds a file lock
(``<out_dir>/.build.lock``) while it checks and builds, so runs started together on one machine
build the folder once: the others wait (with a progress line) and then reuse it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Optional

from training.data._util import Log, read_json
from training.data.corpus import (
    DEFAULT_MAX_DOC_CHARS,
    DEFAULT_TARGET_MB,
    SOURCES,
    build_corpus,
    corpus_is_current,
    corpus_params,
)
from training.data.corpus import meta_path as corpus_meta_path
from training.data.indexed import data_meta_path, indexed_dataset_is_current, preprocess
from training.data.raw import input_fingerprint, iter_texts, load_raw
from training.data.tokenizer import DEFAULT_VOCAB_SIZE, tokenizer_is_current, train_sentencepiece

CORPUS_NAME = "corpus.jsonl"
TOKENIZER_NAME = "tokenizer.model"
PREFIX_NAME = "stdlib_text_document"


def default_paths(out_dir: str) -> dict:
    """Where :func:`prepare_default_data` puts each file under ``out_dir``."""
    out_dir = os.path.abspath(out_dir)
    return {
        "out_dir": out_dir,
        "corpus": os.path.join(out_dir, CORPUS_NAME),
        "tokenizer": os.path.join(out_dir, TOKENIZER_NAME),
        "data_prefix": os.path.join(out_dir, PREFIX_NAME),
    }


LOCK_NAME = ".build.lock"
WAIT_REPORT_S = 30.0


def prepare_default_data(
    out_dir: str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    target_mb: Optional[float] = DEFAULT_TARGET_MB,
    model_type: str = "bpe",
    workers: int = 2,
    seed: int = 1234,
    progress: bool = True,
    log: Optional[Log] = print,
) -> dict:
    """Build (or reuse) the default corpus, tokenizer and indexed dataset under ``out_dir``.

    Args:
        out_dir: the folder for ``corpus.jsonl``, ``tokenizer.model`` and
            ``stdlib_text_document.bin/.idx`` (each with a ``.meta.json``).
        vocab_size: SentencePiece vocabulary size.
        target_mb: corpus size in MB of text (see :func:`training.data.corpus.build_corpus`).
        model_type: SentencePiece ``bpe`` or ``unigram``.
        workers: tokenizer processes for preprocessing (and trainer threads).
        seed: the data's seed (``data.seed``, not ``run.seed``): corpus order and tokenizer line
            sampling, recorded in the corpus's and the tokenizer's ``.meta.json``.
        progress: show the preprocessing progress bar.

    Returns:
        ``{"out_dir", "corpus", "tokenizer", "data_prefix", "vocab_size", "documents", "tokens",
        "seed", "built": [steps run this time], "seconds": {step: s}}``.
    """
    from filelock import FileLock, Timeout

    log = log or (lambda _msg: None)
    paths = default_paths(out_dir)
    os.makedirs(paths["out_dir"], exist_ok=True)
    lock = FileLock(os.path.join(paths["out_dir"], LOCK_NAME))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        t_wait = time.perf_counter()
        log(f"[data] another process is building {paths['out_dir']}: waiting for it, then reusing its result")
        while True:
            try:
                lock.acquire(timeout=WAIT_REPORT_S)
                break
            except Timeout:
                log(f"[data] still waiting for {paths['out_dir']} ({time.perf_counter() - t_wait:.0f}s)")
    try:
        return _prepare_locked(paths, vocab_size, target_mb, model_type, workers, seed, progress, log)
    finally:
        lock.release()


def _prepare_locked(paths: dict, vocab_size: int, target_mb: Optional[float], model_type: str, workers: int,
                    seed: int, progress: bool, log: Log) -> dict:
    built: list[str] = []
    seconds: dict[str, float] = {}
    t_all = time.perf_counter()

    # 1. corpus
    params = corpus_params(target_mb, SOURCES, DEFAULT_MAX_DOC_CHARS, seed)
    t0 = time.perf_counter()
    if corpus_is_current(paths["corpus"], params):
        log(f"[data] corpus up to date: {paths['corpus']}")
    else:
        build_corpus(paths["corpus"], target_mb=target_mb, max_doc_chars=DEFAULT_MAX_DOC_CHARS, seed=seed, log=log)
        built.append("corpus")
    corpus_meta = read_json(corpus_meta_path(paths["corpus"]))
    seconds["corpus"] = round(time.perf_counter() - t0, 3)

    # 2. tokenizer
    expected_tok = {"corpus_sha256": corpus_meta["sha256"], "vocab_size": vocab_size, "model_type": model_type,
                    "seed": seed}
    t0 = time.perf_counter()
    cache_dir = tempfile.mkdtemp(prefix=".hf_cache-", dir=paths["out_dir"])
    try:
        if tokenizer_is_current(paths["tokenizer"], expected_tok):
            log(f"[data] tokenizer up to date: {paths['tokenizer']}")
        else:
            ds = load_raw(paths["corpus"], "text", cache_dir=cache_dir, progress=progress)
            train_sentencepiece(
                iter_texts(ds, "text"), paths["tokenizer"], vocab_size=vocab_size, model_type=model_type,
                num_threads=max(1, workers), seed=seed, extra_meta={"corpus_sha256": corpus_meta["sha256"]}, log=log,
            )
            built.append("tokenizer")
        tok_meta = read_json(paths["tokenizer"] + ".meta.json")
        seconds["tokenizer"] = round(time.perf_counter() - t0, 3)

        # 3. indexed dataset
        expected_data = {"tokenizer_sha256": tok_meta["sha256"], "text_key": "text", "append_eod": True}
        t0 = time.perf_counter()
        data_meta = read_json(data_meta_path(paths["data_prefix"]))
        if (indexed_dataset_is_current(paths["data_prefix"], expected_data)
                and data_meta.get("source", {}).get("sha256") == input_fingerprint(paths["corpus"])["sha256"]):
            log(f"[data] indexed dataset up to date: {paths['data_prefix']}.bin/.idx")
        else:
            preprocess(paths["corpus"], paths["data_prefix"], paths["tokenizer"], workers=workers,
                       cache_dir=cache_dir, progress=progress, log=log)
            built.append("preprocess")
            data_meta = read_json(data_meta_path(paths["data_prefix"]))
        seconds["preprocess"] = round(time.perf_counter() - t0, 3)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    seconds["total"] = round(time.perf_counter() - t_all, 3)

    result = {
        **paths,
        "vocab_size": tok_meta["vocab_size"],
        "documents": data_meta["documents"],
        "tokens": data_meta["tokens"],
        "seed": seed,
        "built": built,
        "seconds": seconds,
    }
    log(f"[data] corpus     {paths['corpus']}  ({corpus_meta['documents']} docs, {corpus_meta['text_bytes'] / 1e6:.2f} MB)")
    log(f"[data] tokenizer  {paths['tokenizer']}  (vocab {tok_meta['vocab_size']})")
    log(f"[data] dataset    {paths['data_prefix']}.bin/.idx  ({data_meta['documents']} docs, {data_meta['tokens']} tokens)")
    log(f"[data] ready in {seconds['total']:.1f}s (built: {', '.join(built) or 'nothing, all up to date'})")
    return result


def main(argv=None) -> int:
    """``python -m training.data.default --out-dir DIR``: prepare the default data and print the paths."""
    import argparse
    import sys

    from training.data._util import DataError

    p = argparse.ArgumentParser(prog="python -m training.data.default", description=main.__doc__)
    p.add_argument("--out-dir", default="data/default")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--target-mb", type=float, default=DEFAULT_TARGET_MB)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234, help="the data's seed (data.seed)")
    args = p.parse_args(argv)
    try:
        prepare_default_data(args.out_dir, vocab_size=args.vocab_size, target_mb=args.target_mb, workers=args.workers,
                             seed=args.seed)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
