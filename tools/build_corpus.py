"""Build the default text corpus (JSONL) from text every Python 3.11 machine has.

    python -m tools.build_corpus --output data/corpus.jsonl --target-mb 3

Sources, in priority order: the Python language reference (pydoc_data), stdlib docstrings,
license texts, stdlib source code.  Same arguments -> identical bytes.
"""

from __future__ import annotations

import argparse
import sys

from tools._cli import run_main
from training.data import DataError
from training.data import DEFAULT_MAX_DOC_CHARS, DEFAULT_SEED, DEFAULT_TARGET_MB, SOURCES, build_corpus


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.build_corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", "-o", default="data/corpus.jsonl", help="the .jsonl file to write")
    p.add_argument("--target-mb", type=float, default=DEFAULT_TARGET_MB,
                   help="MB of text to collect (0 or less: everything, ~13 MB)")
    p.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES,
                   help="sources in priority order")
    p.add_argument("--max-doc-chars", type=int, default=DEFAULT_MAX_DOC_CHARS,
                   help="split longer documents at paragraph/line breaks")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="document order seed")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def body() -> None:
        build_corpus(args.output, target_mb=args.target_mb if args.target_mb > 0 else None,
                     sources=args.sources, max_doc_chars=args.max_doc_chars, seed=args.seed)

    return run_main(body, DataError)


if __name__ == "__main__":
    sys.exit(main())
