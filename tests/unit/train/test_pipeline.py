"""``TrainPipeline`` on one process: the pipelined Trainer equals the plain loop bit for bit (every
step's loss, every table row and optimizer state, every dense weight), with device tables and with
tables behind a cache (whose rows the pipeline prefetches); the step timeline is written.

    python -m pytest tests/unit/train/test_pipeline.py -q
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from neorec.config import load_config
from neorec.data.batch import Batch
from neorec.embedding.cache_prefetch import cached_collections
from neorec.model import dense_parameters
from neorec.train.pipeline import TrainPipeline
from neorec.train.trainer import Trainer

CACHED = ['embedding.location.default="cached_dram"', "embedding.location.cache_rows=192",
          "embedding.location.ways=8", "embedding.location.min_rows=100", "embedding.location.prefetch=true"]


def small_config(directory, pipeline: bool, overrides=()):
    return load_config(None, [
        "data.synthetic.num_tables=3", "data.synthetic.num_embeddings=[60, 400, 900]", "data.synthetic.pooling=3.0",
        "data.synthetic.num_dense=3", "data.synthetic.num_train_samples=1200", "data.synthetic.num_eval_samples=200",
        "data.batch_size=32", "data.eval_batch_size=100", "data.prefetch_batches=2", "model.embedding_dim=8",
        "model.dense_layers=[8]", "model.over_layers=[8]", "train.progress=false", "train.log_every_steps=1",
        "train.eval_every_steps=16", 'embedding.optimizer.kind="rowwise_adagrad"',
        f'train.output_dir="{directory}"', f"train.pipeline={str(pipeline).lower()}", *overrides,
    ])


def losses(directory):
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def table_rows(trainer):
    collection = trainer.model.sparse_arch
    cached = cached_collections(trainer.model)
    out = {}
    for table in collection.tables:
        if cached:
            out[table.name] = cached[0].table_weight(table.name)
            out[table.name + ".state"] = cached[0].optimizer_state(table.name)["momentum1"]
        else:
            out[table.name] = collection.tbe.get_table_weight(table.name)
            out[table.name + ".state"] = collection.tbe.get_optimizer_state(table.name)["momentum1"]
    return out


@pytest.mark.parametrize("placement", ["device", "cached"])
def test_pipelined_trainer_equals_plain_loop_bit_for_bit(tmp_path, placement):
    overrides = CACHED if placement == "cached" else []
    runs = {}
    for pipeline in (False, True):
        directory = tmp_path / f"pipeline_{pipeline}"
        trainer = Trainer(small_config(directory, pipeline, overrides), out=io.StringIO())
        result = trainer.fit()
        runs[pipeline] = (trainer, result, losses(directory))
    (plain, plain_result, plain_losses), (piped, piped_result, piped_losses) = runs[False], runs[True]
    assert plain_result.steps == piped_result.steps == 38  # 1200 / 32, several evaluations in between
    assert len(plain_losses) == 38 and plain_losses == piped_losses  # exact float equality
    assert plain_result.final_eval == piped_result.final_eval
    expected, got = table_rows(plain), table_rows(piped)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    for a, b in zip(dense_parameters(plain.model), dense_parameters(piped.model)):
        assert torch.equal(a, b)
    if placement == "cached":
        for trainer in (plain, piped):  # both loops prefetched (embedding.location.prefetch)
            stats = cached_collections(trainer.model)[0].cache_stats()
            assert sum(s["prefetch_requests"] for s in stats.values()) > 0
            assert sum(s["evictions"] for s in stats.values()) > 0  # the cache is small enough to evict


@pytest.mark.parametrize("prefetch", [False, True])
def test_pipelined_equals_plain_with_a_low_precision_store_and_max_steps_mid_epoch(tmp_path, prefetch):
    """An fp16 store rounds each evicted row, so when rows are evicted changes values: the pipeline
    prefetched whatever embedding.location.prefetch said (records differed from step 3 with it off),
    and the plain loop prefetched the batch after the last step (the final evaluation differed)."""
    overrides = [*CACHED[:-1], f"embedding.location.prefetch={str(prefetch).lower()}",
                 'embedding.location.precision="fp16"', "train.max_steps=30", "train.eval_every_steps=0"]
    results = {}
    for pipeline in (False, True):
        directory = tmp_path / f"{prefetch}_{pipeline}"
        trainer = Trainer(small_config(directory, pipeline, overrides), out=io.StringIO())
        results[pipeline] = (trainer.fit().final_eval, losses(directory), table_rows(trainer))
        requests = sum(s["prefetch_requests"] for s in cached_collections(trainer.model)[0].cache_stats().values())
        assert (requests > 0) == prefetch
    (plain_eval, plain_losses, plain_rows), (piped_eval, piped_losses, piped_rows) = results[False], results[True]
    assert len(plain_losses) == 30 and plain_losses == piped_losses and plain_eval == piped_eval
    for name in plain_rows:
        assert torch.equal(plain_rows[name], piped_rows[name]), name


def test_a_batch_that_fails_to_load_or_has_a_bad_id_stops_the_run_after_the_step_before_it(tmp_path):
    """The pipeline fetches batch i + 1 before step i: an error there threw step i away (and with it
    a checkpoint due at that step); the plain loop trains it first."""
    trainer = Trainer(small_config(tmp_path, True), out=io.StringIO())
    sparse = next(iter(trainer.source.eval_batches(2))).sparse
    batches = [(Batch(torch.randn(2, 3), sparse, torch.zeros(2)), i) for i in range(4)]

    def failing_at(index):
        for item in batches:
            if item[1] == index:
                raise OSError(f"read error in batch {index}")
            yield item

    trained = []
    with pytest.raises(OSError, match="read error in batch 2"):
        for _, extra, hooks in TrainPipeline(trainer.model, "cpu").run(failing_at(2)):
            trained.append(extra)
    assert trained == [0, 1]

    class BadLaunch:  # a sharded collection whose launch of batch 2 (its second) finds a bad id
        def __init__(self):
            self.launched = []

        def launch_input_dist(self, kjt):
            self.launched.append(kjt.batch_size)
            if len(self.launched) == 2:
                raise ValueError("id outside its table in batch 2")

        def progress_launched_input_dist(self):
            pass

        def drop_launched_input_dist(self):
            pass

    # a bad id found while launching batch 2's exchange (during step 1) stopped the run at once, step 1
    # lost; now an empty exchange goes in its place (the other ranks launched theirs: the collectives
    # keep pairing), step 1 trains, and the error is raised after it
    pipeline = TrainPipeline(trainer.model, "cpu")
    collection = BadLaunch()
    pipeline._sharded = [collection]
    trained = []
    with pytest.raises(ValueError, match="id outside its table in batch 2"):
        for _, extra, hooks in pipeline.run(batches):
            hooks.after_forward()
            hooks.after_backward()
            trained.append(extra)
    assert trained == [0, 1]
    assert collection.launched == [2, 2, 0]  # batch 1, batch 2 (refused), then the empty stand-in


def test_pipeline_yields_every_batch_once_in_order_and_hooks_are_single_use(tmp_path):
    trainer = Trainer(small_config(tmp_path, True), out=io.StringIO())
    batches = [(Batch(torch.randn(2, 3), trainer.source.eval_batches(2).__iter__().__next__().sparse,
                      torch.zeros(2)), i) for i in range(4)]
    pipeline = TrainPipeline(trainer.model, "cpu")
    seen = []
    for batch, extra, hooks in pipeline.run(batches):
        seen.append(extra)
        hooks.after_forward()  # no sharded collection: nothing to launch, still checked
        with pytest.raises(RuntimeError, match="called twice"):
            hooks.after_forward()
        hooks.after_backward()
    assert seen == [0, 1, 2, 3]
    taken = []

    def counted():
        for item in batches:
            taken.append(item[1])
            yield item

    assert [extra for _, extra, _ in TrainPipeline(trainer.model, "cpu").run(counted(), max_items=2)] == [0, 1]
    assert taken == [0, 1]  # no batch loaded past max_items
    assert list(TrainPipeline(trainer.model, "cpu").run(batches, max_items=0)) == []
    with pytest.raises(TypeError, match="expects \\(Batch, extra\\) pairs"):
        list(TrainPipeline(trainer.model, "cpu").run([1, 2]))


def test_profile_writes_timeline(tmp_path):
    """Checkpoint saves and the logging after a step were outside every step: the steps did not add
    up to the training time and a save's cost showed nowhere. Saves are now a phase of their own."""
    checkpoints = [f"checkpoint.dir='{tmp_path / 'ck'}'", "checkpoint.every_steps=2", "checkpoint.save_final=false"]
    trainer = Trainer(small_config(tmp_path, True, ["train.profile=true", "train.max_steps=6", *checkpoints]),
                      out=io.StringIO())
    trainer.fit()
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert timeline["steps"] == 6 and timeline["pipeline"] is True
    phases = timeline["phases"]
    assert set(phases) == {"data_loading", "input_dist", "lookup", "dense_forward", "output_dist", "backward",
                           "optimizer", "checkpoint", "other"}
    assert phases["lookup"]["seconds"] > 0 and phases["backward"]["seconds"] > 0
    assert phases["optimizer"]["seconds"] > 0 and phases["dense_forward"]["seconds"] > 0
    assert phases["checkpoint"]["seconds"] > 0 and len(trainer.checkpointer.bytes_written) == 3
    total = sum(p["seconds"] for p in phases.values())
    assert total == pytest.approx(timeline["step_ms"] * 6 / 1e3, rel=1e-6)  # the phases partition the steps
    assert "step timeline (6 steps" in trainer.out.getvalue()


def test_with_prefetch_takes_no_item_past_max_items_without_cached_tables(tmp_path):
    """Without cached tables it pulled item max_items + 1 before stopping (raising that item's
    error, if it had one)."""
    from neorec.embedding.cache_prefetch import with_prefetch

    trainer = Trainer(small_config(tmp_path, False), out=io.StringIO())
    pulled = []

    def items():
        for i in range(5):
            pulled.append(i)
            if i == 2:
                raise OSError("batch 2 is malformed")
            yield i

    assert list(with_prefetch(items(), trainer.model, max_items=2)) == [0, 1] and pulled == [0, 1]
