"""Data parallel: the parallelize function for ``parallel.strategy: ddp``.

The model is wrapped, never edited. DDP holds the process group it was built with, so after a
group rebuild the caller wraps the same module again; parameters (and so the optimizer, which
holds the module's own parameter tensors) are kept.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def parallelize_ddp(model: torch.nn.Module, device: str) -> DistributedDataParallel:
    device_ids = [torch.device(device).index] if device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=device_ids)
