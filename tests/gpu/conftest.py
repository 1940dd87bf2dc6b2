"""Triton kernels run in triton's CPU interpreter when there is no CUDA device.

The switch must be set before triton is imported (its ``@triton.jit`` reads it when a kernel is
defined), so it is set here, when pytest collects this folder, unless the caller chose a value.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
