"""A stand-in rank program for the launcher test: every rank says the same error (rank 2 relays
rank 0's, as a rank that could not get a plan does), waits until the others have said theirs, and
exits 2."""

import os
import sys
import time
from pathlib import Path

from neorec.cli import _say_error

if __name__ == "__main__":
    rank, world = os.environ["RANK"], int(os.environ["WORLD_SIZE"])
    error = ValueError("the same for all")
    if rank == "2":
        error.relayed = True
    _say_error(f"neorec train (rank {rank}): error: {error}", error)
    Path(os.environ["NEOREC_RANK_ERRORS"], f"done{rank}").write_text("")
    while len(list(Path(os.environ["NEOREC_RANK_ERRORS"]).glob("done*"))) < world:
        time.sleep(0.05)
    sys.exit(2)
