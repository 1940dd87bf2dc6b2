"""Rank programs of tests/distributed/test_sharded_checkpoint.py (importable by spawned processes)."""

from __future__ import annotations

import io
import os
from typing import Dict, Optional

import torch
import torch.distributed as dist

from workers import small_config


def gather_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's 1-D ``tensor`` (sizes may differ), concatenated in rank order, on every rank."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([tensor.numel()]), group=group)
    counts = [int(n) for n in sizes]
    padded = tensor.new_zeros(max(counts))
    padded[: tensor.numel()] = tensor
    parts = [torch.zeros_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def snapshot(trainer, distributed: bool) -> Dict[str, torch.Tensor]:
    """Full tables (gathered), dense weights and the logits of the first global eval batch."""
    from neorec.train.distributed import split_batch

    model = trainer.model.module if distributed else trainer.model
    out = {}
    for table in model.sparse_arch.tables:
        out[table.name] = (model.sparse_arch.full_table_weight(table.name) if distributed
                           else model.sparse_arch.tbe.get_table_weight(table.name))
    for key, value in model.state_dict().items():
        if not key.startswith("sparse_arch"):
            out[key] = value.clone()
    batch = next(iter(trainer.source.eval_batches(128)))
    model.eval()
    with torch.no_grad():
        if distributed:
            context = trainer.distributed
            part = split_batch(batch, context.rank, context.world_size)
            out["logits"] = gather_to_all(model(part.dense, part.sparse), context.dense_group)
        else:
            out["logits"] = model(batch.dense, batch.sparse)
    return out


def train_or_resume(rank: int, world: int, group, directory: str, plan_json: str, overrides, resume) -> Dict:
    from neorec.sharding import ShardingPlan
    from neorec.train.distributed import DistributedContext
    from neorec.train.trainer import Trainer

    context = DistributedContext(rank, world, rank, world, "gloo", torch.device("cpu"), group,
                                 dist.new_group(list(range(world))))
    plan = ShardingPlan.from_json(plan_json) if plan_json else None
    cfg = small_config(os.path.join(directory, f"run{world}"), 128 // world, 64, overrides)
    trainer = Trainer(cfg, out=io.StringIO(), distributed=context, plan=plan, resume=resume)
    trainer.fit()
    return snapshot(trainer, True) | {"step": torch.tensor(trainer.step)}


def train_with_cache_stats(rank: int, world: int, group, directory: str, plan_json: str, overrides) -> Dict:
    """``train_or_resume`` without a checkpoint, and under "cache" this rank's caches' summed
    [hits, misses, prefetch_loads]."""
    from neorec.sharding import ShardingPlan
    from neorec.train.distributed import DistributedContext
    from neorec.train.trainer import Trainer

    context = DistributedContext(rank, world, rank, world, "gloo", torch.device("cpu"), group,
                                 dist.new_group(list(range(world))))
    cfg = small_config(os.path.join(directory, f"run{world}"), 128 // world, 64, overrides)
    trainer = Trainer(cfg, out=io.StringIO(), distributed=context, plan=ShardingPlan.from_json(plan_json))
    trainer.fit()
    caches = trainer.model.module.sparse_arch.cached.caches.values()
    stats = [sum(getattr(c.stats, field) for c in caches) for field in ("hits", "misses", "prefetch_loads")]
    return snapshot(trainer, True) | {"cache": torch.tensor(stats)}


def build_with_locations(rank: int, world: int, group, names, rows, plan_json: str, kinds) -> str:
    """The error a ShardedEmbeddingBagCollection with tables at ``kinds`` raises ("" if none)."""
    from neorec.embedding import TableConfig
    from neorec.embedding.locations import TableLocation
    from neorec.sharding import ShardedEmbeddingBagCollection, ShardingPlan

    tables = [TableConfig(name, n, 8) for name, n in zip(names, rows)]
    try:
        ShardedEmbeddingBagCollection(tables, ShardingPlan.from_json(plan_json), group,
                                      locations={name: TableLocation(kind) for name, kind in kinds.items()})
    except ValueError as exc:
        return str(exc)
    return ""


def initial_state(rank: int, world: int, group, directory: str, plan_json: str, overrides,
                  init_chunk: Optional[int] = None) -> Dict:
    """The full tables (gathered) and dense weights of a freshly built distributed Trainer, and
    under "drawn" {table: [blocks of initial rows this rank drew]}; ``init_chunk`` replaces
    ``INIT_CHUNK`` (smaller blocks)."""
    from neorec.embedding import init_stream
    from neorec.sharding import ShardingPlan
    from neorec.train.distributed import DistributedContext
    from neorec.train.trainer import Trainer

    if init_chunk is not None:
        init_stream.INIT_CHUNK = init_chunk
    drawn: Dict[str, set] = {}
    draw = init_stream.TableInit._block

    def recorded(self, k):
        drawn.setdefault(self.name, set()).add(k)
        return draw(self, k)

    init_stream.TableInit._block = recorded
    context = DistributedContext(rank, world, rank, world, "gloo", torch.device("cpu"), group,
                                 dist.new_group(list(range(world))))
    cfg = small_config(os.path.join(directory, f"run{world}"), 128 // world, 64, overrides)
    trainer = Trainer(cfg, out=io.StringIO(), distributed=context, plan=ShardingPlan.from_json(plan_json))
    model = trainer.model.module
    out = {t.name: model.sparse_arch.full_table_weight(t.name) for t in model.sparse_arch.tables}
    out.update({k: v.clone() for k, v in model.state_dict().items() if not k.startswith("sparse_arch")})
    out["drawn"] = {name: sorted(blocks) for name, blocks in drawn.items()}
    return out
