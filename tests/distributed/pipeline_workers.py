"""Rank workers of tests/distributed/test_pipeline_and_qcomm.py (spawned by harness.run_ranks)."""

from __future__ import annotations

import io
import json
import os
from typing import Dict, List

import torch
import torch.distributed as dist

from workers import small_config


def _fit(rank: int, world: int, group, directory: str, overrides) -> Dict:
    from neorec.train.distributed import DistributedContext
    from neorec.train.trainer import Trainer

    context = DistributedContext(rank, world, rank, world, "gloo", torch.device("cpu"), group,
                                 dist.new_group(list(range(world))))
    trainer = Trainer(small_config(directory, 32, 64, ["train.log_every_steps=1", *overrides]), out=io.StringIO(),
                      distributed=context)
    result = trainer.fit()
    collection = trainer.model.module.sparse_arch
    tables = {t.name: collection.full_table_weight(t.name) for t in collection.tables}
    dense = [p.detach().clone() for p in trainer.model.module.parameters() if p is not None
             and not any(p is q for q in collection.parameters())]
    losses: List[float] = []
    if rank == 0:
        records = [json.loads(line) for line in open(os.path.join(directory, "metrics.jsonl"))]
        losses = [r["loss"] for r in records if r["kind"] == "train"]
    return {"result": result, "tables": tables, "dense": dense, "losses": losses, "trainer": trainer}


def pipeline_parity(rank: int, world: int, group, directory: str, plan_overrides) -> Dict:
    """Pipelined and plain distributed Trainers (same config, 2 ranks, an eval every 8 steps):
    returns whether their losses, tables and dense weights are equal bit for bit."""
    from neorec.sharding.sharded_collection import ShardedEmbeddingBagCollection

    counts = {"launched": 0, "used": 0}
    launch, local_batch = ShardedEmbeddingBagCollection.launch_input_dist, ShardedEmbeddingBagCollection._local_batch

    def counting_launch(self, features):
        counts["launched"] += 1
        return launch(self, features)

    def counting_local_batch(self, features):
        pending = self._launched
        if pending is not None and pending[0] is features.values:
            counts["used"] += 1
        return local_batch(self, features)

    ShardedEmbeddingBagCollection.launch_input_dist = counting_launch
    ShardedEmbeddingBagCollection._local_batch = counting_local_batch
    plain = _fit(rank, world, group, os.path.join(directory, "plain"), ["train.pipeline=false", *plan_overrides])
    # the pipelined run is also profiled: the timed step must give the same bits
    piped = _fit(rank, world, group, os.path.join(directory, "piped"),
                 ["train.pipeline=true", "train.profile=true", *plan_overrides])
    report = {"steps": (plain["result"].steps, piped["result"].steps),
              "losses_equal": plain["losses"] == piped["losses"], "num_losses": len(piped["losses"]),
              "tables_equal": all(torch.equal(plain["tables"][n], piped["tables"][n]) for n in plain["tables"]),
              "dense_equal": len(plain["dense"]) > 0 and all(
                  torch.equal(a, b) for a, b in zip(plain["dense"], piped["dense"])),
              "eval_equal": plain["result"].final_eval == piped["result"].final_eval, "counts": counts}
    del plain, piped
    return report


def codec_exchange(rank: int, world: int, group) -> Dict:
    """The quantized all-to-all against the fp32 one on the same blocks: forward values and
    gradients within each codec's bound, encoded bytes counted by CommStats."""
    from neorec.sharding.comm import CommStats, differentiable_all_to_all
    from neorec.sharding.qcomm import CommConfig, quantized_all_to_all

    rows = [5 + 3 * r for r in range(world)]  # samples of each rank
    dims = [7 + 4 * r for r in range(world)]  # columns held by each rank (odd: unaligned fp16 / int8 blocks)
    generator = torch.Generator().manual_seed(rank)
    send_shapes = [(rows[r], dims[rank]) for r in range(world)]
    recv_shapes = [(rows[rank], dims[r]) for r in range(world)]
    values = torch.randn(sum(a * b for a, b in send_shapes), generator=generator) * 0.1
    upstream = torch.randn(sum(a * b for a, b in recv_shapes), generator=generator) * 1e-6
    out: Dict = {}
    reference_in = values.clone().requires_grad_()
    stats = CommStats()
    reference = differentiable_all_to_all(reference_in, [a * b for a, b in send_shapes],
                                          [a * b for a, b in recv_shapes], group, stats, "x").wait()
    reference.backward(upstream)
    out["fp32_bytes"] = stats.snapshot()
    for codec in ("fp32", "fp16", "bf16", "int8", "int8/fp16"):
        forward, backward = codec.split("/") if "/" in codec else (codec, codec)
        stats = CommStats()
        tensor = values.clone().requires_grad_()
        got = quantized_all_to_all(tensor, send_shapes, recv_shapes, group, CommConfig(forward, backward), stats,
                                   "x").wait()
        got.backward(upstream)
        out[codec] = {"forward_error": float((got - reference).abs().max()),
                      "backward_error": float((tensor.grad - reference_in.grad).abs().max()),
                      "forward_scale": float(reference.abs().max()),
                      "backward_scale": float(reference_in.grad.abs().max()), "bytes": stats.snapshot()}
        with torch.no_grad():  # evaluation: same values, no graph
            out[codec]["no_grad_equal"] = torch.equal(quantized_all_to_all(
                values, send_shapes, recv_shapes, group, CommConfig(forward, backward), None, "x").wait(),
                got.detach())
    return out


def codec_training(rank: int, world: int, group, directory: str) -> Dict:
    """Distributed training (a plan with row-wise, column-wise, table-wise and data-parallel
    tables) with each codec both ways: final NE, and the bytes of the pooled exchange."""
    from neorec.embedding import TableConfig
    from neorec.sharding import ShardingPlan, column_wise, data_parallel, row_wise, table_wise
    from neorec.sharding.comm import CommStats
    from neorec.train.distributed import DistributedContext
    from neorec.train.trainer import Trainer

    tables = [TableConfig(f"t_feature_{i}", rows, 8) for i, rows in enumerate([60, 200, 25, 90])]
    plan = ShardingPlan({tables[0].name: column_wise(tables[0], [1, 0]), tables[1].name: row_wise(tables[1], [0, 1]),
                         tables[2].name: data_parallel(), tables[3].name: table_wise(tables[3], 1)}, 2)
    dense_group = dist.new_group(list(range(world)))
    out = {}
    for codec in ("fp32", "fp16", "bf16", "int8"):
        context = DistributedContext(rank, world, rank, world, "gloo", torch.device("cpu"), group, dense_group)
        stats = CommStats()
        cfg = small_config(os.path.join(directory, codec), 64, 128, [
            "data.synthetic.num_tables=4", "data.synthetic.num_embeddings=[60, 200, 25, 90]",
            "data.synthetic.num_train_samples=3000", "data.synthetic.num_eval_samples=1000", "train.epochs=2",
            'embedding.optimizer.kind="sgd"', "embedding.optimizer.learning_rate=0.1",
            f'embedding.comm.forward="{codec}"', f'embedding.comm.backward="{codec}"'])
        trainer = Trainer(cfg, out=io.StringIO(), distributed=context, plan=plan, comm_stats=stats)
        result = trainer.fit()
        out[codec] = {"ne": result.final_eval["ne"], "auc": result.final_eval["auc"],
                      "bytes": stats.bytes_sent.get("output_dist", 0),
                      "backward_bytes": stats.bytes_sent.get("output_dist.backward", 0)}
        del trainer
    return out


def _small_trainer(rank: int, world: int, group, directory: str, overrides=()):
    """This rank's distributed Trainer of the small config, writing under ``directory/rank<r>``."""
    from neorec.train.distributed import DistributedContext
    from neorec.train.trainer import Trainer

    context = DistributedContext(rank, world, rank, world, "gloo", torch.device("cpu"), group,
                                 dist.new_group(list(range(world))))
    return Trainer(small_config(os.path.join(directory, f"rank{rank}"), 32, 64, overrides), out=io.StringIO(),
                   distributed=context)


def fail_between_forward_and_backward(rank: int, world: int, group, directory: str) -> str:
    """Rank 1 raises between its third step's forward and backward, while the pipeline has the
    next batch's id exchange launched; returns what each rank raised."""
    from neorec.train.pipeline import StepHooks

    calls = {"n": 0}
    after_forward = StepHooks.after_forward

    def failing(self):
        after_forward(self)
        calls["n"] += 1
        if rank == 1 and calls["n"] == 3:
            raise RuntimeError("injected failure after the forward of step 3")

    StepHooks.after_forward = failing
    trainer = _small_trainer(rank, world, group, directory)
    try:
        trainer.fit()
    except RuntimeError as exc:
        return f"raised: {exc}"
    return "finished"


def fail_on_one_rank(rank: int, world: int, group, directory: str, how: str, pipeline: bool = True) -> str:
    """Rank 1's third batch fails to load (an I/O error on one node: ``how`` "load") or holds an id
    outside its table ("id"), or its source fails when asked for a batch past the epoch's last
    ("end"); returns what each rank raised, at which step, or "finished" and the step."""
    from neorec.data.batch import Batch
    from neorec.sparse.jagged import KeyedJaggedTensor
    from neorec.train.trainer import Trainer

    train_batches = Trainer._train_batches

    def failing(self, epoch, start_batch):
        if how == "end":  # every batch of the epoch, then a failure asked for one more
            yield from train_batches(self, epoch, start_batch)
            if rank == 1:
                raise OSError("injected: rank 1 failed past the epoch's last batch")
            return
        for count, (batch, size) in enumerate(train_batches(self, epoch, start_batch)):
            if rank == 1 and count == 2:
                if how == "load":
                    raise OSError("injected: batch 3 could not be read on rank 1")
                sparse = batch.sparse
                values = sparse.values.clone()
                values[0] = 10**9
                batch = Batch(batch.dense, KeyedJaggedTensor(sparse.keys(), values, sparse.lengths, sparse.weights,
                                                             batch_size=sparse.batch_size), batch.labels)
            yield batch, size

    Trainer._train_batches = failing
    trainer = _small_trainer(rank, world, group, directory, [f"train.pipeline={str(pipeline).lower()}"])
    try:
        trainer.fit()
    except (OSError, RuntimeError, ValueError) as exc:
        return f"step {trainer.step}: {type(exc).__name__}: {exc}"
    return f"finished at step {trainer.step}"
