"""Optimizers and the learning-rate schedule. The schedule is a pure function of the step, so a
resumed or rebuilt run needs no scheduler state to continue exactly.

AdamW is torch's. LAMB and LARS, for large global batches, are written here: their layer-wise
trust ratio needs each parameter's *whole* norm, and with FSDP or TP a parameter is a DTensor
whose shards live on several ranks; ``_norm`` reduces over them, so every layout takes the step
one process would.
"""

from __future__ import annotations

import math

import torch

from raytrain_sys.parallel.dtensor import is_dtensor
from raytrain_sys.spec import OptimSpec

# The per-parameter state each optimizer keeps (what a rebuilt layout must receive).
STATE_KEYS = {"adamw": ("step", "exp_avg", "exp_avg_sq"), "lamb": ("step", "exp_avg", "exp_avg_sq"),
              "lars": ("step", "momentum_buffer")}


def build_optimizer(model: torch.nn.Module, spec: OptimSpec) -> torch.optim.Optimizer:
    # Weight decay on matrices only (nanoGPT / GPT-3 practice): not on biases and norms' 1-D
    # parameters. LAMB and LARS also leave those out of the trust ratio (You et al.).
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay, "adapt": True},
              {"params": no_decay, "weight_decay": 0.0, "adapt": False}]
    if spec.name == "lamb":
        opt = Lamb(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps)
    elif spec.name == "lars":
        opt = Lars(groups, lr=spec.lr, momentum=spec.momentum, trust_coefficient=spec.trust_coefficient,
                   eps=spec.eps)
    else:
        for g in groups:
            g.pop("adapt")
        # foreach=False: the same kernel at every world size keeps DDP and single-process
        # results equal to float rounding.
        opt = torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps,
                                foreach=False)
    opt.state_keys = STATE_KEYS[spec.name]
    return opt


def peak_lr(spec: OptimSpec, global_batch_size: int = 0) -> float:
    """``optim.lr`` scaled from ``optim.lr_base_batch_size`` to the job's global batch:
    linear (Goyal et al. 2017, with warmup) or square root (Krizhevsky 2014; usual for Adam-type
    optimizers). ``global_batch_size`` 0, or scaling "none": ``optim.lr`` itself."""
    if spec.lr_scaling == "none" or not global_batch_size:
        return spec.lr
    ratio = global_batch_size / spec.lr_base_batch_size
    return spec.lr * (ratio if spec.lr_scaling == "linear" else math.sqrt(ratio))


def lr_at(step: int, spec: OptimSpec, max_steps: int, global_batch_size: int = 0) -> float:
    """Linear warmup from 0 over ``warmup_steps``, then cosine to ``min_lr_ratio`` of the peak.

    ``step`` is the 0-based index of the step about to run; the peak is ``peak_lr``.
    """
    peak = peak_lr(spec, global_batch_size)
    if spec.warmup_steps and step < spec.warmup_steps:
        return peak * (step + 1) / spec.warmup_steps
    span = max(1, max_steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    min_lr = peak * spec.min_lr_ratio
    return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * progress))


def _norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of the whole tensor, as a plain scalar on every rank holding a part of it."""
    n = torch.linalg.vector_norm(t)
    return n.full_tensor() if is_dtensor(n) else n


def _trust_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    # 1 where either norm is 0: a zero-initialized weight or a zero update must still move.
    ok = (numerator > 0) & (denominator > 0)
    return torch.where(ok, numerator / denominator.clamp_min(1e-30), torch.ones_like(numerator))


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"): Adam's update with
    decoupled weight decay, scaled per parameter by ||w|| / ||update||."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-6):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, adapt=True))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                ratio = _trust_ratio(_norm(p), _norm(update)) if group["adapt"] else 1.0
                p.sub_(update * (group["lr"] * ratio))


class Lars(torch.optim.Optimizer):
    """LARS (You et al. 2017, "Large Batch Training of Convolutional Networks"): SGD with
    momentum, the step of each parameter scaled by trust_coefficient x ||w|| / ||g + wd w||."""

    def __init__(self, params, lr: float, momentum: float = 0.9, trust_coefficient: float = 0.001,
                 eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, momentum=momentum, trust_coefficient=trust_coefficient,
                                      eps=eps, weight_decay=0.0, adapt=True))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] += 1
                g = p.grad
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                if group["adapt"]:
                    ratio = group["trust_coefficient"] * _trust_ratio(_norm(p), _norm(g) + group["eps"])
                else:
                    ratio = 1.0
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(g * (group["lr"] * ratio))
                p.sub_(buf)
