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
import errno
import os
import shlex
import sys
import traceback
import warnings
from typing import Optional, Sequence

EXIT_USAGE = 2  # the command as given cannot run: bad option, config, input file or folder
EXIT_FAILED = 1  # it ran and failed: training diverged (non-finite loss), an unforeseen error
_FAILED_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO)  # OSErrors of a run that failed (a full disk)


def _config_keys_help() -> str:
    from neorec.config_help import config_keys_help

    return config_keys_help()


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


def _version() -> str:
    """neorec's version with Python's and torch's (read without importing torch: a bug report's line)."""
    import platform
    from importlib import metadata

    from neorec import __version__

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    return f"neorec {__version__} (Python {platform.python_version()}, torch {torch})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neorec",
        description="neorec: train deep learning recommendation models (DLRM) with fused, "
        "table-batched embeddings (after Meta's Neo).",
    )
    parser.add_argument("--traceback", action="store_true",
                        help="show the full Python traceback on errors (for bug reports); "
                        "NEOREC_TRACEBACK=1 in the environment does the same")
    parser.add_argument("--version", action="version", version=_version(),
                        help="print neorec's, Python's and torch's versions and exit")
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
                       "output dist, backward, optimizer, checkpoint saves, other, exposed communication); print "
                       "the table and write OUTPUT_DIR/timeline.json (same as --set train.profile=true)")
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
        if args.lines < 1:  # an empty file, which every later step refuses
            raise ValueError(f"--lines must be >= 1, got {args.lines}")
        if args.seed < 0:  # named as the option (not as data.synthetic.seed)
            raise ValueError(f"--seed must be >= 0, got {args.seed}")
        criteo.write_criteo_tsv(args.path, num_lines=args.lines, seed=args.seed, held_out=args.held_out)
        print(f"wrote {args.lines:,} {'held-out ' if args.held_out else ''}lines to {args.path}")
        return 0
    if args.data_command == "preprocess-criteo":
        if args.num_embeddings < 2:
            raise ValueError(f"--num-embeddings must be >= 2 (row 0 holds missing values), got {args.num_embeddings}")
        from neorec.data.config import check_criteo_tsv, check_processed_dir, no_rows_reason

        for tsv, what in [(args.tsv, "TSV"), (args.eval_tsv, "--eval-tsv")]:  # all, before hours of work on one
            if tsv is not None:
                check_criteo_tsv(tsv, what, held_out=what == "--eval-tsv")
        processed = args.processed_dir or f"{args.tsv}.neorec"
        where = ("PROCESSED_DIR, the second argument" if args.processed_dir is not None else
                 "by default TSV.neorec beside the TSV; the second argument, PROCESSED_DIR, puts it elsewhere")
        inputs = [(tsv, split) for tsv, split in [(args.tsv, "train"), (args.eval_tsv, "eval")] if tsv is not None]
        for _, split in inputs:  # every output folder too, before any work
            check_processed_dir(os.path.join(processed, split), where)
        sets = [f"data.criteo.train_path={toml_string(args.tsv)}"]
        for tsv, split in inputs:
            out = os.path.join(processed, split)
            stats = criteo.preprocess_criteo(tsv, out, num_embeddings=args.num_embeddings,
                                             skip_malformed=args.skip_malformed, where=where)
            for example in stats.skipped_examples:
                print(f"  skipped {example}")
            if stats.num_rows == 0:  # training on it would stop at "holds no rows": not left as a copy
                criteo.remove_empty_copy(tsv, out)  # (as training removes it; the lock file stays)
                raise ValueError(f"{tsv} holds no rows ({no_rows_reason(stats.num_lines, stats.num_skipped)}):"
                                 f" nothing to {'train' if split == 'train' else 'evaluate'} on")
            skipped = f", {stats.num_skipped:,} malformed lines skipped" if stats.num_skipped else ""
            print(f"preprocessed {tsv} -> {out}: {stats.num_rows:,} rows of {stats.num_lines:,} lines"
                  f"{skipped} ({stats.num_bytes / 2**20:,.1f} MiB read in {stats.seconds:.1f} s)")
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
    from neorec.signals import Terminated
    from neorec.train.launch import die_with_launcher

    die_with_launcher()  # a rank started by `--nproc N`: never outlive the launcher
    show_traceback = bool(args.traceback) or _env_flag("NEOREC_TRACEBACK")
    where = f" (rank {os.environ['RANK']})" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
    try:
        if args.command == "train":
            from neorec.train.cli import cmd_train

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
        _say_error(f"neorec {args.command}{where}: error: {exc}", exc)
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
        return _say_unexpected(args.command, where, exc, show_traceback)


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def _peer_went_away(exc: BaseException) -> bool:
    """A collective failed because another rank's process ended (gloo's "Connection closed by
    peer"): in a rank of ``--nproc N`` that rank's own error says why."""
    distributed = sys.modules.get("torch.distributed")
    network_error = getattr(distributed, "DistNetworkError", None)
    return (network_error is not None and isinstance(exc, network_error)) or any(s in str(exc) for s in _PEER_GONE)


def _say_unexpected(command: str, where: str, exc: Exception, show_traceback: bool) -> int:
    """An error not foreseen: one line and how to see more. In a rank, a collective that failed
    because another rank ended is said as relayed (only when no rank says its own error: it was
    said first, as "unexpected", beside the failed rank's real reason)."""
    message = " ".join(str(exc).split())  # one line, whatever the exception's text holds
    if show_traceback:
        traceback.print_exc()
        print(f"neorec {command}{where}: error: {type(exc).__name__}: {message}", file=sys.stderr)
        return EXIT_FAILED
    if where and _peer_went_away(exc):
        try:
            exc.relayed = True
        except AttributeError:  # (an exception type without a __dict__)
            pass
    _say_error(f"neorec {command}{where}: error: {type(exc).__name__}: {message} (unexpected; "
               f"`neorec --traceback {command} ...` shows where it happened)", exc)
    return EXIT_FAILED


def _say_error(line: str, exc: BaseException) -> None:
    """The error line on stderr; in a rank of ``--nproc N``, to the launcher instead, which says each
    distinct line once for all the ranks that said it (``neorec.train.launch.error_file``; a rank
    relaying another rank's error, ``exc.relayed``, is said only if that rank's own line is not)."""
    from neorec.train.launch import error_file

    file = error_file(relayed=getattr(exc, "relayed", False))
    if file is None:
        print(line, file=sys.stderr)
        return
    rank = f" (rank {os.environ.get('RANK', '0')})"
    try:
        file.write_text(line.replace(rank, " ({RANKS})", 1) + "\n")
    except OSError:  # (the launcher's folder gone): said here
        print(line, file=sys.stderr)

