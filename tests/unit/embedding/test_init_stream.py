"""The initial rows of embedding tables (``neorec/embedding/init_stream.py``): any rows drawn
alone equal the same rows of the whole table, a table's rows do not depend on the other tables,
and every module that builds tables starts from them.

    python -m pytest tests/unit/embedding/test_init_stream.py -q
"""

from __future__ import annotations

import pytest
import torch

from neorec.embedding import EmbeddingBagCollection, StorageConfig, TableConfig
from neorec.embedding import init_stream
from neorec.embedding.cached import CachedEmbeddingBagCollection
from neorec.embedding.init_stream import TableInit, block_rows
from neorec.embedding.locations import TableLocation
from neorec.sparse.jagged import KeyedJaggedTensor

TABLE = TableConfig("t", 100, 8, ["f"])


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 rows for 8-wide tables (``INIT_CHUNK`` 128 values)."""
    monkeypatch.setattr(init_stream, "INIT_CHUNK", 128)


def whole(seed: int, table: TableConfig) -> torch.Tensor:
    return TableInit(seed, table).rows(0, table.num_embeddings)


def test_any_rows_drawn_alone_equal_those_rows_of_the_whole_table(small_blocks):
    assert block_rows(8) == 16
    full = whole(3, TABLE)
    assert full.shape == (100, 8)
    for lo, hi in [(0, 100), (0, 16), (5, 11), (15, 17), (16, 32), (30, 99), (97, 100), (50, 50)]:
        assert torch.equal(TableInit(3, TABLE).rows(lo, hi), full[lo:hi]), (lo, hi)
    init = TableInit(3, TABLE)  # one object asked for rows out of order (its kept block changes)
    for lo, hi in [(40, 45), (3, 20), (41, 60), (0, 1)]:
        assert torch.equal(init.rows(lo, hi), full[lo:hi]), (lo, hi)
    blocks = list(TableInit(3, TABLE).blocks(10, 50))
    assert [(row, block.shape[0]) for row, block in blocks] == [(10, 6), (16, 16), (32, 16), (48, 2)]


def test_rows_outside_the_table_are_refused():
    for lo, hi in [(-1, 3), (5, 101), (7, 6)]:
        with pytest.raises(ValueError, match="outside the table's 100 rows"):
            TableInit(0, TABLE).rows(lo, hi)


def test_values_are_uniform_in_the_bound_and_differ_by_seed_name_and_block(small_blocks):
    table = TableConfig("big", 40_000, 8, ["f"])
    values = whole(0, table)
    bound = (1 / 40_000) ** 0.5
    assert values.abs().max() <= bound and values.min() < -0.99 * bound and values.max() > 0.99 * bound
    assert abs(values.mean().item()) < 0.01 * bound
    assert values.std().item() == pytest.approx(bound / 3 ** 0.5, rel=0.01)
    assert torch.equal(values, whole(0, table))  # deterministic
    blocks = values.view(-1, 16, 8)
    assert not any(torch.equal(blocks[0], blocks[k]) for k in range(1, blocks.shape[0]))
    assert not torch.equal(whole(1, table), values)
    assert not torch.equal(whole(0, TableConfig("other", 40_000, 8, ["f"])), values)
    assert not torch.equal(whole(-1, TABLE), whole(0, TABLE))


def test_a_tables_rows_do_not_depend_on_the_other_tables_or_their_order():
    a, b = TableConfig("a", 50, 4, ["fa"]), TableConfig("b", 70, 8, ["fb"])
    both, alone = EmbeddingBagCollection([a, b], init_seed=5), EmbeddingBagCollection([b], init_seed=5)
    reordered = EmbeddingBagCollection([b, a], init_seed=5)
    assert torch.equal(both.tbe.get_table_weight("b"), alone.tbe.get_table_weight("b"))
    assert torch.equal(both.tbe.get_table_weight("b"), whole(5, b))
    assert torch.equal(reordered.tbe.get_table_weight("a"), whole(5, a))


def test_fp16_tables_hold_the_rows_rounded_to_nearest():
    ebc = EmbeddingBagCollection([TABLE], storage=StorageConfig(precision="fp16"), init_seed=2)
    assert torch.equal(ebc.tbe.table_view("t"), whole(2, TABLE).half())


@pytest.mark.parametrize("kind", ["cached_dram", "cached_ssd", "dram"])
def test_tables_off_the_device_start_from_the_same_rows(small_blocks, tmp_path, kind):
    tables = [TABLE, TableConfig("u", 60, 8, ["g"])]
    location = TableLocation(kind, cache_fraction=0.2, path=str(tmp_path / "t.rows") if kind == "cached_ssd" else "")
    collection = CachedEmbeddingBagCollection(tables, locations={"t": location}, init_seed=9)
    for table in tables:
        assert torch.equal(collection.table_weight(table.name), whole(9, table)), table.name


def test_a_cache_growing_draws_no_rows(small_blocks, recwarn):
    """Growing a cache rebuilds the fused module and copies every table over: it drew every
    table's initial rows again first (the size of the device tables, for nothing)."""
    tables = [TableConfig("big", 4000, 8, ["f"]), TableConfig("c", 500, 8, ["g"])]
    collection = CachedEmbeddingBagCollection(tables, locations={"c": TableLocation("cached_dram", cache_rows=8, ways=4)})
    drawn = []
    with init_stream.observing_draws(drawn.append):
        batch = KeyedJaggedTensor(["f", "g"], torch.arange(64), torch.tensor([1] * 32 + [1] * 32))
        collection(batch)
    assert any("growing it" in str(w.message) for w in recwarn)
    assert drawn == []
    assert torch.equal(collection.table_weight("big"), whole(0, tables[0]))
