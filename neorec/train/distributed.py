"""Multi-process training support: the process group from torchrun's environment, per-rank batch
slices, the data-parallel dense layers, the loss scale and the evaluation gather.

    torchrun --nproc-per-node 2 -m neorec train --config configs/tiny.toml
    neorec train --config configs/tiny.toml --nproc 2          # starts the 2 processes itself
    # two nodes (here: two agents on one machine over loopback)
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 -m neorec train ...     # and --node-rank 1 on the other

Batches: ``data.batch_size`` is per rank. Every rank reads the same global batch of
world * batch_size samples and keeps rows [N * r // W, N * (r + 1) // W) (exactly r*B..(r+1)*B when
the batch is full). The last global batch of an epoch may be smaller: it is split as evenly as
possible (a rank may get no sample), nothing is dropped, and all ranks take the same number of
steps. Each rank's loss is its share of the mean loss over the global batch of N samples,
sum(BCE over its samples) / N, and every gradient is SUMMED over the ranks: the dense layers' by
DistributedDataParallel with a summing communication hook, an embedding row's by the exchange that
brings its pooled gradients back from all ranks, a replicated table's by an all-reduce. That gives
exactly the gradient of the global mean loss, whatever the split, with no scaling pass anywhere
(DDP's default hook would average, and the embedding gradients would then need a 1 / W pass).
"""

from __future__ import annotations

import gc
import inspect
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from neorec.data.batch import Batch
from neorec.sparse.jagged import KeyedJaggedTensor

ENV_KEYS = ("RANK", "WORLD_SIZE")
DEFAULT_TIMEOUT_SECONDS = 600


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, a container's cpuset), not
    every CPU of the machine."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def threads_per_rank(local_ranks: int, environ: Optional[dict] = None) -> int:
    """Intra-op threads of one of ``local_ranks`` processes on this machine: ``OMP_NUM_THREADS``
    when set (by the user, or by torchrun, which sets 1 for several ranks per node), else an even
    share of ``usable_cpus()``."""
    environ = os.environ if environ is None else environ
    try:
        asked = int(environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        asked = 0
    return asked if asked > 0 else max(1, usable_cpus() // max(1, local_ranks))


def launched_by_torchrun(environ: Optional[dict] = None) -> bool:
    """True when RANK and WORLD_SIZE are set (torchrun, or ``neorec train --nproc``)."""
    environ = os.environ if environ is None else environ
    return all(k in environ for k in ENV_KEYS)


@dataclass
class DistributedContext:
    """This process's place in the job and its process groups (pass it; nothing is global).

    embedding_group: collectives of the sharded embeddings; dense_group: DistributedDataParallel's
    all-reduces (a separate group, so the two never interleave on one communicator).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    embedding_group: Any
    dense_group: Any

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str = "auto", timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> "DistributedContext":
        """Join the job described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
        LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): NCCL on ``cuda:LOCAL_RANK`` when the device
        is (or "auto" finds) CUDA, gloo on CPU otherwise."""
        if not launched_by_torchrun():
            raise ValueError("distributed training needs RANK and WORLD_SIZE in the environment: start it with "
                             "torchrun or `neorec train --nproc N`")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if use_cuda:
            if not torch.cuda.is_available():
                raise ValueError(no_cuda_message())
            torch_device = torch.device("cuda", rank_gpu(local_rank, local_world, torch.cuda.device_count(),
                                                         os.environ.get("CUDA_VISIBLE_DEVICES")))
            torch.cuda.set_device(torch_device)
            backend = "nccl"
        else:
            torch_device, backend = torch.device("cpu"), "gloo"
        timeout = timedelta(seconds=timeout_seconds)
        if not dist.is_initialized():
            _init_default_group(backend, rank, world, timeout)
        if use_cuda:  # before any NCCL collective: NCCL's own check ("Duplicate GPU detected") fails first
            host = dist.new_group(list(range(world)), timeout=timeout, backend="gloo")
            try:
                check_distinct_gpus(str(torch.cuda.get_device_properties(torch_device).uuid), host, torch.device("cpu"))
            finally:
                dist.destroy_process_group(host)
        dense_group = dist.new_group(list(range(world)), timeout=timeout, backend=backend)
        return cls(rank, world, local_rank, local_world, backend, torch_device, dist.group.WORLD, dense_group)

    def close(self) -> None:
        """Destroy the process groups. Drop the model (its DistributedDataParallel) first: a
        gloo group whose last reference goes with DDP's reducer is destroyed while holding the
        GIL and can deadlock with gloo's worker threads (pytorch/pytorch#56297); collecting
        garbage here lets it go while the groups are still registered."""
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.embedding_group = self.dense_group = None


def no_cuda_message() -> str:
    """Why ``train.device = 'cuda'`` cannot be had here, and what to do."""
    if torch.version.cuda is None:
        return (f"train.device = 'cuda' but this torch ({torch.__version__}) is a CPU-only build: install a CUDA "
                "build of torch (see the README, \"Training on a GPU\"), or use train.device = 'cpu' or 'auto'")
    return (f"train.device = 'cuda' but torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA device: "
            "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or use train.device = 'cpu' or 'auto'")


def check_distinct_gpus(uuid: str, group: Any, device: torch.device) -> None:
    """Every rank of ``group`` (a gloo group: this runs before NCCL's first collective, whose own
    check fails with "Duplicate GPU detected" or hangs) passes the UUID of its GPU: two ranks on one
    GPU (a CUDA_VISIBLE_DEVICES naming one GPU for a whole node, say) are refused on every rank,
    naming them."""
    data = uuid.encode()[:64].ljust(64, b"\0")
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    ranks: dict = {}
    for rank, tensor in enumerate(everyone):
        ranks.setdefault(bytes(tensor.cpu().tolist()).rstrip(b"\0").decode(errors="replace"), []).append(rank)
    shared = {gpu: r for gpu, r in ranks.items() if len(r) > 1}
    if shared:
        gpu, together = next(iter(shared.items()))
        raise ValueError(f"ranks {together} run on one GPU ({gpu}): give each rank its own GPU (one rank per GPU "
                         "per node; a CUDA_VISIBLE_DEVICES set for the whole node shows every rank the same one)")


def rank_gpu(local_rank: int, local_world: int, gpus: int, visible: Optional[str]) -> int:
    """The CUDA device of local rank ``local_rank``: its own one of the node's ``gpus``; where a
    launcher may have given each rank GPUs of its own (``CUDA_VISIBLE_DEVICES`` set, fewer visible
    than ranks) one of those, ``check_distinct_gpus`` then finding out whether it did. Otherwise
    more ranks than GPUs is an error: two ranks on one GPU make NCCL fail ("Duplicate GPU") or hang."""
    if local_world <= gpus:
        return local_rank
    if gpus >= 1 and visible:
        return local_rank % gpus
    raise ValueError(f"{local_world} ranks on this node but {gpus} CUDA device(s) visible: start at most {gpus} "
                     "ranks per node (torchrun --nproc-per-node, neorec train --nproc), give each rank its own "
                     "GPU with CUDA_VISIBLE_DEVICES, or train on the CPU (train.device = 'cpu')")


def _init_default_group(backend: str, rank: int, world: int, timeout: timedelta) -> None:
    """``init_process_group`` from the environment. When torchrun has restarted the workers
    (``--max-restarts``) they join through the agent's store, which outlives the previous attempt
    and still holds that attempt's keys, among them the gloo addresses of processes now dead: a
    new worker could read one and connect to it (refused, or hang in the full-mesh connect). Each
    attempt therefore uses its own key prefix in that store."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"neorec/attempt-{restart}", store), rank=rank,
                            world_size=world, timeout=timeout)


# ---------------------------------------------------------------------------------- batches
def rank_range(num_samples: int, rank: int, world_size: int) -> Tuple[int, int]:
    """[lo, hi) of a global batch of ``num_samples`` that rank ``rank`` trains on."""
    return num_samples * rank // world_size, num_samples * (rank + 1) // world_size


def slice_samples(features: KeyedJaggedTensor, lo: int, hi: int) -> KeyedJaggedTensor:
    """Samples [lo, hi) of every key of ``features``."""
    batch, keys = features.batch_size, features.keys()
    offsets = features.offsets().tolist()
    starts = [offsets[k * batch + lo] for k in range(len(keys))]
    ends = [offsets[k * batch + hi] for k in range(len(keys))]
    values = [features.values[s:e] for s, e in zip(starts, ends)]
    weights = None
    if features.weights is not None:
        weights = torch.cat([features.weights[s:e] for s, e in zip(starts, ends)]) if keys else features.weights[:0]
    return KeyedJaggedTensor(
        keys, torch.cat(values) if keys else features.values[:0],
        features.lengths_2d()[:, lo:hi].reshape(-1), weights, batch_size=hi - lo, validate=False,
    )


def split_batch(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's part of a global batch (see the module docstring)."""
    lo, hi = rank_range(batch.batch_size, rank, world_size)
    return Batch(batch.dense[lo:hi], slice_samples(batch.sparse, lo, hi), batch.labels[lo:hi])


# ---------------------------------------------------------------------------------- model, loss
def _sum_all_reduce(group, bucket):  # no annotations: DDP checks them against its own types
    """DDP communication hook: the gradients of ``bucket`` (a ``dist.GradBucket``) summed over the
    ranks (DDP's default hook averages them; see the module docstring for why neorec sums)."""
    future = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def wrap_data_parallel(model: nn.Module, group: Any, device: torch.device) -> DistributedDataParallel:
    """DistributedDataParallel over ``model``'s dense layers, their gradients summed over the ranks
    (pair it with ``local_loss``); the buffers and parameters of its ``sparse_arch`` (the sharded
    embeddings) are ignored by DDP (never broadcast nor reduced)."""
    ignored = [name for name, _ in model.named_parameters() if name.startswith("sparse_arch.")]
    ignored += [name for name, _ in model.named_buffers() if name.startswith("sparse_arch.")]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    options = {"process_group": group}
    if device.type == "cuda":
        options["device_ids"] = [device]
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        options["forward_sync_buffers"] = False  # the dense layers' buffers are constants
    else:  # pragma: no cover - torch < 2.13
        options["broadcast_buffers"] = False
    wrapped = DistributedDataParallel(model, **options)
    wrapped.register_comm_hook(group, _sum_all_reduce)
    return wrapped


def local_loss(logits: torch.Tensor, labels: torch.Tensor, global_batch_size: int) -> torch.Tensor:
    """This rank's share of the global mean BCE loss (see the module docstring): sum of BCE over
    the local samples / global_batch_size. The ranks' shares add up to the global mean."""
    total = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    return total / global_batch_size


def all_reduce_sum(value: float, group: Any, device: torch.device) -> float:
    """The sum of ``value`` over the ranks of ``group``."""
    return all_reduce_sums([value], group, device)[0]


def all_reduce_sums(values: List[float], group: Any, device: torch.device) -> List[float]:
    """The element-wise sums of ``values`` over the ranks of ``group``, exchanged as one float64
    tensor on ``device`` (the group's device: NCCL has no CPU tensors)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def broadcast_text(text: Optional[str], group: Any, device: torch.device, src: int = 0) -> str:
    """Rank ``src`` (of ``group``)'s ``text`` (UTF-8, any length) on every rank; the others pass None. Plain
    bytes in a tensor, never a pickle."""
    rank = dist.get_rank(group)
    data = (text or "").encode() if rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, group_src=src, group=group)  # (src= is a global rank: wrong on a subgroup)
    buf = torch.zeros(int(size), dtype=torch.uint8, device=device)
    if rank == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, group_src=src, group=group)
    return bytes(buf.cpu().numpy()).decode()


def gather_to_main(tensor: torch.Tensor, group: Any) -> Optional[torch.Tensor]:
    """On rank 0 of ``group``: the ``tensor`` [n_r, ...] of every rank (n_r may differ, the other
    dims not) concatenated in rank order; None on the others (they hold nothing of the others')."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s) for s in sizes]
    padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.zeros_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, parts, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, counts)]) if rank == 0 else None
