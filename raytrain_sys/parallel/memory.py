"""Per-rank bytes of parameters, gradients and optimizer state, measured on the local shards.

What is counted is what this rank's tensors hold right now: a DTensor counts its local shard, a
tensor shared by two names (the tied embedding) counts once. Not counted: activations, DDP's
gradient buckets (with ``gradient_as_bucket_view`` off, DDP keeps a second copy of the
gradients), FSDP's transient all-gather buffers. Measure after ``optimizer.step()`` and before
``zero_grad``, when parameters, gradients and optimizer state all exist.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.distributed.tensor import DTensor


@dataclass
class RankBytes:
    param_bytes: int
    grad_bytes: int
    optim_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors, seen: set[int]) -> int:
    n = 0
    for t in tensors:
        if t is None:
            continue
        local = _local(t)
        # Views into one buffer (FSDP2's sharded gradients) are distinct tensors; the tied
        # embedding is the same tensor twice.
        key = (local.data_ptr(), local.numel()) if local.numel() else id(local)
        if key in seen:
            continue
        seen.add(key)
        n += local.numel() * local.element_size()
    return n


def rank_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> RankBytes:
    """Bytes this rank holds for ``module``'s parameters, their gradients and ``optimizer``'s
    state (pass ``ParallelModel.local_model``)."""
    params = list(module.parameters())
    seen: set[int] = set()
    param_bytes = _bytes(params, seen)
    grad_bytes = _bytes([p.grad for p in params], seen)
    optim_bytes = 0
    if optimizer is not None:
        states = [v for st in optimizer.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor)]
        optim_bytes = _bytes(states, seen)
    return RankBytes(param_bytes, grad_bytes, optim_bytes)


__all__ = ["RankBytes", "rank_bytes"]
