"""Click-prediction quality metrics: ROC AUC, normalized entropy (NE), calibration, log loss.

    acc = MetricsAccumulator()
    for batch in eval_batches:
        acc.update(model(batch.dense, batch.sparse), batch.labels)   # logits [B], labels [B]
    acc.compute()   # {"auc", "ne", "calibration", "log_loss", "num_samples", "ctr"}

Definitions (p = predicted click probability, y = label in {0, 1}, ctr = mean(y)):
  log_loss    = mean(-(y ln p + (1 - y) ln(1 - p)))                       (natural log)
  NE          = log_loss / H(ctr), H(q) = -(q ln q + (1 - q) ln(1 - q)): log loss relative to
                always predicting the base rate; 1.0 for that constant predictor, lower is better
                (He et al., "Practical lessons from predicting clicks on ads at Facebook", 2014)
  calibration = mean(p) / ctr: 1.0 when the predicted click count matches the observed one
  AUC         = P(score of a random positive > score of a random negative), ties counting 1/2
Undefined values are NaN, never an exception: AUC with no positives or no negatives (or NaN
scores), NE and calibration when ctr is 0 (and NE when ctr is 1). All sums run in float64.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

ArrayLike = Union[torch.Tensor, Sequence[float]]  # or a numpy array


def _pair(name: str, predictions: ArrayLike, labels: ArrayLike) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both as 1-D float64 tensors of equal length on the predictions' device."""
    pred = torch.as_tensor(predictions)
    lab = torch.as_tensor(labels, device=pred.device)
    if pred.dim() != 1 or pred.shape != lab.shape:
        raise ValueError(
            f"{name}: predictions and labels must be 1-D of equal length, got shapes "
            f"{tuple(pred.shape)} and {tuple(lab.shape)}"
        )
    return pred.detach().to(torch.float64), lab.detach().to(torch.float64)


def _check_probability_labels(name: str, labels: torch.Tensor) -> None:
    if labels.numel() and (bool((labels < 0).any()) or bool((labels > 1).any()) or bool(labels.isnan().any())):
        raise ValueError(f"{name}: labels must lie in [0, 1]")


def auc(scores: ArrayLike, labels: ArrayLike) -> float:
    """Exact ROC AUC of ``scores`` [N] (any monotone scale: logits or probabilities) against
    binary ``labels`` [N], in O(N log N). Tied scores count as half-correct pairs (equivalent to
    the Mann-Whitney U statistic with average ranks). NaN if a class is absent or a score is NaN."""
    s, y = _pair("auc", scores, labels)
    if y.numel() and not bool(((y == 0) | (y == 1)).all()):
        raise ValueError("auc: labels must be 0 or 1")
    num_pos = int((y == 1).sum())
    num_neg = y.numel() - num_pos
    if num_pos == 0 or num_neg == 0 or bool(s.isnan().any()):
        return float("nan")
    s_sorted, order = torch.sort(s)
    _, group_sizes = torch.unique_consecutive(s_sorted, return_counts=True)
    group = torch.repeat_interleave(torch.arange(group_sizes.numel(), device=s.device), group_sizes)
    pos = torch.zeros_like(group_sizes).index_add_(0, group, y[order].to(group_sizes.dtype))
    neg = group_sizes - pos
    neg_below = torch.cumsum(neg, 0) - neg  # negatives with a strictly lower score
    correct = (pos.double() * (neg_below.double() + 0.5 * neg.double())).sum()
    return float(correct / (float(num_pos) * float(num_neg)))


def binary_entropy(rate: float) -> float:
    """H(q) = -(q ln q + (1 - q) ln(1 - q)) in nats; 0 at q in {0, 1}."""
    if rate <= 0.0 or rate >= 1.0:
        return 0.0
    return -(rate * math.log(rate) + (1.0 - rate) * math.log(1.0 - rate))


def log_loss(probs: ArrayLike, labels: ArrayLike, eps: float = 1e-7) -> float:
    """Mean binary cross entropy (nats) of ``probs`` [N] clipped to [eps, 1 - eps]; NaN if N = 0."""
    p, y = _pair("log_loss", probs, labels)
    _check_probability_labels("log_loss", y)
    if y.numel() == 0:
        return float("nan")
    p = p.clamp(eps, 1.0 - eps)
    return float(-(y * torch.log(p) + (1.0 - y) * torch.log1p(-p)).mean())


def _normalize(mean_log_loss: float, ctr: float) -> float:
    entropy = binary_entropy(ctr)
    return mean_log_loss / entropy if entropy > 0.0 else float("nan")


def normalized_entropy(probs: ArrayLike, labels: ArrayLike, eps: float = 1e-7) -> float:
    """NE = mean log loss / H(ctr): 1.0 for a constant prediction at the base rate ctr, lower is
    better. ``probs`` [N] are clipped to [eps, 1 - eps]. NaN when ctr is 0 or 1 (H = 0) or N = 0."""
    p, y = _pair("normalized_entropy", probs, labels)
    _check_probability_labels("normalized_entropy", y)
    if y.numel() == 0:
        return float("nan")
    return _normalize(log_loss(p, y, eps), float(y.mean()))


def calibration(probs: ArrayLike, labels: ArrayLike) -> float:
    """mean(probs) / mean(labels) for ``probs``, ``labels`` [N]; NaN when no label is positive."""
    p, y = _pair("calibration", probs, labels)
    _check_probability_labels("calibration", y)
    observed = float(y.sum())
    return float(p.sum()) / observed if observed > 0 else float("nan")


def _log_loss_of_logits(z: torch.Tensor, y: torch.Tensor) -> float:
    """Mean of y softplus(-z) + (1 - y) softplus(z), each term only where its weight is not 0
    (``binary_cross_entropy_with_logits`` gives NaN for a logit of +-inf: 0 x inf)."""
    z, y = z.to(torch.float64), y.to(torch.float64)
    positive = torch.where(y > 0, y * F.softplus(-z), 0.0)
    negative = torch.where(y < 1, (1 - y) * F.softplus(z), 0.0)
    return float((positive + negative).mean())


METRIC_KEYS = ("auc", "ne", "calibration", "log_loss", "num_samples", "ctr")  # what compute_metrics returns


def compute_metrics(logits: ArrayLike, labels: ArrayLike) -> Dict[str, float]:
    """All metrics from ``logits`` [N] (pre-sigmoid) and ``labels`` [N] in [0, 1].

    Log loss (and NE) come straight from the logits (``_log_loss_of_logits``), so no eps clipping
    is needed, and a saturated logit (+-inf) costs 0 when right, inf when wrong. Returns auc, ne,
    calibration, log_loss, num_samples, ctr.
    """
    z, y = _pair("compute_metrics", logits, labels)
    _check_probability_labels("compute_metrics", y)
    n = y.numel()
    if n == 0:
        nan = float("nan")
        return {"auc": nan, "ne": nan, "calibration": nan, "log_loss": nan, "num_samples": 0, "ctr": nan}
    ctr = float(y.mean())
    loss = _log_loss_of_logits(z, y)
    is_binary = bool(((y == 0) | (y == 1)).all())
    return {
        "auc": auc(z, y) if is_binary else float("nan"),
        "ne": _normalize(loss, ctr),
        "calibration": calibration(torch.sigmoid(z), y),
        "log_loss": loss,
        "num_samples": int(n),
        "ctr": ctr,
    }


class MetricsAccumulator:
    """Collects (logits, labels) over many batches and computes metrics over all of them.

    Keeps detached float32 copies on the device they arrive on (no host sync per update); memory
    is 8 bytes per sample, and ``compute_metrics`` (exact AUC: a sort) peaks at about 120 bytes per
    sample. For data-parallel evaluation gather ``logits()``/``labels()`` from all ranks and call
    ``compute_metrics`` on the result: AUC does not decompose over shards (the trainer gathers on
    rank 0 alone and broadcasts the figures).
    """

    def __init__(self) -> None:
        self._logits: List[torch.Tensor] = []
        self._labels: List[torch.Tensor] = []

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add ``logits`` [B] (pre-sigmoid) and ``labels`` [B] in [0, 1]."""
        if logits.dim() != 1 or logits.shape != labels.shape:
            raise ValueError(
                f"MetricsAccumulator.update: logits and labels must be [B], got shapes "
                f"{tuple(logits.shape)} and {tuple(labels.shape)}"
            )
        self._logits.append(logits.detach().to(torch.float32, copy=True))
        self._labels.append(labels.detach().to(device=logits.device, dtype=torch.float32, copy=True))

    @property
    def num_samples(self) -> int:
        return sum(int(t.numel()) for t in self._labels)

    def logits(self) -> torch.Tensor:
        """[N] all logits so far (float32)."""
        return torch.cat(self._logits) if self._logits else torch.zeros(0)

    def labels(self) -> torch.Tensor:
        """[N] all labels so far (float32)."""
        return torch.cat(self._labels) if self._labels else torch.zeros(0)

    def compute(self) -> Dict[str, float]:
        """auc, ne, calibration, log_loss, num_samples, ctr over everything since ``reset``."""
        return compute_metrics(self.logits(), self.labels())

    def reset(self) -> None:
        self._logits.clear()
        self._labels.clear()
