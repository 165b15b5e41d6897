"""Data parallelism: FSDP2 (full shard, ZeRO-2-like, HSDP) and DDP with compression hooks.

FSDP2 ``fully_shard`` goes on every transformer block first, then on the root: a block's
parameters are all-gathered just before it runs and freed after, while the root unit keeps what
is left (embeddings, final norm, head). The tied ``wte`` / ``lm_head`` weight is one parameter
and both its users are in the root unit, so the tie holds without any special case.

FSDP2 is imported inside the functions that use it: it pulls in DTensor, about a second in every
worker process, which a DDP job never needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from raytrain_sys.parallel.timing import StepClock


def mixed_precision_policy(name: str) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if name == "bf16":
        # Compute in bf16, reduce gradients in fp32: bf16 sums of many ranks lose too many bits
        # (torchtitan's default policy).
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(blocks: list[nn.Module], roots: list[nn.Module], dp_mesh: DeviceMesh,
               reshard_after_forward: bool, mixed_precision: str = "none") -> None:
    """Shard ``blocks`` one unit each, then each of ``roots`` (one per pipeline stage).

    ``dp_mesh`` is 1-D ("fsdp") for FSDP or 2-D ("dp", "fsdp") for HSDP: FSDP2 shards over
    the last axis and replicates over the first.
    """
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision_policy(mixed_precision)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    for root in roots:
        # The root's parameters are used again first thing in backward (the head, then the
        # embedding at the very end); freeing them after forward would only gather them again.
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)


def apply_ddp(module: nn.Module, dp_mesh: DeviceMesh, device: str, comm_hook: str = "none",
              powersgd_rank: int = 1, powersgd_start_iter: int = 10,
              clock: StepClock | None = None) -> DistributedDataParallel:
    """DDP over the "dp" axis, for models without DTensor parameters (no TP).

    Given the axis's process group, not ``device_mesh=``: with a mesh sliced from a larger one
    (ours always is), DDP applies its TP transform, which swaps DTensor parameters for new local
    Parameter objects around every forward, so an optimizer built once updates stale tensors
    (the same trap as the composable ``replicate()``). Replicas of a TP or pipelined model
    all-reduce without DDP (parallelize.py).

    ``clock``: the hook marks when each bucket's gradients are ready, which splits the rank's
    compute from its exposed wait on the all-reduce (raytrain_sys.parallel.timing); without a
    compression hook that is torch's own all-reduce hook, which averages as DDP's built-in one does.
    """
    device_ids = [torch.device(device).index] if device.startswith("cuda") else None
    group = dp_mesh.get_group()
    ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=group)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state, hook = group, (default_hooks.allreduce_hook if clock is not None else None)
    if comm_hook == "fp16":
        hook = default_hooks.fp16_compress_hook
    elif comm_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        # The per-tensor hook: batched_powerSGD_hook fails on CPU tensors.
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=powersgd_rank,
                                   start_powerSGD_iter=powersgd_start_iter,
                                   min_compression_rate=1.0)  # compress every matrix, even small ones
        hook = psgd.powerSGD_hook
    if hook is not None:
        ranks = tuple(dist.get_process_group_ranks(group)) if clock is not None else None
        ddp.register_comm_hook(state, clock.timed(hook, ranks) if clock is not None else hook)
    return ddp


__all__ = ["apply_fsdp", "apply_ddp", "mixed_precision_policy"]
