"""The partitioner: pick one option and its ranks per table so that the slowest rank's iteration
cost is as small as possible, under each rank's memory limits.

    result = partition(options_by_table, topology, capacity, time_limit=2.0)
    result.makespan, result.lower_bound, result.gap      # seconds, seconds, makespan / bound - 1

1. Greedy start (longest processing time first): tables in decreasing order of their cheapest
   total work; each takes the (option, ranks) that minimises max(current slowest rank, the ranks
   it lands on, (work placed so far + its work + cheapest work left) / ranks), ties to less work.
   Ranks of an option: the least-loaded ranks with room ("any"), the best node's least-loaded
   ranks ("node": hierarchical TWRW / TWCW), or every rank ("all"). When that runs out of
   memory, three memory-first passes follow, largest tables first: on the least full ranks by
   smallest footprint, then by least fill, then best fit (smallest footprint on the fullest ranks
   with room). Packing is NP-hard: when all four fail, the cluster is full or nearly so.
2. Bound-guided packing: for targets T = bound x 1.00, 1.01, ... each table takes its least-work
   option with pieces <= T, packed largest piece first onto the least-loaded ranks; the best of
   these and the greedy start goes on to
3. Improvement search (local search, deterministic): take the slowest rank; try moving every
   table with a piece there to any of its options and placements, and swapping its single-piece
   tables with single-piece tables elsewhere; apply the move that lowers (slowest rank, sum of
   squared loads) most; stop when no move helps, after ``max_rounds`` or ``time_limit`` seconds
   (of steps 2 and 3, counted from the end of the greedy start; ``search_seconds`` says how long).
4. Lower bound (see ``lower_bound``), at least max(sum over tables of the cheapest total work /
   ranks, the largest cheapest indivisible piece). Memory is not in the bound.
5. Preference pass (optional): tables move to their most preferred option (precision, then tier,
   in the user's order) that fits in memory, then the search runs again among options no less
   preferred: lower precision or slower tiers only where memory needs them. The search may free
   memory, so the two alternate until a pass moves no table (each move is to a strictly more
   preferred option, so this ends): in the final plan no table has a more preferred option that
   fits in the memory the others leave.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from neorec.planner.enumerate import Capacity, InfeasiblePlanError, ShardOption, format_bytes, step_buffers_note
from neorec.planner.topology import Topology

EPS = 1e-12


@dataclass(frozen=True)
class Placement:
    option: ShardOption
    ranks: Tuple[int, ...]


@dataclass
class PartitionResult:
    placements: Dict[str, Placement]
    loads: List[float]            # seconds per rank, [world_size]
    makespan: float
    lower_bound: float
    rounds: int
    greedy_makespan: float
    search_seconds: float = 0.0   # steps 2, 3 and 5: what ``time_limit`` bounds

    @property
    def gap(self) -> float:
        if self.lower_bound <= 0:
            return 0.0
        return max(0.0, self.makespan / self.lower_bound - 1.0)  # bound <= makespan; clamp float rounding


def lower_bound(options: Dict[str, List[ShardOption]], world_size: int) -> float:
    """The smallest T such that every table has an option whose pieces take <= T and the
    cheapest such options add up to <= world_size * T. No plan can be faster: its slowest rank
    holds at least its largest piece, and the ranks together hold all the work. (It is at least
    max(total cheapest work / ranks, the largest indivisible piece).)"""
    pieces = sorted({o.piece_seconds for opts in options.values() for o in opts})
    floor = max(min(o.piece_seconds for o in opts) for opts in options.values())
    pieces = [p for p in pieces if p >= floor]
    by_table = [sorted(((o.piece_seconds, o.work) for o in opts)) for opts in options.values()]
    for i, value in enumerate(pieces):
        total = 0.0
        for opts in by_table:
            total += min(w for p, w in opts if p <= value)
        bound = max(value, total / world_size)
        if i + 1 == len(pieces) or bound < pieces[i + 1]:
            return bound
    return floor


class _State:
    """Per-rank load (seconds) and memory per tier. ``place`` walks the ranks in load order (or
    fill order), cached until the next ``apply``: the first ranks with room are the answer, so an
    "any" placement costs a few ``fits`` checks instead of one per rank (thousands of ranks, ~1000
    tables, several options each); a "node" one still visits every rank, with the check inlined."""

    def __init__(self, topo: Topology, capacity: Capacity):
        self.world, self.per_node = topo.world_size, int(topo.ranks_per_node)
        self.cap = capacity
        self.load = [0.0] * self.world
        self.device = [0.0] * self.world
        self.host = [0.0] * self.world
        self.ssd = [0.0] * self.world
        self._orders: Dict[bool, List[int]] = {}  # by_memory -> ranks, least loaded (least full) first
        self._fills: List[float] = []  # fill of every rank, with the by_memory order

    def fits(self, rank: int, option: ShardOption) -> bool:
        m, c = option.memory, self.cap
        return (self.device[rank] + m.device <= c.device * (1 + 1e-9) and self.host[rank] + m.host <= c.host * (1 + 1e-9)
                and self.ssd[rank] + m.ssd <= c.ssd * (1 + 1e-9))

    def fits_all(self, option: ShardOption) -> bool:
        """``fits`` on every rank: the fullest rank of each tier decides (adding is monotone)."""
        m, c = option.memory, self.cap
        return (max(self.device) + m.device <= c.device * (1 + 1e-9) and max(self.host) + m.host <= c.host * (1 + 1e-9)
                and max(self.ssd) + m.ssd <= c.ssd * (1 + 1e-9))

    def apply(self, placement: Placement, sign: float) -> None:
        o = placement.option
        for r in placement.ranks:
            self.load[r] += sign * o.piece_seconds
            self.device[r] += sign * o.memory.device
            self.host[r] += sign * o.memory.host
            self.ssd[r] += sign * o.memory.ssd
        self._orders.clear()

    def fill(self, rank: int) -> float:
        c = self.cap
        return max(self.device[rank] / c.device if c.device else 0.0, self.host[rank] / c.host if c.host else 0.0,
                   self.ssd[rank] / c.ssd if c.ssd else 0.0)

    def _order(self, by_memory: bool) -> List[int]:
        """Ranks by (load, rank), or by (fill, load, rank) with ``by_memory`` (sorts are stable)."""
        order = self._orders.get(by_memory)
        if order is None:
            if by_memory:
                fills, load = [self.fill(r) for r in range(self.world)], self.load
                order = sorted(range(self.world), key=lambda r: (fills[r], load[r]))
                self._fills = fills
            else:
                order = sorted(range(self.world), key=self.load.__getitem__)
            self._orders[by_memory] = order
        return order

    def place(self, option: ShardOption, by_memory: bool = False, fullest: bool = False) -> Optional[Tuple[int, ...]]:
        """The ranks this option would use now (None if it does not fit): the least loaded, or
        with ``by_memory`` the least full (``fullest``: for an "any" option the fullest ranks with
        room, best fit); for a "node" option those of the node whose chosen ranks peak lowest (the
        first such node)."""
        k = option.num_pieces
        if option.placement == "all":
            return tuple(range(self.world)) if self.fits_all(option) else None
        order = self._order(by_memory)
        if option.placement == "any":
            chosen = []
            for r in (reversed(order) if fullest else order):
                if self.fits(r, option):
                    chosen.append(r)
                    if len(chosen) == k:
                        return tuple(sorted(chosen))
            return None
        per_node: List[List[int]] = [[] for _ in range(self.world // self.per_node)]
        device, host, ssd, size = self.device, self.host, self.ssd, self.per_node
        m, c = option.memory, self.cap  # ``fits`` inlined: this loop runs over every rank
        cap_device, cap_host, cap_ssd = c.device * (1 + 1e-9), c.host * (1 + 1e-9), c.ssd * (1 + 1e-9)
        for r in order:  # every node's k least loaded (least full) ranks with room, in key order
            ranks = per_node[r // size]
            if (len(ranks) < k and device[r] + m.device <= cap_device and host[r] + m.host <= cap_host
                    and ssd[r] + m.ssd <= cap_ssd):
                ranks.append(r)
        key = self._fills if by_memory else self.load
        best: Optional[Tuple[float, Tuple[int, ...]]] = None
        for chosen in per_node:
            if len(chosen) < k:
                continue
            peak = key[chosen[-1]]  # the largest of the chosen: they came in key order
            if best is None or peak < best[0] - EPS:
                best = (peak, tuple(sorted(chosen)))
        return None if best is None else best[1]

    def fullest_after(self, ranks: Sequence[int], option: ShardOption) -> float:
        """The fullest tier of the fullest of ``ranks`` once ``option`` is added (fraction)."""
        m, c = option.memory, self.cap
        worst = 0.0
        for r in ranks:
            for used, need, cap in ((self.device[r], m.device, c.device), (self.host[r], m.host, c.host),
                                    (self.ssd[r], m.ssd, c.ssd)):
                if cap > 0:
                    worst = max(worst, (used + need) / cap)
        return worst

    def peak_after(self, ranks: Sequence[int], seconds: float, base_peak: float) -> float:
        return max(base_peak, max(self.load[r] for r in ranks) + seconds)

    def sumsq_delta(self, ranks: Sequence[int], seconds: float) -> float:
        return sum((self.load[r] + seconds) ** 2 - self.load[r] ** 2 for r in ranks)


def _tightest(state: _State, options: List[ShardOption]) -> str:
    best: Optional[Tuple[float, str]] = None
    for o in options:
        for r in range(state.world):
            for need, used, cap, what in ((o.memory.device, state.device[r], state.cap.device, "device memory"),
                                          (o.memory.host, state.host[r], state.cap.host, "host DRAM share"),
                                          (o.memory.ssd, state.ssd[r], state.cap.ssd, "SSD share")):
                if need > 0 and used + need > cap:
                    ratio = (used + need) / cap if cap > 0 else float("inf")
                    if best is None or ratio < best[0]:
                        best = (ratio, f"{o.describe()}: {what} of rank {r} would hold {format_bytes(used + need)} "
                                       f"of {format_bytes(cap)}")
    return best[1] if best else "none found"


def _total_memory(options: Dict[str, List[ShardOption]], world: int, capacity: Capacity) -> Tuple[float, str, bool]:
    """(the largest ratio of need to room, its sentence, whether a step's buffers are most of that
    need) over "all tiers" and each tier alone:
    what every table takes at least (its smallest option: all pieces, buffers included) against
    what all ranks hold. Above 1 no plan exists; below, packing may still fail near 1."""
    def footprint(o: ShardOption, tier: Optional[str]) -> float:
        m = o.memory
        return (m.device + m.host + m.ssd if tier is None else getattr(m, tier)) * o.num_pieces

    worst: Tuple[float, str, bool] = (0.0, "", False)
    for tier, what, room in (("device", "device memory", capacity.device), ("host", "host DRAM", capacity.host),
                             ("ssd", "SSD", capacity.ssd),  # (a tier alone wins a tie: it says more)
                             (None, "memory of all tiers", capacity.device + capacity.host + capacity.ssd)):
        smallest = {name: min(opts, key=lambda o: footprint(o, tier)) for name, opts in options.items()}
        least = {name: footprint(o, tier) for name, o in smallest.items()}
        need = sum(least.values())
        if need <= 0:
            continue
        ratio = need / (room * world) if room > 0 else float("inf")
        if ratio > worst[0]:
            largest = sorted(least, key=lambda n: -least[n])[:3]
            buffers = sum(o.memory.step_buffers * o.num_pieces for o in smallest.values())
            note = step_buffers_note(buffers, need) if tier in ("device", None) else ""
            worst = (ratio, f"the tables need at least {format_bytes(need)} of {what} in all (each at its smallest "
                            f"option; the largest: {', '.join(repr(n) for n in largest)}){note}, and the {world} ranks "
                            f"hold {format_bytes(room * world)} ({ratio * 100:.0f}%)", bool(note))
    return worst


def _check_total_memory(options: Dict[str, List[ShardOption]], world: int, capacity: Capacity) -> None:
    """Raise ``InfeasiblePlanError`` when the tables cannot fit in all ranks' memory together,
    saying by how much (the packings' own failure named one table and its nearest miss)."""
    ratio, sentence, buffers = _total_memory(options, world, capacity)
    if ratio > 1 + 1e-9:
        advice = "" if buffers else ": add nodes, or allow another tier or a lower precision"
        raise InfeasiblePlanError(f"no plan fits: {sentence}{advice}")


def partition(options: Dict[str, List[ShardOption]], topo: Topology, capacity: Capacity,
              time_limit: float = 2.0, max_rounds: int = 10_000,
              bound_steps: int = 60, preference: Optional[Callable[[ShardOption], tuple]] = None) -> PartitionResult:
    """See the module docstring. ``options``: table name -> its options (non-empty lists).
    ``preference``: option -> sort key (smaller = preferred, e.g. fp32 before fp16); after the
    search, tables move to their most preferred option that fits, and the search runs again
    among options at least that preferred."""
    world = topo.world_size
    _check_total_memory(options, world, capacity)
    for goal in GREEDY_GOALS:
        try:
            state, placements = _greedy(options, topo, capacity, goal)
            break
        except InfeasiblePlanError as exc:
            if goal == GREEDY_GOALS[-1]:
                raise InfeasiblePlanError(f"{exc}; {_total_memory(options, world, capacity)[1]}") from None
    greedy = max(state.load)
    bound = lower_bound(options, world)
    start = time.perf_counter()  # the search's clock: the greedy start and the bound take what they take
    best_loads, best_placements = max(state.load), dict(placements)
    for step in range(bound_steps):
        target = bound * (1 + 0.01 * step)
        if target >= best_loads or time.perf_counter() - start > time_limit / 2:
            break
        for adaptive in (False, True):
            packed = _pack_to_target(options, topo, capacity, target, adaptive)
            if packed is not None and max(packed[0].load) < best_loads * (1 - 1e-9):
                best_loads, best_placements = max(packed[0].load), packed[1]
    if best_placements is not placements and best_loads < greedy:
        state, placements = _State(topo, capacity), best_placements
        for p in placements.values():
            state.apply(p, +1)
    rounds = 0
    while rounds < max_rounds and time.perf_counter() - start < time_limit:
        rounds += 1
        if not _improve(state, placements, options):
            break
    if preference is not None:
        allowed, _ = _prefer(state, placements, options, preference)
        while True:
            while rounds < 2 * max_rounds and time.perf_counter() - start < 2 * time_limit:
                rounds += 1
                if not _improve(state, placements, allowed):
                    break
            allowed, moved = _prefer(state, placements, options, preference)
            if not moved:  # every move is to a more preferred option: this ends
                break
    makespan = max(state.load)
    return PartitionResult({n: placements[n] for n in options}, list(state.load), makespan, bound, rounds, greedy,
                           time.perf_counter() - start)


def _prefer(state: _State, placements: Dict[str, Placement], options: Dict[str, List[ShardOption]],
            preference: Callable[[ShardOption], tuple]) -> Tuple[Dict[str, List[ShardOption]], bool]:
    """Move tables (largest first) to their most preferred option that fits in memory, on the
    least loaded ranks: a less preferred precision or tier is a fallback for memory, not a speed
    knob. Returns the options each table may still use (none less preferred than its own) and
    whether any table moved."""
    moved = False
    for name in sorted(placements, key=lambda n: -placements[n].option.work):
        old = placements[name]
        better = sorted((o for o in options[name] if preference(o) < preference(old.option)),
                        key=lambda o: (preference(o), o.work))
        if not better:
            continue
        state.apply(old, -1)
        chosen = old
        for option in better:
            ranks = state.place(option)
            if ranks is not None:
                chosen = Placement(option, ranks)
                break
        placements[name] = chosen
        state.apply(chosen, +1)
        moved = moved or chosen is not old
    return {name: [o for o in opts if preference(o) <= preference(placements[name].option)]
            for name, opts in options.items()}, moved


def _pack_to_target(options: Dict[str, List[ShardOption]], topo: Topology, capacity: Capacity,
                    target: float, adaptive: bool) -> Optional[Tuple[_State, Dict[str, Placement]]]:
    """Bound-guided packing: every table takes its least-work option whose pieces take <= target,
    then replicated / all-rank options go first and the rest in decreasing piece size onto the
    least-loaded ranks with room. ``adaptive``: at its turn a table may instead take the
    least-work option (pieces <= target) that keeps its ranks under the target, or failing
    that the one with the lowest peak. None when a table has no such option or nothing fits."""
    choice: Dict[str, ShardOption] = {}
    for name, opts in options.items():
        small = [o for o in opts if o.piece_seconds <= target * (1 + 1e-9)]
        if not small:
            return None
        choice[name] = min(small, key=lambda o: (o.work, o.piece_seconds))
    state = _State(topo, capacity)
    placements: Dict[str, Placement] = {}
    order = sorted(choice, key=lambda n: (choice[n].placement != "all", -choice[n].piece_seconds * (
        choice[n].num_pieces if choice[n].placement == "node" else 1), n))
    for name in order:
        candidates = [choice[name]]
        if adaptive:
            candidates = sorted((o for o in options[name] if o.piece_seconds <= target * (1 + 1e-9)),
                                key=lambda o: (o.work, o.piece_seconds))
        best = None
        for option in candidates:
            ranks = state.place(option)
            if ranks is None:
                continue
            peak = max(state.load[r] for r in ranks) + option.piece_seconds
            if peak <= target * (1 + 1e-9):
                best = (peak, option, ranks)
                break
            if best is None or peak < best[0]:
                best = (peak, option, ranks)
        if best is None:
            return None
        placements[name] = Placement(best[1], best[2])
        state.apply(placements[name], +1)
    return state, {n: placements[n] for n in options}


GREEDY_GOALS = ("time", "footprint", "fill", "best_fit")


def _greedy(options: Dict[str, List[ShardOption]], topo: Topology, capacity: Capacity,
            goal: str) -> Tuple[_State, Dict[str, Placement]]:
    """``goal`` "time": longest processing time first (see the module docstring). The fallbacks
    when memory is tight place the largest tables first: "footprint" takes the option with the
    smallest total footprint (all pieces, all tiers, buffers included) on the least full ranks,
    "fill" the option that leaves its fullest rank and tier least full, "best_fit" the smallest
    footprint on the FULLEST ranks with room (best-fit decreasing: it keeps whole ranks free for
    the large tables that the least-full passes scatter into gaps none of them fits)."""
    memory_first = goal != "time"
    state = _State(topo, capacity)
    world = state.world
    min_work = {name: min(o.work for o in opts) for name, opts in options.items()}
    if memory_first:
        size = {name: min((o.memory.device + o.memory.host + o.memory.ssd) * o.num_pieces for o in opts)
                for name, opts in options.items()}
        order = sorted(options, key=lambda name: (-size[name], name))
    else:
        order = sorted(options, key=lambda name: (-min_work[name], name))
    remaining = sum(min_work.values())
    placed_work = 0.0
    placements: Dict[str, Placement] = {}
    for name in order:
        remaining -= min_work[name]
        peak = max(state.load)
        best = None
        for option in options[name]:
            ranks = state.place(option, by_memory=memory_first, fullest=goal == "best_fit")
            if ranks is None:
                continue
            if memory_first:
                fill = state.fullest_after(ranks, option)
                footprint = (option.memory.device + option.memory.host + option.memory.ssd) * option.num_pieces
                score = (round(fill, 3), option.work) if goal == "fill" else (footprint, fill, option.work)
            else:
                projected = (placed_work + option.work + remaining) / world
                score = (max(state.peak_after(ranks, option.piece_seconds, peak), projected), option.work)
            if best is None or score < best[0]:
                best = (score, Placement(option, ranks))
        if best is None:
            raise InfeasiblePlanError(f"table {name!r} does not fit after placing {len(placements)} other tables: "
                                      f"none of the planner's packings found room for every table (the cluster is "
                                      f"too full, or nearly so); tightest limit: {_tightest(state, options[name])}")
        placements[name] = best[1]
        state.apply(best[1], +1)
        placed_work += best[1].option.work
    return state, placements


def _improve(state: _State, placements: Dict[str, Placement], options: Dict[str, List[ShardOption]]) -> bool:
    peak = max(state.load)
    hot = max(range(state.world), key=lambda r: (state.load[r], -r))
    on_hot = [n for n, p in placements.items() if hot in p.ranks]
    best: Optional[Tuple[Tuple[float, float], str, Placement]] = None
    current = (peak, 0.0)
    for name in on_hot:
        old = placements[name]
        state.apply(old, -1)
        base_peak = max(state.load)
        removed = -state.sumsq_delta(old.ranks, old.option.piece_seconds)  # sumsq change of removing it
        for option in options[name]:
            ranks = state.place(option)
            if ranks is None or (option is old.option and ranks == old.ranks):
                continue
            key = (state.peak_after(ranks, option.piece_seconds, base_peak),
                   removed + state.sumsq_delta(ranks, option.piece_seconds))
            if _better(key, current) and (best is None or _better(key, best[0])):
                best = (key, name, Placement(option, ranks))
        state.apply(old, +1)
    if best is None:
        best = _best_swap(state, placements, hot, peak)
    if best is None:
        return False
    _, name, new = best
    if isinstance(name, tuple):  # a swap of two single-piece tables
        for n, p in zip(name, new):
            state.apply(placements[n], -1)
        for n, p in zip(name, new):
            placements[n] = p
            state.apply(p, +1)
        return True
    state.apply(placements[name], -1)
    placements[name] = new
    state.apply(new, +1)
    return True


def _better(a: Tuple[float, float], b: Tuple[float, float]) -> bool:
    scale = max(abs(b[0]), EPS)
    if a[0] < b[0] - 1e-9 * scale:
        return True
    return a[0] <= b[0] + 1e-9 * scale and a[1] < b[1] - 1e-9 * scale * scale


def _best_swap(state: _State, placements: Dict[str, Placement], hot: int, peak: float):
    singles = [n for n, p in placements.items() if len(p.ranks) == 1 and p.option.placement == "any"]
    mine = [n for n in singles if placements[n].ranks[0] == hot]
    others = [n for n in singles if placements[n].ranks[0] != hot]
    rest_peak = max((state.load[r] for r in range(state.world) if r != hot), default=0.0)
    best = None
    for a in mine:
        pa = placements[a]
        ta = pa.option.piece_seconds
        for b in others:
            pb = placements[b]
            tb = pb.option.piece_seconds
            if tb >= ta:
                continue
            other = pb.ranks[0]
            new_hot, new_other = state.load[hot] - ta + tb, state.load[other] - tb + ta
            new_peak = max(new_hot, new_other, max((state.load[r] for r in range(state.world)
                                                    if r not in (hot, other)), default=0.0)) \
                if state.load[other] >= rest_peak else max(new_hot, new_other, rest_peak)
            if new_peak >= peak * (1 - 1e-9):
                continue
            new_a, new_b = Placement(pa.option, (other,)), Placement(pb.option, (hot,))
            state.apply(pa, -1)
            state.apply(pb, -1)
            ok = state.fits(other, pa.option) and state.fits(hot, pb.option)
            state.apply(pa, +1)
            state.apply(pb, +1)
            if ok and (best is None or new_peak < best[0][0]):
                best = ((new_peak, 0.0), (a, b), (new_a, new_b))
    return best
