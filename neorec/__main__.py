"""Entry point for ``python -m neorec ...`` (same as the ``neorec`` console script)."""

import sys

from neorec.cli import main

if __name__ == "__main__":
    sys.exit(main())
