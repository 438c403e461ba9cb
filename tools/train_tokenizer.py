"""Train a SentencePiece tokenizer on raw text (JSONL/JSON, text, parquet or CSV files, or a hub name).

    python -m tools.train_tokenizer --input data/corpus.jsonl --output data/tokenizer.model --vocab-size 4096

Flags are chosen so that text round-trips exactly (identity normalisation, whitespace kept,
byte fallback) and training is deterministic (fixed-seed line sampling).  Ids: <pad> 0,
<unk> 1, <s> 2, </s> 3 (end of document), newline 4.
"""

from __future__ import annotations

import argparse
import itertools
import sys

from tools._cli import add_text_source_args, run_main
from training.data import DataError
from training.data import iter_texts, load_raw
from training.data import DEFAULT_SAMPLE_LINES, DEFAULT_VOCAB_SIZE, train_sentencepiece


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.train_tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", "-i", nargs="+", required=True, help="files, folders, globs, or one hub dataset name")
    p.add_argument("--output", "-o", default="data/tokenizer.model", help="the .model file to write")
    add_text_source_args(p)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--max-lines", type=int, default=DEFAULT_SAMPLE_LINES,
                   help="train on at most this many lines (a fixed-seed sample)")
    p.add_argument("--max-documents", type=int, default=None, help="read at most this many documents")
    p.add_argument("--threads", type=int, default=2, help="SentencePiece trainer threads")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def body() -> None:
        ds = load_raw(args.input, args.text_key, args.format, args.split, args.hub_config, args.cache_dir,
                      args.text_sample_by)
        texts = iter_texts(ds, args.text_key)
        if args.max_documents is not None:
            texts = itertools.islice(texts, args.max_documents)
        train_sentencepiece(texts, args.output, vocab_size=args.vocab_size, model_type=args.model_type,
                            max_lines=args.max_lines, num_threads=args.threads, seed=args.seed,
                            extra_meta={"input": list(args.input), "text_key": args.text_key})

    return run_main(body, DataError)


if __name__ == "__main__":
    sys.exit(main())
