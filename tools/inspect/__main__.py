import sys

from tools.inspect import main

if __name__ == "__main__":
    sys.exit(main())
