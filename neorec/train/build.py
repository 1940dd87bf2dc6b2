"""What a ``Trainer`` is built from: the device, the DLRM and its embedding collection
(``build_model``, under ``memory_named``), the places of tables off the device in a sharded run
(``plan_locations``), the dense optimizer (``make_dense_optimizer``) and the SSD stores' folder
(``ssd_dir_of``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Dict, Iterable, Iterator, Optional, Sequence

import torch

from neorec.config import Config, DenseOptimizerConfig
from neorec.data import DataSource
from neorec.devices import concrete_device
from neorec.embedding import EmbeddingBagCollection
from neorec.embedding.cached import CachedEmbeddingBagCollection
from neorec.embedding.locations import TableLocation
from neorec.embedding.optimizers import STATE_LAYOUT
from neorec.embedding.precision import storage_dtype
from neorec.model import DLRM
from neorec.train.distributed import no_cuda_message


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return concrete_device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(no_cuda_message())
    return concrete_device(name)


def ssd_dir_of(cfg: Config) -> str:
    """The folder of the SSD row stores: ``embedding.location.ssd_dir``, else
    ``<train.output_dir>/embedding_ssd`` (as ``LocationConfig.resolve`` places them)."""
    if cfg.embedding.location.ssd_dir:
        return cfg.embedding.location.ssd_dir
    return str(Path(cfg.train.output_dir) / "embedding_ssd") if cfg.train.output_dir else "embedding_ssd"


def build_model(cfg: Config, source: DataSource, device: torch.device, sparse_arch: Optional[torch.nn.Module] = None,
                initial_rows: bool = True) -> DLRM:
    """The DLRM of ``cfg`` over the tables of ``source``, initialised from ``cfg.train.seed``.
    ``sparse_arch``: its embedding collection, built by the caller (a sharded run's
    ``ShardedEmbeddingBagCollection``, which allocates this rank's pieces only); else built here.
    ``initial_rows`` False: no initial rows are drawn for the tables (zeros on the device, row
    stores not filled): a checkpoint restore sets every row next."""
    torch.manual_seed(cfg.train.seed)  # the dense layers' initial weights: the same whatever the collection
    tables = source.tables(cfg.model.embedding_dim, cfg.model.pooling)
    init_seed = cfg.train.seed if initial_rows else None
    if sparse_arch is not None:
        collection = sparse_arch
    elif cfg.embedding.location.any_off_device(tables):  # some tables in DRAM or behind a cache
        collection = CachedEmbeddingBagCollection(
            tables, cfg.embedding.optimizer, cfg.embedding.storage, device=device, init_seed=init_seed,
            locations=cfg.embedding.location.resolve(tables, ssd_dir_of(cfg)))
    else:
        collection = EmbeddingBagCollection(
            tables,
            optimizer=cfg.embedding.optimizer,
            storage=cfg.embedding.storage,
            device=device,
            init_seed=init_seed,
        )
    model = DLRM(
        sparse_arch=collection,
        num_dense=source.num_dense,
        embedding_dims={f: t.embedding_dim for t in tables for f in t.feature_names},
        dense_layers=cfg.model.dense_layers,
        over_layers=cfg.model.over_layers,
        interaction=cfg.model.interaction,
        dcn_num_layers=cfg.model.dcn_num_layers,
        dcn_low_rank=cfg.model.dcn_low_rank,
        self_interaction=cfg.model.self_interaction,
    )
    return model.to(device)


def memory_bytes(cfg: Config, tables: Sequence) -> int:
    """Bytes of rows and optimizer state that ``tables`` (``TableConfig``s) of a one-process run
    hold in memory: all but those on SSD (``cached_ssd``: a memory-mapped store and a cache)."""
    row_bytes = storage_dtype(cfg.embedding.storage.precision).itemsize
    state = STATE_LAYOUT[cfg.embedding.optimizer.kind]
    total = 0
    for table in tables:
        if cfg.embedding.location.kind_of(table) != "cached_ssd":
            rows, dim = table.num_embeddings, table.embedding_dim
            total += rows * dim * row_bytes + sum(4 * (rows if layout == "row" else rows * dim) for _, layout in state)
    return total


def _machine_memory_bytes() -> Optional[int]:
    """Physical memory plus swap (Linux), or None where the system does not say."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return (int(fields["MemTotal"].split()[0]) + int(fields.get("SwapTotal", "0 kB").split()[0])) * 1024
    except (OSError, ValueError, KeyError):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None


def _out_of_memory_message(needed: Optional[int], why: str, sharded: bool) -> str:
    from neorec.planner.enumerate import format_bytes

    machine = _machine_memory_bytes()
    held = f"the embedding tables {'of this rank ' if sharded else ''}held in memory"
    amount = f" need {format_bytes(needed)} (rows and optimizer state)" if needed else ""
    has = f", and this machine has {format_bytes(machine)} of memory and swap" if machine else ""
    return (f"{why}: {held}{amount}{has}. Keep the largest tables on SSD behind a cache "
            f"(embedding.location.default = \"cached_ssd\" with embedding.location.min_rows, or per table in "
            f"embedding.location.tables; see the README's \"Embedding cache\"), store rows in fewer bits "
            f"(embedding.storage.precision = \"fp16\"), or shard the tables over more processes or machines "
            f"(--nproc, torchrun)")


@contextlib.contextmanager
def memory_named(cfg: Config, tables: Sequence, device: torch.device, sharded: bool) -> Iterator[None]:
    """Around building a model: a one-process model whose tables in memory exceed this machine's
    memory and swap is refused before anything is allocated (where the system overcommits, the
    allocation would succeed and the kernel kill the process as the rows are drawn); an allocation
    that fails while building is said as what it is, with what to do (ValueError), instead of as
    the allocator's error."""
    needed = None if sharded else memory_bytes(cfg, tables)
    machine = _machine_memory_bytes()
    if needed and device.type == "cpu" and machine and needed > machine:
        raise ValueError(_out_of_memory_message(needed, "the model does not fit in memory", sharded))
    try:
        yield
    except (RuntimeError, MemoryError) as exc:  # (torch's OutOfMemoryError is a RuntimeError)
        text = str(exc)
        if not (isinstance(exc, MemoryError) or "can't allocate memory" in text or "out of memory" in text):
            raise
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        raise ValueError(_out_of_memory_message(
            needed, f"building the model ran out of memory on {device} ({first[:300]})", sharded)) from None


def plan_locations(cfg: Config, tables, plan) -> Optional[Dict[str, TableLocation]]:
    """Where a sharded run puts each table: the plan's tier when it is not "device" (the planner
    chose it), else ``[embedding.location]``'s kind, with that section's cache and store settings
    (a cached tier's store takes the plan's precision when it names one); None when every table
    stays on the device."""
    planned = plan.tiers_off_device()
    if not planned and not cfg.embedding.location.any_off_device(tables):
        return None
    locations = cfg.embedding.location.resolve(tables, ssd_dir_of(cfg))
    ssd = Path(ssd_dir_of(cfg))
    for name, tier in planned.items():
        precision = plan.tables[name].precision if tier in ("cached_dram", "cached_ssd") else None
        locations[name] = dataclasses.replace(locations[name], kind=tier,
                                              path=str(ssd / name) if tier == "cached_ssd" else "",
                                              precision=precision or locations[name].precision)
    return locations


def make_dense_optimizer(cfg: DenseOptimizerConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The dense optimizer of ``cfg``; its fused (one kernel for all parameters) implementation when
    every parameter is a floating tensor on CPU or CUDA: the same update, without the per-parameter
    loop of ~10 small ops each (Adagrad on a 540k-parameter DLRM, CPU: 1.7 -> 0.7 ms per step)."""
    params = list(params)
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    if cfg.kind == "sgd":
        kind, options = torch.optim.SGD, {"lr": cfg.learning_rate, "weight_decay": cfg.weight_decay}
    else:
        kind = torch.optim.Adagrad if cfg.kind == "adagrad" else torch.optim.Adam
        options = {"lr": cfg.learning_rate, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if fused:
        try:
            return kind(params, **options, fused=True)
        except (RuntimeError, TypeError, ValueError):  # a torch without this fused kernel for the device
            pass  # (earlier releases' fused Adagrad was CPU-only): the same update, per parameter
    return kind(params, **options)
