"""Tables off the device in sharded training: each rank's pieces of a cached table sit in stores
behind caches of their own; training equals the same plan with every table on the device, bit for
bit (fp32 stores), and its checkpoints restore into one process with device tables.

    python -m pytest tests/distributed/test_sharded_cached.py -q
"""

from __future__ import annotations

import io
import json
import pytest
import torch

import checkpoint_workers
from harness import run_ranks
from neorec.embedding import TableConfig
from neorec.sharding import ShardingPlan, column_wise, data_parallel, row_wise
from neorec.train.checkpoint import verify_checkpoint
from neorec.train.trainer import Trainer
from workers import small_config

TABLES = [TableConfig(f"t_feature_{i}", rows, 8) for i, rows in enumerate([60, 200, 25])]
PLAN = ShardingPlan({TABLES[0].name: column_wise(TABLES[0], [1, 0], widths=[3, 5]),
                     TABLES[1].name: row_wise(TABLES[1], [0, 1]),
                     TABLES[2].name: data_parallel()}, 2).to_json()
# t_feature_0's column pieces and t_feature_1's row pieces behind caches of 10% of their rows (they
# grow to a batch's distinct rows, then evict); the data-parallel table stays on the device
CACHED = ["embedding.location.default='cached_ssd'", 'embedding.location.tables={ t_feature_2 = "device" }',
          "embedding.location.cache_fraction=0.1"]


@pytest.mark.filterwarnings("ignore:cache of table .* growing it:RuntimeWarning")
def test_cached_pieces_train_as_device_pieces_and_checkpoint_as_logical_tables(tmp_path):
    common = ["train.max_steps=5", 'embedding.optimizer.kind="adam"']
    device = run_ranks(checkpoint_workers.train_or_resume, 2, tmp_path / "device",
                       args=(str(tmp_path / "device"), PLAN, common, None))[0]
    saving = [*common, *CACHED, f"checkpoint.dir='{tmp_path / 'ckpt'}'", "checkpoint.every_steps=2",
              "checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=100.0"]
    cached = run_ranks(checkpoint_workers.train_or_resume, 2, tmp_path / "cached",
                       args=(str(tmp_path / "cached"), PLAN, saving, None))[0]
    stores = sorted(p.name for p in (tmp_path / "cached" / "run2" / "embedding_ssd").iterdir() if p.is_dir())
    assert stores == ["t_feature_0@0", "t_feature_0@1", "t_feature_1@0", "t_feature_1@1"]
    assert device.keys() == cached.keys()
    for key in device:
        assert torch.equal(device[key], cached[key]), key

    # the planner's tiers place tables too (the cache and store settings from [embedding.location])
    tiered = json.loads(PLAN)
    tiered["tables"]["t_feature_0"]["tier"] = "dram"
    tiered["tables"]["t_feature_1"]["tier"] = "cached_ssd"
    planned = run_ranks(checkpoint_workers.train_or_resume, 2, tmp_path / "planned",
                        args=(str(tmp_path / "planned"), json.dumps(tiered), common, None))[0]
    assert sorted(p.name for p in (tmp_path / "planned" / "run2" / "embedding_ssd").iterdir() if p.is_dir()) == [
        "t_feature_1@0", "t_feature_1@1"]
    for key in device:
        assert torch.equal(device[key], planned[key]), key

    manifest = verify_checkpoint(tmp_path / "ckpt" / "step-000000005")
    assert manifest["kind"] == "incremental" and len(manifest["chain"]) == 3
    assert any(f.startswith("rank1-") for f in manifest["files"])  # rank 1's cached pieces, in chunk files
    single = Trainer(small_config(str(tmp_path / "run1"), 128, 64, common), out=io.StringIO(),
                     resume=str(tmp_path / "ckpt"))
    single.fit()  # step 5 = max_steps: restores, trains nothing
    assert single.step == 5
    for table in TABLES:
        assert torch.equal(single.model.sparse_arch.tbe.get_table_weight(table.name), cached[table.name]), table.name
    for key, value in single.model.state_dict().items():
        if not key.startswith("sparse_arch"):
            assert torch.equal(value, cached[key]), key


@pytest.mark.filterwarnings("ignore:cache of table .* growing it:RuntimeWarning")
def test_cached_pieces_prefetch_the_next_batch_from_the_pipelines_exchange(tmp_path):
    """``embedding.location.prefetch`` in a sharded run: each rank learns its pieces' ids of batch
    i + 1 from the pipeline's look-ahead exchange and loads their rows after step i's backward.
    Training equals the run without prefetch bit for bit (fp32 stores: where a row sits changes no
    value), and rows the prefetch loaded are hits of the next lookup."""
    common = ["train.max_steps=6", *CACHED, "embedding.location.cache_fraction=0.3"]
    runs = {}
    for prefetch in ("false", "true"):
        runs[prefetch] = run_ranks(checkpoint_workers.train_with_cache_stats, 2, tmp_path / prefetch,
                                   args=(str(tmp_path / prefetch), PLAN,
                                         [*common, f"embedding.location.prefetch={prefetch}"]))
    for rank in range(2):
        off, on = runs["false"][rank], runs["true"][rank]
        assert off.keys() == on.keys()
        for key in off:
            if key != "cache":
                assert torch.equal(off[key], on[key]), (rank, key)
        (hits_off, misses_off, loads_off), (hits_on, misses_on, loads_on) = off["cache"].tolist(), on["cache"].tolist()
        assert loads_off == 0 and loads_on > 0, (off["cache"], on["cache"])
        assert hits_on + misses_on == hits_off + misses_off  # the same lookups
        assert misses_on < misses_off and hits_on > hits_off, (off["cache"], on["cache"])
    # the plain loop exchanges each batch's ids in its own forward: nothing to prefetch from
    with pytest.raises(AssertionError, match="prefetch = true in a sharded run needs train.pipeline = true"):
        run_ranks(checkpoint_workers.train_with_cache_stats, 2, tmp_path / "plain",
                  args=(str(tmp_path / "plain"), PLAN, [*common, "embedding.location.prefetch=true",
                                                         "train.pipeline=false"]))


def test_a_data_parallel_table_off_the_device_is_refused(tmp_path):
    messages = run_ranks(checkpoint_workers.build_with_locations, 2, tmp_path,
                         args=([t.name for t in TABLES], [t.num_embeddings for t in TABLES], PLAN,
                               {"t_feature_2": "cached_dram"}))
    assert all("tables ['t_feature_2'] are data-parallel in the plan and placed off the device (cached_dram)" in m
               for m in messages), messages


def test_a_plan_tier_needs_a_location_of_that_kind(tmp_path):
    tiered = json.loads(PLAN)
    tiered["tables"]["t_feature_1"]["tier"] = "cached_dram"
    messages = run_ranks(checkpoint_workers.build_with_locations, 2, tmp_path,
                         args=([t.name for t in TABLES], [t.num_embeddings for t in TABLES], json.dumps(tiered), {}))
    assert all("the plan places tables {'t_feature_1': 'cached_dram'} off the device" in m for m in messages), messages


@pytest.mark.parametrize("overrides", [[], ["embedding.storage.precision='fp16'"], CACHED,
                                       [*CACHED, "embedding.location.precision='fp16'"],
                                       [*CACHED, "embedding.location.default='cached_dram'"]])
def test_each_rank_builds_its_own_pieces_equal_to_the_single_process_model(tmp_path, overrides, monkeypatch):
    """A sharded Trainer no longer builds the whole model on every rank before sharding it: its
    pieces (column, row, data-parallel; on the device, in fp16, or in fp32 or fp16 stores) get the
    single-process model's initial rows and start equal to it, bit for bit, as do the dense weights.
    (fp16 stores: rounded to nearest as one process's fill rounds, not stochastically.) With blocks
    of 16 rows (the tables are 8 wide), each rank draws only the blocks its pieces span: the row-wise
    table's rows 0..100 on rank 0 (blocks 0-6), 100..200 on rank 1 (blocks 6-12); all of the
    column-wise and data-parallel tables."""
    from neorec.embedding import init_stream

    sharded = run_ranks(checkpoint_workers.initial_state, 2, tmp_path / "ranks",
                        args=(str(tmp_path), PLAN, overrides, 16 * 8))
    monkeypatch.setattr(init_stream, "INIT_CHUNK", 16 * 8)
    single = Trainer(small_config(str(tmp_path / "one"), 128, 64, overrides), out=io.StringIO())
    arch = single.model.sparse_arch
    weight = arch.table_weight if hasattr(arch, "caches") else arch.tbe.get_table_weight
    for rank, result in enumerate(sharded):
        drawn = result.pop("drawn")
        assert drawn[TABLES[0].name] == list(range(4)) and drawn[TABLES[2].name] == [0, 1]
        assert drawn[TABLES[1].name] == (list(range(7)) if rank == 0 else list(range(6, 13))), drawn
        assert result.keys() == {t.name for t in TABLES} | {k for k in single.model.state_dict()
                                                           if not k.startswith("sparse_arch")}
        for table in TABLES:
            assert torch.equal(result[table.name], weight(table.name)), table.name
        for key, value in single.model.state_dict().items():
            if not key.startswith("sparse_arch"):
                assert torch.equal(result[key], value), key


def test_the_documented_two_rank_run_of_tiny_cached_ssd_grows_no_cache(tmp_path):
    """`neorec train --config configs/tiny_cached_ssd.toml --nproc 2`, as its comment and the README
    give it, warned that t_feature_0's piece needed 249 distinct rows of its 224 slots (each piece
    sees the global batch of 512): the 40% caches its comment called enough were not."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "neorec", "train", "--config", str(root / "configs" / "tiny_cached_ssd.toml"),
                          "--nproc", "2", "--max-steps", "8", "--no-progress", "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr
    assert "warning" not in run.stdout + run.stderr and "embedding cache: t_feature_0 hit rate" in run.stdout, run.stdout


def test_prefetch_without_the_pipeline_trains_when_no_table_is_cached(tmp_path):
    """Only cached rows are prefetched: tables in host DRAM with prefetch on and --no-pipeline were
    refused as if cached rows needed the pipeline's look-ahead (one process accepted it)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "neorec", "train", "--config", str(root / "configs" / "tiny.toml"),
                          "--nproc", "2", "--no-pipeline", "--max-steps", "3", "--no-progress", "--output-dir",
                          str(tmp_path), "--set", "embedding.location.default='dram'",
                          "--set", "embedding.location.prefetch=true"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0 and "final eval: AUC" in run.stdout, run.stderr
