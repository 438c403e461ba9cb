"""torchrun entry point for the reliability tests: ``xhc-pretrain`` on this rank, then one line
``rank <R> exit <code>`` so the test sees every rank's exit code (torchrun reports only failures)."""

import os
import sys

from training.pretrain import main

if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os.write(1, f"rank {os.environ.get('RANK')} exit {code}\n".encode())  # one write: lines of ranks do not interleave
    sys.exit(code)
