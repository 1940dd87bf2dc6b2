"""Learnable synthetic click data: Zipf-distributed ids, labels drawn from a hidden teacher model.

    from neorec.data.config import SyntheticConfig
    from neorec.data.synthetic import SyntheticSource
    source = SyntheticSource(SyntheticConfig(num_tables=8, num_embeddings=[10000], pooling=4))
    for batch in source.train_batches(512, epoch=0):
        ...

Samples are generated in chunks of ``CHUNK_SAMPLES``; chunk ``c`` of a split comes from a
generator seeded by (seed, split, epoch, c), so any batch can be made without the ones before it,
and the data do not depend on the batch size. Per sample:

- dense features ~ N(0, 1), float32;
- per table, a bag of ``1 + Poisson(pooling - 1)`` ids (capped at max_pooling); the id of rank r
  is drawn with probability ~ 1 / r^zipf_alpha (``ZipfSampler``), then ranks are mapped to ids by
  a fixed seeded affine permutation (id = (a * rank + b) mod rows) so hot ids spread over the table;
- optional per-id weights in (0, 1];
- label ~ Bernoulli(sigmoid(logit)), the teacher's log-odds

      logit = (d * mlp(dense) + f * sum_t sum_bag w * bias_t(id)
               + p * sum_{s < t} <pool_s, pool_t> + c) / label_noise,     pool_t = sum_bag w * emb_t(id)

  where emb_t(id) [teacher_dim] and bias_t(id) are fixed pseudo-random functions of (seed, table,
  id) (hashes, so a table of any size costs no memory), and the scales d, f, p and the bias c are
  calibrated once from the seed so that the three terms have standard deviations 1.0, 0.7, 1.4
  and the base click rate is ``click_rate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.data.config import SyntheticConfig
from neorec.data.source import batch_ranges, check_batch_args, one_table_per_feature, splitmix64
from neorec.embedding.config import TableConfig
from neorec.sparse.jagged import KeyedJaggedTensor

CHUNK_SAMPLES = 4096
SPLIT_TRAIN, SPLIT_EVAL, SPLIT_CALIBRATION = 0, 1, 2
TEACHER_HIDDEN = 16
TERM_STDS = (1.0, 0.7, 1.4)  # dense MLP, first-order id biases, pairwise pooled dot products
_UNIFORM_BYTE_STD = math.sqrt((256.0**2 - 1.0) / 12.0)


@dataclass
class SampleBlock:
    """Consecutive samples in numpy form: dense [C, D] float32; per table lengths [C] int64,
    values [V_t] int64 and weights [V_t] float32 (or None); labels [C] float32."""

    dense: np.ndarray
    lengths: List[np.ndarray]
    values: List[np.ndarray]
    weights: Optional[List[np.ndarray]]
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, lo: int, hi: int) -> "SampleBlock":
        if lo == 0 and hi == len(self):
            return self
        values, weights = [], [] if self.weights is not None else None
        for t, lengths in enumerate(self.lengths):
            start, stop = int(lengths[:lo].sum()), int(lengths[:hi].sum())
            values.append(self.values[t][start:stop])
            if weights is not None:
                weights.append(self.weights[t][start:stop])
        return SampleBlock(self.dense[lo:hi], [l[lo:hi] for l in self.lengths], values, weights,
                           self.labels[lo:hi])

    @staticmethod
    def concat(blocks: Sequence["SampleBlock"]) -> "SampleBlock":
        if len(blocks) == 1:
            return blocks[0]
        num_tables = len(blocks[0].lengths)
        cat = np.concatenate
        weights = None
        if blocks[0].weights is not None:
            weights = [cat([b.weights[t] for b in blocks]) for t in range(num_tables)]
        return SampleBlock(
            cat([b.dense for b in blocks]),
            [cat([b.lengths[t] for b in blocks]) for t in range(num_tables)],
            [cat([b.values[t] for b in blocks]) for t in range(num_tables)],
            weights,
            cat([b.labels for b in blocks]),
        )


class ZipfSampler:
    """Ranks in [0, num_rows) with P(rank r) proportional to 1 / (r + 1)^alpha.

    The first ``head`` ranks are drawn exactly (a cumulative table); the rest by inverting the
    continuous power law over [head + 0.5, num_rows + 0.5) (midpoint rule: relative error
    O(1 / r^2) there), so memory stays small for tables of any size.
    """

    def __init__(self, num_rows: int, alpha: float, head: int = 4096) -> None:
        self.num_rows, self.alpha = int(num_rows), float(alpha)
        self.head = min(self.num_rows, head)
        self._cumulative = np.cumsum(np.arange(1, self.head + 1, dtype=np.float64) ** -self.alpha)
        self._head_mass = float(self._cumulative[-1])
        self._tail_start = self._integral(self.head + 0.5)
        self._tail_mass = self._integral(self.num_rows + 0.5) - self._tail_start if self.num_rows > self.head else 0.0
        self._total = self._head_mass + self._tail_mass

    def _integral(self, x: float) -> float:
        if abs(self.alpha - 1.0) < 1e-12:
            return math.log(x)
        return x ** (1.0 - self.alpha) / (1.0 - self.alpha)

    def sample(self, uniform: np.ndarray) -> np.ndarray:
        """Map uniforms in [0, 1) to ranks (int64)."""
        if self.alpha == 0.0:
            return np.minimum((uniform * self.num_rows).astype(np.int64), self.num_rows - 1)
        mass = uniform * self._total
        ranks = np.searchsorted(self._cumulative, mass, side="right").astype(np.int64)
        in_tail = mass >= self._head_mass
        if in_tail.any():
            level = self._tail_start + (mass[in_tail] - self._head_mass)
            if abs(self.alpha - 1.0) < 1e-12:
                x = np.exp(level)
            else:
                x = (level * (1.0 - self.alpha)) ** (1.0 / (1.0 - self.alpha))
            ranks[in_tail] = np.floor(x + 0.5).astype(np.int64) - 1
        return np.clip(ranks, 0, self.num_rows - 1)


class Teacher:
    """The hidden model that labels the synthetic data (a pure function of the seed)."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        self.cfg = cfg
        num_tables = cfg.num_tables
        rng = np.random.default_rng([cfg.seed, 0x7EAC4E5])
        self._salts = rng.integers(0, 2**63, size=(num_tables, 1 + -(-cfg.teacher_dim // 8)),
                                   dtype=np.uint64)
        self._w1 = rng.standard_normal((cfg.num_dense, TEACHER_HIDDEN)) * (2.0 / math.sqrt(max(cfg.num_dense, 1)))
        self._w2 = rng.standard_normal(TEACHER_HIDDEN) / math.sqrt(TEACHER_HIDDEN)
        self._scales = np.ones(3)
        self._bias = 0.0

    def calibrate(self, block: SampleBlock) -> None:
        """Set the term scales and the bias from a calibration sample (labels ignored)."""
        terms = self.terms(block.dense, block.lengths, block.values, block.weights)
        stds = terms.std(axis=0)
        constant = stds <= 1e-9 * np.maximum(1.0, np.abs(terms).max(axis=0))  # e.g. one-row tables
        self._scales = np.where(constant, 0.0, np.asarray(TERM_STDS) / np.where(constant, 1.0, stds))
        z = terms @ self._scales
        noise, target = self.cfg.label_noise, self.cfg.click_rate
        lo, hi = -60.0 * noise - 10.0 * abs(z).max(), 60.0 * noise + 10.0 * abs(z).max()
        for _ in range(100):  # bisection: mean sigmoid((z + c) / noise) rises with c
            mid = 0.5 * (lo + hi)
            if _sigmoid((z + mid) / noise).mean() < target:
                lo = mid
            else:
                hi = mid
        self._bias = 0.5 * (lo + hi)

    def embeddings(self, table: int, ids: np.ndarray) -> np.ndarray:
        """[len(ids), teacher_dim] float64, unit variance per coordinate."""
        ids = ids.astype(np.uint64)
        parts = []
        for k in range(1, self._salts.shape[1]):
            parts.append(splitmix64(ids ^ self._salts[table, k]).view(np.uint8).reshape(-1, 8))
        raw = (np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])[:, : self.cfg.teacher_dim]
        return (raw.astype(np.float64) - 127.5) / _UNIFORM_BYTE_STD

    def id_bias(self, table: int, ids: np.ndarray) -> np.ndarray:
        """[len(ids)] float64, uniform with unit variance."""
        h = splitmix64(ids.astype(np.uint64) ^ self._salts[table, 0])
        u = (h >> np.uint64(11)).astype(np.float64) * 2.0**-53
        return (u - 0.5) * math.sqrt(12.0)

    def terms(self, dense, lengths, values, weights) -> np.ndarray:
        """[C, 3]: the unscaled dense, first-order and pairwise terms."""
        num = dense.shape[0]
        out = np.zeros((num, 3))
        if dense.shape[1]:
            out[:, 0] = np.tanh(dense.astype(np.float64) @ self._w1) @ self._w2
        total = np.zeros((num, self.cfg.teacher_dim))
        squares = np.zeros(num)
        for t, (lens, ids) in enumerate(zip(lengths, values)):
            w = None if weights is None else weights[t].astype(np.float64)
            bias = self.id_bias(t, ids)
            emb = self.embeddings(t, ids)
            if w is not None:
                bias, emb = bias * w, emb * w[:, None]
            out[:, 1] += _segment_sum(bias[:, None], lens)[:, 0]
            pooled = _segment_sum(emb, lens)
            total += pooled
            squares += (pooled * pooled).sum(axis=1)
        out[:, 2] = 0.5 * ((total * total).sum(axis=1) - squares)
        return out

    def logits(self, dense, lengths, values, weights) -> np.ndarray:
        """[C] float64: the log-odds of a click."""
        z = self.terms(dense, lengths, values, weights) @ self._scales
        return (z + self._bias) / self.cfg.label_noise


def _segment_sum(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Sum consecutive runs of ``rows`` [V, K] of the given lengths [C] -> [C, K] (empty runs = 0)."""
    starts = np.cumsum(lengths) - lengths
    padded = np.concatenate([rows, np.zeros((1, rows.shape[1]))])  # keeps every start index valid
    out = np.add.reduceat(padded, starts, axis=0)
    out[lengths == 0] = 0.0
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


class SyntheticSource:
    """Learnable synthetic click data (see the module docstring); features ``feature_0..``."""

    name = "synthetic"

    def __init__(self, cfg: SyntheticConfig) -> None:
        self.cfg = cfg
        self.num_dense = cfg.num_dense
        self.feature_names = cfg.feature_names()
        self.table_sizes = cfg.table_sizes()
        self._permutations = [_affine_permutation(cfg.seed, t, n) for t, n in enumerate(self.table_sizes)]
        samplers = {n: ZipfSampler(n, cfg.zipf_alpha) for n in set(self.table_sizes)}
        self._samplers = [samplers[n] for n in self.table_sizes]
        self.teacher = Teacher(cfg)
        calibration = [self._generate(SPLIT_CALIBRATION, 0, c) for c in range(2)]
        self.teacher.calibrate(SampleBlock.concat(calibration))

    # ------------------------------------------------------------------------------ interface
    def tables(self, embedding_dim: int, pooling: str = "sum") -> List[TableConfig]:
        return one_table_per_feature(self.feature_names, self.table_sizes, embedding_dim, pooling)

    def num_train_samples(self) -> int:
        return self.cfg.num_train_samples

    def num_eval_samples(self) -> int:
        return self.cfg.num_eval_samples

    def train_batches(self, batch_size: int, epoch: int = 0, start_batch: int = 0) -> Iterator[Batch]:
        check_batch_args(batch_size, epoch, start_batch)
        epoch = epoch if self.cfg.resample_each_epoch else 0
        for block in self.blocks(SPLIT_TRAIN, epoch, self.cfg.num_train_samples, batch_size, start_batch):
            yield self.to_batch(block)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        check_batch_args(batch_size)
        for block in self.blocks(SPLIT_EVAL, 0, self.cfg.num_eval_samples, batch_size):
            yield self.to_batch(block)

    # ------------------------------------------------------------------------------ extras
    def teacher_logits(self, batch: Batch) -> torch.Tensor:
        """[B] float32: the hidden teacher's log-odds for the samples of ``batch`` (an oracle to
        compare a trained model's AUC with)."""
        kjt = batch.sparse.select_keys(self.feature_names)
        parts = [kjt[f] for f in self.feature_names]
        weights = None if kjt.weights is None else [p.weights.numpy() for p in parts]
        logits = self.teacher.logits(batch.dense.numpy(), [p.lengths.numpy() for p in parts],
                                     [p.values.numpy() for p in parts], weights)
        return torch.from_numpy(logits.astype(np.float32))

    def blocks(self, split: int, epoch: int, num_samples: int, batch_size: int,
               start_batch: int = 0) -> Iterator[SampleBlock]:
        """Samples of a split in batches of ``batch_size``, as numpy blocks."""
        cached: Tuple[int, Optional[SampleBlock]] = (-1, None)
        for start, stop in batch_ranges(num_samples, batch_size, start_batch):
            parts = []
            for chunk in range(start // CHUNK_SAMPLES, (stop - 1) // CHUNK_SAMPLES + 1):
                if cached[0] != chunk:
                    cached = (chunk, self._generate(split, epoch, chunk))
                base = chunk * CHUNK_SAMPLES
                lo, hi = max(start, base) - base, min(stop, base + CHUNK_SAMPLES) - base
                parts.append(cached[1].slice(lo, hi))
            yield SampleBlock.concat(parts)

    def to_batch(self, block: SampleBlock) -> Batch:
        weights = None
        if block.weights is not None:
            weights = torch.from_numpy(np.concatenate(block.weights))
        sparse = KeyedJaggedTensor(
            self.feature_names,
            torch.from_numpy(np.concatenate(block.values)),
            torch.from_numpy(np.concatenate(block.lengths)),
            weights,
            batch_size=len(block),
            validate=False,
        )
        return Batch(torch.from_numpy(block.dense), sparse, torch.from_numpy(block.labels))

    # ------------------------------------------------------------------------------ generation
    def _generate(self, split: int, epoch: int, chunk: int) -> SampleBlock:
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, split, epoch, chunk])
        num = CHUNK_SAMPLES
        dense = rng.standard_normal((num, cfg.num_dense), dtype=np.float32)
        lengths, values, weights = [], [], [] if cfg.weighted else None
        for t, rows in enumerate(self.table_sizes):
            if cfg.pooling == 1.0 or cfg.max_pooling == 1:
                lens = np.ones(num, dtype=np.int64)
            else:
                lens = np.minimum(1 + rng.poisson(cfg.pooling - 1.0, num), cfg.max_pooling).astype(np.int64)
            count = int(lens.sum())
            ranks = self._samplers[t].sample(rng.random(count))
            scale, shift = self._permutations[t]
            lengths.append(lens)
            values.append((ranks * scale + shift) % rows)
            if weights is not None:
                weights.append(1.0 - rng.random(count, dtype=np.float32))
        block = SampleBlock(dense, lengths, values, weights, np.zeros(num, dtype=np.float32))
        if split != SPLIT_CALIBRATION:
            logits = self.teacher.logits(dense, lengths, values, weights)
            block.labels = (rng.random(num) < _sigmoid(logits)).astype(np.float32)
        return block


def _affine_permutation(seed: int, table: int, rows: int) -> Tuple[int, int]:
    """(a, b) with gcd(a, rows) = 1: rank -> (a * rank + b) mod rows is a bijection of the rows;
    a is small enough that a * rank fits in int64."""
    if rows == 1:
        return 1, 0
    rng = np.random.default_rng([seed, 0xAFF1E, table])
    limit = max(2, min(rows, (2**63 - 1) // rows))
    scale = int(rng.integers(1, limit))
    while math.gcd(scale, rows) != 1:
        scale = scale + 1 if scale + 1 < limit else 1
    return scale, int(rng.integers(0, rows))
