"""Checkpoints of tables off the device (``embedding.location``: cached in front of DRAM or SSD,
or "dram"): resume equals uninterrupted training bit for bit with fp32 stores, whatever the
cache holds when the checkpoint is taken; checkpoints move between locations; incremental
checkpoints write only the rows trained since; a cached table is saved in chunks of rows, one
file each, every one verified.

    python -m pytest tests/unit/train/test_checkpoint_cached.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from neorec.embedding.cached import CachedEmbeddingBagCollection
from neorec.embedding.init_stream import TableInit
from neorec.embedding.storage import RowStore
from neorec.train import checkpoint_files, checkpoint_tables
from neorec.train.checkpoint import verify_checkpoint
from tests.unit.train.test_checkpoint import assert_identical, checkpoint_args, make_trainer

# tables of 60, 200, 400 and 30 rows: min_rows=100 puts the middle two off the device; a cache of
# 10% (20 / 40 slots) is smaller than a batch's distinct rows, so the caches grow in the first step
# and rows are evicted and written back on every later one
# (SSD stores go to each run's <train.output_dir>/embedding_ssd)
CACHED = ["embedding.location.min_rows=100", "embedding.location.cache_fraction=0.1"]
pytestmark = pytest.mark.filterwarnings("ignore:cache of table .* growing it:RuntimeWarning")


def located(tmp_path, kind):
    return [f"embedding.location.default='{kind}'", *CACHED]


def snapshot(trainer):
    """Every table (rows and optimizer state, as training sees them) and the dense state."""
    arch = trainer.model.sparse_arch
    out = {}
    for table in arch.tables:
        if isinstance(arch, CachedEmbeddingBagCollection):
            weight, state = arch.table_weight(table.name), arch.optimizer_state(table.name)
        else:
            weight, state = arch.tbe.get_table_weight(table.name), arch.tbe.get_optimizer_state(table.name)
        out[f"{table.name}.w"] = weight
        out.update({f"{table.name}.{k}": v for k, v in state.items()})
    out.update({k: v.clone() for k, v in trainer.model.state_dict().items() if not k.startswith("sparse_arch")})
    for index, state in trainer.dense_optimizer.state_dict()["state"].items():
        out.update({f"opt{index}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    out["step"] = torch.tensor(trainer.step)
    return out


@pytest.mark.parametrize("kind,optimizer,prefetch", [("cached_ssd", "rowwise_adagrad", False),
                                                     ("cached_dram", "adam", False), ("cached_ssd", "sgd", True),
                                                     ("dram", "adagrad", False)])
def test_resume_of_tables_off_the_device_equals_uninterrupted_training(tmp_path, kind, optimizer, prefetch, monkeypatch):
    """(prefetch: the next batch's rows load in a worker thread while a step trains and a
    checkpoint is saved.) The resumed run neither draws initial rows nor fills its stores with
    them: the checkpoint sets every row."""
    settings = [*located(tmp_path, kind), f"embedding.optimizer.kind='{optimizer}'",
                f"embedding.location.prefetch={str(prefetch).lower()}"]
    reference = make_trainer(tmp_path, *settings, "train.max_steps=12", name="ref")
    reference.fit()
    first = make_trainer(tmp_path, *settings, "train.max_steps=5", *checkpoint_args(tmp_path, 5))
    first.fit()
    arch = first.model.sparse_arch
    assert isinstance(arch, CachedEmbeddingBagCollection)
    assert sorted(n for n, loc in arch.locations.items() if loc.kind != "device") == ["t_feature_1", "t_feature_2"]
    if kind != "dram":  # dirty rows sat in the caches (flushed at the end of fit, after the checkpoint)
        assert all(c.stats.write_backs > 0 for c in arch.caches.values())
    fills, draws = [], []
    monkeypatch.setattr(RowStore, "fill", lambda store, *args, **kwargs: fills.append(store))
    monkeypatch.setattr(TableInit, "_block", lambda init, k: draws.append((init.name, k)))
    resumed = make_trainer(tmp_path, *settings, "train.max_steps=12", resume=str(tmp_path / "ckpt"), name="resumed")
    assert fills == [] and draws == []
    resumed.fit()
    assert resumed.step == 12
    assert_identical(snapshot(reference), snapshot(resumed))


def test_a_checkpoint_is_taken_with_dirty_rows_in_the_cache_and_leaves_training_as_it_was(tmp_path):
    """The rows are read where they are (dirty slots, the store): saving neither flushes nor evicts,
    so a run that checkpoints every step trains exactly as one that does not."""
    settings = located(tmp_path, "cached_ssd")
    reference = make_trainer(tmp_path, *settings, "train.max_steps=6", name="ref")
    reference.fit()
    saving = make_trainer(tmp_path, *settings, "train.max_steps=6",
                          *checkpoint_args(tmp_path, 1, "checkpoint.keep_last=6"))
    writes = []
    caches = saving.model.sparse_arch.caches
    original = saving.checkpointer.save

    def save():
        writes.append({n: (int(c.dirty.sum()), c.stats.write_backs) for n, c in caches.items()})
        path = original()
        assert {n: (int(c.dirty.sum()), c.stats.write_backs) for n, c in caches.items()} == writes[-1]
        return path

    saving.checkpointer.save = save
    saving.fit()
    assert len(writes) == 6 and all(dirty > 0 for record in writes for dirty, _ in record.values())
    assert_identical(snapshot(reference), snapshot(saving))


@pytest.mark.parametrize("first_kind,second_kind", [("cached_ssd", "device"), ("device", "cached_dram"),
                                                    ("cached_dram", "dram")])
def test_checkpoints_move_between_table_locations(tmp_path, first_kind, second_kind):
    """Checkpoints hold logical tables: a run resumes with its tables elsewhere (fp32 stores train
    as device tables do, bit for bit)."""
    reference = make_trainer(tmp_path, *located(tmp_path, second_kind), "train.max_steps=10", name="ref")
    reference.fit()
    make_trainer(tmp_path, *located(tmp_path, first_kind), "train.max_steps=4", *checkpoint_args(tmp_path, 4)).fit()
    resumed = make_trainer(tmp_path, *located(tmp_path, second_kind), "train.max_steps=10",
                           resume=str(tmp_path / "ckpt"), name="resumed")
    resumed.fit()
    assert_identical(snapshot(reference), snapshot(resumed))


def test_incremental_checkpoints_of_cached_tables_hold_the_rows_trained_since(tmp_path):
    extra = ["checkpoint.incremental=true", "checkpoint.full_when_fraction_exceeds=100.0", "checkpoint.keep_last=10"]
    settings = located(tmp_path, "cached_ssd")
    trainer = make_trainer(tmp_path, *settings, "train.max_steps=9", *checkpoint_args(tmp_path, 3, *extra))
    seen = {}
    arch = trainer.model.sparse_arch
    lookup = CachedEmbeddingBagCollection._map_to_slots

    def record(self, features, update):  # the distinct ids each training step of a cached table looks up
        if update:
            for name in self.caches:
                table = self._table_of[name]
                ids = torch.cat([features[f].values for f in table.feature_names])
                seen.setdefault(name, []).append(set(ids.tolist()))
        return lookup(self, features, update)

    arch._map_to_slots = record.__get__(arch)
    trainer.fit()
    assert [r["kind"] for r in trainer.checkpointer.bytes_written] == ["full", "incremental", "incremental"]
    for step, name in ((6, "step-000000006"), (9, "step-000000009")):
        manifest = verify_checkpoint(tmp_path / "ckpt" / name)
        entries = [e for es in manifest["pieces"].values() for e in es]
        for table in ("t_feature_1", "t_feature_2"):
            (entry,) = [e for e in entries if e["table"] == table]  # one chunk: 8 MiB of rows
            trained = set().union(*seen[table][step - 3 : step])
            assert entry["num_rows_written"] == len(trained) < {"t_feature_1": 200, "t_feature_2": 400}[table]
            assert entry["rows"] == [min(trained), max(trained) + 1]  # the span of its rows
    reference = make_trainer(tmp_path, *settings, "train.max_steps=12", name="ref")
    reference.fit()
    resumed = make_trainer(tmp_path, *settings, "train.max_steps=12", resume=str(tmp_path / "ckpt"), name="resumed")
    resumed.fit()
    assert_identical(snapshot(reference), snapshot(resumed))


def test_a_cached_table_is_saved_in_chunks_of_rows_each_file_verified(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_tables, "CHUNK_BYTES", 64 * 4 * 5)  # dim 4 + row-wise state: 64 rows a chunk
    settings = located(tmp_path, "cached_dram")
    make_trainer(tmp_path, *settings, "train.max_steps=4", *checkpoint_args(tmp_path, 4)).fit()
    path = tmp_path / "ckpt" / "step-000000004"
    manifest = verify_checkpoint(path)
    chunks = sorted(f for f in manifest["files"] if f.startswith("rank0-"))
    assert len(chunks) == -(-200 // 64) + -(-400 // 64) == 11
    assert sorted(p.name for p in path.glob("rank0-*.pt")) == chunks
    rows = {}
    for file in chunks:
        (entry,) = manifest["pieces"][file]
        assert entry["rows"][1] - entry["rows"][0] == entry["num_rows_written"] <= 64
        rows.setdefault(entry["table"], []).append(tuple(entry["rows"]))
    assert {t: sorted(r)[0][0] for t, r in rows.items()} == {"t_feature_1": 0, "t_feature_2": 0}
    assert {t: sorted(r)[-1][1] for t, r in rows.items()} == {"t_feature_1": 200, "t_feature_2": 400}
    assert json.loads((path / "rank0.json").read_text())["files"][0]["file"] == "rank0.pt"
    reference = make_trainer(tmp_path, *settings, "train.max_steps=8", name="ref")
    reference.fit()
    monkeypatch.setattr(checkpoint_files, "MAPPED_BYTES", 1)  # one file mapped at a time
    loads = []
    tensors = checkpoint_files.MappedFiles.tensors

    def counted(self, file):
        out = tensors(self, file)
        loads.append((file.name, len(self.mapped)))
        return out

    monkeypatch.setattr(checkpoint_files.MappedFiles, "tensors", counted)
    resumed = make_trainer(tmp_path, *settings, "train.max_steps=8", resume=str(tmp_path / "ckpt"), name="resumed")
    resumed.fit()
    assert_identical(snapshot(reference), snapshot(resumed))
    assert {name for name, _ in loads} == {"rank0.pt", *chunks} and max(n for _, n in loads) == 1
    data = bytearray((path / chunks[3]).read_bytes())  # one chunk corrupt: the checkpoint is
    data[len(data) // 2] ^= 0xFF
    (path / chunks[3]).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{chunks[3]} fails its sha256 checksum"):
        verify_checkpoint(path)


def test_a_low_precision_store_takes_the_checkpoint_rows_rounded(tmp_path):
    """An fp16 store: the restored rows are the checkpoint's to within half an fp16 step (the cache
    slots are fp32, the store rounds stochastically)."""
    settings = [*located(tmp_path, "cached_ssd"), "embedding.location.precision='fp16'"]
    first = make_trainer(tmp_path, *settings, "train.max_steps=4", *checkpoint_args(tmp_path, 4))
    first.fit()
    saved = {t: first.model.sparse_arch.table_weight(t) for t in ("t_feature_1", "t_feature_2")}
    resumed = make_trainer(tmp_path, *settings, "train.max_steps=4", resume=str(tmp_path / "ckpt"), name="resumed")
    resumed.fit()  # nothing left to train
    for table, rows in saved.items():
        restored = resumed.model.sparse_arch.table_weight(table)
        step = torch.finfo(torch.float16).eps * rows.abs().clamp(min=2.0 ** -14)
        assert bool(((restored - rows).abs() <= step).all())
        assert torch.equal(restored, restored.half().float())  # every row went through the fp16 store


def test_modified_rows_and_row_access_of_a_cached_collection():
    """The collection's API under the checkpoints: modified rows of every table (cached ones marked
    at a training lookup, the others by the fused module), reads and writes of a cached table's
    rows between steps only."""
    from neorec.embedding.config import SparseOptimizerConfig, TableConfig
    from neorec.embedding.locations import TableLocation
    from neorec.sparse.jagged import KeyedJaggedTensor

    tables = [TableConfig("a", 40, 4, ["fa"]), TableConfig("b", 30, 8, ["fb"])]
    collection = CachedEmbeddingBagCollection(tables, SparseOptimizerConfig(kind="adagrad", learning_rate=0.1),
                                              locations={"b": TableLocation("cached_dram", cache_rows=8, ways=4)})
    collection.track_modified_rows()
    a_ids, b_ids = torch.tensor([3, 3, 17, 0]), torch.tensor([29, 4, 4, 11])
    features = KeyedJaggedTensor(["fa", "fb"], torch.cat([a_ids, b_ids]), torch.tensor([2, 2, 3, 1]))
    with torch.no_grad():  # an evaluation trains nothing and marks nothing
        collection(features)
    assert collection.count_modified_rows("a") == collection.count_modified_rows("b") == 0
    before, _ = collection.read_rows("b", torch.arange(30))
    pooled = collection(features)
    with pytest.raises(RuntimeError, match="between steps"):
        collection.write_rows("b", torch.tensor([1]), torch.zeros(1, 8), {"momentum1": torch.zeros(1, 8)})
    pooled.values.sum().backward()
    assert collection.count_modified_rows("b") == 3 and collection.count_modified_rows("a") == 3
    assert collection.take_modified_rows("b").tolist() == [4, 11, 29]
    assert collection.take_modified_rows("a").tolist() == [0, 3, 17]
    assert collection.count_modified_rows("b") == 0 and collection.take_modified_rows("b").numel() == 0
    after, state = collection.read_rows("b", torch.arange(30))
    changed = (after != before).any(dim=1).nonzero().squeeze(1)
    assert changed.tolist() == [4, 11, 29]  # the trained rows, read from their cache slots
    assert torch.equal(after, collection.table_weight("b"))
    assert all(torch.equal(v, collection.optimizer_state("b")[k]) for k, v in state.items())
    with pytest.raises(ValueError, match="table 'a' is not cached"):
        collection.read_rows("a", torch.tensor([0]))


def test_a_restore_keeps_its_mapped_files_under_a_budget(tmp_path):
    """torch.load(mmap=True) maps files privately: they count toward the process's data size, so a
    restore of many chunk files unmaps the least recently used ones."""
    from neorec.train.checkpoint_files import save_tensors

    paths = []
    for i in range(4):
        paths.append(tmp_path / f"f{i}.pt")
        save_tensors(paths[-1], {"x": torch.full((1000,), float(i))})
    size = paths[0].stat().st_size
    files = checkpoint_files.MappedFiles(budget=2 * size)
    for path in (paths[0], paths[1], paths[0], paths[2], paths[3], paths[0]):
        assert files.tensors(path)["x"][0].item() == float(path.name[1])
        assert sum(s for s, _ in files.mapped.values()) <= 2 * size
    assert list(files.mapped) == [paths[3], paths[0]] and files.loads == 5  # f0 mapped again after f2, f3


@pytest.mark.parametrize("row_bits", [32, 4])
def test_an_increment_of_a_table_no_step_trained_writes_no_rows(row_bits):
    """A table whose bags were all empty since the last checkpoint: no chunk file for a cached
    table, an entry of no row for a device one (4-bit packing of no row raised)."""
    from neorec.embedding.config import SparseOptimizerConfig, TableConfig
    from neorec.embedding.locations import TableLocation
    from neorec.sparse.jagged import KeyedJaggedTensor

    tables = [TableConfig("a", 40, 4, ["fa"]), TableConfig("b", 30, 8, ["fb"]), TableConfig("c", 20, 4, ["fc"])]
    collection = CachedEmbeddingBagCollection(tables, SparseOptimizerConfig(kind="sgd", learning_rate=0.1),
                                              locations={"b": TableLocation("cached_dram", cache_rows=8, ways=4)})
    pieces = checkpoint_tables.model_pieces(collection, 0)
    for holder in checkpoint_tables.holders(pieces):
        holder.track()
    features = KeyedJaggedTensor(["fa", "fb", "fc"], torch.tensor([3, 17]), torch.tensor([1, 1, 0, 0, 0, 0]))
    collection(features).values.sum().backward()  # a: rows 3, 17; b, c: empty bags only
    groups = list(checkpoint_tables.save_pieces(pieces, True, row_bits, "p"))
    assert len(groups) == 1  # the main file only: b has no chunk
    entries = {e["table"]: e for e in groups[0][1]}
    assert set(entries) == {"a", "c"}
    assert entries["a"]["num_rows_written"] == 2 and entries["c"]["num_rows_written"] == 0
    assert entries["a"]["rows"] == [3, 18] and entries["c"]["rows"] == [0, 0]


def test_a_resume_with_nothing_left_to_train_reports_caches_without_lookups(tmp_path, capsys):
    """Only the evaluation ran, which counts no lookup: the hit rate was NaN, which the metrics log
    (strict JSON) refused, so the run failed after restoring."""
    from neorec.train.cli import _print_result

    settings = located(tmp_path, "cached_dram")
    make_trainer(tmp_path, *settings, "train.max_steps=3", *checkpoint_args(tmp_path, 3)).fit()
    resumed = make_trainer(tmp_path, *settings, "train.max_steps=3", resume=str(tmp_path / "ckpt"), name="resumed")
    result = resumed.fit()
    assert result.steps == 3 and sorted(result.cache) == ["t_feature_1", "t_feature_2"]
    assert all(c["lookups"] == 0 and c["hit_rate"] is None for c in result.cache.values())
    final = json.loads((tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["cache"]["t_feature_1"]["hit_rate"] is None
    _print_result(result)
    assert "embedding cache: t_feature_1 no lookups; t_feature_2 no lookups" in capsys.readouterr().out


def test_a_closed_trainer_leaves_its_ssd_stores_to_the_next_trainer(tmp_path):
    """fit() flushed the stores but kept them open: a second Trainer of the same config in the
    process was refused them ("already open in this process") and Trainer had no close()."""
    settings = [*located(tmp_path, "cached_ssd"), "train.max_steps=3"]
    first = make_trainer(tmp_path, *settings)
    first.fit()
    first.close()
    first.close()  # idempotent
    stores = [cache.store for cache in first.model.sparse_arch.caches.values()]
    assert len(stores) == 2 and all(store.closed for store in stores)
    second = make_trainer(tmp_path, *settings)  # the same ssd_dir: the stores are made again
    assert second.fit().steps == 3
    second.close()
