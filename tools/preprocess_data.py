"""Tokenize raw text into Megatron's indexed dataset format (<prefix>.bin / <prefix>.idx).

    python -m tools.preprocess_data --input data/corpus.jsonl --tokenizer data/tokenizer.model \
        --output-prefix data/corpus_text_document --workers 2

Input: JSON/JSONL, text, parquet or CSV files (or folders/globs of them), or a hub dataset
name (needs network).  Every document gets the EOD id appended.  Output is atomic: a run that
is interrupted never leaves a .bin/.idx pair that looks complete.
"""

from __future__ import annotations

import argparse
import sys

from tools._cli import add_text_source_args, run_main
from training.data import DataError
from training.data import preprocess


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.preprocess_data", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", "-i", nargs="+", required=True, help="files, folders, globs, or one hub dataset name")
    p.add_argument("--output-prefix", "-o", required=True, help="output path without .bin/.idx")
    p.add_argument("--tokenizer", "-t", required=True, help="SentencePiece .model file or HF tokenizer folder")
    add_text_source_args(p)
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--batch-size", type=int, default=256, help="documents per worker task")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false", help="do not append EOD")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def body() -> None:
        preprocess(args.input, args.output_prefix, args.tokenizer, text_key=args.text_key, fmt=args.format,
                   workers=args.workers, batch_size=args.batch_size, append_eod=args.append_eod, split=args.split,
                   hub_config=args.hub_config, cache_dir=args.cache_dir, text_sample_by=args.text_sample_by,
                   progress=args.progress)

    return run_main(body, DataError)


if __name__ == "__main__":
    sys.exit(main())
