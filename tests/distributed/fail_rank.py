"""A stand-in rank program for the launcher test: rank 1 fails at once, the others would wait."""

import os
import sys
import time

if __name__ == "__main__":
    if os.environ["RANK"] == "1":
        sys.exit(3)
    time.sleep(300)
