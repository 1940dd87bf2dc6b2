"""``neorec plan``: plan the sharding of a model on a cluster and predict its speed.

    python -m neorec plan --model neo-model-f --topology zionex --out plan.json --chart load.png
    python -m neorec plan --model neo-model-a --topology zionex --nodes 4 --scaling
    python -m neorec plan --tables my_tables.json --topology dgx-h100 --batch-size 1024 --precisions fp32,fp16
    python -m neorec plan --calibrate                 # measure this machine for --topology local-cpu
    python -m neorec train --config configs/tiny.toml --nproc 2 --plan auto   # plan for the live world
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import List

from neorec.planner.names import MODEL_PRESET_NAMES, OPTIMIZERS, PRECISIONS, TIERS

MAX_RANK_ROWS = 16


def add_plan_parser(sub) -> argparse.ArgumentParser:
    plan = sub.add_parser(
        "plan", help="plan embedding sharding on a cluster (cost model + partitioner) and predict QPS",
        description="Choose, per embedding table, a sharding type (table/row/column-wise, data-parallel, "
        "table-row-wise, table-column-wise), a storage tier and a precision, and the ranks of every piece, "
        "minimising the slowest rank's iteration time under each rank's memory limits. Prints a per-rank "
        "table, the gap to a lower bound, the predicted iteration time and QPS; writes the ShardingPlan "
        "JSON (for `neorec train --plan FILE`), a report JSON and a PNG chart of per-rank load.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + "\n".join("  " + line.strip() for line in __doc__.strip().splitlines()[1:] if line.strip()),
    )
    what = plan.add_mutually_exclusive_group()
    what.add_argument("--model", choices=MODEL_PRESET_NAMES, help="a model preset")
    what.add_argument("--tables", metavar="FILE.json", help="a table-spec file (see neorec/planner/specs.py)")
    what.add_argument("--calibrate", action="store_true",
                      help="measure this machine (lookups, matmul, gloo all-to-all) for --topology local-cpu")
    plan.add_argument("--topology", default="zionex", metavar="NAME|FILE.json",
                      help="zionex (16 x 8 A100-40GB, default), dgx-h100, local-cpu (calibrated) or a topology JSON")
    plan.add_argument("--nodes", type=int, metavar="N", help="number of nodes (default: the preset's)")
    plan.add_argument("--batch-size", type=int, metavar="B", help="samples per rank (default: the model's)")
    plan.add_argument("--precisions", metavar="LIST",
                      help=f"allowed, preferred first, from {list(PRECISIONS)} (int8: row stores of cached tiers only; "
                      "default: the model's; fp32 for --tables)")
    plan.add_argument("--tiers", metavar="LIST",
                      help=f"allowed, preferred first, from {list(TIERS)} (default: the model's; device for --tables)")
    plan.add_argument("--optimizer", choices=OPTIMIZERS,
                      help="sparse optimizer, sets the state per row (default: the model's; rowwise_adagrad)")
    plan.add_argument("--comm-bytes", type=int, choices=(1, 2, 4),
                      help="bytes per pooled value on the wire (default: the model's; 4 for --tables)")
    plan.add_argument("--time-limit", type=float, default=10.0, metavar="S",
                      help="seconds for the search of a plan (bound-guided packing and improvement; default 10), "
                           "shared by its partitions; the preference pass after it may take as long again, "
                           "enumeration and the greedy starts are not counted, and --scaling plans each other node "
                           "count with its own limit")
    plan.add_argument("--out", metavar="FILE.json", help="write the ShardingPlan here")
    plan.add_argument("--report", metavar="FILE.json", help="write the full report (per rank, per table) here")
    plan.add_argument("--chart", metavar="FILE.png", help="write a PNG chart of per-rank load (needs matplotlib)")
    plan.add_argument("--scaling", action="store_true",
                      help="also simulate 1, 2, 4, ... nodes up to --nodes, and --nodes itself")
    plan.add_argument("--scale-model", action="store_true",
                      help="with --scaling: table rows grow with the node count (same bytes per rank at every size)")
    plan.add_argument("--all-ranks", action="store_true", help=f"print every rank (default: at most {MAX_RANK_ROWS})")
    plan.add_argument("--calibrate-ranks", type=int, default=2, metavar="N", help="ranks to calibrate for (default 2)")
    plan.add_argument("--calibration-out", metavar="FILE.json", help="where --calibrate writes (default: the cache)")
    return plan


def _count(n: int) -> str:
    """A parameter count for people: 30,400 / 12.5 million / 3.42 billion (not "B": bytes)."""
    if n >= 1e9:
        return f"{n / 1e9:,.2f} billion"
    if n >= 1e6:
        return f"{n / 1e6:,.1f} million"
    return f"{n:,}"


def _list(text: str, flag: str) -> tuple:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values:
        raise ValueError(f"plan: --{flag} {text!r} names nothing; give a comma-separated list")
    return values


def _scaling_counts(num_nodes: int) -> List[int]:
    """1, 2, 4, ... up to ``num_nodes``, and ``num_nodes`` itself."""
    counts, n = [], 1
    while n < num_nodes:
        counts.append(n)
        n *= 2
    return counts + [num_nodes]


def cmd_plan(args: argparse.Namespace) -> int:
    from neorec.planner.planner import plan_tables
    from neorec.planner.presets import get_model_preset
    from neorec.planner.simulate import scaling, simulate
    from neorec.planner.specs import load_table_specs
    from neorec.planner.topology import get_topology

    if args.calibrate:
        from neorec.planner.calibrate import calibrate

        _check_calibration_target(args.calibration_out)  # before measuring, not after
        calibrate(args.calibrate_ranks, args.calibration_out)
        return 0
    if args.model is None and args.tables is None:
        raise ValueError("plan: give --model PRESET or --tables FILE.json (or --calibrate); see --help")
    if args.nodes is not None and args.nodes < 1:
        raise ValueError(f"plan: --nodes must be >= 1, got {args.nodes}")
    if not args.time_limit >= 0:
        raise ValueError(f"plan: --time-limit must be >= 0 seconds, got {args.time_limit}")
    if args.scale_model and not args.scaling:
        raise ValueError("plan: --scale-model only changes the --scaling study; add --scaling")
    for flag in ("out", "report", "chart"):  # before the search, not after it
        _check_output_target(flag, getattr(args, flag))
    if args.chart:
        from neorec.planner.chart import check_matplotlib

        check_matplotlib()
    if args.model:
        preset = get_model_preset(args.model)
        tables, settings, dense = preset.tables, preset.settings, preset.dense
    else:
        from neorec.planner.cost_model import PlanSettings

        preset = None
        tables, dense, batch = load_table_specs(args.tables)
        settings = PlanSettings(batch_size=batch) if batch else PlanSettings()
    changes = {}
    if args.batch_size is not None:
        changes["batch_size"] = args.batch_size
    if args.precisions is not None:
        changes["precisions"] = _list(args.precisions, "precisions")
    if args.tiers is not None:
        changes["tiers"] = _list(args.tiers, "tiers")
    if args.optimizer:
        changes["optimizer"] = args.optimizer
    if args.comm_bytes:
        changes["comm_bytes"] = args.comm_bytes
    settings = dataclasses.replace(settings, **changes)
    topo = get_topology(args.topology, args.nodes)
    print(f"neorec plan: {len(tables)} tables ({_count(sum(t.num_parameters for t in tables))} parameters) on "
          f"{topo.name}: {topo.num_nodes} nodes x {topo.ranks_per_node} ranks, batch {settings.batch_size} per rank, "
          f"optimizer {settings.optimizer}, precisions {list(settings.precisions)}, tiers {list(settings.tiers)}",
          flush=True)
    result = plan_tables(tables, topo, settings, time_limit=args.time_limit)
    sim = simulate(result, dense)
    _print_ranks(result, args.all_ranks)
    kinds: dict = {}
    for p in result.placements.values():
        kinds[p.option.describe()] = kinds.get(p.option.describe(), 0) + 1
    print("options: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])))
    print(f"slowest rank {result.makespan * 1e3:.3f} ms, lower bound {result.lower_bound * 1e3:.3f} ms "
          f"(gap {result.gap * 100:.1f}%), greedy start {result.greedy_makespan * 1e3:.3f} ms, "
          f"{result.partition.rounds} search rounds")
    print(f"predicted iteration {sim.iteration_seconds * 1e3:.2f} ms ({sim.qps:,.0f} QPS) without pipelining, "
          f"{sim.pipelined_iteration_seconds * 1e3:.2f} ms ({sim.pipelined_qps:,.0f} QPS) pipelined")
    if preset is not None and preset.paper_qps:
        print(f"paper ({preset.name}, 16 ZionEX nodes): {preset.paper_qps:,.0f} QPS; predicted / paper = "
              f"{sim.pipelined_qps / preset.paper_qps:.2f} (only meaningful on --topology zionex, 16 nodes)")
    report = result.to_report()
    report["simulation"] = sim.to_dict()
    if args.out:
        result.plan.save(args.out)
        print(f"sharding plan: {args.out}")
        problem = result.plan.training_precision_problem()
        if problem is not None:  # (a plan to read, which neorec train would refuse with this)
            print(f"note: neorec train refuses this plan: {problem.removeprefix('sharding plan: ')}")
        if topo.world_size == 1:  # (neorec train --plan refused it: "--plan needs several processes")
            print("note: neorec train takes no plan on one process (--plan needs --nproc 2 or more, or torchrun): "
                  "this plan of one rank is for reading")
        problem = result.plan.gpu_training_problem() if not topo.unified_memory else None
        if problem is not None:
            print(f"note: neorec train on GPUs refuses this plan: {problem}")
    if args.report:
        _write_report(args.report, report)
        print(f"report: {args.report}")
    if args.chart:
        from neorec.planner.chart import write_load_chart

        write_load_chart(result, args.chart)
        print(f"chart: {args.chart}")
    if args.scaling:  # after the files: a size the model does not fit is a row, not an error
        rows = scaling(tables, topo, settings, dense, _scaling_counts(int(topo.num_nodes)),
                       time_limit=args.time_limit, scale_model=args.scale_model, planned=result)
        print("nodes  ranks  iteration ms (pipelined)         QPS   efficiency")
        for row in rows:
            if "error" in row:
                print(f"{row['nodes']:>5}  {row['ranks']:>5}  does not fit: {row['error']}")
            else:
                print(f"{row['nodes']:>5}  {row['ranks']:>5}  {row['pipelined_iteration_ms']:>24.2f}  "
                      f"{row['pipelined_qps']:>10,.0f}   {row['efficiency']:.2f}")
        if args.report:
            report["scaling"] = rows
            _write_report(args.report, report)
    return 0


def _write_report(path: str, report: dict) -> None:
    from neorec.files import write_atomic

    write_atomic(Path(path), json.dumps(report, indent=1) + "\n")


def _print_ranks(result, all_ranks: bool) -> None:
    ranks = result.ranks()
    shown = ranks
    if not all_ranks and len(ranks) > MAX_RANK_ROWS:
        order = sorted(ranks, key=lambda r: -r.cost.total)
        half = MAX_RANK_ROWS // 2  # (the slowest half and the fastest half; "-MAX_RANK_ROWS // 4" showed 8 + 4)
        shown = sorted(order[:half] + order[-half:], key=lambda r: r.rank)
    gib = 2 ** 30
    print(f"{'rank':>5} {'pieces':>6} {'device GiB':>10} {'host GiB':>9} {'ssd GiB':>8} {'compute ms':>10} "
          f"{'comm ms':>8} {'total ms':>9}")
    for r in shown:
        print(f"{r.rank:>5} {r.num_pieces:>6} {r.memory.device / gib:>10.2f} {r.memory.host / gib:>9.2f} "
              f"{r.memory.ssd / gib:>8.2f} {r.cost.compute * 1e3:>10.3f} {r.cost.comm * 1e3:>8.3f} "
              f"{r.cost.total * 1e3:>9.3f}")
    if len(shown) < len(ranks):
        print(f"({len(shown)} of {len(ranks)} ranks: the slowest and the fastest; --all-ranks prints all)")


def _check_output_target(flag: str, target) -> None:
    """``--out``, ``--report`` or ``--chart`` can be written: a directory, a folder that does not
    exist (it is not made), is a file or cannot be written in, is said before the search, not as a
    raw errno after it."""
    if not target:
        return
    from neorec.files import ensure_writable_dir

    path = Path(target)
    if path.is_dir():
        raise ValueError(f"plan: --{flag} {target} is a directory; give a file name")
    if not path.resolve().parent.exists():
        raise ValueError(f"plan: --{flag} {target}: its directory {path.parent} does not exist")
    ensure_writable_dir(path.parent, f"plan: --{flag} {target}: its folder")  # exists: probed, not made


def _check_calibration_target(out) -> None:
    """The file ``--calibrate`` will write (``--calibration-out``, else the default place) can be
    written: a directory, or a folder that cannot be made or written, is said before measuring."""
    import os

    from neorec.files import ensure_writable_dir
    from neorec.planner.topology import default_calibration_path

    path = Path(out) if out else default_calibration_path()
    given = "--calibration-out" if out else ("NEOREC_CALIBRATION" if os.environ.get("NEOREC_CALIBRATION")
                                             else "the default place")
    if path.is_dir():
        raise ValueError(f"plan: {given} {path} is a directory; give a file name")
    try:
        ensure_writable_dir(path.parent, f"the folder of the calibration {path} ({given}),")
    except ValueError as exc:
        raise ValueError(f"plan: {exc}; give --calibration-out FILE or set NEOREC_CALIBRATION") from None


NOMINAL_SSD_BANDWIDTH = 1e9  # bytes/s of an SSD the topology does not describe (--plan auto with cached_ssd tables)


def gpu_training_topology(world_size: int, ranks_per_node: int, out=None):
    """The topology ``--plan auto`` plans for on GPUs: this GPU's memory, this machine's host
    memory, no SSD (``plan_for_training`` takes the SSD folder's free space when a table is cached
    over SSD), and the bandwidths of the preset of its kind (A100: zionex, otherwise dgx-h100, said
    when the kind is not an H100/H200)."""
    import dataclasses

    import torch

    from neorec.planner.calibrate import host_memory_bytes
    from neorec.planner.topology import dgx_h100, zionex

    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = str(properties.name)
    preset = zionex() if "A100" in name else dgx_h100()
    if not any(kind in name for kind in ("A100", "H100", "H200")):
        print(f"planner: no preset for {name}: bandwidths as the {preset.name} preset's, memory as this GPU's "
              f"(or plan with `neorec plan --topology ... --out plan.json` and pass --plan plan.json)",
              file=out if out is not None else sys.stderr, flush=True)
    return dataclasses.replace(preset, name=f"local-gpu ({name})", device_memory_bytes=float(properties.total_memory),
                               host_dram_bytes=host_memory_bytes(), ssd_bytes=0.0,
                               num_nodes=world_size // ranks_per_node, ranks_per_node=ranks_per_node)


GPU_RESERVE_FRACTION = 0.15  # of a GPU's memory, kept out of --plan auto's tables (as `neorec plan` keeps)


def plans_for_gpu(device: str) -> bool:
    """Whether ``--plan auto`` plans for a GPU: ``train.device`` cuda, or auto with one present."""
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def training_topology(world_size: int, ranks_per_node: int, out=None, device: str = "cpu"):
    """The topology ``--plan auto`` plans for: on GPUs ``gpu_training_topology``; on the CPU the
    local-cpu calibration when it exists, else nominal CPU numbers. A calibration made for another
    number of ranks per node keeps the machine's memory (each rank gets its share of the same
    memory; it used to keep the memory per rank and overcommit the machine) and says that its
    bandwidths were measured for that number."""
    import dataclasses

    from neorec.planner.topology import Topology, default_calibration_path

    if world_size % ranks_per_node:  # (torchrun agents with different --nproc-per-node)
        raise ValueError(f"--plan auto plans for nodes of equal size, but this rank's node runs {ranks_per_node} of the "
                         f"{world_size} ranks (LOCAL_WORLD_SIZE): make a plan for this world with `neorec plan "
                         f"--topology FILE --out plan.json` and pass --plan plan.json")
    if plans_for_gpu(device):
        return gpu_training_topology(world_size, ranks_per_node, out)

    path = default_calibration_path()
    if not path.is_file():  # nominal: a few GB/s of lookups, sub-GB/s gloo over loopback (`neorec plan --calibrate`)
        from neorec.planner.calibrate import host_memory_bytes

        memory = host_memory_bytes()  # shared as a calibration shares it: half of a rank's share for its tables
        return Topology("local-cpu-nominal", world_size // ranks_per_node, ranks_per_node, memory / ranks_per_node / 2,
                        3e9, 0.0, 3e9, 0.0, 0.0, 0.5e9, 0.5e9, 50e9, 500e-6, unified_memory=1)
    calibrated = dataclasses.replace(Topology.load(path), unified_memory=1)
    topo = calibrated.with_world(world_size, ranks_per_node)
    measured = int(calibrated.ranks_per_node)
    if measured != ranks_per_node:
        topo = dataclasses.replace(topo, device_memory_bytes=calibrated.device_memory_bytes * measured / ranks_per_node)
        print(f"planner: the calibration {path} was made for {measured} ranks per node, this run has "
              f"{ranks_per_node}: memory per rank scaled to match, bandwidths as measured for {measured} "
              f"(`neorec plan --calibrate --calibrate-ranks {ranks_per_node}` measures them)",
              file=out if out is not None else sys.stderr, flush=True)
    return topo


def plan_for_training(cfg, source, world_size: int, ranks_per_node: int):
    """``neorec train --plan auto``: plan the config's tables for the live world. Pooling factors
    come from the first training batch; the topology from this GPU (``gpu_training_topology``), or on
    the CPU from the local-cpu calibration when it exists, else nominal CPU numbers with this
    machine's memory. Each table is planned where ``[embedding.location]`` puts it (its tier; a
    cached tier at its store's precision and the section's cache fraction, on the SSD's free space
    when the topology has no SSD), so a table placed off the device no longer needs room on it.
    Deterministic (a fixed number of search rounds, no time limit); training runs it on rank 0
    and sends the plan to the others."""
    import shutil

    from neorec.planner.cost_model import PlanSettings, TableSpec
    from neorec.planner.enumerate import STEP_BUFFERS, InfeasiblePlanError, format_bytes
    from neorec.planner.planner import plan_tables
    from neorec.sharding.plan import CACHED_TIERS
    from neorec.train.build import ssd_dir_of

    location = cfg.embedding.location
    configs = source.tables(cfg.model.embedding_dim, cfg.model.pooling)
    batch = next(iter(source.train_batches(cfg.data.batch_size, 0)))
    per_key = dict(zip(batch.sparse.keys(), batch.sparse.length_per_key()))
    size = max(1, batch.sparse.batch_size)
    tables: List[TableSpec] = []
    for t in configs:
        tier = location.kind_of(t)
        precision = location.precision if tier in CACHED_TIERS else cfg.embedding.storage.precision
        tables.append(TableSpec(t.name, t.num_embeddings, t.embedding_dim,
                                max(1e-3, sum(per_key.get(f, 0) for f in t.feature_names) / size),
                                tiers=(tier,), precisions=(precision,)))
    tiers = tuple(tier for tier in TIERS if tier == "device" or any(tier in t.tiers for t in tables))
    precisions = tuple(dict.fromkeys([cfg.embedding.storage.precision, *(t.precisions[0] for t in tables)]))
    topo = training_topology(world_size, ranks_per_node, device=cfg.train.device)
    if "cached_ssd" in tiers and topo.ssd_bytes <= 0:  # no SSD in the topology: the store folder's free space
        folder = Path(ssd_dir_of(cfg)).resolve()
        while not folder.exists():
            folder = folder.parent
        topo = dataclasses.replace(topo, ssd_bytes=float(shutil.disk_usage(folder).free),
                                   ssd_bandwidth=topo.ssd_bandwidth or NOMINAL_SSD_BANDWIDTH)
    settings = PlanSettings(batch_size=cfg.data.batch_size, optimizer=cfg.embedding.optimizer.kind,
                            precisions=precisions, tiers=tiers, cache_fraction=location.cache_fraction,
                            cache_rows=location.cache_rows, cache_ways=location.ways, cache_policy=location.policy,
                            # a GPU also holds its context, the dense parameters and the activations
                            # (the default share); a CPU topology gives tables half a rank's memory already
                            device_reserve_fraction=(GPU_RESERVE_FRACTION if plans_for_gpu(cfg.train.device)
                                                     else 0.0))
    try:
        result = plan_tables(tables, topo, settings, time_limit=float("inf"), max_rounds=200)
    except InfeasiblePlanError as exc:
        if STEP_BUFFERS in str(exc):  # (other tiers would not help: they are the step's buffers)
            raise InfeasiblePlanError(f"{exc}. --plan auto plans with data.batch_size = {cfg.data.batch_size} per "
                                      "rank: lower it (--set data.batch_size=N)") from None
        raise InfeasiblePlanError(
            f"{exc}. --plan auto plans each table where [embedding.location] puts it, on topology {topo.name!r} "
            f"({format_bytes(topo.device_memory_bytes)} of device memory per rank for tables); put large tables "
            f"off the device there (e.g. --set \"embedding.location.default='cached_ssd'\" --set "
            f"embedding.location.min_rows=N), or let the planner choose tiers: `neorec plan --tiers "
            f"device,cached_dram,cached_ssd ... --out plan.json`, then --plan plan.json") from None
    return result.plan
