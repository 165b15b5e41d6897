"""Optimizer and learning-rate schedule. The schedule is a pure function of the step, so a
resumed or rebuilt run needs no scheduler state to continue exactly."""

from __future__ import annotations

import math

import torch

from raytrain_sys.spec import OptimSpec


def build_optimizer(model: torch.nn.Module, spec: OptimSpec) -> torch.optim.Optimizer:
    # Weight decay on matrices only (nanoGPT / GPT-3 practice): not on biases, norms, embeddings'
    # 1-D parameters.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: the same kernel at every world size keeps DDP and single-process results
    # equal to float rounding.
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps,
                             foreach=False)


def lr_at(step: int, spec: OptimSpec, max_steps: int) -> float:
    """Linear warmup from 0 over ``warmup_steps``, then cosine to ``lr * min_lr_ratio``.

    ``step`` is the 0-based index of the step about to run.
    """
    if spec.warmup_steps and step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    span = max(1, max_steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    min_lr = spec.lr * spec.min_lr_ratio
    return min_lr + 0.5 * (spec.lr - min_lr) * (1 + math.cos(math.pi * progress))
