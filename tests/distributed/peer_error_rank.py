"""A stand-in rank program for the launcher test: rank 1 says its own error and exits; rank 0 has
already said an error of its own and waits to be stopped. PEER_ERROR_MODE "peer": rank 0's error is
gloo's "Connection closed by peer" (what a collective raises when another rank's process ended);
"other": an unrelated error of rank 0's; "race": rank 0's collective fails (peer gone) and it exits
20 ms after rank 1, as a real gloo rank does (mostly seen ended at the same poll)."""

import os
import sys
import time

from neorec.cli import _say_error, _say_unexpected

if __name__ == "__main__":
    mode = os.environ["PEER_ERROR_MODE"]
    if os.environ["RANK"] == "0" and mode == "race":
        time.sleep(1.02)
        sys.exit(_say_unexpected("train", " (rank 0)", RuntimeError("[pair.cc:553] Connection closed by peer "
                                                                    "[127.0.0.1]:29500"), show_traceback=False))
    if os.environ["RANK"] == "0":
        if mode == "peer":
            error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                                 "[127.0.0.1]:29500")
            _say_unexpected("train", " (rank 0)", error, show_traceback=False)
        else:
            _say_error("neorec train (rank 0): error: a slow disk", ValueError("a slow disk"))
        time.sleep(300)
    time.sleep(1.0)  # (rank 0's line is written first)
    _say_error("neorec train (rank 1): error: feature 'f' (table 't'): id 1000 is outside the table's rows [0, 30)",
               ValueError("id 1000"))
    sys.exit(2)
