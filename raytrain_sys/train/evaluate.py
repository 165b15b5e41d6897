"""Evaluation on a rank: the task's sums over whole evaluation batches, with no gradient.

The driver deals evaluation batches whole, batch ``b`` to data-parallel index ``b % D``
(``assign``), so each batch is computed by the same rows in one forward pass at any world size
and the driver adds the batches up in their order: the metrics do not depend on the world.
Every rank makes the same number of forward passes (a rank with fewer batches repeats its first
and drops the result): FSDP and TP forwards are collectives.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def assign(num_batches: int, data_index: int, data_size: int) -> list[int]:
    """The evaluation batches of data-parallel index ``data_index``, padded with -1 (a repeat)
    to the count every index runs."""
    mine = list(range(data_index, num_batches, data_size))
    return mine + [-1] * (math.ceil(num_batches / data_size) - len(mine))


@torch.no_grad()
def batch_sums(task, model: torch.nn.Module, batch: dict[str, np.ndarray], device: str) -> dict[str, float]:
    """``loss_sum`` and ``units`` of one batch, plus the task's ``eval_sums`` if it has them."""
    tensors = {k: torch.tensor(v, device=device) for k, v in batch.items()}
    if hasattr(task, "eval_sums"):
        sums = {k: float(v) for k, v in task.eval_sums(model, tensors).items()}
    else:
        sums = {"loss_sum": float(task.loss_sum(model, tensors))}
    sums["units"] = float(task.units(batch))
    return sums


def summarize(task, per_batch: list[dict[str, float]]) -> dict[str, float]:
    """Metrics from the batches' sums, added in batch order: loss = summed loss / units, each
    extra sum / units, and perplexity = exp(loss) for a task that reports it."""
    totals: dict[str, float] = {}
    for sums in per_batch:
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + v
    units = totals.pop("units", 0.0) or float("nan")
    metrics = {"loss": totals.pop("loss_sum") / units}
    metrics.update({k: v / units for k, v in totals.items()})
    if getattr(task, "reports_perplexity", False):
        metrics["perplexity"] = math.exp(min(metrics["loss"], 700.0))
    return metrics
