"""What every command-line tool's ``main()`` shares: an expected error is one line on stderr and exit
status 2, never a traceback (CONTRIBUTING: bad input -> one clear line naming the field or file)."""

from __future__ import annotations

import sys
from typing import Callable, Optional


def run_main(body: Callable[[], Optional[int]], *expected: type) -> int:
    """Run ``body()`` and return its exit status (``None`` counts as 0).  An exception of one of the
    ``expected`` classes (the tool's input errors) prints ``error: <message>`` on stderr and returns 2;
    any other exception propagates (a bug shows its traceback)."""
    try:
        status = body()
    except expected as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if status is None else status
