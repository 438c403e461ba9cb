"""The xhc pre-training data pipeline.

Raw text (HF ``datasets``: JSONL/text/parquet/CSV files or a hub name) -> SentencePiece (or HF)
tokenizer -> Megatron indexed dataset (``.bin``/``.idx``) -> Megatron ``GPTDataset`` splits ->
deterministic, resumable micro-batches.  With no data of your own, :func:`prepare_default_data`
builds all of it from the Python standard library's text.

Modules: ``corpus`` (stdlib corpus), ``raw`` (loading raw text), ``tokenizer``,
``indexed`` (preprocessing into ``.bin``/``.idx``), ``gpt`` (datasets and iterator), ``default``,
``_util`` (errors, hashes, JSON writes).
Names are imported lazily so that ``import training.data`` stays cheap (no torch/Megatron).
"""

from __future__ import annotations

from training.rooms import lazy_exports

_EXPORTS = {
    "DataError": "_util", "sha256_file": "_util", "write_json": "_util",
    "build_corpus": "corpus", "DEFAULT_MAX_DOC_CHARS": "corpus", "DEFAULT_SEED": "corpus",
    "DEFAULT_TARGET_MB": "corpus", "SOURCES": "corpus",
    "default_paths": "default", "PREFIX_NAME": "default", "prepare_default_data": "default",
    "build_datasets": "gpt", "check_indexed_pair": "gpt", "collate": "gpt", "DataConfig": "gpt",
    "DataIterator": "gpt", "document_positions": "gpt", "make_data_iterator": "gpt", "parse_split": "gpt",
    "split_ranges": "gpt",
    "preprocess": "indexed",
    "BUILDERS": "raw", "check_text_file": "raw", "iter_texts": "raw", "load_raw": "raw",
    "DEFAULT_SAMPLE_LINES": "tokenizer", "DEFAULT_VOCAB_SIZE": "tokenizer", "folder_fingerprint": "tokenizer",
    "load_tokenizer": "tokenizer", "NullTokenizer": "tokenizer", "Tokenizer": "tokenizer",
    "train_sentencepiece": "tokenizer",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
