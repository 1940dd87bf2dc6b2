"""Triton table-batched kernels against the plain-torch reference.

Without CUDA they run on CPU tensors in triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py) at tiny sizes; with CUDA the same tests run on the GPU at larger sizes.

    python -m pytest tests/gpu/test_triton_tbe.py -q
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from neorec.embedding.kernels import TableBatchedLayout, triton_interpreting  # noqa: E402
from neorec.embedding.kernels import triton_tbe  # noqa: E402
from neorec.embedding.kernels.reference import (  # noqa: E402
    reference_backward_update,
    reference_forward,
    rounding_bracket,
)

pytestmark = pytest.mark.triton

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not triton_interpreting(), reason="needs TRITON_INTERPRET=1")),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                triton_interpreting() or not torch.cuda.is_available(), reason="needs CUDA (not interpreting)"
            ),
        ],
    ),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = ["sgd", "rowwise_adagrad", "adagrad"]


@dataclass
class Setup:
    layout: TableBatchedLayout
    rows: List[int]
    feature_table: List[int]
    batch_size: int
    max_length: int


def make_setup(device: str, wide: bool = False) -> Setup:
    """Mixed dims (not all powers of two), a table shared by a sum and a mean feature."""
    if device == "cpu":
        dims, rows, batch_size, max_length = [4, 8, 12, 16], [5, 7, 4, 6], 3, 4
    else:
        dims, rows, batch_size, max_length = [4, 8, 12, 64, 128, 200], [50, 70, 40, 300, 1000, 20], 64, 12
    if wide:
        dims, rows = dims + [136], rows + [3]
    feature_table = list(range(len(dims))) + [1]
    means = [f % 2 == 1 for f in range(len(feature_table))]
    layout = TableBatchedLayout.build(dims, rows, feature_table, means, device=torch.device(device))
    return Setup(layout, rows, feature_table, batch_size, max_length)


def make_batch(setup: Setup, generator: torch.Generator, device: str, weighted: bool):
    """Random bags (some empty, duplicate ids within and across bags); the first bag is empty."""
    num_bags = len(setup.feature_table) * setup.batch_size
    lengths = torch.randint(0, setup.max_length + 1, (num_bags,), generator=generator)
    lengths[0] = 0
    offsets = torch.zeros(num_bags + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = [
        torch.randint(0, setup.rows[setup.feature_table[bag // setup.batch_size]], (int(n),), generator=generator)
        for bag, n in enumerate(lengths.tolist())
    ]
    indices = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    per_value_weights = torch.rand(indices.numel(), generator=generator) * 2 - 0.5 if weighted else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(indices), move(offsets), move(per_value_weights)


def make_weights(setup: Setup, dtype: torch.dtype, generator: torch.Generator, device: str) -> torch.Tensor:
    return torch.randn(setup.layout.total_elements, generator=generator).to(dtype).to(device)


def tolerance(dtype: torch.dtype) -> dict:
    """Accumulation order differs from the reference: a few fp32 ulps, which can flip one
    low-precision rounding (an ulp of the storage type)."""
    return {
        torch.float32: dict(rtol=1e-5, atol=1e-6),
        torch.float16: dict(rtol=2e-3, atol=1e-4),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3),
    }[dtype]


def cpu(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_matches_reference(device, dtype, weighted):
    generator = torch.Generator().manual_seed(1)
    setup = make_setup(device)
    weights = make_weights(setup, dtype, generator, device)
    indices, offsets, per_value_weights = make_batch(setup, generator, device, weighted)
    output = triton_tbe.tbe_forward(weights, setup.layout, indices, offsets, setup.batch_size, per_value_weights)
    expected = reference_forward(
        weights.cpu(), setup.layout.to(torch.device("cpu")), indices.cpu(), offsets.cpu(),
        setup.batch_size, cpu(per_value_weights),
    )
    assert output.dtype == torch.float32 and output.shape == (setup.batch_size, setup.layout.total_cols)
    torch.testing.assert_close(output.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert output[0, :4].abs().sum() == 0  # empty first bag


@pytest.mark.parametrize("device", DEVICES)
def test_forward_wide_table_spans_column_blocks(device):
    generator = torch.Generator().manual_seed(2)
    setup = make_setup(device, wide=True)
    weights = make_weights(setup, torch.float16, generator, device)
    indices, offsets, per_value_weights = make_batch(setup, generator, device, weighted=True)
    output = triton_tbe.tbe_forward(weights, setup.layout, indices, offsets, setup.batch_size, per_value_weights)
    expected = reference_forward(
        weights.cpu(), setup.layout.to(torch.device("cpu")), indices.cpu(), offsets.cpu(),
        setup.batch_size, cpu(per_value_weights),
    )
    torch.testing.assert_close(output.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_rejects_id_outside_its_table(device):
    setup = make_setup(device)
    weights = torch.zeros(setup.layout.total_elements, device=device)
    num_bags = len(setup.feature_table) * setup.batch_size
    offsets = torch.zeros(num_bags + 1, dtype=torch.int64, device=device)
    offsets[1:] = 1  # bag 0 (feature 0, table 0) holds the only id
    indices = torch.tensor([setup.rows[0]], device=device)
    with pytest.raises(ValueError, match="outside table 0"):
        triton_tbe.tbe_forward(weights, setup.layout, indices, offsets, setup.batch_size)
    # unchecked, the bad id reads nothing instead of memory past the table
    output = triton_tbe.tbe_forward(weights, setup.layout, indices, offsets, setup.batch_size, check_ids=False)
    assert torch.count_nonzero(output) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_fused_update_matches_reference_over_steps(device, dtype, kind):
    generator = torch.Generator().manual_seed(3)
    setup = make_setup(device)
    cpu_layout = setup.layout.to(torch.device("cpu"))
    weights = make_weights(setup, dtype, generator, device)
    state = torch.full((setup.layout.state_size(kind),), 0.1, device=device)
    expected_weights, expected_state = weights.cpu().clone(), state.cpu().clone()
    for step in range(3):
        indices, offsets, per_value_weights = make_batch(setup, generator, device, weighted=step != 1)
        output = triton_tbe.tbe_forward(weights, setup.layout, indices, offsets, setup.batch_size, per_value_weights)
        grad_output = torch.sin(output * 3) + 0.1  # depends on the weights, differs per column
        args = (setup.layout, indices, offsets, setup.batch_size, grad_output, per_value_weights)
        triton_tbe.tbe_backward_update(kind, weights, state, *args, learning_rate=0.05, stochastic_rounding=False)
        reference_backward_update(
            kind, expected_weights, expected_state, cpu_layout, indices.cpu(), offsets.cpu(),
            setup.batch_size, grad_output.cpu(), cpu(per_value_weights), learning_rate=0.05,
        )
        torch.testing.assert_close(weights.cpu().float(), expected_weights.float(), **tolerance(dtype))
        torch.testing.assert_close(state.cpu(), expected_state, rtol=1e-5, atol=1e-6)
    assert not torch.equal(weights.cpu(), make_weights(setup, dtype, torch.Generator().manual_seed(3), "cpu"))


@pytest.mark.parametrize("device", DEVICES)
def test_weight_decay_and_untouched_rows(device):
    generator = torch.Generator().manual_seed(4)
    setup = make_setup(device)
    weights = make_weights(setup, torch.float32, generator, device)
    state = torch.zeros(setup.layout.state_size("rowwise_adagrad"), device=device)
    indices, offsets, per_value_weights = make_batch(setup, generator, device, weighted=True)
    grad_output = torch.randn(setup.batch_size, setup.layout.total_cols, generator=generator).to(device)
    expected_weights, expected_state = weights.cpu().clone(), state.cpu().clone()
    args = (setup.layout, indices, offsets, setup.batch_size, grad_output, per_value_weights)
    segments = triton_tbe.tbe_backward_update(
        "rowwise_adagrad", weights, state, *args, learning_rate=0.1, weight_decay=0.01
    )
    reference_backward_update(
        "rowwise_adagrad", expected_weights, expected_state, setup.layout.to(torch.device("cpu")),
        indices.cpu(), offsets.cpu(), setup.batch_size, grad_output.cpu(), cpu(per_value_weights),
        learning_rate=0.1, weight_decay=0.01,
    )
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.cpu(), expected_state, rtol=1e-5, atol=1e-6)
    touched = torch.zeros(setup.layout.total_rows, dtype=torch.bool)
    touched[segments.row_state_index.cpu()] = True
    assert torch.count_nonzero(state.cpu()[~touched]) == 0
    assert segments.num_rows < indices.numel()  # duplicates were merged into one segment


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adagrad"])
def test_hot_rows_summed_in_chunks_match(device, kind):
    """Rows with more values than max_segment_values take the chunked path; same result."""
    generator = torch.Generator().manual_seed(8)
    setup = make_setup(device)
    start = make_weights(setup, torch.float32, generator, device)
    indices, offsets, per_value_weights = make_batch(setup, generator, device, weighted=True)
    indices = indices % 2  # every table's rows 0 and 1 only: long segments
    grad_output = torch.randn(setup.batch_size, setup.layout.total_cols, generator=generator).to(device)
    args = (setup.layout, indices, offsets, setup.batch_size, grad_output, per_value_weights)
    results = []
    for max_segment_values in (3, 3, 1 << 20):
        weights, state = start.clone(), torch.zeros(setup.layout.state_size(kind), device=device)
        segments = triton_tbe.tbe_backward_update(
            kind, weights, state, *args, learning_rate=0.1, max_segment_values=max_segment_values
        )
        results.append((weights, state, segments.num_chunks))
    assert results[0][2] > 0 and results[2][2] == 0
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[0][0], results[2][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[2][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_all_bags_empty_changes_nothing(device):
    setup = make_setup(device)
    weights = torch.randn(setup.layout.total_elements, device=device)
    state = torch.zeros(setup.layout.total_rows, device=device)
    offsets = torch.zeros(len(setup.feature_table) * setup.batch_size + 1, dtype=torch.int64, device=device)
    indices = torch.zeros(0, dtype=torch.int64, device=device)
    output = triton_tbe.tbe_forward(weights, setup.layout, indices, offsets, setup.batch_size)
    assert torch.count_nonzero(output) == 0
    before = weights.clone()
    grad_output = torch.ones_like(output)
    triton_tbe.tbe_backward_update(
        "rowwise_adagrad", weights, state, setup.layout, indices, offsets, setup.batch_size, grad_output,
        learning_rate=0.1,
    )
    assert torch.equal(weights, before) and torch.count_nonzero(state) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_repeatable_and_within_one_step(device, dtype):
    generator = torch.Generator().manual_seed(5)
    setup = make_setup(device)
    start = make_weights(setup, dtype, generator, device)
    indices, offsets, per_value_weights = make_batch(setup, generator, device, weighted=True)
    grad_output = torch.randn(setup.batch_size, setup.layout.total_cols, generator=generator).to(device)
    args = (setup.layout, indices, offsets, setup.batch_size, grad_output, per_value_weights)
    results = {}
    for seed in (7, 7, 8):
        weights = start.clone()
        triton_tbe.tbe_backward_update("sgd", weights, None, *args, learning_rate=0.3, seed=seed)
        results.setdefault(seed, []).append(weights.cpu())
    assert torch.equal(results[7][0], results[7][1])
    assert not torch.equal(results[7][0], results[8][0])
    exact = start.cpu().float()
    reference_backward_update(
        "sgd", exact, None, setup.layout.to(torch.device("cpu")), indices.cpu(), offsets.cpu(),
        setup.batch_size, grad_output.cpu(), cpu(per_value_weights), learning_rate=0.3,
    )
    down, up = rounding_bracket(exact, dtype)
    gap = (up.float() - down.float()).abs()
    for rounded in (results[7][0], results[8][0]):
        assert bool(((rounded.float() - exact).abs() <= gap * 1.001 + 1e-7).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_is_unbiased(device, dtype):
    """Every row of a dim-16 table moves from 1.0 by -lr * 1: mean of the stored values over rows,
    columns and seeds approaches the exact result; round-to-nearest would stay at 1.0."""
    rows, batch_size = 32, 32
    layout = TableBatchedLayout.build([16], [rows], [0], [False], device=torch.device(device))
    indices = torch.arange(rows, device=device)
    offsets = torch.arange(batch_size + 1, device=device)
    grad_output = torch.ones(batch_size, 16, device=device)
    # 1 - lr lies 0.3 of an fp16 step and 0.16 of a bf16 step below a representable number
    learning_rate = 1.3 * 2**-11
    exact = torch.tensor(1.0 - learning_rate)
    down, up = rounding_bracket(exact, dtype)
    values = []
    for seed in range(4):
        weights = torch.ones(rows * 16, dtype=dtype, device=device)
        triton_tbe.tbe_backward_update(
            "sgd", weights, None, layout, indices, offsets, batch_size, grad_output,
            learning_rate=learning_rate, seed=seed,
        )
        stored = weights.cpu().float()
        assert bool(((stored == down.float()) | (stored == up.float())).all())
        values.append(stored)
    samples = torch.cat(values)
    probability_up = float((exact - down.float()) / (up.float() - down.float()))
    standard_error = float((up.float() - down.float()).abs()) * (probability_up * (1 - probability_up) / samples.numel()) ** 0.5
    assert abs(float(samples.mean()) - float(exact)) < 5 * standard_error
    nearest = exact.to(dtype).float()
    assert abs(float(nearest) - float(exact)) > 10 * standard_error  # the test can tell SR from RNE


@triton.jit
def _round_test_kernel(values_ptr, out_ptr, n, BF16: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(values_ptr + offsets, mask=mask, other=0.0)
    rounded = triton_tbe._round_for_storage(values, offsets, 0, out_ptr.dtype.element_ty, BF16, False)
    tl.store(out_ptr + offsets, rounded, mask=mask)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # interpreter: 3e38 -> fp16 inf
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_to_nearest_even_matches_torch(device, dtype):
    special = [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1.0 + 2**-11, 1.0 + 3 * 2**-11,
               3.0e38, -3.0e38, 70000.0, float("inf"), float("-inf"), 1e-30, 6e-8]
    values = torch.cat([torch.tensor(special), torch.randn(200, generator=torch.Generator().manual_seed(6))])
    out = torch.empty(values.numel(), dtype=dtype, device=device)
    _round_test_kernel[(1,)](values.to(device), out, values.numel(), BF16=dtype == torch.bfloat16, BLOCK=256)
    assert torch.equal(out.cpu().view(torch.int16), values.to(dtype).view(torch.int16))
    nan_out = torch.empty(1, dtype=dtype, device=device)
    _round_test_kernel[(1,)](torch.tensor([float("nan")], device=device), nan_out, 1,
                             BF16=dtype == torch.bfloat16, BLOCK=16)
    assert torch.isnan(nan_out.cpu()).all()


def test_layout_rejects_overlapping_output_columns():
    with pytest.raises(ValueError, match="tile"):
        TableBatchedLayout.build([4, 8], [3, 3], [0, 1], [False, False], output_col_offsets=[0, 2])
    with pytest.raises(ValueError, match="overlap"):
        TableBatchedLayout.build([4, 8], [3, 3], [0, 1], [False, False], table_offsets=[0, 8])

