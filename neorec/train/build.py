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


def tables_host_bytes(cfg: Config, tables: Sequence) -> int:
    """Bytes of rows and optimizer state that ``tables`` (``TableConfig``s) of a one-process CPU run
    hold in host memory: a device table's rows (``embedding.storage.precision``) and state, a DRAM
    store's records (``embedding.location.precision``: ``store_record_bytes``); tables on SSD (a
    memory-mapped store) and the caches (a share of a table) are left out: a lower bound."""
    from neorec.planner.cost_model import store_record_bytes

    location = cfg.embedding.location
    row_bytes = storage_dtype(cfg.embedding.storage.precision).itemsize
    state = STATE_LAYOUT[cfg.embedding.optimizer.kind]
    total = 0
    for table in tables:
        kind, rows, dim = location.kind_of(table), table.num_embeddings, table.embedding_dim
        if kind == "device":
            total += rows * dim * row_bytes + sum(4 * (rows if layout == "row" else rows * dim) for _, layout in state)
        elif kind != "cached_ssd":
            total += rows * store_record_bytes(location.precision, dim, cfg.embedding.optimizer.kind,
                                               location.policy == "lfu")
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


_FEWER_BITS = ("store rows in fewer bits (embedding.storage.precision = \"fp16\" for tables on the device, "
               "embedding.location.precision for the stores of cached tables)")


def _host_memory_message(needed: Optional[int], machine: Optional[int], why: str, sharded: bool) -> str:
    from neorec.planner.enumerate import format_bytes

    held = f"the embedding tables {'of this rank ' if sharded else ''}held in memory"
    amount = f" need at least {format_bytes(needed)} (rows and optimizer state)" if needed else ""
    has = f", and this machine has {format_bytes(machine)} of memory and swap" if machine else ""
    return (f"{why}: {held}{amount}{has}. Keep the largest tables on SSD behind a cache "
            f"(embedding.location.default = \"cached_ssd\" with embedding.location.min_rows, or per table in "
            f"embedding.location.tables; see the README's \"Embedding cache\"), {_FEWER_BITS}, or shard the "
            f"tables over more processes or machines (--nproc, torchrun)")


def _device_memory_message(why: str) -> str:
    return (f"{why}: keep the largest tables in host memory or on SSD behind a cache (embedding.location: "
            f"\"cached_dram\" or \"cached_ssd\", see the README's \"Embedding cache\"), {_FEWER_BITS}, or shard "
            f"the tables over more GPUs (--nproc, torchrun)")


@contextlib.contextmanager
def memory_named(cfg: Config, tables: Sequence, device: torch.device, sharded: bool) -> Iterator[None]:
    """Around building a model: a one-process CPU model whose tables in host memory
    (``tables_host_bytes``) exceed this machine's memory and swap is refused before anything is
    allocated (where the system overcommits, the allocation would succeed and the kernel kill the
    process as the rows are drawn); an allocation that fails while building, host or GPU, is said
    as what it is, with what to do (ValueError: the config asks for more memory than there is),
    instead of as the allocator's error."""
    needed = tables_host_bytes(cfg, tables) if device.type == "cpu" and not sharded else None
    machine = _machine_memory_bytes()
    if needed and machine and needed > machine:
        raise ValueError(_host_memory_message(needed, machine, "the model does not fit in memory", sharded))
    try:
        yield
    except (RuntimeError, MemoryError) as exc:  # (torch's OutOfMemoryError is a RuntimeError)
        text = str(exc)
        if not (isinstance(exc, MemoryError) or "can't allocate memory" in text or "out of memory" in text):
            raise
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        why = f"building the model ran out of memory on {device} ({first[:300]})"
        if device.type == "cuda" and "CUDA" in first:  # (the GPU's memory, not the host's)
            raise ValueError(_device_memory_message(why)) from None
        raise ValueError(_host_memory_message(needed, machine, why, sharded)) from None


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
