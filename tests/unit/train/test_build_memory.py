"""A model too big for this machine's memory: refused before anything is allocated (its tables in
memory named against the machine's memory), or, when an allocation fails while it is built, said as
that with what to do, instead of the allocator's error reported as "unexpected".

    python -m pytest tests/unit/train/test_build_memory.py -q
"""

from __future__ import annotations

import io

import pytest

import neorec.train.build as build
from neorec.config import load_config
from neorec.train.trainer import Trainer

SMALL = ["data.synthetic.num_train_samples=256", "data.synthetic.num_eval_samples=64", "data.batch_size=64",
         "train.progress=false", "data.synthetic.num_embeddings=[1000, 2000, 3000, 4000]"]


def config(tmp_path, *overrides):
    return load_config("configs/tiny.toml", SMALL + [f"train.output_dir='{tmp_path / 'run'}'", *overrides])


def tables_of(cfg):
    from neorec.data import make_data_source

    return make_data_source(cfg.data).tables(cfg.model.embedding_dim, cfg.model.pooling)


@pytest.mark.parametrize("optimizer, precision, state_bytes_per_row", [
    ("rowwise_adagrad", "fp32", lambda dim: 4), ("adam", "fp32", lambda dim: 8 * dim), ("sgd", "fp16", lambda dim: 0),
    ("adagrad", "bf16", lambda dim: 4 * dim)])
def test_the_bytes_of_tables_in_memory_count_rows_and_state_and_leave_out_tables_on_ssd(
        tmp_path, optimizer, precision, state_bytes_per_row):
    cfg = config(tmp_path, f"embedding.optimizer.kind='{optimizer}'", f"embedding.storage.precision='{precision}'")
    dim, row_bytes = cfg.model.embedding_dim, 4 if precision == "fp32" else 2
    expected = sum(rows * (dim * row_bytes + state_bytes_per_row(dim)) for rows in (1000, 2000, 3000, 4000))
    assert build.tables_host_bytes(cfg, tables_of(cfg)) == expected
    on_ssd = config(tmp_path, f"embedding.optimizer.kind='{optimizer}'", "embedding.location.tables={t_feature_3='cached_ssd'}")
    assert build.tables_host_bytes(on_ssd, tables_of(on_ssd)) == sum(
        rows * (dim * 4 + state_bytes_per_row(dim)) for rows in (1000, 2000, 3000))


def test_a_dram_stores_bytes_are_its_records_at_the_stores_precision(tmp_path):
    """A cached_dram table's rows were counted at embedding.storage.precision, not at the store's
    own (embedding.location.precision): an int8 store of 7 GiB was counted as 24 GiB and refused."""
    cfg = config(tmp_path, "embedding.location.tables={t_feature_3='cached_dram'}", "embedding.location.precision='int8'")
    dim = cfg.model.embedding_dim
    assert dim == 8
    record = 8 + 8 + 4  # 8 int8 values, the row's fp32 scale and bias, the row-wise AdaGrad state
    assert build.tables_host_bytes(cfg, tables_of(cfg)) == sum(
        rows * (dim * 4 + 4) for rows in (1000, 2000, 3000)) + 4000 * record


def test_a_model_larger_than_the_machine_is_refused_before_it_is_allocated(tmp_path, monkeypatch):
    import neorec.embedding.tbe as tbe

    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated a model that cannot fit")

    monkeypatch.setattr(build, "_machine_memory_bytes", lambda: 100_000)
    monkeypatch.setattr(tbe, "empty_huge", no_allocation)
    with pytest.raises(ValueError, match=r"the model does not fit in memory: the embedding tables held in memory need at least "
                                         r"\S+ \S+ \(rows and optimizer state\), and this machine has 97.66 KiB of "
                                         r"memory and swap. Keep the largest tables on SSD behind a cache \(embedding."
                                         r"location.default = \"cached_ssd\""):
        Trainer(config(tmp_path), out=io.StringIO())


def test_an_allocation_that_fails_while_the_model_is_built_is_said_as_that(tmp_path, monkeypatch):
    import neorec.embedding.tbe as tbe

    def fails(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 66560000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(tbe, "empty_huge", fails)
    with pytest.raises(ValueError, match=r"building the model ran out of memory on cpu \(\[enforce fail .* you tried to "
                                         r"allocate 66560000000 bytes.*\): the embedding tables held in memory need at least "):
        Trainer(config(tmp_path), out=io.StringIO())

    def other(*args, **kwargs):  # not an allocation: not turned into one
        raise RuntimeError("something else")

    monkeypatch.setattr(tbe, "empty_huge", other)
    with pytest.raises(RuntimeError, match="^something else$"):
        Trainer(config(tmp_path), out=io.StringIO())


def test_a_gpu_out_of_memory_is_said_as_the_gpus_not_the_hosts(tmp_path):
    import torch

    with pytest.raises(ValueError) as error:
        with build.memory_named(config(tmp_path), [], torch.device("cuda", 0), sharded=False):
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.10 GiB total capacity)")
    message = str(error.value)
    assert message.startswith("building the model ran out of memory on cuda:0 (CUDA out of memory. Tried to allocate "
                              "20.00 GiB (GPU 0; 79.10 GiB total capacity)): keep the largest tables in host memory "
                              "or on SSD behind a cache"), message
    assert "this machine has" not in message and "held in memory" not in message
