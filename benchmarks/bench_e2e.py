"""End-to-end DLRM training throughput: neorec against TorchRec's DistributedModelParallel, side by side.

Both frameworks train the same DLRM on the same batches:

- tables: T tables x R rows, dim D, sum pooling, one feature per table;
- bottom MLP 13 -> 512 -> 256 -> D (ReLU), dot interaction (pairs i < j of dense + T features,
  concatenated with the dense vector), top MLP -> 512 -> 256 -> 1 (ReLU between, last linear);
- embeddings: row-wise AdaGrad fused into the backward (lr 0.05, eps 1e-8); dense: torch.optim.Adagrad
  (lr 0.01, eps 1e-8); loss: mean BCE with logits;
- batches: neorec's synthetic source (Zipf(1.05) ids scattered over each table, learnable labels),
  ``--batches`` global batches generated once and cycled; each rank trains on its slice.

Contenders:

- ``neorec``: ``neorec.train.trainer.Trainer.train_step`` (1 rank: the single-process trainer;
  N ranks: ``DistributedContext`` over gloo, ``default_plan`` sharding, DDP dense part);
- ``torchrec``: ``torchrec.models.dlrm.DLRM`` over a ``torchrec.EmbeddingBagCollection`` built on
  the meta device, ``apply_optimizer_in_backward(RowWiseAdagrad)`` on the embeddings (TorchRec fuses
  it into fbgemm's CPU TBE), ``DistributedModelParallel`` with its default planner (gloo, CPU, same
  world size, also for 1 rank: its dense part then runs under DDP on a one-rank group, ~2-3% of a
  pool1 step that neorec's single-process trainer does not pay), ``KeyedOptimizerWrapper(Adagrad)``
  for the dense part (fused, as neorec's; torch's default on the CPU is a per-parameter loop).

With ``--pipelines``, two more contenders on models of their own: ``neorec_pipeline`` (the same
step through ``neorec.train.pipeline.TrainPipeline``, what ``neorec train`` runs by default: batch
i + 1's id exchange in flight during batch i) and ``torchrec_pipeline`` (``DLRMTrain`` under DMP,
driven by ``TrainPipelineSparseDist``, batch i + 1's input all-to-all launched during batch i); each
pipeline is kept across timed runs, and the pipelined ratio is reported next to the plain one.
With ``--ceiling``, one more: ``mlp_only``, the dense MLPs alone (copies of neorec's layers, forward
and backward on the rank's batch shapes, no embeddings, interaction, exchange, loss or optimizer):
the matrix products both frameworks run in every step, in neorec's layers (1-4% faster than
``nn.Linear``, bench_aligned_linear). TorchRec's step over it ("ceiling ratio") is the most a
framework running these MLP kernels could reach against TorchRec on this host if everything else
took no time.

Every rank builds both models; each timed run is ``--steps`` steps of one framework; runs alternate
``--repeats`` rounds of one run per framework after one warm-up run each, the order reversed every
other round (neorec, torchrec, ..., then ..., torchrec, neorec: no contender always runs first or
right after the same one). Reported: median samples/s over runs (global samples / rank 0's wall
time) and neorec / torchrec, the median of the per-pair ratios (neorec's run i over TorchRec's run
i, of the same round: a drift of the host's speed cancels within a pair; "pair ratio" in the
table), rank 0's minor page faults per
step (each a trip through the kernel, and the hypervisor on a VM), and every rank's CPU time per
step, split into its main (Python) thread's and its other threads' (gloo's, OpenMP's): a main thread
busy for less than the step's wall time was waiting, mostly for the other rank in a collective.
Intra-op threads: cores / ranks for both (``--threads``). The C allocator: both frameworks share
each worker process, so both run with the malloc thresholds neorec's Trainer sets
(``neorec/train/allocator.py``; applied before either model is built; ``--keep-malloc`` leaves
glibc's defaults for both). The loss of every step is kept, and the mean of the first and last
tenth of the steps is printed, to show both really train.

Run (repository root, venv active, peers: `pip install -r benchmarks/requirements-peers.txt && pip install --no-deps torchrec==1.8.0`; ~15 min on 2 cores):

    python benchmarks/bench_e2e.py --out /tmp/e2e.json   # benchmarks/RESULTS.md names each recorded run's file

    python benchmarks/bench_e2e.py --configs pool1 --ranks 1 --steps 5 --repeats 3    # one cell
    python benchmarks/bench_e2e.py --quick                                            # smoke run
    python benchmarks/bench_e2e.py --ranks 2 --pipelines    # also both frameworks' pipelined loops
    python benchmarks/bench_e2e.py --ceiling    # also the dense MLPs alone: the ratio's ceiling
    python benchmarks/bench_e2e.py --profile neorec_profile    # also a torch.profiler table of neorec's step
    python benchmarks/bench_e2e.py --trace /tmp/t    # chrome traces of one neorec run per rank (trace_timeline.py)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import itertools
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_args import at_least, check_out  # same folder (run as a script)

SPARSE_LR, DENSE_LR, EPS = 0.05, 0.01, 1e-8
NUM_DENSE = 13
BOTTOM = [512, 256]  # + [dim]
TOP = [512, 256]  # + [1]


@dataclass
class E2EConfig:
    name: str
    num_tables: int
    num_rows: int
    dim: int
    batch_size: int  # per rank
    pooling: float


CONFIGS = {
    "pool1": E2EConfig("pool1", 26, 100_000, 64, 2048, 1.0),
    "pool20": E2EConfig("pool20", 16, 200_000, 64, 1024, 20.0),
}
QUICK = {n: E2EConfig(c.name, c.num_tables, c.num_rows // 20, c.dim, c.batch_size // 8, c.pooling)
         for n, c in CONFIGS.items()}


# ------------------------------------------------------------------------------------------ data
def neorec_config(c: E2EConfig, world: int, reuse_freed_memory: bool = True):
    from neorec.config import Config, DenseOptimizerConfig, EmbeddingConfig, ModelConfig, TrainConfig
    from neorec.data.config import DataConfig, SyntheticConfig
    from neorec.embedding.config import SparseOptimizerConfig

    syn = SyntheticConfig(num_tables=c.num_tables, num_embeddings=[c.num_rows], pooling=c.pooling,
                          num_dense=NUM_DENSE, num_train_samples=10_000_000, num_eval_samples=0)
    return Config(
        model=ModelConfig(embedding_dim=c.dim, dense_layers=BOTTOM + [c.dim], over_layers=list(TOP)),
        embedding=EmbeddingConfig(optimizer=SparseOptimizerConfig("rowwise_adagrad", SPARSE_LR, EPS)),
        dense_optimizer=DenseOptimizerConfig("adagrad", DENSE_LR, EPS),
        data=DataConfig(batch_size=c.batch_size, prefetch_batches=0, synthetic=syn),
        train=TrainConfig(max_steps=1, output_dir="", progress=False, reuse_freed_memory=reuse_freed_memory),
    )


def make_batches(source, c: E2EConfig, world: int, rank: int, count: int, torchrec: bool = True):
    """``count`` of this rank's batches: (neorec Batch, global batch size, torchrec KJT or None
    without ``torchrec``: for neorec-only measurements, which then need no torchrec installed)."""
    from neorec.train.distributed import split_batch

    if torchrec:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TRKJT
    out = []
    for i, batch in enumerate(source.train_batches(c.batch_size * world, epoch=0)):
        if i == count:
            break
        size = batch.batch_size
        mine = split_batch(batch, rank, world) if world > 1 else batch
        kjt = mine.sparse
        tr = TRKJT(keys=list(kjt.keys()), values=kjt.values.clone(), lengths=kjt.lengths.clone()) if torchrec else None
        out.append((mine, size, tr))
    return out


# ------------------------------------------------------------------------------------------ models
class NeorecRunner:
    """neorec's ``Trainer.train_step`` over the endless cycle of this rank's batches. ``pipelined``:
    through ``TrainPipeline`` (``Trainer.fit``'s default loop: batch i + 1's id exchange in flight
    during batch i's backward and optimizer step), kept across timed runs."""

    def __init__(self, cfg, source, rank: int, world: int, dense_group, batches, pipelined: bool = False):
        from neorec.train.distributed import DistributedContext
        from neorec.train.pipeline import TrainPipeline
        from neorec.train.trainer import Trainer

        ctx = None
        if world > 1:
            ctx = DistributedContext(rank, world, rank, world, "gloo", torch.device("cpu"),
                                     dist.group.WORLD, dense_group)
        self.trainer = Trainer(cfg, source=source, out=open(os.devnull, "w"), distributed=ctx)
        cycle = ((batch, size) for batch, size, _ in itertools.cycle(batches))
        if pipelined:
            self._steps = TrainPipeline(self.trainer.model, torch.device("cpu")).run(cycle)
        else:
            self._steps = ((batch, size, None) for batch, size in cycle)

    def run(self, steps: int) -> List[float]:
        out = []
        for _ in range(steps):
            batch, size, hooks = next(self._steps)
            out.append(self.trainer.train_step(batch, size, hooks))
        return out


class MlpOnlyRunner:
    """The dense MLPs alone (``--ceiling``): copies of neorec's bottom and top MLPs (the model's own
    layers: ``AlignedLinear`` + ReLU) run forward and backward on this rank's batch shapes, with
    nothing else: no embeddings, interaction, exchange, loss or optimizer. The top MLP's input is a
    leaf that requires grad (its gradient feeds the interaction in the model), the bottom's is the
    dense features (no gradient, as in the model); both outputs get fixed random gradients. Both
    frameworks run these same matrix products in every step, so TorchRec's step over this one bounds
    the ratio any framework could reach on this host at that moment."""

    def __init__(self, neorec_model, batches):
        src = getattr(neorec_model, "module", neorec_model)
        self.bottom, self.top = copy.deepcopy(src.dense_arch), copy.deepcopy(src.over_arch)
        self.params = list(self.bottom.parameters()) + list(self.top.parameters())
        self._dense = itertools.cycle([batch.dense for batch, _, _ in batches])
        size = batches[0][0].dense.shape[0]
        width = next(m for m in self.top.modules() if isinstance(m, torch.nn.Linear)).in_features
        g = torch.Generator().manual_seed(0)
        self.top_input = torch.randn(size, width, generator=g).requires_grad_()
        self._grads = None

    def run(self, steps: int) -> List[float]:
        out = []
        for _ in range(steps):
            for p in self.params:
                p.grad = None
            self.top_input.grad = None
            outputs = [self.bottom(next(self._dense)), self.top(self.top_input)]
            if self._grads is None:
                g = torch.Generator().manual_seed(1)
                self._grads = [torch.randn(o.shape, generator=g) for o in outputs]
            torch.autograd.backward(outputs, self._grads)
            out.append(float(outputs[1].detach().sum()))
        return out


def copy_mlp_weights(neorec_model, torchrec_dlrm) -> None:
    """Copy the bottom and top MLPs of neorec's DLRM into TorchRec's (same shapes, same order)."""
    src = getattr(neorec_model, "module", neorec_model)
    for a, b in ((src.dense_arch, torchrec_dlrm.dense_arch), (src.over_arch, torchrec_dlrm.over_arch)):
        mine = [m for m in a.modules() if isinstance(m, torch.nn.Linear)]
        theirs = [m for m in b.modules() if isinstance(m, torch.nn.Linear)]
        assert [m.weight.shape for m in mine] == [m.weight.shape for m in theirs], (mine, theirs)
        with torch.no_grad():
            for x, y in zip(mine, theirs):
                y.weight.copy_(x.weight)
                y.bias.copy_(x.bias)


class TorchrecRunner:
    """TorchRec's DLRM under ``DistributedModelParallel`` over the endless cycle of this rank's
    batches: forward, loss, backward, optimizer step by hand; ``pipelined``: ``DLRMTrain`` driven by
    ``TrainPipelineSparseDist`` (batch i + 1's input all-to-all launched during batch i)."""

    def __init__(self, c: E2EConfig, neorec_tables, neorec_model, world: int, batches,
                 pipelined: bool = False, seed: int = 0):
        import torchrec
        from torchrec.datasets.utils import Batch as TorchrecBatch
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
        from torchrec.models.dlrm import DLRM, DLRMTrain
        from torchrec.optim.keyed import KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
        from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward

        torch.manual_seed(seed)
        tables = [torchrec.EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim,
                                              num_embeddings=t.num_embeddings, feature_names=list(t.feature_names))
                  for t in neorec_tables]
        ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        dlrm = DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                    dense_arch_layer_sizes=BOTTOM + [c.dim], over_arch_layer_sizes=TOP + [1],
                    dense_device=torch.device("cpu"))
        copy_mlp_weights(neorec_model, dlrm)  # same dense init (the tables share the init law)
        apply_optimizer_in_backward(RowWiseAdagrad, dlrm.sparse_arch.parameters(), {"lr": SPARSE_LR, "eps": EPS})
        self.model = DistributedModelParallel(DLRMTrain(dlrm) if pipelined else dlrm, device=torch.device("cpu"))
        self.optimizer = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(self.model.named_parameters())),
            # fused, as neorec's dense Adagrad (torch's default on CPU is the per-parameter loop, ~0.55 ms a step more)
            lambda params: torch.optim.Adagrad(params, lr=DENSE_LR, eps=EPS, fused=True),
        )
        self.loss_fn = torch.nn.BCEWithLogitsLoss()
        self.world = world
        self.plan = str(self.model.plan)
        self._cycle = itertools.cycle(batches)
        self.pipeline = None
        if pipelined:
            self.pipeline = TrainPipelineSparseDist(self.model, self.optimizer, torch.device("cpu"))
            self._cycle = (TorchrecBatch(dense_features=batch.dense, sparse_features=kjt, labels=batch.labels)
                           for batch, _, kjt in self._cycle)

    def _step(self) -> torch.Tensor:
        if self.pipeline is not None:
            loss, _, _ = self.pipeline.progress(self._cycle)  # DLRMTrain's (loss, logits, labels), detached
            return loss.clone()
        batch, _, kjt = next(self._cycle)
        logits = self.model(batch.dense, kjt).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def run(self, steps: int) -> List[float]:
        out = []
        for _ in range(steps):
            value = self._step()
            if self.world > 1:  # report the global mean, like neorec's train_step
                dist.all_reduce(value)
                value = value / self.world
            out.append(float(value))
        return out


# ------------------------------------------------------------------------------------------ worker
def worker(rank: int, world: int, store_path: str, c: E2EConfig, args, result_path: str) -> None:
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    if not args.keep_malloc:  # process-wide: the same allocator settings for both frameworks
        from neorec.train.allocator import reuse_freed_memory

        reuse_freed_memory()
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    dense_group = dist.new_group(list(range(world)), backend="gloo")
    from neorec.data import make_data_source

    cfg = neorec_config(c, world, reuse_freed_memory=not args.keep_malloc)
    source = make_data_source(cfg.data)
    t0 = time.perf_counter()
    batches = make_batches(source, c, world, rank, args.batches)
    gen_s = time.perf_counter() - t0
    runners = {"neorec": NeorecRunner(cfg, source, rank, world, dense_group, batches)}
    neorec_model, tables = runners["neorec"].trainer.model, source.tables(c.dim)
    runners["torchrec"] = TorchrecRunner(c, tables, neorec_model, world, batches)
    if args.pipelines:  # each framework's pipelined loop too, on models of their own
        runners["neorec_pipeline"] = NeorecRunner(cfg, source, rank, world, dense_group, batches, pipelined=True)
        runners["torchrec_pipeline"] = TorchrecRunner(c, tables, neorec_model, world, batches, pipelined=True)
    if args.ceiling:  # the dense MLPs alone: the work both frameworks share
        runners["mlp_only"] = MlpOnlyRunner(neorec_model, batches)
    torch.set_num_threads(threads)  # the trainer may have set it; keep both equal
    losses: Dict[str, List[float]] = {n: [] for n in runners}
    times: Dict[str, List[float]] = {n: [] for n in runners}
    faults: Dict[str, List[float]] = {n: [] for n in runners}  # page faults per step (rank 0)
    cpu: Dict[str, List[List[float]]] = {n: [] for n in runners}  # CPU ms per step: [main thread, other threads]

    def run(name: str, steps: int) -> float:
        runner = runners[name]
        dist.barrier()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        main_cpu, process_cpu = time.thread_time(), time.process_time()
        start = time.perf_counter()
        losses[name].extend(runner.run(steps))
        seconds = time.perf_counter() - start
        main_cpu, process_cpu = time.thread_time() - main_cpu, time.process_time() - process_cpu
        faults[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps)
        cpu[name].append([main_cpu * 1e3 / steps, (process_cpu - main_cpu) * 1e3 / steps])
        return seconds

    for name in runners:  # warm-up run each
        run(name, max(2, args.steps // 2))
    order = list(runners)
    for repeat in range(args.repeats):  # the order reversed every other round (ABBA): no contender always
        for name in (order if repeat % 2 == 0 else order[::-1]):  # runs first, or right after another
            times[name].append(run(name, args.steps))

    if args.profile and rank == 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            run("neorec", args.steps)
        table = (prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30) + "\n"
                 + prof.key_averages().table(sort_by="cpu_time_total", row_limit=40) + "\n"
                 + prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30))
        with open(f"{args.profile}_{c.name}_r{world}.txt", "w") as f:
            f.write(table)
    elif args.profile:
        run("neorec", args.steps)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run("neorec", args.steps)
        prof.export_chrome_trace(f"{args.trace}_{c.name}_r{world}_rank{rank}.json")

    # every rank's CPU time and rank 0's page faults in the timed runs (not the warm-up's, nor a profiled or
    # traced one's), to rank 0
    timed_cpu = {n: v[1:1 + args.repeats] for n, v in cpu.items()}
    faults = {n: v[1:1 + args.repeats] for n, v in faults.items()}
    cpu_by_rank: List[Dict[str, List[List[float]]]] = [{} for _ in range(world)]
    dist.all_gather_object(cpu_by_rank, timed_cpu)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"times": times, "losses": losses, "gen_seconds": gen_s, "faults_per_step": faults,
                       "cpu_by_rank": cpu_by_rank,
                       "torchrec_plan": runners["torchrec"].plan,
                       "neorec_plan": str(runners["neorec"].trainer.plan)}, f)
    runners.clear()  # frees the models before the group goes (run() keeps the dict)
    dist.barrier()
    dist.destroy_process_group()


def run_cell(c: E2EConfig, world: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        mp.start_processes(worker, args=(world, store, c, args, result), nprocs=world, join=True,
                           start_method="spawn")
        with open(result) as f:
            raw = json.load(f)
    samples = c.batch_size * world * args.steps
    qps = {n: [samples / t for t in ts] for n, ts in raw["times"].items()}
    med = {n: statistics.median(v) for n, v in qps.items()}
    pairs = [a / b for a, b in zip(qps["neorec"], qps["torchrec"])]

    def compared(prefix: str, a: str, b: str) -> dict:
        """``a``'s samples/s over ``b``'s, as ``{prefix}_ratio`` (of medians) and per alternation pair."""
        if a not in qps:
            return {}
        ab = [x / y for x, y in zip(qps[a], qps[b])]
        return {f"{prefix}_ratio": med[a] / med[b], f"{prefix}_pair_ratios": ab,
                f"{prefix}_median_pair_ratio": statistics.median(ab)}

    pipelined = compared("pipelined", "neorec_pipeline", "torchrec_pipeline")  # --pipelines
    ceiling = compared("ceiling", "mlp_only", "torchrec")  # --ceiling: TorchRec's step over the MLPs' alone
    tenth = {}
    for n, ls in raw["losses"].items():
        k = max(1, len(ls) // 10)
        tenth[n] = (sum(ls[:k]) / k, sum(ls[-k:]) / k)
    return {"config": asdict(c), "ranks": world, "steps": args.steps, "repeats": args.repeats,
            "samples_per_s": qps, "median_samples_per_s": med,
            "median_ms_per_step": {n: c.batch_size * world / v * 1e3 for n, v in med.items()},
            "ratio_neorec_over_torchrec": med["neorec"] / med["torchrec"],
            "pair_ratios": pairs, "median_pair_ratio": statistics.median(pairs), **pipelined, **ceiling,
            "loss_first_last_tenth": tenth, "losses": raw["losses"], "torchrec_plan": raw["torchrec_plan"],
            "neorec_plan": raw["neorec_plan"], "batch_generation_seconds": raw["gen_seconds"],
            "median_page_faults_per_step": {n: statistics.median(v) for n, v in raw["faults_per_step"].items()},
            "median_cpu_ms_per_step": {n: [{"main_thread": statistics.median(m for m, _ in by_rank[n]),
                                            "other_threads": statistics.median(o for _, o in by_rank[n])}
                                           for by_rank in raw["cpu_by_rank"]] for n in raw["times"]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="pool1,pool20",
                   help="comma-separated cells: " + "; ".join(
                       f"{n} = {c.num_tables} tables x {c.num_rows:,} rows, dim {c.dim}, batch {c.batch_size} "
                       f"per rank, pooling {c.pooling:g}" for n, c in CONFIGS.items()) + " (default: both)")
    p.add_argument("--ranks", default="1,2",
                   help="comma-separated gloo world sizes to run each config on (default: 1,2)")
    p.add_argument("--steps", type=at_least(1), default=6, help="steps per timed run")
    p.add_argument("--repeats", type=at_least(1), default=5, help="timed runs per framework (alternating)")
    p.add_argument("--batches", type=at_least(1), default=8, help="distinct global batches, cycled")
    p.add_argument("--quick", action="store_true", help="small tables and batches (smoke test)")
    p.add_argument("--profile", default="", help="write torch.profiler tables of one neorec run to PREFIX_*.txt")
    p.add_argument("--trace", default="", help="write a chrome trace of one neorec run per rank to PREFIX_*_rankN.json")
    p.add_argument("--keep-malloc", action="store_true",
                   help="leave glibc's malloc thresholds as they are (default: neorec's, for both frameworks)")
    p.add_argument("--threads", type=at_least(0), default=0, help="intra-op threads per rank (0: cores / ranks)")
    p.add_argument("--pipelines", action="store_true",
                   help="also time each framework's pipelined loop (neorec's TrainPipeline, TorchRec's "
                        "TrainPipelineSparseDist) as two more contenders in the alternation, on models of their own")
    p.add_argument("--ceiling", action="store_true",
                   help="also time the dense MLPs alone (neorec's layers, forward + backward, nothing else) "
                        "as one more contender: TorchRec's step over it bounds the reachable ratio")
    p.add_argument("--out", default="", help="also write every figure, the command and the versions to this JSON file")
    args = p.parse_args(argv)
    check_out(p, args.out)
    table = QUICK if args.quick else CONFIGS
    names = args.configs.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {sorted(table)}")
    try:
        worlds = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks takes comma-separated integers, got {args.ranks!r}")
    if min(worlds) < 1:
        p.error(f"--ranks must be >= 1, got {args.ranks!r}")
    missing = [peer for peer in ("torchrec", "fbgemm_gpu") if importlib.util.find_spec(peer) is None]
    if missing:  # said before any work: the workers died on the import, inside a ProcessRaisedException
        print(f"bench_e2e: {' and '.join(missing)} not installed; the peers' recipe is in "
              "benchmarks/requirements-peers.txt (pip install -r benchmarks/requirements-peers.txt && "
              "pip install --no-deps torchrec==1.8.0)", file=sys.stderr)
        return 2
    results = []
    print(f"{'config':8} {'ranks':>5} {'neorec samples/s':>17} {'torchrec samples/s':>19} {'neorec ms':>10} "
          f"{'torchrec ms':>12} {'ratio':>6} {'pair ratio':>11}   loss first->last tenth (neorec | torchrec)",
          flush=True)
    for name in names:
        for world in worlds:
            r = run_cell(table[name], world, args)
            results.append(r)
            m, ms, lt = r["median_samples_per_s"], r["median_ms_per_step"], r["loss_first_last_tenth"]
            print(f"{name:8} {world:>5} {m['neorec']:>17,.0f} {m['torchrec']:>19,.0f} {ms['neorec']:>10.1f} "
                  f"{ms['torchrec']:>12.1f} {r['ratio_neorec_over_torchrec']:>6.2f} {r['median_pair_ratio']:>11.2f}   "
                  f"{lt['neorec'][0]:.4f}->{lt['neorec'][1]:.4f} | {lt['torchrec'][0]:.4f}->{lt['torchrec'][1]:.4f}",
                  flush=True)
            if "pipelined_ratio" in r:
                print(f"    pipelined loops: neorec {ms['neorec_pipeline']:.1f} ms, torchrec {ms['torchrec_pipeline']:.1f} ms, "
                      f"ratio {r['pipelined_ratio']:.2f}, pair ratio {r['pipelined_median_pair_ratio']:.2f}   "
                      f"loss {lt['neorec_pipeline'][0]:.4f}->{lt['neorec_pipeline'][1]:.4f} | "
                      f"{lt['torchrec_pipeline'][0]:.4f}->{lt['torchrec_pipeline'][1]:.4f}", flush=True)
            if "ceiling_ratio" in r:
                print(f"    dense MLPs alone (forward + backward, nothing else): {ms['mlp_only']:.1f} ms; "
                      f"TorchRec's step over it: {r['ceiling_ratio']:.2f} (pair {r['ceiling_median_pair_ratio']:.2f}), "
                      f"the most a framework running these MLP kernels could reach if all else took no time", flush=True)
            print("    CPU ms per step, main thread + other threads, per rank: " + " | ".join(
                f"{n} " + ", ".join(f"{c['main_thread']:.1f} + {c['other_threads']:.1f}" for c in per_rank)
                for n, per_rank in r["median_cpu_ms_per_step"].items()), flush=True)
    if args.out:
        import torchrec

        meta = {"python": platform.python_version(), "torch": torch.__version__,
                "torchrec": getattr(torchrec, "__version__", "?"), "cpus": os.cpu_count(),
                "machine": platform.processor() or platform.machine(), "argv": sys.argv,
                "date": time.strftime("%Y-%m-%d %H:%M")}
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
