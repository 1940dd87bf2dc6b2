"""Rank functions of the distributed tests (imported by the spawned processes)."""

from __future__ import annotations

import traceback
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from neorec.model import dense_named_parameters, dense_parameters
from neorec.sharding import CommStats, shard
from neorec.train.distributed import local_loss, split_batch, wrap_data_parallel

import cases

DENSE = {"sgd": ("sgd", 0.1), "rowwise_adagrad": ("adagrad", 0.05)}
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _dense_optimizer(kind: str, params):
    name, lr = DENSE[kind]
    return torch.optim.SGD(params, lr=lr) if name == "sgd" else torch.optim.Adagrad(params, lr=lr)


def run_case(rank: int, world: int, group, dense_group, kind: str, sparse_kind: str, weighted: bool,
             plain_reference: bool = False) -> None:
    """Train the sharded model and the single-process reference side by side; assert equality.
    The reference is the unsharded model, or for column pieces under row-wise AdaGrad the
    piece-split one (``cases.PieceSplitCollection``) unless ``plain_reference``."""
    plan = cases.make_plan(kind, world)
    reference = cases.build_model(sparse_kind)
    if cases.needs_piece_reference(plan, sparse_kind) and not plain_reference:
        reference.sparse_arch = cases.PieceSplitCollection(cases.make_tables(), plan, reference.sparse_arch.tbe.optimizer,
                                                           reference.sparse_arch)
    model = shard(cases.build_model(sparse_kind), plan, group, CommStats())
    ddp = wrap_data_parallel(model, dense_group, torch.device("cpu"))
    ref_optimizer = _dense_optimizer(sparse_kind, dense_parameters(reference))
    optimizer = _dense_optimizer(sparse_kind, dense_parameters(ddp))
    for step, size in enumerate(cases.batch_sizes(world)):
        batch = cases.global_batch(step, size, weighted)
        ref_logits = reference(batch.dense, batch.sparse)
        ref_loss = torch.nn.functional.binary_cross_entropy_with_logits(ref_logits, batch.labels)
        ref_optimizer.zero_grad()
        ref_loss.backward()
        ref_optimizer.step()

        local = split_batch(batch, rank, world)
        logits = ddp(local.dense, local.sparse)
        loss = local_loss(logits, local.labels, size)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        lo = size * rank // world
        torch.testing.assert_close(logits, ref_logits[lo : lo + local.batch_size].detach(), **TOLERANCE,
                                   msg=lambda m: f"step {step} predictions: {m}")
    for table in cases.make_tables():
        full = model.sparse_arch.full_table_weight(table.name)
        torch.testing.assert_close(full, cases.reference_table(reference, table.name), **TOLERANCE,
                                   msg=lambda m: f"table {table.name}: {m}")
    ref_params = dict(dense_named_parameters(reference))
    for name, param in dense_named_parameters(ddp):
        torch.testing.assert_close(param, ref_params[name.removeprefix("module.")], **TOLERANCE,
                                   msg=lambda m: f"dense {name}: {m}")
    with torch.no_grad():  # predictions of the trained models on a fresh batch
        batch = cases.global_batch(99, world * cases.LOCAL_BATCH + 1, weighted)
        local = split_batch(batch, rank, world)
        lo = batch.batch_size * rank // world
        torch.testing.assert_close(ddp(local.dense, local.sparse),
                                   reference(batch.dense, batch.sparse)[lo : lo + local.batch_size], **TOLERANCE)


def case_name(kind: str, sparse_kind: str, weighted: bool, plain_reference: bool = False) -> str:
    return f"{kind}-{sparse_kind}{'-weighted' if weighted else ''}{'-plain_reference' if plain_reference else ''}"


def equivalence(rank: int, world: int, group, selected: List[Tuple[str, str, bool, bool]]) -> Dict[str, str]:
    """Every (sharding kind, sparse optimizer, weighted, plain reference) case; returns
    {case name: "ok" or the assertion's traceback}."""
    dense_group = dist.new_group(list(range(world)))
    results = {}
    for kind, sparse_kind, weighted, plain in selected:
        name = case_name(kind, sparse_kind, weighted, plain)
        try:
            run_case(rank, world, group, dense_group, kind, sparse_kind, weighted, plain)
            results[name] = "ok"
        except AssertionError:
            results[name] = traceback.format_exc(limit=2)[-3000:]
        dist.barrier(group)  # a failed comparison on one rank leaves the others in step
    return results


def small_config(directory: str, batch_size: int, eval_batch_size: int, overrides=()):
    from neorec.config import load_config

    return load_config(None, [
        "data.synthetic.num_tables=3", "data.synthetic.num_embeddings=[60, 200, 25]", "data.synthetic.pooling=2.0",
        "data.synthetic.num_dense=3", "data.synthetic.num_train_samples=1000", "data.synthetic.num_eval_samples=300",
        f"data.batch_size={batch_size}", f"data.eval_batch_size={eval_batch_size}", "data.prefetch_batches=2",
        "model.embedding_dim=8", "model.dense_layers=[8]", "model.over_layers=[8]", "train.progress=false",
        "train.log_every_steps=2", f"train.output_dir=\"{directory}\"", *overrides,
    ])


def trainer_equivalence(rank: int, world: int, group, directory: str, plan_json: str, local_batch: int,
                        overrides=()) -> Dict:
    """The distributed Trainer (per-rank batch ``local_batch``) against the single-process Trainer
    with the global batch: same losses, same final eval, same tables and dense weights."""
    import io
    import os

    from neorec.sharding import ShardingPlan
    from neorec.train.distributed import DistributedContext
    from neorec.train.trainer import Trainer

    context = DistributedContext(rank, world, rank, world, "gloo", torch.device("cpu"), group,
                                 dist.new_group(list(range(world))))
    plan = ShardingPlan.from_json(plan_json) if plan_json else None
    out = io.StringIO()
    trainer = Trainer(small_config(os.path.join(directory, "dist"), local_batch, 64, overrides), out=out,
                      distributed=context, plan=plan)
    result = trainer.fit()
    reference = Trainer(small_config(os.path.join(directory, f"ref{rank}"), local_batch * world, 64 * world, overrides),
                        out=io.StringIO())
    expected = reference.fit()
    for key in ("auc", "log_loss", "ne", "num_samples"):
        torch.testing.assert_close(result.final_eval[key], expected.final_eval[key], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"final eval {key}: {m}")
    assert result.steps == expected.steps and result.samples == expected.samples
    collection = trainer.model.module.sparse_arch
    for table in collection.tables:
        torch.testing.assert_close(collection.full_table_weight(table.name),
                                   reference.model.sparse_arch.tbe.get_table_weight(table.name), rtol=1e-5, atol=1e-6)
    reference_dense = dict(dense_named_parameters(reference.model))
    for name, param in dense_named_parameters(trainer.model):
        torch.testing.assert_close(param, reference_dense[name.removeprefix("module.")], rtol=1e-5, atol=1e-6)
    return {"steps": result.steps, "out": out.getvalue(), "plan": trainer.plan.to_json()}


def deadlock(rank: int, world: int, group) -> None:
    """Rank 0 waits in a barrier that rank 1 never joins."""
    import time

    if rank == 0:
        dist.barrier(group)
    else:
        time.sleep(120)


def plan_on_rank_0(rank: int, world: int, group, fail: bool) -> str:
    """``neorec train --plan auto``'s planning step with a planner whose answer differs per rank
    (as with other calibration files on other nodes); returns the plan text, or the error."""
    from types import SimpleNamespace

    from neorec.train.cli import _plan_on_rank_0

    context = SimpleNamespace(is_main=rank == 0, embedding_group=group, device=torch.device("cpu"))

    def make_plan() -> str:
        if fail:
            raise ValueError(f"table 't0' fits no rank (planned on rank {rank})")
        return f"plan of rank {rank} " + "é" * 1000  # any length, any UTF-8
    try:
        return _plan_on_rank_0(context, make_plan)
    except ValueError as exc:
        return f"raised: {exc}"


def gather_on_main(rank: int, world: int, group):
    """What ``gather_to_main`` leaves on each rank (uneven sizes: rank r has r + 2 values, rank 1 none)."""
    from neorec.train.distributed import gather_to_main

    local = torch.arange(rank + 2, dtype=torch.float32) + 10 * rank if rank != 1 else torch.zeros(0)
    gathered = gather_to_main(local, group)
    return None if gathered is None else gathered.tolist()


def broadcast_on_subgroup(rank: int, world: int, group) -> Optional[str]:
    """``broadcast_text`` from the first rank of the subgroup [1, 2] (its group rank 0, global rank
    1); what each rank receives (None outside the subgroup)."""
    import torch.distributed as dist

    from neorec.train.distributed import broadcast_text

    subgroup = dist.new_group([1, 2])  # (every rank takes part in creating it)
    if rank not in (1, 2):
        return None
    return broadcast_text("from global rank 1" if rank == 1 else None, subgroup, torch.device("cpu"))


def distinct_gpus(rank: int, world: int, group, uuids) -> str:
    """``check_distinct_gpus`` with rank r claiming the GPU ``uuids[r]``: what each rank gets."""
    from neorec.train.distributed import check_distinct_gpus

    try:
        check_distinct_gpus(uuids[rank], group, torch.device("cpu"))
    except ValueError as exc:
        return str(exc)
    return "ok"


def eval_failing_on_rank_0(rank: int, world: int, group, directory: str) -> str:
    """Rank 0's metrics computation raises: what each rank's evaluate() does (none may wait)."""
    import io
    import os

    import neorec.train.trainer as trainer_module
    from neorec.train.distributed import DistributedContext
    from neorec.train.trainer import Trainer

    def failing(logits, labels):
        raise MemoryError("injected: no memory for the eval sort")

    trainer_module.compute_metrics = failing
    context = DistributedContext(rank, world, rank, world, "gloo", torch.device("cpu"), group,
                                 dist.new_group(list(range(world))))
    trainer = Trainer(small_config(os.path.join(directory, f"r{rank}"), 32, 64), out=io.StringIO(), distributed=context)
    try:
        trainer.evaluate(max_batches=2)
    except (MemoryError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def ranks_per_node(rank: int, world: int, group, local_world_sizes: List[int]) -> str:
    """``--plan auto``'s node size, agreed by all ranks; each rank claims ``local_world_sizes[rank]``
    as its LOCAL_WORLD_SIZE. Returns the size, or the error."""
    from types import SimpleNamespace

    from neorec.train.cli import _ranks_per_node

    context = SimpleNamespace(local_world_size=local_world_sizes[rank], embedding_group=group,
                              device=torch.device("cpu"))
    try:
        return str(_ranks_per_node(context))
    except ValueError as exc:
        return f"raised: {exc}"


def state_dict_across_plans(rank: int, world: int, group) -> Dict[str, str]:
    """A sharded collection's state dict loaded under its own plan (rows equal) and under a plan
    whose pieces have the same names and shapes on each rank but hold other rows / columns (was
    accepted, the rows landing in other places)."""
    from neorec.embedding import EmbeddingBagCollection, SparseOptimizerConfig, TableConfig
    from neorec.sharding import Shard, ShardingPlan, ShardingType, TablePlan
    from neorec.sharding.sharder import shard_collection

    tables = [TableConfig("t", 6, 4, ["f"]), TableConfig("u", 3, 4, ["g"])]

    def plan(swap: bool) -> ShardingPlan:
        a, b = (1, 0) if swap else (0, 1)
        return ShardingPlan({"t": TablePlan(ShardingType.ROW_WISE, [Shard(a, 0, 3, 0, 4), Shard(b, 3, 6, 0, 4)]),
                             "u": TablePlan(ShardingType.COLUMN_WISE, [Shard(a, 0, 3, 0, 2), Shard(b, 0, 3, 2, 4)])}, 2)

    def collection(seed: int, swap: bool):
        return shard_collection(EmbeddingBagCollection(tables, SparseOptimizerConfig("sgd"), init_seed=seed),
                                plan(swap), group)

    saved = collection(1, False)
    same, other = collection(2, False), collection(2, True)
    before = {name: other.full_table_weight(name) for name in ("t", "u")}
    same.load_state_dict(saved.state_dict())
    out = {"same": str(all(torch.equal(same.full_table_weight(n), saved.full_table_weight(n)) for n in ("t", "u")))}
    try:
        other.load_state_dict(saved.state_dict())
        out["other"] = "accepted"
    except ValueError as exc:
        out["other"] = str(exc)
    out["other unchanged"] = str(all(torch.equal(other.full_table_weight(n), before[n]) for n in ("t", "u")))
    return out


def load_table_weight_beyond_fp16(rank: int, world: int, group) -> str:
    """load_table_weight of a value beyond fp16's range into fp16 rows: stored as inf without a word
    (set_table_weight refused it)."""
    from neorec.embedding import SparseOptimizerConfig, StorageConfig, TableConfig
    from neorec.sharding import Shard, ShardingPlan, ShardingType, TablePlan
    from neorec.sharding.sharded_collection import ShardedEmbeddingBagCollection

    plan = ShardingPlan({"t": TablePlan(ShardingType.ROW_WISE, [Shard(0, 0, 3, 0, 4), Shard(1, 3, 6, 0, 4)])}, 2)
    collection = ShardedEmbeddingBagCollection([TableConfig("t", 6, 4, ["f"])], plan, group,
                                               SparseOptimizerConfig("sgd"), StorageConfig("fp16"))
    weight = torch.zeros(6, 4)
    weight[4, 2] = 1e5
    try:
        collection.load_table_weight("t", weight)
        return f"accepted: {collection.tbe.get_table_weight(collection.tbe.tables[0].name).tolist()}"
    except ValueError as exc:
        return str(exc)
