"""Quantized checkpoints (Check-N-Run): rows quantized to 8, 4 or 2 bits within their error
bound, restored within it, rows that cannot be quantized named with the run's resume point.

    python -m pytest tests/unit/train/test_checkpoint_quantized.py -q
"""

from __future__ import annotations

import pytest
import torch

from neorec.train.checkpoint_files import dequantize_rows, quantize_rows

from test_checkpoint import checkpoint_args, make_trainer, snapshot


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_rows_error_bound(bits):
    x = torch.randn(37, 11) * torch.linspace(0.01, 3, 37)[:, None]
    codes, scale, minimum = quantize_rows(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (37, (11 * bits + 7) // 8)
    back = dequantize_rows(codes, scale, minimum, bits, 11)
    assert torch.all((back - x).abs() <= scale[:, None] / 2 + 1e-6)
    assert torch.equal(back.amin(1), x.amin(1)) or torch.allclose(back.amin(1), x.amin(1))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_rows_of_no_row_or_no_column(bits):
    """An incremental piece with no modified row: 4- and 2-bit packing raised ``cannot reshape
    tensor of 0 elements`` (a RuntimeError, which stopped the run with a traceback)."""
    for rows, cols in ((0, 11), (3, 0), (0, 0)):
        codes, scale, minimum = quantize_rows(torch.zeros(rows, cols), bits)
        assert codes.dtype == torch.uint8 and codes.shape == (rows, (cols * bits + 7) // 8)
        assert scale.shape == minimum.shape == (rows,)
        assert dequantize_rows(codes, scale, minimum, bits, cols).shape == (rows, cols)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_checkpoint_restores_within_error(tmp_path, bits):
    trainer = make_trainer(tmp_path, "train.max_steps=6", *checkpoint_args(tmp_path, 6, f"checkpoint.row_bits={bits}"))
    trainer.fit()
    restored = make_trainer(tmp_path, "train.max_steps=6", resume=str(tmp_path / "ckpt"), name="restored")
    restored.fit()
    a, b = snapshot(trainer), snapshot(restored)
    for key in a:
        if key.endswith(".w"):
            spread = (a[key].amax(1) - a[key].amin(1))[:, None]
            assert torch.all((a[key] - b[key]).abs() <= spread / ((1 << bits) - 1) / 2 + 1e-6), key
            assert not torch.equal(a[key], b[key])
        else:  # optimizer state and dense weights stay exact
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("incremental", [False, True])
def test_a_row_that_cannot_be_quantized_stops_the_run_naming_table_row_and_resume_point(tmp_path, incremental):
    """It raised quantize_rows' bare ValueError (the usage exit code 2), with the row's index in
    the saved subset, no table, no step, no checkpoint to go on from. (A row of NaN or inf is
    stopped before, as a diverged update: test_trainer_log; this one is finite, with a span
    beyond fp32's range.)"""
    from neorec.train.checkpoint import CheckpointWriteError

    extra = ["checkpoint.row_bits=8", f"checkpoint.incremental={'true' if incremental else 'false'}",
             "checkpoint.full_when_fraction_exceeds=100.0"]
    trainer = make_trainer(tmp_path, "train.max_steps=2", *checkpoint_args(tmp_path, 2, *extra))
    trainer.fit()
    tbe = trainer.model.sparse_arch.tbe
    weight = tbe.get_table_weight("t_feature_2")
    weight[150, 0], weight[150, 1] = -3e38, 3e38
    tbe.set_table_weight("t_feature_2", weight)
    if incremental:  # rows 10 and 150 changed since step 2: the bad row is the second one written
        start = tbe.table_row_offsets[tbe._table("t_feature_2")]
        tbe.modified_rows.zero_()
        tbe.modified_rows[start + 10] = tbe.modified_rows[start + 150] = True
    trainer.step = 3
    with pytest.raises(CheckpointWriteError, match=r"checkpoint of step 3 .*table 't_feature_2' row 150 holds NaN "
                       r"or inf.*its last complete checkpoint is of step 2") as caught:
        trainer.checkpointer.save()
    assert caught.value.exit_code == 1


def test_quantize_rows_refuses_rows_whose_range_overflows():
    x = torch.tensor([[0.0, 1.0], [-3e38, 3e38]])
    with pytest.raises(ValueError, match="quantize_rows: row 1 .* spanning more than the fp32 range"):
        quantize_rows(x, 8)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantized_rows_of_subnormals_keep_their_span(bits):
    """A row spanning a few subnormals got scale 0 and came back constant (error 21 ulps)."""
    tiny = torch.tensor([[1e-39, 1.00003e-39, 1.00001e-39, 1.00002e-39]])
    codes, scale, minimum = quantize_rows(tiny, bits)
    back = dequantize_rows(codes, scale, minimum, bits, 4)
    assert scale[0] > 0 and back.amax() > back.amin()
    assert torch.all((back - tiny).abs() <= scale / 2 + torch.finfo(torch.float32).smallest_normal * 2**-23)
