"""The ``neorec`` command line.

    neorec train                                   # default config, built-in synthetic data
    neorec train --config configs/movielens.toml --set train.epochs=3
    neorec train --config configs/tiny.toml --nproc 2              # 2 local ranks, sharded embeddings
    torchrun --nproc-per-node 2 -m neorec train --plan plan.json   # or started by torchrun
    neorec train --config configs/tiny.toml --nproc 2 --plan auto  # cost-model planner for the live world
    neorec plan --model neo-model-f --topology zionex --out plan.json --chart load.png
    neorec config --config configs/default.toml    # print the resolved config
    neorec data write-criteo /tmp/day_0.tsv --lines 100000
    neorec data preprocess-criteo /tmp/day_0.tsv --num-embeddings 100000   # optional: train does it
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shlex
import signal
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import List, Optional, Sequence

EXIT_USAGE = 2  # the command as given cannot run: bad option, config, input file or folder
EXIT_FAILED = 1  # it ran and failed: training diverged (non-finite loss), an unforeseen error
_FAILED_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO)  # OSErrors of a run that failed (a full disk)


def _config_keys_help() -> str:
    from neorec.config import iter_config_keys

    keys = list(iter_config_keys())
    key_width = max(len(key) for key, _, _ in keys)
    type_width = max(len(type_name) for _, type_name, _ in keys)
    lines = ["config keys (TOML tables / --set section.key=value), with defaults:"]
    for key, type_name, default in keys:
        lines.append(f"  {key:<{key_width}}  {type_name:<{type_width}}  {default!r}")
    return "\n".join(lines)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="FILE.toml",
        help="TOML config file (see configs/); its values override the defaults listed below",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config value, read as TOML (e.g. --set train.max_steps=200 "
        "--set model.dense_layers=[128,16] --set data.source=movielens); repeatable, "
        "applied after --config",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neorec",
        description="neorec: train deep learning recommendation models (DLRM) with fused, "
        "table-batched embeddings (after Meta's Neo).",
    )
    parser.add_argument("--traceback", action="store_true",
                        help="show the full Python traceback on errors (for bug reports); "
                        "NEOREC_TRACEBACK=1 in the environment does the same")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.command_parsers = sub.choices  # {command: its parser}: an unknown argument is said with its usage
    parser.command_dest = "command"

    train = sub.add_parser(
        "train", help="train a DLRM and report eval AUC, NE and QPS",
        description="Train a DLRM on one process, or with sharded embeddings on N local processes "
        "(--nproc N) or under torchrun. Without --config it trains the default model on "
        "built-in synthetic data (no download). Prints progress with loss and QPS, evaluates "
        "NE / AUC / calibration, and writes OUTPUT_DIR/metrics.jsonl and OUTPUT_DIR/config.json.",
        epilog=_config_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(train)
    train.add_argument("--max-steps", type=int, metavar="N",
                       help="stop at step N, counted from the run's start: a run resumed at step 50 with "
                       "--max-steps 70 trains 20 more (same as --set train.max_steps=N)")
    train.add_argument("--output-dir", metavar="DIR",
                       help="where metrics.jsonl and config.json go (same as --set train.output_dir=...)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and CI)")
    train.add_argument("--no-pipeline", action="store_true",
                       help="plain training loop: no overlap of the next batch's loading, input all-to-all "
                       "and cache prefetch with the current step (same as --set train.pipeline=false; "
                       "results are the same bit for bit either way)")
    train.add_argument("--profile", action="store_true",
                       help="time each step's phases (data loading, input dist, lookup, dense forward, "
                       "output dist, backward, optimizer, exposed communication); print the table and "
                       "write OUTPUT_DIR/timeline.json (same as --set train.profile=true)")
    train.add_argument("--nproc", type=int, metavar="N",
                       help="train on N local processes (sharded embeddings, data-parallel MLPs; "
                       "data.batch_size is per process); under torchrun the world comes from torchrun")
    train.add_argument("--plan", metavar="FILE.json|auto",
                       help="sharding plan for multi-process training: a plan file (from `neorec plan --out`; "
                       "its tables' storage tiers place them, with [embedding.location]'s cache settings), "
                       "or 'auto' to run the cost-model planner for the live world, each table in the tier "
                       "[embedding.location] gives it "
                       "(default: a balanced table-wise / row-wise plan)")
    train.add_argument("--resume", metavar="DIR",
                       help="continue from a checkpoint, data position included, on any world size or plan: "
                       "DIR is a checkpoint.dir (its newest complete checkpoint) or one step-N directory in "
                       "it (that checkpoint, refused if incomplete or corrupt). Save "
                       "checkpoints with --set checkpoint.dir='\"DIR\"' --set checkpoint.every_steps=N")

    config = sub.add_parser(
        "config", help="print the resolved config as JSON (defaults + --config + --set)",
        description="Print the config a `neorec train` with the same --config and --set would use, "
        "as JSON, after checking every key and type. Nothing is trained.",
        epilog=_config_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(config)

    from neorec.planner.cli import add_plan_parser

    add_plan_parser(sub)

    data = sub.add_parser(
        "data", help="data tools: write and preprocess Criteo TSV",
        description="Data tools for the Criteo source: write learnable synthetic data in the raw "
        "Criteo TSV layout (no download needed), and preprocess a TSV into the binary form training "
        "reads. `neorec data DATA_COMMAND --help` describes each.",
    )
    data_sub = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    data.command_parsers, data.command_dest = data_sub.choices, "data_command"
    write = data_sub.add_parser(
        "write-criteo", help="write synthetic click data in the raw Criteo TSV layout",
        description="Write LINES lines of learnable synthetic data in the raw Criteo TSV layout "
        "(label, 13 integer columns, 26 hexadecimal categorical columns, empty = missing).",
    )
    write.add_argument("path", help="output .tsv file")
    write.add_argument("--lines", type=int, default=100_000, help="number of lines (default 100000)")
    write.add_argument("--seed", type=int, default=0,
                       help="which dataset (default 0): the hidden model that labels it, its ids; a file of "
                       "another seed is another dataset, no held-out set for this one")
    write.add_argument("--held-out", action="store_true",
                       help="write held-out lines of the seed's dataset, which no file written without "
                       "--held-out holds: the file for `preprocess-criteo --eval-tsv` or "
                       "data.criteo.eval_path (without it: the dataset's first LINES lines)")
    prep = data_sub.add_parser(
        "preprocess-criteo", help="convert a Criteo TSV into neorec's memory-mapped binary form",
        description="Stream a raw Criteo TSV file into binary memory-mapped arrays (dense log(1 + max(x, 0)), "
        "categorical ids hashed into NUM_EMBEDDINGS rows) where `neorec train` looks for them: "
        "PROCESSED_DIR/train (and PROCESSED_DIR/eval for --eval-tsv), PROCESSED_DIR being "
        "data.criteo.processed_dir (default: TSV.neorec beside the file). Training does this "
        "itself on first use; running it first only moves the work. Memory stays bounded whatever "
        "the file size. A malformed line stops with its line number unless --skip-malformed.",
    )
    prep.add_argument("tsv", help="input Criteo TSV file (data.criteo.train_path)")
    prep.add_argument("processed_dir", nargs="?", default=None,
                      help="output directory, the data.criteo.processed_dir to train with "
                      "(default: TSV.neorec)")
    prep.add_argument("--eval-tsv", metavar="TSV", default=None,
                      help="also preprocess this held-out file (data.criteo.eval_path)")
    prep.add_argument("--num-embeddings", type=int, default=100_000,
                      help="rows per categorical table, ids are hashed into it; must equal "
                      "data.criteo.num_embeddings when training (default 100000)")
    prep.add_argument("--skip-malformed", action="store_true",
                      help="count and skip malformed lines instead of stopping")
    for command in [*sub.choices.values(), *data_sub.choices.values()]:  # also after the command
        command.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                             help="show the full Python traceback on errors (for bug reports)")
    return parser


def _load(args: argparse.Namespace, extra: Sequence[str] = ()):
    from neorec.config import load_config

    return load_config(args.config, list(args.overrides) + list(extra), check_data=True)


def cmd_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from neorec.train.distributed import launched_by_torchrun
    from neorec.train.launch import Terminated, started_by_a_launcher

    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.nproc is not None and not started_by_a_launcher():
            raise ValueError(f"--nproc {args.nproc}, but RANK={os.environ['RANK']} and WORLD_SIZE={world} are set in "
                             "the environment and no launcher started this process: unset RANK and WORLD_SIZE "
                             "for --nproc to start the ranks, or drop --nproc when another launcher starts them")
        if args.nproc is not None and args.nproc != world:
            raise ValueError(f"--nproc {args.nproc} but the launcher started WORLD_SIZE={world} processes")
        return _train_distributed(args)
    if args.nproc is not None and args.nproc > 1:
        from neorec.train.launch import launch_local

        cfg, plan = _config_and_plan(args, args.nproc, args.nproc)  # said once, before N ranks start and each says it
        _check_before_launch(cfg, plan, args)
        try:
            return launch_local(args.nproc, list(argv))
        except (KeyboardInterrupt, Terminated):  # the ranks are stopped; say where to go on from; _main says why
            print(f"neorec train: {_saved_checkpoint_hint(cfg.checkpoint.dir, args.resume)}", file=sys.stderr)
            raise
    if args.plan is not None:
        raise ValueError("--plan needs several processes: --nproc 2 or more, or start with torchrun")
    from neorec.train.trainer import Trainer

    cfg = _train_config(args)
    trainer = Trainer(cfg, resume=args.resume)
    _print_header(cfg, trainer)
    with _terminate_raises():
        try:
            result = trainer.fit()
        except (KeyboardInterrupt, Terminated):  # say where it stopped; _main says why, and exits
            print(f"neorec train: stopped after step {trainer.step}{_resume_hint(trainer)}", file=sys.stderr)
            raise
        except BrokenPipeError:  # `neorec train | tee log` and tee died: not a silent stop
            print(f"neorec train: standard output was closed (its reader went away); stopped after step "
                  f"{trainer.step}{_resume_hint(trainer)}", file=sys.stderr)
            raise
    trainer.close()  # its row stores flushed and unlocked
    _print_result(result)
    return 0


@contextlib.contextmanager
def _terminate_raises():
    """SIGTERM / SIGHUP raise ``Terminated`` in a single-process run (as Ctrl-C raises
    KeyboardInterrupt), so that it ends through the same report instead of dying silently."""
    from neorec.train.launch import _raise_terminated

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_terminated) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _resume_hint(trainer) -> str:
    checkpointer = trainer.checkpointer
    if checkpointer is None or checkpointer.root is None:
        return " (no checkpoints: set checkpoint.dir to be able to resume)"
    # the folder too: a stop between a checkpoint's manifest and the end of its save said "none yet";
    # and a run resumed from elsewhere that saved nothing yet goes on from that checkpoint
    last = checkpointer.go_on_from()
    if last is None:
        return " (no checkpoint saved yet)"
    return f"; its last checkpoint is of step {last[0]}: --resume {last[1]} goes on from there"


def _check_before_launch(cfg, plan, args: argparse.Namespace) -> None:
    """What every rank would refuse alike, said once by the launcher: missing data files, a
    missing --resume, prefetch of cached rows (single-process only), and, with a plan file or
    --resume, what needs the tables' sizes: rows or columns of a table no shard covers, a
    checkpoint of other tables or optimizers, or an epoch position the new batches cannot continue."""
    from neorec.embedding.locations import PREFETCH_SINGLE_PROCESS
    from neorec.sharding import ShardingPlan

    cfg.data.check_inputs_exist()
    if args.resume and not Path(args.resume).exists():
        raise ValueError(f"--resume: {args.resume} does not exist")
    location = cfg.embedding.location
    if location.prefetch and any(location.known_kind(name) not in (None, "device") for name in cfg.data.table_names()):
        raise ValueError(PREFETCH_SINGLE_PROCESS)
    check_gpus_for_ranks(cfg.train.device, args.nproc)
    if isinstance(plan, ShardingPlan) or args.resume:
        from neorec.data import make_data_source
        from neorec.planner.names import TIERS
        from neorec.train.checkpoint_manifest import check_resume_before_launch

        source = make_data_source(cfg.data)  # (the ranks build it again: small next to their model)
        if isinstance(plan, ShardingPlan):
            try:
                plan.validate(source.tables(cfg.model.embedding_dim, cfg.model.pooling), args.nproc, tiers=TIERS)
            except ValueError as exc:
                raise ValueError(f"{exc} ({args.plan})") from None
        if args.resume:
            check_resume_before_launch(Path(args.resume), cfg, source, args.nproc)


def check_gpus_for_ranks(device: str, nproc: int) -> None:
    """``--nproc N`` ranks all see the launcher's GPUs: on CUDA each needs one of its own, and a
    device the ranks cannot have is said once here rather than by each of them."""
    import torch

    from neorec.train.distributed import no_cuda_message

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(no_cuda_message())
    if device in ("cuda", "auto") and torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ValueError(f"--nproc {nproc} but {torch.cuda.device_count()} CUDA device(s) visible: each rank needs a "
                         f"GPU of its own (--nproc {torch.cuda.device_count()}, more GPUs through "
                         "CUDA_VISIBLE_DEVICES, or train.device = 'cpu')")


def _saved_checkpoint_hint(root: str, resumed: Optional[str] = None) -> str:
    """Where a stopped multi-process run can go on from: its newest checkpoint under ``root``
    (else the ``--resume`` it started from)."""
    from neorec.train.checkpoint_manifest import newest_saved_step

    if not root:
        return "no checkpoints (set checkpoint.dir to be able to resume)"
    step = newest_saved_step(Path(root))
    if step is None:
        again = f"; --resume {resumed} starts again from where it started" if resumed else ""
        return f"no checkpoint saved yet in {root}{again}"
    return f"its newest checkpoint is of step {step}: --resume {root} goes on from there"


def _config_and_plan(args: argparse.Namespace, world: int, ranks_per_node: int):
    """(config, plan) of a run of ``world`` processes, ``ranks_per_node`` on each node: the plan
    file loaded and checked against the world and the config's table names (``--plan auto`` and no
    plan stay as given; the ranks check the rest once they know the tables' sizes)."""
    from neorec.embedding.locations import PREFETCH_SINGLE_PROCESS
    from neorec.sharding import ShardingPlan
    from neorec.sharding.validation import check_plan_nodes, check_plan_pieces, check_plan_tables

    cfg = _train_config(args)
    plan = ShardingPlan.load(args.plan) if args.plan and args.plan != "auto" else args.plan
    if isinstance(plan, ShardingPlan):
        try:
            if plan.world_size != world:
                raise ValueError(f"sharding plan: written for world_size {plan.world_size}, but the world has "
                                 f"{world} ranks; make a plan for {world} ranks")
            check_plan_pieces(plan, world)
            check_plan_nodes(plan, ranks_per_node)
            check_plan_tables(plan, cfg.data.table_names())
            plan.check_replicas_on_device().check_precision(cfg.embedding.storage.precision)
            replicas_off = [name for name, entry in plan.tables.items() if entry.sharding_type.value == "data_parallel"
                            and cfg.embedding.location.known_kind(name) not in (None, "device")]
            if replicas_off:  # (a location that depends on a table's rows: the ranks refuse it)
                raise ValueError(f"sharding plan: data-parallel tables {replicas_off} are placed off the device by "
                                 f"[embedding.location]; every rank would hold a whole replica in a store of its own: "
                                 f"keep them on the device (embedding.location.tables) or shard them another way")
            if cfg.embedding.location.prefetch and plan.tiers_off_device():
                raise ValueError(PREFETCH_SINGLE_PROCESS)
        except ValueError as exc:
            raise ValueError(f"{exc} ({args.plan})") from None
    return cfg, plan


def _train_distributed(args: argparse.Namespace) -> int:
    from neorec.train.distributed import DistributedContext

    world = int(os.environ["WORLD_SIZE"])
    cfg, plan = _config_and_plan(args, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))  # before joining
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:  # RANK and WORLD_SIZE left in a shell: torch would only say that MASTER_ADDR is expected
        raise ValueError(f"RANK={os.environ['RANK']} and WORLD_SIZE={world} are set in the environment but "
                         f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: no launcher started "
                         "this process; unset RANK and WORLD_SIZE to train in one process, or start the ranks "
                         "with torchrun or --nproc")
    context = DistributedContext.from_env(cfg.train.device)
    try:
        result = _fit_distributed(cfg, context, plan, args.resume)  # the model is gone before the groups close
        if context.is_main:
            _print_result(result)
    finally:
        context.close()
    return 0


def _plan_on_rank_0(context, make_plan) -> str:
    """The plan JSON of ``make_plan()`` run on rank 0 alone, on every rank (ranks of other nodes
    may see other calibration files: planning on each would give different plans). A planning
    error on rank 0 is raised on every rank, so none waits for a plan that never comes."""
    from neorec.train.distributed import broadcast_text

    group, device = context.embedding_group, context.device
    if not context.is_main:
        text = broadcast_text(None, group, device)
        if text.startswith("error:"):
            raise ValueError(f"rank 0 could not plan: {text[len('error:'):]}")
        return text
    try:
        text = make_plan()
    except Exception as exc:
        broadcast_text(f"error:{exc}", group, device)
        raise
    return broadcast_text(text, group, device)


def _fit_distributed(cfg, context, plan, resume=None):
    from neorec.train.trainer import Trainer

    source = None
    if plan == "auto":  # the cost-model planner for this world, run on rank 0 and sent to the others
        from neorec.data import make_data_source
        from neorec.planner.cli import plan_for_training
        from neorec.sharding.plan import ShardingPlan

        source = make_data_source(cfg.data)
        plan = _plan_on_rank_0(context, lambda: plan_for_training(cfg, source, context.world_size,
                                                                  context.local_world_size).to_json())
        plan = ShardingPlan.from_json(plan)
    trainer = Trainer(cfg, source=source, distributed=context, plan=plan, resume=resume)
    if context.is_main:
        _print_header(cfg, trainer)
        kinds: dict = {}
        for entry in trainer.plan.tables.values():
            kinds[entry.sharding_type.value] = kinds.get(entry.sharding_type.value, 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        print(f"distributed: {context.world_size} ranks ({context.backend}), local batch "
              f"{cfg.data.batch_size}, global batch {cfg.data.batch_size * context.world_size}; "
              f"tables: {summary}", flush=True)
    result = trainer.fit()
    trainer.close()  # its row stores flushed and unlocked
    return result


def _train_config(args: argparse.Namespace):
    from neorec.config import toml_string

    extra: List[str] = []
    if args.max_steps is not None:
        if args.max_steps < 0:  # said as the option, not as the --set it becomes
            raise ValueError(f"--max-steps must be >= 0 (0 = no limit), got {args.max_steps}")
        extra.append(f"train.max_steps={args.max_steps}")
    if args.output_dir is not None:
        extra.append(f"train.output_dir={toml_string(args.output_dir)}")
    if args.no_progress:
        extra.append("train.progress=false")
    if args.no_pipeline:
        extra.append("train.pipeline=false")
    if args.profile:
        extra.append("train.profile=true")
    return _load(args, extra)


def _print_header(cfg, trainer) -> None:
    num_params = sum(t.num_embeddings * t.embedding_dim for t in trainer.source.tables(
        cfg.model.embedding_dim, cfg.model.pooling))
    print(f"neorec train: data={cfg.data.source} ({trainer.source.num_train_samples():,} train samples), "
          f"{len(trainer.source.feature_names)} sparse features, {num_params:,} embedding parameters, "
          f"optimizer={cfg.embedding.optimizer.kind}, precision={cfg.embedding.storage.precision}, "
          f"device={trainer.device}, embedding kernel={_kernel_summary(trainer.model)}", flush=True)
    if trainer.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        warnings.warn("TRITON_INTERPRET is set: the Triton kernels run in triton's CPU interpreter, very slowly "
                      "(it is for tests without a GPU); unset it for GPU training")


def _kernel_summary(model) -> str:
    """What runs the embedding lookups of ``model`` (its fused modules' paths, and why "auto" fell
    back to torch ops where it did)."""
    from neorec.embedding.kernel_choice import kernel_summary
    from neorec.embedding.tbe import TableBatchedEmbeddingBags

    paths = list(dict.fromkeys(kernel_summary(m) for m in model.modules() if isinstance(m, TableBatchedEmbeddingBags)))
    return ", ".join(paths) if paths else "none on this rank"


def _print_result(result) -> None:
    m = result.final_eval
    if not m:
        print("final eval: none (the eval set is empty)")
    else:
        print(f"final eval: AUC {m['auc']:.4f}  NE {m['ne']:.4f}  calibration {m['calibration']:.3f}  "
              f"log loss {m['log_loss']:.4f}  ({int(m['num_samples']):,} samples)")
    resumed = f" ({result.steps - result.first_step:,} after resuming at step {result.first_step:,})" \
        if result.first_step else ""
    print(f"training: {result.steps:,} steps{resumed}, {result.samples:,} samples in {result.train_seconds:.1f} s, "
          f"QPS {result.qps:,.0f} samples/s")
    if result.cache:
        print("embedding cache: " + "; ".join(
            f"{name} hit rate {c['hit_rate']:.1%} of {c['lookups']:,} lookups, {c['evictions']:,} evictions, "
            f"{c['write_backs']:,} write-backs" if c["lookups"] else f"{name} no lookups"
            for name, c in result.cache.items()))
    if result.metrics_path:
        print(f"metrics log: {result.metrics_path}", flush=True)


def cmd_config(args: argparse.Namespace) -> int:
    print(_load(args).to_json())
    return 0


def cmd_data(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.data_command is None:  # `neorec data` alone: its commands' usage, as `neorec` alone does
        parser.command_parsers["data"].print_help()
        return EXIT_USAGE
    from neorec.config import toml_string
    from neorec.data import criteo

    if args.data_command == "write-criteo":
        for option, value in (("--lines", args.lines), ("--seed", args.seed)):  # named as the options
            if value < 0:
                raise ValueError(f"{option} must be >= 0, got {value}")
        criteo.write_criteo_tsv(args.path, num_lines=args.lines, seed=args.seed, held_out=args.held_out)
        print(f"wrote {args.lines:,} {'held-out ' if args.held_out else ''}lines to {args.path}")
        return 0
    if args.data_command == "preprocess-criteo":
        if args.num_embeddings < 2:
            raise ValueError(f"--num-embeddings must be >= 2 (row 0 holds missing values), got {args.num_embeddings}")
        processed = args.processed_dir or f"{args.tsv}.neorec"
        sets = [f"data.criteo.train_path={toml_string(args.tsv)}"]
        for tsv, split in [(args.tsv, "train"), (args.eval_tsv, "eval")]:
            if tsv is None:
                continue
            out = os.path.join(processed, split)
            stats = criteo.preprocess_criteo(tsv, out, num_embeddings=args.num_embeddings,
                                             skip_malformed=args.skip_malformed)
            skipped = f", {stats.num_skipped:,} malformed lines skipped" if stats.num_skipped else ""
            print(f"preprocessed {tsv} -> {out}: {stats.num_rows:,} rows of {stats.num_lines:,} lines"
                  f"{skipped} ({stats.num_bytes / 2**20:,.1f} MiB read in {stats.seconds:.1f} s)")
            for example in stats.skipped_examples:
                print(f"  skipped {example}")
            if stats.num_rows == 0:  # training on it would stop at "has no training rows"
                raise ValueError(f"{tsv} holds no rows ({'every line is malformed' if stats.num_lines else 'empty'}):"
                                 f" nothing to {'train' if split == 'train' else 'evaluate'} on")
        if args.eval_tsv is not None:
            sets.append(f"data.criteo.eval_path={toml_string(args.eval_tsv)}")
        if args.processed_dir is not None:
            sets.append(f"data.criteo.processed_dir={toml_string(args.processed_dir)}")
        sets.append(f"data.criteo.num_embeddings={args.num_embeddings}")
        if args.skip_malformed:
            sets.append("data.criteo.skip_malformed=true")
        print("train on it with: neorec train --config configs/criteo.toml "
              + " ".join(f"--set {shlex.quote(s)}" for s in sets))  # TOML strings, quoted for the shell
        return 0
    raise ValueError(f"unknown data command {args.data_command!r}")  # pragma: no cover - argparse refuses it


def _env_flag(name: str) -> bool:
    """An on/off environment variable: unset, empty, 0, false, no and off are off."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line of the command's output (Python's shows the source file and line);
    like Python's, it never raises (a closed stderr)."""
    try:
        print(f"neorec: warning: {message}", file=file if file is not None else sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    previous, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before _main's own handling (building the parser imports torch)
        print("neorec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`neorec config | head`): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    finally:
        warnings.showwarning = previous


def _owner_of(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str],
              unknown: str) -> argparse.ArgumentParser:
    """The parser of the innermost (sub)command named before ``unknown`` on the command line:
    `neorec data write-criteo x --foo` -> write-criteo's, `neorec --foo train` -> the top-level one."""
    end = argv.index(unknown) if unknown in argv else len(argv)
    own, start = parser, 0
    while getattr(own, "command_parsers", None):
        name = getattr(args, own.command_dest, None)
        if name is None or name not in argv[start:end]:
            break
        start = argv.index(name, start) + 1
        own = own.command_parsers[name]
    return own


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the innermost command's parser before it: its usage, not the top-level one
        _owner_of(parser, args, argv, extra[0]).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from neorec.train.launch import Terminated, die_with_launcher

    die_with_launcher()  # a rank started by `--nproc N`: never outlive the launcher
    show_traceback = bool(args.traceback) or _env_flag("NEOREC_TRACEBACK")
    where = f" (rank {os.environ['RANK']})" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
    try:
        if args.command == "train":
            return cmd_train(args, argv)
        if args.command == "config":
            return cmd_config(args)
        if args.command == "plan":
            from neorec.planner.cli import cmd_plan

            return cmd_plan(args)
        return cmd_data(args, parser)
    except BrokenPipeError:
        raise  # handled by main: the reader of our output went away
    except (ValueError, TypeError, OSError) as exc:  # what the user can fix: bad input, files, folders
        if show_traceback:  # the traceback, then the same line and exit code as without it
            traceback.print_exc()
        print(f"neorec {args.command}{where}: error: {exc}", file=sys.stderr)
        if isinstance(exc, OSError) and exc.errno in _FAILED_ERRNOS:
            return EXIT_FAILED  # a full disk, an I/O error: the run failed, the command was fine
        return getattr(exc, "exit_code", EXIT_USAGE)  # a diverged run failed (1); it was not misused
    except KeyboardInterrupt:
        ranks = "; stopped every rank" if (getattr(args, "nproc", None) or 1) > 1 and not where else ""
        print(f"neorec {args.command}{where}: interrupted{ranks}", file=sys.stderr)
        return 130
    except Terminated as exc:
        ranks = " every rank" if (getattr(args, "nproc", None) or 1) > 1 else ""
        print(f"neorec {args.command}: {exc} received; stopped{ranks}", file=sys.stderr)
        return 128 + exc.signum
    except Exception as exc:  # not foreseen (or a peer rank died): one line and how to see more
        message = " ".join(str(exc).split())  # one line, whatever the exception's text holds
        if show_traceback:
            traceback.print_exc()
            print(f"neorec {args.command}{where}: error: {type(exc).__name__}: {message}", file=sys.stderr)
            return EXIT_FAILED
        print(f"neorec {args.command}{where}: error: {type(exc).__name__}: {message} (unexpected; "
              f"`neorec --traceback {args.command} ...` shows where it happened)", file=sys.stderr)
        return EXIT_FAILED

