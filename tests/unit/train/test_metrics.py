"""Metrics against brute-force definitions (and scikit-learn when it happens to be installed)."""

import math

import numpy as np
import pytest
import torch

from neorec.train.metrics import (
    MetricsAccumulator,
    auc,
    calibration,
    compute_metrics,
    log_loss,
    normalized_entropy,
)


def brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def brute_force_log_loss(probs, labels):
    return -sum(y * math.log(p) + (1 - y) * math.log(1 - p) for p, y in zip(probs, labels)) / len(labels)


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_pairwise_count_with_ties(seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (60,), generator=gen).float() / 5  # many ties
    labels = torch.randint(0, 2, (60,), generator=gen).float()
    assert auc(scores, labels) == pytest.approx(brute_force_auc(scores.tolist(), labels.tolist()), abs=1e-12)


def test_auc_extremes_and_undefined():
    labels = torch.tensor([0.0, 0, 1, 1, 0, 1])
    assert auc(labels * 2 - 1, labels) == 1.0
    assert auc(1 - labels, labels) == 0.0
    assert auc(torch.zeros(6), labels) == 0.5  # all tied
    assert math.isnan(auc(torch.rand(4), torch.zeros(4)))
    assert math.isnan(auc(torch.tensor([0.1, float("nan")]), torch.tensor([0.0, 1.0])))
    assert auc(np.array([0.2, 0.9, 0.4]), [0, 1, 1]) == 1.0  # numpy and lists work too
    with pytest.raises(ValueError, match="0 or 1"):
        auc(torch.rand(3), torch.tensor([0.0, 0.5, 1.0]))
    with pytest.raises(ValueError, match="equal length"):
        auc(torch.rand(3), torch.rand(4))


def test_log_loss_ne_and_calibration_definitions():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(50, generator=gen) * 0.98 + 0.01
    labels = (torch.rand(50, generator=gen) < 0.3).float()
    expected = brute_force_log_loss(probs.tolist(), labels.tolist())
    assert log_loss(probs, labels) == pytest.approx(expected, rel=1e-9)
    ctr = labels.sum().item() / len(labels)
    entropy = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    assert normalized_entropy(probs, labels) == pytest.approx(expected / entropy, rel=1e-9)
    assert calibration(probs, labels) == pytest.approx(probs.mean().item() / ctr, rel=1e-6)
    # A constant prediction at the base rate has NE exactly 1 and calibration 1.
    constant = torch.full((50,), ctr, dtype=torch.float64)
    assert normalized_entropy(constant, labels) == pytest.approx(1.0, abs=1e-12)
    assert calibration(constant, labels) == pytest.approx(1.0, abs=1e-12)


def test_ne_and_calibration_undefined_when_base_rate_degenerate():
    probs = torch.rand(5)
    assert math.isnan(normalized_entropy(probs, torch.zeros(5)))
    assert math.isnan(normalized_entropy(probs, torch.ones(5)))
    assert math.isnan(calibration(probs, torch.zeros(5)))
    assert math.isfinite(log_loss(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])))  # eps clip
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        log_loss(probs, torch.full((5,), 2.0))


def test_accumulator_streams_and_matches_one_shot():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(200, generator=gen) * 3
    labels = (torch.rand(200, generator=gen) < torch.sigmoid(logits)).float()
    acc = MetricsAccumulator()
    for chunk in range(0, 200, 64):
        acc.update(logits[chunk : chunk + 64].double(), labels[chunk : chunk + 64])
    result = acc.compute()
    probs = torch.sigmoid(logits.double())
    assert result["num_samples"] == 200 and acc.num_samples == 200
    assert result["ctr"] == pytest.approx(labels.mean().item())
    assert result["auc"] == pytest.approx(brute_force_auc(logits.tolist(), labels.tolist()), abs=1e-12)
    assert result["log_loss"] == pytest.approx(brute_force_log_loss(probs.tolist(), labels.tolist()), rel=1e-6)
    assert result["ne"] == pytest.approx(normalized_entropy(probs, labels), rel=1e-6)
    assert result["calibration"] == pytest.approx(calibration(probs, labels), rel=1e-6)
    assert acc.logits().dtype == torch.float32
    assert compute_metrics(logits, labels) == pytest.approx(result)
    acc.reset()
    empty = acc.compute()
    assert empty["num_samples"] == 0 and math.isnan(empty["auc"])


def test_accumulator_keeps_detached_copies():
    acc = MetricsAccumulator()
    logits = torch.zeros(3, requires_grad=True)
    labels = torch.tensor([0.0, 1.0, 1.0])
    acc.update(logits * 1, labels)
    labels[0] = 1.0  # later in-place edits must not leak in
    assert not acc.logits().requires_grad and acc.labels().tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"\[B\]"):
        acc.update(torch.zeros(3, 1), torch.zeros(3))


def test_extreme_logits_stay_finite():
    result = compute_metrics(torch.tensor([-200.0, 200.0, 150.0]), torch.tensor([0.0, 1.0, 1.0]))
    assert result["log_loss"] == pytest.approx(0.0, abs=1e-30) and result["auc"] == 1.0


def test_saturated_logits_cost_nothing_when_right_and_infinity_when_wrong():
    """binary_cross_entropy_with_logits gave NaN log loss and NE for a logit of +-inf (0 x inf)."""
    inf = math.inf
    right = compute_metrics(torch.tensor([inf, -inf, 1.0, -1.0]), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    expected = 2 * math.log1p(math.exp(-1.0)) / 4  # the two finite logits' terms
    assert right["log_loss"] == pytest.approx(expected, rel=1e-12)
    assert right["ne"] == pytest.approx(expected / math.log(2), rel=1e-12) and right["auc"] == 1.0
    wrong = compute_metrics(torch.tensor([-inf, 0.0]), torch.tensor([1.0, 0.0]))
    assert wrong["log_loss"] == inf and wrong["ne"] == inf
    soft = compute_metrics(torch.tensor([0.3, -2.0]), torch.tensor([0.25, 0.5]))  # soft labels: the usual formula
    reference = torch.nn.functional.binary_cross_entropy_with_logits(torch.tensor([0.3, -2.0], dtype=torch.float64),
                                                                     torch.tensor([0.25, 0.5], dtype=torch.float64))
    assert soft["log_loss"] == pytest.approx(float(reference), rel=1e-7)  # the inputs go through float32


def test_against_sklearn_when_installed():
    metrics = pytest.importorskip("sklearn.metrics")
    gen = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 20, (500,), generator=gen).double() / 19
    labels = (torch.rand(500, generator=gen) < 0.4).double()
    assert auc(scores, labels) == pytest.approx(metrics.roc_auc_score(labels, scores), abs=1e-12)
    probs = scores.clamp(0.01, 0.99)
    assert log_loss(probs, labels) == pytest.approx(metrics.log_loss(labels, probs), rel=1e-9)
