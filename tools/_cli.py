"""What every command-line tool's ``main()`` shares: an expected error is one line on stderr and exit
status 2, never a traceback (CONTRIBUTING: bad input -> one clear line naming the field or file)."""

from __future__ import annotations

import sys
import argparse
from typing import Callable, Optional


class MissingExtra(RuntimeError):
    """An optional package a tool needs is not installed (the message names the extra to install)."""


def require(tool: str, extra: str, *modules: str) -> None:
    """Raise :class:`MissingExtra` (one line: the tool, the missing package, ``pip install 'xhc[extra]'``)
    unless every module in ``modules`` can be imported.  Called before any work starts."""
    import importlib.util

    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingExtra(f"{tool} needs {name.split('.')[0]}, which is not installed: pip install 'xhc[{extra}]' "
                               f"(or pip install -e '.[{extra}]' in a checkout)")


def run_main(body: Callable[[], Optional[int]], *expected: type) -> int:
    """Run ``body()`` and return its exit status (``None`` counts as 0).  An exception of one of the
    ``expected`` classes (the tool's input errors) or :class:`MissingExtra` prints ``error: <message>``
    on stderr and returns 2; any other exception propagates (a bug shows its traceback)."""
    try:
        status = body()
    except (MissingExtra, *expected) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if status is None else status


def add_text_source_args(p: argparse.ArgumentParser) -> None:
    """The options that say how to read raw text (``training.data.raw.load_raw``), shared by
    ``tools.train_tokenizer`` and ``tools.preprocess_data`` (after their ``--input``)."""
    from training.data import BUILDERS

    p.add_argument("--text-key", default="text", help="the column holding the text")
    p.add_argument("--format", choices=list(BUILDERS) + ["hub"], default=None, help="force the input format")
    p.add_argument("--split", default="train", help="hub dataset split")
    p.add_argument("--hub-config", default=None, help="hub dataset configuration name")
    p.add_argument("--text-sample-by", choices=["line", "paragraph", "document"], default="paragraph",
                   help="for .txt input: what one document is")
    p.add_argument("--cache-dir", default=None, help="HF datasets cache folder")
