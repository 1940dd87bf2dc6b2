"""PNG chart of the per-rank load of a plan (stacked compute / communication seconds per rank).
Needs matplotlib (``pip install 'neorec[plot]'``).

    write_load_chart(result, "load.png")
"""

from __future__ import annotations

import io
from pathlib import Path

from neorec.files import write_atomic

MISSING = ("the per-rank chart needs matplotlib: pip install 'matplotlib>=3.7' (or the neorec[plot] extra), "
           "or leave out --chart")


def check_matplotlib() -> None:
    """Raise the ValueError ``write_load_chart`` would, without importing matplotlib (the CLI asks
    before its search, not after it)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(MISSING)


def write_load_chart(result, path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(MISSING) from None
    ranks = result.ranks()
    x = [r.rank for r in ranks]
    parts = [("lookups + optimizer", [r.cost.compute * 1e3 for r in ranks]),
             ("all-to-all", [(r.cost.input_comm + r.cost.output_comm + r.cost.gradient_comm) * 1e3 for r in ranks]),
             ("all-reduce (replicas)", [r.cost.allreduce * 1e3 for r in ranks])]
    fig, ax = plt.subplots(figsize=(max(6.0, min(20.0, len(ranks) * 0.15)), 4.0))
    bottom = [0.0] * len(ranks)
    for label, values in parts:
        ax.bar(x, values, bottom=bottom, label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(result.lower_bound * 1e3, color="black", linestyle="--", linewidth=1, label="lower bound")
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per iteration")
    ax.set_title(f"{result.topology.name}: {result.topology.world_size} ranks, slowest {result.makespan * 1e3:.3f} ms, "
                 f"gap to bound {result.gap * 100:.1f}%")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=100)
    finally:
        plt.close(fig)
    write_atomic(Path(path), png.getvalue())  # the mode the umask gives, as the plan and report files
