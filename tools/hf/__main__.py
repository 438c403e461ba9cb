import sys

from tools.hf import main

if __name__ == "__main__":
    sys.exit(main())
