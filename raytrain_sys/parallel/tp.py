"""Tensor parallel + sequence parallel for the GPT, as a plan of data.

The plan maps submodule-name patterns (``parallelize_module`` matches each dotted part with
fnmatch) to DTensor placement styles. Between blocks the residual stream is a plain local tensor
holding this rank's slice of the sequence (sequence parallel, Korthikanti et al. 2022): the
LayerNorms run on that slice, the MLP all-gathers the sequence on the way in and
reduce-scatters it on the way out (Megatron's column-then-row split, Shoeybi et al. 2019).

What stays replicated across the tensor-parallel ranks, and why:
- **Attention** (``attn.c_attn``, ``attn.c_proj``): the GPT fuses q, k and v into one
  ``c_attn`` of shape (3C, C) in GPT-2's [q | k | v] layout and its forward reads the head size
  from the input width. A contiguous column shard of that weight does not hold whole heads, and
  a head-aligned shard is strided, which DCP cannot reshard. Each TP rank therefore computes the
  full attention for the whole sequence (the all-gather before it and the slice after it are the
  same as a sharded attention's). Sharding attention needs a model-side change (a head-major qkv
  layout and ``view(B, T, -1, head_dim)``), left for when a model needs it.
- **Embeddings and the tied head** (``wte`` = ``lm_head``): kept as plain tensors so the tie
  is one parameter, as in the model; their gradients are equal on every TP rank because their
  inputs and output gradients are all-gathered.
So the MLP, 2/3 of each block's parameters and FLOPs, is sharded; attention and embeddings are
not. Every sharded placement is a plain ``Shard(d)``, so DCP reshards any TP layout.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)


def gpt_tp_plan() -> dict[str, ParallelStyle]:
    """The GPT's tensor-parallel plan: module-name pattern -> placement style."""
    seq = Shard(1)  # (B, T, C): the sequence dimension
    return {
        # The embedding sum is replicated; block 0 takes this rank's sequence slice of it.
        "transformer.h.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=seq,
                                              use_local_output=True),
        "transformer.h.*.ln_1": SequenceParallel(),
        # Attention runs replicated on the whole sequence (see the module docstring).
        "transformer.h.*.attn": PrepareModuleInputOutput(
            input_layouts=seq, desired_input_layouts=Replicate(), use_local_input=True,
            output_layouts=Replicate(), desired_output_layouts=seq, use_local_output=True),
        "transformer.h.*.ln_2": SequenceParallel(),
        "transformer.h.*.mlp": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate()),
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),  # (4C, C) split on rows: 4C/tp hidden units
        "transformer.h.*.mlp.c_proj": RowwiseParallel(output_layouts=seq),  # reduce-scatter out
        "transformer.ln_f": SequenceParallel(),
        # The head needs the whole sequence: its weight is the (replicated) token embedding.
        "lm_head": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate(),
                                      use_local_output=True),
    }


def _present(model: nn.Module, pattern: str) -> bool:
    from fnmatch import fnmatch

    parts = pattern.split(".")
    return any(len(n.split(".")) == len(parts) and all(fnmatch(a, b) for a, b in zip(n.split("."), parts))
               for n, m in model.named_modules() if m is not None)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle] | None = None) -> nn.Module:
    """Apply ``plan`` (default: the GPT plan) in place. Entries whose modules are absent (a
    pipeline stage without block 0 or the head) are skipped, so one plan serves every stage."""
    assert tp_mesh.ndim == 1, f"tensor parallel takes a 1-D mesh, got {tp_mesh.mesh_dim_names}"
    plan = gpt_tp_plan() if plan is None else plan
    present = {k: v for k, v in plan.items() if _present(model, k)}
    parallelize_module(model, tp_mesh, present)
    return model


__all__ = ["gpt_tp_plan", "apply_tp"]
