"""Both ranks' timelines of a ``bench_e2e.py --trace PREFIX`` run, merged by time: which rank
starts each collective when, and what it ran before (to see where one rank waits for the other).

    python benchmarks/bench_e2e.py --configs pool20 --ranks 2 --repeats 2 --trace /tmp/trace
    python benchmarks/trace_timeline.py /tmp/trace_pool20_r2 --start 150 --end 250

Prints one line per event longer than ``--min-ms`` whose name matches ``--match`` (defaults: the
collectives, the embedding lookup and its backward, the MLP layers and their backward, the
interaction, the dense optimizer), with its start in ms from the first event, rank, thread
("main" = the Python thread, "bg" = gloo's and autograd's workers) and duration. The ranks' clocks
are the same (one host), so the columns line up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import List, Optional, Tuple

from bench_args import at_least  # same folder (run as a script)

DEFAULT_MATCH = ("gloo:", "c10d::", "DistributedDataParallel.forward", "PathLookup", "_DifferentiableAllToAll",
                 "Optimizer.step", "_PlaceParts", "_DotInteraction", "aten::linear",
                 "evaluate_function: AddmmBackward0", "evaluate_function: _AlignedLinear")


def events(path: str, rank: int, match: Tuple[str, ...], min_us: float) -> List[Tuple[float, int, str, float, str]]:
    with open(path) as f:
        trace = json.load(f)
    complete = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    tids = [e["tid"] for e in complete]
    main = max(set(tids), key=tids.count)  # the thread with the most events is the Python thread
    return [(e["ts"], rank, "main" if e["tid"] == main else "bg", e["dur"], e["name"])
            for e in complete if e["dur"] >= min_us and any(m in e["name"] for m in match)]


def ranks_of(prefix: str) -> Optional[int]:
    """The rank count in a ``bench_e2e.py --trace`` prefix's ``_rW`` suffix (``/tmp/t_pool20_r1``: 1);
    None without one."""
    found = re.search(r"_r(\d+)$", prefix)
    return int(found.group(1)) if found and int(found.group(1)) > 0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", help="PREFIX_CONFIG_rW of the trace files (without _rankN.json)")
    parser.add_argument("--ranks", type=at_least(1), default=None,
                        help="trace files to merge (default: W of the prefix's _rW suffix, else 2)")
    parser.add_argument("--start", type=float, default=0.0, help="ms from the first event")
    parser.add_argument("--end", type=float, default=float("inf"), help="ms from the first event")
    parser.add_argument("--min-ms", type=float, default=0.1, help="leave out events shorter than this (default 0.1)")
    parser.add_argument("--match", default=",".join(DEFAULT_MATCH), help="comma list of name substrings")
    args = parser.parse_args(argv)
    if args.start > args.end:
        parser.error(f"argument --end: must not be before --start ({args.start:g}), got {args.end:g}")
    match = tuple(m for m in args.match.split(",") if m)
    ranks = args.ranks or ranks_of(args.prefix) or 2
    paths = [f"{args.prefix}_rank{rank}.json" for rank in range(ranks)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        print(f"trace_timeline: no trace file {missing[0]} (reading {ranks} ranks; give the prefix "
              f"PREFIX_CONFIG_rW, or --ranks N for N files)", file=sys.stderr)
        return 2
    rows = []
    for rank, path in enumerate(paths):
        rows += events(path, rank, match, args.min_ms * 1e3)
    if not rows:
        raise SystemExit("no matching events")
    rows.sort()
    origin = rows[0][0]
    print(f"{'ms':>9}  rank thread {'ms long':>8}  event (rank 1 indented)")
    for ts, rank, thread, dur, name in rows:
        at = (ts - origin) / 1e3
        if args.start <= at <= args.end:
            print(f"{at:9.2f}  {'    ' * rank}r{rank} {thread:<4} {dur / 1e3:8.2f}  {name[:80]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
