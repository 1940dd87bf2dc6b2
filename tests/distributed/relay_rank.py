"""A stand-in rank program for the launcher test: rank 1 relays an error of rank 0's and exits at
once; rank 0 would say its own later (it is stopped first)."""

import os
import sys
import time

from neorec.cli import _say_error

if __name__ == "__main__":
    if os.environ["RANK"] == "1":
        error = ValueError("rank 0 could not plan: the table does not fit")
        error.relayed = True
        _say_error(f"neorec train (rank 1): error: {error}", error)
        sys.exit(2)
    time.sleep(300)
