"""Device names made concrete: a tensor on the first GPU says ``cuda:0``, and ``torch.device("cuda")
!= torch.device("cuda:0")``, so a module that compares its inputs' device with the one it was given
must hold the indexed name."""

from __future__ import annotations

from typing import Optional, Union

import torch


def concrete_device(device: Optional[Union[str, torch.device]]) -> torch.device:
    """``device`` (None: the CPU) with a CUDA device's index filled in (the current device)."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
