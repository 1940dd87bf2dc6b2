"""What only a GPU run executes, checked on the CPU: device placement (a "meta" device or the
``DeviceMixCheck`` of tests/device_mix.py stand in for CUDA), the choice of each rank's GPU, NCCL's
need for device tensors, generator states of another kind of device, and additions whose order
CUDA's atomics would not keep.

    python -m pytest tests/unit/test_gpu_paths_on_cpu.py -q
"""

from __future__ import annotations

import io
import sys
import time
import types
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from device_mix import DeviceMixCheck  # noqa: E402

from neorec.config import load_config  # noqa: E402
from neorec.devices import concrete_device  # noqa: E402
from neorec.embedding.cached import CachedEmbeddingBagCollection  # noqa: E402
from neorec.embedding.config import SparseOptimizerConfig, StorageConfig, TableConfig  # noqa: E402
from neorec.embedding.kernels.layout import launch_device  # noqa: E402
from neorec.embedding.locations import TableLocation  # noqa: E402
from neorec.embedding.precision import Rounder  # noqa: E402
from neorec.embedding.tbe import TableBatchedEmbeddingBags  # noqa: E402
from neorec.sharding.output_dist import addition_layers  # noqa: E402
from neorec.train.checkpoint_tables import FusedPieces, LocalPiece, restore_pieces, save_pieces  # noqa: E402
from neorec.train.distributed import rank_gpu  # noqa: E402
from neorec.train.timeline import StepTimeline, step_clock  # noqa: E402
from neorec.train.trainer import Trainer  # noqa: E402

TABLES = [TableConfig("a", 40, 4), TableConfig("b", 30, 8)]


def test_host_tables_stay_in_host_memory_when_the_model_moves():
    """build_model's model.to("cuda") moved the "dram" tables' module too; the first forward, which
    hands it host ids, raised "KeyedJaggedTensor is on cpu, the embedding tables on cuda:0"."""
    collection = CachedEmbeddingBagCollection(TABLES, SparseOptimizerConfig(kind="sgd"),
                                              locations={"b": TableLocation("dram")},
                                              separate_host_tables=True)  # what a GPU device selects
    collection.to("meta")  # stands in for the GPU
    assert collection.tbe.weights.device.type == "meta"
    assert all(b.device.type == "cpu" for b in collection.host_tbe.buffers())
    plain = CachedEmbeddingBagCollection(TABLES, SparseOptimizerConfig(kind="sgd"))
    plain.to("meta")  # without host tables
    assert plain.host_tbe is None and plain.tbe.weights.device.type == "meta" and "host_tbe" not in plain._modules


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad"])
def test_a_resume_merges_the_saved_rows_on_host_copies(kind):
    """The merge wrote host payloads into device tensors by indexed assignment, which CUDA refuses:
    every GPU resume failed."""
    optimizer = SparseOptimizerConfig(kind=kind, learning_rate=0.1)
    source = TableBatchedEmbeddingBags(TABLES, optimizer, init_seed=3)
    for table in TABLES:  # some optimizer state that is not the initial one
        state = source.get_optimizer_state(table.name)
        source.set_optimizer_state(table.name, {k: torch.rand_like(v) for k, v in state.items()})
    def pieces_of(module):
        holder = FusedPieces(lambda: module)
        return [LocalPiece(t.name, t.name, 0, t.num_embeddings, 0, t.embedding_dim, True, holder) for t in TABLES]

    (tensors, entries), = save_pieces(pieces_of(source), False, 32, "p")
    tensors = {k: v.clone() for k, v in tensors.items()}  # as load_tensors gives them: host tensors
    target = TableBatchedEmbeddingBags(TABLES, optimizer, init_seed=9)
    with DeviceMixCheck() as check:
        check.mark(*target.buffers())  # on a GPU run these live on the device
        restore_pieces(pieces_of(target), [(entries, lambda entry: tensors)])
    assert check.violations == []
    for table in TABLES:
        assert torch.equal(target.get_table_weight(table.name), source.get_table_weight(table.name))
        saved, restored = source.get_optimizer_state(table.name), target.get_optimizer_state(table.name)
        assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)


def test_the_device_mix_check_sees_a_host_value_written_into_a_device_tensor():
    """The check itself: it must flag what CUDA refuses, and nothing CUDA allows."""
    device, host = torch.zeros(5, 2), torch.ones(2, 2)
    with DeviceMixCheck() as check:
        check.mark(device)
        device[torch.tensor([1, 3])] = device[torch.tensor([0, 2])] * 2  # host indices: allowed
        device.add_(1.0)  # a Python scalar: allowed
        device.copy_(torch.ones(5, 2))  # a copy moves data: allowed
    assert check.violations == []
    with DeviceMixCheck() as check:
        check.mark(device)
        device[torch.tensor([1, 3])] = host
    assert [name for name, _ in check.violations] == ["index_put_"]


def test_the_incremental_checkpoint_size_exchange_uses_the_training_device(tmp_path, monkeypatch):
    """A CPU tensor all-reduced on an NCCL group ("No backend type associated with device type
    cpu") stopped every multi-GPU run with incremental checkpoints at its second save."""
    import neorec.train.checkpoint as checkpoint_module

    cfg = load_config("configs/tiny.toml", [
        "data.synthetic.num_train_samples=512", "data.batch_size=128", "train.epochs=1", "train.progress=false",
        f"train.output_dir='{tmp_path / 'run'}'", f"checkpoint.dir='{tmp_path / 'ckpt'}'",
        "checkpoint.every_steps=2", "checkpoint.incremental=true"])
    trainer = Trainer(cfg, out=io.StringIO())
    trainer.fit()  # saves a full checkpoint: the chain an increment needs
    checkpointer = trainer.checkpointer
    assert checkpointer.chain
    seen = []

    def all_reduce_sums(values, group, device):
        seen.append(device)
        return [2 * v for v in values]

    monkeypatch.setattr(checkpoint_module, "all_reduce_sums", all_reduce_sums)
    checkpointer.world_size = 2  # as on two GPUs
    trainer.device = torch.device("meta")  # stands in for cuda:N
    assert checkpointer._choose_kind() in ("full", "incremental")
    assert seen == [torch.device("meta")]


def test_a_rounding_generator_state_of_another_kind_of_device_is_not_restored():
    """A CPU generator's state is 5056 bytes, a CUDA one's 16: resuming a GPU checkpoint on the CPU
    (or back) raised "Expected a CPUGeneratorImplState of size 5056 but found 16"."""
    rounder = Rounder(torch.float16, stochastic=True, seed=5)
    rounder.generator("cpu")
    before = rounder.get_state()
    assert rounder.set_state(torch.zeros(16, dtype=torch.uint8)) is False  # a CUDA generator's
    assert torch.equal(rounder.get_state(), before)
    assert rounder.set_state(before) is True
    pending = Rounder(torch.float16, stochastic=True, seed=5)
    assert pending.set_state(torch.zeros(16, dtype=torch.uint8)) is True  # no generator yet: kept for later
    generator = pending.generator("cpu")  # ... and dropped there: the sequence starts from the seed
    assert torch.equal(generator.get_state(), before)

    storage = StorageConfig(precision="fp16", stochastic_rounding=True)
    module = TableBatchedEmbeddingBags(TABLES, SparseOptimizerConfig(kind="sgd"), storage)
    saved = module.state_dict()
    saved["rounding_rng_state"] = torch.zeros(16, dtype=torch.uint8)
    saved["weights"] = saved["weights"] + 1
    other = TableBatchedEmbeddingBags(TABLES, SparseOptimizerConfig(kind="sgd"), storage)
    other.state_dict()  # the buffer now holds this moment's state ...
    torch.rand(3, generator=other._rounder.generator("cpu"))  # ... and the generator goes on past it
    live = other._rounder.get_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(saved)
    assert torch.equal(other.weights, saved["weights"])  # the rest of the state dict loads
    assert any("another kind of device" in str(w.message) for w in caught)
    assert torch.equal(other._rounder.get_state(), live)  # not rewound to the last saved state


def test_each_local_rank_gets_its_own_gpu_and_too_many_ranks_are_refused():
    """local_rank % device_count put two ranks on one GPU (NCCL: "Duplicate GPU detected", or a hang)."""
    assert [rank_gpu(r, 4, 8, None) for r in range(4)] == [0, 1, 2, 3]
    assert rank_gpu(3, 4, 1, "2") == 0  # the launcher gave each rank one GPU of its own
    assert rank_gpu(3, 4, 2, "4,5") == 1  # ... or two (the UUID check finds out whether it did)
    with pytest.raises(ValueError, match="4 ranks on this node but 2 CUDA device"):
        rank_gpu(3, 4, 2, None)
    with pytest.raises(ValueError, match="2 ranks on this node but 1 CUDA device"):
        rank_gpu(1, 2, 1, None)


def test_a_cuda_device_without_an_index_is_made_concrete(monkeypatch):
    """torch.device("cuda") != torch.device("cuda:0"): a sharded collection given "cuda" refused
    every batch ("KeyedJaggedTensor is on cuda:0, the embedding tables on cuda")."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert concrete_device("cuda") == torch.device("cuda", 1)
    assert concrete_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert concrete_device(None) == torch.device("cpu") and concrete_device("cpu") == torch.device("cpu")


def test_triton_kernels_launch_on_their_tensors_gpu():
    """Triton launches on the current CUDA device, not on the tensors' one."""
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 1))
    context = launch_device(on_gpu)
    assert isinstance(context, torch.cuda.device) and context.idx == 1
    with launch_device(torch.zeros(1)):  # CPU (the interpreter): nothing to switch
        pass


def test_row_wise_partial_sums_are_added_in_rank_order_without_repeated_targets():
    """One index_add with repeated target columns is atomic and unordered on CUDA: with three or more
    row-wise pieces the output changed from run to run."""
    columns = [0, 1, 2, 0, 1, 3, 0, 4]  # column 0 gets three partial sums, column 1 two
    layers = addition_layers(columns)
    assert all(len(set(targets)) == len(targets) for _, targets in layers)
    assert sorted(s for sources, _ in layers for s in sources) == list(range(len(columns)))
    received = torch.randn(6, len(columns), dtype=torch.float32) * torch.tensor([1e8, 1, 1, 1, 1, 1, -1e8, 1])
    out = torch.zeros(6, 5)
    for sources, targets in layers:
        out = out.index_add(1, torch.tensor(targets), received[:, sources])
    expected = torch.zeros(6, 5)
    for source, target in enumerate(columns):  # in received (rank) order, one at a time
        expected[:, target] += received[:, source]
    assert torch.equal(out, expected)

    # a sharded output with a table cut row-wise over 3 ranks: the CPU keeps its one index_add (in
    # index order; the layers were 3-4x slower there), an accelerator adds layer by layer, same bits
    from neorec.sharding import ShardingPlan, row_wise, table_wise
    from neorec.sharding.output_dist import OutputPlacement
    from neorec.sharding.routing import Routing

    tables = [TableConfig("r", 30, 4), TableConfig("t", 10, 2)]
    routing = Routing(tables, ShardingPlan({"r": row_wise(tables[0], [0, 1, 2]), "t": table_wise(tables[1], 1)}, 3), 3)
    assert routing.additive
    cpu, accelerator = OutputPlacement(routing, torch.device("cpu")), OutputPlacement(routing, torch.device("meta"))
    assert cpu.layers == [] and len(accelerator.layers) == 3
    flat = torch.randn(5 * sum(routing.dims_on)) * 1e4
    single = cpu.place(flat, 5, None)
    cpu.layers = [(torch.tensor(src), torch.tensor(dst)) for src, dst in addition_layers(routing.columns)]
    assert torch.equal(cpu.place(flat, 5, None), single)


def test_profiling_on_a_gpu_times_finished_work(monkeypatch):
    """Phase times read the clock right after queuing asynchronous CUDA work (and an NCCL wait returns
    at once): the timeline measured launches, and exposed communication read ~0."""
    assert step_clock(torch.device("cpu")) is time.perf_counter
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    clock = step_clock(torch.device("cuda", 0))
    timeline = StepTimeline(clock=clock)
    with timeline.phase("backward"):
        pass
    assert synchronized == [torch.device("cuda", 0)] * 2  # at the phase's start and end


def test_a_cached_collections_table_copies_are_all_in_host_memory():
    """Cached tables came back in host memory, the others on the device: a caller comparing them
    with one another on a GPU needed a .to() for some tables only."""
    collection = CachedEmbeddingBagCollection(TABLES, SparseOptimizerConfig(kind="rowwise_adagrad"),
                                              locations={"b": TableLocation("cached_dram", cache_fraction=0.5)})
    with DeviceMixCheck() as check:
        check.mark(*collection.tbe.buffers())  # the fused module (device tables, cache slots) on the GPU
        copies = {t.name: (collection.table_weight(t.name), collection.optimizer_state(t.name)) for t in TABLES}
    for name, (weight, state) in copies.items():
        assert not check.on_device(weight) and not any(check.on_device(v) for v in state.values()), name


def test_launching_more_ranks_than_gpus_or_cuda_without_it_is_said_once_before_any_rank_starts(monkeypatch):
    """Each rank said it (an error per rank), or NCCL failed with two ranks on one GPU."""
    from neorec.train.cli import check_gpus_for_ranks
    from neorec.train.distributed import no_cuda_message

    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match=r"this torch \(.*\) is a CPU-only build: install a CUDA build"):
        check_gpus_for_ranks("cuda", 2)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert "finds no CUDA device: check the NVIDIA driver" in no_cuda_message()
    check_gpus_for_ranks("auto", 2)  # no GPU: auto trains on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"--nproc 2 but 1 CUDA device\(s\) visible: each rank needs a GPU of its own"):
        check_gpus_for_ranks("auto", 2)
    check_gpus_for_ranks("cuda", 1)
    check_gpus_for_ranks("cpu", 4)  # gloo on the CPU: any number


def test_a_torch_without_a_fused_dense_optimizer_for_the_device_gets_the_plain_one(monkeypatch):
    """fused=True was passed for CUDA parameters whatever the torch: releases whose fused Adagrad is
    CPU-only raised at the first step of the default config on a GPU."""
    from neorec.config import DenseOptimizerConfig
    from neorec.train.build import make_dense_optimizer

    real = torch.optim.Adagrad

    class CpuOnlyFusedAdagrad(real):
        def __init__(self, params, fused=None, **options):
            if fused:
                raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of "
                                   "supported devices: ['cpu']")
            super().__init__(params, **options)

    monkeypatch.setattr(torch.optim, "Adagrad", CpuOnlyFusedAdagrad)
    params = [torch.nn.Parameter(torch.ones(3))]
    optimizer = make_dense_optimizer(DenseOptimizerConfig(kind="adagrad", learning_rate=0.1), params)
    assert isinstance(optimizer, CpuOnlyFusedAdagrad) and not optimizer.defaults.get("fused")
    params[0].grad = torch.ones(3)
    optimizer.step()
    assert params[0].detach().lt(1).all()
    monkeypatch.setattr(torch.optim, "Adagrad", real)
    assert make_dense_optimizer(DenseOptimizerConfig(kind="adagrad", learning_rate=0.1), params).defaults["fused"]
