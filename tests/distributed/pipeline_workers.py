"""Rank workers of tests/distributed/test_pipeline.py (spawned by harness.run_ranks)."""

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
    piped = _fit(rank, world, group, os.path.join(directory, "piped"), ["train.pipeline=true", *plan_overrides])
    report = {"steps": (plain["result"].steps, piped["result"].steps),
              "losses_equal": plain["losses"] == piped["losses"], "num_losses": len(piped["losses"]),
              "tables_equal": all(torch.equal(plain["tables"][n], piped["tables"][n]) for n in plain["tables"]),
              "dense_equal": len(plain["dense"]) > 0 and all(
                  torch.equal(a, b) for a, b in zip(plain["dense"], piped["dense"])),
              "eval_equal": plain["result"].final_eval == piped["result"].final_eval, "counts": counts}
    del plain, piped
    return report
