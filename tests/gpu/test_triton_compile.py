"""The Triton kernels (table-batched embedding and cache) compile for NVIDIA GPUs (sm_80, down to
a cubin with the bundled ptxas), even on a machine without one: catches typing and lowering errors
that the CPU interpreter lets through.

    python -m pytest tests/gpu/test_triton_compile.py -q
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

# Runs in a fresh process: kernels defined under TRITON_INTERPRET=1 cannot be compiled.
SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from neorec.embedding.kernels import triton_tbe as k

target = GPUTarget("cuda", 80, 32)
forward_signature = dict(
    weights_ptr="*bf16", indices_ptr="*i64", bag_offsets_ptr="*i64", per_value_weights_ptr="*fp32",
    table_offsets_ptr="*i64", table_dims_ptr="*i32", table_rows_ptr="*i64", feature_table_ptr="*i32",
    feature_pooling_mean_ptr="*i32", output_col_offsets_ptr="*i64", output_ptr="*fp32",
    batch_size="i32", total_cols="i32", HAS_WEIGHTS="constexpr", BLOCK_L="constexpr", BLOCK_D="constexpr")
triton.compile(ASTSource(k._pooled_forward_kernel, forward_signature,
                         constexprs=dict(HAS_WEIGHTS=True, BLOCK_L=16, BLOCK_D=128)), target=target)
for weight_type, optimizer, stochastic, partials in (
    ("bf16", 1, True, True), ("fp16", 2, True, False), ("fp32", 0, False, False)
):
    signature = dict(
        weights_ptr="*" + weight_type, state_ptr="*fp32", grad_output_ptr="*fp32",
        value_starts_ptr="*i64", value_ends_ptr="*i64", partial_starts_ptr="*i64", partial_ends_ptr="*i64",
        partials_ptr="*fp32", partial_stride="i32",
        row_weight_offsets_ptr="*i64", row_dims_ptr="*i32", row_state_index_ptr="*i64",
        sorted_grad_offsets_ptr="*i64", sorted_scales_ptr="*fp32", learning_rate="fp32", eps="fp32",
        weight_decay="fp32", seed="i64", OPTIMIZER="constexpr", BF16="constexpr", STOCHASTIC="constexpr",
        HAS_PARTIALS="constexpr", BLOCK_L="constexpr", BLOCK_D="constexpr")
    constants = dict(OPTIMIZER=optimizer, BF16=weight_type == "bf16", STOCHASTIC=stochastic,
                     HAS_PARTIALS=partials, BLOCK_L=8, BLOCK_D=128)
    compiled = triton.compile(ASTSource(k._fused_backward_update_kernel, signature, constexprs=constants),
                              target=target)
    assert compiled.asm["cubin"]
chunk_signature = dict(
    grad_output_ptr="*fp32", sorted_grad_offsets_ptr="*i64", sorted_scales_ptr="*fp32",
    chunk_value_starts_ptr="*i64", chunk_value_ends_ptr="*i64", chunk_dims_ptr="*i32", partials_ptr="*fp32",
    partial_stride="i32", BLOCK_L="constexpr", BLOCK_D="constexpr")
triton.compile(ASTSource(k._chunk_partial_kernel, chunk_signature, constexprs=dict(BLOCK_L=8, BLOCK_D=128)),
               target=target)
from neorec.embedding.kernels import triton_cache as c
find_signature = dict(rows_ptr="*i64", slot_rows_ptr="*i64", out_slots_ptr="*i64", out_sets_ptr="*i64",
                      num_rows="i32", num_sets="i32", ways="i32", hash_multiplier="i64",
                      BLOCK="constexpr", BLOCK_W="constexpr")
assert triton.compile(ASTSource(c._cache_find_kernel, find_signature, constexprs=dict(BLOCK=128, BLOCK_W=32)),
                      target=target).asm["cubin"]
place_signature = dict(slot_rows_ptr="*i64", last_use_ptr="*i64", counts_ptr="*i64", pinned_until_ptr="*i64",
                       set_ids_ptr="*i64", set_starts_ptr="*i64", set_counts_ptr="*i64", order_ptr="*i64",
                       out_slots_ptr="*i64", ways="i32", completed="i64", generation="i64", LFU="constexpr",
                       UNAVAILABLE="constexpr", LFU_MASK="constexpr", BLOCK_W="constexpr")
for lfu in (False, True):
    constants = dict(LFU=lfu, UNAVAILABLE=c._UNAVAILABLE, LFU_MASK=c._LFU_MASK, BLOCK_W=32)
    assert triton.compile(ASTSource(c._cache_place_kernel, place_signature, constexprs=constants),
                          target=target).asm["cubin"]
print("compiled")
"""


def test_kernels_compile_for_sm80():
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
