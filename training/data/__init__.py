"""The xhc pre-training data pipeline.

Raw text (HF ``datasets``: JSONL/text/parquet/CSV files or a hub name) -> SentencePiece (or HF)
tokenizer -> Megatron indexed dataset (``.bin``/``.idx``) -> Megatron ``GPTDataset`` splits ->
deterministic, resumable micro-batches.  With no data of your own, :func:`prepare_default_data`
builds all of it from the Python standard library's text.

Modules: ``corpus`` (stdlib corpus), ``raw`` (loading raw text), ``tokenizer``,
``indexed`` (preprocessing into ``.bin``/``.idx``), ``gpt`` (datasets and iterator), ``default``.
Names are imported lazily so that ``import training.data`` stays cheap (no torch/Megatron).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DataError": "_util",
    "build_corpus": "corpus",
    "SOURCES": "corpus",
    "load_raw": "raw",
    "iter_texts": "raw",
    "Tokenizer": "tokenizer",
    "NullTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_sentencepiece": "tokenizer",
    "preprocess": "indexed",
    "DataConfig": "gpt",
    "build_datasets": "gpt",
    "DataIterator": "gpt",
    "make_data_iterator": "gpt",
    "collate": "gpt",
    "document_positions": "gpt",
    "prepare_default_data": "default",
    "default_paths": "default",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"training.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'training.data' has no attribute {name!r}")
