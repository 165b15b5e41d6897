"""Pipeline parallel for the GPT with ``torch.distributed.pipelining``.

A stage is the GPT with the layers of other stages deleted from ``transformer.h`` (a ModuleDict
keyed by layer index, so every kept parameter keeps its name), the embeddings on the first stage
only and the final norm and head on the last only. Stage k of S holds an equal run of layers;
with ``interleaved_1f1b`` a rank holds stages r, r + pp, r + 2pp, ... (Narayanan et al. 2021).

Tied embeddings: ``wte`` (first stage) and ``lm_head`` (last stage) are one parameter in the
model and live on different ranks here. Each keeps its own copy, and after every backward the two
copies' gradients are summed over a group of exactly those two ranks (Megatron's embedding
group). Both copies then take the same optimizer step from the same state and stay equal, and
the gradient is the single-process one (the sum of the two uses). The norm for clipping counts
the pair once.

The loss is the task's summed cross-entropy times ``data_parallel_size / global_units`` per
micro-batch, and the schedules are built with ``scale_grads=False``: their default divides by the
number of micro-batches, which is not the single-process gradient when shares are uneven.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def stage_layers(n_layer: int, num_stages: int) -> list[list[int]]:
    """Layer indices of each stage: equal runs, the first stages taking one extra if uneven."""
    assert 1 <= num_stages <= n_layer, f"{num_stages} stages for {n_layer} layers"
    base, extra = divmod(n_layer, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def local_stage_ids(pp_rank: int, pp: int, schedule: str, stages_per_rank: int) -> list[int]:
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return [pp_rank + k * pp for k in range(v)]  # loop placement: stage s on rank s % pp


class GPTStage(nn.Module):
    """One pipeline stage: references to the local model's submodules under their own names.

    Why a forward here at all: GPT.forward runs every part unconditionally, and a stage must
    skip the parts it does not hold. If the model skipped missing parts (torchtitan's models
    do), this class would reduce to the model itself.
    """

    def __init__(self, local_model: nn.Module, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        t = local_model.transformer
        parts: dict[str, nn.Module] = {}
        if first:
            parts.update(wte=t.wte, wpe=t.wpe, drop=t.drop)
        parts["h"] = nn.ModuleDict({str(i): t.h[str(i)] for i in layer_ids})
        if last:
            parts["ln_f"] = t.ln_f
        self.transformer = nn.ModuleDict(parts)
        self.lm_head = local_model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        if "wte" in t:  # x: token ids (B, T), as in GPT.forward
            pos = torch.arange(0, x.size(1), dtype=torch.long, device=x.device)
            x = t.drop(t.wte(x) + t.wpe(pos))
        for block in t.h.values():
            x = block(x)
        if "ln_f" in t:
            x = t.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


@dataclass
class PipelineSplit:
    stage_ids: list[int]  # global stage indices on this rank
    num_stages: int
    modules: list[GPTStage]  # one per local stage, sharing the local model's submodules
    tied: bool  # wte and lm_head were one parameter before the split
    has_first: bool
    has_last: bool


def split_gpt(model: nn.Module, pp_rank: int, pp: int, schedule: str, stages_per_rank: int) -> PipelineSplit:
    """Trim ``model`` in place to this rank's layers and return its stage modules."""
    stage_ids = local_stage_ids(pp_rank, pp, schedule, stages_per_rank)
    num_stages = pp * len(stage_ids)
    runs = stage_layers(model.config.n_layer, num_stages)
    keep = {i for s in stage_ids for i in runs[s]}
    tied = model.lm_head.weight is model.transformer.wte.weight
    t = model.transformer
    for name in list(t.h.keys()):
        if int(name) not in keep:
            del t.h[name]
    has_first, has_last = 0 in stage_ids, num_stages - 1 in stage_ids
    if not has_first:
        for name in ("wte", "wpe", "drop"):
            del t[name]
    if not has_last:
        del t["ln_f"]
        model.lm_head = None
    modules = [GPTStage(model, runs[s], s == 0, s == num_stages - 1) for s in stage_ids]
    return PipelineSplit(stage_ids, num_stages, modules, tied, has_first, has_last)


class SummedLoss:
    """The last stage's loss: the task's summed CE, times ``scale`` (data-parallel size over the
    global batch's units), so the summed micro-batch gradients are the global-mean gradient."""

    def __init__(self):
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # as train/tasks.py: low-precision logits' loss in fp32
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
        return ce * self.scale


def build_schedule(stages: list[PipelineStage], schedule: str, microbatches: int, loss_fn):
    cls = SCHEDULES[schedule]
    if schedule == "interleaved_1f1b":
        return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    assert len(stages) == 1, f"{schedule} runs one stage per rank"
    return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)


def tied_pair_group(mesh) -> dist.ProcessGroup | None:
    """The two-rank group (first stage, last stage) that shares this rank's (dp, fsdp, tp)
    coordinate. Every rank creates every pair group (new_group is collective); ranks of middle
    stages get None."""
    grid = mesh.mesh  # (pp, dp, fsdp, tp) global ranks
    me = dist.get_rank()
    mine = None
    flat = grid.reshape(grid.size(0), -1)
    for col in range(flat.size(1)):
        pair = [int(flat[0, col]), int(flat[-1, col])]
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine


@torch.no_grad()
def sync_tied_grads(split: PipelineSplit, group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of the two copies of the tied embedding (see the module docstring)."""
    if not split.tied or group is None:
        return
    if split.has_first:
        weight = split.modules[0].transformer.wte.weight
    else:
        weight = split.modules[-1].lm_head.weight
    grad = weight.grad
    local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad
    dist.all_reduce(local, group=group)


def tied_duplicate(split: PipelineSplit) -> nn.Parameter | None:
    """The copy to leave out of a global norm (the head's copy on the last stage)."""
    if split.tied and split.has_last and not split.has_first:
        return split.modules[-1].lm_head.weight
    return None


# ----------------------------------------------------------------------------- bubble

class _Sleep(torch.autograd.Function):
    """Stands for compute of a fixed length that uses no CPU, so the pipeline's idle time can
    be measured on a 2-core machine without the stages competing for cores. Each sleep's actual
    length goes to ``spent``: on a loaded machine a sleep overruns (its wake-up waits for a
    core), and that is compute time of the stage, not idle time of the pipeline."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s, spent):
        t0 = time.perf_counter()
        time.sleep(forward_s)
        spent.append(time.perf_counter() - t0)
        ctx.backward_s, ctx.spent = backward_s, spent
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        t0 = time.perf_counter()
        time.sleep(ctx.backward_s)
        ctx.spent.append(time.perf_counter() - t0)
        return grad, None, None, None


class _SleepStage(nn.Module):
    def __init__(self, width: int, forward_s: float, backward_s: float, spent: list[float]):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.forward_s, self.backward_s, self.spent = forward_s, backward_s, spent

    def forward(self, x):
        return _Sleep.apply(self.lin(x), self.forward_s, self.backward_s, self.spent)


@dataclass
class BubbleReport:
    schedule: str
    pp: int
    microbatches: int
    stages_per_rank: int
    step_s: float  # wall time of one pipeline step (fastest of ``steps``)
    busy_s: float  # compute this rank did in it
    measured: float  # 1 - busy / step: the rank's idle fraction
    theory: float  # (p - 1) / (v m + p - 1)
    step_times_s: list[float] = field(default_factory=list)


def measure_bubble(schedule: str, microbatches: int, group: dist.ProcessGroup | None = None,
                   stages_per_rank: int = 1, forward_s: float = 0.02, backward_s: float = 0.04,
                   steps: int = 3) -> BubbleReport:
    """Run a pipeline of fixed-length stages over ``group`` (default: the world) and measure
    each rank's idle fraction of a step. With every stage taking the same time, GPipe and 1F1B
    idle (p - 1)/(m + p - 1) of the step (Huang et al. 2019; Narayanan et al. 2021); interleaving
    v stages per rank divides the fill/drain time by v."""
    group = group or dist.group.WORLD
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    ids = local_stage_ids(rank, pp, schedule, v)
    width, rows_per_mb = 8, 2
    spent: list[float] = []  # every stage's sleeps on this rank, as they ran
    stages = [PipelineStage(_SleepStage(width, forward_s / v, backward_s / v, spent), s, pp * v,
                            torch.device("cpu"), group=group) for s in ids]
    sched = build_schedule(stages, schedule, microbatches, lambda out, tgt: (out - tgt).pow(2).sum())
    x = torch.randn(microbatches * rows_per_mb, width)
    first, last = 0 in ids, pp * v - 1 in ids

    def step():
        args = (x,) if first else ()
        kwargs = {"target": torch.zeros_like(x), "losses": []} if last else {}
        sched.step(*args, **kwargs)

    step()  # shape inference and first-call costs stay out of the measurement
    times, busy = [], []
    for _ in range(steps):
        dist.barrier(group)
        spent.clear()
        t0 = time.perf_counter()
        step()
        dist.barrier(group)  # the step ends when the last rank is done
        times.append(time.perf_counter() - t0)
        busy.append(sum(spent))
    # The fastest step: noise from other processes only ever adds time, it never removes any.
    # Its busy time is the stages' sleeps as they ran (each at least its nominal length).
    fastest = min(range(steps), key=times.__getitem__)
    step_s, busy_s = times[fastest], busy[fastest]
    return BubbleReport(schedule, pp, microbatches, v, step_s, busy_s, 1 - busy_s / step_s,
                        (pp - 1) / (v * microbatches + pp - 1), times)


__all__ = ["SCHEDULES", "stage_layers", "local_stage_ids", "GPTStage", "PipelineSplit", "split_gpt",
           "SummedLoss", "build_schedule", "tied_pair_group", "sync_tied_grads", "tied_duplicate",
           "measure_bubble", "BubbleReport"]
