"""``neorec train``: one process, ``--nproc N`` local ranks, or a rank started by torchrun.

    neorec train                                                   # default config, built-in synthetic data
    neorec train --config configs/tiny.toml --nproc 2 --plan auto  # 2 local ranks, cost-model plan
    torchrun --nproc-per-node 2 -m neorec train --plan plan.json   # or started by torchrun

Its options are declared in ``neorec.cli.build_parser``; ``neorec.cli`` turns the errors raised
here into one line and an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Iterator, List, Optional, Sequence


def cmd_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from neorec.train.distributed import launched_by_torchrun
    from neorec.signals import Terminated, terminate_raises
    from neorec.train.launch import started_by_a_launcher

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
        made = _not_made_yet(_run_folders(cfg))  # (the ranks make them)
        try:
            code = launch_local(args.nproc, list(argv))
        except (KeyboardInterrupt, Terminated):  # the ranks are stopped; say where to go on from; _main says why
            print(f"neorec train: {_saved_checkpoint_hint(cfg.checkpoint.dir, args.resume)}", file=sys.stderr)
            _remove_left_empty(made)
            raise
        if code:
            _remove_left_empty(made)
        return code
    if args.plan is not None:
        raise ValueError("--plan needs several processes: --nproc 2 or more, or start with torchrun")
    from neorec.files import holding_dirs
    from neorec.train.checkpoint import refuse_other_runs
    from neorec.train.trainer import Trainer, run_dirs

    cfg = _train_config(args)
    cfg.data.check_inputs_exist()  # named by its key, before the model is built
    if args.resume:  # (said after a model build of minutes, otherwise)
        from neorec.train.checkpoint_manifest import check_resume_location

        check_resume_location(Path(args.resume))
    with _removed_if_left_empty(_run_folders(cfg)):  # a refused run leaves no empty folder behind
        with holding_dirs(run_dirs(cfg)):  # another run on these folders: said now; fit() holds them for the run
            pass
        if args.resume is None:  # checkpoints of another run in checkpoint.dir: said before the build too
            refuse_other_runs(cfg.checkpoint)
        with terminate_raises():  # (from the build on: a store half made is removed, as after Ctrl-C)
            trainer = Trainer(cfg, resume=args.resume)
            _print_header(cfg, trainer)
            try:
                result = trainer.fit()
            except (KeyboardInterrupt, Terminated):  # say where it stopped; _main says why, and exits
                print(f"neorec train: stopped {_stopped_where(trainer)}{_resume_hint(trainer)}", file=sys.stderr)
                raise
            except BrokenPipeError:  # `neorec train | tee log` and tee died: not a silent stop
                print(f"neorec train: standard output was closed (its reader went away); stopped "
                      f"{_stopped_where(trainer)}{_resume_hint(trainer)}", file=sys.stderr)
                raise
    trainer.close()  # its row stores flushed and unlocked
    _print_result(result)
    return 0


def _not_made_yet(paths: Sequence[str]) -> List[Path]:
    """The folders that do not exist yet among each of ``paths`` ("" skipped) and its parents,
    deepest first: what ``_remove_left_empty`` may remove after a refusal. Each is resolved (links,
    ``..``) as the system will: of ``new/../kept/out`` they are ``kept/out`` and ``new``, never the
    user's ``kept``."""
    new: List[Path] = []
    for path in paths:
        for part in [Path(path), *Path(path).parents] if path else []:
            folder = Path(os.path.realpath(part))
            if not folder.exists() and folder not in new:
                new.append(folder)
    return new


def _remove_left_empty(made: List[Path]) -> None:
    """Remove the folders of ``_not_made_yet`` (deepest first) that hold nothing but a run's lock
    file: a refused run left an empty output folder behind. A lock that another process holds is
    left alone, and so is a folder that holds anything else."""
    from neorec.files import DIR_LOCK, LockHeld, lock_file

    for folder in made:
        if folder.is_dir() and [entry.name for entry in folder.iterdir()] == [DIR_LOCK]:
            try:
                fd = lock_file(folder / DIR_LOCK)
            except (LockHeld, OSError):
                continue
            (folder / DIR_LOCK).unlink(missing_ok=True)
            os.close(fd)
        try:
            folder.rmdir()
        except OSError:  # not empty (a file of the run's), or never made
            pass


@contextlib.contextmanager
def _removed_if_left_empty(paths: Sequence[str]) -> Iterator[None]:
    """``_remove_left_empty`` of the folders of ``paths`` not made yet, when the block raises."""
    made = _not_made_yet(paths)
    try:
        yield
    except BaseException:
        _remove_left_empty(made)
        raise


def _run_folders(cfg) -> List[str]:
    """The folders a run may make, deepest first: the SSD stores' (by default inside the output
    folder), the output and the checkpoint folders."""
    from neorec.train.build import ssd_dir_of
    from neorec.train.trainer import run_dirs

    return [ssd_dir_of(cfg), *(path for path, _ in run_dirs(cfg))]


def _stopped_where(trainer) -> str:
    restoring = trainer.checkpointer.restoring if trainer.checkpointer is not None else None
    if restoring is None:
        return f"after step {trainer.step}"
    if restoring[0] is None:  # (the step is still 0: said "stopped after step 0")
        return f"while checking the checkpoint to resume from in {restoring[1]}"
    return f"while restoring the checkpoint of step {restoring[0]}"


def _resume_hint(trainer) -> str:
    # the folder too: a stop between a checkpoint's manifest and the end of its save said "none yet";
    # and a run resumed from elsewhere (with or without a checkpoint.dir) goes on from that checkpoint
    # until it saves one of its own
    checkpointer = trainer.checkpointer
    last = checkpointer.go_on_from() if checkpointer is not None else None
    if last is not None:
        return f"; its last checkpoint is of step {last[0]}: --resume {last[1]} goes on from there"
    if checkpointer is not None and checkpointer.restoring is not None:  # (its step not read yet)
        return f"; --resume {checkpointer.restoring[1]} starts again"
    if checkpointer is None or checkpointer.root is None:
        return " (no checkpoints: set checkpoint.dir to be able to resume)"
    return " (no checkpoint saved yet)"


def _check_before_launch(cfg, plan, args: argparse.Namespace) -> None:
    """What every rank would refuse alike, said once by the launcher: missing data files, a
    missing --resume, prefetch of cached rows without the pipeline, and, with a plan file or
    --resume, what needs the tables' sizes: rows or columns of a table no shard covers, a
    checkpoint of other tables or optimizers, or an epoch position the new batches cannot continue."""
    from neorec.embedding.locations import CACHED_LOCATIONS, PREFETCH_NEEDS_PIPELINE
    from neorec.sharding import ShardingPlan

    cfg.data.check_inputs_exist()
    if args.resume:
        from neorec.train.checkpoint_manifest import check_resume_location

        check_resume_location(Path(args.resume))
    if args.resume is None:  # (each rank would say it after building its pieces and stores)
        from neorec.train.checkpoint import refuse_other_runs

        refuse_other_runs(cfg.checkpoint)
    location = cfg.embedding.location
    if location.prefetch and not cfg.train.pipeline and any(  # (only cached rows are prefetched)
            location.known_kind(name) in CACHED_LOCATIONS for name in cfg.data.table_names()):
        raise ValueError(PREFETCH_NEEDS_PIPELINE)
    check_gpus_for_ranks(cfg.train.device, args.nproc)
    if isinstance(plan, ShardingPlan) or args.resume:
        from neorec.data import make_data_source
        from neorec.planner.names import TIERS
        from neorec.train.checkpoint_manifest import check_resume_before_launch

        source = make_data_source(cfg.data)  # (the ranks build it again: small next to their model)
        if isinstance(plan, ShardingPlan):
            tables = source.tables(cfg.model.embedding_dim, cfg.model.pooling)
            try:
                plan.validate(tables, args.nproc, tiers=TIERS)
            except ValueError as exc:
                raise ValueError(f"{exc} ({args.plan})") from None
            kinds = {t.name: plan.tables[t.name].tier if plan.tables[t.name].tier != "device"  # (as plan_locations)
                     else cfg.embedding.location.kind_of(t) for t in tables}
            problem = plan.gpu_training_problem(kinds) if _trains_on_cuda(cfg.train.device) else None
            if problem is not None:
                raise ValueError(f"sharding plan {args.plan} on GPUs: {problem}")
        if args.resume:
            check_resume_before_launch(Path(args.resume), cfg, source, args.nproc)


def _trains_on_cuda(device: str) -> bool:
    import torch

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


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
        if resumed:
            return (f"this run saved no checkpoints (checkpoint.dir is empty); --resume {resumed} starts again "
                    "from where it started")
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
    from neorec.embedding.locations import CACHED_LOCATIONS, PREFETCH_NEEDS_PIPELINE
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
            if cfg.embedding.location.prefetch and not cfg.train.pipeline and \
                    set(plan.tiers_off_device().values()) & set(CACHED_LOCATIONS):
                raise ValueError(PREFETCH_NEEDS_PIPELINE)
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
            error = ValueError(f"rank 0 could not plan: {text[len('error:'):]}")
            error.relayed = True  # (under --nproc, rank 0's own line says it)
            raise error
        return text
    try:
        text = make_plan()
    except Exception as exc:
        broadcast_text(f"error:{exc}", group, device)
        raise
    return broadcast_text(text, group, device)


def _ranks_per_node(context) -> int:
    """The ranks per node that ``--plan auto`` plans for, the same on every rank: each rank sends its
    LOCAL_WORLD_SIZE, and nodes of unequal size (torchrun agents with different --nproc-per-node)
    are refused on every rank (the check of rank 0's own node alone let 2 + 4 ranks plan as 3 nodes of 2)."""
    import torch
    import torch.distributed as dist

    group, device = context.embedding_group, context.device
    mine = torch.tensor([context.local_world_size], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, mine, group=group)
    sizes = [int(size) for size in sizes]
    if len(set(sizes)) > 1:
        counts = " and ".join(f"{size} ({sizes.count(size)} rank{'s' * (sizes.count(size) > 1)})"
                              for size in sorted(set(sizes)))
        raise ValueError(f"--plan auto plans for nodes of equal size, but the ranks' LOCAL_WORLD_SIZE differ: {counts}; "
                         "make a plan for this world with `neorec plan --topology FILE --out plan.json` and pass "
                         "--plan plan.json")
    return sizes[0]


def _fit_distributed(cfg, context, plan, resume=None):
    from neorec.train.trainer import Trainer

    source = None
    if plan == "auto":  # the cost-model planner for this world, run on rank 0 and sent to the others
        from neorec.data import make_data_source
        from neorec.planner.cli import plan_for_training
        from neorec.sharding.plan import ShardingPlan

        source = make_data_source(cfg.data)
        ranks_per_node = _ranks_per_node(context)
        plan = _plan_on_rank_0(context, lambda: plan_for_training(cfg, source, context.world_size,
                                                                  ranks_per_node).to_json())
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
    from neorec.config import load_config, toml_string

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
    return load_config(args.config, list(args.overrides) + extra, check_data=True)


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
