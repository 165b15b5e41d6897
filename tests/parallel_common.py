"""What the parallelism tests share: a tiny GPT job, its single-process reference, and the
per-rank training loop (the same steps a worker runs: accumulate, clip, step, zero grads).

Numerics: the comparisons run in fp64. In fp32 a different reduction order (a sum over ranks,
a sharded matmul) changes the last bits of a gradient, and Adam's division by sqrt(v) turns
those bits into ~1e-5 differences in parameters within ten steps (measured 5e-6..5e-5 for plain
DDP vs one process); in fp64 the same noise stays near 1e-13, so equality can be asserted tightly
and honestly.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist

from raytrain_sys.spec import ModelSpec, OptimSpec, ParallelSpec

MODEL = ModelSpec(block_size=16, n_layer=4, n_head=4, n_embd=32)
OPTIM = OptimSpec(lr=1e-2, warmup_steps=2, weight_decay=0.1, grad_clip=0.5)  # clipping is active
# LAMB and LARS take layer-wise trust-ratio steps: each layer moves by about lr (LAMB) or
# lr x trust_coefficient (LARS) of its own norm per step, hence these lrs to train in ten steps.
OPTIMS = {"adamw": OPTIM,
          "lamb": OptimSpec(name="lamb", lr=0.2, warmup_steps=2, weight_decay=0.1, grad_clip=0.5),
          "lars": OptimSpec(name="lars", lr=20.0, warmup_steps=2, weight_decay=1e-4, grad_clip=0.5)}
GLOBAL_BATCH = 8
STEPS = 10
SEED = 1234
RTOL_FP64 = 1e-9  # measured differences are ~1e-13 relative; see the module docstring


def global_batches(steps: int = STEPS, rows: int = GLOBAL_BATCH, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    # Token rows with some structure (a repeated random phrase + noise) so the loss falls.
    phrase = g.integers(0, 256, size=MODEL.block_size + 1)
    noise = g.integers(0, 256, size=(steps, rows, MODEL.block_size + 1))
    keep = g.random((steps, rows, MODEL.block_size + 1)) < 0.7
    return np.where(keep, phrase, noise).astype(np.int64)


def shard_rows(batch: np.ndarray, index: int, size: int) -> np.ndarray:
    return np.array_split(batch, size)[index]


def units(batch: np.ndarray) -> int:
    return batch.shape[0] * (batch.shape[1] - 1)


def build(dtype=torch.float64, model_spec: ModelSpec = MODEL):
    from raytrain_sys.extensions import build_model

    torch.manual_seed(SEED)
    return build_model(model_spec).to(dtype)


@functools.lru_cache(maxsize=8)
def reference(steps: int = STEPS, dtype_name: str = "float64", optim_name: str = "adamw") -> tuple[dict, list[float]]:
    """One process, the whole global batch: the parameters and losses every layout must match."""
    from raytrain_sys.train.optim import build_optimizer, lr_at
    from raytrain_sys.train.tasks import NextToken

    optim = OPTIMS[optim_name]
    model = build(getattr(torch, dtype_name))
    opt = build_optimizer(model, optim)
    task, losses = NextToken(), []
    for step, batch in enumerate(global_batches(steps)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, optim, steps)
        loss = task.loss_sum(model, {"tokens": torch.tensor(batch)})
        (loss / units(batch)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def make_parallel(par: ParallelSpec, dtype=torch.float64, model_spec: ModelSpec = MODEL,
                  optim_name: str = "adamw"):
    from raytrain_sys.parallel.mesh import build_mesh
    from raytrain_sys.parallel.parallelize import parallelize
    from raytrain_sys.train.optim import build_optimizer
    from raytrain_sys.train.tasks import NextToken

    mesh = build_mesh(par, dist.get_world_size())
    pm = parallelize(build(dtype, model_spec), mesh, par, "cpu", task=NextToken())
    opt = build_optimizer(pm.optimizer_module(), OPTIMS[optim_name])
    opt.spec = OPTIMS[optim_name]
    return pm, opt


def train_steps(pm, opt, first_step: int, steps: int, total_steps: int = STEPS,
                micro_batch_size: int = 0) -> list[float]:
    """Run steps [first_step, first_step + steps) of the global batches; the global losses."""
    from raytrain_sys.train.optim import lr_at

    optim = getattr(opt, "spec", OPTIM)
    batches = global_batches(total_steps)
    index, size = pm.data_shard()
    losses = []
    for step in range(first_step, first_step + steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, optim, total_steps)
        rows = torch.tensor(shard_rows(batches[step], index, size))
        loss = pm.forward_backward({"tokens": rows}, units(batches[step]), micro_batch_size)
        pm.clip_grad_norm_(optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # The global loss: each data shard's loss once (its leader's).
        total = torch.tensor(loss if pm.is_data_leader else 0.0, dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def train_and_report(par: ParallelSpec, steps: int = STEPS, dtype_name: str = "float64",
                     micro_batch_size: int = 0, optim_name: str = "adamw") -> dict | None:
    """Rank function: train ``steps`` steps under ``par``; rank 0 returns params and losses."""
    pm, opt = make_parallel(par, getattr(torch, dtype_name), optim_name=optim_name)
    losses = train_steps(pm, opt, 0, steps, steps, micro_batch_size)
    params = pm.full_state_dict()
    return {"params": params, "losses": losses} if dist.get_rank() == 0 else None


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(set(a) ^ set(b)))
    return max(float(((a[k] - b[k]).abs() / b[k].abs().clamp_min(1e-3)).max()) for k in a)


def initial_params() -> dict:
    return {k: v.detach().clone() for k, v in build().state_dict().items()}


def deviation(params: dict, ref: dict) -> float:
    """||params - ref|| / ||ref - init||: how far a lossy run ends from the reference, as a
    fraction of how far the reference itself moved in training."""
    init = initial_params()
    num = sum(float((params[k] - ref[k]).pow(2).sum()) for k in ref)
    den = sum(float((ref[k] - init[k]).pow(2).sum()) for k in ref)
    return (num / den) ** 0.5


def reform_and_train(par: ParallelSpec, steps: int = 2, forget: bool = True) -> list[float] | None:
    """Rank function: a layout trains a step, its process groups are destroyed, and the same
    layout is built again on new groups and trains ``steps`` steps from step 0, as a survivor
    re-forms (TrainWorker.setup_group); ``forget``: DTensor's caches dropped in between, as
    setup_group does. Rank 0 returns the new layout's losses."""
    from raytrain_sys.parallel.dtensor import forget_meshes

    pm, opt = make_parallel(par)
    train_steps(pm, opt, 0, 1)
    for group in pm.mesh.get_all_groups():
        dist.destroy_process_group(group)
    if forget:
        forget_meshes()
    pm, opt = make_parallel(par)
    losses = train_steps(pm, opt, 0, steps)
    return losses if dist.get_rank() == 0 else None
