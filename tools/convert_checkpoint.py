"""``python -m tools.convert_checkpoint``: the Hugging Face converter's command, as documented.

The converter lives in the :mod:`tools.hf` room (``tools/hf/cli.py``); ``python -m tools.hf`` and the
``xhc-convert`` console script run the same :func:`main`.
"""

import sys

from tools.hf import main

if __name__ == "__main__":
    sys.exit(main())
