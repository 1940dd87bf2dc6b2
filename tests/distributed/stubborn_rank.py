"""A stand-in rank program for the launcher tests that ignores SIGTERM (a rank busy in a
collective, or a program that handles it slowly): the launcher SIGKILLs it after its grace period.
Its output goes nowhere, so that the launcher's pipes close when the launcher exits. Once SIGTERM is
ignored it makes ``$STUBBORN_READY_DIR/<pid>``."""

import os
import signal
import time

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    nowhere = os.open(os.devnull, os.O_WRONLY)
    os.dup2(nowhere, 1)
    os.dup2(nowhere, 2)
    open(os.path.join(os.environ["STUBBORN_READY_DIR"], str(os.getpid())), "w").close()
    time.sleep(300)
