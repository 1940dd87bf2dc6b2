"""Shared test setup.

A shell starts background jobs (`nohup ... &`, some CI runners) with SIGINT ignored, and an ignored
signal stays ignored in every process started from them: a `neorec train` child would then never
see the Ctrl-C that the interruption tests send (they hung until their timeout). The suite runs
with Python's usual SIGINT handler, as it has in a terminal, so that its children get the default.
"""

import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
