"""A stand-in rank program for the launcher tests: asks to die with the launcher, as a neorec rank
does first thing, then sleeps."""

import time

from neorec.train.launch import die_with_launcher

if __name__ == "__main__":
    die_with_launcher()
    time.sleep(300)
